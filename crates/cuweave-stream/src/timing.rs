//! [`GpuTimer`]: the one GPU timer of cuweave. Each timed span is a pair of pooled timing
//! events recorded around work on a stream; its duration is `cuEventElapsedTime` between the
//! span's own two events, read once the GPU has passed them.
//!
//! Streams ([`PriorityStream::set_timing`](crate::PriorityStream::set_timing)), the
//! [`StreamProfiler`](crate::StreamProfiler) and the event layer's operation coordinator all
//! time their work through it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use cuweave_driver::{Event, EventPool, OwnedPooledEvent, Stream};
use parking_lot::Mutex;

use crate::error::Result;

/// Spans a timer keeps waiting for the GPU by default (see [`GpuTimer::with_capacity`]).
pub const DEFAULT_PENDING_SPANS: usize = 4096;

/// The start of a timed span: a timing event recorded on a stream by [`GpuTimer::start`].
#[derive(Debug)]
#[must_use = "a started span is timed only once `GpuTimer::finish` records its end"]
pub struct SpanStart {
    start: OwnedPooledEvent,
}

#[derive(Debug)]
struct Span<T> {
    start: OwnedPooledEvent,
    end: Arc<OwnedPooledEvent>,
    tag: T,
}

/// Timing-event pairs around work on streams, each carrying a tag `T` (what was timed), read
/// back in the order they finished being queued once the GPU has passed them.
///
/// Events come from the context's [`EventPool`] and go back to it once read, so a timer holds
/// at most two events per span in flight. The spans waiting for the GPU are bounded
/// ([`with_capacity`](Self::with_capacity), [`DEFAULT_PENDING_SPANS`]): when that many are
/// pending and none has finished, [`start`](Self::start) times nothing (returns `None`) and
/// counts the span in [`skipped`](Self::skipped), so a host running far ahead of the GPU costs
/// bounded memory and never blocks.
///
/// The duration of a span is measured between its own two events, so its resolution is that
/// of timing events (about half a microsecond) however long the program has run.
#[derive(Debug)]
pub struct GpuTimer<T> {
    events: EventPool,
    enabled: AtomicBool,
    capacity: usize,
    pending: Mutex<VecDeque<Span<T>>>,
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
            pending: Mutex::new(VecDeque::new()),
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

    /// Spans queued whose time has not been read yet.
    pub fn pending(&self) -> usize {
        self.pending.lock().len()
    }

    /// Records the start of a span on `stream`; `None` (nothing recorded) when timing is off,
    /// or when the timer is full of spans the GPU has not finished.
    ///
    /// # Errors
    /// The driver's error from taking or recording the event.
    pub fn start(&self, stream: &Stream) -> Result<Option<SpanStart>> {
        if !self.is_enabled() {
            return Ok(None);
        }
        if self.pending.lock().len() >= self.capacity {
            self.skipped.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        let start = self.events.acquire_owned(true)?;
        start.record(stream)?;
        Ok(Some(SpanStart { start }))
    }

    /// Records the end of the span begun by `start` on `stream` (nothing for `None`); its
    /// duration is read later, with `tag`, by [`harvest`](Self::harvest).
    ///
    /// # Errors
    /// The driver's error from taking or recording the event.
    pub fn finish(&self, start: Option<SpanStart>, stream: &Stream, tag: T) -> Result<()> {
        let Some(SpanStart { start }) = start else {
            return Ok(());
        };
        let end = self.events.acquire_owned(true)?;
        end.record(stream)?;
        self.pending.lock().push_back(Span {
            start,
            end: Arc::new(end),
            tag,
        });
        Ok(())
    }

    /// Ends the span begun by `start` at `end`, an event the caller already recorded on the
    /// span's stream and shares for other uses (a completion event that other streams wait
    /// on): one record less than [`finish`](Self::finish). `end` must be a timing event (its
    /// duration reads as an error otherwise).
    pub fn finish_with(&self, start: Option<SpanStart>, end: Arc<OwnedPooledEvent>, tag: T) {
        if let Some(SpanStart { start }) = start {
            self.pending.lock().push_back(Span { start, end, tag });
        }
    }

    /// Hands `sink` the tag, the GPU duration and the start event (to place the span on a
    /// timeline) of every span the GPU has finished, in queueing order up to the first
    /// unfinished one, without blocking; their events go back to the pool afterwards.
    ///
    /// # Errors
    /// The driver's error from querying or reading an event (that span is dropped).
    pub fn harvest(&self, mut sink: impl FnMut(T, Duration, &Event)) -> Result<()> {
        loop {
            let span = {
                let mut pending = self.pending.lock();
                match pending.front() {
                    Some(span) if span.end.query()? => pending.pop_front(),
                    _ => None,
                }
            };
            let Some(span) = span else {
                return Ok(());
            };
            let duration = Self::duration(&span)?;
            sink(span.tag, duration, &span.start);
        }
    }

    /// Waits for every pending span and hands each to `sink`, in queueing order.
    ///
    /// # Errors
    /// The driver's error from waiting on or reading an event.
    pub fn harvest_all(&self, mut sink: impl FnMut(T, Duration, &Event)) -> Result<()> {
        let spans = std::mem::take(&mut *self.pending.lock());
        for span in spans {
            span.end.synchronize()?;
            let duration = Self::duration(&span)?;
            sink(span.tag, duration, &span.start);
        }
        Ok(())
    }

    fn duration(span: &Span<T>) -> Result<Duration> {
        let ms = span.start.elapsed_ms(&span.end)?;
        Ok(Duration::from_nanos(
            (f64::from(ms.max(0.0)) * 1e6).round() as u64
        ))
    }
}
