//! [`UseState`]: the read/write bookkeeping of a buffer's uses on streams, free of CUDA.
//!
//! The state is generic over the stream ([`UseStream`]) and the event ([`UseEvent`]), so that
//! the rules (which uses a read or a write waits for, which event a use records, when a wait is
//! skipped, when finished reads are dropped) are unit-tested here with fake streams and events;
//! [`super::tracker`] plugs in the driver's `Stream` and the pooled events of the context's
//! [`EventPool`](cuweave_driver::EventPool).
//!
//! The state keeps no spare events: an event whose use is retired is dropped, which for a pooled
//! handle means it goes back to the context's pool (once no host wait still holds a clone), and
//! a new use takes one from there (and records it before anything waits on it).
//!
//! **Capture.** Each use carries the capture epoch read just after it was recorded and, when
//! its stream was capturing, the capture's id. A [`CaptureView`] tells each operation whether
//! any capture is active and which capture (with its known-complete epoch bound) the using
//! stream records into. The rules, none of which queries an event:
//! - a capturing stream drops the eager uses stamped before its capture's bound (the context
//!   was synchronised after them: they have finished); it refuses, with
//!   [`GraphError::Capturing`], to wait for an eager use stamped later (another thread's work
//!   after the capture began) or for a use captured by another capture;
//! - uses recorded on a capturing stream order later work of the same capture as usual (and the
//!   graph pool the capture is bound to is remembered for the free: its graphs may replay with
//!   the memory while it lives; see [`UseState::take_all`]);
//!   once their capture has ended they are dropped (the graph's launches are ordered by the stream
//!   the graph is launched on); while it is active, eager work that would wait for one is
//!   refused with [`GraphError::Capturing`];
//! - while any capture is active, finished uses are not pruned (that would query events), and no
//!   capture begins while they are (`outside_captures`: a query would break a global-mode one).

use std::sync::Arc;

use cuweave_driver::graph::GraphError;

use super::tracker::Access;
use crate::caching::NO_POOL;
use crate::error::{MemoryError, Result};

#[path = "uses_bound.rs"]
mod bound;
#[path = "uses_byte_range.rs"]
mod byte_range;
#[path = "uses_capture.rs"]
mod capture;
#[path = "uses_stream.rs"]
mod stream;

pub(crate) use byte_range::ByteRange;
pub(crate) use capture::{CaptureView, Capturing, FencedCaptures};
use capture::{CapturedBytes, CapturedUse};
use stream::{ReadSlot, read_slot, stream_identity};
pub(crate) use stream::{UseEvent, UseStream};

/// What [`UseState::take_all`] hands over when a buffer is freed.
#[derive(Debug)]
pub(crate) struct Taken<E> {
    /// The events recorded behind the uses that are kept, each with the identity of its
    /// stream (`None` for a default stream).
    pub(crate) events: Vec<(Arc<E>, Option<u64>)>,
    /// The distinct tags of the graph pools bound to the captures that used the buffer (of
    /// ended captures too), or [`NO_POOL`] for a capture no pool was bound to.
    pub(crate) graph_pools: Vec<u64>,
}

/// Reads tracked at once before finished ones are pruned (reads of streams that come and go,
/// or of the per-thread default stream, would otherwise pile up until the next write).
pub(crate) const PRUNE_READS_AT: usize = 8;

/// Uses (writes and reads of distinct ranges) tracked at once at most: past it, finished ones
/// are dropped, then the rest merged into one (see [`UseState::record_range`]).
pub(crate) const MAX_USES: usize = 32;

/// How many graph pools a buffer remembers before it first drops the dead ones (and again at
/// each doubling).
pub(crate) const PRUNE_GRAPHS_AT: usize = 16;

/// How many captures a buffer remembers for ordering eager work after their graphs' launches
/// (see [`UseState::waits_for_capture`]).
pub(crate) const CAPTURES_KEPT: usize = 8;

/// An event recorded on a stream behind a use of a range of the buffer.
#[derive(Debug)]
struct Use<E> {
    event: Arc<E>,
    /// The stream's identity (`None`: never skip a wait for it).
    stream: Option<u64>,
    /// For reads: the entry a later read of the same stream re-records.
    slot: Option<ReadSlot>,
    /// The bytes used.
    range: ByteRange,
    /// The capture epoch read just after the event was recorded.
    epoch: u64,
    /// The capture the event was recorded in (`None`: recorded eagerly).
    capture: Option<u64>,
    /// When the event was last recorded, in the state's count of records: of two uses with the
    /// same stream, the one with the larger `seq` was recorded later on that stream.
    seq: u64,
}

impl<E> Use<E> {
    /// Whether work queued on a stream of identity `stream` is already ordered after this use.
    fn covers(&self, stream: Option<u64>) -> bool {
        self.stream.is_some() && self.stream == stream
    }

    /// `Err(Capturing)` when a stream seen through `view` cannot be ordered after this use.
    fn orderable(&self, operation: &'static str, view: &CaptureView) -> Result<()> {
        let reason = match (self.capture, view.tag()) {
            (None, None) => return Ok(()),
            (Some(captured), Some(capturing)) if captured == capturing => return Ok(()),
            (Some(_), _) => {
                "the buffer was used inside an active capture: work outside it cannot wait for captured work"
            }
            (None, Some(_)) => {
                "the buffer was used by work outside the capture after it began: a capturing stream cannot wait for it"
            }
        };
        Err(MemoryError::Driver(
            GraphError::Capturing { operation, reason }.into(),
        ))
    }
}

/// A buffer's conflicting uses, per byte range: the writes not yet overwritten and the reads
/// since them.
///
/// A write of a range retires the uses inside it (the writing stream waited for them); uses
/// that only overlap it stay, so a later use of their other bytes still waits for them. Uses of
/// disjoint ranges never wait for each other.
#[derive(Debug)]
pub(crate) struct UseState<E> {
    /// The events recorded behind writes, by range.
    writes: Vec<Use<E>>,
    /// One event per stream and range that read the buffer since the writes of that range.
    reads: Vec<Use<E>>,
    /// Raw handle of the stream of the latest use (`None`: never used).
    pub(crate) last_stream: Option<usize>,
    /// Whether a use recorded in a capture may still be tracked.
    has_captured: bool,
    /// The graph pools of the captures that used the buffer, by tag (or [`NO_POOL`]): their
    /// graphs may replay with the memory until the pools die, so a free hands them on
    /// ([`UseState::take_all`]). Pools that died are pruned as the list grows past
    /// [`PRUNE_GRAPHS_AT`], so it holds at most twice the pools alive, never a stand-in.
    graphs: Vec<u64>,
    /// The last capture noted and its pool's tag (every record in a capture notes it; a
    /// capture is never rebound to another pool). Never [`NO_POOL`]: a capture may be bound
    /// after its first uses.
    last_graph: Option<(u64, u64)>,
    /// Captures that had no pool bound when they used the buffer: looked up again at the
    /// next record and at the free (a capture is bound only once it has begun, so a use may
    /// come first). Those that ended unresolved are settled as [`NO_POOL`] as the list grows.
    unbound: Vec<u64>,
    /// The latest captures that used the buffer (at most [`CAPTURES_KEPT`]), with the bytes
    /// each used and wrote: eager work on another stream and the launches of their graphs are
    /// ordered where they conflict (see [`UseState::waits_for_capture`],
    /// [`UseState::launches_after`]).
    captures: Vec<CapturedUse>,
    /// More captures used the buffer than are kept: the fenced launches of every tracked
    /// capture's graph are taken to make the uses of [`Self::all_captured`].
    many_captures: bool,
    /// The bytes every capture together used and wrote (those no longer kept included).
    all_captured: CapturedBytes,
    /// Records so far (each use's `seq` is the count when it was last recorded).
    records: u64,
}

impl<E> Default for UseState<E> {
    fn default() -> Self {
        Self {
            writes: Vec::new(),
            reads: Vec::new(),
            last_stream: None,
            has_captured: false,
            graphs: Vec::new(),
            last_graph: None,
            unbound: Vec::new(),
            captures: Vec::new(),
            many_captures: false,
            all_captured: CapturedBytes::default(),
            records: 0,
        }
    }
}

impl<E: UseEvent> UseState<E> {
    /// How many streams' reads since the last writes are tracked (they may overlap).
    pub(crate) fn readers(&self) -> usize {
        self.reads.len()
    }

    /// Whether nothing is tracked (and so no event is held).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.writes.is_empty() && self.reads.is_empty()
    }

    /// How many uses are tracked (writes and reads).
    pub(crate) fn tracked(&self) -> usize {
        self.writes.len() + self.reads.len()
    }

    /// [`wait_on_range`](Self::wait_on_range) for the whole buffer.
    #[cfg(test)]
    pub(crate) fn wait_on<S: UseStream<Event = E>>(
        &mut self,
        stream: &S,
        access: Access,
    ) -> Result<()> {
        self.wait_on_range("test", stream, ByteRange::WHOLE, access, &CaptureView::NONE)
    }

    /// [`record_range`](Self::record_range) for the whole buffer.
    #[cfg(test)]
    pub(crate) fn record<S: UseStream<Event = E>>(
        &mut self,
        stream: &S,
        access: Access,
        make: impl FnOnce() -> Result<Arc<E>>,
    ) -> Result<()> {
        self.record_range(stream, ByteRange::WHOLE, access, &CaptureView::NONE, make)
    }

    /// [`settle_range`](Self::settle_range) for the whole buffer.
    #[cfg(test)]
    pub(crate) fn settle_completed<S: UseStream<Event = E>>(&mut self, stream: &S, access: Access) {
        self.settle_range(stream, ByteRange::WHOLE, access);
    }

    /// Makes `stream` wait for the uses of `range` an `access` conflicts with (a read: the
    /// writes; a write: the writes and every read since), skipping those it is already ordered
    /// after. First forgets, without querying, the uses `view` shows to be finished or out of
    /// reach (see the module docs on capture).
    ///
    /// # Errors
    /// `GraphError::Capturing` (nothing waited for) when a conflicting use cannot be waited for
    /// across a capture boundary; the stream's error.
    pub(crate) fn wait_on_range<S: UseStream<Event = E>>(
        &mut self,
        operation: &'static str,
        stream: &S,
        range: ByteRange,
        access: Access,
        view: &CaptureView,
    ) -> Result<()> {
        self.reconcile(stream, view);
        let identity = stream_identity(stream);
        // A use on this very stream is ordered by stream order only on the same side of a
        // capture: an eager use on a stream that now captures is not part of the graph, so it
        // goes through the capture check like any other (and is never re-recorded away).
        let tag = view.tag();
        let conflicting = |used: &&Use<E>| {
            used.range.overlaps(range) && !(used.covers(identity) && used.capture == tag)
        };
        let reads = self
            .reads
            .iter()
            .filter(|_| access == Access::Write)
            .filter(conflicting);
        if view.any_active || self.has_captured {
            for used in self.writes.iter().filter(conflicting).chain(reads.clone()) {
                used.orderable(operation, view)?;
            }
        }
        for used in self.writes.iter().filter(conflicting).chain(reads) {
            stream.wait_for(&used.event)?;
        }
        Ok(())
    }

    /// Forgets, without querying any event, the uses `view` shows need no wait: uses of
    /// captures that have ended and, for a capturing stream, eager uses stamped before its
    /// capture's known-complete bound. Their events go back to the pool (whoever takes one
    /// records it again, which resets it).
    fn reconcile<S: UseStream<Event = E>>(&mut self, stream: &S, view: &CaptureView) {
        if !view.any_active && !self.has_captured {
            return;
        }
        let complete_before = view.capture.map_or(0, |capture| capture.complete_before);
        let mut has_captured = false;
        let mut keep = |used: &Use<E>| {
            let finished = match used.capture {
                Some(id) => !view.any_active || !stream.capture_is_active(id),
                None => used.epoch < complete_before,
            };
            if !finished {
                has_captured |= used.capture.is_some();
            }
            !finished
        };
        self.writes.retain(&mut keep);
        self.reads.retain(&mut keep);
        self.has_captured = has_captured;
    }

    /// Records an `access` of `range` by `stream`, behind the work just queued there (which
    /// waited, by [`wait_on_range`](Self::wait_on_range), for what it conflicts with). A new
    /// event, when the use needs one, comes from `make` (the context's event pool).
    ///
    /// Bounded: past [`MAX_USES`] uses, the finished ones are dropped; if that is not enough,
    /// `stream` waits for every remaining use and one event recorded on it then stands for all
    /// of them (a write of their combined range), so a buffer used in ever new ranges keeps a
    /// fixed number of events.
    pub(crate) fn record_range<S: UseStream<Event = E>>(
        &mut self,
        stream: &S,
        range: ByteRange,
        access: Access,
        view: &CaptureView,
        make: impl FnOnce() -> Result<Arc<E>>,
    ) -> Result<()> {
        let identity = stream_identity(stream);
        let tag = view.tag();
        if let Some(id) = tag {
            self.has_captured = true;
            self.note_graph(stream, id, range, access);
        }
        self.records += 1;
        let seq = self.records;
        match access {
            Access::Write => {
                // Re-record a write this one overwrites, else take an event.
                if let Some(index) = self
                    .writes
                    .iter()
                    .position(|w| range.contains(w.range) && w.capture == tag)
                {
                    stream.record(&self.writes[index].event)?;
                    let mut write = self.writes.swap_remove(index);
                    write.stream = identity;
                    write.range = range;
                    write.epoch = stream.capture_epoch();
                    write.capture = tag;
                    write.seq = seq;
                    self.retire_inside(range);
                    self.writes.push(write);
                } else {
                    let event = make()?;
                    // On failure nothing changed: the earlier uses stay tracked (and the caller
                    // drains the stream, which waited for them); the event goes back.
                    stream.record(&event)?;
                    self.retire_inside(range);
                    self.writes.push(Use {
                        event,
                        stream: identity,
                        slot: None,
                        range,
                        epoch: stream.capture_epoch(),
                        capture: tag,
                        seq,
                    });
                }
            }
            Access::Read => {
                let slot = read_slot(stream);
                if let Some(read) = self.reads.iter_mut().find(|read| {
                    slot.is_some()
                        && read.slot == slot
                        && read.capture == tag
                        && (read.range.contains(range) || range.contains(read.range))
                }) {
                    // Stream order: the event recorded now also covers the earlier read there.
                    stream.record(&read.event)?;
                    read.range = read.range.hull(range);
                    read.epoch = stream.capture_epoch();
                    read.seq = seq;
                } else {
                    if self.reads.len() >= PRUNE_READS_AT {
                        self.prune_finished(view);
                    }
                    let event = make()?;
                    stream.record(&event)?;
                    self.reads.push(Use {
                        event,
                        stream: identity,
                        slot,
                        range,
                        epoch: stream.capture_epoch(),
                        capture: tag,
                        seq,
                    });
                }
            }
        }
        self.last_stream = Some(stream.raw());
        if self.tracked() > MAX_USES {
            self.prune_finished(view);
            if self.tracked() > MAX_USES {
                self.merge_on(stream, identity, tag);
            }
        }
        Ok(())
    }

    /// Retires every use inside `range` (the writer waited for them); their events go back.
    fn retire_inside(&mut self, range: ByteRange) {
        let outside = |used: &Use<E>| !range.contains(used.range);
        self.writes.retain(outside);
        self.reads.retain(outside);
    }

    /// Forgets what a *completed* `access` of `range` made unnecessary to track: called after
    /// the access ran on a stream that first [waited](Self::wait_on_range) for its conflicts
    /// and was then synchronized by the host. A write waited for every overlapping use, a read
    /// for the overlapping writes: those have finished, whole. The completed access itself needs
    /// no event: nothing can run before it any more.
    pub(crate) fn settle_range<S: UseStream<Event = E>>(
        &mut self,
        stream: &S,
        range: ByteRange,
        access: Access,
    ) {
        let unfinished = |used: &Use<E>| !used.range.overlaps(range);
        self.writes.retain(unfinished);
        if access == Access::Write {
            self.reads.retain(unfinished);
        }
        self.last_stream = Some(stream.raw());
    }

    /// Takes every event recorded behind a use out, leaving the state as new, with the graph
    /// pools of every capture that used the buffer, ended or not: their graphs may replay with
    /// the memory, so the free hands the block to those pools (whatever the capture count reads
    /// by then) instead of the general cache; pools that have died by then are skipped. Events
    /// of uses whose capture has ended (`ended` says which) are dropped, back to their pool:
    /// they can never be queried.
    pub(crate) fn take_all(&mut self, ended: impl Fn(u64) -> bool) -> Taken<E> {
        let mut events = Vec::with_capacity(self.tracked());
        for used in self.writes.drain(..).chain(self.reads.drain(..)) {
            if !used.capture.is_some_and(&ended) {
                events.push((used.event, used.stream));
            }
        }
        self.last_stream = None;
        self.has_captured = false;
        self.last_graph = None;
        // A capture still unbound at the free is looked up once more (bound since, or ended
        // bound: its pool; else stranded).
        self.settle_unbound(|_| false, crate::caching::pool_tag_of_capture);
        Taken {
            events,
            graph_pools: std::mem::take(&mut self.graphs),
        }
    }

    /// Every event a host write must wait for ([`host_events`](Self::host_events) with
    /// `Access::Write`).
    #[cfg(test)]
    pub(crate) fn all_events(
        &self,
        operation: &'static str,
        active: impl Fn(u64) -> bool,
    ) -> Result<Vec<Arc<E>>> {
        self.host_events(operation, Access::Write, active)
    }

    /// The events a host `access` of the whole buffer must wait for: a read waits for the
    /// writes only (the device's reads and the host's may overlap), a write for every use. Uses
    /// of ended captures are left out (their work is the graph's, ordered by the stream it is
    /// launched on).
    ///
    /// # Errors
    /// `GraphError::Capturing` when a use `access` conflicts with was recorded in a capture that
    /// is still active (`active` says which): its event cannot be waited for by the host.
    pub(crate) fn host_events(
        &self,
        operation: &'static str,
        access: Access,
        active: impl Fn(u64) -> bool,
    ) -> Result<Vec<Arc<E>>> {
        let reads = if access == Access::Write {
            &self.reads[..]
        } else {
            &[]
        };
        let mut events = Vec::with_capacity(self.writes.len() + reads.len());
        for used in self.writes.iter().chain(reads) {
            match used.capture {
                Some(id) if active(id) => {
                    return Err(MemoryError::Driver(
                        GraphError::Capturing {
                            operation,
                            reason: "the buffer was used inside an active capture: the host cannot wait for captured work",
                        }
                        .into(),
                    ));
                }
                Some(_) => {}
                None => events.push(Arc::clone(&used.event)),
            }
        }
        Ok(events)
    }
}

#[cfg(test)]
#[path = "uses_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "uses_capture_tests.rs"]
mod capture_tests;

#[cfg(test)]
#[path = "uses_model_tests.rs"]
mod model_tests;
