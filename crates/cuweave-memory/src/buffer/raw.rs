//! The buffer layer's unsafe spot: the driver's raw copies and memsets, and host slices over
//! managed memory.
//!
//! Every function here is safe to call from the rest of the crate because it keeps the host
//! side's contract itself:
//!
//! - blocking copies use the driver layer's blocking calls, which return only once the copy has
//!   landed: `memory::copy_htod` synchronises the legacy stream after `cuMemcpyHtoD` (which from
//!   pageable memory returns once the bytes are *staged*, "the DMA to final destination may not
//!   have completed": CUDA's API synchronization behavior notes), and `cuMemcpyDtoH` returns
//!   only once the copy has completed, pageable or pinned. So the borrowed host slice is not
//!   touched after they return, and the tracker may forget the uses they complete
//!   ([`tracker::run_completed`]) instead of recording an event on the legacy stream;
//! - asynchronous copies take the host side by value and return it inside a [`PendingCopy`],
//!   which frees it only after the event recorded behind the copy has completed;
//! - the pattern fill hands its staging vector to a host function queued behind its copy.
//!
//! and the device side's contract through the crate invariant of [`DeviceSpan`]: spans come
//! from live, range-checked buffers, work on them is queued only inside [`tracker::run`] (which
//! records it on the buffer's tracker), and buffers synchronize their tracker before freeing.

use std::sync::Arc;

use cuweave_driver::memory::{self, CompletionWords, ManagedAllocation, StreamMarks};
use cuweave_driver::{Context, EventPool, OwnedPooledEvent, Stream};

use cuweave_driver::graph::StatusCheck;

use super::capture;
use super::fill::{doubling_steps, pattern_chunk_len};
use super::host::sealed::HostSide;
use super::host::{HostRefusal, HostSink, HostSource};
use super::pending::{MarkedCopy, PendingCopy};
use super::range::DeviceSpan;
use super::tracker::{self, Access, Part, StreamTracker};
use crate::element::Element;
use crate::error::{MemoryError, Result, hand_back_on_error};

/// The context's legacy default stream (`NULL`), on which blocking operations are ordered.
pub(crate) fn legacy_stream(context: &Arc<Context>) -> Stream {
    // SAFETY: the null stream is the legacy default stream, which every context has; the handle
    // is not owned, so dropping it destroys nothing.
    unsafe { Stream::from_raw(context, std::ptr::null_mut(), false) }
}

/// Runs `op` on the legacy default stream under the ordering protocol and returns once it, and
/// every earlier use of the buffers, has finished.
pub(crate) fn run_blocking<R>(
    operation: &'static str,
    context: &Arc<Context>,
    uses: &[(Part<'_>, Access)],
    op: impl FnOnce(&Stream) -> Result<R>,
) -> Result<R> {
    let legacy = legacy_stream(context);
    let value = tracker::run_uses(operation, &legacy, uses, || op(&legacy))?;
    // The operation itself is done once the stream that ran it is.
    legacy.synchronize()?;
    Ok(value)
}

/// Copies `src` into `dst` and returns once the copy has completed.
pub(crate) fn write_blocking(
    operation: &'static str,
    context: &Arc<Context>,
    dst: DeviceSpan,
    src: &[u8],
    buffer: Part<'_>,
) -> Result<()> {
    debug_assert_eq!(src.len(), dst.bytes());
    let legacy = legacy_stream(context);
    // One buffer, one blocking call: the tracker forgets the finished uses rather than
    // recording an event behind a copy that is already done (no event record per call). Done
    // means landed, not staged: `memory::copy_htod` synchronises the legacy stream after
    // `cuMemcpyHtoD`, whose DMA from pageable memory may still be in flight when it returns;
    // without that a later use on a non-blocking stream would not be ordered after the DMA.
    // (Queuing the copy and recording an event instead would spare the host that wait, but a
    // borrowed `&[T]` may be pinned memory, which `cuMemcpyHtoDAsync` would read after return.)
    Ok(tracker::run_completed(
        operation,
        &legacy,
        buffer,
        Access::Write,
        || {
            // SAFETY: `src` is readable for `dst.bytes()` bytes and `memory::copy_htod` returns
            // only once the copy has landed (it synchronises the legacy stream), so nothing reads
            // `src` afterwards; `dst` is a live span (crate invariant). The legacy stream it runs
            // on was ordered after the buffer's uses.
            unsafe { memory::copy_htod(context, dst.ptr(), src.as_ptr(), dst.bytes()) }?;
            Ok(())
        },
    )?)
}

/// Copies `src` into `dst` and returns once the copy has completed.
pub(crate) fn read_blocking(
    operation: &'static str,
    context: &Arc<Context>,
    dst: &mut [u8],
    src: DeviceSpan,
    buffer: Part<'_>,
) -> Result<()> {
    debug_assert_eq!(dst.len(), src.bytes());
    let legacy = legacy_stream(context);
    Ok(tracker::run_completed(
        operation,
        &legacy,
        buffer,
        Access::Read,
        || {
            // SAFETY: `dst` is writable for `src.bytes()` bytes and exclusively borrowed;
            // `cuMemcpyDtoH` returns only once the copy has completed, into pageable or pinned
            // memory (CUDA's API synchronization behavior notes). `src` is a live span.
            unsafe { memory::copy_dtoh(context, dst.as_mut_ptr(), src.ptr(), src.bytes()) }?;
            Ok(())
        },
    )?)
}

/// Queues a copy from the host side `host` into `dst` on `stream`; the returned
/// [`PendingCopy`] owns `host` until the copy has finished.
pub(crate) fn write_async<T: Element, H: HostSource<T>>(
    operation: &'static str,
    dst: DeviceSpan,
    host: H,
    stream: &Stream,
    buffer: Part<'_>,
) -> Result<PendingCopy<H>, HostRefusal<H, T>> {
    debug_assert_eq!(host.host_len() * size_of::<T>(), dst.bytes());
    let done = hand_back_on_error!(
        prepare(operation, stream, &buffer, host.host_tracker()),
        host
    );
    let src = host.host_ptr();
    let uses: Vec<(Part<'_>, Access)> = [
        Some((buffer, Access::Write)),
        host.host_tracker()
            .map(|host| (Part::whole(host), Access::Read)),
    ]
    .into_iter()
    .flatten()
    .collect();
    let outcome = tracker::run_uses(operation, stream, &uses, || {
        // SAFETY: `src` is `host`'s memory, valid for `dst.bytes()` bytes; `host` is moved into
        // the returned PendingCopy (its memory does not move with it: HostSide's contract),
        // which frees it only after `done`, recorded behind this copy, has completed. A pinned
        // host side's own tracker is ordered and recorded by `run` too. In a capture (pinned
        // host sides only) nothing runs now; the graph reads `src` at each launch, and the
        // pinned buffer's tracker, which `run` recorded the captured use in, makes its drop
        // keep the memory for the capture's graphs. `dst` is a live span.
        unsafe { memory::copy_htod_async(dst.ptr(), src, dst.bytes(), stream) }?;
        if let Some(done) = &done {
            done.record(stream)?;
        }
        Ok(())
    });
    finish(outcome, host, done, dst.bytes()).map_err(refuse)
}

/// Copies the host side `host` into `dst` on `stream` and returns it once the copy has landed:
/// the stream waits for the buffer's conflicting uses, `cuMemcpyHtoDAsync` is queued there and
/// the stream is synchronised (through `words` when given: a completion word, else
/// `cuStreamSynchronize`). No event is recorded: like the legacy-stream blocking copies, the
/// tracker then forgets the uses now known to be finished. A host side with a tracker of its own
/// (a [`PinnedBuffer`](crate::PinnedBuffer)) goes the queued way and is waited for.
pub(crate) fn write_completed<T: Element, H: HostSource<T>>(
    operation: &'static str,
    dst: DeviceSpan,
    host: H,
    stream: &Stream,
    words: Option<&CompletionWords>,
    buffer: Part<'_>,
) -> Result<H, HostRefusal<H, T>> {
    debug_assert_eq!(host.host_len() * size_of::<T>(), dst.bytes());
    // A capture would record the copy and run nothing, so "landed" could never be true; a
    // pageable one would also invalidate it. Refused before anything touches the stream.
    let pinned = host.host_tracker().is_some();
    let check = if pinned {
        StatusCheck::WhileCuweaveCaptures
    } else {
        StatusCheck::Always
    };
    hand_back_on_error!(
        capture::refuse_in_capture(operation, stream, check, capture::BLOCKING),
        host
    );
    if pinned {
        // A failed wait leaves the copy's end unknown: the pending copy keeps the host side.
        return write_async(operation, dst, host, stream, buffer)?
            .wait()
            .map_err(|error| H::refusal(error, None));
    }
    let src = host.host_ptr();
    let outcome = tracker::run_completed(operation, stream, buffer, Access::Write, || {
        // SAFETY: `src` is `host`'s memory, valid for `dst.bytes()` bytes, and `host` is held
        // here until the stream, and so this copy, has finished (or is leaked below if that
        // cannot be known); `dst` is a live span (crate invariant).
        unsafe { memory::copy_htod_async(dst.ptr(), src, dst.bytes(), stream) }?;
        match words {
            Some(words) => words.synchronize(stream)?,
            None => stream.synchronize()?,
        }
        Ok(())
    });
    match outcome {
        Ok(()) => Ok(host),
        Err(failure) => Err(refuse(give_up_host(failure, host))),
    }
}

/// Queues a copy from `src` into the host side `host` on `stream`; the returned
/// [`PendingCopy`] owns `host` until the copy has finished.
pub(crate) fn read_async<T: Element, H: HostSink<T>>(
    operation: &'static str,
    src: DeviceSpan,
    mut host: H,
    stream: &Stream,
    buffer: Part<'_>,
) -> Result<PendingCopy<H>, HostRefusal<H, T>> {
    debug_assert_eq!(host.host_len() * size_of::<T>(), src.bytes());
    let done = hand_back_on_error!(
        prepare(operation, stream, &buffer, host.host_tracker()),
        host
    );
    let dst = host.host_mut_ptr();
    let uses: Vec<(Part<'_>, Access)> = [
        Some((buffer, Access::Read)),
        host.host_tracker()
            .map(|host| (Part::whole(host), Access::Write)),
    ]
    .into_iter()
    .flatten()
    .collect();
    let outcome = tracker::run_uses(operation, stream, &uses, || {
        // SAFETY: `dst` is `host`'s memory, writable for `src.bytes()` bytes and reachable only
        // through `host`, which moves (without its memory moving) into the returned
        // PendingCopy; that frees or returns it only after `done`, recorded behind this copy,
        // has completed. In a capture (pinned host sides only) nothing runs now; the graph
        // writes `dst` at each launch, and the pinned buffer's tracker, which `run` recorded the
        // captured use in, makes its drop keep the memory for the capture's graphs. `src` is a
        // live span.
        unsafe { memory::copy_dtoh_async(dst, src.ptr(), src.bytes(), stream) }?;
        if let Some(done) = &done {
            done.record(stream)?;
        }
        Ok(())
    });
    finish(outcome, host, done, src.bytes()).map_err(refuse)
}

/// Checks, before anything is queued, that a host copy can run on `stream`: a stream of the
/// buffer's device, and no capture unless the host side is pinned (`host_tracker`: a pageable
/// one would invalidate the capture). Returns the event to record behind the copy: from the
/// context's event pool, which every layer shares (none is created per copy); none for a
/// captured copy, since an event recorded in a capture can never be waited for.
fn prepare(
    operation: &'static str,
    stream: &Stream,
    buffer: &Part<'_>,
    host_tracker: Option<&StreamTracker>,
) -> Result<Option<OwnedPooledEvent>> {
    tracker::ensure_same_device(operation, buffer.tracker.context(), stream)?;
    if capture::host_copy_captured(operation, stream, host_tracker.is_some())? {
        Ok(None)
    } else {
        Ok(Some(buffer.tracker.event_for(stream)?))
    }
}

/// The pending copy of a queued `outcome`: tracked by `done`, or captured when there is none;
/// on failure the error and the host side where it can be handed back ([`give_up_host`]).
fn finish<H>(
    outcome: Result<(), tracker::OpFailure>,
    host: H,
    done: Option<OwnedPooledEvent>,
    bytes: usize,
) -> Result<PendingCopy<H>, (MemoryError, Option<H>)> {
    match outcome {
        Ok(()) => Ok(match done {
            Some(done) => PendingCopy::new(host, done, bytes),
            None => PendingCopy::captured(host, bytes),
        }),
        Err(failure) => Err(give_up_host(failure, host)),
    }
}

/// The error of a failed copy with a host side, and `host` if the stream was settled; it is
/// leaked if the copy may still be running (its memory must never be freed under the copy
/// engine).
fn give_up_host<H>(failure: tracker::OpFailure, host: H) -> (MemoryError, Option<H>) {
    if failure.settled {
        (failure.error, Some(host))
    } else {
        std::mem::forget(host);
        (failure.error, None)
    }
}

/// The host side's refusal of an error and the host side handed back with it.
fn refuse<T, H: HostSide<T>>((error, host): (MemoryError, Option<H>)) -> HostRefusal<H, T> {
    H::refusal(error, host)
}

/// Queues a device-to-device copy of `src` into `dst` (same length) on `stream`.
pub(crate) fn copy_dtod(dst: DeviceSpan, src: DeviceSpan, stream: &Stream) -> Result<()> {
    debug_assert_eq!(dst.bytes(), src.bytes());
    // SAFETY: both are live spans of device-accessible memory (crate invariant), ordered on
    // `stream` by the caller's `tracker::run`.
    unsafe { memory::copy_dtod_async(dst.ptr(), src.ptr(), dst.bytes(), stream) }?;
    Ok(())
}

/// Queues a byte memset of `dst` on `stream`.
pub(crate) fn memset_d8(dst: DeviceSpan, value: u8, stream: &Stream) -> Result<()> {
    // SAFETY: a live span (crate invariant), ordered by the caller's `tracker::run`.
    unsafe { memory::memset_d8_async(dst.ptr(), value, dst.bytes(), stream) }?;
    Ok(())
}

/// Queues a 32-bit memset of `dst` on `stream`.
///
/// # Errors
/// `Misaligned` (nothing queued) unless `dst` starts on a 4-byte boundary and is a whole number
/// of words: the driver refuses anything else ([`FillPlan`](super::fill::FillPlan) never asks).
pub(crate) fn memset_d32(dst: DeviceSpan, value: u32, stream: &Stream) -> Result<()> {
    if !(dst.ptr().is_multiple_of(4) && dst.bytes().is_multiple_of(4)) {
        return Err(MemoryError::Misaligned {
            operation: "cuMemsetD32Async",
            bytes: dst.bytes(),
            element_size: 4,
        });
    }
    // SAFETY: a live span (crate invariant), 4-byte aligned and a whole number of words
    // (checked), ordered by the caller's `tracker::run`.
    unsafe { memory::memset_d32_async(dst.ptr(), value, dst.bytes() / 4, stream) }?;
    Ok(())
}

/// Queues a 16-bit memset of `dst` on `stream`.
///
/// # Errors
/// `Misaligned` (nothing queued) unless `dst` starts on a 2-byte boundary and is a whole number
/// of halves: the driver refuses anything else ([`FillPlan`](super::fill::FillPlan) never asks).
pub(crate) fn memset_d16(dst: DeviceSpan, value: u16, stream: &Stream) -> Result<()> {
    if !(dst.ptr().is_multiple_of(2) && dst.bytes().is_multiple_of(2)) {
        return Err(MemoryError::Misaligned {
            operation: "cuMemsetD16Async",
            bytes: dst.bytes(),
            element_size: 2,
        });
    }
    // SAFETY: a live span (crate invariant), 2-byte aligned and a whole number of halves
    // (checked), ordered by the caller's `tracker::run`.
    unsafe { memory::memset_d16_async(dst.ptr(), value, dst.bytes() / 2, stream) }?;
    Ok(())
}

/// Queues a fill of `dst` with repetitions of `value` (one element's bytes): a host-staged
/// chunk, then device-to-device doublings. The staging memory is released by a host function
/// queued behind the copy (or after synchronizing `stream` if that cannot be queued).
pub(crate) fn fill_pattern(dst: DeviceSpan, value: &[u8], stream: &Stream) -> Result<()> {
    let size = value.len();
    let len = dst.bytes() / size;
    let chunk = pattern_chunk_len(size, len);
    let staging: Arc<Vec<u8>> = Arc::new(value.repeat(chunk));
    let first = dst.sub(0, staging.len());
    // SAFETY: `staging` is readable for its length and stays allocated until the copy is done:
    // one reference goes to a host function queued behind the copy, and ours is dropped only
    // after that was queued, or after synchronizing the stream (and leaked if that fails).
    // `first` lies inside the live span `dst`.
    unsafe { memory::copy_htod_async(first.ptr(), staging.as_ptr(), first.bytes(), stream) }?;
    let mut doubled = Ok(());
    for (offset, count) in doubling_steps(chunk, len) {
        doubled = copy_dtod(
            dst.sub(offset * size, count * size),
            dst.sub(0, count * size),
            stream,
        );
        if doubled.is_err() {
            break;
        }
    }
    let in_callback = Arc::clone(&staging);
    // The host function only drops a reference (no CUDA call), on the driver's thread.
    match stream.launch_host_fn(move || drop(in_callback)) {
        Ok(()) => drop(staging),
        Err(error) => {
            // The driver refused the callback (and dropped its reference); ours must outlive
            // the copy.
            if !tracker::settle(stream) {
                std::mem::forget(staging);
            }
            return Err(error.into());
        }
    }
    doubled
}

/// The elements of a managed allocation, as a host slice.
///
/// The caller ([`super::UnifiedBuffer`]) guarantees that no queued device work can write the
/// allocation while the slice lives: it synchronizes its tracker first, and writes through the
/// buffer's API need `&mut` access, which the returned borrow excludes.
pub(crate) fn managed_slice<T: Element>(
    allocation: &ManagedAllocation,
    len: usize,
) -> Result<&[T]> {
    check_host_layout::<T>(allocation, len)?;
    // SAFETY: managed memory is host-accessible at its device address under unified addressing;
    // the allocation holds `len` elements (checked) at a `T`-aligned address (checked), was
    // initialized when the buffer was created (zeroed or copied into), and stays allocated for
    // the borrow of `allocation`. Every bit pattern is a valid `T` (Pod).
    Ok(unsafe { std::slice::from_raw_parts(allocation.ptr() as usize as *const T, len) })
}

/// The elements of a managed allocation, as a mutable host slice (see [`managed_slice`]).
pub(crate) fn managed_slice_mut<T: Element>(
    allocation: &mut ManagedAllocation,
    len: usize,
) -> Result<&mut [T]> {
    check_host_layout::<T>(allocation, len)?;
    // SAFETY: as in `managed_slice`; the exclusive borrow of `allocation` makes this the only
    // reference to the memory for its lifetime.
    Ok(unsafe { std::slice::from_raw_parts_mut(allocation.ptr() as usize as *mut T, len) })
}

fn check_host_layout<T>(allocation: &ManagedAllocation, len: usize) -> Result<()> {
    let fits = len
        .checked_mul(size_of::<T>())
        .is_some_and(|bytes| bytes <= allocation.len());
    if !fits || !(allocation.ptr() as usize).is_multiple_of(align_of::<T>()) {
        return Err(MemoryError::Misaligned {
            operation: "UnifiedBuffer host slice",
            bytes: allocation.len(),
            element_size: size_of::<T>(),
        });
    }
    Ok(())
}

/// Runs the queuing of one staged chunk: ordered after, and recorded in, the host side's own
/// tracker as `access` when it has one; otherwise plainly, with the stream settled if queuing
/// fails part way.
fn run_chunk<R>(
    operation: &'static str,
    stream: &Stream,
    own: Option<&StreamTracker>,
    access: Access,
    copy: impl FnOnce() -> Result<R>,
) -> Result<R, tracker::OpFailure> {
    match own {
        Some(own) => tracker::run_uses(operation, stream, &[(Part::whole(own), access)], copy),
        None => copy().map_err(|error| tracker::OpFailure {
            settled: tracker::settle(stream),
            error,
        }),
    }
}

/// Queues `cuMemcpyHtoDAsync` of `host` into `dst` on `stream` and records an event behind it,
/// *without* touching the buffer's tracker: the caller ([`super::staged`]) ordered `stream`
/// after the buffer's earlier uses for the whole range before, and records the whole range's
/// use after, its chunks. A host side with a tracker of its own is ordered and recorded as usual.
pub(crate) fn write_chunk<T: Element, H: HostSource<T>>(
    operation: &'static str,
    dst: DeviceSpan,
    host: H,
    stream: &Stream,
    events: &EventPool,
) -> Result<PendingCopy<H>> {
    debug_assert_eq!(host.host_len() * size_of::<T>(), dst.bytes());
    let captured = capture::host_copy_captured(operation, stream, host.host_tracker().is_some())?;
    // From the buffer's context's event pool: no event created, and no lookup, per chunk.
    let done = if captured {
        None
    } else {
        Some(crate::events::event_on(events, stream)?)
    };
    let src = host.host_ptr();
    let copy = || {
        // SAFETY: `src` is `host`'s memory, valid for `dst.bytes()` bytes; `host` moves into the
        // returned PendingCopy (its memory does not move), which frees it only after `done`,
        // recorded behind this copy, has completed. `dst` lies in a live span whose buffer is
        // exclusively borrowed by the `StagedWrite` that calls this, and that records the span's
        // use on this stream before the borrow ends (super::staged). In a capture (pinned host
        // sides only) the pinned buffer's tracker keeps its memory for the capture's graphs.
        unsafe { memory::copy_htod_async(dst.ptr(), src, dst.bytes(), stream) }?;
        if let Some(done) = &done {
            done.record(stream)?;
        }
        Ok(())
    };
    let outcome = run_chunk(operation, stream, host.host_tracker(), Access::Read, copy);
    // Chunks are the staging pipelines' own blocks: an error drops the block (back to its pool).
    finish(outcome, host, done, dst.bytes()).map_err(|(error, _)| error)
}

/// Queues a chunk copy (`copy`, touching `host`'s memory) on `stream` with a mark of `marks`
/// behind it, ordered in `host`'s own tracker as `access` when it has one: the shared part of
/// [`write_chunk_marked`] and [`read_chunk_marked`]. Marks of another stream are refused before
/// anything is queued.
fn queue_marked<'s, T, H: super::host::sealed::HostSide<T>>(
    operation: &'static str,
    host: H,
    bytes: usize,
    stream: &'s Stream,
    marks: &'s StreamMarks,
    access: Access,
    copy: impl FnOnce() -> Result<()>,
) -> Result<MarkedCopy<'s, H>> {
    if !marks.belongs_to(stream) {
        return Err(MemoryError::InvalidStream {
            operation,
            reason: "the marks belong to another stream than the chunk's",
        });
    }
    // Pageable host sides are refused on a capturing stream, and so is the mark itself.
    if capture::host_copy_captured(operation, stream, host.host_tracker().is_some())? {
        return Err(MemoryError::NotCapturable {
            operation,
            reason: capture::MARKED,
        });
    }
    let outcome = run_chunk(operation, stream, host.host_tracker(), access, || {
        copy()?;
        Ok(marks.mark(stream)?)
    });
    match outcome {
        Ok(mark) => Ok(MarkedCopy::new(host, marks, mark, stream, bytes)),
        Err(failure) => Err(give_up_host(failure, host).0),
    }
}

/// Queues `cuMemcpyHtoDAsync` of `host` into `dst` on `stream` and a mark of `marks` behind it,
/// without touching the buffer's tracker (see [`write_chunk`]): the returned copy learns that it
/// landed from the marks' word, with no event.
pub(crate) fn write_chunk_marked<'s, T: Element, H: HostSource<T>>(
    operation: &'static str,
    dst: DeviceSpan,
    host: H,
    stream: &'s Stream,
    marks: &'s StreamMarks,
) -> Result<MarkedCopy<'s, H>> {
    debug_assert_eq!(host.host_len() * size_of::<T>(), dst.bytes());
    let src = host.host_ptr();
    queue_marked(
        operation,
        host,
        dst.bytes(),
        stream,
        marks,
        Access::Read,
        || {
            // SAFETY: `src` is `host`'s memory, valid for `dst.bytes()` bytes; `host` moves (without
            // its memory moving) into the returned MarkedCopy, which frees or returns it only after
            // the stream has passed the mark queued behind this copy (or leaks it). `dst` lies in a
            // live span whose buffer is exclusively borrowed by the `StagedWrite` that calls this,
            // and that records the span's use on this stream before the borrow ends.
            unsafe { memory::copy_htod_async(dst.ptr(), src, dst.bytes(), stream) }?;
            Ok(())
        },
    )
}

/// Queues `cuMemcpyDtoHAsync` of `src` into `host` on `stream` and a mark of `marks` behind it,
/// without touching the buffer's tracker (see [`write_chunk`]): the returned copy learns that it
/// landed from the marks' word, with no event.
pub(crate) fn read_chunk_marked<'s, T: Element, H: HostSink<T>>(
    operation: &'static str,
    src: DeviceSpan,
    mut host: H,
    stream: &'s Stream,
    marks: &'s StreamMarks,
) -> Result<MarkedCopy<'s, H>> {
    debug_assert_eq!(host.host_len() * size_of::<T>(), src.bytes());
    let dst = host.host_mut_ptr();
    queue_marked(
        operation,
        host,
        src.bytes(),
        stream,
        marks,
        Access::Write,
        || {
            // SAFETY: `dst` is `host`'s memory, writable for `src.bytes()` bytes and reachable only
            // through `host`, which moves (without its memory moving) into the returned MarkedCopy;
            // that frees or returns it only after the stream has passed the mark queued behind this
            // copy (or leaks it). `src` lies in a live span of a buffer borrowed by the `StagedRead`
            // that calls this, which records the span's read on this stream before the borrow ends.
            unsafe { memory::copy_dtoh_async(dst, src.ptr(), src.bytes(), stream) }?;
            Ok(())
        },
    )
}

/// Queues `cuMemcpyDtoHAsync` of `src` into `host` on `stream` and records an event behind it,
/// without touching the buffer's tracker (see [`write_chunk`]).
pub(crate) fn read_chunk<T: Element, H: HostSink<T>>(
    operation: &'static str,
    src: DeviceSpan,
    mut host: H,
    stream: &Stream,
    events: &EventPool,
) -> Result<PendingCopy<H>> {
    debug_assert_eq!(host.host_len() * size_of::<T>(), src.bytes());
    let captured = capture::host_copy_captured(operation, stream, host.host_tracker().is_some())?;
    // From the buffer's context's event pool: no event created, and no lookup, per chunk.
    let done = if captured {
        None
    } else {
        Some(crate::events::event_on(events, stream)?)
    };
    let dst = host.host_mut_ptr();
    let copy = || {
        // SAFETY: `dst` is `host`'s memory, writable for `src.bytes()` bytes and reachable only
        // through `host`, which moves (without its memory moving) into the returned PendingCopy;
        // that frees or returns it only after `done` has completed. `src` lies in a live span of
        // a buffer borrowed by the `StagedRead` that calls this, which records the span's read on
        // this stream before the borrow ends (super::staged). In a capture (pinned host sides
        // only) the pinned buffer's tracker keeps its memory for the capture's graphs.
        unsafe { memory::copy_dtoh_async(dst, src.ptr(), src.bytes(), stream) }?;
        if let Some(done) = &done {
            done.record(stream)?;
        }
        Ok(())
    };
    let outcome = run_chunk(operation, stream, host.host_tracker(), Access::Write, copy);
    finish(outcome, host, done, src.bytes()).map_err(|(error, _)| error)
}
