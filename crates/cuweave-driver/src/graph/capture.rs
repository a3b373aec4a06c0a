//! Stream capture: begin and end a capture on a [`Stream`], its status, the thread's capture
//! mode, and the process-wide bookkeeping that lets other code ask "is a capture active?" for
//! the price of one atomic load.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::error::{GraphError, capture_error_name};
use super::handle::Graph;
use crate::error::{DriverError, Result};
use crate::loader::{cu, driver};
use crate::stream::Stream;
use crate::sys;

/// How strictly the driver guards a capture against calls that are unsafe during it
/// (`cuMemAlloc`, synchronisation, querying an event recorded before the capture, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// Unsafe calls from *any* thread not in relaxed mode break the capture.
    Global,
    /// Unsafe calls from the capturing thread break the capture; other threads are free.
    /// cuweave's default: event pollers and allocators on other threads keep working.
    ThreadLocal,
    /// Nothing is checked; the caller promises not to make unsafe calls.
    Relaxed,
}

impl CaptureMode {
    fn to_sys(self) -> sys::CUstreamCaptureMode {
        match self {
            Self::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            Self::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            Self::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }

    fn from_sys(mode: sys::CUstreamCaptureMode) -> Self {
        match mode {
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL => Self::Global,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => Self::ThreadLocal,
            _ => Self::Relaxed,
        }
    }
}

/// Where a stream stands with respect to capture (`cuStreamGetCaptureInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureStatus {
    /// Not capturing: work queued on it runs.
    None,
    /// Capturing into the capture sequence `id` (unique per process run).
    Active {
        /// The capture sequence's id; streams forked into one capture share it.
        id: u64,
    },
    /// The capture `id` was invalidated; it must still be ended.
    Invalidated {
        /// The capture sequence's id.
        id: u64,
    },
}

impl CaptureStatus {
    /// Whether work queued now is recorded rather than run (active or invalidated capture).
    pub fn is_capturing(self) -> bool {
        !matches!(self, Self::None)
    }

    /// The capture sequence's id, when capturing.
    pub fn id(self) -> Option<u64> {
        match self {
            Self::None => None,
            Self::Active { id } | Self::Invalidated { id } => Some(id),
        }
    }
}

/// Captures begun through [`Stream::begin_capture`] and not yet ended.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Those of them in [`CaptureMode::Global`].
static GLOBAL: AtomicUsize = AtomicUsize::new(0);
/// Sequence number of driver failures with a capture error code.
static FAILURE_SEQ: AtomicU64 = AtomicU64::new(0);
/// How many capture failures [`FAILURES`] remembers; older ones are dropped.
const FAILURE_LOG: usize = 64;

/// A driver call that failed with a capture error while a capture was active.
#[derive(Debug, Clone, Copy)]
struct Failure {
    seq: u64,
    operation: &'static str,
    code: sys::CUresult,
}

/// The most recent capture failures, oldest first (bounded by [`FAILURE_LOG`]).
static FAILURES: Mutex<VecDeque<Failure>> = Mutex::new(VecDeque::new());

/// A capture begun here: which stream, in which mode, and the failure sequence at its start.
#[derive(Debug, Clone, Copy)]
struct Record {
    stream: u64,
    mode: CaptureMode,
    first_failure: u64,
}

/// Every capture begun through cuweave and not yet ended (few at a time: one per capturing
/// stream), so that `end_capture` knows its mode and where to look for the call that broke it.
static RECORDS: Mutex<Vec<Record>> = Mutex::new(Vec::new());

thread_local! {
    /// Captures this thread began in global or thread-local mode and has not ended.
    static THREAD_CAPTURES: Cell<usize> = const { Cell::new(0) };
}

/// How many captures begun through cuweave are active in the process: one relaxed atomic load,
/// for hot paths that must behave differently while any capture runs.
#[inline]
pub fn active_captures() -> usize {
    ACTIVE.load(Ordering::Acquire)
}

/// Called by the loader on every failed driver call: remembers capture errors while a capture
/// is active, so the capture's end can name the call that broke it.
pub(crate) fn note_driver_failure(code: sys::CUresult, operation: &'static str) {
    // `INVALIDATED` is what every call after the breaking one returns: not a cause.
    if active_captures() == 0
        || !(900..=908).contains(&code.0)
        || code == sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    {
        return;
    }
    let seq = FAILURE_SEQ.fetch_add(1, Ordering::AcqRel) + 1;
    let oldest_wanted = RECORDS
        .lock()
        .iter()
        .map(|record| record.first_failure)
        .min()
        .unwrap_or(seq);
    let mut failures = FAILURES.lock();
    // Failures no active capture can ask about go first; when the log is still full, the newest
    // is dropped, since each capture reports the *first* call that broke it.
    while failures
        .front()
        .is_some_and(|failure| failure.seq <= oldest_wanted)
    {
        failures.pop_front();
    }
    if failures.len() == FAILURE_LOG {
        return;
    }
    failures.push_back(Failure {
        seq,
        operation,
        code,
    });
}

/// The typed error for a call that failed because its capture was invalidated earlier: one
/// [`GraphError::CaptureInvalidated`] naming the first call that broke a capture, instead of the
/// driver's bare `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` on every call after it.
pub(crate) fn translate_driver_failure(code: sys::CUresult) -> Option<DriverError> {
    if code != sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED || active_captures() == 0 {
        return None;
    }
    let start = RECORDS
        .lock()
        .iter()
        .map(|record| record.first_failure)
        .min()?;
    Some(invalidated_since(start))
}

/// The first capture failure after sequence number `after`, if still remembered.
fn first_failure_after(after: u64) -> Option<Failure> {
    FAILURES
        .lock()
        .iter()
        .find(|failure| failure.seq > after)
        .copied()
}

/// Whether the calling thread may make a call that capture forbids (an event query, a
/// synchronisation, `cuMemAlloc`) without breaking some active capture: `false` while this
/// thread has a global or thread-local capture, or any thread a global one, unless this thread
/// is in relaxed mode.
fn unsafe_calls_break_a_capture() -> Result<bool> {
    let this_thread = THREAD_CAPTURES.with(Cell::get);
    if GLOBAL.load(Ordering::Acquire) == 0 && this_thread == 0 {
        return Ok(false);
    }
    Ok(thread_capture_mode()? != CaptureMode::Relaxed)
}

/// This thread's capture mode, read by exchanging it with itself.
fn thread_capture_mode() -> Result<CaptureMode> {
    let api = driver()?;
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: valid in-out pointer; exchanging is legal during capture.
    unsafe { cu!(api.thread_exchange_stream_capture_mode(&mut mode)) }?;
    let current = mode;
    // SAFETY: as above; puts the original mode back.
    unsafe { cu!(api.thread_exchange_stream_capture_mode(&mut mode)) }?;
    Ok(CaptureMode::from_sys(current))
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

/// The calling thread switched to another capture mode for a scope; the previous mode comes
/// back on drop (`cuThreadExchangeStreamCaptureMode`).
///
/// Relaxed mode is how a library makes a call it knows to be safe (an allocation that the
/// capture does not record) while a capture is active.
#[must_use = "the previous mode comes back when the guard is dropped"]
#[derive(Debug)]
pub struct CaptureModeGuard {
    previous: sys::CUstreamCaptureMode,
    /// Thread-bound: the mode is per thread.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl CaptureModeGuard {
    /// Puts this thread in `mode` until the guard is dropped.
    ///
    /// # Errors
    /// The driver's error (`Unsupported` before CUDA 10.1).
    pub fn enter(mode: CaptureMode) -> Result<Self> {
        let api = driver()?;
        let mut previous = mode.to_sys();
        // SAFETY: valid in-out pointer.
        unsafe { cu!(api.thread_exchange_stream_capture_mode(&mut previous)) }?;
        Ok(Self {
            previous,
            _not_send: std::marker::PhantomData,
        })
    }

    /// The mode the thread was in before.
    pub fn previous(&self) -> CaptureMode {
        CaptureMode::from_sys(self.previous)
    }
}

impl Drop for CaptureModeGuard {
    fn drop(&mut self) {
        let Ok(api) = driver() else { return };
        let mut mode = self.previous;
        // SAFETY: valid in-out pointer.
        if let Err(error) = unsafe { cu!(api.thread_exchange_stream_capture_mode(&mut mode)) } {
            tracing::warn!(%error, "restoring the thread's capture mode failed");
        }
    }
}

/// Whether `raw` is the legacy default stream (null or `CU_STREAM_LEGACY`).
fn is_legacy_default(raw: sys::CUstream) -> bool {
    raw as usize <= 1
}

impl Stream {
    /// Starts recording the work queued on this stream (and on streams that wait on events
    /// recorded in it) into a graph, instead of running it. `cuStreamBeginCapture_v2`.
    ///
    /// End with [`end_capture`](Self::end_capture) on this same stream.
    ///
    /// # Errors
    /// [`GraphError::LegacyDefaultStream`] for the legacy default stream;
    /// [`GraphError::AlreadyCapturing`] when a cuweave capture is active on this stream; the
    /// driver's error otherwise.
    pub fn begin_capture(&self, mode: CaptureMode) -> Result<()> {
        if is_legacy_default(self.as_raw()) {
            return Err(GraphError::LegacyDefaultStream {
                operation: "Stream::begin_capture",
            }
            .into());
        }
        if RECORDS
            .lock()
            .iter()
            .any(|record| record.stream == self.id())
        {
            return Err(GraphError::AlreadyCapturing { stream: self.id() }.into());
        }
        self.context().bind_to_thread()?;
        let api = driver()?;
        // No lock across the call: a failure goes through `note_driver_failure`, which locks.
        // SAFETY: live stream of the current context; the mode is a valid enum value.
        unsafe { cu!(api.stream_begin_capture(self.as_raw(), mode.to_sys())) }?;
        RECORDS.lock().push(Record {
            stream: self.id(),
            mode,
            first_failure: FAILURE_SEQ.load(Ordering::Acquire),
        });
        ACTIVE.fetch_add(1, Ordering::AcqRel);
        if mode == CaptureMode::Global {
            GLOBAL.fetch_add(1, Ordering::AcqRel);
        }
        if mode != CaptureMode::Relaxed {
            THREAD_CAPTURES.with(|count| count.set(count.get() + 1));
        }
        Ok(())
    }

    /// Ends the capture begun on this stream and returns what it recorded.
    /// `cuStreamEndCapture`.
    ///
    /// # Errors
    /// [`GraphError::NotCapturing`] when no capture was begun on this stream through cuweave
    /// (for instance, ending on a stream that was only forked into the capture), without
    /// touching the capture; [`GraphError::CaptureInvalidated`] naming the first call that broke
    /// it; [`GraphError::UnjoinedFork`] when a forked stream was not joined back. Either way the
    /// capture is over and the stream usable again.
    pub fn end_capture(&self) -> Result<Graph> {
        let record = {
            let records = RECORDS.lock();
            records
                .iter()
                .find(|record| record.stream == self.id())
                .copied()
        };
        let Some(record) = record else {
            return Err(GraphError::NotCapturing {
                operation: "Stream::end_capture",
                stream: self.id(),
            }
            .into());
        };
        self.context().bind_to_thread()?;
        let api = driver()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: live stream; valid out-pointer.
        let ended = unsafe { cu!(api.stream_end_capture(self.as_raw(), &mut raw)) };
        let over = match &ended {
            Ok(()) => true,
            Err(error) => !matches!(
                error.code(),
                Some(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)
            ),
        };
        if over {
            self.forget_capture(record);
        }
        match ended {
            Ok(()) if !raw.is_null() => {
                // SAFETY: the driver just created this graph and hands it to us.
                Ok(unsafe { Graph::from_raw(self.context(), raw) })
            }
            Ok(()) => Err(invalidated_since(record.first_failure)),
            Err(DriverError::Graph(GraphError::CaptureInvalidated { .. })) => {
                Err(invalidated_since(record.first_failure))
            }
            Err(error) => Err(match error.code() {
                Some(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED) => {
                    GraphError::UnjoinedFork.into()
                }
                Some(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) => {
                    invalidated_since(record.first_failure)
                }
                _ => error,
            }),
        }
    }

    fn forget_capture(&self, record: Record) {
        RECORDS.lock().retain(|other| other.stream != record.stream);
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
        if record.mode == CaptureMode::Global {
            GLOBAL.fetch_sub(1, Ordering::AcqRel);
        }
        if record.mode != CaptureMode::Relaxed {
            THREAD_CAPTURES.with(|count| count.set(count.get().saturating_sub(1)));
        }
    }

    /// Whether this stream is capturing, and into which capture sequence.
    /// `cuStreamGetCaptureInfo` (the `_v3` form where the driver has it, else `_v2`).
    pub fn capture_status(&self) -> Result<CaptureStatus> {
        let api = driver()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id = 0u64;
        if api.stream_get_capture_info_v3.is_available() {
            // SAFETY: live stream; valid out-pointers; the optional outputs are null.
            unsafe {
                cu!(api.stream_get_capture_info_v3(
                    self.as_raw(),
                    &mut status,
                    &mut id,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                ))
            }?;
        } else {
            // SAFETY: as above, for the older signature.
            unsafe {
                cu!(api.stream_get_capture_info_v2(
                    self.as_raw(),
                    &mut status,
                    &mut id,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                ))
            }?;
        }
        Ok(match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {
                CaptureStatus::Active { id }
            }
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                CaptureStatus::Invalidated { id }
            }
            _ => CaptureStatus::None,
        })
    }

    /// Whether this stream is capturing (`cuStreamIsCapturing`).
    pub fn is_capturing(&self) -> Result<bool> {
        let api = driver()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: live stream; valid out-pointer.
        unsafe { cu!(api.stream_is_capturing(self.as_raw(), &mut status)) }?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The mode of the capture begun on this stream through cuweave, if any.
    pub fn capture_mode(&self) -> Option<CaptureMode> {
        RECORDS
            .lock()
            .iter()
            .find(|record| record.stream == self.id())
            .map(|record| record.mode)
    }
}

fn invalidated_since(start: u64) -> DriverError {
    let first = first_failure_after(start);
    GraphError::CaptureInvalidated {
        broken_by: first.map(|failure| failure.operation),
        code_name: first.map(|failure| capture_error_name(failure.code)),
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_failure_log_is_bounded_and_finds_the_first_after_a_point() {
        // Not noted while no capture is active (no other test touches the counters).
        let before = FAILURE_SEQ.load(Ordering::Acquire);
        note_driver_failure(
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            "cuTest",
        );
        assert_eq!(FAILURE_SEQ.load(Ordering::Acquire), before);
        ACTIVE.fetch_add(1, Ordering::AcqRel);
        let start = FAILURE_SEQ.load(Ordering::Acquire);
        note_driver_failure(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY, "cuIgnored");
        // A consequence, not a cause: never noted.
        note_driver_failure(
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            "cuConsequence",
        );
        for _ in 0..100_000 {
            note_driver_failure(
                sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                "cuLater",
            );
        }
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
        assert!(FAILURES.lock().len() <= FAILURE_LOG);
        // With no capture recorded, nobody asks about old failures: the log keeps the newest.
        assert!(first_failure_after(start).is_some_and(|first| first.operation == "cuLater"));
        let last = FAILURE_SEQ.load(Ordering::Acquire);
        assert!(first_failure_after(last).is_none());
    }

    #[test]
    fn status_helpers() {
        assert!(!CaptureStatus::None.is_capturing());
        assert!(CaptureStatus::Active { id: 3 }.is_capturing());
        assert_eq!(CaptureStatus::Invalidated { id: 4 }.id(), Some(4));
        assert!(is_legacy_default(std::ptr::null_mut()));
        assert!(is_legacy_default(1 as sys::CUstream));
        assert!(!is_legacy_default(2 as sys::CUstream));
    }

    #[test]
    fn no_capture_means_nothing_is_refused() {
        if active_captures() == 0 {
            assert!(refuse_while_capturing(None, "op").is_ok());
        }
    }
}
