//! [`WorkloadType`]: kinds of work, each with a priority and a set of the pool's streams, the
//! timing records that feed [`StreamPool::optimize_configuration`](super::StreamPool::optimize_configuration),
//! and the rule it applies.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::priority::StreamPriority;

/// What kind of work a stream is wanted for.
///
/// | workload | priority | streams |
/// |---|---|---|
/// | `Compute` | normal | the first `compute_streams` normal-priority streams |
/// | `Mixed` | normal | the other normal-priority streams (the compute ones if there are no others) |
/// | `Memory` | low | the low-priority streams, else the non-compute normal ones; never a compute stream |
/// | `Coordination` | high | the high-priority streams, else the normal ones |
///
/// Memory work (copies, prefetches) is kept off the compute streams so a long copy never sits
/// in front of a kernel in one queue; coordination work (small kernels, signals, barriers) is
/// latency-bound and gets the most urgent streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WorkloadType {
    /// Kernels.
    Compute,
    /// Copies and prefetches.
    Memory,
    /// Kernels and copies together.
    Mixed,
    /// Small latency-bound work: signals, barriers, bookkeeping kernels.
    Coordination,
}

impl WorkloadType {
    /// Every workload.
    pub const ALL: [WorkloadType; 4] =
        [Self::Compute, Self::Memory, Self::Mixed, Self::Coordination];

    /// The priority the workload's streams have.
    pub fn priority(self) -> StreamPriority {
        match self {
            Self::Compute | Self::Mixed => StreamPriority::Normal,
            Self::Memory => StreamPriority::Low,
            Self::Coordination => StreamPriority::High,
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            Self::Compute => 0,
            Self::Memory => 1,
            Self::Mixed => 2,
            Self::Coordination => 3,
        }
    }
}

impl std::fmt::Display for WorkloadType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Compute => "compute",
            Self::Memory => "memory",
            Self::Mixed => "mixed",
            Self::Coordination => "coordination",
        })
    }
}

/// Completed-workload timings of one workload type.
#[derive(Debug, Default)]
pub(crate) struct WorkloadRecord {
    count: AtomicU64,
    total_ns: AtomicU64,
}

impl WorkloadRecord {
    pub(crate) fn record(&self, duration: Duration) {
        let ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        self.count.fetch_add(1, Ordering::Relaxed);
        // Saturating: a wrapped total would make a huge record read as a short one.
        let _ = self
            .total_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |total| {
                Some(total.saturating_add(ns))
            });
    }

    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    pub(crate) fn total(&self) -> Duration {
        Duration::from_nanos(self.total_ns.load(Ordering::Relaxed))
    }

    pub(crate) fn average(&self) -> Option<Duration> {
        let count = self.count();
        (count > 0).then(|| self.total() / u32::try_from(count).unwrap_or(u32::MAX))
    }
}

/// Where each workload's streams are in the pool: index ranges into the priority sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadLayout {
    /// High-priority streams in the pool.
    pub high: usize,
    /// Normal-priority streams in the pool.
    pub normal: usize,
    /// Low-priority streams in the pool.
    pub low: usize,
    /// How many of the normal streams serve `Compute` (the rest serve `Mixed`).
    pub compute_streams: usize,
}

/// Which priority set, and which range of it, serves a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamSet {
    pub(crate) priority: StreamPriority,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

impl WorkloadLayout {
    /// The streams serving `workload`, or `None` when the layout has none for it.
    pub(crate) fn set_for(&self, workload: WorkloadType) -> Option<StreamSet> {
        let normal = |start: usize, len: usize| {
            (len > 0).then_some(StreamSet {
                priority: StreamPriority::Normal,
                start,
                len,
            })
        };
        let compute = normal(0, self.compute_streams.min(self.normal));
        let mixed = normal(
            self.compute_streams,
            self.normal.saturating_sub(self.compute_streams),
        );
        match workload {
            WorkloadType::Compute => compute.or(mixed),
            WorkloadType::Mixed => mixed.or(compute),
            WorkloadType::Memory => (self.low > 0)
                .then_some(StreamSet {
                    priority: StreamPriority::Low,
                    start: 0,
                    len: self.low,
                })
                .or(mixed),
            WorkloadType::Coordination => (self.high > 0)
                .then_some(StreamSet {
                    priority: StreamPriority::High,
                    start: 0,
                    len: self.high,
                })
                .or(normal(0, self.normal)),
        }
    }
}

/// The rule of `optimize_configuration`: how many of `normal` streams `Compute` should get,
/// given the total recorded time of compute and of mixed work.
///
/// Each side gets a share of the normal streams proportional to its total recorded time
/// (count × average), rounded to the nearest stream, and at least one stream each while it has
/// any recorded time. With fewer than two normal streams, or no recorded time on either side,
/// the split stays `current`.
pub fn compute_stream_share(
    normal: usize,
    compute: Duration,
    mixed: Duration,
    current: usize,
) -> usize {
    if normal < 2 || (compute.is_zero() && mixed.is_zero()) {
        return current.min(normal);
    }
    let (c, m) = (compute.as_secs_f64(), mixed.as_secs_f64());
    let share = (normal as f64 * c / (c + m)).round() as usize;
    let low = usize::from(!compute.is_zero());
    let high = normal - usize::from(!mixed.is_zero());
    share.clamp(low, high)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[rstest]
    #[case(8, ms(300), ms(100), 4, 6)]
    #[case(8, ms(100), ms(300), 4, 2)]
    #[case(8, ms(100), ms(100), 1, 4)]
    #[case(8, ms(1000), ms(1), 4, 7)]
    #[case(8, ms(1), ms(1000), 4, 1)]
    #[case(8, ms(5), Duration::ZERO, 4, 8)]
    #[case(8, Duration::ZERO, ms(5), 4, 0)]
    #[case(8, Duration::ZERO, Duration::ZERO, 3, 3)]
    #[case(1, ms(5), ms(5), 1, 1)]
    fn compute_share_follows_recorded_time(
        #[case] normal: usize,
        #[case] compute: Duration,
        #[case] mixed: Duration,
        #[case] current: usize,
        #[case] expected: usize,
    ) {
        assert_eq!(
            compute_stream_share(normal, compute, mixed, current),
            expected
        );
    }

    const LAYOUT: WorkloadLayout = WorkloadLayout {
        high: 2,
        normal: 4,
        low: 2,
        compute_streams: 2,
    };

    #[test]
    fn a_huge_record_saturates_the_total_instead_of_wrapping() {
        let record = WorkloadRecord::default();
        record.record(Duration::MAX);
        record.record(Duration::from_millis(10));
        assert_eq!(record.count(), 2);
        assert_eq!(record.total(), Duration::from_nanos(u64::MAX));
        assert!(record.average().unwrap() > Duration::from_secs(1 << 30));
    }

    #[test]
    fn memory_work_never_lands_on_a_compute_stream() {
        let compute = LAYOUT.set_for(WorkloadType::Compute).unwrap();
        assert_eq!(
            (compute.priority, compute.start, compute.len),
            (StreamPriority::Normal, 0, 2)
        );
        let memory = LAYOUT.set_for(WorkloadType::Memory).unwrap();
        assert_eq!(memory.priority, StreamPriority::Low);
        let no_low = WorkloadLayout { low: 0, ..LAYOUT };
        let memory = no_low.set_for(WorkloadType::Memory).unwrap();
        assert_eq!(
            (memory.priority, memory.start, memory.len),
            (StreamPriority::Normal, 2, 2)
        );
        let all_compute = WorkloadLayout {
            low: 0,
            compute_streams: 4,
            ..LAYOUT
        };
        assert_eq!(all_compute.set_for(WorkloadType::Memory), None);
    }

    #[test]
    fn workloads_fall_back_when_their_set_is_empty() {
        let only_normal = WorkloadLayout {
            high: 0,
            normal: 3,
            low: 0,
            compute_streams: 3,
        };
        let mixed = only_normal.set_for(WorkloadType::Mixed).unwrap();
        assert_eq!((mixed.start, mixed.len), (0, 3));
        let coordination = only_normal.set_for(WorkloadType::Coordination).unwrap();
        assert_eq!(
            (coordination.priority, coordination.len),
            (StreamPriority::Normal, 3)
        );
        assert_eq!(
            LAYOUT.set_for(WorkloadType::Coordination).unwrap().priority,
            StreamPriority::High
        );
    }

    #[test]
    fn records_average_their_durations() {
        let record = WorkloadRecord::default();
        assert_eq!(record.average(), None);
        record.record(ms(10));
        record.record(ms(20));
        assert_eq!(record.count(), 2);
        assert_eq!(record.average(), Some(ms(15)));
        assert_eq!(record.total(), ms(30));
    }

    #[test]
    fn workloads_map_to_priorities() {
        assert_eq!(WorkloadType::Coordination.priority(), StreamPriority::High);
        assert_eq!(WorkloadType::Memory.priority(), StreamPriority::Low);
        assert_eq!(WorkloadType::Compute.priority(), StreamPriority::Normal);
        for (i, w) in WorkloadType::ALL.into_iter().enumerate() {
            assert_eq!(w.index(), i);
        }
    }
}
