//! [`CoordinatorMetrics`]: what an operation coordinator has done, in counts and time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use super::OperationType;

/// Totals of an [`OperationCoordinator`](super::OperationCoordinator).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CoordinatorMetrics {
    /// Operations registered.
    pub registered: u64,
    /// Operations begun.
    pub begun: u64,
    /// Operations withdrawn before they began (`cancel_operation`).
    pub cancelled: u64,
    /// Operations the GPU completed.
    pub completed: u64,
    /// Operations whose completion could not be observed (driver error, dead context).
    pub failed: u64,
    /// Completion callbacks that panicked (each contained and logged; the operation's other
    /// callbacks still ran and it retired as usual).
    pub callback_panics: u64,
    /// Calls of `detect_deadlocks` that found at least one cycle.
    pub deadlock_detections: u64,
    /// Cycles found over all those calls.
    pub cycles_found: u64,
    /// `cuStreamWaitEvent`s queued for dependencies on other streams.
    pub cross_stream_waits: u64,
    /// Dependencies on the same stream, which needed no wait.
    pub same_stream_waits_skipped: u64,
    /// Host time spent inside the coordinator's methods.
    pub coordination_time: Duration,
    /// GPU time (begin to complete, from timing events) summed per operation type, for
    /// operations begun while timing was on.
    pub gpu_time_by_type: HashMap<OperationType, Duration>,
    /// Completed operations with a GPU time, per type.
    pub timed_by_type: HashMap<OperationType, u64>,
}

#[derive(Debug, Default)]
pub(crate) struct MetricsCell {
    pub(crate) registered: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) begun: AtomicU64,
    pub(crate) completed: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) callback_panics: AtomicU64,
    pub(crate) deadlock_detections: AtomicU64,
    pub(crate) cycles_found: AtomicU64,
    pub(crate) cross_stream_waits: AtomicU64,
    pub(crate) same_stream_waits_skipped: AtomicU64,
    pub(crate) coordination_ns: AtomicU64,
    gpu_time: Mutex<HashMap<OperationType, (Duration, u64)>>,
}

impl MetricsCell {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn add_time(&self, spent: Duration) {
        let ns = u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX);
        self.coordination_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub(crate) fn add_gpu_time(&self, operation_type: OperationType, time: Duration) {
        let mut gpu_time = self.gpu_time.lock();
        let entry = gpu_time.entry(operation_type).or_default();
        entry.0 += time;
        entry.1 += 1;
    }

    pub(crate) fn snapshot(&self) -> CoordinatorMetrics {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let gpu_time = self.gpu_time.lock();
        CoordinatorMetrics {
            registered: load(&self.registered),
            cancelled: load(&self.cancelled),
            begun: load(&self.begun),
            completed: load(&self.completed),
            failed: load(&self.failed),
            callback_panics: load(&self.callback_panics),
            deadlock_detections: load(&self.deadlock_detections),
            cycles_found: load(&self.cycles_found),
            cross_stream_waits: load(&self.cross_stream_waits),
            same_stream_waits_skipped: load(&self.same_stream_waits_skipped),
            coordination_time: Duration::from_nanos(load(&self.coordination_ns)),
            gpu_time_by_type: gpu_time
                .iter()
                .map(|(kind, (time, _))| (*kind, *time))
                .collect(),
            timed_by_type: gpu_time.iter().map(|(kind, (_, n))| (*kind, *n)).collect(),
        }
    }
}
