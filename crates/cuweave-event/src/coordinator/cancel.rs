//! Withdrawing an operation that never began: [`OperationCoordinator::cancel_operation`].
//!
//! A registered operation holds its dependencies' records (they cannot retire while it may
//! still begin and wait on them). A caller whose `begin_operation` was refused (a capture rule,
//! a driver error) or who abandons the work would otherwise leave it, and them, registered for
//! good: cancelling removes it as if it had never been registered. Its id then reads as
//! unknown, not as retired (a retired id means the GPU completed the work, which here it never
//! did), for as long as it is among the [`CANCELLED_KEPT`] runs of consecutive cancelled ids
//! (a batch withdrawn at once is one run) cancelled into most recently; asking about a
//! cancellation older than that is a program's bug either way.
//!
//! Operations that depend on each other go together ([`OperationCoordinator::cancel_operations`]):
//! that is how a dependency cycle closed by mistake (whose members can never begin, and each of
//! which a registered operation depends on) is withdrawn.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::completion::run_callbacks;
use super::metrics::MetricsCell;
use super::{
    OperationCoordinator, OperationId, OperationState, State, expect_state, operation_mut,
};
use crate::error::{EventError, Result};

/// How many runs of consecutive cancelled ids a coordinator remembers (the runs cancelled into
/// most recently).
pub(crate) const CANCELLED_KEPT: usize = 4096;

/// The latest cancelled ids, as runs of consecutive ids (a batch withdrawn together, or one
/// after another, is one run), at most [`CANCELLED_KEPT`] runs. Past the bound the run least
/// recently cancelled into is forgotten, never by id: an operation registered early and
/// withdrawn late has the lowest id but is the latest cancellation.
#[derive(Debug, Default)]
pub(super) struct Cancelled {
    /// First id of each run to its last id and the stamp of its latest cancellation.
    runs: BTreeMap<u64, (u64, u64)>,
    /// Each run's first id, by the stamp of its latest cancellation (oldest first).
    by_recency: BTreeMap<u64, u64>,
    /// Cancellations so far: the next stamp.
    stamps: u64,
}

impl Cancelled {
    pub(super) fn contains(&self, id: OperationId) -> bool {
        let number = id.get();
        self.runs
            .range(..=number)
            .next_back()
            .is_some_and(|(_, &(last, _))| last >= number)
    }

    fn insert(&mut self, id: OperationId) {
        let number = id.get();
        if self.contains(id) {
            return;
        }
        // Joins the run that ends just below and the one that starts just above.
        let mut first = number;
        let mut last = number;
        if let Some((&start, &(end, stamp))) = self.runs.range(..number).next_back()
            && end + 1 == number
        {
            first = start;
            self.runs.remove(&start);
            self.by_recency.remove(&stamp);
        }
        if let Some((end, stamp)) = number
            .checked_add(1)
            .and_then(|next| self.runs.remove(&next))
        {
            last = end;
            self.by_recency.remove(&stamp);
        }
        let stamp = self.stamps;
        self.stamps += 1;
        self.runs.insert(first, (last, stamp));
        self.by_recency.insert(stamp, first);
        if self.runs.len() > CANCELLED_KEPT
            && let Some((_, oldest)) = self.by_recency.pop_first()
        {
            self.runs.remove(&oldest);
        }
    }

    #[cfg(test)]
    fn runs(&self) -> usize {
        debug_assert_eq!(self.runs.len(), self.by_recency.len());
        self.runs.len()
    }
}

/// What cancelling hands back: each cancelled id with its completion callbacks.
type Withdrawn = Vec<(OperationId, Vec<super::CompletionCallback>)>;

impl State {
    /// Removes every one of `ids` (registered, never begun, and depended on by no registered
    /// operation outside `ids`) and lets their other dependencies go; all or none. Returns each
    /// id's callbacks, in the order given (duplicates once).
    fn cancel_all(&mut self, ids: &[OperationId], operation: &'static str) -> Result<Withdrawn> {
        let mut unique = Vec::with_capacity(ids.len());
        let mut members = HashSet::with_capacity(ids.len());
        for &id in ids {
            if members.insert(id) {
                unique.push(id);
            }
        }
        // How many of each member's dependants are members too.
        let mut inside: HashMap<OperationId, usize> = HashMap::new();
        for &id in &unique {
            let op = operation_mut(self, id, operation)?;
            expect_state(op, OperationState::Registered, "cancel")?;
            for dependency in &op.metadata.dependencies {
                if members.contains(dependency) {
                    *inside.entry(*dependency).or_default() += 1;
                }
            }
        }
        for &id in &unique {
            let dependants = self.operations[&id].dependants;
            if dependants > inside.get(&id).copied().unwrap_or(0) {
                return Err(EventError::InvalidState {
                    id,
                    action: "cancel",
                    state: "a dependency of registered operations",
                });
            }
        }
        let removed: Vec<_> = unique
            .iter()
            .map(|id| {
                self.operations
                    .remove(id)
                    .expect("looked up under the same lock")
            })
            .collect();
        let mut withdrawn = Vec::with_capacity(removed.len());
        for (id, op) in unique.into_iter().zip(removed) {
            for dependency in &op.metadata.dependencies {
                if members.contains(dependency) {
                    continue;
                }
                if let Some(dep) = self.operations.get_mut(dependency) {
                    dep.dependants = dep.dependants.saturating_sub(1);
                }
                self.try_retire(*dependency);
            }
            self.cancelled.insert(id);
            withdrawn.push((id, op.callbacks));
        }
        Ok(withdrawn)
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
    /// depend on it (they would lose the order it stands for: cancel them first, or together
    /// with it through [`cancel_operations`](Self::cancel_operations)).
    pub fn cancel_operation(&self, id: OperationId) -> Result<()> {
        self.cancel_withdrawn(&[id], "cancel_operation")
    }

    /// Withdraws every one of `ids` at once, as [`cancel_operation`](Self::cancel_operation)
    /// withdraws one: each must be registered and never begun, and a registered operation may
    /// depend on one of them only if it is among `ids` too. All are withdrawn or none. This is
    /// how operations that depend on each other go, a dependency cycle closed by mistake among
    /// them (its members can never begin, and each is a dependency of another).
    ///
    /// ```no_run
    /// # use cuweave_event::{OperationCoordinator, OperationType, EventPriority};
    /// # fn example(coordinator: &OperationCoordinator, a: cuweave_event::OperationId, b: cuweave_event::OperationId) -> cuweave_event::Result<()> {
    /// // a and b were made to depend on each other: neither can begin, nor go alone.
    /// assert!(!coordinator.detect_deadlocks().is_empty());
    /// coordinator.cancel_operations(&[a, b])?;
    /// assert!(coordinator.detect_deadlocks().is_empty());
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`cancel_operation`](Self::cancel_operation), for the first id found refused;
    /// nothing is withdrawn then.
    pub fn cancel_operations(&self, ids: &[OperationId]) -> Result<()> {
        self.cancel_withdrawn(ids, "cancel_operations")
    }

    fn cancel_withdrawn(&self, ids: &[OperationId], operation: &'static str) -> Result<()> {
        let withdrawn = self.inner.state.lock().cancel_all(ids, operation)?;
        MetricsCell::add(&self.inner.metrics.cancelled, withdrawn.len() as u64);
        // A `wait_until_ready` on a dependant of a dependency looks again.
        self.inner.changed.notify_all();
        for (id, callbacks) in withdrawn {
            let panicked = run_callbacks(id, callbacks, &Err(EventError::Cancelled { id }));
            if panicked > 0 {
                MetricsCell::add(&self.inner.metrics.callback_panics, panicked);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::{Operation, OperationType};

    impl State {
        /// `cancel_operation`'s step for one id.
        fn cancel(&mut self, id: OperationId) -> Result<()> {
            self.cancel_all(&[id], "cancel_operation").map(drop)
        }
    }

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
    fn a_cycle_goes_only_as_a_whole_and_lets_its_outside_dependency_retire() {
        let mut state = State::default();
        let upload = register(&mut state, Vec::new());
        let a = register(&mut state, vec![upload]);
        let b = register(&mut state, vec![upload, a]);
        // a depends on b too: the cycle a <-> b.
        state
            .operations
            .get_mut(&a)
            .unwrap()
            .metadata
            .dependencies
            .push(b);
        state.operations.get_mut(&b).unwrap().dependants += 1;
        state.operations.get_mut(&upload).unwrap().metadata.state = OperationState::Completed;
        let outside = register(&mut state, vec![b]);
        for alone in [a, b] {
            assert!(matches!(
                state.cancel(alone),
                Err(EventError::InvalidState { .. })
            ));
        }
        // `outside` depends on b: the pair cannot go without it, and nothing goes.
        assert!(matches!(
            state.cancel_all(&[a, b], "cancel_operations"),
            Err(EventError::InvalidState { id, .. }) if id == b
        ));
        assert!(state.operations.contains_key(&a));
        let withdrawn = state
            .cancel_all(&[outside, b, a, b], "cancel_operations")
            .unwrap();
        let ids: Vec<OperationId> = withdrawn.iter().map(|(id, _)| *id).collect();
        assert_eq!(
            ids,
            vec![outside, b, a],
            "in the order given, duplicates once"
        );
        assert!(
            state.is_retired(upload),
            "nothing holds the completed upload"
        );
        assert!(state.operations.is_empty());
        for id in [a, b, outside] {
            assert_eq!(state.state_of(id), None, "reads unknown, not retired");
        }
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
        assert_eq!(state.cancelled.runs(), 1, "consecutive ids are one run");
        assert!(state.operations.is_empty());
        for id in &ids {
            assert_eq!(state.state_of(*id), None, "every one reads unknown");
        }
    }

    /// Cancellations between completions are one run each: the oldest runs go past the bound,
    /// and only those read as retired.
    #[test]
    fn cancelled_runs_are_merged_and_bounded() {
        let mut state = State::default();
        let mut cancelled = Vec::new();
        let mut kept = Vec::new();
        for _ in 0..CANCELLED_KEPT + 10 {
            let id = register(&mut state, Vec::new());
            state.cancel(id).unwrap();
            cancelled.push(id);
            // A registered id in between keeps the cancelled ones apart.
            kept.push(register(&mut state, Vec::new()));
        }
        assert_eq!(state.cancelled.runs(), CANCELLED_KEPT);
        assert_eq!(state.state_of(cancelled[10]), None);
        assert_eq!(
            state.state_of(cancelled[9]),
            Some(OperationState::Completed),
            "the oldest runs are forgotten (documented)"
        );
        // The registered ones between them, cancelled now (4,106 cancellations later than the
        // first loop's, so those runs are forgotten one by one as these come), keep the bound,
        // and the latest reads unknown.
        let last_kept = *kept.last().unwrap();
        for id in kept {
            state.cancel(id).unwrap();
            assert!(state.cancelled.runs() <= CANCELLED_KEPT);
        }
        assert_eq!(state.state_of(last_kept), None);
        assert!(state.operations.is_empty());
    }

    /// An operation registered first and withdrawn after 4,200 separate withdrawals has the
    /// lowest id but is the latest cancellation: it reads unknown, never completed, and the run
    /// forgotten is the one cancelled longest ago.
    #[test]
    fn the_run_forgotten_is_the_least_recently_cancelled_not_the_lowest_id() {
        let mut state = State::default();
        let early = register(&mut state, Vec::new());
        let mut cancelled = Vec::new();
        for _ in 0..CANCELLED_KEPT + 100 {
            let id = register(&mut state, Vec::new());
            state.cancel(id).unwrap();
            cancelled.push(id);
            register(&mut state, Vec::new());
        }
        state.cancel(early).unwrap();
        assert_eq!(state.cancelled.runs(), CANCELLED_KEPT);
        assert_eq!(
            state.state_of(early),
            None,
            "the latest cancellation reads unknown"
        );
        assert_eq!(state.state_of(*cancelled.last().unwrap()), None);
        assert_eq!(
            state.state_of(cancelled[100]),
            Some(OperationState::Completed),
            "the least recently cancelled run is the one forgotten"
        );
        assert_eq!(state.state_of(cancelled[101]), None);
    }

    #[test]
    fn runs_join_from_either_side_and_ignore_repeats() {
        let mut cancelled = Cancelled::default();
        let id = |n| OperationId::new(1, n);
        for n in [5, 7, 6, 6, 9, 4] {
            cancelled.insert(id(n));
        }
        assert_eq!(
            cancelled
                .runs
                .iter()
                .map(|(&a, &(b, _))| (a, b))
                .collect::<Vec<_>>(),
            [(4, 7), (9, 9)]
        );
        for (n, inside) in [
            (3, false),
            (4, true),
            (7, true),
            (8, false),
            (9, true),
            (10, false),
        ] {
            assert_eq!(cancelled.contains(id(n)), inside, "{n}");
        }
    }
}
