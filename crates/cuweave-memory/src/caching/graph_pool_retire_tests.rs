//! A dropped allocator's graph-pool segments, with a fake upstream: kept (and the upstream with
//! them) while the pool lives, returned exactly once when it dies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::super::super::engine::Upstream;
use super::super::test_support::flushed_until;
use super::super::{GraphPool, PRIVATE_BIT};
use super::*;
use crate::caching::stream_uses::fake::Flag;
use crate::error::MemoryError;

const MIB: usize = 1 << 20;

/// Hands out addresses from a counter; counts every return, and refuses a second one.
#[derive(Debug, Default)]
struct FakeHome {
    next: AtomicU64,
    outstanding: Mutex<HashMap<u64, usize>>,
    returned: Arc<Mutex<Vec<u64>>>,
}

impl FakeHome {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            next: AtomicU64::new(0x7e00_0000_0000),
            ..Self::default()
        })
    }

    fn returned(&self) -> Vec<u64> {
        let mut returned = self.returned.lock().clone();
        returned.sort_unstable();
        returned
    }
}

impl Release for FakeHome {
    fn release_segments(&self, segments: &[Segment]) -> Result<()> {
        let mut outstanding = self.outstanding.lock();
        for segment in segments {
            // Every attempt is listed: one made twice shows up twice.
            self.returned.lock().push(segment.ptr);
            if outstanding.remove(&segment.ptr) != Some(segment.size) {
                return Err(MemoryError::UnknownAllocation {
                    operation: "fake release",
                    ptr: segment.ptr,
                });
            }
        }
        Ok(())
    }
}

impl Upstream for FakeHome {
    fn allocate_segment(&self, bytes: usize) -> Result<u64> {
        let ptr = self
            .next
            .fetch_add(bytes as u64 + 0x10_0000, Ordering::SeqCst);
        self.outstanding.lock().insert(ptr, bytes);
        Ok(ptr)
    }
}

impl SegmentHome for FakeHome {
    fn context(&self) -> Option<&Arc<Context>> {
        None
    }
}

/// The key of `pool`'s free list for the stream with id `stream`.
fn private(pool: &GraphPool, stream: usize) -> StreamKey {
    StreamKey::from_raw(PRIVATE_BIT | ((pool.id().as_u32() as usize) << 32) | stream)
}

/// A block of `bytes` allocated for `key` and freed again: one cached segment.
fn cached(engine: &Engine<Flag>, home: &Arc<FakeHome>, key: StreamKey, bytes: usize) -> u64 {
    let grant = engine.allocate(key, bytes, &**home).unwrap();
    engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    grant.ptr
}

#[test]
fn a_live_graph_pools_segments_outlive_the_allocator_and_go_back_once_when_it_dies() {
    let engine = Engine::<Flag>::default();
    let home = FakeHome::new();
    let pool = GraphPool::new();
    let general = cached(&engine, &home, StreamKey::from_raw(7), MIB);
    let small = cached(&engine, &home, private(&pool, 7), MIB);
    // A private block freed behind another stream's use: pending when the allocator drops.
    let grant = engine.allocate(private(&pool, 9), 3 * MIB, &*home).unwrap();
    let marker = Flag::default();
    engine
        .free_after(grant.stream, grant.id, grant.ptr, vec![marker.clone()])
        .unwrap();
    let large = grant.ptr;
    // The graph made from the capture keeps the pool; the user lets go of the handle.
    let graph = pool.keep_alive();
    drop(pool);

    // The allocator's last handle goes.
    retire_engine(&engine, &home).unwrap();
    assert_eq!(home.returned(), vec![general], "only the general cache");
    assert_eq!(engine.stats().reserved_bytes.current, 0, "off the books");
    assert_eq!(engine.stats().segments.current, 0);
    let returned = Arc::clone(&home.returned);
    let upstream: Weak<FakeHome> = Arc::downgrade(&home);
    drop(engine);
    drop(home);
    let alive = upstream
        .upgrade()
        .expect("the pool keeps the upstream alive");
    let mut held: Vec<u64> = alive.outstanding.lock().keys().copied().collect();
    held.sort_unstable();
    assert_eq!(
        held,
        vec![small, large],
        "the graph's segments stay allocated"
    );
    drop(alive);

    // The graph goes: both segments return, once each, and the upstream is let go.
    drop(graph);
    assert!(
        flushed_until(|| upstream.upgrade().is_none()),
        "the upstream outlived the graph's segments"
    );
    let mut expected = vec![general, small, large];
    expected.sort_unstable();
    let mut returned = returned.lock().clone();
    returned.sort_unstable();
    assert_eq!(returned, expected, "each segment returned once");
    assert!(
        marker.0.load(Ordering::SeqCst),
        "the pending block was waited for"
    );
}

#[test]
fn segments_return_to_the_upstream_exactly_once_and_only_when_their_own_pool_dies() {
    let engine = Engine::<Flag>::default();
    let home = FakeHome::new();
    let (first, second) = (GraphPool::new(), GraphPool::new());
    let a = cached(&engine, &home, private(&first, 3), MIB);
    let b = cached(&engine, &home, private(&first, 4), 3 * MIB);
    let c = cached(&engine, &home, private(&second, 3), MIB);
    retire_engine(&engine, &home).unwrap();
    assert!(home.returned().is_empty(), "both pools live");

    drop(second);
    assert!(flushed_until(|| home.returned() == vec![c]));
    drop(first);
    let mut expected = vec![a, b, c];
    expected.sort_unstable();
    assert!(flushed_until(|| home.returned() == expected));
    // Nothing is returned twice, however often held memory is flushed.
    for _ in 0..3 {
        assert!(flushed_until(|| true));
    }
    assert_eq!(home.returned(), expected);
    assert!(home.outstanding.lock().is_empty(), "no leak");
}

#[test]
fn segments_of_a_pool_that_died_before_the_allocator_go_back_with_the_cache() {
    let engine = Engine::<Flag>::default();
    let home = FakeHome::new();
    let pool = GraphPool::new();
    let key = private(&pool, 5);
    let ptr = cached(&engine, &home, key, MIB);
    drop(pool);
    retire_engine(&engine, &home).unwrap();
    assert_eq!(home.returned(), vec![ptr]);
    assert_eq!(Arc::strong_count(&home), 1, "nothing holds the upstream");
}

#[test]
fn the_pool_of_a_key_is_read_back_from_private_keys_only() {
    let pool = GraphPool::new();
    assert_eq!(pool_of_key(private(&pool, 42)), Some(pool.id().as_u32()));
    assert_eq!(pool_of_key(StreamKey::from_raw(42)), None);
}
