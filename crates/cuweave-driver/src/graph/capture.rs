//! Stream capture: begin and end a capture on a [`Stream`](crate::Stream), its status, the
//! thread's capture mode, and the process-wide bookkeeping that lets other code ask "is a capture
//! active?" for the price of one atomic load.
//!
//! | module | what it holds |
//! |---|---|
//! | `mode` | [`CaptureMode`], [`CaptureModeGuard`], [`relaxed_during_captures`]: the calling thread's capture mode |
//! | `status` | [`CaptureStatus`], and a stream's status (`Stream::capture_status`, `is_capturing`, `capture_mode`) |
//! | `outside` | [`outside_captures`]: work cuweave does of its own accord (queries) that no capture may begin during |
//! | `registry` | the process-wide bookkeeping: the capture count and epoch ([`active_captures`], [`capture_state`]) and the captures begun through cuweave |
//! | `failures` | the driver calls that broke a capture, remembered for [`GraphError::CaptureInvalidated`](crate::GraphError::CaptureInvalidated) |
//! | `refusals` | the checks that refuse a call that would break a capture ([`refuse_while_capturing`], [`refuse_recording`], [`refuse_wait_across_capture`], [`refuse_legacy_stream_use`], [`refuse_on_legacy_stream`]) |
//! | `begin_end` | `Stream::begin_capture`, `begin_capture_synchronized`, `end_capture`, and the end of a capture abandoned at a stream's drop |

mod begin_end;
mod failures;
mod mode;
mod outside;
mod refusals;
mod registry;
mod status;

pub use mode::{CaptureMode, CaptureModeGuard, relaxed_during_captures};
pub(crate) use mode::{relaxed_beside_captures, relaxed_for_unrecorded_call};
pub(crate) use outside::between_capture_begins;
pub use outside::{outside_captures, outside_captures_or_relaxed};
pub use refusals::{
    StatusCheck, refuse_legacy_stream_use, refuse_on_legacy_stream, refuse_recording,
    refuse_wait_across_capture, refuse_while_capturing,
};
pub(crate) use registry::captures_ended;
pub use registry::{
    CaptureState, active_captures, capture_is_active, capture_state, known_complete_before,
    note_tracked_use, wait_for_no_global_capture,
};
pub use status::CaptureStatus;

pub(crate) use failures::{note_driver_failure, translate_driver_failure};
pub(crate) use refusals::{RecordedIn, refuse_dependency_across_capture};
#[cfg(test)]
pub(crate) use registry::CAPTURE_COUNT_TEST_LOCK;
pub(crate) use registry::while_no_capture_begins;

#[cfg(test)]
mod tests;
