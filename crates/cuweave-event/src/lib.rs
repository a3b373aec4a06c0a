//! Events for cuweave: an event pool, dependency-aware operation coordination, cross-stream
//! barriers and runtime-agnostic async waiting.
//!
//! # The model
//!
//! Everything this crate reports as complete, the GPU completed: it observes real events, or
//! words the GPU writes into mapped pinned memory behind the work, never the host's say-so.
//! Ordering between streams happens on the device (`cuStreamWaitEvent`); the host blocks only
//! where a method says so.
//!
//! | item | what it is for |
//! |---|---|
//! | [`EventPool`], [`PooledEvent`], [`OwnedPooledEvent`] | reusable timing and non-timing events, returned on drop (borrowing the pool, or sharing ownership of it); one atomic swap per round trip on a thread's fast path; re-exported from `cuweave-driver`, where every layer takes its events from one pool per context |
//! | [`OperationCoordinator`] | operations with types, priorities and dependencies, begun and completed on streams; deadlock (cycle) detection, stall reports, completion callbacks, metrics with GPU time per type |
//! | [`CrossStreamBarrier`] | every stream waits for every other (on the device), or the host waits for all |
//! | [`AsyncEventWaiter`], [`WaitFuture`] | one reactor thread that wakes futures and runs callbacks when the GPU reaches a point; cancellation, timeouts |
//! | [`wake`] | the CUDA-free, loom-checked core of the waiter |
//!
//! A [`WaitFuture`] needs no async runtime: `.await` it under tokio, smol or
//! `futures::executor::block_on`. `docs/events.md` has the measurements behind the default wake
//! mechanism ([`WakeMechanism::CompletionWord`]).
//!
//! ```no_run
//! use cuweave_driver::{Context, Device, Stream, StreamFlags};
//! use cuweave_event::AsyncEventWaiter;
//!
//! # async fn run() -> Result<(), cuweave_event::EventError> {
//! let context = Context::primary(Device::get(0)?)?;
//! let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
//! // ... queue kernels and copies on `stream` ...
//! AsyncEventWaiter::global()?.stream_idle(&stream)?.await?;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

// Under `--cfg loom` only the CUDA-free core is built: it is what the loom models check, and
// the rest (driver handles, the reactor's real threads) cannot run under loom's scheduler.
#[cfg(not(loom))]
pub mod barrier;
#[cfg(not(loom))]
mod capture;
#[cfg(not(loom))]
pub mod coordinator;
#[cfg(not(loom))]
pub mod error;
mod sync;
#[cfg(not(loom))]
pub mod waiter;
pub mod wake;

#[cfg(not(loom))]
pub use barrier::CrossStreamBarrier;
#[cfg(not(loom))]
pub use coordinator::{
    AsStream, CoordinatorMetrics, EventMetadata, EventPriority, OperationCoordinator, OperationId,
    OperationState, OperationType,
};
/// The event pool lives in the driver crate, the lowest layer that records events, so that
/// every layer shares one per context; it is re-exported here with the seed's API.
pub use cuweave_driver::event_pool as pool;
pub use cuweave_driver::{EventPool, OwnedPooledEvent, PoolCounters, PoolUtilization, PooledEvent};
#[cfg(not(loom))]
pub use error::{EventError, Result};
#[cfg(not(loom))]
pub use waiter::{
    AsyncEventWaiter, WaitFuture, WaitId, WaitOptions, WaitResult, WaiterStats, WakeMechanism,
    WatchedEvent, event_done, stream_idle,
};
