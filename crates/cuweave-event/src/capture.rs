//! How the event layer lives beside stream captures.
//!
//! While a [`CaptureMode::Global`] capture runs on any thread, the driver (and cuweave's mirror
//! of its rule, [`refuse_while_capturing`](cuweave_driver::graph::refuse_while_capturing))
//! refuses event and stream queries and synchronisations on every thread that is not in
//! relaxed mode. Such a refusal says "not now", never "failed": the capture ends and the
//! question can be asked again. The waiter's own threads query only events recorded outside
//! captures, which no capture can be broken by, so they run in relaxed mode for their whole
//! lives ([`relaxed_thread`]).

use cuweave_driver::graph::CaptureModeGuard;
use cuweave_driver::{CaptureMode, DriverError, GraphError};

/// Whether `error` is a capture refusal ([`GraphError::Capturing`]): the call would have
/// broken an active capture and was not made. Not a failure of the work asked about.
pub(crate) fn is_refusal(error: &DriverError) -> bool {
    matches!(error, DriverError::Graph(GraphError::Capturing { .. }))
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_capture_refusal_is_a_refusal() {
        let refusal = DriverError::Graph(GraphError::Capturing {
            operation: "Event::query",
            reason: "a blocking call or event query now would invalidate the capture",
        });
        assert!(is_refusal(&refusal));
        let invalidated = DriverError::Graph(GraphError::CaptureInvalidated {
            broken_by: None,
            code_name: None,
        });
        assert!(!is_refusal(&invalidated));
        let sticky = DriverError::Cuda {
            code: 719,
            operation: "cuEventQuery",
        };
        assert!(!is_refusal(&sticky));
    }
}
