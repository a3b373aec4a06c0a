//! Copies and memsets on raw addresses, synchronous and stream-ordered.
//!
//! The blocking forms return only once the operation has completed. The driver alone does not
//! promise that: a `cuMemcpyHtoD` from pageable memory returns once the bytes are staged, and
//! device-to-device copies and memsets return before they run (they are merely ordered on the
//! legacy default stream). So each blocking form synchronises the legacy default stream after
//! the call, which also waits for work on streams created with `StreamFlags::DEFAULT`, as
//! `cudaMemcpy` does.
//!
//! The legacy default stream may not be used at all while a blocking stream of its context
//! (one made without `StreamFlags::NON_BLOCKING`) captures, whatever the capture mode and from
//! whichever thread: the driver answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` and invalidates
//! the capture. So while a capture begun through cuweave on such a stream is active, the
//! blocking forms, and the async forms given [`Stream::legacy_default`], are refused with
//! [`GraphError::Capturing`](crate::GraphError::Capturing) before the driver is asked, and the
//! capture survives ([`refuse_legacy_stream_use`](crate::graph::refuse_legacy_stream_use)).
//!
//! All are `unsafe`: the driver checks device addresses only loosely and host addresses not at
//! all. Each function's contract is the same shape: every range is valid for `bytes` (or
//! `count` elements), and for the async forms stays valid, and unwritten by the host for
//! sources / unread for destinations, until the stream has passed the operation.

use std::ffi::c_void;

use super::DevicePtr;
use crate::context::Context;
use crate::error::Result;
use crate::loader::{cu, driver};
use crate::stream::Stream;

/// Waits for everything queued on the current context's legacy default stream.
fn complete_legacy_stream(api: &crate::loader::DriverApi) -> Result<()> {
    // SAFETY: the null stream is the current context's legacy default stream (the caller bound
    // the context).
    unsafe { cu!(api.stream_synchronize(std::ptr::null_mut())) }
}

/// Refuses a 16-bit memset at an odd address: the driver would refuse it too
/// (`CUDA_ERROR_INVALID_VALUE`), but only after binding the context, and saying less.
fn ensure_aligned_d16(dst: DevicePtr, operation: &'static str) -> Result<()> {
    ensure_aligned(dst, 2, operation)
}

/// Refuses a 32-bit memset at an address that is not 4-byte aligned, as
/// [`ensure_aligned_d16`] does for 16-bit ones.
fn ensure_aligned_d32(dst: DevicePtr, operation: &'static str) -> Result<()> {
    ensure_aligned(dst, 4, operation)
}

fn ensure_aligned(dst: DevicePtr, align: u64, operation: &'static str) -> Result<()> {
    if dst.is_multiple_of(align) {
        Ok(())
    } else {
        Err(crate::error::DriverError::invalid(
            operation,
            format!("destination {dst:#x} is not {align}-byte aligned"),
        ))
    }
}

/// Refuses a copy whose source and destination ranges overlap (other than a copy onto itself,
/// which leaves every byte as it was): `cuMemcpy*` do not promise memmove semantics, and on the
/// GPU an overlapping copy runs in parallel chunks, so later chunks may read bytes an earlier
/// chunk has already overwritten. Both addresses lie in one unified address space, so ranges
/// that overlap as numbers overlap in memory.
fn ensure_disjoint(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    operation: &'static str,
) -> Result<()> {
    let len = bytes as u64;
    let overlap =
        dst != src && len != 0 && dst < src.saturating_add(len) && src < dst.saturating_add(len);
    if overlap {
        Err(crate::error::DriverError::invalid(
            operation,
            format!(
                "source {src:#x} and destination {dst:#x} of a {bytes}-byte copy overlap \
                 (copy through a temporary, or in non-overlapping pieces)"
            ),
        ))
    } else {
        Ok(())
    }
}

/// Copies `bytes` from host `src` to device `dst` and waits for it.
///
/// # Errors
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before the driver is asked, while
/// the calling thread's capture mode forbids blocking calls, and, from any thread, while a
/// capture begun through cuweave on a blocking stream of `context` is active: the legacy
/// default stream this runs on would break it
/// ([`refuse_legacy_stream_use`](crate::graph::refuse_legacy_stream_use)).
///
/// # Safety
/// `src` is readable for `bytes`; `dst` is device memory of `context`'s device (or memory it
/// can address) writable for `bytes`.
pub unsafe fn copy_htod(
    context: &Context,
    dst: DevicePtr,
    src: *const u8,
    bytes: usize,
) -> Result<()> {
    let _relaxed = refuse_blocking(context, "memory::copy_htod")?;
    context.bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memcpy_htod(dst, src.cast::<c_void>(), bytes)) }?;
    complete_legacy_stream(api)
}

/// Copies `bytes` from device `src` to host `dst` and waits for it.
///
/// # Errors
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before the driver is asked, while
/// the calling thread's capture mode forbids blocking calls, and, from any thread, while a
/// capture begun through cuweave on a blocking stream of `context` is active: the legacy
/// default stream this runs on would break it
/// ([`refuse_legacy_stream_use`](crate::graph::refuse_legacy_stream_use)).
///
/// # Safety
/// `dst` is writable for `bytes`; `src` is readable device memory for `bytes`.
pub unsafe fn copy_dtoh(
    context: &Context,
    dst: *mut u8,
    src: DevicePtr,
    bytes: usize,
) -> Result<()> {
    let _relaxed = refuse_blocking(context, "memory::copy_dtoh")?;
    context.bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memcpy_dtoh(dst.cast::<c_void>(), src, bytes)) }
}

/// Copies `bytes` between device ranges (same device, or peers with unified addressing).
///
/// # Errors
/// `InvalidArgument` when the two ranges overlap (and are not the same range), before the
/// driver is asked: the driver's copies are undefined on overlapping ranges.
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before the driver is asked, while
/// the calling thread's capture mode forbids blocking calls, and, from any thread, while a
/// capture begun through cuweave on a blocking stream of `context` is active: the legacy
/// default stream this runs on would break it
/// ([`refuse_legacy_stream_use`](crate::graph::refuse_legacy_stream_use)).
///
/// # Safety
/// Both ranges are valid device memory for `bytes`.
pub unsafe fn copy_dtod(
    context: &Context,
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
) -> Result<()> {
    ensure_disjoint(dst, src, bytes, "memory::copy_dtod")?;
    let _relaxed = refuse_blocking(context, "memory::copy_dtod")?;
    context.bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memcpy_dtod(dst, src, bytes)) }?;
    complete_legacy_stream(api)
}

/// Copies `bytes` between any two addresses of the unified address space (host, pinned, device
/// or managed: the driver infers each side from its address) and waits for it.
///
/// # Errors
/// `InvalidArgument` when the two ranges overlap (and are not the same range), before the
/// driver is asked: the driver's copies are undefined on overlapping ranges.
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before the driver is asked, while
/// the calling thread's capture mode forbids blocking calls, and, from any thread, while a
/// capture begun through cuweave on a blocking stream of `context` is active: the legacy
/// default stream this runs on would break it
/// ([`refuse_legacy_stream_use`](crate::graph::refuse_legacy_stream_use)).
///
/// # Safety
/// `src` is readable and `dst` writable for `bytes`, each either host memory or memory the
/// driver knows (device, pinned, registered or managed).
pub unsafe fn copy(context: &Context, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
    ensure_disjoint(dst, src, bytes, "memory::copy")?;
    let _relaxed = refuse_blocking(context, "memory::copy")?;
    context.bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memcpy(dst, src, bytes)) }?;
    complete_legacy_stream(api)
}

/// Queues a copy between any two addresses of the unified address space on `stream` (see
/// [`copy`]). Asynchronous with respect to the host only when no side is pageable host memory.
///
/// # Errors
/// `InvalidArgument` when the two ranges overlap (and are not the same range), before the
/// driver is asked: the driver's copies are undefined on overlapping ranges.
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before anything is queued, when
/// `stream` is the legacy default stream and a capture begun through cuweave on a blocking
/// stream of its context is active
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// Both ranges stay valid for `bytes`, `src` unwritten and `dst` unread by the host, until
/// `stream` passes the copy.
pub unsafe fn copy_async(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    ensure_disjoint(dst, src, bytes, "memory::copy_async")?;
    crate::graph::refuse_on_legacy_stream(stream, "memory::copy_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memcpy_async(dst, src, bytes, stream.as_raw())) }
}

/// Queues a host-to-device copy on `stream`. Asynchronous only from pinned host memory; from
/// pageable memory the driver stages it and returns once `src` has been read.
///
/// # Errors
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before anything is queued, when
/// `stream` is the legacy default stream and a capture begun through cuweave on a blocking
/// stream of its context is active
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// `src` stays readable and unmodified, and `dst` valid, until `stream` passes the copy.
pub unsafe fn copy_htod_async(
    dst: DevicePtr,
    src: *const u8,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    crate::graph::refuse_on_legacy_stream(stream, "memory::copy_htod_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memcpy_htod_async(dst, src.cast::<c_void>(), bytes, stream.as_raw())) }
}

/// Queues a device-to-host copy on `stream`.
///
/// # Errors
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before anything is queued, when
/// `stream` is the legacy default stream and a capture begun through cuweave on a blocking
/// stream of its context is active
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// `dst` stays writable and unread by the host, and `src` valid, until `stream` passes the copy.
pub unsafe fn copy_dtoh_async(
    dst: *mut u8,
    src: DevicePtr,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    crate::graph::refuse_on_legacy_stream(stream, "memory::copy_dtoh_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memcpy_dtoh_async(dst.cast::<c_void>(), src, bytes, stream.as_raw())) }
}

/// Queues a device-to-device copy on `stream`.
///
/// # Errors
/// `InvalidArgument` when the two ranges overlap (and are not the same range), before the
/// driver is asked: the driver's copies are undefined on overlapping ranges.
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before anything is queued, when
/// `stream` is the legacy default stream and a capture begun through cuweave on a blocking
/// stream of its context is active
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// Both ranges stay valid until `stream` passes the copy.
pub unsafe fn copy_dtod_async(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    ensure_disjoint(dst, src, bytes, "memory::copy_dtod_async")?;
    crate::graph::refuse_on_legacy_stream(stream, "memory::copy_dtod_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memcpy_dtod_async(dst, src, bytes, stream.as_raw())) }
}

/// Queues a copy between devices on `stream` (direct over NVLink/PCIe when peer access is
/// enabled, staged by the driver otherwise).
///
/// # Errors
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before anything is queued, when
/// `stream` is the legacy default stream and a capture begun through cuweave on a blocking
/// stream of its context is active
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// `dst` is memory of `dst_context`'s device and `src` of `src_context`'s, both valid for `bytes`
/// until `stream` passes the copy.
pub unsafe fn copy_peer_async(
    dst: DevicePtr,
    dst_context: &Context,
    src: DevicePtr,
    src_context: &Context,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    crate::graph::refuse_on_legacy_stream(stream, "memory::copy_peer_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe {
        cu!(api.memcpy_peer_async(
            dst,
            dst_context.as_raw(),
            src,
            src_context.as_raw(),
            bytes,
            stream.as_raw(),
        ))
    }
}

/// Sets `bytes` bytes at `dst` to `value` and waits for it.
///
/// # Errors
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before the driver is asked, while
/// the calling thread's capture mode forbids blocking calls, and, from any thread, while a
/// capture begun through cuweave on a blocking stream of `context` is active: the legacy
/// default stream this runs on would break it
/// ([`refuse_legacy_stream_use`](crate::graph::refuse_legacy_stream_use)).
///
/// # Safety
/// `dst` is device memory writable for `bytes`.
pub unsafe fn memset_d8(context: &Context, dst: DevicePtr, value: u8, bytes: usize) -> Result<()> {
    let _relaxed = refuse_blocking(context, "memory::memset_d8")?;
    context.bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memset_d8(dst, value, bytes)) }?;
    complete_legacy_stream(api)
}

/// Sets `count` 16-bit values at `dst` to `value` and waits for it: the fill for `f16`, `bf16`
/// and `u16` elements, which need only 2-byte alignment where [`memset_d32`] needs 4.
///
/// # Errors
/// `InvalidArgument` when `dst` is not 2-byte aligned, before the driver is asked (which would
/// answer `CUDA_ERROR_INVALID_VALUE`).
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before the driver is asked, while
/// the calling thread's capture mode forbids blocking calls, and, from any thread, while a
/// capture begun through cuweave on a blocking stream of `context` is active: the legacy
/// default stream this runs on would break it
/// ([`refuse_legacy_stream_use`](crate::graph::refuse_legacy_stream_use)).
///
/// # Safety
/// `dst` is 2-byte aligned device memory writable for `2 * count` bytes.
pub unsafe fn memset_d16(
    context: &Context,
    dst: DevicePtr,
    value: u16,
    count: usize,
) -> Result<()> {
    ensure_aligned_d16(dst, "memory::memset_d16")?;
    let _relaxed = refuse_blocking(context, "memory::memset_d16")?;
    context.bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract; `dst` is 2-byte aligned (checked above).
    unsafe { cu!(api.memset_d16(dst, value, count)) }?;
    complete_legacy_stream(api)
}

/// Sets `count` 32-bit words at `dst` (4-byte aligned) to `value` and waits for it.
///
/// # Errors
/// `InvalidArgument` when `dst` is not 4-byte aligned, before the driver is asked.
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before the driver is asked, while
/// the calling thread's capture mode forbids blocking calls, and, from any thread, while a
/// capture begun through cuweave on a blocking stream of `context` is active: the legacy
/// default stream this runs on would break it
/// ([`refuse_legacy_stream_use`](crate::graph::refuse_legacy_stream_use)).
///
/// # Safety
/// `dst` is 4-byte aligned device memory writable for `4 * count` bytes.
pub unsafe fn memset_d32(
    context: &Context,
    dst: DevicePtr,
    value: u32,
    count: usize,
) -> Result<()> {
    ensure_aligned_d32(dst, "memory::memset_d32")?;
    let _relaxed = refuse_blocking(context, "memory::memset_d32")?;
    context.bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memset_d32(dst, value, count)) }?;
    complete_legacy_stream(api)
}

/// Queues a byte memset on `stream`.
///
/// # Errors
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before anything is queued, when
/// `stream` is the legacy default stream and a capture begun through cuweave on a blocking
/// stream of its context is active
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// `dst` stays valid for `bytes` until `stream` passes the memset.
pub unsafe fn memset_d8_async(
    dst: DevicePtr,
    value: u8,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    crate::graph::refuse_on_legacy_stream(stream, "memory::memset_d8_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memset_d8_async(dst, value, bytes, stream.as_raw())) }
}

/// Queues a 16-bit memset of `count` values on `stream` (see [`memset_d16`]).
///
/// # Errors
/// `InvalidArgument` when `dst` is not 2-byte aligned, before anything is queued.
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before anything is queued, when
/// `stream` is the legacy default stream and a capture begun through cuweave on a blocking
/// stream of its context is active
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// `dst` is 2-byte aligned and stays valid for `2 * count` bytes until `stream` passes it.
pub unsafe fn memset_d16_async(
    dst: DevicePtr,
    value: u16,
    count: usize,
    stream: &Stream,
) -> Result<()> {
    ensure_aligned_d16(dst, "memory::memset_d16_async")?;
    crate::graph::refuse_on_legacy_stream(stream, "memory::memset_d16_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract; `dst` is 2-byte aligned (checked above).
    unsafe { cu!(api.memset_d16_async(dst, value, count, stream.as_raw())) }
}

/// Queues a 32-bit memset of `count` words on `stream`.
///
/// # Errors
/// `InvalidArgument` when `dst` is not 4-byte aligned, before anything is queued.
/// [`GraphError::Capturing`](crate::GraphError::Capturing), before anything is queued, when
/// `stream` is the legacy default stream and a capture begun through cuweave on a blocking
/// stream of its context is active
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// `dst` is 4-byte aligned and stays valid for `4 * count` bytes until `stream` passes it.
pub unsafe fn memset_d32_async(
    dst: DevicePtr,
    value: u32,
    count: usize,
    stream: &Stream,
) -> Result<()> {
    ensure_aligned_d32(dst, "memory::memset_d32_async")?;
    crate::graph::refuse_on_legacy_stream(stream, "memory::memset_d32_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    // SAFETY: the caller's contract.
    unsafe { cu!(api.memset_d32_async(dst, value, count, stream.as_raw())) }
}

/// The checks every blocking copy and memset makes before the driver is asked: the blocking
/// call must not meet a capture that this thread may not break
/// ([`refuse_while_capturing`](crate::graph::refuse_while_capturing)), and the legacy stream it
/// runs on must not meet a capture on a blocking stream of `context`
/// ([`refuse_legacy_stream_use`](crate::graph::refuse_legacy_stream_use)).
///
/// Returns this thread in relaxed capture mode, to hold across the blocking call and the wait
/// behind it: a global-mode capture another thread begins after the checks is then neither
/// broken by the call nor raced by the driver's own check of it (that race was seen to crash
/// inside the driver).
fn refuse_blocking(
    context: &Context,
    operation: &'static str,
) -> Result<crate::graph::CaptureModeGuard> {
    crate::graph::refuse_while_capturing(None, operation)?;
    crate::graph::refuse_legacy_stream_use(context, operation)?;
    crate::graph::relaxed_for_unrecorded_call()
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::{ensure_aligned_d16, ensure_aligned_d32, ensure_disjoint};
    use crate::error::DriverError;

    #[rstest]
    #[case::zero(0, true)]
    #[case::four(4, true)]
    #[case::allocation(0x7f00_0000_0200, true)]
    #[case::two(2, false)]
    #[case::one(1, false)]
    #[case::word_inside_allocation(0x7f00_0000_0206, false)]
    fn a_32_bit_memset_needs_a_4_byte_aligned_destination(#[case] dst: u64, #[case] ok: bool) {
        match ensure_aligned_d32(dst, "memory::memset_d32") {
            Ok(()) => assert!(ok, "{dst:#x} accepted"),
            Err(DriverError::InvalidArgument { operation, reason }) => {
                assert!(!ok, "{dst:#x} refused");
                assert_eq!(operation, "memory::memset_d32");
                assert!(reason.contains("4-byte aligned"), "{reason}");
            }
            Err(other) => panic!("{other}"),
        }
    }

    #[rstest]
    #[case::zero(0, true)]
    #[case::two(2, true)]
    #[case::allocation(0x7f00_0000_0200, true)]
    #[case::one(1, false)]
    #[case::odd_inside_allocation(0x7f00_0000_0203, false)]
    fn a_16_bit_memset_needs_a_2_byte_aligned_destination(#[case] dst: u64, #[case] ok: bool) {
        match ensure_aligned_d16(dst, "memory::memset_d16_async") {
            Ok(()) => assert!(ok, "{dst:#x} passed"),
            Err(DriverError::InvalidArgument { operation, reason }) => {
                assert!(!ok, "{dst:#x} refused: {reason}");
                assert_eq!(operation, "memory::memset_d16_async");
                assert!(reason.contains(&format!("{dst:#x}")), "{reason}");
            }
            Err(other) => panic!("{other:?}"),
        }
    }

    #[rstest]
    #[case::disjoint(0x1000, 0x2000, 0x1000, true)]
    #[case::adjacent_after(0x2000, 0x1000, 0x1000, true)]
    #[case::adjacent_before(0x1000, 0x2000, 0x1000, true)]
    #[case::same_range(0x1000, 0x1000, 0x1000, true)]
    #[case::zero_bytes(0x1001, 0x1000, 0, true)]
    #[case::shift_up_by_one(0x1001, 0x1000, 0x1000, false)]
    #[case::shift_down_by_one(0x1000, 0x1001, 0x1000, false)]
    #[case::one_byte_shared(0x1fff, 0x1000, 0x1000, false)]
    #[case::near_the_top(u64::MAX - 4, u64::MAX - 8, 8, false)]
    fn overlapping_copies_are_refused(
        #[case] dst: u64,
        #[case] src: u64,
        #[case] bytes: usize,
        #[case] ok: bool,
    ) {
        match ensure_disjoint(dst, src, bytes, "memory::copy_dtod") {
            Ok(()) => assert!(ok, "{dst:#x} <- {src:#x} ({bytes}) passed"),
            Err(DriverError::InvalidArgument { operation, reason }) => {
                assert!(!ok, "{dst:#x} <- {src:#x} ({bytes}) refused: {reason}");
                assert_eq!(operation, "memory::copy_dtod");
                assert!(reason.contains("overlap"), "{reason}");
            }
            Err(other) => panic!("{other:?}"),
        }
    }
}
