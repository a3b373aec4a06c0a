//! The coordinator's `State` behind its lock: the live operations, the per-stream queues of
//! those whose completion is not seen yet, the latest cancellations; and what it answers about
//! an id (its state, its [`CompletionPoint`]), deciding and retiring operations.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use cuweave_driver::graph::capture_is_active;
use cuweave_driver::{DriverError, OwnedPooledEvent};

use super::capture_waits::{self, CapturedCompletion, captured_completion};
use super::queue::{Front, StreamQueues};
use super::{CompletionCallback, Operation, OperationId, OperationState, cancel};
use crate::error::{EventError, Result};
use crate::waiter::WaitResult;

#[derive(Default)]
pub(super) struct State {
    /// This coordinator's number in the process (0 in unit tests), part of its ids.
    pub(super) coordinator: u64,
    pub(super) next_id: u64,
    /// Live operations: not yet retired.
    pub(super) operations: HashMap<OperationId, Operation>,
    /// Queued operations whose completion has not been seen, per stream in the order they
    /// were queued.
    pub(super) queued: StreamQueues,
    /// The latest cancelled ids, so that they read as unknown rather than retired.
    pub(super) cancelled: cancel::Cancelled,
    /// Captures whose end the waiter watches for this coordinator (one watch per capture,
    /// however many of its operations have callbacks), until it fires.
    pub(super) watched_captures: HashSet<u64>,
}

impl State {
    /// Whether the waiter should start watching `capture`'s end for this coordinator: `true`
    /// the first time it is asked (the caller then starts the watch), `false` while a watch of
    /// it is live.
    pub(super) fn first_watch_of_capture(&mut self, capture: u64) -> bool {
        self.watched_captures.insert(capture)
    }

    /// Whether `id` was registered and has retired (completed, nothing depends on it).
    pub(super) fn is_retired(&self, id: OperationId) -> bool {
        id.coordinator() == self.coordinator
            && (1..=self.next_id).contains(&id.get())
            && !self.operations.contains_key(&id)
            && !self.cancelled.contains(id)
    }

    /// The state of a registered id, live or retired.
    pub(super) fn state_of(&self, id: OperationId) -> Option<OperationState> {
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
    pub(super) fn completion_point(
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
    pub(super) fn take_finished(
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

    /// Decides, complete, every queued operation whose completion event was recorded into
    /// `capture`, once that capture has ended (`active` says whether it still records; while
    /// it does, nothing is decided), wherever each stands in its stream's queue; returns their
    /// callbacks to run.
    ///
    /// A captured operation is complete once its capture has ended, whatever eager work was
    /// queued before it on the same stream: its work is a node of the graph, not stream work,
    /// so stream order says nothing about it. Were it decided only by a poll from its queue's
    /// front, an eager operation in front (still running, or its query skipped during another
    /// capture) would hold it, and its callbacks, until some later coordinator call. No driver
    /// call: the capture registry answers.
    pub(super) fn decide_captured(
        &mut self,
        capture: u64,
        active: impl Fn(u64) -> bool,
    ) -> Vec<(OperationId, WaitResult, Vec<CompletionCallback>)> {
        if captured_completion(capture, active) == CapturedCompletion::Recording {
            return Vec::new();
        }
        let operations = &self.operations;
        let taken = self.queued.remove_where(|id| {
            operations.get(&id).is_some_and(|op| {
                op.metadata.state == OperationState::Queued && op.captured_into() == Some(capture)
            })
        });
        taken
            .into_iter()
            .filter_map(|id| {
                let callbacks = self.decide(id, &Ok(()))?;
                Some((id, Ok(()), callbacks))
            })
            .collect()
    }

    /// Records that the GPU reached (or failed to reach) queued `id`: its state, its error,
    /// its queue entry; returns its callbacks to run. `None` when it is not queued (already
    /// decided, or unknown).
    pub(super) fn decide(
        &mut self,
        id: OperationId,
        result: &WaitResult,
    ) -> Option<Vec<CompletionCallback>> {
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
    pub(super) fn try_retire(&mut self, id: OperationId) {
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
pub(super) enum CompletionPoint {
    /// The GPU completed it.
    Reached,
    /// Its completion could not be observed; the stored error.
    Failed(EventError),
    /// Queued: its completion event.
    Event(Arc<OwnedPooledEvent>),
}
