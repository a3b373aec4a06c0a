//! Which buffer operations a stream capture can hold, decided before anything is queued.
//!
//! A capture records the work queued on a stream into a graph, which runs it at every launch.
//! Some operations cannot be recorded, and the driver answers them by invalidating the whole
//! capture (the user loses the graph being built): a copy between the device and *pageable*
//! host memory (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`), a host function (which cuweave's driver
//! layer refuses on a capturing stream). This module refuses such operations with
//! [`MemoryError::NotCapturable`] first, before the tracker queues any wait, so the capture stays
//! valid.
//!
//! A copy from or into *pinned* memory (a [`PinnedBuffer`](super::PinnedBuffer) host side) is
//! capturable: the graph's memcpy node reads or writes that host memory at every launch, and the
//! pinned buffer's own tracker records the captured use, so its drop keeps the memory for the
//! graphs of that capture (see [`PinnedBuffer`](super::PinnedBuffer)'s drop). `Vec<T>` and
//! `Box<[T]>` host sides are always treated as pageable: nothing ties their memory to the graph.

use cuweave_driver::Stream;
use cuweave_driver::graph::{StatusCheck, active_captures};

use crate::error::{MemoryError, Result};

/// Why a pageable host side is refused.
pub(crate) const PAGEABLE: &str = "a copy between the device and pageable host memory (a Vec or Box host side) cannot be captured; stage it in a PinnedBuffer, whose memory the graph keeps";
/// Why a copy that returns once it has landed is refused.
pub(crate) const BLOCKING: &str =
    "it returns once the copy has landed, but captured work runs only when the graph is launched";
/// Why a chunk with a completion mark behind it is refused.
pub(crate) const MARKED: &str = "the completion mark behind the chunk is a host-visible write that runs once, not at every launch; use the event-tracked chunk copy";
/// Why a fill of a value that no memset can write is refused.
pub(crate) const PATTERN_FILL: &str = "the value is not byte-, 2-byte- or 4-byte-periodic at this alignment, so it would be staged from pageable host memory behind a host function";

/// Whether work queued on `stream` now is recorded into a capture (active or invalidated).
///
/// With [`StatusCheck::Always`] it asks the driver (one `cuStreamIsCapturing`), which also sees
/// captures begun outside cuweave; with [`StatusCheck::WhileCuweaveCaptures`] it costs one
/// atomic load while no capture begun through cuweave is active (the buffer tracker's own rule).
pub(crate) fn stream_is_capturing(stream: &Stream, check: StatusCheck) -> Result<bool> {
    if check == StatusCheck::WhileCuweaveCaptures && active_captures() == 0 {
        return Ok(false);
    }
    // The null stream's capture status is that of the thread's current context.
    stream.context().bind_to_thread()?;
    Ok(stream.is_capturing()?)
}

/// `Err(NotCapturable { operation, reason })` when `stream` is capturing; nothing is queued.
pub(crate) fn refuse_in_capture(
    operation: &'static str,
    stream: &Stream,
    check: StatusCheck,
    reason: &'static str,
) -> Result<()> {
    if stream_is_capturing(stream, check)? {
        return Err(MemoryError::NotCapturable { operation, reason });
    }
    Ok(())
}

/// For an asynchronous copy with a host side: whether it is queued into a capture (`Ok(true)`:
/// only for a pinned host side, `pinned`), or `NotCapturable` for a pageable host side on a
/// capturing stream. Pageable copies always ask the driver (they are slow anyway, and a capture
/// begun outside cuweave would be lost as surely); pinned ones follow the tracker's rule.
pub(crate) fn host_copy_captured(
    operation: &'static str,
    stream: &Stream,
    pinned: bool,
) -> Result<bool> {
    if pinned {
        return stream_is_capturing(stream, StatusCheck::WhileCuweaveCaptures);
    }
    refuse_in_capture(operation, stream, StatusCheck::Always, PAGEABLE)?;
    Ok(false)
}
