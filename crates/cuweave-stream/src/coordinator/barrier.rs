//! [`queue_barrier`]: the one device-side barrier of cuweave, fanned in to one stream and out
//! again. Both coordinators (this crate's [`MultiStreamCoordinator`](super::MultiStreamCoordinator)
//! and the event layer's `CrossStreamBarrier`) queue their barriers through it.

use cuweave_driver::graph::{GraphError, active_captures};
use cuweave_driver::{DriverError, EventPool, Stream};
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
/// While a capture is active the streams must all be outside any capture, or all in one:
/// a barrier mixing a capturing stream with streams outside its capture would make a capturing
/// stream wait on eager work (or pull eager streams into the capture), which the driver answers
/// by invalidating the capture. Such a barrier is refused before anything is queued.
///
/// # Errors
/// [`cuweave_driver::graph::GraphError::Capturing`] for a barrier across
/// a capture's boundary, before anything is queued; the driver's error from an event record or
/// wait; the waits queued before it stay queued.
pub fn queue_barrier(streams: &[(&Stream, &EventPool)]) -> Result<BarrierInfo> {
    let Some(((hub, hub_pool), others)) = streams.split_first() else {
        return Ok(BarrierInfo {
            streams: 0,
            events: 0,
            waits: 0,
        });
    };
    refuse_barrier_across_capture(streams)?;
    let mut waits = 0;
    for (stream, pool) in others {
        let arrived = pool.acquire_event(false)?;
        arrived.record(stream)?;
        hub.wait_event(&arrived)?;
        waits += 1;
    }
    crate::capture::note_wait_joined_capture(hub)?;
    let all_arrived = hub_pool.acquire_event(false)?;
    all_arrived.record(hub)?;
    for (stream, _) in others {
        stream.wait_event(&all_arrived)?;
        crate::capture::note_wait_joined_capture(stream)?;
        waits += 1;
    }
    Ok(BarrierInfo {
        streams: streams.len(),
        events: streams.len(),
        waits,
    })
}

/// [`GraphError::Capturing`] unless the streams all share one capture status (none, or one
/// capture); one atomic load while no capture begun through cuweave is active.
fn refuse_barrier_across_capture(streams: &[(&Stream, &EventPool)]) -> Result<()> {
    if active_captures() == 0 {
        return Ok(());
    }
    let captures = streams
        .iter()
        .map(|(stream, _)| crate::capture::capture_id(stream))
        .collect::<Result<Vec<_>>>()?;
    if captures.iter().any(Option::is_some) && captures.windows(2).any(|pair| pair[0] != pair[1]) {
        return Err(DriverError::from(GraphError::Capturing {
            operation: "queue_barrier",
            reason: "some streams are capturing and others are not in their capture: a barrier across a capture's boundary would invalidate the capture",
        })
        .into());
    }
    Ok(())
}
