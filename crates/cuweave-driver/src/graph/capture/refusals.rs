//! The checks that refuse, before anything is queued, a call that would break a capture: a
//! blocking call or query ([`refuse_while_capturing`]), work that must not be recorded into a
//! graph ([`refuse_recording`]), a wait across a capture's boundary
//! ([`refuse_wait_across_capture`]), a use of the legacy default stream beside a blocking
//! stream's capture ([`refuse_legacy_stream_use`], [`refuse_on_legacy_stream`]). Each costs one
//! atomic load while no capture is active.

use std::sync::atomic::Ordering;

use super::begin_end::is_legacy_default;
use super::mode::{CaptureMode, thread_capture_mode};
use super::registry::{
    BLOCKING, GLOBAL, active_captures, blocking_capture_in, this_thread_captures,
};
use crate::context::Context;
use crate::error::Result;
use crate::graph::error::GraphError;
use crate::stream::Stream;

/// Whether the calling thread may make a call that capture forbids (an event query, a
/// synchronisation, `cuMemAlloc`) without breaking some active capture: `false` while this
/// thread has a global or thread-local capture, or any thread a global one, unless this thread
/// is in relaxed mode.
fn unsafe_calls_break_a_capture() -> Result<bool> {
    // Read from the records, not a thread-local count: a capture can be ended (or its stream
    // dropped) on another thread than the one that began it.
    if GLOBAL.load(Ordering::Acquire) == 0 && !this_thread_captures() {
        return Ok(false);
    }
    Ok(thread_capture_mode()? != CaptureMode::Relaxed)
}

/// The capture `stream` records into, or `None` when it is not capturing; one atomic load
/// while no capture begun through cuweave is active.
fn capture_of(stream: &Stream) -> Result<Option<u64>> {
    if active_captures() == 0 {
        return Ok(None);
    }
    Ok(stream.capture_status()?.id())
}

/// Refuses a wait of `dependent` on work just queued on `prerequisite` that would break a
/// capture, before it is queued: a capturing `dependent` may wait only on streams of its own
/// capture (the driver refuses a dependency across the capture's boundary,
/// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`, and invalidates the capture); the legacy default
/// stream may not wait on a capturing stream (it cannot join a capture). An eager stream that
/// waits on a capturing one joins its capture, as a fork does: allowed. One atomic load while no
/// capture begun through cuweave is active.
///
/// # Errors
/// [`GraphError::Capturing`] or [`GraphError::LegacyDefaultStream`] naming `operation`; the
/// driver's error when a capture status cannot be read.
pub fn refuse_wait_across_capture(
    dependent: &Stream,
    prerequisite: &Stream,
    operation: &'static str,
) -> Result<()> {
    if active_captures() == 0 {
        return Ok(());
    }
    refuse_dependency_across_capture(dependent, capture_of(prerequisite)?.into(), operation)
}

/// Where the work a wait depends on was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecordedIn {
    /// Not known (an event never recorded through cuweave): the driver decides.
    Unknown,
    /// On a stream that was not capturing.
    Eager,
    /// Into this capture.
    Capture(u64),
}

impl From<Option<u64>> for RecordedIn {
    fn from(capture: Option<u64>) -> Self {
        capture.map_or(Self::Eager, Self::Capture)
    }
}

/// [`refuse_wait_across_capture`] for work recorded where `prerequisite` says.
pub(crate) fn refuse_dependency_across_capture(
    dependent: &Stream,
    prerequisite: RecordedIn,
    operation: &'static str,
) -> Result<()> {
    let Some(capture) = capture_of(dependent)? else {
        if dependent.is_special_handle()
            && !dependent.is_per_thread_default()
            && matches!(prerequisite, RecordedIn::Capture(_))
        {
            return Err(GraphError::LegacyDefaultStream { operation }.into());
        }
        return Ok(());
    };
    match prerequisite {
        RecordedIn::Unknown => Ok(()),
        RecordedIn::Capture(other) if other == capture => Ok(()),
        RecordedIn::Eager | RecordedIn::Capture(_) => Err(GraphError::Capturing {
            operation,
            reason: "the waiting stream is capturing and the work it would wait for is not in its capture: a wait across a capture's boundary would invalidate the capture",
        }
        .into()),
    }
}

/// Refuses, with [`GraphError::Capturing`], a call that would break an active capture:
/// one that blocks on or queries `stream` while it is capturing, or (with or without a stream)
/// any call capture forbids while this thread may not make it (see [`CaptureMode`]).
///
/// Costs one atomic load while no capture is active anywhere in the process.
///
/// # Errors
/// [`GraphError::Capturing`] naming `operation`; the driver's error when the status query fails.
#[inline]
pub fn refuse_while_capturing(stream: Option<&Stream>, operation: &'static str) -> Result<()> {
    if active_captures() == 0 {
        return Ok(());
    }
    refuse_while_capturing_slow(stream, operation)
}

#[cold]
fn refuse_while_capturing_slow(stream: Option<&Stream>, operation: &'static str) -> Result<()> {
    if let Some(stream) = stream
        && stream.capture_status()?.is_capturing()
    {
        return Err(GraphError::Capturing {
            operation,
            reason: "the stream is capturing: its work is recorded, not run, so there is nothing to wait for",
        }
        .into());
    }
    if unsafe_calls_break_a_capture()? {
        return Err(GraphError::Capturing {
            operation,
            reason: "a blocking call or event query now would invalidate the capture",
        }
        .into());
    }
    Ok(())
}

/// Refuses, with [`GraphError::Capturing`], queuing on `stream` work that must not be recorded
/// into a graph: work that is safe to run once but not to replay (a host function whose boxed
/// `FnOnce` is freed by its first run, a write into memory that may be freed before a later
/// launch of the graph). Unlike [`refuse_while_capturing`], it looks only at `stream`: queuing
/// such work on a stream that is not capturing is fine whatever else captures.
///
/// With [`StatusCheck::Always`] it asks the driver (`cuStreamIsCapturing`, one call) every time,
/// which also catches captures begun outside cuweave; with [`StatusCheck::WhileCuweaveCaptures`]
/// it costs one atomic load while no capture begun through cuweave is active, and asks the
/// driver only while one is (then it also catches streams forked into a capture and captures
/// begun outside cuweave). Whenever it asks the driver it first makes the stream's context
/// current on the calling thread, so callers need not: the null stream's capture status is that
/// of its thread's current context.
///
/// # Errors
/// [`GraphError::Capturing`] naming `operation` and `reason` when the stream is capturing
/// (active or invalidated capture); the driver's error when the stream's context cannot be
/// made current or the status query fails.
#[inline]
pub fn refuse_recording(
    stream: &Stream,
    check: StatusCheck,
    operation: &'static str,
    reason: &'static str,
) -> Result<()> {
    if check == StatusCheck::WhileCuweaveCaptures && active_captures() == 0 {
        return Ok(());
    }
    refuse_recording_slow(stream, operation, reason)
}

#[cold]
fn refuse_recording_slow(
    stream: &Stream,
    operation: &'static str,
    reason: &'static str,
) -> Result<()> {
    // The null stream's capture status is its thread's current context's.
    stream.context().bind_to_thread()?;
    if stream.is_capturing()? {
        return Err(GraphError::Capturing { operation, reason }.into());
    }
    Ok(())
}

/// When [`refuse_recording`] asks the driver whether the stream is capturing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatusCheck {
    /// Every time (one driver call): for paths whose own cost dwarfs it (`cuLaunchHostFunc`),
    /// and which must refuse captures begun outside cuweave too.
    Always,
    /// Only while a capture begun through cuweave is active (one atomic load otherwise): for
    /// hot paths.
    WhileCuweaveCaptures,
}

/// Refuses, with [`GraphError::Capturing`], a use of `context`'s legacy default stream while a
/// capture begun through cuweave on a blocking stream of that context (one made without
/// `StreamFlags::NON_BLOCKING`) is active: a blocking copy or memset (`memory::copy_htod`, ...,
/// which run on the legacy stream and then synchronise it), or work, a wait, a query or a
/// synchronisation on [`Stream::legacy_default`].
///
/// CUDA forbids it in every capture mode and from every thread: the legacy stream is ordered
/// with every blocking stream of its context, so a use of it would depend on (or make the
/// capturing stream depend on) work outside the capture. The driver answers
/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` and invalidates the capture; refused here, the capture
/// survives and the call can be made again once it ends. Captures whose origin is
/// non-blocking (every stream cuweave's stream layer makes, and [`Stream::fork`]'s children)
/// refuse nothing here.
///
/// One atomic load while no capture on a blocking stream is active. Captures begun outside
/// cuweave are not known, and a blocking stream of the context that joined a capture begun on
/// a non-blocking one (by waiting on it) is not looked at.
///
/// # Errors
/// [`GraphError::Capturing`] naming `operation`.
#[inline]
pub fn refuse_legacy_stream_use(context: &Context, operation: &'static str) -> Result<()> {
    if BLOCKING.load(Ordering::Acquire) == 0 {
        return Ok(());
    }
    refuse_legacy_stream_use_slow(context, operation)
}

#[cold]
fn refuse_legacy_stream_use_slow(context: &Context, operation: &'static str) -> Result<()> {
    if blocking_capture_in(context.as_raw() as usize) {
        return Err(GraphError::Capturing {
            operation,
            reason: "a stream of this context made without StreamFlags::NON_BLOCKING is capturing: any use of the legacy default stream would depend on it, and the driver would invalidate the capture (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)",
        }
        .into());
    }
    Ok(())
}

/// [`refuse_legacy_stream_use`] for work queued on, or a wait, query or synchronisation of,
/// `stream`: nothing to refuse unless `stream` is the legacy default stream (the null handle or
/// `CU_STREAM_LEGACY`, as [`Stream::legacy_default`] gives), then that stream's context is
/// looked at. No atomic load at all for other streams.
///
/// # Errors
/// [`GraphError::Capturing`] naming `operation`.
#[inline]
pub fn refuse_on_legacy_stream(stream: &Stream, operation: &'static str) -> Result<()> {
    if !is_legacy_default(stream.as_raw()) {
        return Ok(());
    }
    refuse_legacy_stream_use(stream.context(), operation)
}
