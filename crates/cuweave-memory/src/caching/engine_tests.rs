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
fn out_of_memory_after_the_retry_is_a_typed_error_with_the_totals() {
    let engine = Engine::<Flag>::default();
    let upstream = FakeUpstream::with_cap(8 * MIB);
    let held = engine.allocate(key(1), 4096, &upstream).unwrap();
    let cached = engine.allocate(key(2), 4096, &upstream).unwrap();
    engine.free(cached.stream, cached.id, cached.ptr).unwrap();
    // 3 MiB is a large request: it needs a 20 MiB segment, past the 8 MiB cap.
    let error = engine.allocate(key(1), 3 * MIB, &upstream).unwrap_err();
    assert_eq!(
        error,
        MemoryError::OutOfMemory {
            requested: 3 * MIB,
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
