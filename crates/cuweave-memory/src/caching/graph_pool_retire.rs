//! What happens to a graph pool's segments when the caching allocator they came from goes
//! away while a graph of the pool still lives (PyTorch's rule: a private pool's memory lives as
//! long as any graph that uses it, whatever becomes of the allocator).
//!
//! The allocator's last handle gives every free segment of its general cache (and of pools that
//! have died) back to the upstream, as before. The segments of graph pools still alive are
//! handed to those pools instead, each pool's with an `Arc` of the allocator's upstream part
//! ([`SegmentHome`]): the upstream resource (a `DriverResource` frees whatever it still has
//! when it drops) lives until the last pool holding its segments has died, and the segments go
//! back to it then, after the device has finished (a graph launch may still run), once no
//! capture is active: the same path as every other memory a pool holds.

use std::sync::Arc;

use cuweave_driver::Context;

use super::super::engine::{Engine, Release};
use super::super::pool::Segment;
use super::super::stream_uses::{Marker, StreamKey};
use super::{GraphHeld, Held, HeldMemory, pool_of_tag, synchronize_once};
use crate::error::Result;

/// Where a caching allocator's segments go back to: the part of the allocator that a graph
/// pool holding some of its segments keeps alive after the allocator is gone.
pub(crate) trait SegmentHome: Release + Send + Sync + 'static {
    /// The context whose device must have finished before the segments go back; `None` for
    /// homes that need no wait (the tests' fakes).
    fn context(&self) -> Option<&Arc<Context>>;
}

/// The graph pool whose free lists `key` names, if it is a private key.
fn pool_of_key(key: StreamKey) -> Option<u32> {
    super::graph_pool_of_key(key).map(super::GraphPoolId::as_u32)
}

/// Segments of a dropped allocator that a graph pool holds for its graphs, with the upstream
/// they go back to.
struct HeldSegments {
    home: Arc<dyn SegmentHome>,
    segments: Vec<Segment>,
}

impl GraphHeld for HeldSegments {
    fn give_back(
        self: Box<Self>,
        synced: &mut Vec<Arc<Context>>,
    ) -> Result<Option<Box<dyn GraphHeld>>> {
        if let Some(context) = self.home.context().cloned() {
            match synchronize_once(&context, synced) {
                Err(error) if error.is_capture_refusal() => return Ok(Some(self)),
                Err(error) => {
                    self.strand();
                    return Err(error);
                }
                Ok(()) => {}
            }
        }
        let bytes: usize = self.segments.iter().map(|segment| segment.size).sum();
        tracing::info!(
            segments = self.segments.len(),
            bytes,
            "caching allocator: returning a dead graph pool's segments of a dropped allocator"
        );
        self.home.release_segments(&self.segments).map(|()| None)
    }

    fn strand(self: Box<Self>) {
        // Never returned: forgetting keeps the upstream (and so the memory) alive for good.
        std::mem::forget(self);
    }
}

/// Retires an allocator's engine, on its last handle's drop: waits for its pending blocks,
/// gives every free segment that no live graph pool holds back to `home`, and hands those of
/// live graph pools to their pools (with an `Arc` of `home`), to go back when the pool dies.
///
/// # Errors
/// The first error from waiting or releasing; what could be released is released, and the
/// live pools' segments are handed over whatever happened.
pub(crate) fn retire_engine<E: Marker, H: SegmentHome>(
    engine: &Engine<E>,
    home: &Arc<H>,
) -> Result<()> {
    let released = engine.release_cached(&**home).map(|_| ());
    let mut by_pool: Vec<(u32, Vec<Segment>)> = Vec::new();
    let mut orphans = Vec::new();
    for segment in engine.take_all_free_segments() {
        match pool_of_key(segment.stream) {
            Some(pool) => match by_pool.iter_mut().find(|(id, _)| *id == pool) {
                Some((_, segments)) => segments.push(segment),
                None => by_pool.push((pool, vec![segment])),
            },
            None => orphans.push(segment),
        }
    }
    for (pool, segments) in by_pool {
        // Upgraded outside the live set's lock: the pool may die as soon as it is let go,
        // and its drop takes that lock (and returns what it holds, these segments too).
        match pool_of_tag(u64::from(pool)) {
            Some(token) => {
                let home: Arc<dyn SegmentHome> = Arc::clone(home) as Arc<dyn SegmentHome>;
                token.held.lock().push(Held {
                    memory: HeldMemory::Other(Box::new(HeldSegments { home, segments })),
                    also: Vec::new(),
                });
            }
            // The pool died since the cache was released: no graph of it is left.
            None => orphans.extend(segments),
        }
    }
    let orphaned = if orphans.is_empty() {
        Ok(())
    } else {
        home.release_segments(&orphans)
    };
    released.and(orphaned)
}

#[cfg(test)]
#[path = "graph_pool_retire_tests.rs"]
mod tests;
