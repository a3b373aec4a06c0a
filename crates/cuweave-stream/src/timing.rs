//! [`GpuTimer`]: the one GPU timer of cuweave. Each timed span is a pair of pooled timing
//! events recorded around work on a stream; its duration is `cuEventElapsedTime` between the
//! span's own two events, read once the GPU has passed them.
//!
//! Streams ([`PriorityStream::set_timing`](crate::PriorityStream::set_timing)), the
//! [`StreamProfiler`](crate::StreamProfiler) and the event layer's operation coordinator all
//! time their work through it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use cuweave_driver::{Event, EventPool, OwnedPooledEvent, Stream};
use parking_lot::Mutex;

use crate::error::{Result, StreamError};

/// Spans a timer keeps waiting for the GPU by default (see [`GpuTimer::with_capacity`]).
pub const DEFAULT_PENDING_SPANS: usize = 4096;

/// The start of a timed span: a timing event recorded on a stream by [`GpuTimer::start`].
#[derive(Debug)]
#[must_use = "a started span is timed only once `GpuTimer::finish` records its end"]
pub struct SpanStart {
    start: OwnedPooledEvent,
    /// The stream the span runs on ([`Stream::id`]).
    stream: u64,
}

#[derive(Debug)]
struct Span<T> {
    start: OwnedPooledEvent,
    end: Arc<OwnedPooledEvent>,
    tag: T,
    /// The order the span was queued in, across streams.
    seq: u64,
}

/// The spans waiting for the GPU, one queue per stream: a stream passes its events in the
/// order they were recorded, so each queue is read from its front up to its first unfinished
/// span, and a slow stream never holds back another stream's finished spans.
#[derive(Debug)]
struct Pending<T> {
    streams: HashMap<u64, VecDeque<Span<T>>>,
    len: usize,
    next_seq: u64,
}

impl<T> Pending<T> {
    fn push(&mut self, stream: u64, start: OwnedPooledEvent, end: Arc<OwnedPooledEvent>, tag: T) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.len += 1;
        self.streams.entry(stream).or_default().push_back(Span {
            start,
            end,
            tag,
            seq,
        });
    }

    /// Every span, in queueing order, leaving none.
    fn take_all(&mut self) -> Vec<(u64, Span<T>)> {
        let mut spans: Vec<(u64, Span<T>)> = self
            .streams
            .drain()
            .flat_map(|(stream, queue)| queue.into_iter().map(move |span| (stream, span)))
            .collect();
        spans.sort_unstable_by_key(|(_, span)| span.seq);
        self.len = 0;
        spans
    }

    /// Puts `spans` (in queueing order, all queued before any still here) back in front.
    fn put_back(&mut self, spans: impl DoubleEndedIterator<Item = (u64, Span<T>)>) {
        for (stream, span) in spans.rev() {
            self.len += 1;
            self.streams.entry(stream).or_default().push_front(span);
        }
    }
}

/// Timing-event pairs around work on streams, each carrying a tag `T` (what was timed), read
/// back once the GPU has passed them: on each stream in the order they were queued, and a
/// stream's finished spans are read however far behind another stream is.
///
/// Events come from the context's [`EventPool`] and go back to it once read, so a timer holds
/// at most two events per span in flight. The spans waiting for the GPU are bounded
/// ([`with_capacity`](Self::with_capacity), [`DEFAULT_PENDING_SPANS`]): when that many are
/// pending and none has finished, [`start`](Self::start) times nothing (returns `None`) and
/// counts the span in [`skipped`](Self::skipped), so a host running far ahead of the GPU costs
/// bounded memory and never blocks. A span counts as finished when its stream has passed it, so
/// a long operation on one stream does not fill the timer with another stream's finished spans.
///
/// The duration of a span is measured between its own two events, so its resolution is that
/// of timing events (about half a microsecond) however long the program has run.
#[derive(Debug)]
pub struct GpuTimer<T> {
    events: EventPool,
    enabled: AtomicBool,
    capacity: usize,
    pending: Mutex<Pending<T>>,
    skipped: AtomicU64,
}

impl<T> GpuTimer<T> {
    /// A timer (on) taking its events from `events`, keeping at most
    /// [`DEFAULT_PENDING_SPANS`] spans pending.
    pub fn new(events: EventPool) -> Self {
        Self::with_capacity(events, DEFAULT_PENDING_SPANS)
    }

    /// A timer keeping at most `capacity` (at least 1) spans pending.
    pub fn with_capacity(events: EventPool, capacity: usize) -> Self {
        Self {
            events,
            enabled: AtomicBool::new(true),
            capacity: capacity.max(1),
            pending: Mutex::new(Pending {
                streams: HashMap::new(),
                len: 0,
                next_seq: 0,
            }),
            skipped: AtomicU64::new(0),
        }
    }

    /// Turns timing of later spans on or off.
    pub fn set_enabled(&self, enabled: bool) {
        self.enabled.store(enabled, Ordering::Relaxed);
    }

    /// Whether spans are being timed.
    pub fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Spans not timed because the timer was full.
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    /// Whether as many spans wait for the GPU as the timer keeps: [`start`](Self::start) would
    /// time nothing unless finished ones are [harvested](Self::harvest) first.
    pub fn is_full(&self) -> bool {
        self.pending() >= self.capacity
    }

    /// Spans queued whose time has not been read yet.
    pub fn pending(&self) -> usize {
        self.pending.lock().len
    }

    /// Records the start of a span on `stream`; `None` (nothing recorded) when timing is off,
    /// when `stream` is capturing (its work is recorded into a graph, not run: an event
    /// recorded there could never be read), or when the timer is full of spans the GPU has not
    /// finished.
    ///
    /// # Errors
    /// The driver's error from the capture-status query, or from taking or recording the event.
    pub fn start(&self, stream: &Stream) -> Result<Option<SpanStart>> {
        if !self.is_enabled() || crate::capture::is_capturing(stream)? {
            return Ok(None);
        }
        self.start_not_capturing(stream)
    }

    /// [`start`](Self::start) on a stream the caller has just found not capturing: no second
    /// capture-status query (a driver call while any capture is active).
    pub(crate) fn start_not_capturing(&self, stream: &Stream) -> Result<Option<SpanStart>> {
        if !self.is_enabled() {
            return Ok(None);
        }
        if self.is_full() {
            self.skipped.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        let start = self.events.acquire_owned(true)?;
        start.record(stream)?;
        Ok(Some(SpanStart {
            start,
            stream: stream.id(),
        }))
    }

    /// Records the end of the span begun by `start` on `stream` (nothing for `None`); its
    /// duration is read later, with `tag`, by [`harvest`](Self::harvest). A span whose stream
    /// began capturing after its start is dropped untimed: its end would be recorded into the
    /// graph, where it could never be read.
    ///
    /// # Errors
    /// The driver's error from the capture-status query, or from taking or recording the event.
    pub fn finish(&self, start: Option<SpanStart>, stream: &Stream, tag: T) -> Result<()> {
        if start.is_none() || crate::capture::is_capturing(stream)? {
            return Ok(());
        }
        self.finish_not_capturing(start, stream, tag)
    }

    /// [`finish`](Self::finish) on a stream the caller knows is still not capturing (it found it
    /// so before the span's start and queued nothing since that could make it capture): no
    /// capture-status query.
    pub(crate) fn finish_not_capturing(
        &self,
        start: Option<SpanStart>,
        stream: &Stream,
        tag: T,
    ) -> Result<()> {
        let Some(SpanStart { start, .. }) = start else {
            return Ok(());
        };
        let end = self.events.acquire_owned(true)?;
        end.record(stream)?;
        self.pending
            .lock()
            .push(stream.id(), start, Arc::new(end), tag);
        Ok(())
    }

    /// Ends the span begun by `start` at `end`, an event the caller already recorded on the
    /// span's stream and shares for other uses (a completion event that other streams wait
    /// on): one record less than [`finish`](Self::finish). `end` must be a timing event recorded
    /// outside any capture (otherwise the span reads as an error, once, and is dropped).
    pub fn finish_with(&self, start: Option<SpanStart>, end: Arc<OwnedPooledEvent>, tag: T) {
        if let Some(SpanStart { start, stream }) = start {
            self.pending.lock().push(stream, start, end, tag);
        }
    }

    /// Hands `sink` the tag, the GPU duration and the start event (to place the span on a
    /// timeline) of every span the GPU has finished (on each stream, those up to its first
    /// unfinished one), in queueing order, without blocking; their events go back to the pool
    /// afterwards.
    ///
    /// A span that cannot be read (an end event that is not a timing event, or was recorded
    /// into a capture) is dropped and the others are still read; the first such error is
    /// returned once they have been. While this thread may not query events (it is capturing),
    /// nothing is read or dropped: the spans stay pending for a later harvest.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](cuweave_driver::graph::GraphError::Capturing) while this thread
    /// is capturing; otherwise the driver's error from the first span that could not be
    /// read.
    pub fn harvest(&self, mut sink: impl FnMut(T, Duration, &Event)) -> Result<()> {
        let mut first_error = None;
        let mut finished = Vec::new();
        let mut broken = Vec::new();
        {
            let mut pending = self.pending.lock();
            let pending = &mut *pending;
            'streams: for queue in pending.streams.values_mut() {
                while let Some(front) = queue.front() {
                    match front.end.query() {
                        Ok(false) => break,
                        Ok(true) => finished.extend(queue.pop_front()),
                        Err(error) if error.is_capture_refusal() => {
                            first_error.get_or_insert(error.into());
                            break 'streams;
                        }
                        Err(error) => {
                            first_error.get_or_insert(error.into());
                            broken.extend(queue.pop_front());
                        }
                    }
                }
            }
            pending.len -= finished.len() + broken.len();
            pending.streams.retain(|_, queue| !queue.is_empty());
        }
        // Dropped outside the lock: their events go back to the pool.
        drop(broken);
        finished.sort_unstable_by_key(|span| span.seq);
        for span in finished {
            match Self::duration(&span) {
                Ok(duration) => sink(span.tag, duration, &span.start),
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Waits for every pending span and hands each to `sink`, in queueing order.
    ///
    /// A span that cannot be read is dropped and the others are still read; the first such
    /// error is returned once they have been. While this thread may not wait for events (it is
    /// capturing), the spans not yet read stay pending, in order, for a later harvest.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](cuweave_driver::graph::GraphError::Capturing) while this thread
    /// is capturing; otherwise the driver's error from the first span that could not be
    /// waited for or read.
    pub fn harvest_all(&self, mut sink: impl FnMut(T, Duration, &Event)) -> Result<()> {
        let mut spans = self.pending.lock().take_all().into_iter();
        let mut first_error = None;
        while let Some((stream, span)) = spans.next() {
            let read = span
                .end
                .synchronize()
                .map_err(StreamError::from)
                .and_then(|()| Self::duration(&span));
            match read {
                Ok(duration) => sink(span.tag, duration, &span.start),
                Err(StreamError::Driver(error)) if error.is_capture_refusal() => {
                    // Every later wait would be refused too: put the unread spans back ahead
                    // of any queued meanwhile, which started later.
                    self.pending
                        .lock()
                        .put_back(std::iter::once((stream, span)).chain(spans));
                    return Err(error.into());
                }
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn duration(span: &Span<T>) -> Result<Duration> {
        let ms = span.start.elapsed_ms(&span.end)?;
        Ok(Duration::from_nanos(
            (f64::from(ms.max(0.0)) * 1e6).round() as u64
        ))
    }
}
