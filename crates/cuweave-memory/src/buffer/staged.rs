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

use cuweave_driver::Stream;

use super::host::{HostSink, HostSource};
use super::pending::PendingCopy;
use super::range::DeviceSpan;
use super::raw;
use super::tracker::{self, Access, Part};
use crate::element::Element;
use crate::error::{MemoryError, Result};

/// One range of a buffer being written in chunks on a set of streams (see the module docs and
/// [`Buffer::staged_write`](super::Buffer::staged_write)).
#[derive(Debug)]
pub struct StagedWrite<'a, T> {
    span: DeviceSpan,
    len: usize,
    streams: &'a [Stream],
    _element: std::marker::PhantomData<fn() -> T>,
}

/// One range of a buffer being read in chunks on a set of streams (see
/// [`Buffer::staged_read`](super::Buffer::staged_read)).
#[derive(Debug)]
pub struct StagedRead<'a, T> {
    span: DeviceSpan,
    len: usize,
    streams: &'a [Stream],
    _element: std::marker::PhantomData<fn() -> T>,
}

const WRITE_OP: &str = "StagedWrite::copy_in";
const READ_OP: &str = "StagedRead::copy_out";

/// The span of elements `offset..offset + len` of the staged range, checked.
fn chunk<T>(
    operation: &'static str,
    span: DeviceSpan,
    capacity: usize,
    offset: usize,
    len: usize,
) -> Result<DeviceSpan> {
    DeviceSpan::of_elements(operation, span.ptr(), capacity, size_of::<T>(), offset, len)
}

fn stream_at<'a>(
    operation: &'static str,
    streams: &'a [Stream],
    lane: usize,
) -> Result<&'a Stream> {
    streams.get(lane).ok_or(MemoryError::OutOfRange {
        operation,
        offset: lane,
        len: 1,
        capacity: streams.len(),
    })
}

impl<T: Element> StagedWrite<'_, T> {
    /// Queues a copy of `host` into elements `offset..offset + host_len` of the staged range
    /// (relative to its start) on stream `lane` of the set; the returned [`PendingCopy`] owns
    /// `host` until the copy has finished.
    ///
    /// # Errors
    /// `OutOfRange` for a chunk outside the staged range or a lane outside the set; the
    /// driver's error if queueing fails (the stream is then synchronised before `host` is
    /// dropped, or `host` is leaked if even that fails).
    pub fn copy_in<H: HostSource<T>>(
        &self,
        lane: usize,
        offset: usize,
        host: H,
    ) -> Result<PendingCopy<H>> {
        let stream = stream_at(WRITE_OP, self.streams, lane)?;
        let span = chunk::<T>(WRITE_OP, self.span, self.len, offset, host.host_len())?;
        raw::write_chunk::<T, H>(WRITE_OP, span, host, stream)
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
}

impl<T: Element> StagedRead<'_, T> {
    /// Queues a copy of elements `offset..offset + host_len` of the staged range into `host` on
    /// stream `lane` of the set; [`PendingCopy::wait`] returns `host` holding the data.
    ///
    /// # Errors
    /// As [`StagedWrite::copy_in`].
    pub fn copy_out<H: HostSink<T>>(
        &self,
        lane: usize,
        offset: usize,
        host: H,
    ) -> Result<PendingCopy<H>> {
        let stream = stream_at(READ_OP, self.streams, lane)?;
        let span = chunk::<T>(READ_OP, self.span, self.len, offset, host.host_len())?;
        raw::read_chunk::<T, H>(READ_OP, span, host, stream)
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

pub(crate) fn write<'a, T>(
    span: DeviceSpan,
    len: usize,
    streams: &'a [Stream],
) -> StagedWrite<'a, T> {
    StagedWrite {
        span,
        len,
        streams,
        _element: std::marker::PhantomData,
    }
}

pub(crate) fn read<'a, T>(
    span: DeviceSpan,
    len: usize,
    streams: &'a [Stream],
) -> StagedRead<'a, T> {
    StagedRead {
        span,
        len,
        streams,
        _element: std::marker::PhantomData,
    }
}
