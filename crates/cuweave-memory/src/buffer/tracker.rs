//! [`StreamTracker`]: a buffer's uses on streams, reads apart from writes, and ordering every
//! later use after the ones it conflicts with.
//!
//! The protocol, which every operation on a buffer follows through [`run`] / [`run_uses`]:
//!
//! 1. the stream about to use the buffer waits (device-side, `cuStreamWaitEvent`) for the
//!    events of the uses it conflicts with: a **read** waits for the last write; a **write**
//!    waits for the last write and for every read since it;
//! 2. the operation is queued;
//! 3. an event is recorded on this stream behind it: a write re-records the write event and
//!    forgets the reads (they are behind it now); a read re-records its stream's read event.
//!
//! So readers on different streams run together, each ordered only after the last writer, and
//! the next writer waits for all of them (one event per reading stream, which a single "read
//! event" per buffer could not do). Host access and the buffer's `Drop` wait for every event.
//!
//! A use on the stream that already holds the event it would wait for skips the wait (stream
//! order already covers it) and re-records that stream's event instead of taking a new one.
//! Streams are compared by their process-unique [`Stream::id`]; the legacy and per-thread default
//! streams, whose one handle may name different streams, never skip.
//!
//! A blocking host copy ([`run_completed`]) skips step 3: it returns only once the legacy
//! stream, which waited for the copy's conflicts, has finished, so instead of recording an
//! event the tracker forgets the uses now known to be done (a write: all of them; a read: the
//! last write). Blocking copies in a loop thus cost the driver call and nothing more. "Finished"
//! must mean the device side has landed: `cuMemcpyHtoD` from pageable memory returns once the
//! bytes are staged, with the DMA still queued on the legacy stream, so the upload goes through
//! `memory::copy_htod`, which synchronises that stream before returning.
//!
//! The three steps run under the tracker's lock so that two threads using one buffer through
//! `&self` cannot interleave them; the lock covers only the queueing calls, never a wait on an
//! event by the host.
//!
//! **Stream capture.** Each operation reads where its stream stands ([`CaptureView`]: one
//! atomic load while no capture is active anywhere) and each recorded use is stamped with the
//! capture epoch and, on a capturing stream, the capture's id. A capture begun through
//! `StreamCapture` synchronises its context first, so a capturing stream drops the eager uses
//! stamped before it instead of waiting on events recorded outside the capture; uses recorded
//! in a capture order the capture's later work and are forgotten once it ends; anything else
//! that would cross a capture boundary is a `GraphError::Capturing` refusal, never a broken
//! capture. The rules live in [`super::uses`].
//!
//! **Graph launches.** A launch of a graph records no use here (the tracker saw the capture, not
//! the launches), so once a capture has used the buffer, host access also waits for the graph
//! launches: [`StreamTracker::synchronize`] synchronises the context unless no graph has been
//! launched since its last such wait (`cuweave_driver::graph::launched_since`), and
//! [`StreamTracker::is_idle`] says "busy" until such a wait covers the last launch. Eager
//! device work on another stream waits for the fences the launches of graphs from the
//! buffer's captures leave (`cuweave_driver::graph::wait_for_graph_launches`), so it is ordered
//! after them without a host wait.
//!
//! [`CaptureView`]: super::uses::CaptureView

use std::sync::Arc;

use cuweave_driver::graph::{
    HostBorrow, LaunchMark, LaunchesAfter, active_captures, capture_is_active, launched_since,
    synchronize_launches,
};
use cuweave_driver::{Context, EventPool, OwnedPooledEvent, Stream};
use parking_lot::Mutex;

use super::uses::{ByteRange, FencedCaptures, UseState};
use crate::caching::ShardHandle;
use crate::error::{MemoryError, Result};
use crate::events::StreamEvent;

#[path = "tracker_origin.rs"]
mod origin;
#[path = "tracker_protocol.rs"]
mod protocol;

pub(crate) use origin::Origin;

pub(crate) use protocol::{
    OpFailure, Part, ensure_same_device, run, run_completed, run_uses, settle,
};

/// What a tracker's lock guards: the buffer's uses, and, for a cached buffer not yet used on
/// another stream, where its memory came from ([`Origin`]).
#[derive(Debug, Default)]
pub(crate) struct Tracked {
    uses: UseState<OwnedPooledEvent>,
    /// The allocation stream, until a use on another stream was ordered after it.
    pub(crate) origin: Option<Origin>,
}

impl std::ops::Deref for Tracked {
    type Target = UseState<OwnedPooledEvent>;

    #[inline]
    fn deref(&self) -> &Self::Target {
        &self.uses
    }
}

impl std::ops::DerefMut for Tracked {
    #[inline]
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.uses
    }
}

/// Where a tracked buffer's context and events come from: the context's event pool, or the
/// caching allocator's shard handle its memory came from (so that making a cached buffer writes
/// no reference count that other threads share: every thread on its own stream has its own
/// shard), whose allocator holds the same pool.
#[derive(Clone)]
pub(crate) enum Owner {
    /// The event pool of the buffer's context (which it names).
    Events(EventPool),
    /// The caching allocator the memory came from: its context, and that context's event pool.
    Cache(Arc<ShardHandle>),
}

impl Owner {
    #[inline]
    fn context(&self) -> &Arc<Context> {
        match self {
            Self::Events(pool) => pool.context(),
            Self::Cache(shard) => shard.shared.context(),
        }
    }
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Events(_) => f.write_str("EventPool"),
            Self::Cache(_) => f.write_str("CachingAllocator"),
        }
    }
}

/// What a freed buffer's tracker hands over ([`StreamTracker::take_for_free`]).
#[derive(Debug, Default)]
pub(crate) struct FreeMarkers {
    /// The events recorded behind its uses, each with its stream's identity.
    pub(crate) events: Vec<StreamEvent>,
    /// The tags of the graph pools bound to the captures that used the buffer (of ended
    /// captures too; [`NO_POOL`](crate::caching::NO_POOL) for a capture no pool was bound to):
    /// the graphs of those pools may replay with the memory while the pools live. Empty when no
    /// capture used the buffer.
    pub(crate) graph_pools: Vec<u64>,
}

impl FreeMarkers {
    /// Whether the free must take the capture path: a capture is active now, or one used the
    /// buffer.
    #[inline]
    pub(crate) fn during_capture(&self) -> bool {
        self.used_in_graphs() || active_captures() != 0
    }

    /// Whether a capture used the buffer (its memory may belong to graphs).
    #[inline]
    pub(crate) fn used_in_graphs(&self) -> bool {
        !self.graph_pools.is_empty()
    }
}

/// How an operation uses a buffer: whether it only reads the memory or may write it.
///
/// Reads on different streams overlap; a write is ordered after every earlier use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// The operation only reads the buffer.
    Read,
    /// The operation may write the buffer (also the meaning of the untyped `prepare_use` /
    /// `record_use`).
    Write,
}

/// Remembers a buffer's last write and the reads since, as events recorded behind them.
///
/// Part of every buffer; reached through the [`Buffer`](super::Buffer) methods `prepare_read`,
/// `prepare_write`, `record_read`, `record_write` (and `prepare_use` / `record_use`, which mean
/// a write), `last_use`, `is_idle` and `synchronize`, and through
/// [`TrackedLaunch`](crate::TrackedLaunch).
#[derive(Debug)]
pub struct StreamTracker {
    owner: Owner,
    state: Mutex<Tracked>,
    /// The graph launches the last context wait of [`synchronize`](Self::synchronize) covered
    /// (`None`: never waited), for a buffer that captures used.
    graphs_waited: Mutex<Option<LaunchMark>>,
    /// The capture whose graph allocates the buffer's memory (a stream-ordered resource's
    /// allocation on a capturing stream): only work captured into it may use the buffer.
    graph_allocation_of: Option<u64>,
}

impl StreamTracker {
    /// A tracker for a buffer of `context` that has not been used yet, taking its events from
    /// the context's pool.
    ///
    /// # Errors
    /// As [`EventPool::for_context`].
    pub(crate) fn new(context: &Arc<Context>) -> Result<Self> {
        Ok(Self::with_owner(Owner::Events(EventPool::for_context(
            context,
        )?)))
    }

    /// A tracker for a buffer of `pool`'s context that takes its events from `pool`.
    pub(crate) fn with_events(pool: EventPool) -> Self {
        Self::with_owner(Owner::Events(pool))
    }

    /// A tracker for a buffer whose context comes from `owner`.
    #[inline]
    pub(crate) fn with_owner(owner: Owner) -> Self {
        Self {
            owner,
            state: Mutex::new(Tracked::default()),
            graphs_waited: Mutex::new(None),
            graph_allocation_of: None,
        }
    }

    /// A tracker for a cached buffer whose memory came from a block of `stream`'s free list:
    /// its first use on another stream waits for `stream` (see [`Origin`]).
    #[inline]
    pub(crate) fn with_origin(owner: Owner, origin: Origin) -> Self {
        Self {
            owner,
            state: Mutex::new(Tracked {
                uses: UseState::default(),
                origin: Some(origin),
            }),
            graphs_waited: Mutex::new(None),
            graph_allocation_of: None,
        }
    }

    /// Marks the buffer's memory as a graph allocation of `capture`: from now on only work
    /// captured into that capture may use it ([`MemoryError::GraphAllocation`] otherwise).
    pub(crate) fn set_graph_allocation(&mut self, capture: u64) {
        self.graph_allocation_of = Some(capture);
    }

    /// The capture whose graph allocates the buffer's memory, if it is a graph allocation.
    #[inline]
    pub(crate) fn graph_allocation_of(&self) -> Option<u64> {
        self.graph_allocation_of
    }

    /// The context of the buffer this tracker belongs to.
    #[inline]
    pub(crate) fn context(&self) -> &Arc<Context> {
        self.owner.context()
    }

    /// An event for a new use, from the context's event pool (which creates one only when
    /// every event it made is held).
    fn new_event(&self) -> Result<Arc<OwnedPooledEvent>> {
        Ok(Arc::new(self.event_pool()?.acquire_owned(false)?))
    }

    /// The event pool of the buffer's context: its own, or its caching allocator's.
    ///
    /// # Errors
    /// As [`EventPool::for_context`], the first time an allocator needs its pool.
    pub(crate) fn event_pool(&self) -> Result<&EventPool> {
        match &self.owner {
            Owner::Events(pool) => Ok(pool),
            Owner::Cache(shard) => shard.shared.event_pool(),
        }
    }

    /// A non-timing event to record on `stream` (see [`crate::events::event_on`]).
    ///
    /// # Errors
    /// The driver's error when the pool had to grow and creating the event failed.
    pub(crate) fn event_for(&self, stream: &Stream) -> Result<OwnedPooledEvent> {
        crate::events::event_on(self.event_pool()?, stream)
    }

    /// The caching allocator shard the buffer's memory came from, if it did.
    #[inline]
    pub(crate) fn shard(&self) -> Option<&ShardHandle> {
        match &self.owner {
            Owner::Cache(shard) => Some(shard),
            Owner::Events(_) => None,
        }
    }

    /// Takes the events recorded behind uses out of the tracker when its buffer is freed: the
    /// memory may be reused only once they have all completed, so they travel with the block
    /// (to the caching allocator's pending list or the pinned pool) and go back to the event
    /// pool when dropped there. Nothing (no allocation, no lock: the buffer is being dropped)
    /// when nothing is tracked.
    ///
    /// [`FreeMarkers::graph_pools`] names the graph pools of the captures that used the buffer:
    /// the free must then go to the capture path, which holds the memory for their graphs (while
    /// the pools live), even if those captures have ended (their events can never be queried,
    /// and their graphs may replay).
    ///
    /// A recorded event that is still shared (only a host wait on this tracker clones one, and
    /// a buffer being freed has no borrower left) is waited for here instead.
    #[inline]
    pub(crate) fn take_for_free(&mut self) -> FreeMarkers {
        let state = self.state.get_mut();
        if state.is_empty() && !state.used_in_graphs() {
            return FreeMarkers::default();
        }
        // Uses of an ended capture are never queried: with no capture active, every one has ended.
        let none_active = active_captures() == 0;
        let taken = state.take_all(|id| none_active || !capture_is_active(id));
        let mut events = Vec::with_capacity(taken.events.len());
        for (event, stream) in taken.events {
            match Arc::try_unwrap(event) {
                Ok(event) => events.push(StreamEvent { event, stream }),
                Err(shared) => {
                    if let Err(error) = shared.synchronize() {
                        tracing::error!(%error, "waiting for a shared use event of a freed buffer failed");
                    }
                }
            }
        }
        FreeMarkers {
            events,
            graph_pools: taken.graph_pools,
        }
    }

    /// The raw handle of the stream that last used the buffer (0 is the legacy default stream,
    /// which blocking operations use), or `None` if it was never used on a stream.
    pub(crate) fn last_use(&self) -> Option<usize> {
        self.state.lock().last_stream
    }

    /// How many streams read the buffer since its last write (their reads may overlap).
    pub(crate) fn concurrent_readers(&self) -> usize {
        self.state.lock().readers()
    }

    /// Blocks until every use has finished on the device, the launches of graphs that may use
    /// the buffer included (see the module docs).
    ///
    /// # Errors
    /// `GraphError::Capturing` when an active capture used the buffer, or when it must wait for
    /// graph launches while any capture is active (a context synchronisation would wait on the
    /// capturing streams); the driver's error otherwise.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.synchronize_before(Access::Write)
    }

    /// Waits for the uses a host `access` of the whole buffer conflicts with: for a read, the
    /// writes (device reads may go on beside the host's); for a write, every use. Graph
    /// launches are covered as in [`synchronize`](Self::synchronize).
    ///
    /// # Errors
    /// As [`synchronize`](Self::synchronize).
    fn synchronize_before(&self, access: Access) -> Result<()> {
        let (events, in_graphs) = self.host_wait("StreamTracker::synchronize", access)?;
        for event in events {
            event.synchronize()?;
        }
        if in_graphs && !self.graph_launches_waited() {
            let mark = synchronize_launches(self.context())?;
            *self.graphs_waited.lock() = Some(mark);
        }
        Ok(())
    }

    /// What a host wait must cover, read under one lock: the events of every use (cloned out,
    /// so that no lock is held while the host waits for the GPU), and whether a capture used the
    /// buffer (then graph launches, which record no uses, must be covered too).
    ///
    /// # Errors
    /// As [`UseState::host_events`].
    fn host_wait(
        &self,
        operation: &'static str,
        access: Access,
    ) -> Result<(Vec<Arc<OwnedPooledEvent>>, bool)> {
        let state = self.state.lock();
        let events = state.host_events(operation, access, capture_is_active)?;
        Ok((events, state.used_in_graphs()))
    }

    /// Whether a context wait since the last graph launch in the process covered the launches
    /// of graphs that may use the buffer.
    fn graph_launches_waited(&self) -> bool {
        matches!(*self.graphs_waited.lock(), Some(mark) if !launched_since(mark))
    }

    /// Whether every use has finished, without blocking. For a buffer a capture used, `false`
    /// while a graph launch since the last [`synchronize`](Self::synchronize) may still run.
    pub(crate) fn is_idle(&self) -> Result<bool> {
        self.is_idle_for(Access::Write)
    }

    /// Whether every use a host `access` conflicts with has finished, without blocking (see
    /// [`synchronize_before`](Self::synchronize_before)).
    fn is_idle_for(&self, access: Access) -> Result<bool> {
        let (events, in_graphs) = self.host_wait("StreamTracker::is_idle", access)?;
        if in_graphs && !self.graph_launches_waited() {
            return Ok(false);
        }
        for event in events {
            if !event.query()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// `Err(DeviceBusy)` unless every use a host `access` conflicts with has finished.
    fn ensure_idle_before(&self, access: Access, operation: &'static str) -> Result<()> {
        if self.is_idle_for(access)? {
            Ok(())
        } else {
            Err(MemoryError::DeviceBusy {
                operation,
                stream: self.last_use().unwrap_or_default(),
            })
        }
    }

    /// Waits as [`synchronize`](Self::synchronize) does before a host `access` of the whole
    /// buffer, and returns the borrow that holds back the launches of graphs whose captures
    /// conflict with that access (a read: captures that wrote some of its bytes; a write: those
    /// that used some) until it is dropped; `None` when no capture did.
    ///
    /// The borrow is registered before the wait: a launch it does not refuse was enqueued
    /// before the wait began, so the wait covers it.
    ///
    /// # Errors
    /// As [`synchronize`](Self::synchronize); the borrow ends with the error.
    pub(crate) fn synchronize_for_host(&self, access: Access) -> Result<Option<HostBorrow>> {
        let borrow = self.begin_host_borrow(access);
        self.synchronize_before(access)?;
        Ok(borrow)
    }

    /// As [`synchronize_for_host`](Self::synchronize_for_host), without blocking:
    /// `Err(DeviceBusy)` unless every use has finished.
    ///
    /// # Errors
    /// As [`ensure_idle_before`](Self::ensure_idle_before); the borrow ends with the error.
    pub(crate) fn ensure_idle_for_host(
        &self,
        access: Access,
        operation: &'static str,
    ) -> Result<Option<HostBorrow>> {
        let borrow = self.begin_host_borrow(access);
        self.ensure_idle_before(access, operation)?;
        Ok(borrow)
    }

    fn begin_host_borrow(&self, access: Access) -> Option<HostBorrow> {
        let conflicting = {
            let state = self.state.lock();
            if !state.used_in_graphs() {
                return None;
            }
            state.launches_after(ByteRange::WHOLE, access)?
        };
        Some(HostBorrow::begin(match &conflicting {
            FencedCaptures::These(captures) => LaunchesAfter::Captures(captures),
            FencedCaptures::Any => LaunchesAfter::AnyCapture,
        }))
    }

    /// How many uses are tracked (bounded by the merge rule of [`UseState::record_range`]).
    pub(crate) fn tracked_uses(&self) -> usize {
        self.state.lock().tracked()
    }
}
