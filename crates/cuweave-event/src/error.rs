//! [`EventError`]: what can go wrong in the event layer.

use std::time::Duration;

use cuweave_driver::DriverError;

use crate::coordinator::OperationId;

/// A result whose error is an [`EventError`].
pub type Result<T, E = EventError> = std::result::Result<T, E>;

/// Why an event-layer operation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EventError {
    /// The driver failed (or is missing). A context killed by a kernel fault reports here too:
    /// every wait on it resolves with the driver's sticky error instead of hanging.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The stream layer failed (e.g. a stream pool with no stream to hand out).
    #[error(transparent)]
    Stream(#[from] cuweave_stream::StreamError),
    /// An operation id the coordinator never registered.
    #[error("{operation}: unknown operation {id}")]
    UnknownOperation {
        /// The coordinator method that was given the id.
        operation: &'static str,
        /// The unknown id.
        id: OperationId,
    },
    /// An operation was begun before one of its dependencies was queued (completed on the host
    /// side with `complete_operation`), so there is no event to wait on yet.
    #[error("operation {id} cannot begin: its dependency {dependency} has not been queued yet")]
    DependencyNotQueued {
        /// The operation that was to begin.
        id: OperationId,
        /// The dependency whose event does not exist yet.
        dependency: OperationId,
    },
    /// An operation can never begin: it is in a dependency cycle (closed with
    /// [`add_dependency`](crate::OperationCoordinator::add_dependency)), so each operation of
    /// the cycle waits for another that can only begin after it.
    #[error(
        "operation {id} can never begin: it is in the dependency cycle {}",
        show_cycle(.cycle)
    )]
    DependencyCycle {
        /// The operation that was to begin (or to become ready).
        id: OperationId,
        /// The cycle, as [`detect_deadlocks`](crate::OperationCoordinator::detect_deadlocks)
        /// lists it: from its lowest id, each operation followed by one it depends on; the
        /// last depends on the first.
        cycle: Vec<OperationId>,
    },
    /// An operation is not in the state the method needs (begun twice, completed before begun…).
    #[error("operation {id}: cannot {action} while it is {state}")]
    InvalidState {
        /// The operation.
        id: OperationId,
        /// What was asked, e.g. `begin`.
        action: &'static str,
        /// The state it is in, e.g. `queued`.
        state: &'static str,
    },
    /// An operation was begun on a stream of another context (another device, or another
    /// context of the same device) than the coordinator's event pool: its completion event
    /// could not be recorded there.
    #[error(
        "operation {id}: stream {stream} belongs to a context of device {stream_device}, not to \
         the coordinator's event pool's context (device {pool_device})"
    )]
    ForeignStream {
        /// The operation.
        id: OperationId,
        /// The stream's id ([`Stream::id`](cuweave_driver::Stream::id)).
        stream: u64,
        /// The device of the stream's context.
        stream_device: usize,
        /// The device of the coordinator's event pool.
        pool_device: usize,
    },
    /// Adding a dependency of an operation on itself.
    #[error("operation {id} cannot depend on itself")]
    SelfDependency {
        /// The operation.
        id: OperationId,
    },
    /// An operation waited longer than its timeout for dependencies that were never begun.
    #[error("operation {id} stalled for {waited:?}: dependencies {blocked_on:?} were never queued")]
    Stalled {
        /// The waiting operation.
        id: OperationId,
        /// How long it waited.
        waited: Duration,
        /// The dependencies still not queued.
        blocked_on: Vec<OperationId>,
    },
    /// A wait ran past its timeout before the GPU reached the event.
    #[error("the wait timed out after {timeout:?}")]
    TimedOut {
        /// The timeout the wait carried.
        timeout: Duration,
    },
    /// The operation completed and retired: its record is gone (its figures stay in the
    /// coordinator's metrics).
    #[error("operation {id} completed and retired; its metadata is no longer kept")]
    Retired {
        /// The operation.
        id: OperationId,
    },
    /// The operation was withdrawn before it began
    /// ([`cancel_operation`](crate::OperationCoordinator::cancel_operation)): what its
    /// completion callbacks receive.
    #[error("operation {id} was cancelled before it began")]
    Cancelled {
        /// The operation.
        id: OperationId,
    },
    /// The operating system refused to start a thread (the waiter's reactor).
    #[error("{operation}: starting the thread `{thread}` failed: {reason}")]
    ThreadSpawn {
        /// The operation that needed the thread.
        operation: &'static str,
        /// The thread's name.
        thread: &'static str,
        /// The operating system's error.
        reason: String,
    },
    /// The waiter serving a wait was shut down before the GPU reached the event.
    #[error("the event waiter shut down before the wait completed")]
    WaiterShutDown,
    /// A barrier, pool or coordinator was given an empty or mismatched set of streams.
    #[error("{operation}: {reason}")]
    InvalidArgument {
        /// The operation that rejected it.
        operation: &'static str,
        /// What was wrong, with the offending value.
        reason: String,
    },
}

/// `op#1 -> op#3 -> op#2 -> op#1`.
fn show_cycle(cycle: &[OperationId]) -> String {
    let mut shown: Vec<String> = cycle.iter().map(ToString::to_string).collect();
    if let Some(first) = cycle.first() {
        shown.push(first.to_string());
    }
    shown.join(" -> ")
}

impl EventError {
    /// Whether this is a capture refusal
    /// ([`DriverError::is_capture_refusal`], from the driver or through the stream layer): the
    /// call would have broken an active capture, or recorded into it what must run once, and
    /// was not made. "Not now", not a failure of the work.
    pub fn is_capture_refusal(&self) -> bool {
        match self {
            Self::Driver(error) => error.is_capture_refusal(),
            Self::Stream(error) => error.is_capture_refusal(),
            _ => false,
        }
    }

    pub(crate) fn invalid(operation: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            operation,
            reason: reason.into(),
        }
    }
}
