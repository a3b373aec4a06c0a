//! [`UseState`]: the read/write bookkeeping of a buffer's uses on streams, free of CUDA.
//!
//! The state is generic over the stream ([`UseStream`]) and the event ([`UseEvent`]), so that
//! the rules (which uses a read or a write waits for, which event a use records, when a wait is
//! skipped, when finished reads are dropped) are unit-tested here with fake streams and events;
//! [`super::tracker`] plugs in the driver's `Stream` and `Event`.

use std::sync::Arc;

use cuweave_driver::{Event, Stream};

use super::tracker::Access;
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
}

impl UseEvent for Event {
    fn is_complete(&self) -> Result<bool> {
        Ok(self.query()?)
    }
}

impl UseStream for Stream {
    type Event = Event;

    fn raw(&self) -> usize {
        self.as_raw() as usize
    }

    fn id(&self) -> u64 {
        Stream::id(self)
    }

    fn wait_for(&self, event: &Event) -> Result<()> {
        Ok(self.wait_event(event)?)
    }

    fn record(&self, event: &Event) -> Result<()> {
        Ok(event.record(self)?)
    }
}

/// The identity of a stream for skipping waits: its id, or none for a default stream whose
/// handle can name several streams (`CUstream` 0 or 1, the legacy stream, which blocking
/// operations reach through fresh handles; 2, the per-thread default stream).
fn stream_identity(stream: &impl UseStream) -> Option<u64> {
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
enum ReadSlot {
    Stream(u64),
    Legacy,
}

fn read_slot(stream: &impl UseStream) -> Option<ReadSlot> {
    match stream.raw() {
        0 | 1 => Some(ReadSlot::Legacy),
        2 => None,
        _ => Some(ReadSlot::Stream(stream.id())),
    }
}

/// Reads tracked at once before finished ones are pruned (reads of streams that come and go,
/// or of the per-thread default stream, would otherwise pile up until the next write).
pub(crate) const PRUNE_READS_AT: usize = 8;

/// An event recorded on a stream behind a use of the buffer.
#[derive(Debug)]
struct Use<E> {
    event: Arc<E>,
    /// The stream's identity (`None`: never skip a wait for it).
    stream: Option<u64>,
    /// For reads: the entry a later read of the same stream re-records.
    slot: Option<ReadSlot>,
}

impl<E> Use<E> {
    /// Whether work queued on a stream of identity `stream` is already ordered after this use.
    fn covers(&self, stream: Option<u64>) -> bool {
        self.stream.is_some() && self.stream == stream
    }
}

/// A buffer's conflicting uses: the last write and the reads since it.
#[derive(Debug)]
pub(crate) struct UseState<E> {
    /// The event recorded behind the last write (`None`: never written on a stream).
    write: Option<Use<E>>,
    /// One event per stream that read the buffer since the last write.
    reads: Vec<Use<E>>,
    /// Events no longer needed, for reuse.
    spare: Vec<Arc<E>>,
    /// Raw handle of the stream of the latest use (`None`: never used).
    pub(crate) last_stream: Option<usize>,
}

impl<E> Default for UseState<E> {
    fn default() -> Self {
        Self {
            write: None,
            reads: Vec::new(),
            spare: Vec::new(),
            last_stream: None,
        }
    }
}

impl<E: UseEvent> UseState<E> {
    /// How many streams' reads since the last write are tracked (they may overlap).
    pub(crate) fn readers(&self) -> usize {
        self.reads.len()
    }

    fn take_event(&mut self, make: impl FnOnce() -> Result<Arc<E>>) -> Result<Arc<E>> {
        match self.spare.pop() {
            Some(event) => Ok(event),
            None => make(),
        }
    }

    /// Makes `stream` wait for the uses an `access` conflicts with (a read: the last write; a
    /// write: the last write and every read since), skipping those it is already ordered after.
    pub(crate) fn wait_on<S: UseStream<Event = E>>(
        &self,
        stream: &S,
        access: Access,
    ) -> Result<()> {
        let identity = stream_identity(stream);
        if let Some(write) = &self.write
            && !write.covers(identity)
        {
            stream.wait_for(&write.event)?;
        }
        if access == Access::Write {
            for read in &self.reads {
                if !read.covers(identity) {
                    stream.wait_for(&read.event)?;
                }
            }
        }
        Ok(())
    }

    /// Records an `access` by `stream`, behind the work just queued there (which waited, by
    /// [`wait_on`](Self::wait_on), for what it conflicts with). New events come from the spare
    /// ones, else from `make`.
    pub(crate) fn record<S: UseStream<Event = E>>(
        &mut self,
        stream: &S,
        access: Access,
        make: impl FnOnce() -> Result<Arc<E>>,
    ) -> Result<()> {
        let identity = stream_identity(stream);
        match access {
            Access::Write => {
                let event = match &self.write {
                    Some(previous) => Arc::clone(&previous.event),
                    None => self.take_event(make)?,
                };
                if let Err(error) = stream.record(&event) {
                    // Nothing changed: the earlier uses stay tracked (and the caller drains the
                    // stream, which waited for them).
                    if self.write.is_none() {
                        self.spare.push(event);
                    }
                    return Err(error);
                }
                // The stream waited for every read: they are behind the new write.
                self.spare
                    .extend(self.reads.drain(..).map(|read| read.event));
                self.write = Some(Use {
                    event,
                    stream: identity,
                    slot: None,
                });
            }
            Access::Read => {
                let slot = read_slot(stream);
                if let Some(read) = self
                    .reads
                    .iter()
                    .find(|read| slot.is_some() && read.slot == slot)
                {
                    // Stream order: the event recorded now also covers the earlier read there.
                    stream.record(&read.event)?;
                } else {
                    if self.reads.len() >= PRUNE_READS_AT {
                        self.prune_finished_reads();
                    }
                    let event = self.take_event(make)?;
                    if let Err(error) = stream.record(&event) {
                        self.spare.push(event);
                        return Err(error);
                    }
                    self.reads.push(Use {
                        event,
                        stream: identity,
                        slot,
                    });
                }
            }
        }
        self.last_stream = Some(stream.raw());
        Ok(())
    }

    /// Drops the reads whose events have completed (a later write need not wait for them); a
    /// read whose event cannot be queried is kept.
    fn prune_finished_reads(&mut self) {
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reads)
            .into_iter()
            .partition(|read| matches!(read.event.is_complete(), Ok(true)));
        self.reads = running;
        self.spare.extend(done.into_iter().map(|read| read.event));
    }

    /// Forgets what a *completed* `access` made unnecessary to track: called after the access
    /// ran on a stream that first [waited](Self::wait_on) for its conflicts and was then
    /// synchronized by the host. A write waited for the last write and every read, so all of
    /// them are finished and nothing is left to track; a read waited for the last write, so
    /// that is finished (the reads of other streams may still run and stay tracked). The
    /// completed access itself needs no event: nothing can run before it any more.
    pub(crate) fn settle_completed<S: UseStream<Event = E>>(&mut self, stream: &S, access: Access) {
        if let Some(write) = self.write.take() {
            self.spare.push(write.event);
        }
        if access == Access::Write {
            self.spare
                .extend(self.reads.drain(..).map(|read| read.event));
        }
        self.last_stream = Some(stream.raw());
    }

    /// Takes every event out, leaving the state as new: those recorded behind uses, and the
    /// spare ones.
    pub(crate) fn take_all(&mut self) -> (Vec<Arc<E>>, Vec<Arc<E>>) {
        let recorded = self
            .write
            .take()
            .into_iter()
            .chain(self.reads.drain(..))
            .map(|used| used.event)
            .collect();
        self.last_stream = None;
        (recorded, std::mem::take(&mut self.spare))
    }

    /// Every event a host access must wait for.
    pub(crate) fn all_events(&self) -> Vec<Arc<E>> {
        self.write
            .iter()
            .chain(&self.reads)
            .map(|used| Arc::clone(&used.event))
            .collect()
    }
}

#[cfg(test)]
#[path = "uses_tests.rs"]
mod tests;
