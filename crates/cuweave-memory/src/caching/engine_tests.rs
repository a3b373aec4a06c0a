//! The engine with a fake upstream (addresses from a counter, an optional cap) and hand-completed
//! markers: hits and misses, the out-of-memory retry, pending blocks, concurrency.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::*;
use crate::caching::size_class::{LARGE_SEGMENT, SMALL_SEGMENT};
use crate::caching::stream_uses::fake::{FakePool, Flag, Pooled};

const MIB: usize = 1 << 20;

/// Hands out addresses from a counter, refusing past `cap` like a limit adaptor.
#[derive(Debug)]
struct FakeUpstream {
    next: AtomicU64,
    cap: usize,
    outstanding: Mutex<HashMap<u64, usize>>,
    allocations: AtomicUsize,
    released: AtomicUsize,
    broken: bool,
    /// How long a release takes before the memory is back (`cuMemFree` takes microseconds).
    release_time: std::time::Duration,
}

impl FakeUpstream {
    fn with_cap(cap: usize) -> Self {
        Self {
            next: AtomicU64::new(0x7f00_0000_0000),
            cap,
            outstanding: Mutex::new(HashMap::new()),
            allocations: AtomicUsize::new(0),
            released: AtomicUsize::new(0),
            broken: false,
            release_time: std::time::Duration::ZERO,
        }
    }

    fn unlimited() -> Self {
        Self::with_cap(usize::MAX)
    }

    fn outstanding_bytes(&self) -> usize {
        self.outstanding.lock().values().sum()
    }
}

impl Release for FakeUpstream {
    fn release_segments(&self, segments: &[Segment]) -> Result<()> {
        let started = std::time::Instant::now();
        while started.elapsed() < self.release_time {
            std::hint::spin_loop();
        }
        let mut outstanding = self.outstanding.lock();
        for segment in segments {
            match outstanding.remove(&segment.ptr) {
                Some(size) if size == segment.size => {}
                _ => {
                    return Err(MemoryError::UnknownAllocation {
                        operation: "fake release",
                        ptr: segment.ptr,
                    });
                }
            }
            self.released.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

impl Upstream for FakeUpstream {
    fn allocate_segment(&self, bytes: usize) -> Result<u64> {
        if self.broken {
            return Err(MemoryError::ZeroLength {
                operation: "broken upstream",
            });
        }
        let mut outstanding = self.outstanding.lock();
        let held: usize = outstanding.values().sum();
        if held.saturating_add(bytes) > self.cap {
            return Err(MemoryError::OutOfMemory {
                requested: bytes,
                allocated: held,
                reserved: held,
                limit: Some(self.cap),
            });
        }
        let ptr = self
            .next
            .fetch_add(bytes as u64 + 0x10_0000, Ordering::SeqCst);
        outstanding.insert(ptr, bytes);
        self.allocations.fetch_add(1, Ordering::SeqCst);
        Ok(ptr)
    }
}

fn key(raw: usize) -> StreamKey {
    StreamKey::from_raw(raw)
}

#[test]
fn a_freed_block_comes_back_without_an_upstream_allocation() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::unlimited();
    let a = engine.allocate(key(1), MIB, &upstream).unwrap();
    engine.free(a.stream, a.id, a.ptr).unwrap();
    let b = engine.allocate(key(1), MIB, &upstream).unwrap();
    assert_eq!(b.ptr, a.ptr);
    assert_eq!(upstream.allocations.load(Ordering::SeqCst), 1);
    let stats = engine.stats();
    assert_eq!((stats.cache_hits, stats.cache_misses), (1, 1));
    assert_eq!(stats.reserved_bytes.current, SMALL_SEGMENT);
    engine.check_invariants();
}

#[test]
fn out_of_memory_releases_the_cache_and_retries() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::with_cap(2 * SMALL_SEGMENT);
    // Fill the cap with cached segments of two streams, then ask on a third.
    for stream in [1, 2] {
        let grant = engine.allocate(key(stream), 4096, &upstream).unwrap();
        engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    }
    assert_eq!(upstream.outstanding_bytes(), 2 * SMALL_SEGMENT);
    let grant = engine.allocate(key(3), 4096, &upstream).unwrap();
    let stats = engine.stats();
    assert_eq!(stats.oom_retries, 1);
    assert_eq!(stats.ooms, 0);
    assert_eq!(stats.segments_released, 2);
    assert_eq!(stats.reserved_bytes.current, SMALL_SEGMENT);
    assert_eq!(upstream.outstanding_bytes(), SMALL_SEGMENT);
    engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    engine.check_invariants();
}

#[test]
fn out_of_memory_first_takes_a_block_that_waited_for_its_uses_and_keeps_the_other_caches() {
    // A budget of two small segments: stream 1's block waits for a use elsewhere (the host ran
    // ahead of the GPU), stream 2 keeps a cached segment. Stream 1 asks again: the retry waits
    // for the pending block and takes it, with no segment released or allocated.
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::with_cap(2 * SMALL_SEGMENT);
    let first = engine.allocate(key(1), MIB, &upstream).unwrap();
    let held = engine.allocate(key(1), MIB, &upstream).unwrap();
    let marker = Flag::default();
    engine
        .free_after(first.stream, first.id, first.ptr, vec![marker.clone()])
        .unwrap();
    let other = engine.allocate(key(2), 4096, &upstream).unwrap();
    engine.free(other.stream, other.id, other.ptr).unwrap();
    let again = engine.allocate(key(1), MIB, &upstream).unwrap();
    assert!(
        marker.is_complete().unwrap(),
        "the pending block was waited for"
    );
    assert_eq!(again.ptr, first.ptr, "the block that waited came back");
    let stats = engine.stats();
    assert_eq!((stats.oom_retries, stats.ooms), (1, 0));
    assert_eq!(stats.segments_released, 0, "no cache was given back");
    assert_eq!(upstream.allocations.load(Ordering::SeqCst), 2);
    assert_eq!(upstream.outstanding_bytes(), 2 * SMALL_SEGMENT);
    for grant in [again, held] {
        engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    }
    engine.check_invariants();
}

#[test]
fn out_of_memory_after_the_retry_is_a_typed_error_with_the_totals() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::with_cap(8 * MIB);
    let held = engine.allocate(key(1), 4096, &upstream).unwrap();
    let cached = engine.allocate(key(2), 4096, &upstream).unwrap();
    engine.free(cached.stream, cached.id, cached.ptr).unwrap();
    // 7 MiB is a large request: it asks for a 20 MiB segment, past the 8 MiB cap, and then for
    // one of its own size (8 MiB), past what the held small segment leaves.
    let error = engine.allocate(key(1), 7 * MIB, &upstream).unwrap_err();
    assert_eq!(
        error,
        MemoryError::OutOfMemory {
            requested: 7 * MIB,
            allocated: 4096,
            reserved: SMALL_SEGMENT,
            limit: Some(8 * MIB),
        }
    );
    assert!(error.is_out_of_memory());
    let stats = engine.stats();
    assert_eq!((stats.oom_retries, stats.ooms), (1, 1));
    assert_eq!(
        stats.segments_released, 1,
        "the cached segment was released before the retry"
    );
    assert_eq!(upstream.outstanding_bytes(), SMALL_SEGMENT);
    engine.free(held.stream, held.id, held.ptr).unwrap();
    engine.check_invariants();
}

/// PyTorch's guarantee under `set_per_process_memory_fraction`: threads whose live demand fits
/// the budget are never refused, though each one's cached segments crowd the others out.
/// Four threads on their own streams (so their own shards) hold one block at a time, a large
/// one (a 20 MiB segment) or every fourth time a small one (a 2 MiB segment), under a cap of
/// four large segments: each small request and the large one after it must give back cached
/// segments, often another thread's, while other threads allocate around the retry.
#[test]
fn threads_whose_live_demand_fits_the_cap_are_never_refused_while_they_retry_together() {
    let engine = Arc::new(Engine::<Flag>::default());
    let upstream = Arc::new(FakeUpstream {
        release_time: std::time::Duration::from_micros(20),
        ..FakeUpstream::with_cap(4 * LARGE_SEGMENT)
    });
    let start = Arc::new(std::sync::Barrier::new(4));
    let threads: Vec<_> = (1..=4usize)
        .map(|stream| {
            let (engine, upstream, start) = (
                Arc::clone(&engine),
                Arc::clone(&upstream),
                Arc::clone(&start),
            );
            std::thread::spawn(move || {
                let mut refused = 0;
                start.wait();
                for step in 0..20_000usize {
                    let bytes = if step % 4 == 3 {
                        64 << 10
                    } else {
                        (2 + (step * 7 + stream) % 8) * MIB
                    };
                    match engine.allocate(key(stream), bytes, &*upstream) {
                        Ok(grant) => engine.free(grant.stream, grant.id, grant.ptr).unwrap(),
                        Err(error) => {
                            assert!(error.is_out_of_memory(), "{error}");
                            refused += 1;
                        }
                    }
                }
                refused
            })
        })
        .collect();
    let refused: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(
        refused, 0,
        "requests refused though the live demand fit the cap"
    );
    assert_eq!(engine.stats().ooms, 0);
    assert!(
        engine.stats().oom_retries > 0,
        "the threads did crowd each other out"
    );
    engine.release_cached(&*upstream).unwrap();
    assert_eq!(upstream.outstanding_bytes(), 0);
    engine.check_invariants();
}

#[test]
fn other_upstream_errors_are_not_retried() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream {
        broken: true,
        ..FakeUpstream::unlimited()
    };
    let error = engine.allocate(key(1), 4096, &upstream).unwrap_err();
    assert!(matches!(error, MemoryError::ZeroLength { .. }));
    assert_eq!(engine.stats().oom_retries, 0);
}

#[test]
fn zero_and_impossible_requests_are_typed_errors() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::unlimited();
    assert!(matches!(
        engine.allocate(key(1), 0, &upstream),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        engine.allocate(key(1), usize::MAX - 4, &upstream),
        Err(MemoryError::OutOfMemory { .. })
    ));
    assert_eq!(upstream.allocations.load(Ordering::SeqCst), 0);
}

#[test]
fn a_pending_block_is_reused_only_after_its_markers_complete() {
    let engine = Engine::<Pooled>::default();
    let upstream = FakeUpstream::unlimited();
    let events = FakePool::default();
    let a = engine.allocate(key(1), 64 * 1024, &upstream).unwrap();
    let markers = vec![events.acquire(), events.acquire()];
    let (first, second) = (markers[0].flag(), markers[1].flag());
    engine.free_after(a.stream, a.id, a.ptr, markers).unwrap();
    assert_eq!(engine.pending_blocks(), 1);
    let stats = engine.stats();
    assert_eq!(stats.allocated_bytes.current, 0, "freed by its holder");
    assert_eq!(
        stats.active_bytes.current,
        64 * 1024,
        "but still in use elsewhere"
    );

    let b = engine.allocate(key(1), 64 * 1024, &upstream).unwrap();
    assert_ne!(b.ptr, a.ptr, "not reused while both markers are pending");
    first.complete();
    let c = engine.allocate(key(1), 64 * 1024, &upstream).unwrap();
    assert_ne!(c.ptr, a.ptr, "not reused while one marker is pending");
    second.complete();
    let d = engine.allocate(key(1), 64 * 1024, &upstream).unwrap();
    assert_eq!(d.ptr, a.ptr, "reused once every marker completed");
    assert_eq!(engine.pending_blocks(), 0);
    assert_eq!(
        events.held(),
        0,
        "completed markers went back to their pool"
    );
    assert_eq!(events.created(), 2);
    for grant in [b, c, d] {
        engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    }
    engine.check_invariants();
    assert_eq!(engine.stats().active_bytes.current, 0);
}

#[test]
fn releasing_the_cache_waits_for_pending_blocks() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::unlimited();
    let a = engine.allocate(key(1), 4096, &upstream).unwrap();
    let marker = Flag::default();
    engine
        .free_after(a.stream, a.id, a.ptr, vec![marker.clone()])
        .unwrap();
    let released = engine.release_cached(&upstream).unwrap();
    assert!(marker.is_complete().unwrap(), "the marker was waited for");
    assert_eq!(released, SMALL_SEGMENT);
    assert_eq!(upstream.outstanding_bytes(), 0);
    assert_eq!(engine.pending_blocks(), 0);
    let stats = engine.stats();
    assert_eq!(
        (stats.reserved_bytes.current, stats.active_bytes.current),
        (0, 0)
    );
}

#[test]
fn blocks_that_are_never_to_be_reused_keep_their_segment() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::unlimited();
    let a = engine.allocate(key(1), 4096, &upstream).unwrap();
    engine.free_never_reuse(a.stream, a.id, a.ptr).unwrap();
    assert_eq!(engine.release_cached(&upstream).unwrap(), 0);
    let b = engine.allocate(key(1), 4096, &upstream).unwrap();
    assert_ne!(b.ptr, a.ptr);
    assert!(matches!(
        engine.free(a.stream, a.id, a.ptr),
        Err(MemoryError::UnknownAllocation { .. })
    ));
}

#[test]
fn large_requests_share_twenty_mib_segments() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::unlimited();
    let grants: Vec<Grant> = (0..3)
        .map(|_| engine.allocate(key(1), 7 * MIB, &upstream).unwrap())
        .collect();
    // Two 7 MiB blocks are carved from one 20 MiB segment; the 6 MiB left cannot hold a third.
    assert_eq!(upstream.allocations.load(Ordering::SeqCst), 2);
    assert_eq!(engine.stats().reserved_bytes.current, 2 * LARGE_SEGMENT);
    assert_eq!(grants[1].ptr, grants[0].ptr + 7 * MIB as u64);
    for grant in grants {
        engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    }
    assert_eq!(engine.release_cached(&upstream).unwrap(), 2 * LARGE_SEGMENT);
}

#[test]
fn eight_threads_lose_nothing() {
    let engine = Arc::new(Engine::<Flag>::default());
    let upstream = Arc::new(FakeUpstream::with_cap(512 * MIB));
    let threads: Vec<_> = (0..8u64)
        .map(|thread| {
            let (engine, upstream) = (Arc::clone(&engine), Arc::clone(&upstream));
            std::thread::spawn(move || {
                let mut state = 0x9e37_79b9_7f4a_7c15_u64 ^ (thread + 1);
                let mut random = move || {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state
                };
                let mut live = Vec::new();
                for _ in 0..2000 {
                    if live.len() < 16 && random() % 2 == 0 {
                        let stream = key(1 + (random() % 4) as usize);
                        let bytes = 1 + (random() % (3 * MIB as u64)) as usize;
                        live.push(engine.allocate(stream, bytes, &*upstream).unwrap());
                    } else if let Some(grant) = live.pop() {
                        if random() % 5 == 0 {
                            let marker = Flag::default();
                            marker.complete();
                            engine
                                .free_after(grant.stream, grant.id, grant.ptr, vec![marker])
                                .unwrap();
                        } else {
                            engine.free(grant.stream, grant.id, grant.ptr).unwrap();
                        }
                    }
                }
                for grant in live {
                    engine.free(grant.stream, grant.id, grant.ptr).unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    engine.check_invariants();
    let stats = engine.stats();
    assert_eq!(stats.allocations, stats.frees);
    assert_eq!(stats.allocated_bytes.current, 0);
    engine.release_cached(&*upstream).unwrap();
    let stats = engine.stats();
    assert_eq!(stats.active_bytes.current, 0);
    assert_eq!(stats.reserved_bytes.current, 0);
    assert_eq!(upstream.outstanding_bytes(), 0);
}

#[test]
fn markers_go_back_to_their_pool_so_it_never_makes_more_than_are_held_at_once() {
    // 10^5 blocks freed behind a use each, whose markers complete 8 frees later (a GPU that
    // lags the host): the pool makes only as many markers as are pending at once, the engine
    // keeps none, and every block is reused.
    const LAG: usize = 8;
    let engine = Engine::<Pooled>::default();
    let upstream = FakeUpstream::unlimited();
    let events = FakePool::default();
    let mut in_flight = std::collections::VecDeque::new();
    for _ in 0..100_000 {
        let grant = engine.allocate(key(1), 4096, &upstream).unwrap();
        let marker = events.acquire();
        in_flight.push_back(marker.flag());
        engine
            .free_after(grant.stream, grant.id, grant.ptr, vec![marker])
            .unwrap();
        if in_flight.len() > LAG {
            in_flight.pop_front().expect("one in flight").complete();
        }
        assert!(engine.pending_blocks() <= LAG + 1);
    }
    assert!(
        events.created() <= LAG + 2,
        "{} markers made for 10^5 frees",
        events.created()
    );
    assert_eq!(events.created(), events.peak_held());
    for flag in in_flight {
        flag.complete();
    }
    engine.process_pending();
    assert_eq!(events.held(), 0, "every marker went back");
    assert_eq!(
        upstream.allocations.load(Ordering::SeqCst),
        1,
        "one segment, reused"
    );
    engine.release_cached(&upstream).unwrap();
    assert_eq!(upstream.outstanding_bytes(), 0);
}

/// Captures into fresh graph pools, simulated: private keys by pool id, the pools that have
/// died, and the capture epoch with each capture's known-complete bound.
mod adoption {
    use std::collections::HashSet;

    use rstest::rstest;

    use super::*;

    /// Pool ids far from any live pool of other tests (whose ids count up from 1), so that
    /// `empty_cache`'s liveness check sees them dead once the simulation says so.
    const FIRST_POOL: u32 = 0x6000_0000;
    const PRIVATE: usize = 1 << (usize::BITS - 1);

    fn private(pool: u32, stream: usize) -> StreamKey {
        StreamKey::from_raw(PRIVATE | ((pool as usize) << 32) | stream)
    }

    fn pool_of(key: StreamKey) -> Option<u32> {
        let raw = key.as_usize();
        (raw & PRIVATE != 0).then_some(((raw & !PRIVATE) >> 32) as u32)
    }

    #[derive(Default)]
    struct Captures {
        dead: Mutex<HashSet<u32>>,
        epoch: AtomicU64,
        /// The bound of the capture running now (its begin's synchronisation).
        complete_before: AtomicU64,
    }

    impl Captures {
        /// A capture begins with the context synchronised (`begin_capture_synchronized`).
        fn begin_synchronized(&self) {
            let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
            self.complete_before.store(epoch, Ordering::SeqCst);
        }

        /// A capture begins without the synchronisation: nothing is known complete.
        fn begin_unsynchronized(&self) {
            self.complete_before.store(0, Ordering::SeqCst);
        }

        fn kill(&self, pool: u32) {
            self.dead.lock().insert(pool);
        }

        fn allocate(
            &self,
            engine: &Engine<Flag>,
            key: StreamKey,
            bytes: usize,
            upstream: &FakeUpstream,
        ) -> Grant {
            let retired =
                |key: StreamKey| pool_of(key).is_some_and(|p| self.dead.lock().contains(&p));
            let epoch = || self.epoch.load(Ordering::SeqCst);
            let complete_before = || self.complete_before.load(Ordering::SeqCst);
            let adoption = Adoption {
                retired: &retired,
                epoch: &epoch,
                complete_before: &complete_before,
            };
            engine
                .allocate_quiet(key, bytes, upstream, true, Some(&adoption))
                .unwrap()
        }
    }

    /// One cycle of the recapture loop: a fresh pool, a scratch block allocated and freed in
    /// the capture, the graph launched and dropped (the pool dies).
    fn cycle(
        engine: &Engine<Flag>,
        captures: &Captures,
        upstream: &FakeUpstream,
        pool: u32,
        bytes: usize,
    ) {
        captures.begin_synchronized();
        let grant = captures.allocate(engine, private(pool, 7), bytes, upstream);
        engine.free(grant.stream, grant.id, grant.ptr).unwrap();
        captures.kill(pool);
    }

    #[rstest]
    #[case::small_scratch(256)]
    #[case::large_scratch(4 * MIB)]
    fn ten_thousand_fresh_pool_captures_take_a_bounded_number_of_segments(#[case] bytes: usize) {
        let engine = Engine::<Flag>::default();
        let upstream = FakeUpstream::unlimited();
        let captures = Captures::default();
        for cycle_index in 0..10_000u32 {
            cycle(
                &engine,
                &captures,
                &upstream,
                FIRST_POOL + cycle_index,
                bytes,
            );
        }
        assert!(
            upstream.allocations.load(Ordering::SeqCst) <= 3,
            "{} upstream segments for 10^4 captures",
            upstream.allocations.load(Ordering::SeqCst)
        );
        let stats = engine.stats();
        assert_eq!(stats.reserved_bytes.current, upstream.outstanding_bytes());
        assert_eq!(stats.segments.current, upstream.outstanding.lock().len());
        assert_eq!(
            stats.cache_misses as usize,
            upstream.allocations.load(Ordering::SeqCst)
        );
        assert_eq!(stats.segments_released, 0, "adoption is no release");
        assert_eq!(stats.allocated_bytes.current, 0);
        assert!(engine.retired_len() <= 3, "the retired list stays bounded");
        engine.check_invariants();
        // Nothing uses them: `empty_cache` still gives every one back.
        engine.release_cached(&upstream).unwrap();
        assert_eq!(upstream.outstanding_bytes(), 0);
        assert_eq!(engine.stats().reserved_bytes.current, 0);
        engine.check_invariants();
    }

    #[test]
    fn a_segment_first_seen_dead_during_this_capture_is_not_adopted_until_the_next() {
        // The graph of the dead pool may have been launched just before it died, after this
        // capture's synchronisation: only a later synchronisation proves it finished.
        let engine = Engine::<Flag>::default();
        let upstream = FakeUpstream::unlimited();
        let captures = Captures::default();
        cycle(&engine, &captures, &upstream, FIRST_POOL + 100_000, 256);
        captures.begin_synchronized();
        let second = captures.allocate(&engine, private(FIRST_POOL + 100_001, 7), 256, &upstream);
        assert_eq!(
            upstream.allocations.load(Ordering::SeqCst),
            2,
            "seen now, not adopted"
        );
        engine.free(second.stream, second.id, second.ptr).unwrap();
        captures.begin_synchronized();
        let third = captures.allocate(&engine, private(FIRST_POOL + 100_002, 7), 256, &upstream);
        assert_eq!(
            upstream.allocations.load(Ordering::SeqCst),
            2,
            "adopted after a later sync"
        );
        assert_ne!(third.ptr, second.ptr, "the second pool is still alive");
        engine.free(third.stream, third.id, third.ptr).unwrap();
        engine.check_invariants();
    }

    #[test]
    fn a_capture_begun_without_synchronising_adopts_nothing() {
        let engine = Engine::<Flag>::default();
        let upstream = FakeUpstream::unlimited();
        let captures = Captures::default();
        cycle(&engine, &captures, &upstream, FIRST_POOL + 200_000, 256);
        // Seen by a capture's miss, then several synchronised captures pass.
        cycle(&engine, &captures, &upstream, FIRST_POOL + 200_001, 256);
        captures.begin_synchronized();
        captures.begin_unsynchronized();
        let before = upstream.allocations.load(Ordering::SeqCst);
        let grant = captures.allocate(&engine, private(FIRST_POOL + 200_002, 7), 256, &upstream);
        assert_eq!(upstream.allocations.load(Ordering::SeqCst), before + 1);
        engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    }

    #[test]
    fn segments_of_live_pools_partly_used_segments_and_general_ones_are_never_adopted() {
        let engine = Engine::<Flag>::default();
        let upstream = FakeUpstream::unlimited();
        let captures = Captures::default();
        let live = FIRST_POOL + 300_000;
        let held_pool = FIRST_POOL + 300_001;
        // A live pool's free segment, a general-cache free segment, and a dead pool's segment
        // with a block still allocated (a buffer that outlived its graph).
        captures.begin_synchronized();
        let a = captures.allocate(&engine, private(live, 7), 256, &upstream);
        engine.free(a.stream, a.id, a.ptr).unwrap();
        let b = engine.allocate(key(3), 256, &upstream).unwrap();
        engine.free(b.stream, b.id, b.ptr).unwrap();
        let kept = captures.allocate(&engine, private(held_pool, 7), 256, &upstream);
        captures.kill(held_pool);
        for pool in 0..5 {
            captures.begin_synchronized();
            let grant = captures.allocate(
                &engine,
                private(FIRST_POOL + 300_010 + pool, 9),
                256,
                &upstream,
            );
            assert!(![a.ptr, b.ptr, kept.ptr].contains(&grant.ptr));
            // Kept alive: this test's own segments are not adoptable either.
            engine.free(grant.stream, grant.id, grant.ptr).unwrap();
        }
        assert_eq!(upstream.allocations.load(Ordering::SeqCst), 8);
        // Once the block is freed its segment is adoptable (after one more synchronisation).
        engine.free(kept.stream, kept.id, kept.ptr).unwrap();
        for pool in 0..2 {
            captures.begin_synchronized();
            let grant = captures.allocate(
                &engine,
                private(FIRST_POOL + 300_020 + pool, 9),
                256,
                &upstream,
            );
            engine.free(grant.stream, grant.id, grant.ptr).unwrap();
        }
        assert_eq!(
            upstream.allocations.load(Ordering::SeqCst),
            9,
            "one more, then adopted"
        );
        engine.check_invariants();
    }

    #[test]
    fn a_large_request_adopts_the_smallest_fitting_large_segment_and_never_a_small_one() {
        let engine = Engine::<Flag>::default();
        let upstream = FakeUpstream::unlimited();
        let captures = Captures::default();
        // Dead pools with a small segment, a 20 MiB one and a 40 MiB one.
        for (pool, bytes) in [(0u32, 256), (1, 4 * MIB), (2, 40 * MIB)] {
            cycle(
                &engine,
                &captures,
                &upstream,
                FIRST_POOL + 400_000 + pool,
                bytes,
            );
        }
        let segment_of = |ptr: u64| {
            upstream
                .outstanding
                .lock()
                .iter()
                .find(|&(&start, &size)| start <= ptr && ptr < start + size as u64)
                .map(|(_, &size)| size)
        };
        // A small request's miss sees the large ones (adoptable from the next capture on) and
        // adopts the small segment, never a large one.
        captures.begin_synchronized();
        let small = captures.allocate(&engine, private(FIRST_POOL + 400_010, 7), 256, &upstream);
        assert_eq!(upstream.allocations.load(Ordering::SeqCst), 3, "adopted");
        assert_eq!(segment_of(small.ptr), Some(SMALL_SEGMENT));
        captures.begin_synchronized();
        let grant = captures.allocate(
            &engine,
            private(FIRST_POOL + 400_011, 7),
            12 * MIB,
            &upstream,
        );
        assert_eq!(upstream.allocations.load(Ordering::SeqCst), 3, "adopted");
        let stats = engine.stats();
        assert_eq!(stats.reserved_bytes.current, upstream.outstanding_bytes());
        assert_eq!(grant.size, 12 * MIB);
        assert_eq!(
            segment_of(grant.ptr),
            Some(LARGE_SEGMENT),
            "the smallest that fits"
        );
        engine.free(grant.stream, grant.id, grant.ptr).unwrap();
        engine.free(small.stream, small.id, small.ptr).unwrap();
        engine.check_invariants();
    }
}

/// A budget of 24 MiB: a 4 MiB buffer on one stream takes a shared 20 MiB segment; a 4 MiB
/// buffer on another stream cannot have one, and gets a segment of its own size instead of an
/// out-of-memory error with 8 MiB live. A 10 MiB request (its own segment already) and small
/// requests (2 MiB segments) have no smaller segment to fall back to.
#[test]
fn out_of_memory_for_a_shared_segment_falls_back_to_the_requests_own_size() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::with_cap(24 * MIB);
    let first = engine.allocate(key(1), 4 * MIB, &upstream).unwrap();
    let second = engine.allocate(key(2), 4 * MIB, &upstream).unwrap();
    let stats = engine.stats();
    assert_eq!(stats.reserved_bytes.current, LARGE_SEGMENT + 4 * MIB);
    assert_eq!((stats.oom_retries, stats.ooms), (1, 0));
    assert!(engine.allocate(key(3), 10 * MIB, &upstream).is_err());
    for grant in [first, second] {
        engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    }
    engine.check_invariants();
    assert_eq!(
        crate::caching::size_class::smallest_segment(3 * MIB + 1),
        Some(4 * MIB)
    );
    assert_eq!(crate::caching::size_class::smallest_segment(MIB), None);
    assert_eq!(crate::caching::size_class::smallest_segment(10 * MIB), None);
    assert_eq!(crate::caching::size_class::smallest_segment(19 * MIB), None);
}

/// During a capture (no retry), a request past a budget is refused naming the budget, and a
/// 1-10 MiB request takes a segment of its own size when a shared 20 MiB one does not fit.
#[test]
fn a_capture_miss_past_a_budget_names_it_and_falls_back_to_the_requests_own_size() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::with_cap(24 * MIB);
    let first = engine
        .allocate_quiet(key(1), 4 * MIB, &upstream, true, None)
        .unwrap();
    let second = engine
        .allocate_quiet(key(2), 4 * MIB, &upstream, true, None)
        .unwrap();
    assert_eq!(
        engine.stats().reserved_bytes.current,
        LARGE_SEGMENT + 4 * MIB
    );
    match engine.allocate_quiet(key(3), 12 * MIB, &upstream, true, None) {
        Err(MemoryError::OutOfMemory { limit, .. }) => assert_eq!(limit, Some(24 * MIB)),
        other => panic!("past the budget: {other:?}"),
    }
    for grant in [first, second] {
        engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    }
    engine.check_invariants();
}
