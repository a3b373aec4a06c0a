//! The finished operations a [`StreamProfiler`](super::StreamProfiler) keeps: the newest ones,
//! up to a bound, so a profiler left on in a program that runs for days holds a window of its
//! latest work rather than all of it.

use std::collections::VecDeque;

use super::report::ProfiledOperation;

/// How many finished operations a profiler keeps unless told otherwise
/// ([`StreamProfiler::with_limit`](super::StreamProfiler::with_limit)): about 10-20 MiB of
/// records, a few seconds of a busy training step's launches.
pub const DEFAULT_KEPT_OPERATIONS: usize = 1 << 16;

/// The newest finished operations, at most `limit`, and how many older ones were let go.
#[derive(Debug)]
pub(super) struct KeptOperations {
    operations: VecDeque<ProfiledOperation>,
    limit: usize,
    evicted: u64,
}

impl KeptOperations {
    /// Keeps at most `limit` operations (at least one).
    pub(super) fn new(limit: usize) -> Self {
        Self {
            operations: VecDeque::new(),
            limit: limit.max(1),
            evicted: 0,
        }
    }

    /// Adds newly finished operations, letting the oldest go past the limit.
    pub(super) fn extend(&mut self, finished: impl IntoIterator<Item = ProfiledOperation>) {
        for operation in finished {
            if self.operations.len() == self.limit {
                self.operations.pop_front();
                self.evicted += 1;
            }
            self.operations.push_back(operation);
        }
    }

    /// The kept operations, by GPU start (then stream).
    pub(super) fn sorted(&mut self) -> Vec<ProfiledOperation> {
        let operations = self.operations.make_contiguous();
        operations.sort_by_key(|op| (op.start_ns, op.stream));
        operations.to_vec()
    }

    /// Operations let go because the limit was reached, since the profiler was made.
    pub(super) fn evicted(&self) -> u64 {
        self.evicted
    }

    /// How many are kept now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.operations.len()
    }

    /// Forgets every kept operation (the eviction count stays).
    pub(super) fn clear(&mut self) {
        self.operations.clear();
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;
    use crate::priority::StreamPriority;
    use crate::stream::OperationKind;

    fn operation(i: u64) -> ProfiledOperation {
        ProfiledOperation {
            stream: i % 3,
            priority: StreamPriority::Normal,
            name: format!("op{i}"),
            kind: OperationKind::KernelLaunch,
            bytes: 0,
            start_ns: i * 10,
            duration_ns: 5,
        }
    }

    #[rstest]
    #[case::one(1)]
    #[case::small(7)]
    #[case::default(DEFAULT_KEPT_OPERATIONS)]
    fn a_long_run_keeps_the_newest_operations_within_the_limit(#[case] limit: usize) {
        let mut kept = KeptOperations::new(limit);
        let total = 200_000u64;
        for batch in 0..total / 100 {
            kept.extend((batch * 100..batch * 100 + 100).map(operation));
            assert!(kept.len() <= limit);
        }
        let limit = limit as u64;
        assert_eq!(kept.evicted(), total - limit);
        let sorted = kept.sorted();
        assert_eq!(sorted.len() as u64, limit);
        // The newest ones, in start order.
        assert_eq!(sorted.first().unwrap().name, format!("op{}", total - limit));
        assert_eq!(sorted.last().unwrap().name, format!("op{}", total - 1));
        assert!(sorted.windows(2).all(|w| w[0].start_ns <= w[1].start_ns));
        kept.clear();
        assert_eq!((kept.len(), kept.evicted()), (0, total - limit));
    }

    #[test]
    fn a_limit_of_zero_keeps_one() {
        let mut kept = KeptOperations::new(0);
        kept.extend((0..3).map(operation));
        assert_eq!((kept.len(), kept.evicted()), (1, 2));
    }
}
