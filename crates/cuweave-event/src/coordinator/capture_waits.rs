//! Which dependency waits an operation may queue beside stream captures.
//!
//! `begin_operation` makes the operation's stream wait for each dependency's completion event.
//! Across a capture's boundary the driver refuses such a wait and invalidates the capture: a
//! capturing stream may not wait for an event recorded outside its capture
//! (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`). So each completion event remembers where it was
//! recorded ([`Recorded`]), and [`decide`] says, before anything is queued, whether to wait,
//! to skip the wait, or to refuse the begin with `GraphError::Capturing` (the capture stays
//! valid), by the rules the buffer trackers follow:
//!
//! | operation's stream | dependency's event | decision |
//! |---|---|---|
//! | eager | eager | wait |
//! | eager | in an active capture | wait: the stream joins the capture (a fork) |
//! | eager | in an ended capture | skip: the captured work runs at the graph's launches, ordered by their stream |
//! | capturing | in the same capture | wait (a join inside the graph) |
//! | capturing | eager, before the capture's begin synchronised the context | skip: it has finished |
//! | capturing | eager, after, or with no synchronisation | refuse |
//! | capturing | in another capture that has ended | skip: as for an eager stream (below) |
//! | capturing | in another capture still recording | refuse |
//!
//! The table holds for a dependency on the operation's own stream too. An eager stream needs
//! no wait there (stream order), but a capturing one does not inherit its stream's order: the
//! graph replays later, on whatever stream it is launched on, so eager work queued on the
//! stream before the capture began orders nothing at a launch. A same-stream dependency is
//! therefore refused exactly where the table refuses (eager work not known to have finished,
//! or another capture still recording) and skipped otherwise (no wait is queued for it).
//!
//! A dependency recorded into a capture that has ended is satisfied for every dependant,
//! eager or capturing: its work is a node of that capture's graph and runs at each of its
//! launches, which the program orders by the streams it launches graphs on (the coordinator
//! cannot see launches). This is also what a dependant finds once any poll has decided such an
//! operation (`Completed`, then retired), so whether a begin is accepted never depends on
//! whether something polled first.
//!
//! [`decide`] holds no CUDA, so the table is tested on its own.

use cuweave_driver::graph::{active_captures, capture_state, known_complete_before};
use cuweave_driver::{DriverError, GraphError, Stream};

/// Where a completion event was recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// Eagerly; `epoch` is the capture epoch read just after the record.
    Eager { epoch: u64 },
    /// Into the capture sequence `capture` (the driver's capture id).
    Captured { capture: u64 },
}

impl Recorded {
    /// Where nobody could tell (the status query failed): treated as eager work that no
    /// capture knows to have finished, so eager streams wait for it and capturing ones refuse.
    pub(crate) const UNKNOWN: Self = Self::Eager { epoch: u64::MAX };

    /// The capture an event was recorded into, if any.
    pub(crate) fn capture(self) -> Option<u64> {
        match self {
            Self::Captured { capture } => Some(capture),
            Self::Eager { .. } => None,
        }
    }
}

/// Where a captured operation stands, decided without touching its completion event: the
/// driver refuses to query or wait for an event recorded into a capture
/// (`CUDA_ERROR_CAPTURED_EVENT`), before the capture ends and after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CapturedCompletion {
    /// Its capture is still recording: later operations of the same capture wait for it
    /// inside the graph; nothing eager can.
    Recording,
    /// Its capture ended: the operation is complete as far as eager work goes (its work is a
    /// node of the capture's graph and runs at each launch, ordered by the launch's stream).
    Captured,
}

/// [`CapturedCompletion`] of an operation whose completion was recorded into `capture`.
pub(crate) fn captured_completion(
    capture: u64,
    active: impl Fn(u64) -> bool,
) -> CapturedCompletion {
    if active(capture) {
        CapturedCompletion::Recording
    } else {
        CapturedCompletion::Captured
    }
}

/// The refusal of a host wait for an operation recorded into a capture still recording.
pub(crate) fn host_wait_refusal(operation: &'static str) -> DriverError {
    GraphError::Capturing {
        operation,
        reason: "the operation was recorded into a stream capture that is still active: its work runs only when the capture's graph is launched, so no host wait can see it finish (it counts as complete once the capture ends)",
    }
    .into()
}

/// The capture a stream is recording into: its id, and the epoch before which its context's
/// eager work is known to have finished when the capture began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DependentCapture {
    pub(crate) capture: u64,
    pub(crate) complete_before: u64,
}

/// What `begin_operation` does about one dependency on another stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitDecision {
    /// Queue the device-side wait.
    Wait,
    /// Queue nothing: the wait is not needed (see the module's table).
    Skip,
    /// Refuse the begin: the wait would invalidate a capture.
    Refuse,
}

/// The rule of the module's table. `active` says whether a capture is still active.
pub(crate) fn decide(
    dependent: Option<DependentCapture>,
    recorded: Recorded,
    active: impl Fn(u64) -> bool,
) -> WaitDecision {
    match (dependent, recorded) {
        (None, Recorded::Eager { .. }) => WaitDecision::Wait,
        (None, Recorded::Captured { capture }) => {
            if active(capture) {
                WaitDecision::Wait
            } else {
                WaitDecision::Skip
            }
        }
        (Some(dependent), Recorded::Captured { capture }) if capture == dependent.capture => {
            WaitDecision::Wait
        }
        (Some(dependent), Recorded::Eager { epoch }) if epoch < dependent.complete_before => {
            WaitDecision::Skip
        }
        // Another capture's, ended: as a poll would have decided it (complete, retired).
        (Some(_), Recorded::Captured { capture }) if !active(capture) => WaitDecision::Skip,
        (Some(_), _) => WaitDecision::Refuse,
    }
}

/// Where an event just recorded on `stream` went. One atomic load while no capture begun
/// through cuweave is active.
///
/// # Errors
/// The driver's error from the capture status query.
pub(crate) fn recorded_on(stream: &Stream) -> Result<Recorded, DriverError> {
    if active_captures() != 0
        && let Some(capture) = stream.capture_status()?.id()
    {
        return Ok(Recorded::Captured { capture });
    }
    Ok(Recorded::Eager {
        epoch: capture_state().epoch,
    })
}

/// The capture `stream` records into, if any. One atomic load while no capture begun through
/// cuweave is active.
///
/// # Errors
/// The driver's error from the capture status query.
pub(crate) fn dependent_capture(stream: &Stream) -> Result<Option<DependentCapture>, DriverError> {
    if active_captures() == 0 {
        return Ok(None);
    }
    Ok(stream
        .capture_status()?
        .id()
        .map(|capture| DependentCapture {
            capture,
            complete_before: known_complete_before(capture, stream.context()),
        }))
}

/// What `begin_operation` does about one dependency on the operation's own stream: the
/// table's rule, but nothing is ever queued (an eager stream orders it already; a capturing
/// one is refused where the table refuses). `true` to refuse.
pub(crate) fn refuse_same_stream(
    dependent: Option<DependentCapture>,
    recorded: Recorded,
    active: impl Fn(u64) -> bool,
) -> bool {
    dependent.is_some() && decide(dependent, recorded, active) == WaitDecision::Refuse
}

/// Whether `error` is the driver's answer to a query, synchronisation or wait of an event whose
/// last record went into a stream capture: `CUDA_ERROR_CAPTURED_EVENT` while that capture
/// records, and `CUDA_ERROR_INVALID_VALUE` once it has ended (what the H200's driver 580 answers
/// `cuEventQuery` then; a live event gives that code for nothing else, and a dead context
/// answers with its own error). The capture was begun outside cuweave, which [`recorded_on`]
/// does not look for while no cuweave capture is active.
pub(crate) fn is_captured_event(error: &DriverError) -> bool {
    use cuweave_driver::sys::CUresult;
    matches!(
        error.code(),
        Some(CUresult::CUDA_ERROR_CAPTURED_EVENT | CUresult::CUDA_ERROR_INVALID_VALUE)
    )
}

/// Whether an operation whose completion event turned out to be recorded into a capture begun
/// outside cuweave ([`is_captured_event`]) counts as complete now: once its stream captures no
/// longer, that capture has ended ([`CapturedCompletion::Captured`]); while it captures, the
/// capture may still be recording it (asked again at a later poll). One driver call
/// (`cuStreamIsCapturing`), made only on this rare path.
///
/// # Errors
/// The driver's error from the status query.
pub(crate) fn foreign_capture_ended(stream: &Stream) -> Result<bool, DriverError> {
    Ok(!stream.is_capturing()?)
}

/// The refusal of a begin whose wait would cross a capture's boundary.
pub(crate) fn refusal() -> DriverError {
    GraphError::Capturing {
        operation: "OperationCoordinator::begin_operation",
        reason: "the operation's stream is capturing and a dependency's completion was recorded outside its capture (after the capture began, without a synchronised begin, or in another capture still recording), so nothing orders it before this operation when the graph is launched (stream order at capture time does not carry into the graph either)",
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPTURE: u64 = 7;
    const OTHER: u64 = 9;

    fn capturing(complete_before: u64) -> Option<DependentCapture> {
        Some(DependentCapture {
            capture: CAPTURE,
            complete_before,
        })
    }

    #[test]
    fn a_captured_operation_is_recording_while_its_capture_is_active_and_captured_after() {
        let active = |capture| capture == CAPTURE;
        assert_eq!(
            captured_completion(CAPTURE, active),
            CapturedCompletion::Recording
        );
        assert_eq!(
            captured_completion(OTHER, active),
            CapturedCompletion::Captured
        );
        assert_eq!(Recorded::Captured { capture: OTHER }.capture(), Some(OTHER));
        assert_eq!(Recorded::UNKNOWN.capture(), None);
    }

    #[test]
    fn an_eager_stream_waits_for_eager_work_and_active_captures_and_skips_ended_ones() {
        let active = |capture| capture == CAPTURE;
        assert_eq!(
            decide(None, Recorded::Eager { epoch: 3 }, active),
            WaitDecision::Wait
        );
        assert_eq!(
            decide(None, Recorded::Captured { capture: CAPTURE }, active),
            WaitDecision::Wait,
            "a fork into the capture"
        );
        assert_eq!(
            decide(None, Recorded::Captured { capture: OTHER }, active),
            WaitDecision::Skip,
            "an ended capture's event stands for no eager work"
        );
    }

    #[test]
    fn a_capturing_stream_joins_its_own_capture_and_skips_work_finished_before_it_began() {
        let active = |_| true;
        assert_eq!(
            decide(
                capturing(5),
                Recorded::Captured { capture: CAPTURE },
                active
            ),
            WaitDecision::Wait
        );
        assert_eq!(
            decide(capturing(5), Recorded::Eager { epoch: 4 }, active),
            WaitDecision::Skip,
            "recorded before the begin's synchronisation"
        );
    }

    #[test]
    fn a_capturing_stream_refuses_eager_work_it_cannot_know_finished_and_other_captures() {
        let active = |_| true;
        assert_eq!(
            decide(capturing(5), Recorded::Eager { epoch: 5 }, active),
            WaitDecision::Refuse,
            "recorded after the synchronisation began"
        );
        assert_eq!(
            decide(capturing(0), Recorded::Eager { epoch: 0 }, active),
            WaitDecision::Refuse,
            "a capture begun without synchronising knows nothing finished"
        );
        assert_eq!(
            decide(capturing(5), Recorded::Captured { capture: OTHER }, active),
            WaitDecision::Refuse,
            "another capture still recording"
        );
    }

    #[test]
    fn a_capturing_stream_skips_a_dependency_of_an_ended_capture_as_a_poll_would() {
        let active = |capture| capture == CAPTURE;
        assert_eq!(
            decide(capturing(5), Recorded::Captured { capture: OTHER }, active),
            WaitDecision::Skip,
            "the same answer as for the dependency once a poll decided (and retired) it"
        );
        assert_eq!(
            decide(None, Recorded::Captured { capture: OTHER }, active),
            WaitDecision::Skip
        );
    }

    #[test]
    fn a_same_stream_dependency_is_refused_exactly_where_the_table_refuses() {
        let active = |capture| capture == CAPTURE;
        // Eager stream: stream order, never refused, whatever the dependency.
        for recorded in [
            Recorded::Eager { epoch: 3 },
            Recorded::UNKNOWN,
            Recorded::Captured { capture: OTHER },
        ] {
            assert!(!refuse_same_stream(None, recorded, active), "{recorded:?}");
        }
        // Capturing stream: eager work queued before the capture is not part of the graph.
        assert!(
            refuse_same_stream(capturing(0), Recorded::Eager { epoch: 0 }, active),
            "eager, unsynchronised capture: a launch could run before it finished"
        );
        assert!(refuse_same_stream(capturing(5), Recorded::UNKNOWN, active));
        assert!(
            !refuse_same_stream(capturing(5), Recorded::Eager { epoch: 4 }, active),
            "known finished before the capture began"
        );
        assert!(
            !refuse_same_stream(
                capturing(5),
                Recorded::Captured { capture: CAPTURE },
                active
            ),
            "the same capture: ordered inside the graph"
        );
        assert!(!refuse_same_stream(
            capturing(5),
            Recorded::Captured { capture: OTHER },
            active
        ));
        let all_active = |_| true;
        assert!(refuse_same_stream(
            capturing(5),
            Recorded::Captured { capture: OTHER },
            all_active
        ));
    }
}
