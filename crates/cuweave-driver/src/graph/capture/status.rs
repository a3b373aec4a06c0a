//! [`CaptureStatus`]: where a stream stands with respect to capture, and the [`Stream`] methods
//! that ask (`cuStreamGetCaptureInfo`, `cuStreamIsCapturing`, the mode of a cuweave capture).

use super::begin_end::is_legacy_default;
use super::mode::CaptureMode;
use super::registry::RECORDS;
use crate::error::Result;
use crate::loader::{cu, driver};
use crate::stream::Stream;
use crate::sys;

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

impl Stream {
    /// Whether this stream is capturing, and into which capture sequence.
    /// `cuStreamGetCaptureInfo` (the `_v3` form where the driver has it, else `_v2`).
    ///
    /// The legacy default stream never captures (the driver refuses to begin a capture on it):
    /// it answers [`CaptureStatus::None`] without asking the driver, which would answer
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` while a blocking stream of its context captures.
    pub fn capture_status(&self) -> Result<CaptureStatus> {
        if is_legacy_default(self.as_raw()) {
            return Ok(CaptureStatus::None);
        }
        self.bind_if_context_relative()?;
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

    /// Whether this stream is capturing (`cuStreamIsCapturing`); `false` for the legacy default
    /// stream without asking the driver (see [`capture_status`](Self::capture_status)).
    pub fn is_capturing(&self) -> Result<bool> {
        if is_legacy_default(self.as_raw()) {
            return Ok(false);
        }
        self.bind_if_context_relative()?;
        let api = driver()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: live stream; valid out-pointer.
        unsafe { cu!(api.stream_is_capturing(self.as_raw(), &mut status)) }?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Makes the stream's context current when the handle is one of the driver's
    /// context-relative names (null, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`), which the
    /// driver resolves against the calling thread's current context: on a thread with none,
    /// or with another context current, the status would be refused or another context's.
    /// Streams this crate created name their own context and skip it.
    fn bind_if_context_relative(&self) -> Result<()> {
        if self.is_special_handle() {
            self.context().bind_to_thread()?;
        }
        Ok(())
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
