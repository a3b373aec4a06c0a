//! [`Buffer`]: what device, pinned and unified buffers share.
use std::sync::Arc;

use cuweave_driver::memory::{CompletionWords, DevicePtr};
use cuweave_driver::{Context, Device, Stream};

use super::fill::FillPlan;
use super::host::{HostRefusal, HostSink, HostSource};
use super::pending::PendingCopy;
use super::range::{DeviceSpan, check_same_len};
use super::raw;
use super::tracker::Access;
use super::view::{BufferSlice, BufferSliceMut};
use crate::element::Element;
use crate::error::{MemoryError, Result, hand_back_on_error};
use std::ops::RangeBounds;

#[path = "common_buffer_core.rs"]
mod buffer_core;

pub use buffer_core::{BufferCore, CoreRef};

pub(crate) mod sealed {
    /// Gives the shared implementation access to a buffer's core. Sealed: only this crate's
    /// buffers implement [`Buffer`](super::Buffer).
    pub trait Sealed {
        /// The buffer's (or view's) untyped core.
        fn core(&self) -> super::CoreRef<'_>;
    }
}

fn ensure_same_device(operation: &'static str, dst: CoreRef<'_>, src: CoreRef<'_>) -> Result<()> {
    let (expected, actual) = (dst.context().device(), src.context().device());
    if expected != actual {
        return Err(MemoryError::WrongDevice {
            operation,
            expected: expected.ordinal(),
            actual: actual.ordinal(),
        });
    }
    if dst.context().as_raw() != src.context().as_raw() {
        return Err(MemoryError::WrongContext {
            operation,
            device: expected.ordinal(),
        });
    }
    Ok(())
}

/// The cheapest fill of `span` with `value` (see [`FillPlan`]): the plan sees where the span
/// starts, since a view need not start on a word boundary.
fn fill_plan(span: DeviceSpan, value: &[u8]) -> FillPlan {
    FillPlan::for_value(value, span.ptr(), span.bytes())
}

/// Queues `plan`, a fill of `span` with `value`, on `stream`.
fn enqueue_fill(plan: FillPlan, span: DeviceSpan, value: &[u8], stream: &Stream) -> Result<()> {
    match plan {
        FillPlan::Bytes(byte) => raw::memset_d8(span, byte, stream),
        FillPlan::Words(word) => raw::memset_d32(span, word, stream),
        FillPlan::Halves(half) => raw::memset_d16(span, half, stream),
        FillPlan::Pattern => raw::fill_pattern(span, value, stream),
    }
}

/// The operations every buffer offers: size, device address, fill, and copies to and from the
/// host and other buffers, blocking or on a stream.
///
/// Offsets and lengths are in elements. Blocking methods return once the operation (and every
/// earlier use of the buffers involved) has finished; they run on the context's legacy default
/// stream, so they also wait for work on streams created with `StreamFlags::DEFAULT`. Methods
/// ending in `_async` queue the work on a stream and return at once; copies with host memory
/// take the host side by value and give it back from [`PendingCopy::wait`].
///
/// Every use is ordered after the earlier uses it conflicts with, whatever stream they were on: a
/// read after the last write, a write after every use since the last write (see
/// [`prepare_read`](Self::prepare_read) and [`prepare_write`](Self::prepare_write)). No sequence
/// of calls on this trait races with itself on the GPU, reads on different streams overlap, and a
/// buffer is never freed under queued work.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::buffer::{Buffer, DeviceBuffer};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let mut buffer = DeviceBuffer::<u32>::new(&context, 1 << 20)?;
/// buffer.fill(7)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let pending = buffer.copy_to_host_async(vec![0u32; 1 << 20], &stream)?;
/// assert!(pending.wait()?.iter().all(|&x| x == 7));
/// # Ok(())
/// # }
/// ```
pub trait Buffer<T: Element>: sealed::Sealed {
    /// Number of elements (never zero: empty buffers are refused at creation).
    fn len(&self) -> usize {
        self.core().len()
    }

    /// Always `false`; present for API symmetry with slices.
    fn is_empty(&self) -> bool {
        self.core().len() == 0
    }

    /// Size in bytes.
    fn byte_size(&self) -> usize {
        self.core().bytes()
    }

    /// The device address of element 0, for kernels (see [`prepare_use`](Self::prepare_use)
    /// and [`record_use`](Self::record_use) to keep them ordered with this buffer's other uses).
    fn device_ptr(&self) -> DevicePtr {
        self.core().ptr()
    }

    /// The context the memory belongs to.
    fn context(&self) -> &Arc<Context> {
        self.core().context()
    }

    /// A read-only view of the elements in `range` (no driver call, no allocation): every
    /// operation that reads a buffer accepts it, and its uses are tracked for those elements
    /// alone. Writing through it is [`MemoryError::ReadOnlyView`].
    ///
    /// # Errors
    /// `ZeroLength` for an empty range, `OutOfRange` for one past the end.
    fn slice(&self, range: impl RangeBounds<usize>) -> Result<BufferSlice<'_, T>> {
        let core = self.core();
        let (start, len) = super::view::resolve("Buffer::slice", range, core.len())?;
        Ok(BufferSlice::new(core, start, len))
    }

    /// A writable view of the elements in `range`, borrowing the buffer exclusively: copies,
    /// fills and [`TrackedLaunch::write`](crate::TrackedLaunch::write) accept it, and work on
    /// disjoint views runs at once on different streams.
    ///
    /// # Errors
    /// `ZeroLength` for an empty range, `OutOfRange` for one past the end.
    fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<BufferSliceMut<'_, T>> {
        let core = self.core();
        let (start, len) = super::view::resolve("Buffer::slice_mut", range, core.len())?;
        Ok(BufferSliceMut::new(core, start, len))
    }

    /// Two writable views, of the elements before `mid` and of those from `mid` on, borrowing
    /// the buffer exclusively (`<[T]>::split_at_mut`): each may be written on its own stream,
    /// at once, since uses are tracked per range (an all-to-all receiving into the slots of one
    /// flat buffer, as `all_to_all_single` does).
    ///
    /// ```no_run
    /// use cuweave_driver::{Context, Device};
    /// use cuweave_memory::{Buffer, DeviceBuffer};
    ///
    /// # fn main() -> cuweave_memory::Result<()> {
    /// let context = Context::primary(Device::get(0)?)?;
    /// let mut buffer = DeviceBuffer::<u32>::zeroed(&context, 6)?;
    /// let (mut head, mut tail) = buffer.split_at_mut(2)?;
    /// head.fill(1)?;
    /// tail.fill(2)?;
    /// assert_eq!(buffer.to_vec()?, [1, 1, 2, 2, 2, 2]);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// `ZeroLength` when a part would be empty (`mid` is 0 or the length), `OutOfRange` for
    /// `mid` past the end.
    fn split_at_mut(
        &mut self,
        mid: usize,
    ) -> Result<(BufferSliceMut<'_, T>, BufferSliceMut<'_, T>)> {
        const OPERATION: &str = "Buffer::split_at_mut";
        let core = self.core();
        let (head_start, head_len) = super::view::resolve(OPERATION, ..mid, core.len())?;
        let (tail_start, tail_len) = super::view::resolve(OPERATION, mid.., core.len())?;
        // The two ranges are disjoint, so two writable views of them alias nothing.
        Ok((
            BufferSliceMut::new(core, head_start, head_len),
            BufferSliceMut::new(core, tail_start, tail_len),
        ))
    }

    /// Writable views of consecutive runs of `chunk_len` elements (the last may be shorter),
    /// borrowing the buffer exclusively (`<[T]>::chunks_mut`): the per-peer slots of a flat
    /// buffer, or the parts of a pipelined copy, each usable on its own stream.
    ///
    /// # Errors
    /// `ZeroLength` for a `chunk_len` of 0.
    fn chunks_mut(&mut self, chunk_len: usize) -> Result<Vec<BufferSliceMut<'_, T>>> {
        if chunk_len == 0 {
            return Err(crate::MemoryError::ZeroLength {
                operation: "Buffer::chunks_mut",
            });
        }
        let core = self.core();
        let len = core.len();
        // Disjoint runs, so the writable views alias nothing.
        Ok((0..len)
            .step_by(chunk_len)
            .map(|start| BufferSliceMut::new(core, start, chunk_len.min(len - start)))
            .collect())
    }

    /// The device the memory belongs to.
    fn device(&self) -> Device {
        self.core().context().device()
    }

    /// Sets every element to `value`, blocking: a byte memset when `value`'s bytes allow, a word
    /// memset when they repeat every 4 bytes and the elements start and end on word boundaries
    /// (a view need not), else a 16-bit memset when they repeat every 2 bytes (any `u16`, `f16`
    /// or `bf16`, at any element offset), else a host-staged chunk doubled on the device.
    fn fill(&mut self, value: T) -> Result<()> {
        let core = self.core();
        let span = core.whole();
        let value = bytemuck::bytes_of(&value);
        let plan = fill_plan(span, value);
        raw::run_blocking(
            "Buffer::fill",
            core.context(),
            &[(core.part(), Access::Write)],
            |stream| enqueue_fill(plan, span, value, stream),
        )
    }

    /// Queues setting every element to `value` on `stream`.
    ///
    /// On a capturing stream the fill is recorded into the graph when a memset can write it
    /// (see [`fill`](Self::fill): a value whose bytes are all equal, repeat every 4 bytes on a
    /// word-aligned range, or repeat every 2 bytes).
    ///
    /// # Errors
    /// [`MemoryError::NotCapturable`] on a capturing stream when no memset can write the value
    /// (it would be staged from pageable host memory behind a host function, which would break
    /// the capture); nothing is queued and the capture goes on. `ReadOnlyView` for a shared view;
    /// the driver's error otherwise.
    fn fill_async(&mut self, value: T, stream: &Stream) -> Result<()> {
        const OP: &str = "Buffer::fill_async";
        let core = self.core();
        let span = core.whole();
        let value = bytemuck::bytes_of(&value);
        let plan = fill_plan(span, value);
        if plan == FillPlan::Pattern {
            // The pattern path's pageable staging copy and host function cannot be captured:
            // refuse before the tracker queues anything (one driver query, on a path that
            // stages through the host anyway).
            super::capture::refuse_in_capture(
                OP,
                stream,
                cuweave_driver::graph::StatusCheck::Always,
                super::capture::PATTERN_FILL,
            )?;
        }
        let uses = [(core.part(), Access::Write)];
        super::tracker::run_uses(OP, stream, &uses, || {
            enqueue_fill(plan, span, value, stream)
        })?;
        Ok(())
    }

    /// Copies `src` (exactly [`len`](Self::len) elements) into the buffer, blocking.
    fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        check_same_len("Buffer::copy_from_host", self.len(), src.len())?;
        self.copy_range_from_host(0, src)
    }

    /// Copies `src` into elements `offset..offset + src.len()`, blocking.
    fn copy_range_from_host(&mut self, offset: usize, src: &[T]) -> Result<()> {
        const OP: &str = "Buffer::copy_range_from_host";
        let core = self.core();
        let span = core.span(OP, offset, src.len())?;
        raw::write_blocking(
            OP,
            core.context(),
            span,
            bytemuck::cast_slice(src),
            core.part_of(span),
        )
    }

    /// Copies the buffer into `dst` (exactly [`len`](Self::len) elements), blocking.
    fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        check_same_len("Buffer::copy_to_host", self.len(), dst.len())?;
        self.copy_range_to_host(0, dst)
    }

    /// Copies elements `offset..offset + dst.len()` into `dst`, blocking.
    fn copy_range_to_host(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        const OP: &str = "Buffer::copy_range_to_host";
        let core = self.core();
        let span = core.span(OP, offset, dst.len())?;
        raw::read_blocking(
            OP,
            core.context(),
            bytemuck::cast_slice_mut(dst),
            span,
            core.part_of(span),
        )
    }

    /// The whole buffer, copied into a new vector, blocking.
    fn to_vec(&self) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len()];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    /// Copies another buffer of the same length and device into this one, blocking.
    fn copy_from<B: Buffer<T> + ?Sized>(&mut self, src: &B) -> Result<()> {
        check_same_len("Buffer::copy_from", self.len(), src.len())?;
        self.copy_range_from(0, src, 0, self.len())
    }

    /// Copies `len` elements of `src` from `src_offset` to this buffer at `offset`, blocking.
    ///
    /// # Errors
    /// `WrongDevice` when `src` lives on another device (peer copies belong to
    /// `cuweave-transfer`); `ZeroLength` / `OutOfRange` for bad ranges on either side.
    fn copy_range_from<B: Buffer<T> + ?Sized>(
        &mut self,
        offset: usize,
        src: &B,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        const OP: &str = "Buffer::copy_range_from";
        let (dst, src) = (self.core(), src.core());
        ensure_same_device(OP, dst, src)?;
        let (dst_span, src_span) = (dst.span(OP, offset, len)?, src.span(OP, src_offset, len)?);
        raw::run_blocking(
            OP,
            dst.context(),
            &[
                (dst.part_of(dst_span), Access::Write),
                (src.part_of(src_span), Access::Read),
            ],
            |stream| raw::copy_dtod(dst_span, src_span, stream),
        )
    }

    /// Queues a copy of another buffer of the same length and device into this one on `stream`.
    fn copy_from_async<B: Buffer<T> + ?Sized>(&mut self, src: &B, stream: &Stream) -> Result<()> {
        check_same_len("Buffer::copy_from_async", self.len(), src.len())?;
        self.copy_range_from_async(0, src, 0, self.len(), stream)
    }

    /// Queues a copy of `len` elements of `src` from `src_offset` to `offset` on `stream`.
    fn copy_range_from_async<B: Buffer<T> + ?Sized>(
        &mut self,
        offset: usize,
        src: &B,
        src_offset: usize,
        len: usize,
        stream: &Stream,
    ) -> Result<()> {
        const OP: &str = "Buffer::copy_range_from_async";
        let (dst, src) = (self.core(), src.core());
        ensure_same_device(OP, dst, src)?;
        let (dst_span, src_span) = (dst.span(OP, offset, len)?, src.span(OP, src_offset, len)?);
        let uses = [
            (dst.part_of(dst_span), Access::Write),
            (src.part_of(src_span), Access::Read),
        ];
        super::tracker::run_uses(OP, stream, &uses, || {
            raw::copy_dtod(dst_span, src_span, stream)
        })?;
        Ok(())
    }

    /// Queues a copy of `host` (exactly [`len`](Self::len) elements) into the buffer on
    /// `stream`; the returned [`PendingCopy`] owns `host` until the copy has finished.
    ///
    /// On a capturing stream a pinned host side is captured (the graph reads it at every
    /// launch; see [`HostSource`]) and a pageable one (`Vec`, `Box`) is refused with
    /// [`MemoryError::NotCapturable`] before anything is queued, leaving the capture valid.
    ///
    /// # Errors
    /// The host side's [`HostRefusal`]: for an owned host side a
    /// [`HostCopyError`](crate::HostCopyError) that hands `host` back whenever no copy of it
    /// can still run (every refusal, and failures after which the stream was settled); for a
    /// borrowed pinned buffer the [`MemoryError`] alone. `SizeMismatch` for another length,
    /// `WrongDevice` for a stream of another device, `NotCapturable`, the driver's error. `?`
    /// turns either into a [`MemoryError`].
    fn copy_from_host_async<H: HostSource<T>>(
        &mut self,
        host: H,
        stream: &Stream,
    ) -> Result<PendingCopy<H>, HostRefusal<H, T>> {
        hand_back_on_error!(
            check_same_len("Buffer::copy_from_host_async", self.len(), host.host_len()),
            host
        );
        self.copy_range_from_host_async(0, host, stream)
    }

    /// Queues a copy of `host` into elements `offset..offset + host_len` on `stream`.
    ///
    /// # Errors
    /// As [`copy_from_host_async`](Self::copy_from_host_async), with `OutOfRange` /
    /// `ZeroLength` for a bad range (`host` handed back).
    fn copy_range_from_host_async<H: HostSource<T>>(
        &mut self,
        offset: usize,
        host: H,
        stream: &Stream,
    ) -> Result<PendingCopy<H>, HostRefusal<H, T>> {
        const OP: &str = "Buffer::copy_range_from_host_async";
        let core = self.core();
        let span = hand_back_on_error!(core.span(OP, offset, host.host_len()), host);
        raw::write_async::<T, H>(OP, span, host, stream, core.part_of(span))
    }

    /// Copies the host side `host` into elements `offset..offset + host_len` on `stream` and
    /// returns it once the copy has landed (the blocking copy on a stream of the caller's).
    ///
    /// The stream waits for the buffer's conflicting uses, the copy is queued there and the
    /// stream is synchronised; the tracker then forgets the finished uses instead of recording
    /// an event. [`copy_range_from_host_watched`](Self::copy_range_from_host_watched) learns
    /// that the copy landed through a completion word instead, which is quicker still.
    ///
    /// # Errors
    /// As [`copy_range_from_host_async`](Self::copy_range_from_host_async) (`host` handed back
    /// in the [`HostRefusal`] where owned); if the copy's end cannot be known (the context broke), `host`
    /// is leaked rather than freed.
    /// [`MemoryError::NotCapturable`] on a capturing stream, whatever the host side: a capture
    /// runs nothing, so the copy could never have landed when this returns.
    fn copy_range_from_host_on<H: HostSource<T>>(
        &mut self,
        offset: usize,
        host: H,
        stream: &Stream,
    ) -> Result<H, HostRefusal<H, T>> {
        const OP: &str = "Buffer::copy_range_from_host_on";
        let core = self.core();
        let span = hand_back_on_error!(core.span(OP, offset, host.host_len()), host);
        raw::write_completed::<T, H>(OP, span, host, stream, None, core.part_of(span))
    }

    /// [`copy_range_from_host_on`](Self::copy_range_from_host_on), learning that the copy has
    /// landed from a completion word the stream writes behind it
    /// ([`CompletionWords::synchronize`](cuweave_driver::memory::CompletionWords::synchronize),
    /// falling back to `cuStreamSynchronize` after a bounded spin): the quickest way measured
    /// to land a small upload from pinned memory. On the H100, 4 KiB in 7.0 µs of raw calls,
    /// against 7.4–8.0 µs with `cuStreamSynchronize`, 7.6–8.5 µs for `cuMemcpyHtoD` followed by
    /// the legacy stream's synchronisation ([`copy_range_from_host`](Self::copy_range_from_host))
    /// and 7.7–7.8 µs for an event record and wait
    /// ([`copy_range_from_host_async`](Self::copy_range_from_host_async) + `wait`); see
    /// `benches/benches/small_upload.rs`.
    ///
    /// # Errors
    /// As [`copy_range_from_host_on`](Self::copy_range_from_host_on).
    fn copy_range_from_host_watched<H: HostSource<T>>(
        &mut self,
        offset: usize,
        host: H,
        stream: &Stream,
        words: &CompletionWords,
    ) -> Result<H, HostRefusal<H, T>> {
        const OP: &str = "Buffer::copy_range_from_host_watched";
        let core = self.core();
        let span = hand_back_on_error!(core.span(OP, offset, host.host_len()), host);
        raw::write_completed::<T, H>(OP, span, host, stream, Some(words), core.part_of(span))
    }

    /// Writes elements `offset..offset + len` in chunks on `streams`: every stream first waits
    /// (device-side) for the uses the range's write conflicts with, `work` queues the chunks
    /// through the lent [`StagedWrite`](super::StagedWrite) (plain copies, no use tracking per
    /// chunk), and when it returns, or unwinds, the range's write is recorded on every stream.
    /// What a pipelined upload of many chunks needs: the tracker is locked twice per stream per
    /// transfer instead of once per chunk.
    ///
    /// # Errors
    /// `ZeroLength` / `OutOfRange` for a bad range, `WrongDevice` for a stream of another
    /// device, `ReadOnlyView` for a shared view (all before `work` runs); a failure to record
    /// the use afterwards (each stream is then synchronised).
    fn staged_write<'s, R>(
        &mut self,
        offset: usize,
        len: usize,
        streams: &'s [Stream],
        work: impl FnOnce(&super::StagedWrite<'s, T>) -> R,
    ) -> Result<R> {
        const OP: &str = "Buffer::staged_write";
        let core = self.core();
        let span = core.span(OP, offset, len)?;
        let events = core.tracker().event_pool()?.clone();
        let staged = super::StagedWrite::new(span, len, streams, events);
        super::staged::run(OP, core.part_of(span), Access::Write, streams, || {
            work(&staged)
        })
    }

    /// Reads elements `offset..offset + len` in chunks on `streams`: every stream first waits
    /// for the range's last write, `work` queues the chunks through the lent
    /// [`StagedRead`](super::StagedRead), and the range's read is then recorded on every stream.
    ///
    /// # Errors
    /// As [`staged_write`](Self::staged_write), but shared views are accepted.
    fn staged_read<'s, R>(
        &self,
        offset: usize,
        len: usize,
        streams: &'s [Stream],
        work: impl FnOnce(&super::StagedRead<'s, T>) -> R,
    ) -> Result<R> {
        const OP: &str = "Buffer::staged_read";
        let core = self.core();
        let span = core.span(OP, offset, len)?;
        let events = core.tracker().event_pool()?.clone();
        let staged = super::StagedRead::new(span, len, streams, events);
        super::staged::run(OP, core.part_of(span), Access::Read, streams, || {
            work(&staged)
        })
    }

    /// Queues a copy of the buffer into `host` (exactly [`len`](Self::len) elements) on
    /// `stream`; [`PendingCopy::wait`] returns `host` holding the data.
    ///
    /// On a capturing stream a pinned host side is captured (the graph writes it at every
    /// launch) and a pageable one is refused with [`MemoryError::NotCapturable`], as for
    /// [`copy_from_host_async`](Self::copy_from_host_async).
    ///
    /// # Errors
    /// As [`copy_from_host_async`](Self::copy_from_host_async): the [`HostRefusal`] hands
    /// `host` back whenever no copy into it can still run (its contents are then unspecified
    /// if the copy failed after it was queued).
    fn copy_to_host_async<H: HostSink<T>>(
        &self,
        host: H,
        stream: &Stream,
    ) -> Result<PendingCopy<H>, HostRefusal<H, T>> {
        hand_back_on_error!(
            check_same_len("Buffer::copy_to_host_async", self.len(), host.host_len()),
            host
        );
        self.copy_range_to_host_async(0, host, stream)
    }

    /// Queues a copy of elements `offset..offset + host_len` into `host` on `stream`.
    ///
    /// # Errors
    /// As [`copy_to_host_async`](Self::copy_to_host_async), with `OutOfRange` / `ZeroLength`
    /// for a bad range (`host` handed back).
    fn copy_range_to_host_async<H: HostSink<T>>(
        &self,
        offset: usize,
        host: H,
        stream: &Stream,
    ) -> Result<PendingCopy<H>, HostRefusal<H, T>> {
        const OP: &str = "Buffer::copy_range_to_host_async";
        let core = self.core();
        let span = hand_back_on_error!(core.span(OP, offset, host.host_len()), host);
        raw::read_async::<T, H>(OP, span, host, stream, core.part_of(span))
    }

    /// Makes `stream` wait (device-side) for every use of the buffer so far. Call it before
    /// launching your own kernel on [`device_ptr`](Self::device_ptr), and
    /// [`record_use`](Self::record_use) after. The use counts as a write; for a kernel that only
    /// reads, [`prepare_read`](Self::prepare_read) lets it overlap other readers, and
    /// [`TrackedLaunch`](crate::TrackedLaunch) does both steps for every buffer of a launch.
    fn prepare_use(&self, stream: &Stream) -> Result<()> {
        self.core()
            .part()
            .prepare("Buffer::prepare_use", stream, Access::Write)
    }

    /// Records that work just queued on `stream` uses the buffer: later uses on other streams
    /// wait for it, host access waits for it, and the buffer is not freed before it finishes.
    fn record_use(&self, stream: &Stream) -> Result<()> {
        self.core()
            .part()
            .record("Buffer::record_use", stream, Access::Write)
    }

    /// Makes `stream` wait (device-side) for the uses a kernel that only *reads* the buffer
    /// conflicts with: the last write. Reads on different streams then run together. Call
    /// [`record_read`](Self::record_read) after queueing the read.
    fn prepare_read(&self, stream: &Stream) -> Result<()> {
        self.core()
            .part()
            .prepare("Buffer::prepare_read", stream, Access::Read)
    }

    /// Records that work just queued on `stream` reads the buffer: the next write (on any
    /// stream) waits for it, host access and drop wait for it, other reads do not.
    fn record_read(&self, stream: &Stream) -> Result<()> {
        self.core()
            .part()
            .record("Buffer::record_read", stream, Access::Read)
    }

    /// Makes `stream` wait for every use so far, as a write must (the same as
    /// [`prepare_use`](Self::prepare_use)).
    fn prepare_write(&self, stream: &Stream) -> Result<()> {
        self.core()
            .part()
            .prepare("Buffer::prepare_write", stream, Access::Write)
    }

    /// Records that work just queued on `stream` writes the buffer (the same as
    /// [`record_use`](Self::record_use)): every later use waits for it.
    fn record_write(&self, stream: &Stream) -> Result<()> {
        self.core()
            .part()
            .record("Buffer::record_write", stream, Access::Write)
    }

    /// How many uses of the buffer (writes and reads of distinct ranges, on any stream) its
    /// tracker holds: at most a small fixed number, however many ranges are used (finished uses
    /// are dropped and the rest merged past it).
    fn tracked_uses(&self) -> usize {
        self.core().tracker().tracked_uses()
    }

    /// How many streams read the buffer since its last write; their reads may run at once.
    fn concurrent_readers(&self) -> usize {
        self.core().tracker().concurrent_readers()
    }

    /// The raw handle (as an integer) of the stream that last used the buffer; 0 is the legacy
    /// default stream, which blocking operations use. `None` if it was never used.
    fn last_use(&self) -> Option<usize> {
        self.core().tracker().last_use()
    }

    /// Whether every queued use of the buffer has finished, without blocking. For a buffer a
    /// stream capture used, `false` while a graph launched since the last
    /// [`synchronize`](Self::synchronize) may still run (launches record no uses).
    fn is_idle(&self) -> Result<bool> {
        self.core().tracker().is_idle()
    }

    /// Blocks until every queued use of the buffer has finished; for a buffer a stream capture
    /// used, graph launches too (a context synchronisation, unless no graph was launched since
    /// the last one; `GraphError::Capturing` while a capture is active).
    fn synchronize(&self) -> Result<()> {
        self.core().tracker().synchronize()
    }
}
