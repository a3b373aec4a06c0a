//! Fences between graph launches and eager work on the memory their captures used, in both
//! directions.
//!
//! A graph launch records no use on the buffers its nodes read and write: their trackers saw
//! the capture, not the launches. Host access covers launches with a context wait
//! ([`synchronize_launches`](super::synchronize_launches)); device-side work needs a cheaper and
//! narrower answer. The memory layer notes each capture in which a tracked buffer is used
//! ([`note_tracked_use`](super::note_tracked_use)); the graph ended from it, and every
//! executable instantiated from (or updated to) that graph, knows that capture
//! ([`Graph::tracked_capture`](super::Graph::tracked_capture)).
//!
//! **Eager work after a launch.** Each launch of such an executable on an eager stream records
//! one event behind itself, kept per (context, stream, capture) and replacing the previous
//! fence of that key (stream order makes the newest fence cover the older launches). Before
//! eager work on a buffer that captures used, the memory layer makes its stream wait for the
//! fences of those captures on the other streams of its context ([`wait_for_graph_launches`]).
//! Launches of graphs that use none of the buffer's captures are not waited for, so streams
//! that each replay their own graph stay concurrent.
//!
//! **A launch after eager work.** The other way round, eager work on such a buffer that a
//! launch conflicts with (a write of bytes the capture used, or a read of bytes it wrote) leaves
//! one event behind it, kept per (context, stream, capture) in the same way
//! ([`fence_eager_use`]); a launch of a graph of that capture first makes its stream wait for
//! those fences on the context's other streams. So an input written on one stream and a graph
//! that reads it, launched on another, are ordered as two eager operations would be.
//!
//! The lists are bounded: one fence per (stream, capture) pair, and past [`PRUNE_FENCES_AT`]
//! fences the finished ones (those of destroyed streams among them) are dropped when a new pair
//! is added. Graphs with no tracked capture (built by hand, or captured from raw pointers only)
//! record no fence, wait for none and cost nothing more per launch.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::context::Context;
use crate::error::Result;
use crate::event_pool::OwnedPooledEvent;
use crate::stream::Stream;

/// Past this many fences of one direction, adding a new (stream, capture) pair drops the
/// finished ones.
pub const PRUNE_FENCES_AT: usize = 16;

/// The newest fence of each (context, stream, capture) that launched.
static FENCES: Mutex<Vec<Fence>> = Mutex::new(Vec::new());

/// The newest fence of each (context, stream, capture) whose eager work a launch of that
/// capture's graphs must wait for; `capture` [`ANY_CAPTURE`] for work that every tracked
/// launch waits for.
static USE_FENCES: Mutex<Vec<Fence>> = Mutex::new(Vec::new());

/// The key that stands for every tracked capture: of a fence that a launch of any tracked
/// capture's graph waits for, and of a host borrow that refuses all of them (`launches`).
pub(super) const ANY_CAPTURE: u64 = u64::MAX;

/// Whether a fence or borrow kept under `key` concerns the launches of `capture`'s graphs.
pub(super) fn key_covers(key: u64, capture: u64) -> bool {
    key == capture || key == ANY_CAPTURE
}

struct Fence {
    context: usize,
    stream: u64,
    capture: u64,
    event: Arc<OwnedPooledEvent>,
}

/// Which captures' launches must wait for an eager use ([`fence_eager_use`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchesAfter<'a> {
    /// The launches of graphs ended from these captures.
    Captures(&'a [u64]),
    /// The launches of every graph ended from a tracked capture (a buffer that more captures
    /// used than it remembers).
    AnyCapture,
}

impl<'a> LaunchesAfter<'a> {
    /// The capture keys it names ([`ANY_CAPTURE`] for every capture).
    pub(super) fn keys(&self) -> &'a [u64] {
        match *self {
            Self::Captures(captures) => captures,
            Self::AnyCapture => &[ANY_CAPTURE],
        }
    }
}

/// Whether `stream` may wait for or record an eager fence: not while it captures (a launch
/// into a capture is a node of that graph, which runs when that graph does; an event recorded
/// or waited for there would belong to the graph). One atomic load while no capture is active.
pub(crate) fn is_eager(stream: &Stream) -> bool {
    super::active_captures() == 0 || matches!(stream.is_capturing(), Ok(false))
}

/// Puts `event` in `fences` under `key`, replacing that key's fence; past [`PRUNE_FENCES_AT`]
/// fences a new key first drops the finished ones.
fn keep_fence(fences: &mut Vec<Fence>, key: (usize, u64, u64), event: Arc<OwnedPooledEvent>) {
    let slot = fences
        .iter()
        .position(|fence| (fence.context, fence.stream, fence.capture) == key);
    if let Some(slot) = slot {
        fences[slot].event = event;
        return;
    }
    if fences.len() >= PRUNE_FENCES_AT {
        // Finished fences order nothing. Their events were recorded behind eager work, which no
        // capture records, so they are queried in relaxed mode: a capture this thread holds
        // neither refuses the queries (the list would grow for as long as it is open) nor
        // breaks. A query that still fails keeps its fence.
        let relaxed = super::relaxed_during_captures();
        fences.retain(|fence| !matches!(fence.event.query(), Ok(true)));
        drop(relaxed);
    }
    fences.push(Fence {
        context: key.0,
        stream: key.1,
        capture: key.2,
        event,
    });
}

/// Makes `stream` wait for the `fences` that `wanted` accepts, on the other streams of its
/// context; returns how many waits it queued.
fn wait_for_fences(
    fences: &Mutex<Vec<Fence>>,
    stream: &Stream,
    wanted: impl Fn(u64) -> bool,
) -> Result<usize> {
    let context = stream.context().as_raw() as usize;
    let id = stream.id();
    let waits: Vec<Arc<OwnedPooledEvent>> = {
        let fences = fences.lock();
        if fences.is_empty() {
            return Ok(0);
        }
        fences
            .iter()
            .filter(|fence| fence.context == context && fence.stream != id && wanted(fence.capture))
            .map(|fence| Arc::clone(&fence.event))
            .collect()
    };
    for event in &waits {
        stream.wait_event(event)?;
    }
    Ok(waits.len())
}

/// Keeps the fence `record` makes behind a launch, just queued on eager `stream` (in `context`;
/// the caller checked [`is_eager`]), of a graph ended from tracked capture `capture`.
///
/// A fence that cannot be recorded is logged, and the key's previous fence dropped: a failed
/// record means the context is broken, and a stale fence would order nothing anyway.
pub(crate) fn fence_launch(
    context: &Context,
    stream: &Stream,
    capture: u64,
    record: impl FnOnce() -> Result<OwnedPooledEvent>,
) {
    let recorded = record();
    let key = (context.as_raw() as usize, stream.id(), capture);
    let mut fences = FENCES.lock();
    match recorded {
        Ok(event) => keep_fence(&mut fences, key, Arc::new(event)),
        Err(error) => {
            tracing::warn!(%error, "recording the fence behind a graph launch failed; eager work on other streams is not ordered after this launch");
            fences.retain(|fence| (fence.context, fence.stream, fence.capture) != key);
        }
    }
}

/// Makes `stream` wait (device-side) for the fenced launches, on the other streams of its
/// context, of graphs ended from the captures `uses` accepts; returns how many waits it
/// queued. Launches on `stream` itself are ordered by the stream.
///
/// # Errors
/// The driver's error from `cuStreamWaitEvent` (the waits queued before it stay queued).
pub fn wait_for_graph_launches(stream: &Stream, uses: impl Fn(u64) -> bool) -> Result<usize> {
    wait_for_fences(&FENCES, stream, uses)
}

/// Keeps `event`, just recorded on `stream` behind eager work on memory that tracked captures
/// used, as the fence that launches of the graphs `after` names wait for on the context's other
/// streams ([`GraphExec::launch`](super::GraphExec::launch)); replaces the previous fence of
/// each (stream, capture). The memory layer calls it after a write of bytes such a capture
/// used, and after a read of bytes it wrote. Ignored on a capturing stream (its work belongs to
/// the graph being captured).
pub fn fence_eager_use(stream: &Stream, after: LaunchesAfter<'_>, event: OwnedPooledEvent) {
    if !is_eager(stream) {
        return;
    }
    let (context, id) = (stream.context().as_raw() as usize, stream.id());
    let event = Arc::new(event);
    let mut fences = USE_FENCES.lock();
    for &key in after.keys() {
        keep_fence(&mut fences, (context, id, key), Arc::clone(&event));
    }
}

/// Makes eager `stream` (the caller checked [`is_eager`]) wait for the eager work fenced for
/// launches of graphs ended from `capture` on the other streams of its context
/// ([`fence_eager_use`]), before such a launch. Returns how many waits it queued.
pub(crate) fn wait_for_eager_uses(stream: &Stream, capture: u64) -> Result<usize> {
    wait_for_fences(&USE_FENCES, stream, |fenced| key_covers(fenced, capture))
}

/// How many fences behind graph launches are kept (for tests of the bound).
pub fn graph_launch_fences() -> usize {
    FENCES.lock().len()
}

/// How many fences behind eager work that graph launches wait for are kept (for tests of the
/// bound).
pub fn eager_use_fences() -> usize {
    USE_FENCES.lock().len()
}
