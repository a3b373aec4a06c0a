//! [`queue_barrier`]: the one device-side barrier of cuweave, fanned in to one stream and out
//! again. Both coordinators (this crate's [`MultiStreamCoordinator`](super::MultiStreamCoordinator)
//! and the event layer's `CrossStreamBarrier`) queue their barriers through it.

use cuweave_driver::{EventPool, Stream};
use serde::{Deserialize, Serialize};

use crate::error::Result;

/// What [`queue_barrier`] queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BarrierInfo {
    /// Streams in the barrier.
    pub streams: usize,
    /// Events recorded: one on each stream but the hub, and one on the hub after its waits.
    pub events: usize,
    /// Device-side waits queued: `2 (n - 1)` for `n` streams (in to the hub, then out).
    pub waits: usize,
}

/// Queues a barrier across `streams`, each with the event pool of its context: work queued
/// afterwards on any of them starts only once the work queued before on all of them has
/// finished. The host does not block.
///
/// The first stream is the hub: it waits for an event recorded on each other stream (fan in),
/// then every other stream waits for one event recorded on the hub behind those waits (fan
/// out). That is `2 (n - 1)` waits and `n` events, where every stream waiting for every other
/// would take `n (n - 1)` waits. The events go back to their pools at once: a queued wait is
/// fixed when it is queued.
///
/// # Errors
/// The driver's error from an event record or wait; the waits queued before it stay queued.
pub fn queue_barrier(streams: &[(&Stream, &EventPool)]) -> Result<BarrierInfo> {
    let Some(((hub, hub_pool), others)) = streams.split_first() else {
        return Ok(BarrierInfo {
            streams: 0,
            events: 0,
            waits: 0,
        });
    };
    let mut waits = 0;
    for (stream, pool) in others {
        let arrived = pool.acquire_event(false)?;
        arrived.record(stream)?;
        hub.wait_event(&arrived)?;
        waits += 1;
    }
    let all_arrived = hub_pool.acquire_event(false)?;
    all_arrived.record(hub)?;
    for (stream, _) in others {
        stream.wait_event(&all_arrived)?;
        waits += 1;
    }
    Ok(BarrierInfo {
        streams: streams.len(),
        events: streams.len(),
        waits,
    })
}
