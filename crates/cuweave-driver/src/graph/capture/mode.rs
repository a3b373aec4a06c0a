//! The calling thread's capture mode: [`CaptureMode`], the [`CaptureModeGuard`] that switches it
//! for a scope, and [`relaxed_during_captures`] for calls a capture does not record.

use super::registry::active_captures;
use crate::error::Result;
use crate::loader::{cu, driver};
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
    pub(super) fn to_sys(self) -> sys::CUstreamCaptureMode {
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

/// Puts this thread in relaxed capture mode while any capture begun through cuweave is active
/// (`None`, and no driver call, while none is): for a call that a capture does not record and
/// that is sound to make during one (allocating, freeing or pinning memory, loading or
/// unloading a module), which the driver would otherwise refuse under a global or thread-local
/// capture, breaking that capture. A capture begun outside cuweave while none of cuweave's is
/// active is not seen.
///
/// # Errors
/// The driver's error from `cuThreadExchangeStreamCaptureMode`.
pub fn relaxed_during_captures() -> Result<Option<CaptureModeGuard>> {
    (active_captures() != 0)
        .then(|| CaptureModeGuard::enter(CaptureMode::Relaxed))
        .transpose()
}

/// Puts this thread in relaxed capture mode for one call that no capture records (allocating,
/// freeing or pinning memory, making or destroying a pool, loading or unloading a module),
/// whether or not a capture is active.
///
/// [`relaxed_during_captures`] skips the switch while cuweave counts no capture, which leaves
/// a gap: another thread may begin a global capture between that check and the call, and the
/// call would then break it. These calls take microseconds or more, so the two
/// `cuThreadExchangeStreamCaptureMode` calls cost nothing that matters, and a capture begun
/// outside cuweave is covered too. Polling paths that run often keep the cheaper check.
///
/// # Errors
/// The driver's error from `cuThreadExchangeStreamCaptureMode`.
pub(crate) fn relaxed_for_unrecorded_call() -> Result<CaptureModeGuard> {
    CaptureModeGuard::enter(CaptureMode::Relaxed)
}

/// Runs `f` (a stream-ordered allocation or free: `cuMemAllocAsync`, `cuMemAllocFromPoolAsync`,
/// `cuMemFreeAsync`) with no capture able to begin meanwhile, in relaxed capture mode while one
/// is active: the driver counts these calls on an eager stream as unsafe under another thread's
/// global-mode capture and breaks it (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, seen on the GPU),
/// while on a capturing stream they are recorded as graph nodes whatever the mode. Costs an
/// atomic add, a fence and a load while no capture is active (the mode switch only while one
/// is, which a capture begin cannot race).
///
/// # Errors
/// `f`'s error; the driver's error from `cuThreadExchangeStreamCaptureMode`.
pub(crate) fn relaxed_beside_captures<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    super::outside::between_capture_begins(|| {
        let _relaxed = if super::registry::active_captures() != 0 {
            Some(relaxed_for_unrecorded_call()?)
        } else {
            None
        };
        f()
    })
}

/// This thread's capture mode, read by exchanging it with itself.
pub(super) fn thread_capture_mode() -> Result<CaptureMode> {
    let api = driver()?;
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: valid in-out pointer; exchanging is legal during capture.
    unsafe { cu!(api.thread_exchange_stream_capture_mode(&mut mode)) }?;
    let current = mode;
    // SAFETY: as above; puts the original mode back.
    unsafe { cu!(api.thread_exchange_stream_capture_mode(&mut mode)) }?;
    Ok(CaptureMode::from_sys(current))
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
