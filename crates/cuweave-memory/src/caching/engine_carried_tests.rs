//! Blocks that carry their own stream's marker ([`Engine::free_carrying`]): handed out again
//! at once on that stream, with the marker; never on another stream, never merged, split or
//! released to the upstream before the marker has completed.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::caching::stream_uses::fake::{FakePool, Flag, Pooled};

const MIB: usize = 1 << 20;

/// Segments at increasing addresses; a release checks, before anything goes back, that every
/// marker it was told of has completed (the device could still write the memory otherwise).
#[derive(Default)]
struct Checked {
    next: AtomicUsize,
    cap: Option<usize>,
    held: parking_lot::Mutex<Vec<(u64, usize)>>,
    watched: parking_lot::Mutex<Vec<Flag>>,
    released: AtomicUsize,
}

impl Release for Checked {
    fn release_segments(&self, segments: &[Segment]) -> Result<()> {
        for flag in self.watched.lock().iter() {
            assert!(
                flag.is_complete().unwrap(),
                "a segment went back before a carried marker completed"
            );
        }
        let mut held = self.held.lock();
        for segment in segments {
            held.retain(|&(ptr, _)| ptr != segment.ptr);
            self.released.fetch_add(segment.size, Ordering::SeqCst);
        }
        Ok(())
    }
}

impl Upstream for Checked {
    fn allocate_segment(&self, bytes: usize) -> Result<u64> {
        let mut held = self.held.lock();
        let total: usize = held.iter().map(|&(_, size)| size).sum();
        if self.cap.is_some_and(|cap| total + bytes > cap) {
            return Err(MemoryError::OutOfMemory {
                requested: bytes,
                allocated: total,
                reserved: total,
                limit: self.cap,
            });
        }
        let ptr = 0x7f00_0000_0000 + self.next.fetch_add(bytes + MIB, Ordering::SeqCst) as u64;
        held.push((ptr, bytes));
        Ok(ptr)
    }
}

fn key(raw: usize) -> StreamKey {
    StreamKey::from_raw(raw)
}

fn carry(engine: &Engine<Pooled>, grant: &Grant, marker: Pooled) {
    engine
        .free_carrying(grant.stream, grant.id, grant.ptr, Seed { marker, epoch: 3 })
        .unwrap();
}

#[test]
fn a_carried_block_is_handed_out_on_its_stream_at_once_with_its_marker() {
    let engine = Engine::<Pooled>::default();
    let upstream = Checked::default();
    let events = FakePool::default();
    let a = engine.allocate(key(1), 64 * MIB, &upstream).unwrap();
    let marker = events.acquire();
    let flag = marker.flag();
    carry(&engine, &a, marker);
    assert_eq!(engine.pending_blocks(), 1);
    assert_eq!(
        engine.stats().active_bytes.current,
        64 * MIB,
        "still in use"
    );

    let (b, seed) = engine.allocate_seeded(key(1), 64 * MIB, &upstream).unwrap();
    assert_eq!(b.ptr, a.ptr, "reused at once, its marker still pending");
    let seed = seed.expect("the marker goes with the block");
    assert_eq!(seed.epoch, 3);
    assert!(!seed.marker.is_complete().unwrap());
    flag.complete();
    assert!(
        seed.marker.is_complete().unwrap(),
        "the very marker it carried"
    );
    assert_eq!(engine.pending_blocks(), 0);
    let stats = engine.stats();
    assert_eq!((stats.cache_hits, stats.cache_misses), (1, 1));
    assert_eq!(stats.allocated_bytes.current, 64 * MIB);
    assert_eq!(stats.active_bytes.current, 64 * MIB, "counted once");
    assert_eq!(stats.reserved_bytes.current, 64 * MIB);
    engine.check_invariants();
    drop(seed);
    assert_eq!(events.held(), 0);
}

#[test]
fn a_carried_block_goes_to_no_other_stream_before_its_marker_completes() {
    // One shard: both streams' blocks and pending lists side by side.
    let engine = Engine::<Pooled>::with_shards(1);
    let upstream = Checked::default();
    let events = FakePool::default();
    let a = engine.allocate(key(1), 64 * MIB, &upstream).unwrap();
    let marker = events.acquire();
    let flag = marker.flag();
    carry(&engine, &a, marker);
    let (other, seed) = engine.allocate_seeded(key(2), 64 * MIB, &upstream).unwrap();
    assert!(seed.is_none());
    assert_ne!(
        other.ptr, a.ptr,
        "another stream is not ordered after the old use"
    );
    // A request that would split it does not take it either (the rest would be free memory the
    // old use still writes).
    let (split, seed) = engine.allocate_seeded(key(1), 3 * MIB, &upstream).unwrap();
    assert!(seed.is_none());
    assert!(split.ptr < a.ptr || split.ptr >= a.ptr + (64 * MIB) as u64);
    assert_eq!(engine.pending_blocks(), 1);
    engine.check_invariants();

    flag.complete();
    engine.process_pending();
    assert_eq!(
        engine.pending_blocks(),
        0,
        "a plain free block once it completed"
    );
    // (30 MiB: more than the 20 MiB segment the 3 MiB request was carved from.)
    let (after, seed) = engine.allocate_seeded(key(1), 30 * MIB, &upstream).unwrap();
    assert!(seed.is_none(), "nothing left to wait for");
    assert_eq!(after.ptr, a.ptr, "split like any free block");
    let (never, _) = engine.allocate_seeded(key(2), 3 * MIB, &upstream).unwrap();
    assert!(never.ptr < a.ptr || never.ptr >= a.ptr + (64 * MIB) as u64);
    engine.check_invariants();
    assert_eq!(events.held(), 0);
}

#[test]
fn a_loop_that_never_waits_keeps_one_block_and_one_marker() {
    // allocate on S, use on S, free: the GPU never catches up. The seed is passed on each time
    // (a tracker's write on S re-records it), so neither blocks nor markers pile up.
    let engine = Engine::<Pooled>::default();
    let upstream = Checked::default();
    let events = FakePool::default();
    for _ in 0..100_000 {
        let (grant, seed) = engine.allocate_seeded(key(5), 64 * MIB, &upstream).unwrap();
        let marker = seed.map_or_else(|| events.acquire(), |seed| seed.marker);
        carry(&engine, &grant, marker);
    }
    let stats = engine.stats();
    assert_eq!(stats.reserved_bytes.current, 64 * MIB);
    assert_eq!(stats.cache_misses, 1);
    assert_eq!(engine.pending_blocks(), 1);
    assert_eq!(events.created(), 1);
}

#[test]
fn empty_cache_waits_for_a_carried_marker_before_releasing_its_segment() {
    let engine = Engine::<Flag>::default();
    let upstream = Checked::default();
    let a = engine.allocate(key(1), 64 * MIB, &upstream).unwrap();
    let flag = Flag::default();
    upstream.watched.lock().push(flag.clone());
    engine
        .free_carrying(
            a.stream,
            a.id,
            a.ptr,
            Seed {
                marker: flag.clone(),
                epoch: 0,
            },
        )
        .unwrap();
    assert_eq!(engine.release_cached(&upstream).unwrap(), 64 * MIB);
    assert!(flag.is_complete().unwrap(), "waited for");
    assert_eq!(upstream.released.load(Ordering::SeqCst), 64 * MIB);
    let stats = engine.stats();
    assert_eq!(
        (stats.reserved_bytes.current, stats.active_bytes.current),
        (0, 0)
    );
    assert_eq!(engine.pending_blocks(), 0);
}

#[test]
fn the_out_of_memory_retry_waits_for_carried_markers_before_releasing() {
    let engine = Engine::<Flag>::default();
    let upstream = Checked {
        cap: Some(64 * MIB),
        ..Checked::default()
    };
    let a = engine.allocate(key(1), 64 * MIB, &upstream).unwrap();
    let flag = Flag::default();
    upstream.watched.lock().push(flag.clone());
    engine
        .free_carrying(
            a.stream,
            a.id,
            a.ptr,
            Seed {
                marker: flag.clone(),
                epoch: 0,
            },
        )
        .unwrap();
    // Another stream's request finds the device full: the retry waits, releases, retries.
    let (b, seed) = engine.allocate_seeded(key(2), 64 * MIB, &upstream).unwrap();
    assert!(seed.is_none());
    assert!(flag.is_complete().unwrap());
    assert_eq!(upstream.released.load(Ordering::SeqCst), 64 * MIB);
    assert_eq!(engine.stats().oom_retries, 1);
    engine.free(b.stream, b.id, b.ptr).unwrap();
    engine.check_invariants();
}

/// The GPU training-loop test's pattern (tests/user_patterns.rs) on the engine: activations of
/// many sizes and a derived half-size tensor each, all dropped behind their queued work (so they
/// carry their markers, or wait for the reading stream's), then the streams synchronized. The
/// carried blocks are handed out again whole or, once polled, merged and split as before: after
/// the warm-up, no new segment.
#[rstest::rstest]
fn a_synchronized_training_loop_stops_growing_after_warm_up(#[values(false, true)] two: bool) {
    const KIB: usize = 1 << 10;
    const ACTIVATIONS: [usize; 8] = [
        4 * KIB,
        100 * KIB,
        700 * KIB + 12,
        MIB,
        3 * MIB,
        6 * MIB + 12,
        12 * MIB + 4,
        25 * MIB,
    ];
    let engine = Engine::<Pooled>::default();
    let upstream = Checked::default();
    let events = FakePool::default();
    let (a, b) = (key(1), key(2));
    let mut warm = None;
    for iteration in 0..40 {
        let mut held = Vec::new();
        for (index, &bytes) in ACTIVATIONS.iter().enumerate() {
            let on = if two && index % 2 == 1 { b } else { a };
            held.push((
                engine.allocate_seeded(on, bytes, &upstream).unwrap(),
                on != a,
            ));
            let half = bytes / 2 + 4;
            held.push((engine.allocate_seeded(a, half, &upstream).unwrap(), false));
        }
        let mut flags = Vec::new();
        for ((grant, seed), read_elsewhere) in held {
            let marker = seed.map_or_else(|| events.acquire(), |seed| seed.marker);
            flags.push(marker.flag());
            if read_elsewhere {
                let other = events.acquire();
                flags.push(other.flag());
                engine
                    .free_after(grant.stream, grant.id, grant.ptr, vec![marker, other])
                    .unwrap();
            } else {
                carry(&engine, &grant, marker);
            }
        }
        flags.iter().for_each(Flag::complete);
        engine.check_invariants();
        let stats = engine.stats();
        if iteration == 1 {
            warm = Some((stats.reserved_bytes.current, stats.cache_misses));
        } else if let Some(warm) = warm {
            assert_eq!(
                (stats.reserved_bytes.current, stats.cache_misses),
                warm,
                "iteration {iteration}"
            );
        }
    }
}
