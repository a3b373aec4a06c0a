//! Streams for cuweave: priority streams, stream pools, multi-stream coordination, a
//! stream-ordered allocator and a GPU-timed profiler.
//!
//! Work in progress (issue 6); see `docs/streams.md`.
#![forbid(unsafe_code)]

pub mod allocator;
pub mod coordinator;
pub mod error;
pub mod pool;
pub mod priority;
pub mod profiler;
pub mod stream;

pub use allocator::{
    AllocatorStats, SizeClassStats, StreamAllocation, StreamOrderedAllocator,
    StreamOrderedAllocatorConfig,
};
pub use coordinator::{BarrierInfo, CoordinatorStats, DependencyGraph, MultiStreamCoordinator};
pub use error::{Result, StreamError};
pub use pool::{
    AllocationStrategy, ConfigurationChange, StreamPool, StreamPoolConfig, WorkloadLayout,
    WorkloadType, compute_stream_share, wait_for_any_ready,
};
pub use priority::StreamPriority;
pub use profiler::{
    CombinedReport, NamedTotal, ProfileReport, ProfiledOperation, StreamProfiler, StreamReport,
};
pub use stream::{CallbackFailure, OperationKind, PriorityStream, StreamMetrics};
