//! Fences behind graph launches, so that eager work on another stream can be ordered after the
//! launches of graphs that use the same memory.
//!
//! A graph launch records no use on the buffers its nodes read and write: their trackers saw
//! the capture, not the launches. Host access covers launches with a context wait
//! ([`synchronize_launches`](super::synchronize_launches)); device-side work needs a cheaper and
//! narrower answer. The memory layer notes each capture in which a tracked buffer is used
//! ([`note_tracked_use`](super::note_tracked_use)); the graph ended from it, and every
//! executable instantiated from (or updated to) that graph, knows that capture
//! ([`Graph::tracked_capture`](super::Graph::tracked_capture)). Each launch of such an
//! executable on an eager stream records one event behind itself, kept per (context, stream,
//! capture) and replacing the previous fence of that key (stream order makes the newest fence
//! cover the older launches). Before eager work on a buffer that captures used, the memory
//! layer makes its stream wait for the fences of those captures on the other streams of its
//! context ([`wait_for_graph_launches`]). Launches of graphs that use none of the buffer's
//! captures are not waited for, so streams that each replay their own graph stay concurrent.
//!
//! The list is bounded: one fence per (stream, capture) pair that launched, and past
//! [`PRUNE_FENCES_AT`] fences the finished ones (those of destroyed streams among them) are
//! dropped at the next new pair's launch. Graphs with no tracked capture (built by hand, or
//! captured from raw pointers only) record no fence and cost nothing more per launch.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::context::Context;
use crate::error::Result;
use crate::event_pool::OwnedPooledEvent;
use crate::stream::Stream;

/// Past this many fences a launch of a new (stream, capture) pair drops the finished ones.
pub const PRUNE_FENCES_AT: usize = 16;

/// The newest fence of each (context, stream, capture) that launched.
static FENCES: Mutex<Vec<LaunchFence>> = Mutex::new(Vec::new());

struct LaunchFence {
    context: usize,
    stream: u64,
    capture: u64,
    event: Arc<OwnedPooledEvent>,
}

/// Keeps the fence `record` makes behind a launch, just queued on `stream` (in `context`), of a graph ended
/// from tracked capture `capture`, unless the stream is capturing (a launch into a capture is
/// a node of that graph: it runs when that graph does; `record` is not called then).
///
/// A fence that cannot be recorded is logged, and the key's previous fence dropped: a failed
/// record means the context is broken, and a stale fence would order nothing anyway.
pub(crate) fn fence_launch(
    context: &Context,
    stream: &Stream,
    capture: u64,
    record: impl FnOnce() -> Result<OwnedPooledEvent>,
) {
    if super::active_captures() != 0 && !matches!(stream.is_capturing(), Ok(false)) {
        return;
    }
    let recorded = record();
    let key = (context.as_raw() as usize, stream.id(), capture);
    let mut fences = FENCES.lock();
    let slot = fences
        .iter()
        .position(|fence| (fence.context, fence.stream, fence.capture) == key);
    match (recorded, slot) {
        (Ok(event), Some(slot)) => fences[slot].event = Arc::new(event),
        (Ok(event), None) => {
            if fences.len() >= PRUNE_FENCES_AT {
                // Finished fences order nothing; a query refused (a capture elsewhere) keeps it.
                fences.retain(|fence| !matches!(fence.event.query(), Ok(true)));
            }
            fences.push(LaunchFence {
                context: key.0,
                stream: key.1,
                capture,
                event: Arc::new(event),
            });
        }
        (Err(error), slot) => {
            tracing::warn!(%error, "recording the fence behind a graph launch failed; eager work on other streams is not ordered after this launch");
            if let Some(slot) = slot {
                fences.swap_remove(slot);
            }
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
    let context = stream.context().as_raw() as usize;
    let id = stream.id();
    let waits: Vec<Arc<OwnedPooledEvent>> = {
        let fences = FENCES.lock();
        if fences.is_empty() {
            return Ok(0);
        }
        fences
            .iter()
            .filter(|fence| fence.context == context && fence.stream != id && uses(fence.capture))
            .map(|fence| Arc::clone(&fence.event))
            .collect()
    };
    for event in &waits {
        stream.wait_event(event)?;
    }
    Ok(waits.len())
}

/// How many fences are kept (for tests of the bound).
pub fn graph_launch_fences() -> usize {
    FENCES.lock().len()
}
