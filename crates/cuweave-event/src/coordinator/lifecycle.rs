//! An operation's life through the coordinator: registering it (and its dependencies),
//! beginning it on a stream (the device-side waits on its dependencies), and completing it (its
//! completion event); with the checks a caller can make before registering.

use std::sync::Arc;
use std::time::Instant;

use cuweave_driver::Stream;
use cuweave_driver::graph::capture_is_active;
use cuweave_stream::{PriorityStream, StreamPool};

use super::capture_waits::{self, Recorded, WaitDecision};
use super::metrics::MetricsCell;
use super::{
    AsStream, EventPriority, Inner, Operation, OperationCoordinator, OperationId, OperationState,
    OperationType, POLL_AT, expect_state, operation_mut,
};
use crate::error::{EventError, Result};

/// A claimed completion ([`State::claim_completion`]) not yet finished: dropped (the record
/// failed, or the caller unwound), it gives the claim back.
///
/// [`State::claim_completion`]: super::State::claim_completion
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
            for (queued, event) in waits.iter().enumerate() {
                if let Err(error) = stream.wait_event(event) {
                    if queued > 0 {
                        // The waits queued before this one still hold the stream.
                        handle.note_queued_wait();
                    }
                    return Err(error.into());
                }
            }
            if !waits.is_empty() {
                handle.note_queued_wait();
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
    /// retires) once the capture has ended, as the coordinator's next call observes (or, for
    /// an operation with callbacks, the waiter's watch of the capture's end, whatever eager work
    /// is queued before it on the stream); its work then runs at each launch of the graph. It
    /// has no GPU time.
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
            // captured operation (and run its callbacks) once its capture has ended, and the
            // waiter watches for that end, so that callbacks need no later coordinator call.
            let callbacks = !operation.callbacks.is_empty();
            let watch = callbacks && recorded.capture().is_none();
            operation.watched = watch;
            let capture_end = match recorded.capture() {
                Some(capture) if callbacks && state.first_watch_of_capture(capture) => {
                    Some(capture)
                }
                _ => None,
            };
            state.queued.push(stream_id, id);
            (watch, capture_end, state.queued.len() >= POLL_AT)
        };
        self.inner.changed.notify_all();
        let (watch, capture_end, poll) = watch;
        if watch {
            self.inner.watch(id, &done);
        }
        if let Some(capture) = capture_end {
            self.inner.watch_capture_end(capture);
        }
        if poll {
            self.inner.poll();
        }
        Ok(())
    }
}
