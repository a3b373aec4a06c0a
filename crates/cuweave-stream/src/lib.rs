//! Streams for cuweave: priority streams with metrics and callbacks, a stream pool with
//! allocation strategies, multi-stream coordination, a stream-ordered allocator and a GPU-timed
//! profiler.
//!
//! This layer sits on [`cuweave_driver`] (whose `Stream` it wraps, never re-binding the FFI)
//! and [`cuweave_memory`] (whose buffers its copies move, ordered by their own use tracking).
//!
//! | item | what it is for |
//! |---|---|
//! | [`StreamPriority`] | High / Normal / Low, mapped onto the device's range (H100: -5, -2, 0) and read back with `cuStreamGetPriority` |
//! | [`PriorityStream`], [`StreamMetrics`] | a non-blocking stream with counted (and, on request, GPU-timed) copies, fills, prefetches, launches; outstanding work tracked with events; host callbacks that may call CUDA |
//! | [`StreamPool`], [`AllocationStrategy`], [`WorkloadType`] | streams made once per context and priority, handed out round robin, by least queued GPU work, by priority or by workload; ready-stream waiting; one pool per device |
//! | [`MultiStreamCoordinator`], [`DependencyGraph`] | dependencies as device-side event waits with cycles refused, barriers, parallel execution, completion callbacks |
//! | [`StreamOrderedAllocator`] | `cuMemAllocFromPoolAsync` memory tied to a stream, freed in stream order, shared only through recorded dependencies |
//! | [`StreamProfiler`], [`ProfileReport`] | per-stream and combined reports in GPU time, Chrome trace JSON |
//! | [`capture`]: [`StreamCapture`], [`CaptureOptions`] | graph capture on streams with a private memory pool, fork/join, typed refusals; [`PriorityStream::launch_graph`] |
//! | [`StreamError`] | every failure, typed; wraps the driver's and the memory layer's errors |
//!
//! # The model
//! A CUDA stream runs its work in order; different streams may run concurrently. Everything
//! here is about choosing streams and ordering work between them *on the device*: a dependency
//! is an event recorded on one stream and waited for by another (`cuStreamWaitEvent`), never a
//! host-side wait. What a strategy knows about a stream comes from the device too: how many of
//! its operations are still queued is read from the events recorded behind them.
//!
//! Guide: `docs/streams.md` in the repository (strategy rules, what is measured and how, bench
//! figures).
//!
//! ```no_run
//! use std::sync::Arc;
//! use cuweave_driver::{Context, Device};
//! use cuweave_memory::DeviceBuffer;
//! use cuweave_stream::{MultiStreamCoordinator, StreamPool, StreamPoolConfig, WorkloadType};
//!
//! # fn main() -> cuweave_stream::Result<()> {
//! let context = Context::primary(Device::get(0)?)?;
//! let pool = StreamPool::new(&context, StreamPoolConfig::default())?;
//! let copies = pool.get_stream_for_workload(WorkloadType::Memory)?;
//! let compute = pool.get_stream_for_workload(WorkloadType::Compute)?;
//!
//! let mut input = DeviceBuffer::<f32>::new(&context, 1 << 20)?;
//! let upload = copies.copy_from_host(&mut input, vec![1.0f32; 1 << 20])?;
//! MultiStreamCoordinator::new().add_dependency(&compute, &copies)?; // compute waits for the upload
//! compute.add_callback(|| println!("the GPU got here"))?;
//! upload.wait()?;
//! println!("{}", copies.metrics()?);
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

pub mod allocator;
pub mod capture;
pub mod coordinator;
pub mod error;
pub mod pool;
pub mod priority;
pub mod profiler;
pub mod stream;
pub mod timing;

pub use allocator::{
    AllocatorStats, SizeClassStats, StreamAllocation, StreamOrderedAllocator,
    StreamOrderedAllocatorConfig,
};
pub use capture::{CaptureOptions, StreamCapture};
pub use coordinator::{
    BarrierInfo, CoordinatorStats, DependencyGraph, MultiStreamCoordinator, queue_barrier,
};
pub use error::{Result, StreamError};
pub use pool::{
    AllocationStrategy, ConfigurationChange, StreamPool, StreamPoolConfig, WorkloadLayout,
    WorkloadType, compute_stream_share, wait_for_any_ready,
};
pub use priority::StreamPriority;
pub use profiler::{
    CombinedReport, DEFAULT_KEPT_OPERATIONS, NamedTotal, ProfileReport, ProfiledOperation,
    StreamProfiler, StreamReport,
};
pub use stream::{CallbackFailure, OperationKind, PriorityStream, StreamMetrics};
pub use timing::{GpuTimer, SpanStart};
