//! The engine's allocation path while a stream capture is active: no event polling, no
//! out-of-memory retry (both would wait on or query the device), and a miss only where the
//! caller allows it.
//!
//! A miss in a capture's private pool first adopts a whole free segment of a dead graph pool
//! (no driver call), but only one known idle: the capture epoch is read after the segment was
//! seen dead and free (every graph of its pool gone, every block freed, so no work using it is
//! queued after that), and the capture must have synchronised its context after that epoch
//! (`known_complete_before`, as buffer trackers use it). So a recapture loop with a fresh pool
//! each cycle keeps reusing the same few segments instead of taking new ones without bound.
//! A segment is first seen at some capture's miss, so it is adoptable from the next
//! synchronised capture on.

use cuweave_driver::graph::GraphError;

use super::super::pool::{Grant, Segment};
use super::super::size_class::{PoolKind, round_size, segment_size};
use super::super::stream_uses::{Marker, StreamKey};
use super::{Engine, Upstream, limit_of};
use crate::error::{MemoryError, Result};

impl<E: Marker> Engine<E> {
    /// `bytes` rounded to the allocator's granularity; a size too large to round is counted
    /// and reported as out-of-memory.
    #[inline]
    pub(super) fn round_request(&self, stream: StreamKey, bytes: usize) -> Result<usize> {
        round_size(bytes).map_err(|error| match error {
            MemoryError::OutOfMemory { .. } => self.out_of_memory(stream, bytes, None),
            other => other,
        })
    }

    /// A block of at least `bytes` for `stream` from the cache, else (with `allow_miss`) from a
    /// new upstream segment; never polls pending blocks nor retries after out-of-memory.
    ///
    /// With `adoption`, a miss first adopts an idle segment of a dead graph pool
    /// ([`Adoption`]) before asking the upstream.
    pub fn allocate_quiet(
        &self,
        stream: StreamKey,
        bytes: usize,
        upstream: &impl Upstream,
        allow_miss: bool,
        adoption: Option<&Adoption<'_>>,
    ) -> Result<Grant> {
        let rounded = self.round_request(stream, bytes)?;
        if let Some(grant) = self
            .shard(stream)
            .pools
            .lock()
            .take_free(stream, rounded, bytes)
        {
            return Ok(grant);
        }
        if !allow_miss {
            return Err(MemoryError::Driver(
                GraphError::Capturing {
                    operation: "CachingAllocator::allocate",
                    reason: "the graph pool has no free block of this size and the capture's miss policy is Fail",
                }
                .into(),
            ));
        }
        let Some(segment) = segment_size(rounded) else {
            return Err(self.out_of_memory(stream, rounded, None));
        };
        if let Some(adoption) = adoption
            && let Some(grant) = self.adopt_retired(stream, rounded, bytes, segment, adoption)
        {
            return Ok(grant);
        }
        match upstream.allocate_segment(segment) {
            Ok(ptr) => Ok(self.add_segment(stream, ptr, segment, rounded, bytes)),
            Err(error) if error.is_out_of_memory() => {
                // No retry during a capture (it would wait and free), but a segment of the
                // request's own size may fit where a shared one does not, as outside.
                if let Some(grant) = self.own_size_segment(stream, rounded, bytes, upstream) {
                    return Ok(grant);
                }
                Err(self.out_of_memory(stream, rounded, limit_of(&error)))
            }
            Err(error) => Err(error),
        }
    }

    /// Adopts for `stream` the smallest idle retired segment that fits a new segment of
    /// `segment` bytes for a request of `rounded` bytes, after noting the retired segments seen
    /// now; `None` when there is none (the caller asks the upstream).
    fn adopt_retired(
        &self,
        stream: StreamKey,
        rounded: usize,
        bytes: usize,
        segment: usize,
        adoption: &Adoption<'_>,
    ) -> Option<Grant> {
        let mut seen = Vec::new();
        for shard in self.shards.iter() {
            seen.extend(
                shard
                    .pools
                    .lock()
                    .whole_free_segments(|key| key != stream && (adoption.retired)(key)),
            );
        }
        // Read after the segments were seen dead and free: any work that used one was queued
        // before this load.
        let epoch = (adoption.epoch)();
        let kind = PoolKind::for_size(rounded);
        let mut fitting: Vec<Retired> = {
            let mut retired = self.retired.lock();
            let previous = std::mem::take(&mut *retired);
            for (found, pool) in seen {
                let first_seen = previous
                    .iter()
                    .find(|entry| entry.segment == found)
                    .map_or(epoch, |entry| entry.seen);
                retired.push(Retired {
                    segment: found,
                    kind: pool,
                    seen: first_seen,
                });
            }
            retired
                .iter()
                .filter(|entry| entry.kind == kind && entry.segment.size >= segment)
                .copied()
                .collect()
        };
        if fitting.is_empty() {
            return None;
        }
        // Outside the lock: it may ask the driver for the capture's id.
        let complete_before = (adoption.complete_before)();
        fitting.retain(|entry| entry.seen < complete_before);
        // Largest first: popped smallest first.
        fitting.sort_by_key(|entry| std::cmp::Reverse(entry.segment.size));
        let mut candidates: Vec<Segment> = fitting.iter().map(|entry| entry.segment).collect();
        while let Some(candidate) = candidates.pop() {
            let taken = {
                let mut pools = self.shard(candidate.stream).pools.lock();
                // Still dead (a pool id is handed out again only once its pool has died, and
                // then to a new pool whose key this is again) and still free and whole.
                let taken = (adoption.retired)(candidate.stream)
                    .then(|| pools.take_segment_to_move(candidate))
                    .flatten();
                if taken.is_some() {
                    let mut totals = self.totals.lock();
                    totals.reserved_bytes.sub(candidate.size);
                    totals.segments.sub(1);
                }
                taken
            };
            self.retired
                .lock()
                .retain(|entry| entry.segment != candidate);
            let Some(taken) = taken else { continue };
            tracing::debug!(
                segment = taken.size,
                requested = bytes,
                "caching allocator: a capture adopted an idle segment of a dead graph pool"
            );
            let mut pools = self.shard(stream).pools.lock();
            let grant = pools.adopt_segment(stream, taken, rounded, bytes);
            let mut totals = self.totals.lock();
            totals.reserved_bytes.add(taken.size);
            totals.segments.add(1);
            return Some(grant);
        }
        None
    }

    /// How many retired segments the engine remembers (tests).
    #[cfg(test)]
    pub fn retired_len(&self) -> usize {
        self.retired.lock().len()
    }
}

/// What lets a capture's miss adopt the free segments of dead graph pools.
pub(crate) struct Adoption<'a> {
    /// Whether a stream key names a graph pool that has died (no graph of it left).
    pub retired: &'a (dyn Fn(StreamKey) -> bool + 'a),
    /// The capture epoch now ([`cuweave_driver::graph::capture_state`]).
    pub epoch: &'a (dyn Fn() -> u64 + 'a),
    /// The epoch before which the capture knows its context's work complete
    /// ([`cuweave_driver::graph::known_complete_before`]); 0 when nothing is known.
    pub complete_before: &'a (dyn Fn() -> u64 + 'a),
}

/// A free segment of a dead graph pool, and the capture epoch read after it was first seen so.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retired {
    segment: Segment,
    kind: PoolKind,
    seen: u64,
}
