//! Free segments of dropped streams: adopted by the next miss of a live stream once the dropped
//! stream's last work has finished, so that a program making a new stream per request keeps the
//! reserve one request needs instead of one segment per request ever served.
//!
//! A block freed on a stream is handed out again only on that stream (its free list); once the
//! stream's handle is dropped nobody allocates there again, and its cached segments would wait
//! for an out-of-memory retry or `empty_cache`. The engine therefore watches every stream it
//! has segments of ([`StreamEnd`], the driver's [`StreamEnd`](cuweave_driver::stream::StreamEnd)): the
//! handle's drop records an event behind all the work queued through it. Only handles that own
//! their stream are watched: a borrowed handle's stream lives on after its drop and takes more
//! work through other handles, so its segments stay with it; they are keyed by the raw stream,
//! which every later borrowed handle of that stream shares, so the next one finds them
//! ([`StreamKey`]). A miss (no free block
//! of the requesting stream fits) then, and only then:
//!
//! 1. notes which watched streams were dropped, looking only when the process-wide count of
//!    dropped watched streams changed since the last miss (one atomic load otherwise);
//! 2. for each dropped stream whose end event has completed (one `cuEventQuery`, remembered once
//!    true), takes its wholly free segments off its lists
//!    ([`Pools::take_segments_to_move`](super::super::pool::Pools::take_segments_to_move)) and
//!    adopts them, free, into the requesting stream's lists
//!    ([`Pools::adopt_free_segment`](super::super::pool::Pools::adopt_free_segment)): the same
//!    move of whole segments between keys that captures use for dead graph pools;
//!    Blocks of the dropped stream freed while used on other streams are polled first (nobody
//!    allocates on the dropped stream to poll them): they join its lists once those uses' events
//!    have completed, as on any stream;
//! 3. tries the requesting stream's best fit again before asking the upstream.
//!
//! Why that is safe: a free block of the dropped stream was last used by work queued on that
//! stream before its free (uses on other streams keep a block pending until their events
//! complete, and a pending or allocated block keeps its segment from being whole and free), and
//! all work queued on the stream precedes its handle's drop, so the end event completes after
//! it. A block of the stream freed after the drop had its last use on the stream before the
//! drop too. So once the event has completed, nothing queued can touch a wholly free segment of
//! the stream, and any stream may carve it. A dropped stream whose end could not be recorded
//! (it was capturing, or the driver failed) is never adopted from: its segments wait for
//! `empty_cache` or the out-of-memory retry, which synchronise the device first.
//!
//! A dropped stream is forgotten once none of its segments is left (segments with blocks still
//! allocated stay with it until they are wholly free, and are adopted then).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::super::pool::Grant;
use super::super::stream_uses::{Marker, StreamKey};
use super::{Engine, StreamEnd, Upstream};

/// The engine's watched streams.
#[derive(Default)]
pub(crate) struct Ends {
    /// The count of dropped watched streams when `live` was last looked through.
    seen: u64,
    /// Streams with segments here whose handles were not yet seen dropped.
    live: HashMap<StreamKey, Arc<dyn StreamEnd>>,
    /// Streams seen dropped that still have segments here.
    ended: Vec<Ended>,
}

impl std::fmt::Debug for Ends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ends")
            .field("seen", &self.seen)
            .field("live", &self.live.len())
            .field("ended", &self.ended.len())
            .finish()
    }
}

/// A dropped stream that still has segments.
#[derive(Clone)]
struct Ended {
    key: StreamKey,
    end: Arc<dyn StreamEnd>,
    /// Its end event has completed (it stays so).
    finished: bool,
}

impl<E: Marker> Engine<E> {
    /// The miss path's first step: watches `stream` (made on its first miss), then adopts for it
    /// the wholly free segments of dropped streams whose work has finished, and hands out a
    /// block of them if one fits; `None` sends the request to the upstream.
    pub(super) fn adopt_from_ended(
        &self,
        stream: StreamKey,
        rounded: usize,
        bytes: usize,
        upstream: &impl Upstream,
    ) -> Option<Grant> {
        let generation = upstream.ended_streams();
        let candidates = {
            let mut ends = self.ends.lock();
            if !ends.live.contains_key(&stream)
                && let Some(end) = upstream.stream_end()
            {
                ends.live.insert(stream, end);
            }
            if ends.seen != generation {
                ends.seen = generation;
                let dropped: Vec<StreamKey> = ends
                    .live
                    .iter()
                    .filter(|(_, end)| end.dropped())
                    .map(|(&key, _)| key)
                    .collect();
                for key in dropped {
                    if let Some(end) = ends.live.remove(&key) {
                        ends.ended.push(Ended {
                            key,
                            end,
                            finished: false,
                        });
                    }
                }
            }
            if ends.ended.is_empty() {
                return None;
            }
            ends.ended.clone()
        };
        // Outside the lock: queries the driver.
        let mut finished = Vec::new();
        let mut ready: HashSet<StreamKey> = HashSet::new();
        for candidate in &candidates {
            if candidate.key == stream {
                continue;
            }
            if candidate.finished || candidate.end.finished() {
                if !candidate.finished {
                    finished.push(candidate.key);
                }
                // Its blocks freed with uses on other streams return to its lists once those
                // complete; nobody allocates on the dropped stream to poll them.
                let shard = self.shard(candidate.key);
                if shard.pending_count.load(Ordering::Acquire) != 0 {
                    self.process_pending_of(shard);
                }
                ready.insert(candidate.key);
            }
        }
        // One pass over each shard that holds any of them (a shard's blocks are all of keys it
        // owns): moves the finished streams' wholly free segments and notes which dropped
        // streams still have segments, so a miss costs a scan per shard, not one per dropped
        // stream.
        let keys: HashSet<StreamKey> = candidates.iter().map(|candidate| candidate.key).collect();
        let mut shards: Vec<usize> = keys.iter().map(|&key| self.shard_index(key)).collect();
        shards.sort_unstable();
        shards.dedup();
        let mut moved = 0;
        let mut left: HashSet<StreamKey> = HashSet::new();
        for index in shards {
            moved += self.move_free_segments(index, |key| ready.contains(&key), stream);
            left.extend(
                self.shards[index]
                    .pools
                    .lock()
                    .streams_with_segments(|key| keys.contains(&key)),
            );
        }
        let gone: Vec<StreamKey> = keys.difference(&left).copied().collect();
        if !finished.is_empty() || !gone.is_empty() {
            let mut ends = self.ends.lock();
            ends.ended.retain(|entry| !gone.contains(&entry.key));
            for entry in ends.ended.iter_mut() {
                entry.finished |= finished.contains(&entry.key);
            }
        }
        if moved == 0 {
            return None;
        }
        tracing::debug!(
            segments = moved,
            requested = bytes,
            "caching allocator: a miss adopted the free segments of dropped streams"
        );
        self.shard(stream)
            .pools
            .lock()
            .take_free(stream, rounded, bytes)
    }

    /// Moves every wholly free segment of shard `index` whose stream `from` accepts into `to`'s
    /// free lists; returns how many. The totals drop while a segment is between shards, so a
    /// statistics snapshot (which locks every shard) always sees them equal to the shards' sum.
    fn move_free_segments(
        &self,
        index: usize,
        from: impl Fn(StreamKey) -> bool,
        to: StreamKey,
    ) -> usize {
        let taken = {
            let mut pools = self.shards[index].pools.lock();
            let taken = pools.take_segments_to_move(from);
            if !taken.is_empty() {
                let mut totals = self.totals.lock();
                for (segment, _) in &taken {
                    totals.reserved_bytes.sub(segment.size);
                    totals.segments.sub(1);
                }
            }
            taken
        };
        if taken.is_empty() {
            return 0;
        }
        let mut pools = self.shard(to).pools.lock();
        let mut totals = self.totals.lock();
        for &(segment, pool) in &taken {
            pools.adopt_free_segment(to, segment, pool);
            totals.reserved_bytes.add(segment.size);
            totals.segments.add(1);
        }
        taken.len()
    }

    /// How many streams the engine watches: (live, dropped with segments left) (tests).
    #[cfg(test)]
    pub fn watched_streams(&self) -> (usize, usize) {
        let ends = self.ends.lock();
        (ends.live.len(), ends.ended.len())
    }
}

#[cfg(test)]
#[path = "engine_ends_tests.rs"]
mod tests;
