//! [`OperationCoordinator`]: GPU operations with types, priorities and dependencies, ordered on
//! the device with events, with deadlock (cycle) detection, completion callbacks and metrics.

mod cancel;
mod capture_waits;
mod completion;
mod metrics;
mod observe;
mod queries;
mod queue;
mod types;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use cuweave_driver::{DriverError, Stream};
use cuweave_stream::{GpuTimer, PriorityStream, StreamPool, StreamPriority};
use parking_lot::{Condvar, Mutex};

pub use metrics::CoordinatorMetrics;
pub use types::{EventMetadata, EventPriority, OperationId, OperationState, OperationType};

use crate::error::{EventError, Result};
use crate::waiter::{AsyncEventWaiter, WaitFuture, WaitResult};
use capture_waits::{CapturedCompletion, Recorded, WaitDecision, captured_completion};
use cuweave_driver::graph::capture_is_active;
use cuweave_driver::{EventPool, OwnedPooledEvent};
use metrics::MetricsCell;
use queue::{Front, StreamQueues};

/// Anything that is, or wraps, a driver [`Stream`]: operations can begin on a plain stream or
/// on a [`PriorityStream`] from a [`StreamPool`].
pub trait AsStream: Send + Sync + 'static {
    /// The driver stream.
    fn as_stream(&self) -> &Stream;
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
    state: Mutex<State>,
    changed: Condvar,
    metrics: MetricsCell,
}

/// A number no other coordinator of the process has (from 1), for its operation ids.
fn next_coordinator() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[derive(Default)]
struct State {
    /// This coordinator's number in the process (0 in unit tests), part of its ids.
    coordinator: u64,
    next_id: u64,
    /// Live operations: not yet retired.
    operations: HashMap<OperationId, Operation>,
    /// Queued operations whose completion has not been seen, per stream in the order they
    /// were queued.
    queued: StreamQueues,
    /// The latest cancelled ids, so that they read as unknown rather than retired.
    cancelled: cancel::Cancelled,
}

impl State {
    /// Whether `id` was registered and has retired (completed, nothing depends on it).
    fn is_retired(&self, id: OperationId) -> bool {
        id.coordinator() == self.coordinator
            && (1..=self.next_id).contains(&id.get())
            && !self.operations.contains_key(&id)
            && !self.cancelled.contains(id)
    }

    /// The state of a registered id, live or retired.
    fn state_of(&self, id: OperationId) -> Option<OperationState> {
        match self.operations.get(&id) {
            Some(op) => Some(op.metadata.state),
            None if self.is_retired(id) => Some(OperationState::Completed),
            None => None,
        }
    }

    /// Where a caller that waits for `id`'s completion stands: already reached (completed,
    /// live or retired), failed with the stored error, or waiting on its completion event.
    ///
    /// # Errors
    /// `UnknownOperation`; `InvalidState` before `complete_operation` (no event yet).
    fn completion_point(
        &self,
        id: OperationId,
        operation: &'static str,
        action: &'static str,
    ) -> Result<CompletionPoint> {
        if self.is_retired(id) {
            return Ok(CompletionPoint::Reached);
        }
        let op = self
            .operations
            .get(&id)
            .ok_or(EventError::UnknownOperation { operation, id })?;
        match (op.metadata.state, &op.done) {
            (OperationState::Completed, _) => Ok(CompletionPoint::Reached),
            (OperationState::Failed, _) => Ok(CompletionPoint::Failed(
                op.failure.clone().unwrap_or(EventError::WaiterShutDown),
            )),
            (OperationState::Queued, Some(done)) => match op.captured_into() {
                None => Ok(CompletionPoint::Event(Arc::clone(done))),
                Some(capture) => match captured_completion(capture, capture_is_active) {
                    CapturedCompletion::Recording => {
                        Err(capture_waits::host_wait_refusal(operation).into())
                    }
                    CapturedCompletion::Captured => Ok(CompletionPoint::Reached),
                },
            },
            (state, _) => Err(EventError::InvalidState {
                id,
                action,
                state: state.name(),
            }),
        }
    }

    /// Takes off the queues the operations whose completion events `query` finds reached (or
    /// failing), each stream's from its front up to the first it finds pending, and those
    /// already decided; returns the reached ones with their outcome, for
    /// [`decide`](Self::decide).
    fn take_finished(
        &mut self,
        mut query: impl FnMut(&Operation) -> Result<bool, DriverError>,
    ) -> Vec<(OperationId, WaitResult)> {
        let operations = &self.operations;
        self.queued.drain_done(|id| match operations.get(&id) {
            Some(op) if op.metadata.state == OperationState::Queued => match query(op) {
                Ok(false) => Front::NotYet,
                // A capture on some thread forbids this thread's query while it lasts: ask again
                // later (never a failure of the operation).
                Err(error) if error.is_capture_refusal() => Front::NotYet,
                Ok(true) => Front::Done(Ok(())),
                Err(error) => Front::Done(Err(EventError::from(error))),
            },
            // Already decided (by the waiter): just drop it from the queue.
            _ => Front::Drop,
        })
    }

    /// Records that the GPU reached (or failed to reach) queued `id`: its state, its error,
    /// its queue entry; returns its callbacks to run. `None` when it is not queued (already
    /// decided, or unknown).
    fn decide(&mut self, id: OperationId, result: &WaitResult) -> Option<Vec<CompletionCallback>> {
        let operation = self.operations.get_mut(&id)?;
        if operation.metadata.state != OperationState::Queued {
            return None;
        }
        operation.metadata.completed_at = Some(Instant::now());
        operation.metadata.state = if result.is_ok() {
            OperationState::Completed
        } else {
            OperationState::Failed
        };
        operation.failure = result.as_ref().err().cloned();
        let callbacks = std::mem::take(&mut operation.callbacks);
        if result.is_ok() {
            // The completion event is no longer needed by anyone who begins later.
            operation.done = None;
        }
        if let Some(stream) = operation.metadata.stream {
            self.queued.remove_front(stream, id);
        }
        Some(callbacks)
    }

    /// Drops `id`'s record if the GPU completed it and nothing still needs it.
    fn try_retire(&mut self, id: OperationId) {
        if self.operations.get(&id).is_some_and(|op| {
            op.metadata.state == OperationState::Completed
                && op.dependants == 0
                && op.callbacks.is_empty()
        }) {
            self.operations.remove(&id);
        }
    }
}

/// What waiting for an operation's completion comes down to.
enum CompletionPoint {
    /// The GPU completed it.
    Reached,
    /// Its completion could not be observed; the stored error.
    Failed(EventError),
    /// Queued: its completion event.
    Event(Arc<OwnedPooledEvent>),
}

struct Operation {
    metadata: EventMetadata,
    stream: Option<Arc<dyn AsStream>>,
    /// The completion event (a timing event while timing is on: it also ends the GPU span).
    done: Option<Arc<OwnedPooledEvent>>,
    /// Where `done` was recorded: eagerly or into a capture (see [`capture_waits`]).
    recorded: Option<Recorded>,
    span: Option<cuweave_stream::SpanStart>,
    /// Registered operations, not yet begun, that list this one as a dependency.
    dependants: usize,
    /// Whether the waiter watches the completion event (for callbacks).
    watched: bool,
    /// A `complete_operation` call claimed it (still `Begun`) and is recording its event.
    completing: bool,
    callbacks: Vec<CompletionCallback>,
    failure: Option<EventError>,
}

impl Operation {
    /// The capture its completion event was recorded into, if any (such an event can never be
    /// queried or waited for: the capture decides where the operation stands).
    fn captured_into(&self) -> Option<u64> {
        self.recorded.and_then(Recorded::capture)
    }

    /// A just-registered operation of `operation_type` waiting for `dependencies` (normal
    /// priority, no description, no preferred stream).
    fn registered(
        id: OperationId,
        operation_type: OperationType,
        dependencies: Vec<OperationId>,
    ) -> Self {
        Self {
            metadata: EventMetadata {
                id,
                operation_type,
                priority: EventPriority::Normal,
                description: String::new(),
                dependencies,
                state: OperationState::Registered,
                preferred_stream: None,
                stream: None,
                registered_at: Instant::now(),
                begun_at: None,
                queued_at: None,
                completed_at: None,
                gpu_time: None,
                cross_stream_waits: 0,
            },
            stream: None,
            done: None,
            recorded: None,
            span: None,
            dependants: 0,
            watched: false,
            completing: false,
            callbacks: Vec::new(),
            failure: None,
        }
    }
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

/// A claimed completion ([`State::claim_completion`]) not yet finished: dropped (the record
/// failed, or the caller unwound), it gives the claim back.
struct Claim<'a> {
    inner: &'a Inner,
    id: OperationId,
    armed: bool,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.inner.state.lock().abandon_completion(self.id);
        }
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

    /// Registers an operation that will run after `dependencies` (all already registered).
    /// `stream` names where it is meant to run (informational; [`begin_operation`] says where
    /// it does).
    ///
    /// [`begin_operation`]: Self::begin_operation
    ///
    /// # Errors
    /// [`EventError::UnknownOperation`] for a dependency never registered.
    pub fn register_operation(
        &self,
        operation_type: OperationType,
        priority: EventPriority,
        stream: Option<&Stream>,
        dependencies: &[OperationId],
        description: impl Into<String>,
    ) -> Result<OperationId> {
        let _timed = self.timed();
        let mut state = self.inner.state.lock();
        for &dependency in dependencies {
            if state.state_of(dependency).is_none() {
                return Err(EventError::UnknownOperation {
                    operation: "register_operation",
                    id: dependency,
                });
            }
        }
        state.next_id += 1;
        let id = OperationId::new(state.coordinator, state.next_id);
        let mut unique = dependencies.to_vec();
        unique.sort_unstable();
        unique.dedup();
        for dependency in &unique {
            if let Some(op) = state.operations.get_mut(dependency) {
                op.dependants += 1;
            }
        }
        let mut operation = Operation::registered(id, operation_type, unique);
        operation.metadata.priority = priority;
        operation.metadata.description = description.into();
        operation.metadata.preferred_stream = stream.map(Stream::id);
        state.operations.insert(id, operation);
        MetricsCell::add(&self.inner.metrics.registered, 1);
        Ok(id)
    }

    /// Makes `id` also depend on `dependency` (which may be registered after it, so this can
    /// close a cycle: see [`detect_deadlocks`](Self::detect_deadlocks)).
    ///
    /// # Errors
    /// `UnknownOperation`; `SelfDependency`; `InvalidState` once `id` has begun.
    pub fn add_dependency(&self, id: OperationId, dependency: OperationId) -> Result<()> {
        let _timed = self.timed();
        if id == dependency {
            return Err(EventError::SelfDependency { id });
        }
        let mut state = self.inner.state.lock();
        if state.state_of(dependency).is_none() {
            return Err(EventError::UnknownOperation {
                operation: "add_dependency",
                id: dependency,
            });
        }
        let operation = operation_mut(&mut state, id, "add_dependency")?;
        expect_state(operation, OperationState::Registered, "add a dependency to")?;
        if !operation.metadata.dependencies.contains(&dependency) {
            operation.metadata.dependencies.push(dependency);
            if let Some(dep) = state.operations.get_mut(&dependency) {
                dep.dependants += 1;
            }
            drop(state);
            // A `wait_until_ready` on an operation this closes a cycle through looks again.
            self.inner.changed.notify_all();
        }
        Ok(())
    }

    /// Begins `id` on `stream`: the stream waits on the device for each dependency's completion
    /// event recorded on another stream, and a timing event marks the start. On a capturing
    /// stream a dependency on the same stream follows the capture rules too (see
    /// `capture_waits`): stream order at capture time does not order a graph's launches.
    ///
    /// # Errors
    /// [`EventError::DependencyNotQueued`] when a dependency has not been completed with
    /// [`complete_operation`](Self::complete_operation) yet (its event does not exist);
    /// [`EventError::DependencyCycle`], naming the cycle, when that is because `id` is in a
    /// dependency cycle (it can never begin);
    /// `InvalidState` when `id` was already begun; [`EventError::ForeignStream`] for a stream
    /// of another context than the coordinator's event pool (checked before anything changes);
    /// `GraphError::Capturing` (a [capture refusal](EventError::is_capture_refusal)) when the
    /// stream is capturing and a dependency's completion was recorded outside its capture
    /// without being known to have finished when the capture began: the wait would invalidate
    /// the capture, so nothing is queued and the operation stays registered (see
    /// `capture_waits` for every case);
    /// the driver's error (the operation then stays registered).
    pub fn begin_operation<S: AsStream>(&self, id: OperationId, stream: &Arc<S>) -> Result<()> {
        let _timed = self.timed();
        let handle: Arc<dyn AsStream> = Arc::clone(stream) as Arc<dyn AsStream>;
        let stream = handle.as_stream();
        self.check_stream_for(id, stream)?;
        let dependent = capture_waits::dependent_capture(stream)?;
        let waits = {
            let mut state = self.inner.state.lock();
            let operation = operation_mut(&mut state, id, "begin_operation")?;
            expect_state(operation, OperationState::Registered, "begin")?;
            let dependencies = operation.metadata.dependencies.clone();
            if let Err(error) = state.check_queued(id, &dependencies, "begin_operation") {
                // Not merely early: an operation in a cycle can never begin. Say which cycle.
                return Err(match (&error, state.cycle_through(id)) {
                    (EventError::DependencyNotQueued { .. }, Some(cycle)) => {
                        EventError::DependencyCycle { id, cycle }
                    }
                    _ => error,
                });
            }
            let mut waits = Vec::new();
            for dependency in dependencies {
                // A retired or completed dependency: nothing to wait for.
                let Some(dep) = state.operations.get(&dependency) else {
                    continue;
                };
                if dep.metadata.state != OperationState::Queued {
                    continue;
                }
                let recorded = dep.recorded.unwrap_or(Recorded::UNKNOWN);
                if dep.metadata.stream != Some(stream.id()) {
                    match capture_waits::decide(dependent, recorded, capture_is_active) {
                        WaitDecision::Wait => {
                            waits.push(Arc::clone(dep.done.as_ref().expect("queued has event")));
                        }
                        WaitDecision::Skip => {}
                        WaitDecision::Refuse => return Err(capture_waits::refusal().into()),
                    }
                } else if capture_waits::refuse_same_stream(dependent, recorded, capture_is_active)
                {
                    // Stream order at capture time does not carry into the graph, which
                    // replays later on any stream: the same rule as across streams.
                    return Err(capture_waits::refusal().into());
                } else {
                    MetricsCell::add(&self.inner.metrics.same_stream_waits_skipped, 1);
                }
            }
            // Reserved under the lock so that a concurrent begin of the same id is refused.
            let operation = operation_mut(&mut state, id, "begin_operation")?;
            operation.metadata.state = OperationState::Begun;
            waits
        };
        let queued = (|| -> Result<Option<cuweave_stream::SpanStart>> {
            for event in &waits {
                stream.wait_event(event)?;
            }
            if !waits.is_empty() {
                cuweave_stream::capture::note_wait_joined_capture(stream)?;
            }
            Ok(self.inner.timer.start(stream)?)
        })();
        let mut state = self.inner.state.lock();
        let operation = operation_mut(&mut state, id, "begin_operation")?;
        match queued {
            Ok(span) => {
                operation.span = span;
                operation.stream = Some(Arc::clone(&handle));
                operation.metadata.stream = Some(stream.id());
                operation.metadata.begun_at = Some(Instant::now());
                operation.metadata.cross_stream_waits = waits.len();
                let dependencies = operation.metadata.dependencies.clone();
                // Begun: it no longer needs its dependencies' records.
                for dependency in dependencies {
                    if let Some(dep) = state.operations.get_mut(&dependency) {
                        dep.dependants = dep.dependants.saturating_sub(1);
                    }
                    state.try_retire(dependency);
                }
                MetricsCell::add(&self.inner.metrics.begun, 1);
                MetricsCell::add(&self.inner.metrics.cross_stream_waits, waits.len() as u64);
                Ok(())
            }
            Err(error) => {
                operation.metadata.state = OperationState::Registered;
                Err(error)
            }
        }
    }

    /// Checks, changing nothing, that operations can begin on `stream`: it must belong to the
    /// context of the coordinator's event pool, as [`begin_operation`](Self::begin_operation)
    /// requires. For callers that must not register an operation that could not begin.
    ///
    /// # Errors
    /// [`EventError::ForeignStream`], whose `id` is [`OperationId::UNREGISTERED`].
    pub fn check_stream(&self, stream: &Stream) -> Result<()> {
        self.check_stream_for(OperationId::UNREGISTERED, stream)
    }

    /// `begin_operation`'s stream rule, for operation `id`.
    fn check_stream_for(&self, id: OperationId, stream: &Stream) -> Result<()> {
        // The completion event comes from the pool and is recorded on this stream: both must
        // be of one context, or `complete_operation` would fail with the operation begun.
        let pool_context = self.inner.pool.context();
        if stream.context().as_raw() != pool_context.as_raw() {
            return Err(EventError::ForeignStream {
                id,
                stream: stream.id(),
                stream_device: stream.device().ordinal(),
                pool_device: pool_context.device().ordinal(),
            });
        }
        Ok(())
    }

    /// Checks, under one lock and without polling the GPU, that every one of `dependencies` is
    /// queued, completed or retired: the rule [`begin_operation`](Self::begin_operation)
    /// applies to an operation's dependencies. For callers that must not register an
    /// operation that could not begin (it would stay registered and keep its dependencies
    /// from retiring). O(dependencies).
    ///
    /// # Errors
    /// `UnknownOperation` for an id never registered; [`EventError::DependencyNotQueued`] for
    /// the first one registered or begun but not queued, or whose completion failed; its `id`
    /// is [`OperationId::UNREGISTERED`] (no operation was registered).
    pub fn dependencies_queued(&self, dependencies: &[OperationId]) -> Result<()> {
        self.inner.state.lock().check_queued(
            OperationId::UNREGISTERED,
            dependencies,
            "dependencies_queued",
        )
    }

    /// Begins `id` on a stream of `pool` at the operation's priority
    /// ([`EventPriority::stream_priority`]; the pool falls back to the nearest priority it has),
    /// and returns that stream for the operation's work.
    ///
    /// # Errors
    /// As [`begin_operation`](Self::begin_operation); the pool's error.
    pub fn begin_on_pool(&self, id: OperationId, pool: &StreamPool) -> Result<Arc<PriorityStream>> {
        let priority = self.metadata(id)?.priority.stream_priority();
        let stream = pool.get_priority_stream(priority)?;
        self.begin_operation(id, &stream)?;
        Ok(stream)
    }

    /// Marks the end of `id`'s work on its stream: records its completion event (which
    /// dependants' streams wait on, and which ends its GPU-time span). Completion callbacks run
    /// once the GPU reaches the event.
    ///
    /// On a capturing stream the event goes into the capture: operations of the same capture
    /// wait for it inside the graph, and the operation counts as complete (callbacks run, it
    /// retires) once the capture has ended, as the coordinator's next call observes; its work
    /// then runs at each launch of the graph. It has no GPU time.
    ///
    /// Of two concurrent calls on one operation exactly one records its event; the other is
    /// refused as a second call is.
    ///
    /// # Errors
    /// `InvalidState` unless `id` is begun (state `completing` while a concurrent call is
    /// recording it); the driver's error (the operation then stays begun, and may be completed
    /// again).
    pub fn complete_operation(&self, id: OperationId) -> Result<()> {
        let _timed = self.timed();
        // Claimed under the lock before anything is recorded: of two concurrent calls exactly
        // one proceeds, the other is refused as a second call is. Given back (the operation
        // begun again) if the record fails or the caller unwinds.
        let claimed = self.inner.state.lock().claim_completion(id)?;
        let mut claim = Claim {
            inner: &self.inner,
            id,
            armed: true,
        };
        let stream = claimed.stream.as_stream();
        let stream_id = stream.id();
        let done = self.inner.pool.acquire_owned(claimed.timed)?;
        done.record(stream)?;
        let recorded = capture_waits::recorded_on(stream).unwrap_or(Recorded::UNKNOWN);
        let done = Arc::new(done);
        // Recorded: the claim is ended below, under the lock, not given back.
        claim.armed = false;
        let watch = {
            let mut state = self.inner.state.lock();
            if !state.finish_completion(id) {
                return Err(EventError::UnknownOperation {
                    operation: "complete_operation",
                    id,
                });
            }
            let operation = operation_mut(&mut state, id, "complete_operation")?;
            let span = operation.span.take();
            let operation_type = operation.metadata.operation_type;
            // A span begun eagerly whose end went into a capture could never be read: dropped.
            if recorded.capture().is_none() {
                self.inner
                    .timer
                    .finish_with(span, Arc::clone(&done), (id, operation_type));
            }
            operation.done = Some(Arc::clone(&done));
            operation.recorded = Some(recorded);
            operation.metadata.queued_at = Some(Instant::now());
            // The waiter cannot watch a captured event: the coordinator's own polls decide a
            // captured operation (and run its callbacks) once its capture has ended.
            let watch = !operation.callbacks.is_empty() && recorded.capture().is_none();
            operation.watched = watch;
            state.queued.push(stream_id, id);
            (watch, state.queued.len() >= POLL_AT)
        };
        self.inner.changed.notify_all();
        let (watch, poll) = watch;
        if watch {
            self.inner.watch(id, done);
        }
        if poll {
            self.inner.poll();
        }
        Ok(())
    }

    /// Runs `callback` once the GPU has completed `id` (at once, on this thread, if it already
    /// has); otherwise on the waiter's thread, or on the thread of whichever coordinator call
    /// observes the completion. Keep it short. A callback that panics there is contained and
    /// logged (counted in [`CoordinatorMetrics::callback_panics`]): the operation's other
    /// callbacks still run, it retires, and no unrelated caller sees the panic.
    ///
    /// # Errors
    /// `UnknownOperation`.
    pub fn on_complete<F>(&self, id: OperationId, callback: F) -> Result<()>
    where
        F: FnOnce(OperationId, WaitResult) + Send + 'static,
    {
        let mut state = self.inner.state.lock();
        if state.is_retired(id) {
            drop(state);
            callback(id, Ok(()));
            return Ok(());
        }
        let operation = operation_mut(&mut state, id, "on_complete")?;
        let result = match operation.metadata.state {
            OperationState::Completed => Ok(()),
            OperationState::Failed => Err(operation
                .failure
                .clone()
                .unwrap_or(EventError::WaiterShutDown)),
            state_now => {
                operation.callbacks.push(Box::new(callback));
                match operation.captured_into() {
                    // A queued operation nobody watched yet: the waiter watches it from now on.
                    None if state_now == OperationState::Queued && !operation.watched => {
                        operation.watched = true;
                        let done = Arc::clone(operation.done.as_ref().expect("queued has event"));
                        drop(state);
                        self.inner.watch(id, done);
                    }
                    // Captured, and its capture has ended: the poll decides it and runs the
                    // callbacks now (while the capture records, a later poll will).
                    Some(capture)
                        if captured_completion(capture, capture_is_active)
                            == CapturedCompletion::Captured =>
                    {
                        drop(state);
                        self.inner.poll();
                    }
                    _ => {}
                }
                return Ok(());
            }
        };
        drop(state);
        callback(id, result);
        Ok(())
    }

    /// A future that resolves when the GPU has completed `id`: at once for an operation the
    /// GPU already completed (retired, or completed and still kept for a dependant), with the
    /// stored error for a failed one.
    ///
    /// # Errors
    /// `UnknownOperation`; `InvalidState` before `complete_operation` (there is no event yet);
    /// `GraphError::Capturing` for an operation recorded into a capture still active (nothing
    /// runs until its graph is launched).
    pub fn completion(&self, id: OperationId) -> Result<WaitFuture> {
        let point = self
            .inner
            .state
            .lock()
            .completion_point(id, "completion", "await")?;
        Ok(match point {
            CompletionPoint::Reached => WaitFuture::ready(),
            CompletionPoint::Failed(error) => WaitFuture::failed(error),
            CompletionPoint::Event(done) => self.inner.waiter.event_done(done),
        })
    }

    /// Blocks until the GPU has completed `id` (its completion event); returns at once for an
    /// operation the GPU already completed, and with the stored error for a failed one.
    ///
    /// # Errors
    /// As [`completion`](Self::completion); the driver's error.
    pub fn synchronize(&self, id: OperationId) -> Result<()> {
        let point = self
            .inner
            .state
            .lock()
            .completion_point(id, "synchronize", "synchronize")?;
        match point {
            CompletionPoint::Reached => Ok(()),
            CompletionPoint::Failed(error) => Err(error),
            CompletionPoint::Event(done) => match done.synchronize() {
                // Recorded into a capture begun outside cuweave: a poll decides it from that
                // capture (complete once it ended), as for a cuweave capture.
                Err(error) if capture_waits::is_captured_event(&error) => {
                    self.inner.poll();
                    let point = self.inner.state.lock().completion_point(
                        id,
                        "synchronize",
                        "synchronize",
                    )?;
                    match point {
                        CompletionPoint::Reached => Ok(()),
                        CompletionPoint::Failed(error) => Err(error),
                        CompletionPoint::Event(_) => {
                            Err(capture_waits::host_wait_refusal("synchronize").into())
                        }
                    }
                }
                answer => Ok(answer?),
            },
        }
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

fn operation_mut<'a>(
    state: &'a mut State,
    id: OperationId,
    operation: &'static str,
) -> Result<&'a mut Operation> {
    state
        .operations
        .get_mut(&id)
        .ok_or(EventError::UnknownOperation { operation, id })
}

fn expect_state(
    operation: &Operation,
    expected: OperationState,
    action: &'static str,
) -> Result<()> {
    if operation.metadata.state == expected {
        Ok(())
    } else {
        Err(EventError::InvalidState {
            id: operation.metadata.id,
            action,
            state: operation.metadata.state.name(),
        })
    }
}

#[cfg(test)]
mod tests;
