//! [`OperationCoordinator`]: GPU operations with types, priorities and dependencies, ordered on
//! the device with events, with deadlock (cycle) detection, completion callbacks and metrics.
//!
//! The coordinator's record of its operations is `state` (the `State` behind its lock) and
//! `operation` (one operation's record); `lifecycle` registers, begins and completes operations,
//! `waiting` waits for their completion (callbacks, futures, blocking); `queries` asks about the
//! dependency graph, `observe` and `completion` decide completions, `cancel` withdraws an
//! operation, `capture_waits` holds the rules beside stream captures.

mod cancel;
mod capture_waits;
mod completion;
mod lifecycle;
mod metrics;
mod observe;
mod operation;
mod queries;
mod queue;
mod state;
mod types;
mod waiting;

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use cuweave_driver::Stream;
use cuweave_stream::{GpuTimer, PriorityStream, StreamPriority};
use parking_lot::{Condvar, Mutex};

pub use metrics::CoordinatorMetrics;
pub use types::{EventMetadata, EventPriority, OperationId, OperationState, OperationType};

use crate::error::{EventError, Result};
use crate::waiter::{AsyncEventWaiter, WaitResult};
use cuweave_driver::EventPool;
use metrics::MetricsCell;
use operation::{Operation, expect_state, operation_mut};
use state::{CompletionPoint, State};

// Used here only by the unit tests (`tests.rs` takes the parent's names with `use super::*`).
#[cfg(test)]
use crate::waiter::WaitFuture;
#[cfg(test)]
use cuweave_driver::DriverError;

/// Anything that is, or wraps, a driver [`Stream`]: operations can begin on a plain stream or
/// on a [`PriorityStream`] from a [`StreamPool`].
///
/// [`StreamPool`]: cuweave_stream::StreamPool
pub trait AsStream: Send + Sync + 'static {
    /// The driver stream.
    fn as_stream(&self) -> &Stream;

    /// Told after work that can hold the stream without being one of its counted operations
    /// was queued on [`as_stream`](Self::as_stream): a device wait (a dependency's, a
    /// barrier's, a buffer's use tracker's) or a collective (`cuweave-collective`'s
    /// coordinated calls). A [`PriorityStream`] counts it, so its pool does not hand it out as
    /// idle until the GPU has passed it. Nothing by default.
    fn note_queued_wait(&self) {}
}

impl AsStream for Stream {
    fn as_stream(&self) -> &Stream {
        self
    }
}

impl AsStream for PriorityStream {
    fn as_stream(&self) -> &Stream {
        self.stream()
    }

    fn note_queued_wait(&self) {
        PriorityStream::note_queued_wait(self);
    }
}

impl EventPriority {
    /// The stream priority an operation of this urgency runs at: `Critical` and `High` on
    /// high-priority streams, `Normal` on normal ones, `Low` and `Cleanup` on low ones.
    pub fn stream_priority(self) -> StreamPriority {
        match self {
            Self::Critical | Self::High => StreamPriority::High,
            Self::Normal => StreamPriority::Normal,
            Self::Low | Self::Cleanup => StreamPriority::Low,
        }
    }
}

/// Queued operations at which `complete_operation` looks for finished ones (one event query
/// each): few enough that records and events stay bounded, many enough that a program whose
/// GPU keeps up pays about one query per operation.
const POLL_AT: usize = 16;

/// A completion callback: told the operation and whether the GPU completed it.
type CompletionCallback = Box<dyn FnOnce(OperationId, WaitResult) + Send + 'static>;

/// Coordinates GPU operations that depend on each other across streams.
///
/// Register an operation with its type, priority, dependencies and a description; when its
/// work is about to be queued, [`begin_operation`](Self::begin_operation) makes its stream wait
/// *on the device* for each dependency's completion event (`cuStreamWaitEvent`; nothing to do
/// for a dependency on the same stream, which the stream orders anyway); queue the work; then
/// [`complete_operation`](Self::complete_operation) records the operation's own event. The host
/// never blocks. Completion callbacks ([`on_complete`](Self::on_complete)) run when the GPU
/// reaches that event, observed by an [`AsyncEventWaiter`], not when `complete_operation` is
/// called.
///
/// - [`ready_operations`](Self::ready_operations): registered operations whose dependencies are
///   all queued, most urgent first.
/// - [`detect_deadlocks`](Self::detect_deadlocks): every cycle in the dependency graph
///   ([`add_dependency`](Self::add_dependency) can close one after registration).
/// - [`wait_until_ready`](Self::wait_until_ready) / [`stalled_operations`](Self::stalled_operations):
///   an operation waiting on one that is never begun is reported after a timeout instead of
///   hanging its caller.
/// - [`metrics`](Self::metrics): counts, host time spent coordinating, and, with
///   [`set_timing`](Self::set_timing), GPU time per operation type measured by the one
///   [`GpuTimer`] (the operation's start event and its completion event).
///
/// **Finished work retires.** Once the GPU has completed an operation (observed by the
/// coordinator's own event queries, on each stream oldest first, made by `complete_operation`
/// once 16 operations are queued and by every query method, or by the waiter when a callback
/// waits) and no registered operation that has not begun depends on it, its events go back to
/// the pool and its metadata is dropped; only the aggregate [`metrics`](Self::metrics) keep it. A retired id
/// still answers [`state`](Self::state) (`Completed`), [`synchronize`](Self::synchronize) and
/// [`completion`](Self::completion) at once, and is a valid dependency (already satisfied);
/// [`metadata`](Self::metadata) reports [`EventError::Retired`]. So memory and events stay
/// bounded by the operations in flight, and every query costs O(live operations). A completed
/// operation kept for a dependant answers `synchronize` and `completion` at once too. An
/// operation whose completion could not be observed (`Failed`) stays, with its error, which
/// `synchronize` and `completion` report.
///
/// ```no_run
/// use std::sync::Arc;
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_event::{EventPool, EventPriority, OperationCoordinator, OperationType};
///
/// # fn main() -> Result<(), cuweave_event::EventError> {
/// let context = Context::primary(Device::get(0)?)?;
/// let coordinator = OperationCoordinator::new(EventPool::new(&context, 16, 16)?)?;
/// let (copy_stream, compute_stream) = (
///     Arc::new(Stream::new(&context, StreamFlags::NON_BLOCKING)?),
///     Arc::new(Stream::new(&context, StreamFlags::NON_BLOCKING)?),
/// );
/// let copy = coordinator.register_operation(
///     OperationType::MemoryTransfer, EventPriority::High, Some(&copy_stream), &[], "upload")?;
/// let kernel = coordinator.register_operation(
///     OperationType::Kernel, EventPriority::Normal, Some(&compute_stream), &[copy], "compute")?;
/// coordinator.begin_operation(copy, &copy_stream)?;
/// // ... queue the copy on copy_stream ...
/// coordinator.complete_operation(copy)?;
/// coordinator.begin_operation(kernel, &compute_stream)?; // compute_stream waits for the copy
/// // ... launch the kernel on compute_stream ...
/// coordinator.complete_operation(kernel)?;
/// coordinator.synchronize(kernel)?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct OperationCoordinator {
    inner: Arc<Inner>,
}

struct Inner {
    pool: EventPool,
    waiter: Arc<AsyncEventWaiter>,
    timer: GpuTimer<(OperationId, OperationType)>,
    /// Held from taking finished spans out of `timer` until their times are written into
    /// `state`: a thread that harvests after another took a span waits for that write, so a
    /// callback run after its own harvest always finds its operation's GPU time.
    harvesting: Mutex<()>,
    state: Mutex<State>,
    changed: Condvar,
    metrics: MetricsCell,
}

/// A number no other coordinator of the process has (from 1), for its operation ids.
fn next_coordinator() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl fmt::Debug for OperationCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OperationCoordinator")
            .field("operations", &self.inner.state.lock().operations.len())
            .finish()
    }
}

/// Adds the host time spent in a method to the metrics when dropped.
struct Timed<'a>(&'a MetricsCell, Instant);

impl Drop for Timed<'_> {
    fn drop(&mut self) {
        self.0.add_time(self.1.elapsed());
    }
}

impl OperationCoordinator {
    /// A coordinator taking its events from `pool`, with its own [`AsyncEventWaiter`].
    ///
    /// # Errors
    /// When the waiter's thread cannot start.
    pub fn new(pool: EventPool) -> Result<Self> {
        Ok(Self::with_waiter(pool, Arc::new(AsyncEventWaiter::new()?)))
    }

    /// A coordinator sharing `waiter` (one reactor thread for several coordinators).
    pub fn with_waiter(pool: EventPool, waiter: Arc<AsyncEventWaiter>) -> Self {
        let timer = GpuTimer::new(pool.clone());
        timer.set_enabled(false);
        Self {
            inner: Arc::new(Inner {
                timer,
                harvesting: Mutex::new(()),
                pool,
                waiter,
                state: Mutex::new(State {
                    coordinator: next_coordinator(),
                    ..State::default()
                }),
                changed: Condvar::new(),
                metrics: MetricsCell::default(),
            }),
        }
    }

    fn timed(&self) -> Timed<'_> {
        Timed(&self.inner.metrics, Instant::now())
    }

    /// The event pool the coordinator takes its events from.
    pub fn pool(&self) -> &EventPool {
        &self.inner.pool
    }

    /// Turns GPU timing of operations begun later on or off. Off by default: a timing event
    /// record costs about 1.5 µs of host time on the H100, five times a plain one, and timing
    /// takes two per operation (a start event at begin, and a timing completion event instead
    /// of a plain one); `docs/events.md` has the figures.
    pub fn set_timing(&self, enabled: bool) {
        self.inner.timer.set_enabled(enabled);
    }

    /// Operations not yet retired (registered, in flight, completed but still depended on,
    /// failed).
    pub fn live_operations(&self) -> usize {
        self.inner.poll();
        self.inner.state.lock().operations.len()
    }

    /// Observes, without blocking, the queued operations the GPU has completed (on each
    /// stream oldest first, up to the first one it has not), and retires those nothing depends
    /// on. Every method
    /// that registers, begins or completes does this too; call it to retire work while the
    /// coordinator is otherwise idle.
    pub fn retire_finished(&self) {
        self.inner.poll();
    }

    /// Where `id` is now.
    ///
    /// # Errors
    /// `UnknownOperation`.
    pub fn state(&self, id: OperationId) -> Result<OperationState> {
        self.inner.poll();
        self.inner
            .state
            .lock()
            .state_of(id)
            .ok_or(EventError::UnknownOperation {
                operation: "state",
                id,
            })
    }

    /// Everything known about `id`, while it is live.
    ///
    /// # Errors
    /// `UnknownOperation`; [`EventError::Retired`] once it completed and retired (its figures
    /// are in the [`metrics`](Self::metrics)).
    pub fn metadata(&self, id: OperationId) -> Result<EventMetadata> {
        let mut state = self.inner.state.lock();
        if state.is_retired(id) {
            return Err(EventError::Retired { id });
        }
        Ok(operation_mut(&mut state, id, "metadata")?.metadata.clone())
    }

    /// Counts, coordination time and GPU time per operation type (after observing what the
    /// GPU has finished).
    pub fn metrics(&self) -> CoordinatorMetrics {
        self.inner.poll();
        self.inner.metrics.snapshot()
    }
}

#[cfg(test)]
mod tests;
