//! cuweave: CUDA memory, streams, events and transfers for Rust, in the spirit of PyTorch's
//! c10/cuda and RAPIDS RMM.
//!
//! # The model
//!
//! cuweave talks to the CUDA *driver* API, which it loads at run time: building needs no CUDA
//! install, one binary runs on CUDA 12.x and 13.x drivers, and a machine without a driver gets a
//! typed error ([`driver::DriverError::NotFound`]), never a panic. Everything is a handle that
//! frees itself on drop and holds the primary context of its device, which it makes current on
//! the calling thread before each driver call, so handles move freely between threads.
//!
//! The work is split into layers, each its own crate; a crate depends only on those below it.
//! This crate re-exports them, one Cargo feature per layer, so a program can depend on
//! `cuweave` alone and turn on what it uses (or depend on one layer's crate directly):
//!
//! | layer | crate | re-exported as | what it holds |
//! |---|---|---|---|
//! | driver | `cuweave-driver` | [`driver`] | the loader, `DriverError`, `Device`, `Context`, `Stream`, `Event`, the per-context `EventPool` every layer uses, `Module` / `Kernel`, raw memory calls |
//! | memory | `cuweave-memory` | [`memory`] | typed device, pinned and unified buffers, migration hints, the caching allocator, the pinned pool |
//! | stream | `cuweave-stream` | [`stream`] | priority streams with metrics and callbacks, the stream pool and its strategies, multi-stream coordination, the stream-ordered allocator, the GPU-timed profiler |
//! | event | `cuweave-event` | [`event`] | the event pool (re-exported from the driver layer), the operation coordinator (dependencies, priorities, deadlock detection), cross-stream barriers, async waiting (`.await` a stream or an event under any executor) |
//! | collective | `cuweave-collective` | [`collective`] | NCCL loaded at run time: communicators (one process per GPU or one driving several), typed all-reduce / broadcast / reduce / all-gather / reduce-scatter / send / recv on tracked buffers, deadlines that abort, coordinated operations |
//! | transfer | `cuweave-transfer` | [`transfer`] | the transfer manager: measured method choice, pipelined staging of pageable copies, peer-to-peer, zero-copy, host registration, statistics, async transfers |
//!
//! # Features
//!
//! | feature | default | enables |
//! |---|---|---|
//! | `driver` | yes | [`driver`]: the CUDA driver layer |
//! | `memory` | yes | [`memory`]: typed buffers, unified memory, allocators (implies `driver`) |
//! | `stream` | yes | [`stream`]: priority streams, pools, coordination, stream-ordered allocation, profiling (implies `driver`, `memory`) |
//! | `event` | yes | [`event`]: operation coordination, barriers, async waiting (implies `driver`, `stream`; the crate does not use the memory layer itself) |
//! | `transfer` | yes | [`transfer`]: the transfer manager (implies `driver`, `memory`, `event`) |
//! | `collective` | yes | [`collective`]: NCCL collectives (implies `driver`, `memory`, `event`); NCCL itself is loaded at run time, so building needs no NCCL |
//!
//! # Example
//!
//! ```no_run
//! use cuweave::prelude::*;
//!
//! # fn main() -> Result<(), DriverError> {
//! for device in Device::all()? {
//!     let context = Context::primary(device)?;
//!     let memory = context.memory_info()?;
//!     println!(
//!         "device {}: {} (compute {}), {} of {} bytes free",
//!         device.ordinal(),
//!         device.name()?,
//!         device.compute_capability()?,
//!         memory.free,
//!         memory.total
//!     );
//!
//!     // Order work on a stream and wait for it with an event.
//!     let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
//!     let done = Event::new(&context, EventFlags::DISABLE_TIMING)?;
//!     done.record(&stream)?;
//!     done.synchronize()?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! The `cuweave` command (crate `cuweave-cli`) prints what the driver and each device offer:
//! `cargo run -p cuweave-cli -- info`.
#![forbid(unsafe_code)]

#[cfg(feature = "collective")]
pub use cuweave_collective as collective;
#[cfg(feature = "driver")]
pub use cuweave_driver as driver;
#[cfg(feature = "event")]
pub use cuweave_event as event;
#[cfg(feature = "memory")]
pub use cuweave_memory as memory;
#[cfg(feature = "stream")]
pub use cuweave_stream as stream;
#[cfg(feature = "transfer")]
pub use cuweave_transfer as transfer;

/// The most used types of every enabled layer, for `use cuweave::prelude::*`.
pub mod prelude {
    #[cfg(feature = "collective")]
    pub use cuweave_collective::{
        CollectiveError, CollectiveFuture, CommConfig, Communicator, CoordinatedCollectives, Group,
        NcclType, ReduceOp, UniqueId,
    };
    #[cfg(feature = "driver")]
    pub use cuweave_driver::{
        CaptureMode, Context, Device, DriverError, Event, EventFlags, EventPool, Graph, GraphError,
        GraphExec, InstantiateOptions, Kernel, KernelArgs, LaunchConfig, Module, OwnedPooledEvent,
        PooledEvent, Stream, StreamFlags,
    };
    #[cfg(feature = "event")]
    pub use cuweave_event::{
        AsyncEventWaiter, CrossStreamBarrier, EventError, EventPriority, OperationCoordinator,
        OperationId, OperationType, WaitFuture, WakeMechanism,
    };
    #[cfg(feature = "memory")]
    pub use cuweave_memory::{
        AllocatorConfig, BlockStatus, Buffer, BufferSlice, BufferSliceMut, CachedAllocation,
        CachingAllocator, DeviceBuffer, DriverResource, Element, GraphPool, HostRefusal,
        LimitAdaptor, MemAdvice, MemLocation, MemoryError, MemoryResource, MemorySnapshot,
        MemoryStats, MigrationPolicy, MissPolicy, PendingCopy, PinnedBuffer, PinnedPool,
        PrefetchPlan, TrackedLaunch, UnifiedBuffer, split_host_refusal,
    };
    #[cfg(feature = "stream")]
    pub use cuweave_stream::{
        AllocationStrategy, CaptureOptions, MultiStreamCoordinator, OperationKind, PriorityStream,
        StreamCapture, StreamError, StreamMetrics, StreamOrderedAllocator, StreamPool,
        StreamPoolConfig, StreamPriority, StreamProfiler, WorkloadType,
    };
    #[cfg(feature = "transfer")]
    pub use cuweave_transfer::{
        AsyncTransfer, CalibrationTable, Destination, Location, Owned, OwnedTransfer, Plan,
        RegisteredHost, RegistrationAdvice, Source, StagingConfig, TransferDirection,
        TransferError, TransferManager, TransferMethod, TransferPath, TransferReport,
        TransferStats,
    };
}

/// The README's examples, compiled as doc tests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
