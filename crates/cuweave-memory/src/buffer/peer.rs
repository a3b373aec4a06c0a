//! [`copy_peer`]: a copy between buffers of two devices (or one), with `cuMemcpyPeerAsync`.
//!
//! [`Buffer::copy_range_from`] refuses buffers of different devices; the transfer layer moves
//! bytes between devices through this function, after enabling peer access where the devices
//! allow it (the driver stages the copy through the host where they do not).

use cuweave_driver::Stream;
use cuweave_driver::memory;

use super::common::Buffer;
use super::tracker;
use crate::element::Element;
use crate::error::Result;

/// Copies `len` elements of `src` from `src_offset` into `dst` at `dst_offset` with
/// `cuMemcpyPeerAsync` on `stream`, and returns once the copy has finished.
///
/// `src` and `dst` may live on different devices (or on the same one); `stream` must run on
/// `dst`'s device. Every earlier use of both buffers has finished before the copy starts:
/// `stream` waits for `dst`'s last use device-side, and the host waits for `src`'s (it may be
/// on another device). The copy is recorded as `dst`'s last use.
///
/// # Errors
/// `ZeroLength` / `OutOfRange` for bad ranges on either side, `WrongDevice` when `stream` is not
/// on `dst`'s device, `GraphError::Capturing` on a capturing stream (or while a capture forbids
/// the wait), the driver's error otherwise.
pub fn copy_peer<T, D, S>(
    dst: &mut D,
    dst_offset: usize,
    src: &S,
    src_offset: usize,
    len: usize,
    stream: &Stream,
) -> Result<()>
where
    T: Element,
    D: Buffer<T> + ?Sized,
    S: Buffer<T> + ?Sized,
{
    const OP: &str = "copy_peer";
    // A blocking copy: on a capturing stream the copy would be recorded, not run, and the wait
    // for it refused, leaving a node that reads `src` whenever the graph runs while nothing
    // records that read. Refused before anything is queued.
    cuweave_driver::graph::refuse_while_capturing(Some(stream), OP)?;
    let (dst, src) = (dst.core(), src.core());
    let (dst_span, src_span) = (
        dst.span(OP, dst_offset, len)?,
        src.span(OP, src_offset, len)?,
    );
    src.tracker().synchronize()?;
    let uses = [(dst.part_of(dst_span), tracker::Access::Write)];
    tracker::run_uses(OP, stream, &uses, || {
        // SAFETY: both spans come from live, range-checked buffers that the caller borrows until
        // this function returns; `src` has no queued work left (synchronized above) and `dst`'s
        // earlier uses are ordered before the copy by `run`. The function returns only after
        // `stream` has passed the copy (synchronized below), or after `run` settled the stream
        // on failure, so neither buffer can be freed under it.
        unsafe {
            memory::copy_peer_async(
                dst_span.ptr(),
                dst.context(),
                src_span.ptr(),
                src.context(),
                dst_span.bytes(),
                stream,
            )
        }?;
        Ok(())
    })?;
    stream.synchronize()?;
    Ok(())
}
