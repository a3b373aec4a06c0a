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

use std::sync::Arc;

use cuweave_driver::graph::{
    CaptureStatus, HostBorrow, LaunchMark, LaunchesAfter, active_captures, capture_is_active,
    launched_since, synchronize_launches,
};
use cuweave_driver::{Context, EventPool, OwnedPooledEvent, Stream};
use parking_lot::{Mutex, MutexGuard};

use super::uses::{ByteRange, CaptureView, Capturing, FencedCaptures, UseState};
use crate::caching::ShardHandle;
use crate::error::{MemoryError, Result};
use crate::events::StreamEvent;

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
    state: Mutex<UseState<OwnedPooledEvent>>,
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
            state: Mutex::new(UseState::default()),
            graphs_waited: Mutex::new(None),
            graph_allocation_of: None,
        }
    }

    /// Marks the buffer's memory as a graph allocation of `capture`: from now on only work
    /// captured into that capture may use it ([`MemoryError::GraphAllocation`] otherwise).
    pub(crate) fn set_graph_allocation(&mut self, capture: u64) {
        self.graph_allocation_of = Some(capture);
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
        let (events, in_graphs) = self.host_wait("StreamTracker::synchronize")?;
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
    /// As [`UseState::all_events`].
    fn host_wait(&self, operation: &'static str) -> Result<(Vec<Arc<OwnedPooledEvent>>, bool)> {
        let state = self.state.lock();
        let events = state.all_events(operation, capture_is_active)?;
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
        let (events, in_graphs) = self.host_wait("StreamTracker::is_idle")?;
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

    /// `Err(DeviceBusy)` unless every use has finished.
    pub(crate) fn ensure_idle(&self, operation: &'static str) -> Result<()> {
        if self.is_idle()? {
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
        self.synchronize()?;
        Ok(borrow)
    }

    /// As [`synchronize_for_host`](Self::synchronize_for_host), without blocking:
    /// `Err(DeviceBusy)` unless every use has finished.
    ///
    /// # Errors
    /// As [`ensure_idle`](Self::ensure_idle); the borrow ends with the error.
    pub(crate) fn ensure_idle_for_host(
        &self,
        access: Access,
        operation: &'static str,
    ) -> Result<Option<HostBorrow>> {
        let borrow = self.begin_host_borrow(access);
        self.ensure_idle(operation)?;
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

/// Part of a tracked buffer: its tracker, the bytes a use touches, and whether the borrow it
/// came from allows writing them (a shared view does not).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Part<'a> {
    /// The buffer's tracker.
    pub(crate) tracker: &'a StreamTracker,
    /// The bytes, relative to the buffer's first byte.
    pub(crate) range: ByteRange,
    /// `false` for a shared view: a write through it is refused.
    pub(crate) writable: bool,
}

impl<'a> Part<'a> {
    /// The whole buffer of `tracker`, writable.
    pub(crate) fn whole(tracker: &'a StreamTracker) -> Self {
        Self {
            tracker,
            range: ByteRange::WHOLE,
            writable: true,
        }
    }

    /// `Err(ReadOnlyView)` for a write through a shared view.
    pub(crate) fn check(&self, operation: &'static str, access: Access) -> Result<()> {
        if access == Access::Write && !self.writable {
            Err(MemoryError::ReadOnlyView { operation })
        } else {
            Ok(())
        }
    }

    /// Makes `stream` wait (device-side) for the uses an `access` of this part conflicts with,
    /// without recording a new one.
    pub(crate) fn prepare(
        &self,
        operation: &'static str,
        stream: &Stream,
        access: Access,
    ) -> Result<()> {
        self.check(operation, access)?;
        ensure_same_device(operation, self.tracker.context(), stream)?;
        let view = capture_view(self.tracker, stream, operation)?;
        wait_before_use(
            &mut self.tracker.state.lock(),
            operation,
            stream,
            self.range,
            access,
            &view,
        )
    }

    /// Records an `access` of this part by the work just queued on `stream`, after making
    /// `stream` wait for the uses it conflicts with.
    pub(crate) fn record(
        &self,
        operation: &'static str,
        stream: &Stream,
        access: Access,
    ) -> Result<()> {
        run_uses(operation, stream, &[(*self, access)], || Ok(())).map_err(|failure| failure.error)
    }
}

/// Makes `stream` wait for what a `range` / `access` use conflicts with, before the use is
/// queued: the tracked uses ([`UseState::wait_on_range`]) and, for a buffer a capture used,
/// the launches of that capture's graphs on the context's other streams (those of captures
/// that used bytes of `range`; for a read, that wrote some). A launch records no use here (see
/// the module docs), so without the second eager work on another stream could overlap a replay
/// that reads or writes the memory. A capturing stream waits for no launch (the wait would
/// break its capture; its captured uses follow the rules of [`super::uses`]).
#[inline]
fn wait_before_use(
    state: &mut UseState<OwnedPooledEvent>,
    operation: &'static str,
    stream: &Stream,
    range: ByteRange,
    access: Access,
    view: &CaptureView,
) -> Result<()> {
    if state.used_in_graphs() && view.capture.is_none() {
        cuweave_driver::graph::wait_for_graph_launches(stream, |capture| {
            state.waits_for_capture(capture, range, access)
        })?;
    }
    state.wait_on_range(operation, stream, range, access, view)
}

/// The captures whose graphs' launches must be ordered after an eager `access` of `range` just
/// recorded ([`UseState::launches_after`]); `None` for a use recorded into a capture (it
/// belongs to that graph) and for a buffer no capture used.
#[inline]
fn launches_after(
    state: &UseState<OwnedPooledEvent>,
    range: ByteRange,
    access: Access,
    view: &CaptureView,
) -> Option<FencedCaptures> {
    if view.capture.is_some() || !state.used_in_graphs() {
        return None;
    }
    state.launches_after(range, access)
}

/// Records one event on `stream` behind eager work just queued there, taken from `tracker`'s
/// pool, as the fence the launches of the graphs of `fenced` wait for on other streams
/// ([`cuweave_driver::graph::fence_eager_use`]).
///
/// # Errors
/// The driver's error when the event cannot be recorded: the caller then drains the stream,
/// so no unfenced work is left running.
#[cold]
fn fence_for_launches(
    tracker: &StreamTracker,
    stream: &Stream,
    fenced: &FencedCaptures,
) -> Result<()> {
    let event = tracker.event_for(stream)?;
    event.record(stream)?;
    let after = match fenced {
        FencedCaptures::These(captures) => LaunchesAfter::Captures(captures),
        FencedCaptures::Any => LaunchesAfter::AnyCapture,
    };
    cuweave_driver::graph::fence_eager_use(stream, after, event);
    Ok(())
}

/// Where `stream` stands with respect to capture, for a use of `tracker`'s buffer: one atomic
/// load while no capture is active anywhere.
///
/// # Errors
/// [`MemoryError::GraphAllocation`] when the buffer's memory is a graph allocation and `stream`
/// does not capture into that graph's capture; the driver's error from the status query.
#[inline]
fn capture_view(
    tracker: &StreamTracker,
    stream: &Stream,
    operation: &'static str,
) -> Result<CaptureView> {
    let view = if active_captures() == 0 {
        CaptureView::NONE
    } else {
        capture_view_slow(tracker.context(), stream)?
    };
    match tracker.graph_allocation_of {
        Some(capture) if view.capture.is_none_or(|c| c.id != capture) => {
            Err(MemoryError::GraphAllocation { operation, capture })
        }
        _ => Ok(view),
    }
}

#[cold]
fn capture_view_slow(context: &Context, stream: &Stream) -> Result<CaptureView> {
    // A thread that has not used the context yet (another thread's eager work) gets it current
    // before asking the driver about the stream.
    stream.context().bind_to_thread()?;
    let capture = match stream.capture_status()? {
        CaptureStatus::None => None,
        status => status.id().map(|id| Capturing {
            id,
            complete_before: cuweave_driver::graph::known_complete_before(id, context),
        }),
    };
    if let Some(capturing) = capture {
        // A tracked buffer is about to be used in this capture: its graph's launches leave
        // fences for eager work on other streams to wait on (`wait_before_use`).
        cuweave_driver::graph::note_tracked_use(capturing.id);
    }
    Ok(CaptureView {
        any_active: true,
        capture,
    })
}

/// `Err(WrongDevice)` unless `stream` runs on `context`'s device.
pub(crate) fn ensure_same_device(
    operation: &'static str,
    context: &Context,
    stream: &Stream,
) -> Result<()> {
    let (expected, actual) = (context.device(), stream.device());
    if expected == actual {
        Ok(())
    } else {
        Err(MemoryError::WrongDevice {
            operation,
            expected: expected.ordinal(),
            actual: actual.ordinal(),
        })
    }
}

/// Why [`run`] failed, and whether the stream was drained afterwards.
#[derive(Debug)]
pub(crate) struct OpFailure {
    /// The first error.
    pub(crate) error: MemoryError,
    /// `true` when no work of this call can still be running: nothing was queued, or the
    /// stream was synchronized after the failure. `false` only when that synchronization failed
    /// too; host memory handed to the operation must then be leaked, not freed.
    pub(crate) settled: bool,
}

impl From<OpFailure> for MemoryError {
    fn from(failure: OpFailure) -> Self {
        failure.error
    }
}

/// Runs `op` (which queues work on `stream` writing the buffers of `trackers`) under the
/// ordering protocol; see [`run_uses`].
pub(crate) fn run<R>(
    operation: &'static str,
    stream: &Stream,
    trackers: &[&StreamTracker],
    op: impl FnOnce() -> Result<R>,
) -> Result<R, OpFailure> {
    match trackers {
        [tracker] => run_uses(
            operation,
            stream,
            &[(Part::whole(tracker), Access::Write)],
            op,
        ),
        _ => {
            let uses: Vec<_> = trackers
                .iter()
                .map(|tracker| (Part::whole(tracker), Access::Write))
                .collect();
            run_uses(operation, stream, &uses, op)
        }
    }
}

/// Runs `op` (which queues work on `stream` using the buffers of `uses`, each as its
/// [`Access`] says) under the ordering protocol: `stream` first waits for the uses each access
/// conflicts with, and afterwards each access is recorded.
///
/// A buffer listed twice counts as written if either entry writes it. If `op` or a recording
/// fails after work may have been queued, the stream is synchronized before returning, so no
/// untracked work is left running.
pub(crate) fn run_uses<R>(
    operation: &'static str,
    stream: &Stream,
    uses: &[(Part<'_>, Access)],
    op: impl FnOnce() -> Result<R>,
) -> Result<R, OpFailure> {
    let unqueued = |error: MemoryError| OpFailure {
        error,
        settled: true,
    };
    for (part, access) in uses {
        part.check(operation, *access).map_err(unqueued)?;
        ensure_same_device(operation, part.tracker.context(), stream).map_err(unqueued)?;
    }
    if let [(part, access)] = uses {
        // One buffer: no sorting, no allocation.
        let tracker = part.tracker;
        let view = capture_view(tracker, stream, operation).map_err(unqueued)?;
        let mut state = tracker.state.lock();
        wait_before_use(&mut state, operation, stream, part.range, *access, &view)
            .map_err(unqueued)?;
        let outcome = op();
        let recorded =
            state.record_range(stream, part.range, *access, &view, || tracker.new_event());
        let fenced = launches_after(&state, part.range, *access, &view);
        drop(state);
        let recorded = match fenced {
            Some(fenced) => recorded.and_then(|()| fence_for_launches(tracker, stream, &fenced)),
            None => recorded,
        };
        return finish(outcome, recorded, stream);
    }
    let views = uses
        .iter()
        .map(|(part, _)| capture_view(part.tracker, stream, operation))
        .collect::<Result<Vec<_>>>()
        .map_err(unqueued)?;
    let view_of = |tracker: &StreamTracker| {
        uses.iter()
            .position(|(part, _)| std::ptr::eq(part.tracker, tracker))
            .map_or(CaptureView::NONE, |index| views[index])
    };
    let (mut guards, order) = lock_in_address_order(uses);
    for &(guard, range, access) in &order {
        let view = view_of(guards[guard].0);
        // Waits touch no memory: a failure here leaves nothing unsafe queued.
        wait_before_use(
            &mut guards[guard].1,
            operation,
            stream,
            range,
            access,
            &view,
        )
        .map_err(unqueued)?;
    }
    let outcome = op();
    let mut recorded = Ok(());
    // The captures to fence for, over every buffer, and a tracker to take the event from.
    let mut fenced: Option<(FencedCaptures, &StreamTracker)> = None;
    for &(guard, range, access) in &order {
        let view = view_of(guards[guard].0);
        let (tracker, state) = &mut guards[guard];
        if let Err(error) = state.record_range(stream, range, access, &view, || tracker.new_event())
        {
            recorded = recorded.and(Err(error));
        }
        if let Some(captures) = launches_after(state, range, access, &view) {
            match &mut fenced {
                Some((all, _)) => all.merge(captures),
                None => fenced = Some((captures, *tracker)),
            }
        }
    }
    drop(guards);
    let recorded = match fenced {
        Some((fenced, tracker)) => {
            recorded.and_then(|()| fence_for_launches(tracker, stream, &fenced))
        }
        None => recorded,
    };
    finish(outcome, recorded, stream)
}

/// Runs a *blocking* `op` that uses one buffer on `stream`: the stream waits for the uses the
/// access conflicts with, `op` does the work on `stream` and returns only once it, and so
/// everything queued on `stream` before it, has completed (the driver's blocking copies on the
/// legacy stream do), and the tracker then forgets what is now known to be finished
/// ([`UseState::settle_range`]) instead of recording an event behind work that is done.
///
/// The lock is held until the state is settled, so no other thread's use can slip between the
/// completed work and the settling. On failure the stream is drained and the state is left as
/// it was (still tracking every earlier use).
pub(crate) fn run_completed<R>(
    operation: &'static str,
    stream: &Stream,
    part: Part<'_>,
    access: Access,
    op: impl FnOnce() -> Result<R>,
) -> Result<R, OpFailure> {
    let unqueued = |error: MemoryError| OpFailure {
        error,
        settled: true,
    };
    part.check(operation, access).map_err(unqueued)?;
    ensure_same_device(operation, part.tracker.context(), stream).map_err(unqueued)?;
    let view = capture_view(part.tracker, stream, operation).map_err(unqueued)?;
    let mut state = part.tracker.state.lock();
    wait_before_use(&mut state, operation, stream, part.range, access, &view).map_err(unqueued)?;
    match op() {
        Ok(value) => {
            state.settle_range(stream, part.range, access);
            Ok(value)
        }
        Err(error) => Err(OpFailure {
            error,
            settled: settle(stream),
        }),
    }
}

fn finish<R>(outcome: Result<R>, recorded: Result<()>, stream: &Stream) -> Result<R, OpFailure> {
    match (outcome, recorded) {
        (Ok(value), Ok(())) => Ok(value),
        (Err(error), _) | (Ok(_), Err(error)) => Err(OpFailure {
            error,
            settled: settle(stream),
        }),
    }
}

/// Synchronizes `stream` after a failure; `false` (logged) if even that fails.
pub(crate) fn settle(stream: &Stream) -> bool {
    match stream.synchronize() {
        Ok(()) => true,
        Err(error) => {
            tracing::error!(%error, "synchronizing a stream after a failed buffer operation failed");
            false
        }
    }
}

/// The locked state of one tracker.
type Locked<'a> = (
    &'a StreamTracker,
    MutexGuard<'a, UseState<OwnedPooledEvent>>,
);

/// Locks each distinct tracker once, in address order, so that two operations locking the same
/// trackers cannot deadlock; returns the guards and, for each use, its guard's index, range and
/// access (a tracker listed twice, say for a copy between two parts of one buffer, is locked
/// once and keeps both uses).
fn lock_in_address_order<'a>(
    uses: &[(Part<'a>, Access)],
) -> (Vec<Locked<'a>>, Vec<(usize, ByteRange, Access)>) {
    let mut sorted = uses.to_vec();
    sorted.sort_by_key(|(part, _)| std::ptr::from_ref(part.tracker) as usize);
    let mut guards: Vec<Locked<'a>> = Vec::with_capacity(sorted.len());
    let mut order = Vec::with_capacity(sorted.len());
    for (part, access) in sorted {
        if !guards
            .last()
            .is_some_and(|(tracker, _)| std::ptr::eq(*tracker, part.tracker))
        {
            guards.push((part.tracker, part.tracker.state.lock()));
        }
        order.push((guards.len() - 1, part.range, access));
    }
    // Reads first: a write of the same tracker recorded after them retires what it covers.
    order.sort_by_key(|&(_, _, access)| access == Access::Write);
    (guards, order)
}
