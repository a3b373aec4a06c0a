//! Events for cuweave: an event pool, dependency-aware operation coordination, cross-stream
//! barriers and runtime-agnostic async waiting.
#![forbid(unsafe_code)]

pub mod barrier;
pub mod coordinator;
pub mod error;
pub mod pool;
mod sync;
pub mod waiter;
pub mod wake;

pub use barrier::CrossStreamBarrier;
pub use coordinator::{
    CoordinatorMetrics, EventMetadata, EventPriority, OperationCoordinator, OperationId,
    OperationState, OperationType,
};
pub use error::{EventError, Result};
pub use pool::{EventPool, PoolCounters, PoolUtilization, PooledEvent};
pub use waiter::{
    AsyncEventWaiter, WaitFuture, WaitId, WaitOptions, WaitResult, WaiterStats, WakeMechanism,
    WatchedEvent, event_done, stream_idle,
};
