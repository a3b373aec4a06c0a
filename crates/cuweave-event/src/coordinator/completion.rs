//! The coordinator's completion steps that need no CUDA: claiming an operation's completion
//! (so that two concurrent `complete_operation` calls accept exactly one), and running
//! completion callbacks so that one that panics stops neither the others nor retirement.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use super::{AsStream, CompletionCallback, OperationId, OperationState, State, operation_mut};
use crate::error::{EventError, Result};
use crate::waiter::WaitResult;

/// What a claimed completion needs once the lock is released: the operation's stream, and
/// whether its completion event must be a timing one (it ends a GPU-time span).
pub(super) struct Claimed {
    pub(super) stream: Arc<dyn AsStream>,
    pub(super) timed: bool,
}

impl State {
    /// Claims `id`'s completion for the calling `complete_operation`: `id` must be begun and
    /// not already being completed. Made under the lock, before the event is recorded with the
    /// lock released, so that of two concurrent calls exactly one proceeds; the other gets the
    /// `InvalidState` a second, sequential call gets. Undone by
    /// [`abandon_completion`](Self::abandon_completion) when the record fails, ended by
    /// [`finish_completion`](Self::finish_completion).
    ///
    /// # Errors
    /// `UnknownOperation`; `InvalidState` (state `completing` while another call holds it).
    pub(super) fn claim_completion(&mut self, id: OperationId) -> Result<Claimed> {
        let operation = operation_mut(self, id, "complete_operation")?;
        let state = operation.metadata.state;
        if state != OperationState::Begun || operation.completing {
            return Err(EventError::InvalidState {
                id,
                action: "complete",
                state: if operation.completing {
                    "completing"
                } else {
                    state.name()
                },
            });
        }
        operation.completing = true;
        Ok(Claimed {
            stream: Arc::clone(operation.stream.as_ref().expect("begun has a stream")),
            timed: operation.span.is_some(),
        })
    }

    /// Gives back a claim whose record failed (or whose caller unwound): `id` is begun again,
    /// and a later `complete_operation` may try again.
    pub(super) fn abandon_completion(&mut self, id: OperationId) {
        if let Some(operation) = self.operations.get_mut(&id) {
            operation.completing = false;
        }
    }

    /// Ends a claim whose event was recorded: `id` is queued from now on (the caller sets the
    /// rest). `false` when `id` holds no claim (never happens: only the claimant ends it).
    pub(super) fn finish_completion(&mut self, id: OperationId) -> bool {
        match self.operations.get_mut(&id) {
            Some(operation)
                if operation.completing && operation.metadata.state == OperationState::Begun =>
            {
                operation.completing = false;
                operation.metadata.state = OperationState::Queued;
                true
            }
            _ => false,
        }
    }
}

/// Runs `id`'s completion callbacks, each once, in registration order; a callback that panics
/// is contained and logged, and the ones after it still run. Returns how many panicked.
pub(super) fn run_callbacks(
    id: OperationId,
    callbacks: Vec<CompletionCallback>,
    result: &WaitResult,
) -> u64 {
    let mut panicked = 0;
    for callback in callbacks {
        let outcome = result.clone();
        if catch_unwind(AssertUnwindSafe(move || callback(id, outcome))).is_err() {
            panicked += 1;
            tracing::error!(%id, "an operation's completion callback panicked; the panic was contained");
        }
    }
    panicked
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::coordinator::{Operation, OperationType};

    fn begun(state: &mut State, number: u64) -> OperationId {
        let id = OperationId::new(0, number);
        state.next_id = state.next_id.max(number);
        let mut operation = Operation::registered(id, OperationType::Kernel, Vec::new());
        operation.metadata.state = OperationState::Begun;
        operation.metadata.stream = Some(7);
        operation.stream = Some(Arc::new(NoStream));
        state.operations.insert(id, operation);
        id
    }

    /// Never asked for its stream: the claim only clones the handle.
    struct NoStream;

    impl AsStream for NoStream {
        fn as_stream(&self) -> &cuweave_driver::Stream {
            unreachable!("the state machine never touches the stream")
        }
    }

    fn refused_as(result: Result<Claimed>) -> &'static str {
        match result {
            Err(EventError::InvalidState {
                action: "complete",
                state,
                ..
            }) => state,
            Err(other) => panic!("refused with {other:?}"),
            Ok(_) => panic!("claimed twice"),
        }
    }

    #[test]
    fn of_two_claims_on_one_begun_operation_exactly_one_proceeds() {
        let mut state = State::default();
        let id = begun(&mut state, 1);
        assert!(state.claim_completion(id).is_ok());
        // The second caller comes while the first records its event (the lock released).
        assert_eq!(refused_as(state.claim_completion(id)), "completing");
        assert_eq!(state.state_of(id), Some(OperationState::Begun));
        assert!(state.finish_completion(id));
        assert_eq!(state.state_of(id), Some(OperationState::Queued));
        // Sequentially afterwards: the usual double-complete refusal.
        assert_eq!(refused_as(state.claim_completion(id)), "queued");
        assert!(!state.finish_completion(id), "no claim to end");
    }

    #[test]
    fn a_failed_record_gives_the_claim_back() {
        let mut state = State::default();
        let id = begun(&mut state, 1);
        assert!(state.claim_completion(id).is_ok());
        state.abandon_completion(id);
        assert_eq!(state.state_of(id), Some(OperationState::Begun));
        assert!(
            state.claim_completion(id).is_ok(),
            "a retry may claim again"
        );
        assert!(state.finish_completion(id));
        // Unknown and not-yet-begun operations are refused, typed.
        assert!(matches!(
            state.claim_completion(OperationId::new(0, 9)),
            Err(EventError::UnknownOperation { .. })
        ));
        let registered = OperationId::new(0, 2);
        state.operations.insert(
            registered,
            Operation::registered(registered, OperationType::Kernel, Vec::new()),
        );
        assert_eq!(refused_as(state.claim_completion(registered)), "registered");
    }

    #[test]
    fn a_panicking_callback_stops_neither_the_next_ones_nor_the_count() {
        let ran = Arc::new(AtomicUsize::new(0));
        let id = OperationId::new(0, 1);
        let counting = |ran: &Arc<AtomicUsize>| -> CompletionCallback {
            let ran = Arc::clone(ran);
            Box::new(move |done, result| {
                assert_eq!((done, result), (OperationId::new(0, 1), Ok(())));
                ran.fetch_add(1, Ordering::SeqCst);
            })
        };
        let callbacks: Vec<CompletionCallback> = vec![
            counting(&ran),
            Box::new(|_, _| panic!("test: a callback that panics")),
            counting(&ran),
            Box::new(|_, _| panic!("test: another")),
            counting(&ran),
        ];
        assert_eq!(run_callbacks(id, callbacks, &Ok(())), 2);
        assert_eq!(ran.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_decided_operation_whose_callback_panicked_still_retires() {
        let mut state = State::default();
        let id = begun(&mut state, 1);
        assert!(state.claim_completion(id).is_ok());
        assert!(state.finish_completion(id));
        state.queued.push(7, id);
        state
            .operations
            .get_mut(&id)
            .unwrap()
            .callbacks
            .push(Box::new(|_, _| panic!("test: a callback that panics")));
        let callbacks = state.decide(id, &Ok(())).expect("queued: decided");
        assert_eq!(run_callbacks(id, callbacks, &Ok(())), 1);
        state.try_retire(id);
        assert!(state.is_retired(id));
        assert_eq!(state.queued.len(), 0);
    }
}
