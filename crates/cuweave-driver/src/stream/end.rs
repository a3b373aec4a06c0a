//! [`StreamEnd`]: what a watched [`Stream`] handle leaves behind when dropped, and the
//! process-wide count of such drops ([`ended_watched_streams`]).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Stream;
use crate::error::Result;

/// What a [`Stream`] handle leaves behind when it is dropped, for a layer that keeps state per
/// stream (the caching allocator's free lists) and must know when that state is nobody's and no
/// queued work of the stream can still use it. Taken with [`Stream::end_watch`].
///
/// When a watched handle drops, an event of its context's [`EventPool`](crate::EventPool) is
/// recorded behind all the work queued through it (`cuStreamDestroy` returns at once; that work
/// finishes later), and [`ended_watched_streams`] counts one more. [`is_finished`](Self::is_finished)
/// then says, without blocking, whether that work is done.
///
/// A [`WeakStream`](super::WeakStream) has one too ([`WeakStream::end`](super::WeakStream::end)):
/// the same as [`Stream::end_watch`]'s for a handle that owns its stream; for a borrowed handle
/// ([`Stream::from_raw`] without `owned`) one of its own, recorded when that handle drops (its
/// stream lives on, so such an end says only that the work queued before the drop has
/// finished) and not counted in [`ended_watched_streams`].
#[derive(Debug)]
pub struct StreamEnd {
    /// Set once, at the handle's drop: the event behind its last work, or `None` when none could
    /// be recorded (the stream was capturing, or the driver refused): its end is then never
    /// known finished.
    ended: OnceLock<Option<crate::OwnedPooledEvent>>,
    /// Whether the drop counts in [`ended_watched_streams`] (a borrowed handle's does not: its
    /// stream lives on, and nobody adopts what it leaves).
    counted: bool,
}

impl Default for StreamEnd {
    /// The end of a handle that owns its stream, counted in [`ended_watched_streams`].
    fn default() -> Self {
        Self {
            ended: OnceLock::new(),
            counted: true,
        }
    }
}

impl StreamEnd {
    /// Whether the handle has been dropped (an atomic load).
    #[inline]
    pub fn is_dropped(&self) -> bool {
        self.ended.get().is_some()
    }

    /// Whether the handle has been dropped and every piece of work queued through it before
    /// has finished: one `cuEventQuery` once dropped, no driver call before. `false` for good
    /// when no event could be recorded at the drop.
    ///
    /// # Errors
    /// The driver's error from the query (a capture active in the process refuses it).
    pub fn is_finished(&self) -> Result<bool> {
        match self.ended.get() {
            Some(Some(event)) => event.query(),
            Some(None) | None => Ok(false),
        }
    }

    /// Whether the handle was dropped with an event recorded behind its last work (which
    /// [`wait_on`](Self::wait_on) can wait for).
    #[inline]
    pub fn is_recorded(&self) -> bool {
        matches!(self.ended.get(), Some(Some(_)))
    }

    /// Makes later work on `stream` wait (device-side; the host does not block) until the work
    /// queued through the handle before its drop has finished: `Ok(true)`. `Ok(false)` when
    /// there is nothing to wait for: the handle has not been dropped, or no event could be
    /// recorded at its drop ([`is_recorded`](Self::is_recorded)).
    ///
    /// # Errors
    /// As [`Stream::wait_event`] (a capturing `stream` cannot wait for this eager event).
    pub fn wait_on(&self, stream: &Stream) -> Result<bool> {
        match self.ended.get() {
            Some(Some(event)) => stream.wait_event(event).map(|()| true),
            Some(None) | None => Ok(false),
        }
    }

    /// The end of a borrowed handle that was downgraded: not counted in
    /// [`ended_watched_streams`].
    pub(super) fn uncounted() -> Self {
        Self {
            ended: OnceLock::new(),
            counted: false,
        }
    }

    /// Records the end of `stream`, whose handle is being dropped: an event behind its work,
    /// unless it is capturing (the event would join the capture and could never be queried).
    pub(super) fn record(&self, stream: &Stream) {
        let recorded = match stream.is_capturing() {
            Ok(false) => crate::EventPool::for_context(stream.context())
                .and_then(|pool| pool.acquire_owned(false))
                .and_then(|event| event.record(stream).map(|()| event))
                .map_err(|error| {
                    tracing::warn!(%error, stream = stream.id(), "recording a dropped stream's end failed; its cached memory stays with it");
                })
                .ok(),
            Ok(true) | Err(_) => None,
        };
        self.set(recorded);
    }

    /// Marks the handle dropped, with the event behind its last work if there is one.
    pub(super) fn set(&self, recorded: Option<crate::OwnedPooledEvent>) {
        if self.ended.set(recorded).is_ok() && self.counted {
            ENDED_WATCHED_STREAMS.fetch_add(1, Ordering::Release);
        }
    }
}

/// How many watched stream handles ([`Stream::end_watch`]) have been dropped in this process so
/// far: one atomic load, which lets a watcher skip looking at its streams while it is unchanged.
/// Incremented after the dropped handle's [`StreamEnd`] is set.
#[inline]
pub fn ended_watched_streams() -> u64 {
    ENDED_WATCHED_STREAMS.load(Ordering::Acquire)
}

static ENDED_WATCHED_STREAMS: AtomicU64 = AtomicU64::new(0);
