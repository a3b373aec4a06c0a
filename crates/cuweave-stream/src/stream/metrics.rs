//! [`StreamMetrics`]: what a [`PriorityStream`](super::PriorityStream) has been asked to do, and
//! the GPU time it took where timing was asked for.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// A snapshot of one stream's counters.
///
/// `operations` counts everything queued through the stream's methods (copies, memsets,
/// prefetches, kernel launches, host callbacks, tracked custom work). `gpu_time_ns` sums the GPU
/// time of the operations queued while timing was on ([`PriorityStream::set_timing`](super::PriorityStream::set_timing)),
/// measured between timing events recorded before and after each one, for those the GPU has
/// finished; `timed_operations` counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamMetrics {
    /// Operations queued through the stream.
    pub operations: u64,
    /// Copies (host to device, device to host, device to device).
    pub copies: u64,
    /// Memsets / fills.
    pub memsets: u64,
    /// Unified-memory prefetches.
    pub prefetches: u64,
    /// Kernel launches.
    pub kernel_launches: u64,
    /// Host callbacks queued.
    pub callbacks: u64,
    /// CUDA graph launches ([`PriorityStream::launch_graph`](super::PriorityStream::launch_graph)).
    pub graph_launches: u64,
    /// Host callbacks that panicked (caught).
    pub callback_panics: u64,
    /// Bytes moved by copies and prefetches (fills count the bytes written).
    pub bytes: u64,
    /// Operations whose GPU time has been measured.
    pub timed_operations: u64,
    /// Sum of the measured GPU time, in nanoseconds.
    pub gpu_time_ns: u64,
}

impl std::fmt::Display for StreamMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ops ({} copies, {} memsets, {} prefetches, {} launches, {} graph launches, {} callbacks, {} callback panics), {} bytes, {} timed ops in {:.3} ms GPU time",
            self.operations,
            self.copies,
            self.memsets,
            self.prefetches,
            self.kernel_launches,
            self.graph_launches,
            self.callbacks,
            self.callback_panics,
            self.bytes,
            self.timed_operations,
            self.gpu_time_ns as f64 / 1e6
        )
    }
}

/// The kind of an operation queued on a stream, for metrics and profiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OperationKind {
    /// A copy.
    Copy,
    /// A memset or fill.
    Memset,
    /// A unified-memory prefetch.
    Prefetch,
    /// A kernel launch.
    KernelLaunch,
    /// A host callback.
    Callback,
    /// A CUDA graph launch (one operation, however many nodes the graph has).
    GraphLaunch,
    /// Anything else queued through [`PriorityStream::enqueue`](super::PriorityStream::enqueue).
    Other,
}

impl OperationKind {
    /// A short lowercase name, used as the Chrome trace category.
    pub fn name(self) -> &'static str {
        match self {
            Self::Copy => "copy",
            Self::Memset => "memset",
            Self::Prefetch => "prefetch",
            Self::KernelLaunch => "kernel",
            Self::Callback => "callback",
            Self::GraphLaunch => "graph",
            Self::Other => "other",
        }
    }
}

/// The live counters behind [`StreamMetrics`]; relaxed atomics, read as a snapshot (callback
/// panics are counted by the callback worker).
#[derive(Debug, Default)]
pub(crate) struct MetricsCounters {
    operations: AtomicU64,
    copies: AtomicU64,
    memsets: AtomicU64,
    prefetches: AtomicU64,
    kernel_launches: AtomicU64,
    callbacks: AtomicU64,
    graph_launches: AtomicU64,
    bytes: AtomicU64,
    timed_operations: AtomicU64,
    gpu_time_ns: AtomicU64,
}

impl MetricsCounters {
    pub(crate) fn count(&self, kind: OperationKind, bytes: u64) {
        self.operations.fetch_add(1, Ordering::Relaxed);
        let counter = match kind {
            OperationKind::Copy => &self.copies,
            OperationKind::Memset => &self.memsets,
            OperationKind::Prefetch => &self.prefetches,
            OperationKind::KernelLaunch => &self.kernel_launches,
            OperationKind::Callback => &self.callbacks,
            OperationKind::GraphLaunch => &self.graph_launches,
            OperationKind::Other => {
                self.bytes.fetch_add(bytes, Ordering::Relaxed);
                return;
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn add_gpu_time(&self, operations: u64, ns: u64) {
        self.timed_operations
            .fetch_add(operations, Ordering::Relaxed);
        self.gpu_time_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> StreamMetrics {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        StreamMetrics {
            operations: load(&self.operations),
            copies: load(&self.copies),
            memsets: load(&self.memsets),
            prefetches: load(&self.prefetches),
            kernel_launches: load(&self.kernel_launches),
            callbacks: load(&self.callbacks),
            graph_launches: load(&self.graph_launches),
            callback_panics: 0,
            bytes: load(&self.bytes),
            timed_operations: load(&self.timed_operations),
            gpu_time_ns: load(&self.gpu_time_ns),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sort_operations_by_kind() {
        let counters = MetricsCounters::default();
        counters.count(OperationKind::Copy, 100);
        counters.count(OperationKind::Copy, 28);
        counters.count(OperationKind::KernelLaunch, 0);
        counters.count(OperationKind::Memset, 64);
        counters.count(OperationKind::Other, 1);
        counters.add_gpu_time(2, 1_500);
        let metrics = counters.snapshot();
        assert_eq!(metrics.operations, 5);
        assert_eq!(metrics.copies, 2);
        assert_eq!(metrics.kernel_launches, 1);
        assert_eq!(metrics.memsets, 1);
        assert_eq!(metrics.bytes, 193);
        assert_eq!((metrics.timed_operations, metrics.gpu_time_ns), (2, 1_500));
        assert!(metrics.to_string().starts_with("5 ops (2 copies"));
    }
}
