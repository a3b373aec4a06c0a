//! How the event layer lives beside stream captures.
//!
//! While a [`CaptureMode::Global`] capture runs on any thread, the driver (and cuweave's mirror
//! of its rule, [`refuse_while_capturing`](cuweave_driver::graph::refuse_while_capturing))
//! refuses event and stream queries and synchronisations on every thread that is not in
//! relaxed mode. Such a refusal says "not now", never "failed": the capture ends and the
//! question can be asked again. The waiter's own threads query only events recorded outside
//! captures, which no capture can be broken by, so they run in relaxed mode for their whole
//! lives ([`relaxed_thread`]); should a thread fail to enter it, its queries are made as the
//! ones below.
//!
//! The queries the layer makes of its own accord on a caller's thread (the coordinator's polls
//! and GPU-time harvests, the completion words' check of their last wake event) run inside
//! [`outside_captures`](cuweave_driver::graph::outside_captures): never while a capture begun
//! through cuweave is active, and no capture begins during them. A check of the capture count
//! followed by the query would leave a gap in which another thread's global-mode capture could
//! begin, and the query would break it. Skipped, such a query counts as "not yet".

use cuweave_driver::graph::{CaptureModeGuard, StatusCheck, refuse_recording};
use cuweave_driver::{CaptureMode, DriverError, Stream};

/// Puts the calling thread in relaxed capture mode until the guard drops (for a thread's whole
/// life: hold it at the top of the thread's body). `None`, logged, when the driver cannot (no
/// driver: there is nothing to watch then either).
pub(crate) fn relaxed_thread(thread: &'static str) -> Option<CaptureModeGuard> {
    CaptureModeGuard::enter(CaptureMode::Relaxed)
        .map_err(|error| {
            tracing::debug!(%error, thread, "cannot put the thread in relaxed capture mode");
        })
        .ok()
}

/// Refuses, with [`GraphError::Capturing`](cuweave_driver::graph::GraphError::Capturing), a wait on `stream` while it is capturing: the
/// marker the wait queues (a completion-word write, an event record, a host function) would be
/// recorded into the graph instead of run, so the wait would never resolve and its word would
/// stay lent for ever. Called before anything is queued or leased.
///
/// The driver's rule ([`refuse_recording`] with [`StatusCheck::WhileCuweaveCaptures`], which
/// also makes the stream's context current before asking): one atomic load while no capture
/// begun through cuweave is active; while one is, the driver is asked about `stream` (which also
/// catches streams forked into a capture). A capture begun outside cuweave with no cuweave
/// capture active is not seen.
///
/// # Errors
/// [`GraphError::Capturing`](cuweave_driver::graph::GraphError::Capturing) naming `operation`; the driver's error when the status query
/// fails.
pub(crate) fn refuse_capturing_stream(
    stream: &Stream,
    operation: &'static str,
) -> Result<(), DriverError> {
    refuse_recording(
        stream,
        StatusCheck::WhileCuweaveCaptures,
        operation,
        "the stream is capturing: a wait queued on it would be recorded into the graph, not run, and never resolve",
    )
}
