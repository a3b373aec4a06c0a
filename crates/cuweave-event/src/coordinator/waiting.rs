//! Waiting for an operation's completion: a callback ([`OperationCoordinator::on_complete`]), a
//! future ([`OperationCoordinator::completion`]) or a blocking wait
//! ([`OperationCoordinator::synchronize`]).

use std::sync::Arc;

use cuweave_driver::graph::capture_is_active;

use super::capture_waits::{self, CapturedCompletion, captured_completion};
use super::{CompletionPoint, OperationCoordinator, OperationId, OperationState, operation_mut};
use crate::error::{EventError, Result};
use crate::waiter::{WaitFuture, WaitResult};

impl OperationCoordinator {
    /// Runs `callback` once the GPU has completed `id` (at once, on this thread, if it already
    /// has); otherwise on the waiter's thread, or on the thread of whichever coordinator call
    /// observes the completion. Keep it short. A callback that panics there is contained and
    /// logged (counted in [`CoordinatorMetrics::callback_panics`]): the operation's other
    /// callbacks still run, it retires, and no unrelated caller sees the panic.
    ///
    /// [`CoordinatorMetrics::callback_panics`]: super::CoordinatorMetrics::callback_panics
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
                        self.inner.watch(id, &done);
                    }
                    // Captured, and its capture has ended: decided now with the rest of that
                    // capture, and the callbacks run (not by a poll, which eager work queued
                    // before it on its stream would stop).
                    Some(capture)
                        if captured_completion(capture, capture_is_active)
                            == CapturedCompletion::Captured =>
                    {
                        drop(state);
                        self.inner.decide_ended_capture(capture);
                    }
                    // Queued into a capture still recording: the waiter watches for its end,
                    // once per capture, and polls then.
                    Some(capture)
                        if state_now == OperationState::Queued
                            && state.first_watch_of_capture(capture) =>
                    {
                        drop(state);
                        self.inner.watch_capture_end(capture);
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
}
