//! [`OperationCoordinator`]: GPU operations with types, priorities and dependencies, ordered on
//! the device with events, with deadlock (cycle) detection, completion callbacks and metrics.

mod graph;
mod metrics;
mod queries;
mod types;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use cuweave_driver::Stream;
use cuweave_stream::{PriorityStream, StreamPool, StreamPriority};
use parking_lot::{Condvar, Mutex};

pub use metrics::CoordinatorMetrics;
pub use types::{EventMetadata, EventPriority, OperationId, OperationState, OperationType};

use crate::error::{EventError, Result};
use cuweave_driver::{EventPool, OwnedPooledEvent};
use crate::waiter::{AsyncEventWaiter, WaitFuture, WaitResult};
use metrics::MetricsCell;

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
/// - [`metrics`](Self::metrics): counts, host time spent coordinating, and GPU time per
///   operation type measured with timing events around each operation.
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
    state: Mutex<State>,
    changed: Condvar,
    metrics: MetricsCell,
}

#[derive(Default)]
struct State {
    next_id: u64,
    operations: HashMap<OperationId, Operation>,
}

struct Operation {
    metadata: EventMetadata,
    stream: Option<Arc<dyn AsStream>>,
    done: Option<Arc<OwnedPooledEvent>>,
    start: Option<OwnedPooledEvent>,
    end: Option<OwnedPooledEvent>,
    callbacks: Vec<CompletionCallback>,
    failure: Option<EventError>,
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
        Self {
            inner: Arc::new(Inner {
                pool,
                waiter,
                state: Mutex::new(State::default()),
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
            if !state.operations.contains_key(&dependency) {
                return Err(EventError::UnknownOperation {
                    operation: "register_operation",
                    id: dependency,
                });
            }
        }
        state.next_id += 1;
        let id = OperationId(state.next_id);
        let mut unique = dependencies.to_vec();
        unique.sort_unstable();
        unique.dedup();
        let metadata = EventMetadata {
            id,
            operation_type,
            priority,
            description: description.into(),
            dependencies: unique,
            state: OperationState::Registered,
            preferred_stream: stream.map(Stream::id),
            stream: None,
            registered_at: Instant::now(),
            begun_at: None,
            queued_at: None,
            completed_at: None,
            gpu_time: None,
            cross_stream_waits: 0,
        };
        state.operations.insert(
            id,
            Operation {
                metadata,
                stream: None,
                done: None,
                start: None,
                end: None,
                callbacks: Vec::new(),
                failure: None,
            },
        );
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
        if !state.operations.contains_key(&dependency) {
            return Err(EventError::UnknownOperation {
                operation: "add_dependency",
                id: dependency,
            });
        }
        let operation = operation_mut(&mut state, id, "add_dependency")?;
        expect_state(operation, OperationState::Registered, "add a dependency to")?;
        if !operation.metadata.dependencies.contains(&dependency) {
            operation.metadata.dependencies.push(dependency);
        }
        Ok(())
    }

    /// Begins `id` on `stream`: the stream waits on the device for each dependency's completion
    /// event recorded on another stream, and a timing event marks the start.
    ///
    /// # Errors
    /// [`EventError::DependencyNotQueued`] when a dependency has not been completed with
    /// [`complete_operation`](Self::complete_operation) yet (its event does not exist);
    /// `InvalidState` when `id` was already begun; the driver's error (the operation then stays
    /// registered).
    pub fn begin_operation<S: AsStream>(&self, id: OperationId, stream: &Arc<S>) -> Result<()> {
        let _timed = self.timed();
        let handle: Arc<dyn AsStream> = Arc::clone(stream) as Arc<dyn AsStream>;
        let stream = handle.as_stream();
        let waits = {
            let mut state = self.inner.state.lock();
            let operation = operation_mut(&mut state, id, "begin_operation")?;
            expect_state(operation, OperationState::Registered, "begin")?;
            let dependencies = operation.metadata.dependencies.clone();
            let mut waits = Vec::new();
            for dependency in dependencies {
                let dep = &state.operations[&dependency];
                match dep.metadata.state {
                    OperationState::Queued => {
                        if dep.metadata.stream != Some(stream.id()) {
                            waits.push(Arc::clone(dep.done.as_ref().expect("queued has event")));
                        } else {
                            MetricsCell::add(&self.inner.metrics.same_stream_waits_skipped, 1);
                        }
                    }
                    OperationState::Completed => {}
                    _ => return Err(EventError::DependencyNotQueued { id, dependency }),
                }
            }
            // Reserved under the lock so that a concurrent begin of the same id is refused.
            let operation = operation_mut(&mut state, id, "begin_operation")?;
            operation.metadata.state = OperationState::Begun;
            waits
        };
        let queued = (|| -> Result<OwnedPooledEvent> {
            for event in &waits {
                stream.wait_event(event)?;
            }
            let start = self.inner.pool.acquire_owned(true)?;
            start.record(stream)?;
            Ok(start)
        })();
        let mut state = self.inner.state.lock();
        let operation = operation_mut(&mut state, id, "begin_operation")?;
        match queued {
            Ok(start) => {
                operation.start = Some(start);
                operation.stream = Some(Arc::clone(&handle));
                operation.metadata.stream = Some(stream.id());
                operation.metadata.begun_at = Some(Instant::now());
                operation.metadata.cross_stream_waits = waits.len();
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
    /// dependants' streams wait on) and a timing event. Completion callbacks run once the GPU
    /// reaches the event.
    ///
    /// # Errors
    /// `InvalidState` unless `id` is begun; the driver's error.
    pub fn complete_operation(&self, id: OperationId) -> Result<()> {
        let _timed = self.timed();
        let stream = {
            let mut state = self.inner.state.lock();
            let operation = operation_mut(&mut state, id, "complete_operation")?;
            expect_state(operation, OperationState::Begun, "complete")?;
            Arc::clone(operation.stream.as_ref().expect("begun has a stream"))
        };
        let stream = stream.as_stream();
        let recorded = (|| -> Result<(OwnedPooledEvent, OwnedPooledEvent)> {
            let end = self.inner.pool.acquire_owned(true)?;
            end.record(stream)?;
            let done = self.inner.pool.acquire_owned(false)?;
            done.record(stream)?;
            Ok((end, done))
        })();
        let (end, done) = recorded?;
        let done = Arc::new(done);
        {
            let mut state = self.inner.state.lock();
            let operation = operation_mut(&mut state, id, "complete_operation")?;
            operation.end = Some(end);
            operation.done = Some(Arc::clone(&done));
            operation.metadata.state = OperationState::Queued;
            operation.metadata.queued_at = Some(Instant::now());
        }
        self.inner.changed.notify_all();
        let inner: Weak<Inner> = Arc::downgrade(&self.inner);
        self.inner.waiter.wait_async(done, move |result| {
            if let Some(inner) = inner.upgrade() {
                inner.on_gpu_complete(id, result);
            }
        });
        Ok(())
    }

    /// Runs `callback` once the GPU has completed `id` (at once, on this thread, if it already
    /// has); otherwise on the waiter's thread. Keep it short.
    ///
    /// # Errors
    /// `UnknownOperation`.
    pub fn on_complete<F>(&self, id: OperationId, callback: F) -> Result<()>
    where
        F: FnOnce(OperationId, WaitResult) + Send + 'static,
    {
        let mut state = self.inner.state.lock();
        let operation = operation_mut(&mut state, id, "on_complete")?;
        let result = match operation.metadata.state {
            OperationState::Completed => Ok(()),
            OperationState::Failed => Err(operation
                .failure
                .clone()
                .unwrap_or(EventError::WaiterShutDown)),
            _ => {
                operation.callbacks.push(Box::new(callback));
                return Ok(());
            }
        };
        drop(state);
        callback(id, result);
        Ok(())
    }

    /// A future that resolves when the GPU has completed `id`.
    ///
    /// # Errors
    /// `UnknownOperation`; `InvalidState` before `complete_operation` (there is no event yet).
    pub fn completion(&self, id: OperationId) -> Result<WaitFuture> {
        let done = {
            let mut state = self.inner.state.lock();
            let operation = operation_mut(&mut state, id, "completion")?;
            match &operation.done {
                Some(done) => Arc::clone(done),
                None => {
                    return Err(EventError::InvalidState {
                        id,
                        action: "await",
                        state: operation.metadata.state.name(),
                    });
                }
            }
        };
        Ok(self.inner.waiter.event_done(done))
    }

    /// Blocks until the GPU has completed `id` (its completion event).
    ///
    /// # Errors
    /// As [`completion`](Self::completion); the driver's error.
    pub fn synchronize(&self, id: OperationId) -> Result<()> {
        let done = {
            let mut state = self.inner.state.lock();
            let operation = operation_mut(&mut state, id, "synchronize")?;
            operation.done.clone().ok_or(EventError::InvalidState {
                id,
                action: "synchronize",
                state: operation.metadata.state.name(),
            })?
        };
        Ok(done.synchronize()?)
    }

    /// Where `id` is now.
    ///
    /// # Errors
    /// `UnknownOperation`.
    pub fn state(&self, id: OperationId) -> Result<OperationState> {
        Ok(self.metadata(id)?.state)
    }

    /// Everything known about `id`.
    ///
    /// # Errors
    /// `UnknownOperation`.
    pub fn metadata(&self, id: OperationId) -> Result<EventMetadata> {
        let mut state = self.inner.state.lock();
        Ok(operation_mut(&mut state, id, "metadata")?.metadata.clone())
    }

    /// Counts, coordination time and GPU time per operation type.
    pub fn metrics(&self) -> CoordinatorMetrics {
        self.inner.metrics.snapshot()
    }
}

impl Inner {
    /// Called on the waiter's thread once the GPU reached (or failed to reach) `id`'s event.
    fn on_gpu_complete(&self, id: OperationId, result: WaitResult) {
        let (start, end, callbacks, operation_type) = {
            let mut state = self.state.lock();
            let Some(operation) = state.operations.get_mut(&id) else {
                return;
            };
            operation.metadata.completed_at = Some(Instant::now());
            operation.metadata.state = if result.is_ok() {
                OperationState::Completed
            } else {
                OperationState::Failed
            };
            operation.failure = result.as_ref().err().cloned();
            (
                operation.start.take(),
                operation.end.take(),
                std::mem::take(&mut operation.callbacks),
                operation.metadata.operation_type,
            )
        };
        if result.is_ok() {
            MetricsCell::add(&self.metrics.completed, 1);
            // The events are complete, so this query does not block.
            if let (Some(start), Some(end)) = (start, end) {
                match start.elapsed_ms(&end) {
                    Ok(ms) => {
                        let time = Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
                        self.metrics.add_gpu_time(operation_type, time);
                        if let Some(op) = self.state.lock().operations.get_mut(&id) {
                            op.metadata.gpu_time = Some(time);
                        }
                    }
                    Err(error) => tracing::warn!(%error, %id, "reading an operation's GPU time"),
                }
            }
        } else {
            MetricsCell::add(&self.metrics.failed, 1);
        }
        self.changed.notify_all();
        for callback in callbacks {
            callback(id, result.clone());
        }
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
