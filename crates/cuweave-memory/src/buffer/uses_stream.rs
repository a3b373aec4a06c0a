//! The stream and the event a buffer's uses are recorded with, as the bookkeeping sees them
//! ([`UseStream`], [`UseEvent`]): the driver's `Stream` and pooled events, or the tests' fakes.

use cuweave_driver::{OwnedPooledEvent, Stream};

use crate::error::Result;

/// An event as the bookkeeping needs it.
pub(crate) trait UseEvent {
    /// Whether the work recorded before it has finished; never blocks.
    fn is_complete(&self) -> Result<bool>;
}

/// A stream as the bookkeeping needs it.
pub(crate) trait UseStream {
    /// The event type recorded on it.
    type Event: UseEvent;
    /// The raw `CUstream` value (0 and 1: the legacy default stream; 2: the per-thread one).
    fn raw(&self) -> usize;
    /// The handle's process-unique id.
    fn id(&self) -> u64;
    /// Makes the stream wait (device-side) for `event`.
    fn wait_for(&self, event: &Self::Event) -> Result<()>;
    /// Records `event` behind the work queued on the stream so far.
    fn record(&self, event: &Self::Event) -> Result<()>;
    /// The capture epoch now (read after recording a use, to stamp it).
    fn capture_epoch(&self) -> u64;
    /// Whether the capture `id` is still active.
    fn capture_is_active(&self, id: u64) -> bool;
    /// The graph pool the active capture `id` allocates from, as a tag that outlives the
    /// capture's binding ([`NO_POOL`](crate::caching::NO_POOL) when no pool is bound to it).
    fn graph_pool_of(&self, capture: u64) -> u64 {
        crate::caching::pool_tag_of_capture(capture)
    }
    /// Whether the graph pool `tag` still has a holder (a handle, graph or executable).
    fn graph_pool_is_live(&self, tag: u64) -> bool {
        crate::caching::pool_tag_is_live(tag)
    }
}

impl UseEvent for OwnedPooledEvent {
    fn is_complete(&self) -> Result<bool> {
        Ok(self.query()?)
    }
}

impl UseStream for Stream {
    type Event = OwnedPooledEvent;

    fn raw(&self) -> usize {
        self.as_raw() as usize
    }

    fn id(&self) -> u64 {
        Stream::id(self)
    }

    fn wait_for(&self, event: &OwnedPooledEvent) -> Result<()> {
        Ok(self.wait_event(event)?)
    }

    fn record(&self, event: &OwnedPooledEvent) -> Result<()> {
        Ok(event.record(self)?)
    }

    #[inline]
    fn capture_epoch(&self) -> u64 {
        // The record just made is ordered before the epoch read that stamps it.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        cuweave_driver::graph::capture_state().epoch
    }

    fn capture_is_active(&self, id: u64) -> bool {
        cuweave_driver::graph::capture_is_active(id)
    }
}

/// The identity of a stream for skipping waits: its id, or none for a default stream whose
/// handle can name several streams (`CUstream` 0 or 1, the legacy stream, which blocking
/// operations reach through fresh handles; 2, the per-thread default stream).
pub(super) fn stream_identity(stream: &impl UseStream) -> Option<u64> {
    if stream.raw() <= 2 {
        None
    } else {
        Some(stream.id())
    }
}

/// Which read entry a read may re-record: its own stream's. Reads on the legacy default stream
/// (one stream per context) share one entry; reads on the per-thread default stream, whose one
/// handle names a different stream on each thread, never share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReadSlot {
    Stream(u64),
    Legacy,
}

pub(super) fn read_slot(stream: &impl UseStream) -> Option<ReadSlot> {
    match stream.raw() {
        0 | 1 => Some(ReadSlot::Legacy),
        2 => None,
        _ => Some(ReadSlot::Stream(stream.id())),
    }
}
