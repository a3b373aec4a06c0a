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
//! [`outside_captures`]: never while a capture begun
//! through cuweave is active, and no capture begins during them. A check of the capture count
//! followed by the query would leave a gap in which another thread's global-mode capture could
//! begin, and the query would break it. Skipped, such a query counts as "not yet". The GPU-time
//! harvest the coordinator makes before running callbacks is on a relaxed thread when the
//! reactor's callbacks make it ([`holds_relaxed_mode`]), and then queries at once, as the
//! reactor does ([`own_query`]).

use std::cell::Cell;

use cuweave_driver::graph::{CaptureModeGuard, StatusCheck, outside_captures, refuse_recording};
use cuweave_driver::{CaptureMode, DriverError, Stream};

thread_local! {
    /// Whether this thread holds a [`RelaxedThread`] (is in relaxed capture mode for its life).
    static RELAXED: Cell<bool> = const { Cell::new(false) };
}

/// A waiter thread in relaxed capture mode for its whole life ([`relaxed_thread`]); the
/// previous mode comes back when it drops. While it is held, [`holds_relaxed_mode`] says so to
/// any code of this crate that runs on the thread (the coordinator's completion handling, run
/// from the reactor's callbacks), so that it can query as the reactor does ([`own_query`]).
pub(crate) struct RelaxedThread {
    _mark: RelaxedMark,
    _mode: CaptureModeGuard,
}

/// Marks the thread relaxed in [`RELAXED`] until dropped (then puts back what was there).
/// Only made after the driver put the thread in relaxed mode; dropped before it leaves it.
struct RelaxedMark {
    previous: bool,
    /// Thread-bound: the mark is per thread.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl RelaxedMark {
    fn set() -> Self {
        Self {
            previous: RELAXED.with(|relaxed| relaxed.replace(true)),
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for RelaxedMark {
    fn drop(&mut self) {
        RELAXED.with(|relaxed| relaxed.set(self.previous));
    }
}

/// Puts the calling thread in relaxed capture mode until the guard drops (for a thread's whole
/// life: hold it at the top of the thread's body). `None`, logged, when the driver cannot (no
/// driver: there is nothing to watch then either).
pub(crate) fn relaxed_thread(thread: &'static str) -> Option<RelaxedThread> {
    let mode = CaptureModeGuard::enter(CaptureMode::Relaxed)
        .map_err(|error| {
            tracing::debug!(%error, thread, "cannot put the thread in relaxed capture mode");
        })
        .ok()?;
    // Fields drop in order: the mark goes before the mode does.
    Some(RelaxedThread {
        _mark: RelaxedMark::set(),
        _mode: mode,
    })
}

/// Whether the calling thread holds a [`RelaxedThread`]: it is one of the waiter's threads,
/// in relaxed capture mode for its life.
pub(crate) fn holds_relaxed_mode() -> bool {
    RELAXED.with(Cell::get)
}

/// Makes `ask`, a query of this layer's own accord of events recorded outside captures: at
/// once on a thread in relaxed capture mode (`relaxed`), which no capture forbids and which
/// breaks none; otherwise only inside [`outside_captures`] (`None`: skipped while a capture
/// is active or beginning). The reactor passes its own `relaxed`; code that may run on the
/// reactor or on a caller's thread passes [`holds_relaxed_mode`].
pub(crate) fn own_query<R>(relaxed: bool, ask: impl FnOnce() -> R) -> Option<R> {
    if relaxed {
        Some(ask())
    } else {
        outside_captures(ask)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relaxed_mark_is_per_thread_and_put_back_when_dropped() {
        assert!(!holds_relaxed_mode());
        let outer = RelaxedMark::set();
        assert!(holds_relaxed_mode());
        std::thread::spawn(|| assert!(!holds_relaxed_mode(), "another thread is not marked"))
            .join()
            .unwrap();
        let inner = RelaxedMark::set();
        drop(inner);
        assert!(
            holds_relaxed_mode(),
            "a nested mark puts back the outer one"
        );
        drop(outer);
        assert!(!holds_relaxed_mode());
    }

    #[test]
    fn an_own_query_runs_at_once_when_relaxed_and_outside_captures_otherwise() {
        // No capture is active here (no driver), so both run; a relaxed one never asks the
        // capture gate.
        assert_eq!(own_query(true, || 7), Some(7));
        assert_eq!(own_query(false, || 8), Some(8));
        let _mark = RelaxedMark::set();
        assert_eq!(own_query(holds_relaxed_mode(), || 9), Some(9));
    }
}
