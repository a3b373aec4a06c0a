//! [`AllocationStrategy`]: how [`StreamPool::get_stream`](super::StreamPool::get_stream) picks a
//! stream, and the pure choice rules behind each strategy.

use serde::{Deserialize, Serialize};

/// How a [`StreamPool`](super::StreamPool) picks the stream `get_stream` hands out.
///
/// | strategy | rule |
/// |---|---|
/// | `RoundRobin` | the next normal-priority stream after an atomic counter (PyTorch's rule): O(1), no driver call |
/// | `LoadBalanced` | the normal-priority stream with the fewest operations still queued on the GPU, read from the events recorded behind each operation; ties go to the round-robin order |
/// | `Priority` | the first idle stream, looking at high, then normal, then low priority; if none is idle, the least loaded high-priority stream (normal if there are none) |
/// | `Workload` | `get_stream_for_workload(WorkloadType::Mixed)` |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum AllocationStrategy {
    /// Cycle through the normal-priority streams.
    #[default]
    RoundRobin,
    /// The normal-priority stream with the least work still queued on the GPU.
    LoadBalanced,
    /// The most urgent idle stream, else the least loaded high-priority one.
    Priority,
    /// By workload: what `get_stream_for_workload(Mixed)` gives.
    Workload,
}

impl AllocationStrategy {
    pub(crate) fn to_u8(self) -> u8 {
        match self {
            Self::RoundRobin => 0,
            Self::LoadBalanced => 1,
            Self::Priority => 2,
            Self::Workload => 3,
        }
    }

    pub(crate) fn from_u8(value: u8) -> Self {
        match value {
            1 => Self::LoadBalanced,
            2 => Self::Priority,
            3 => Self::Workload,
            _ => Self::RoundRobin,
        }
    }
}

/// The index (into `loads`) of the least loaded entry; ties go to the first at or after `start`
/// in cyclic order, so equal streams are still used in turn. `None` for an empty slice.
pub(crate) fn least_loaded(loads: &[u64], start: usize) -> Option<usize> {
    let n = loads.len();
    (0..n).map(|k| (start + k) % n).min_by_key(|&i| loads[i])
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(&[3, 1, 2], 0, Some(1))]
    #[case(&[0, 0, 0], 2, Some(2))]
    #[case(&[0, 5, 0], 1, Some(2))]
    #[case(&[4], 9, Some(0))]
    #[case(&[], 0, None)]
    fn least_loaded_prefers_less_queued_work(
        #[case] loads: &[u64],
        #[case] start: usize,
        #[case] expected: Option<usize>,
    ) {
        assert_eq!(least_loaded(loads, start), expected);
    }

    #[test]
    fn strategies_round_trip_through_their_tag() {
        for strategy in [
            AllocationStrategy::RoundRobin,
            AllocationStrategy::LoadBalanced,
            AllocationStrategy::Priority,
            AllocationStrategy::Workload,
        ] {
            assert_eq!(AllocationStrategy::from_u8(strategy.to_u8()), strategy);
        }
    }
}
