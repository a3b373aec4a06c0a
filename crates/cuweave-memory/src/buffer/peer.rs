//! Copies between buffers of two devices (or one), with `cuMemcpyPeerAsync`: [`copy_peer`],
//! which returns once the copy has finished, and [`copy_peer_async`], ordered on a stream of
//! each device without the host waiting (PyTorch's `tensor.to(other_device, non_blocking=True)`).
//!
//! [`Buffer::copy_range_from`] refuses buffers of different devices; the transfer layer moves
//! bytes between devices through these functions, after enabling peer access where the devices
//! allow it (the driver stages the copy through the host where they do not).

use cuweave_driver::graph::{StatusCheck, refuse_recording};
use cuweave_driver::memory;
use cuweave_driver::{EventPool, Stream};

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

/// Copies `len` elements of `src` from `src_offset` into `dst` at `dst_offset` with
/// `cuMemcpyPeerAsync`, ordered on `dst_stream` (on `dst`'s device) and `src_stream` (on
/// `src`'s device), and returns without waiting for it: the device-to-device copy of a model
/// split across GPUs, or PyTorch's `tensor.to(other_device, non_blocking=True)`.
///
/// Ordering, all device-side (the two streams may be on different devices, or the same one):
/// `src_stream` waits for `src`'s last write, `dst_stream` waits for that point and for every
/// earlier use of `dst`, then the copy runs on `dst_stream` and is recorded as `dst`'s last
/// write there; `src_stream` then waits for the copy, and the copy's read of `src` is recorded
/// on it. So later work on `dst` (on any stream) waits for the copy, a later write of `src`
/// (on any stream) or its drop waits for the copy to have read it, and work queued on
/// `src_stream` afterwards runs after the copy, as PyTorch orders a cross-device copy on the
/// current streams of both devices.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::buffer::{Buffer, DeviceBuffer, copy_peer_async};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let (gpu0, gpu1) = (Context::primary(Device::get(0)?)?, Context::primary(Device::get(1)?)?);
/// let (s0, s1) = (
///     Stream::new(&gpu0, StreamFlags::NON_BLOCKING)?,
///     Stream::new(&gpu1, StreamFlags::NON_BLOCKING)?,
/// );
/// let activations = DeviceBuffer::from_slice(&gpu0, &[1.0f32; 1024])?;
/// let mut next_stage = DeviceBuffer::<f32>::new_on(&s1, 1024)?;
/// copy_peer_async(&mut next_stage, 0, &activations, 0, 1024, &s1, &s0)?;
/// // Work queued on `s1` now sees the activations; `activations` may be dropped at once.
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// `ZeroLength` / `OutOfRange` for bad ranges on either side; `WrongDevice` when `dst_stream`
/// is not on `dst`'s device or `src_stream` not on `src`'s; `GraphError::Capturing` when either
/// stream is capturing (the copy would become a graph node whose read of `src` nothing
/// records), all before anything is queued; the driver's error otherwise. When the copy was
/// queued but its read of `src` could not be recorded behind it, the host waits for
/// `dst_stream` before the error is returned, so `src` is never freed under the copy.
pub fn copy_peer_async<T, D, S>(
    dst: &mut D,
    dst_offset: usize,
    src: &S,
    src_offset: usize,
    len: usize,
    dst_stream: &Stream,
    src_stream: &Stream,
) -> Result<()>
where
    T: Element,
    D: Buffer<T> + ?Sized,
    S: Buffer<T> + ?Sized,
{
    const OP: &str = "copy_peer_async";
    const WHY: &str = "a peer copy on a capturing stream would be a graph node whose read of the source no tracker records";
    let (dst, src) = (dst.core(), src.core());
    let (dst_span, src_span) = (
        dst.span(OP, dst_offset, len)?,
        src.span(OP, src_offset, len)?,
    );
    tracker::ensure_same_device(OP, dst.context(), dst_stream)?;
    tracker::ensure_same_device(OP, src.context(), src_stream)?;
    refuse_recording(dst_stream, StatusCheck::Always, OP, WHY)?;
    refuse_recording(src_stream, StatusCheck::Always, OP, WHY)?;
    let src_events = EventPool::for_context(src.context())?;
    let dst_events = EventPool::for_context(dst.context())?;
    let src_part = [(src.part_of(src_span), tracker::Access::Read)];
    // 1. `src_stream` waits for `src`'s last write; `src_ready` marks that point. The read is
    //    recorded here too, and re-recorded behind the copy in step 3: until then `src` stays
    //    borrowed by this call, so no writer (which needs it mutably) nor drop comes between.
    let src_ready = src_events.acquire_owned(false)?;
    tracker::run_uses(OP, src_stream, &src_part, || {
        src_ready.record(src_stream)?;
        Ok(())
    })?;
    // 2. The copy, on `dst_stream`, after `dst`'s earlier uses and `src_ready`; recorded as
    //    `dst`'s last write.
    let dst_part = [(dst.part_of(dst_span), tracker::Access::Write)];
    tracker::run_uses(OP, dst_stream, &dst_part, || {
        dst_stream.wait_event(&src_ready)?;
        // SAFETY: both spans come from live, range-checked buffers; the copy is ordered after
        // `dst`'s earlier uses (by `run_uses`) and after `src`'s last write (`src_ready`), and
        // is recorded as `dst`'s write and, below, as `src`'s read behind it (or the host waits
        // for it), so neither buffer is reused or freed under it.
        unsafe {
            memory::copy_peer_async(
                dst_span.ptr(),
                dst.context(),
                src_span.ptr(),
                src.context(),
                dst_span.bytes(),
                dst_stream,
            )
        }?;
        Ok(())
    })?;
    // 3. `src_stream` waits for the copy, and `src`'s read is recorded behind that wait.
    let behind = dst_events.acquire_owned(false).and_then(|copied| {
        copied.record(dst_stream)?;
        Ok(copied)
    });
    let recorded = behind.map_err(Into::into).and_then(|copied| {
        tracker::run_uses(OP, src_stream, &src_part, || {
            src_stream.wait_event(&copied)?;
            Ok(())
        })
        .map_err(Into::into)
    });
    if let Err(error) = recorded {
        // The copy may be running with no recorded read of `src` behind it: wait for it.
        if let Err(wait) = dst_stream.synchronize() {
            tracing::error!(%wait, "waiting for a peer copy whose source read could not be recorded failed");
        }
        return Err(error);
    }
    Ok(())
}
