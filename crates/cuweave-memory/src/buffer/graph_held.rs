//! Freeing a typed buffer's own allocation (a pinned buffer's host allocation, a unified
//! buffer's managed memory) in the order its uses allow, stream captures included.

use std::sync::Arc;

use cuweave_driver::Context;

use super::tracker::FreeMarkers;
use crate::caching::{GraphHeld, defer_until_no_capture, hold_for_graphs, synchronize_once};
use crate::error::Result;

/// An allocation whose free waits for graph pools to die or for captures to end: freed (dropped)
/// once the device has finished with it, forgotten (leaked) when stranded.
struct HeldAllocation<A> {
    context: Arc<Context>,
    allocation: A,
    what: &'static str,
}

impl<A: Send + 'static> GraphHeld for HeldAllocation<A> {
    fn give_back(
        self: Box<Self>,
        synced: &mut Vec<Arc<Context>>,
    ) -> Result<Option<Box<dyn GraphHeld>>> {
        // A launch of a dead pool's graph, or eager work, may still be running.
        match synchronize_once(&self.context, synced) {
            // A capture began since the flush checked: try again once none is active.
            Err(error) if error.is_capture_refusal() => Ok(Some(self)),
            Err(error) => {
                self.strand();
                Err(error)
            }
            Ok(()) => {
                drop(self);
                Ok(None)
            }
        }
    }

    fn strand(self: Box<Self>) {
        tracing::warn!(
            what = self.what,
            "leaking a buffer's memory: a graph may still use it, or the device could not be waited for"
        );
        std::mem::forget(self.allocation);
    }
}

/// Frees `allocation` (of `bytes`, in `context`), which a buffer described as `what` owned and
/// whose tracker handed over `markers`, without freeing memory that queued work or a graph may
/// still use:
///
/// - used by stream captures: held by the graph pools of those captures and freed once the last
///   of them has died (and the context has been synchronised), at once when all have died;
///   leaked, and counted in [`stranded_graph_memory`](crate::caching::stranded_graph_memory),
///   when a capture had no pool (nothing could say when its graphs are gone);
/// - not used by a capture but freed while one is active: freed once no capture is active,
///   after the context has been synchronised (nothing may wait for the device, nor free memory,
///   during a capture);
/// - else freed after waiting for every event of its uses; leaked when a wait fails.
pub(crate) fn free_own_allocation<A: Send + 'static>(
    context: &Arc<Context>,
    allocation: A,
    bytes: usize,
    markers: FreeMarkers,
    what: &'static str,
) {
    let held = |allocation| {
        Box::new(HeldAllocation {
            context: Arc::clone(context),
            allocation,
            what,
        })
    };
    if markers.used_in_graphs() {
        hold_for_graphs(held(allocation), &markers.graph_pools, bytes);
        return;
    }
    if markers.during_capture() {
        // The events go back to their pool unqueried: the context is synchronised instead.
        defer_until_no_capture(held(allocation));
        return;
    }
    for used in markers.events {
        if let Err(error) = used.event.synchronize() {
            tracing::error!(%error, what, "waiting for a buffer's last use before freeing it failed; leaking it");
            std::mem::forget(allocation);
            return;
        }
    }
    drop(allocation);
}
