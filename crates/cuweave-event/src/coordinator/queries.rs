//! The coordinator's questions about its graph: what is ready, what is deadlocked, what stalls.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::metrics::MetricsCell;
use super::{EventPriority, OperationCoordinator, OperationId, OperationState, State, graph};
use crate::error::{EventError, Result};

impl OperationCoordinator {
    /// Registered operations whose dependencies are all queued, most urgent first (ties in
    /// registration order).
    pub fn ready_operations(&self) -> Vec<OperationId> {
        let _timed = self.timed();
        let state = self.inner.state.lock();
        let mut ready: Vec<(EventPriority, OperationId)> = state
            .operations
            .values()
            .filter(|op| op.metadata.state == OperationState::Registered)
            .filter(|op| {
                op.metadata
                    .dependencies
                    .iter()
                    .all(|dep| state.operations[dep].metadata.state.is_queued())
            })
            .map(|op| (op.metadata.priority, op.metadata.id))
            .collect();
        ready.sort_unstable();
        ready.into_iter().map(|(_, id)| id).collect()
    }

    /// Every cycle among operations not yet begun (they can never begin), each listed once,
    /// starting at its lowest id and following dependencies (`[a, b]`: `a` waits for `b`, which
    /// waits for `a`).
    pub fn detect_deadlocks(&self) -> Vec<Vec<OperationId>> {
        let _timed = self.timed();
        let cycles = {
            let state = self.inner.state.lock();
            let mut ids: Vec<OperationId> = state.operations.keys().copied().collect();
            ids.sort_unstable();
            let index: HashMap<OperationId, usize> =
                ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
            let edges: Vec<Vec<usize>> = ids
                .iter()
                .map(|id| {
                    let op = &state.operations[id];
                    op.metadata
                        .dependencies
                        .iter()
                        .map(|dep| index[dep])
                        .collect()
                })
                .collect();
            graph::elementary_cycles(&edges)
                .into_iter()
                .map(|cycle| cycle.into_iter().map(|i| ids[i]).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        };
        if !cycles.is_empty() {
            tracing::warn!(cycles = cycles.len(), "dependency cycles found");
            MetricsCell::add(&self.inner.metrics.deadlock_detections, 1);
            MetricsCell::add(&self.inner.metrics.cycles_found, cycles.len() as u64);
        }
        cycles
    }

    /// The dependencies of `id` that are not queued yet.
    fn blocked_on(state: &State, id: OperationId) -> Vec<OperationId> {
        state.operations[&id]
            .metadata
            .dependencies
            .iter()
            .copied()
            .filter(|dep| !state.operations[dep].metadata.state.is_queued())
            .collect()
    }

    /// Operations registered at least `older_than` ago that still wait for dependencies that
    /// are not queued, with those dependencies.
    pub fn stalled_operations(&self, older_than: Duration) -> Vec<(OperationId, Vec<OperationId>)> {
        let state = self.inner.state.lock();
        let mut stalled: Vec<_> = state
            .operations
            .values()
            .filter(|op| op.metadata.state == OperationState::Registered)
            .filter(|op| op.metadata.registered_at.elapsed() >= older_than)
            .map(|op| (op.metadata.id, Self::blocked_on(&state, op.metadata.id)))
            .filter(|(_, blocked)| !blocked.is_empty())
            .collect();
        stalled.sort_unstable();
        stalled
    }

    /// Blocks until every dependency of `id` is queued (so it can begin), for at most
    /// `timeout`.
    ///
    /// # Errors
    /// [`EventError::Stalled`] with the dependencies still not queued when the time is up;
    /// `UnknownOperation`.
    pub fn wait_until_ready(&self, id: OperationId, timeout: Duration) -> Result<()> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut state = self.inner.state.lock();
        if !state.operations.contains_key(&id) {
            return Err(EventError::UnknownOperation {
                operation: "wait_until_ready",
                id,
            });
        }
        loop {
            let blocked_on = Self::blocked_on(&state, id);
            if blocked_on.is_empty() {
                return Ok(());
            }
            if self
                .inner
                .changed
                .wait_until(&mut state, deadline)
                .timed_out()
            {
                let blocked_on = Self::blocked_on(&state, id);
                if blocked_on.is_empty() {
                    return Ok(());
                }
                tracing::warn!(%id, ?blocked_on, "operation stalled");
                return Err(EventError::Stalled {
                    id,
                    waited: started.elapsed(),
                    blocked_on,
                });
            }
        }
    }
}
