//! The coordinator's questions about its graph: what is ready, what is deadlocked, what stalls.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use cuweave_stream::DependencyGraph;

use super::metrics::MetricsCell;
use super::{EventPriority, OperationCoordinator, OperationId, OperationState, State};
use crate::error::{EventError, Result};

impl OperationCoordinator {
    /// Registered operations whose dependencies are all queued, most urgent first (ties in
    /// registration order). O(live operations).
    pub fn ready_operations(&self) -> Vec<OperationId> {
        let _timed = self.timed();
        self.inner.poll();
        let state = self.inner.state.lock();
        let mut ready: Vec<(EventPriority, OperationId)> = state
            .operations
            .values()
            .filter(|op| op.metadata.state == OperationState::Registered)
            .filter(|op| {
                op.metadata
                    .dependencies
                    .iter()
                    .all(|dep| is_queued(&state, *dep))
            })
            .map(|op| (op.metadata.priority, op.metadata.id))
            .collect();
        ready.sort_unstable();
        ready.into_iter().map(|(_, id)| id).collect()
    }

    /// Every cycle among operations not yet begun (they can never begin), each listed once,
    /// starting at its lowest id and following dependencies (`[a, b]`: `a` waits for `b`, which
    /// waits for `a`). Built on the stream layer's [`DependencyGraph`] (the one graph module
    /// of cuweave), over live operations only: a retired one depends on nothing.
    pub fn detect_deadlocks(&self) -> Vec<Vec<OperationId>> {
        let _timed = self.timed();
        let cycles = {
            let state = self.inner.state.lock();
            let mut graph = DependencyGraph::new();
            for op in state.operations.values() {
                for dep in &op.metadata.dependencies {
                    if state.operations.contains_key(dep) {
                        graph.add_unchecked(op.metadata.id.get(), dep.get());
                    }
                }
            }
            graph
                .elementary_cycles()
                .into_iter()
                .map(|cycle| {
                    cycle
                        .into_iter()
                        .map(|number| OperationId::new(state.coordinator, number))
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        };
        if !cycles.is_empty() {
            tracing::warn!(cycles = cycles.len(), "dependency cycles found");
            MetricsCell::add(&self.inner.metrics.deadlock_detections, 1);
            MetricsCell::add(&self.inner.metrics.cycles_found, cycles.len() as u64);
        }
        cycles
    }

    /// Operations registered at least `older_than` ago that still wait for dependencies that
    /// are not queued, with those dependencies.
    pub fn stalled_operations(&self, older_than: Duration) -> Vec<(OperationId, Vec<OperationId>)> {
        self.inner.poll();
        let state = self.inner.state.lock();
        let mut stalled: Vec<_> = state
            .operations
            .values()
            .filter(|op| op.metadata.state == OperationState::Registered)
            .filter(|op| op.metadata.registered_at.elapsed() >= older_than)
            .map(|op| (op.metadata.id, state.blocked_on(op.metadata.id)))
            .filter(|(_, blocked)| !blocked.is_empty())
            .collect();
        stalled.sort_unstable();
        stalled
    }

    /// Blocks until every dependency of `id` is queued (so it can begin), for at most
    /// `timeout`. Returns `Ok` at once, or as soon as it happens, when `id` has retired (it
    /// began and completed meanwhile, on another thread).
    ///
    /// # Errors
    /// [`EventError::Stalled`] with the dependencies still not queued when the time is up;
    /// [`EventError::DependencyCycle`] at once (looked for before waiting, and again after
    /// each completion or added dependency while it waits) when `id` is in a dependency cycle,
    /// which no wait can resolve; [`EventError::Cancelled`] when `id` is cancelled
    /// ([`cancel_operation`](Self::cancel_operation)) while this waits; `UnknownOperation`.
    pub fn wait_until_ready(&self, id: OperationId, timeout: Duration) -> Result<()> {
        let started = Instant::now();
        // A timeout past what a clock can hold (`Duration::MAX`) waits as long as it takes.
        let deadline = started.checked_add(timeout);
        let mut state = self.inner.state.lock();
        if state.is_retired(id) {
            return Ok(());
        }
        if !state.operations.contains_key(&id) {
            return Err(EventError::UnknownOperation {
                operation: "wait_until_ready",
                id,
            });
        }
        let mut timed_out = false;
        loop {
            // Cancelled while this waited (`cancel_operation` notifies): it will never begin,
            // and an empty `blocked_on` of an id no longer registered must not read as ready.
            if !state.operations.contains_key(&id) && !state.is_retired(id) {
                return Err(EventError::Cancelled { id });
            }
            let blocked_on = state.blocked_on(id);
            if blocked_on.is_empty() {
                return Ok(());
            }
            if timed_out {
                tracing::warn!(%id, ?blocked_on, "operation stalled");
                return Err(EventError::Stalled {
                    id,
                    waited: started.elapsed(),
                    blocked_on,
                });
            }
            // Waiting cannot help an operation in a cycle (`add_dependency` may close one
            // while this waits: it notifies, and the cycle is looked for again).
            if let Some(cycle) = state.cycle_through(id) {
                return Err(EventError::DependencyCycle { id, cycle });
            }
            timed_out = match deadline {
                Some(deadline) => self
                    .inner
                    .changed
                    .wait_until(&mut state, deadline)
                    .timed_out(),
                None => {
                    self.inner.changed.wait(&mut state);
                    false
                }
            };
        }
    }
}

impl State {
    /// The rule an operation's dependencies must meet for it to begin: each is queued (its
    /// completion event exists), completed or retired. `id` is the operation they belong to
    /// ([`OperationId::UNREGISTERED`] for a check made before registering).
    ///
    /// # Errors
    /// `UnknownOperation` (named after `operation`) for a dependency never registered;
    /// `DependencyNotQueued` for the first one registered, begun or failed.
    pub(super) fn check_queued(
        &self,
        id: OperationId,
        dependencies: &[OperationId],
        operation: &'static str,
    ) -> Result<()> {
        for &dependency in dependencies {
            match self.state_of(dependency) {
                None => {
                    return Err(EventError::UnknownOperation {
                        operation,
                        id: dependency,
                    });
                }
                Some(state) if !state.is_queued() => {
                    return Err(EventError::DependencyNotQueued { id, dependency });
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// A dependency cycle through `id` among operations not yet begun (only those can form
    /// one: `add_dependency` refuses begun operations, and an operation begins only once its
    /// dependencies are queued), listed as `detect_deadlocks` lists cycles: from its lowest id,
    /// each followed by one it depends on. `None` when `id` is in none. A breadth-first search
    /// from `id`'s dependencies, so O(live operations); asked only when `id` cannot begin.
    pub(super) fn cycle_through(&self, id: OperationId) -> Option<Vec<OperationId>> {
        let registered = |op: OperationId| {
            self.operations
                .get(&op)
                .filter(|op| op.metadata.state == OperationState::Registered)
        };
        // Who reached each operation first (the one depending on it), to walk the path back.
        let mut reached_from: HashMap<OperationId, OperationId> = HashMap::new();
        let mut frontier = VecDeque::from([id]);
        while let Some(at) = frontier.pop_front() {
            let Some(op) = registered(at) else { continue };
            for &dependency in &op.metadata.dependencies {
                if dependency == id {
                    let mut cycle = vec![at];
                    while let Some(&before) = reached_from.get(cycle.last().expect("non-empty")) {
                        cycle.push(before);
                    }
                    // `cycle` runs from the last dependant back to `id`: reverse it into
                    // dependency order, then start it at its lowest id.
                    cycle.reverse();
                    let lowest = (0..cycle.len()).min_by_key(|&i| cycle[i]).unwrap_or(0);
                    cycle.rotate_left(lowest);
                    return Some(cycle);
                }
                if registered(dependency).is_some() && !reached_from.contains_key(&dependency) {
                    reached_from.insert(dependency, at);
                    frontier.push_back(dependency);
                }
            }
        }
        None
    }

    /// The dependencies of `id` that are not queued yet; none once `id` is no longer live
    /// (it retired while a caller waited for it to become ready: it began, so it was ready).
    pub(super) fn blocked_on(&self, id: OperationId) -> Vec<OperationId> {
        self.operations.get(&id).map_or_else(Vec::new, |operation| {
            operation
                .metadata
                .dependencies
                .iter()
                .copied()
                .filter(|dep| !is_queued(self, *dep))
                .collect()
        })
    }
}

/// Whether `id`'s completion event exists or it already completed (a retired id did).
fn is_queued(state: &State, id: OperationId) -> bool {
    state.state_of(id).is_some_and(OperationState::is_queued)
}
