//! Events for cuweave: an event pool, dependency-aware operation coordination, cross-stream
//! barriers and runtime-agnostic async waiting.
#![forbid(unsafe_code)]

// Under `--cfg loom` only the CUDA-free core is built: it is what the loom models check, and
// the rest (driver handles, the reactor's real threads) cannot run under loom's scheduler.
#[cfg(not(loom))]
pub mod barrier;
#[cfg(not(loom))]
pub mod coordinator;
#[cfg(not(loom))]
pub mod error;
#[cfg(not(loom))]
pub mod pool;
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
#[cfg(not(loom))]
pub use error::{EventError, Result};
#[cfg(not(loom))]
pub use pool::{EventPool, PoolCounters, PoolUtilization, PooledEvent};
#[cfg(not(loom))]
pub use waiter::{
    AsyncEventWaiter, WaitFuture, WaitId, WaitOptions, WaitResult, WaiterStats, WakeMechanism,
    WatchedEvent, event_done, stream_idle,
};
