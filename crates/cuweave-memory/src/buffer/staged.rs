//! Staged copies of one range in many chunks: the range is ordered once per stream, the chunks
//! are queued as plain copies, and the range's use is recorded once per stream at the end.
//!
//! A pipelined transfer (`cuweave-transfer`'s staging) moves one range of a buffer through many
//! pinned blocks on several streams. Going through
//! [`copy_range_from_host_async`](super::Buffer::copy_range_from_host_async) for each chunk
//! costs the buffer's use tracking every time: its lock (which every participant contends for),
//! waits on the earlier chunks' uses and an event recorded for the tracker beside the copy's own.
//! [`Buffer::staged_write`](super::Buffer::staged_write) and
//! [`Buffer::staged_read`](super::Buffer::staged_read) instead make each stream wait once for the
//! uses the whole range conflicts with, lend a [`StagedWrite`] / [`StagedRead`] to a closure
//! whose chunk copies touch no tracker (one `cuMemcpy*Async` and one event per chunk, the event
//! that hands the chunk's host block back), and record the range's use on every stream when the
//! closure returns, or unwinds.
//!
//! The handle is only lent, never returned, so it cannot be leaked past the recording: the
//! buffer's borrow (exclusive for a write) ends only after every queued chunk is tracked.

use cuweave_driver::memory::StreamMarks;
use cuweave_driver::{EventPool, Stream};

use super::host::{HostSink, HostSource};
use super::pending::{MarkedCopy, PendingCopy};
use super::range::DeviceSpan;
use super::raw;
use super::tracker::{self, Access, Part};
use crate::element::Element;
use crate::error::{MemoryError, Result};

/// One range of a buffer being copied in chunks on a set of streams, lent to the closure of
/// [`Buffer::staged_write`](super::Buffer::staged_write) ([`StagedWrite`]) or
/// [`Buffer::staged_read`](super::Buffer::staged_read) ([`StagedRead`]); see the module docs.
#[derive(Debug)]
pub struct Staged<'a, T, D> {
    span: DeviceSpan,
    len: usize,
    streams: &'a [Stream],
    /// The buffer's context's event pool, which every chunk's event comes from.
    events: EventPool,
    _marker: std::marker::PhantomData<fn() -> (T, D)>,
}

/// The direction of a [`Staged`] range: host to device.
#[derive(Debug)]
pub enum ToDevice {}

/// The direction of a [`Staged`] range: device to host.
#[derive(Debug)]
pub enum FromDevice {}

/// A range being written in chunks ([`Buffer::staged_write`](super::Buffer::staged_write)).
pub type StagedWrite<'a, T> = Staged<'a, T, ToDevice>;

/// A range being read in chunks ([`Buffer::staged_read`](super::Buffer::staged_read)).
pub type StagedRead<'a, T> = Staged<'a, T, FromDevice>;

impl<'a, T: Element, D> Staged<'a, T, D> {
    pub(crate) fn new(
        span: DeviceSpan,
        len: usize,
        streams: &'a [Stream],
        events: EventPool,
    ) -> Self {
        Self {
            span,
            len,
            streams,
            events,
            _marker: std::marker::PhantomData,
        }
    }

    /// Elements in the staged range.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the staged range is empty (never: empty ranges are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many streams chunks may be queued on (`lane` in `0..streams()`).
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// The span of elements `offset..offset + len` of the range and stream `lane`, checked.
    fn locate(
        &self,
        operation: &'static str,
        lane: usize,
        offset: usize,
        len: usize,
    ) -> Result<(DeviceSpan, &'a Stream)> {
        let stream = self.streams.get(lane).ok_or(MemoryError::OutOfRange {
            operation,
            offset: lane,
            len: 1,
            capacity: self.streams.len(),
        })?;
        let span = DeviceSpan::of_elements(
            operation,
            self.span.ptr(),
            self.len,
            size_of::<T>(),
            offset,
            len,
        )?;
        Ok((span, stream))
    }
}

impl<'a, T: Element> Staged<'a, T, ToDevice> {
    /// Queues a copy of `host` into elements `offset..offset + host_len` of the staged range
    /// (relative to its start) on stream `lane` of the set; the returned [`PendingCopy`] owns
    /// `host` until the copy has finished.
    ///
    /// # Errors
    /// `OutOfRange` for a chunk outside the staged range or a lane outside the set; the
    /// driver's error if queueing fails (the stream is then synchronised before `host` is
    /// dropped, or `host` is leaked if even that fails). On a capturing lane a pinned host side
    /// is captured and a pageable one refused with
    /// [`crate::MemoryError::NotCapturable`], before anything is
    /// queued.
    pub fn copy_in<H: HostSource<T>>(
        &self,
        lane: usize,
        offset: usize,
        host: H,
    ) -> Result<PendingCopy<H>> {
        const OP: &str = "StagedWrite::copy_in";
        let (span, stream) = self.locate(OP, lane, offset, host.host_len())?;
        raw::write_chunk::<T, H>(OP, span, host, stream, &self.events)
    }

    /// Queues a copy of `host` into elements `offset..offset + host_len` of the staged range on
    /// stream `lane`, with a mark of `marks` (which must belong to that stream) behind it instead
    /// of an event: chunks queued on one stream land in order, and whoever waits for one
    /// ([`MarkedCopy::wait`]) spins on the marks' word with no driver call.
    ///
    /// # Errors
    /// As [`copy_in`](Self::copy_in); `InvalidStream` when `marks` belong to another stream;
    /// `NotCapturable` on a capturing lane, whatever the host side (the mark cannot be captured).
    pub fn copy_in_marked<'m, H: HostSource<T>>(
        &self,
        lane: usize,
        offset: usize,
        host: H,
        marks: &'m StreamMarks,
    ) -> Result<MarkedCopy<'m, H>>
    where
        'a: 'm,
    {
        const OP: &str = "StagedWrite::copy_in_marked";
        let (span, stream) = self.locate(OP, lane, offset, host.host_len())?;
        raw::write_chunk_marked::<T, H>(OP, span, host, stream, marks)
    }
}

impl<'a, T: Element> Staged<'a, T, FromDevice> {
    /// Queues a copy of elements `offset..offset + host_len` of the staged range into `host` on
    /// stream `lane` of the set; [`PendingCopy::wait`] returns `host` holding the data.
    ///
    /// # Errors
    /// As [`StagedWrite::copy_in`](Staged::copy_in).
    pub fn copy_out<H: HostSink<T>>(
        &self,
        lane: usize,
        offset: usize,
        host: H,
    ) -> Result<PendingCopy<H>> {
        const OP: &str = "StagedRead::copy_out";
        let (span, stream) = self.locate(OP, lane, offset, host.host_len())?;
        raw::read_chunk::<T, H>(OP, span, host, stream, &self.events)
    }

    /// Queues a copy of elements `offset..offset + host_len` of the staged range into `host` on
    /// stream `lane`, with a mark of `marks` (which must belong to that stream) behind it instead
    /// of an event: chunks queued on one stream land in order, and threads waiting for them
    /// ([`MarkedCopy::wait`]) spin on the marks' word with no driver call.
    ///
    /// # Errors
    /// As [`copy_out`](Self::copy_out); `InvalidStream` when `marks` belong to another stream;
    /// `NotCapturable` on a capturing lane, whatever the host side (the mark cannot be captured).
    pub fn copy_out_marked<'m, H: HostSink<T>>(
        &self,
        lane: usize,
        offset: usize,
        host: H,
        marks: &'m StreamMarks,
    ) -> Result<MarkedCopy<'m, H>>
    where
        'a: 'm,
    {
        const OP: &str = "StagedRead::copy_out_marked";
        let (span, stream) = self.locate(OP, lane, offset, host.host_len())?;
        raw::read_chunk_marked::<T, H>(OP, span, host, stream, marks)
    }
}

/// Records `access` of `part` on every stream when dropped (after the closure returned or while
/// it unwinds). A stream whose recording fails is synchronised instead, so no untracked chunk is
/// left running; if even that fails, the error is logged.
struct RecordOnDrop<'a> {
    operation: &'static str,
    part: Part<'a>,
    access: Access,
    streams: &'a [Stream],
    failed: Option<MemoryError>,
}

impl RecordOnDrop<'_> {
    fn record(&mut self) {
        for stream in self.streams {
            if let Err(error) = self.part.record(self.operation, stream, self.access) {
                if !tracker::settle(stream) {
                    tracing::error!(%error, "a staged copy's use could not be recorded nor its stream synchronised");
                }
                self.failed.get_or_insert(error);
            }
        }
        self.streams = &[];
    }
}

impl Drop for RecordOnDrop<'_> {
    fn drop(&mut self) {
        self.record();
    }
}

/// Orders every stream after the uses `access` of `part` conflicts with, runs `work`, then
/// records the access on every stream.
pub(crate) fn run<R>(
    operation: &'static str,
    part: Part<'_>,
    access: Access,
    streams: &[Stream],
    work: impl FnOnce() -> R,
) -> Result<R> {
    // Also with no stream at all: a write through a read-only view is refused either way.
    part.check(operation, access)?;
    for stream in streams {
        part.prepare(operation, stream, access)?;
    }
    let mut guard = RecordOnDrop {
        operation,
        part,
        access,
        streams,
        failed: None,
    };
    let out = work();
    guard.record();
    match guard.failed.take() {
        Some(error) => Err(error),
        None => Ok(out),
    }
}
