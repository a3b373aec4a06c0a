//! Withdrawing an operation that never began: [`OperationCoordinator::cancel_operation`].
//!
//! A registered operation holds its dependencies' records (they cannot retire while it may
//! still begin and wait on them). A caller whose `begin_operation` was refused (a capture rule,
//! a driver error) or who abandons the work would otherwise leave it, and them, registered for
//! good: cancelling removes it as if it had never been registered. Its id then reads as
//! unknown, not as retired (a retired id means the GPU completed the work, which here it never
//! did), for as long as it is among the latest [`CANCELLED_KEPT`] cancellations; ids only grow,
//! so an id older than that is a program's bug either way.

use std::collections::{HashSet, VecDeque};

use super::completion::run_callbacks;
use super::metrics::MetricsCell;
use super::{
    OperationCoordinator, OperationId, OperationState, State, expect_state, operation_mut,
};
use crate::error::{EventError, Result};

/// How many of the latest cancelled ids a coordinator remembers.
pub(crate) const CANCELLED_KEPT: usize = 4096;

/// The latest cancelled ids, oldest first, at most [`CANCELLED_KEPT`].
#[derive(Debug, Default)]
pub(super) struct Cancelled {
    order: VecDeque<OperationId>,
    ids: HashSet<OperationId>,
}

impl Cancelled {
    pub(super) fn contains(&self, id: OperationId) -> bool {
        self.ids.contains(&id)
    }

    fn insert(&mut self, id: OperationId) {
        if self.order.len() == CANCELLED_KEPT
            && let Some(oldest) = self.order.pop_front()
        {
            self.ids.remove(&oldest);
        }
        self.order.push_back(id);
        self.ids.insert(id);
    }
}

impl State {
    /// Removes registered, never-begun `id` and lets its dependencies go; returns its
    /// callbacks.
    fn cancel(&mut self, id: OperationId) -> Result<Vec<super::CompletionCallback>> {
        let operation = operation_mut(self, id, "cancel_operation")?;
        expect_state(operation, OperationState::Registered, "cancel")?;
        if operation.dependants > 0 {
            return Err(EventError::InvalidState {
                id,
                action: "cancel",
                state: "a dependency of registered operations",
            });
        }
        let operation = self
            .operations
            .remove(&id)
            .expect("looked up under the same lock");
        for dependency in &operation.metadata.dependencies {
            if let Some(dep) = self.operations.get_mut(dependency) {
                dep.dependants = dep.dependants.saturating_sub(1);
            }
            self.try_retire(*dependency);
        }
        self.cancelled.insert(id);
        Ok(operation.callbacks)
    }
}

impl OperationCoordinator {
    /// Withdraws `id`, registered and never begun (its begin was refused, or the work is
    /// abandoned): its record goes, and its dependencies no longer wait for it to begin, so they
    /// retire as if it had never been registered. Its completion callbacks run at once, on this
    /// thread, with [`EventError::Cancelled`]. Later calls with `id` answer `UnknownOperation`.
    ///
    /// # Errors
    /// `UnknownOperation`; `InvalidState` once it has begun, and while registered operations
    /// depend on it (they would lose the order it stands for: cancel them first).
    pub fn cancel_operation(&self, id: OperationId) -> Result<()> {
        let callbacks = self.inner.state.lock().cancel(id)?;
        MetricsCell::add(&self.inner.metrics.cancelled, 1);
        // A `wait_until_ready` on a dependant of a dependency looks again.
        self.inner.changed.notify_all();
        let panicked = run_callbacks(id, callbacks, &Err(EventError::Cancelled { id }));
        if panicked > 0 {
            MetricsCell::add(&self.inner.metrics.callback_panics, panicked);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::{Operation, OperationType};

    fn register(state: &mut State, dependencies: Vec<OperationId>) -> OperationId {
        state.next_id += 1;
        let id = OperationId::new(0, state.next_id);
        for dependency in &dependencies {
            state.operations.get_mut(dependency).unwrap().dependants += 1;
        }
        state.operations.insert(
            id,
            Operation::registered(id, OperationType::Kernel, dependencies),
        );
        id
    }

    #[test]
    fn a_cancelled_operation_reads_unknown_and_frees_its_dependency() {
        let mut state = State::default();
        let dependency = register(&mut state, Vec::new());
        let refused = register(&mut state, vec![dependency]);
        // The dependency completes while `refused` still holds it.
        let dep = state.operations.get_mut(&dependency).unwrap();
        dep.metadata.state = OperationState::Completed;
        state.try_retire(dependency);
        assert!(
            state.operations.contains_key(&dependency),
            "held by `refused`"
        );

        assert!(matches!(
            state.cancel(dependency),
            Err(EventError::InvalidState { .. })
        ));
        state.cancel(refused).unwrap();
        assert!(state.is_retired(dependency), "nothing holds it any more");
        assert!(!state.is_retired(refused), "cancelled is not completed");
        assert_eq!(state.state_of(refused), None);
        assert!(matches!(
            state.cancel(refused),
            Err(EventError::UnknownOperation { .. })
        ));
    }

    #[test]
    fn a_depended_on_or_begun_operation_is_not_cancelled() {
        let mut state = State::default();
        let first = register(&mut state, Vec::new());
        let _second = register(&mut state, vec![first]);
        assert!(matches!(
            state.cancel(first),
            Err(EventError::InvalidState { .. })
        ));
        let alone = register(&mut state, Vec::new());
        state.operations.get_mut(&alone).unwrap().metadata.state = OperationState::Begun;
        assert!(matches!(
            state.cancel(alone),
            Err(EventError::InvalidState { .. })
        ));
    }

    #[test]
    fn cancelled_ids_are_remembered_up_to_a_bound() {
        let mut state = State::default();
        let ids: Vec<OperationId> = (0..CANCELLED_KEPT + 10)
            .map(|_| {
                let id = register(&mut state, Vec::new());
                state.cancel(id).unwrap();
                id
            })
            .collect();
        assert_eq!(state.cancelled.order.len(), CANCELLED_KEPT);
        assert_eq!(state.cancelled.ids.len(), CANCELLED_KEPT);
        assert!(state.operations.is_empty());
        assert_eq!(state.state_of(*ids.last().unwrap()), None);
    }
}
