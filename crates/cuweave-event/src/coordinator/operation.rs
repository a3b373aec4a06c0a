//! `Operation`: the coordinator's record of one operation (its metadata, stream, completion
//! event, dependants and callbacks), and the lookups that find and check one.

use std::sync::Arc;
use std::time::Instant;

use cuweave_driver::OwnedPooledEvent;

use super::capture_waits::Recorded;
use super::{
    AsStream, CompletionCallback, EventMetadata, EventPriority, OperationId, OperationState,
    OperationType, State,
};
use crate::error::{EventError, Result};

pub(super) struct Operation {
    pub(super) metadata: EventMetadata,
    pub(super) stream: Option<Arc<dyn AsStream>>,
    /// The completion event (a timing event while timing is on: it also ends the GPU span).
    pub(super) done: Option<Arc<OwnedPooledEvent>>,
    /// Where `done` was recorded: eagerly or into a capture (see [`capture_waits`]).
    ///
    /// [`capture_waits`]: super::capture_waits
    pub(super) recorded: Option<Recorded>,
    pub(super) span: Option<cuweave_stream::SpanStart>,
    /// Registered operations, not yet begun, that list this one as a dependency.
    pub(super) dependants: usize,
    /// Whether the waiter watches the completion event (for callbacks).
    pub(super) watched: bool,
    /// A `complete_operation` call claimed it (still `Begun`) and is recording its event.
    pub(super) completing: bool,
    pub(super) callbacks: Vec<CompletionCallback>,
    pub(super) failure: Option<EventError>,
}

impl Operation {
    /// The capture its completion event was recorded into, if any (such an event can never be
    /// queried or waited for: the capture decides where the operation stands).
    pub(super) fn captured_into(&self) -> Option<u64> {
        self.recorded.and_then(Recorded::capture)
    }

    /// A just-registered operation of `operation_type` waiting for `dependencies` (normal
    /// priority, no description, no preferred stream).
    pub(super) fn registered(
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

pub(super) fn operation_mut<'a>(
    state: &'a mut State,
    id: OperationId,
    operation: &'static str,
) -> Result<&'a mut Operation> {
    state
        .operations
        .get_mut(&id)
        .ok_or(EventError::UnknownOperation { operation, id })
}

pub(super) fn expect_state(
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
