//! Pinned blocks that captures used, held by graph pools and returned when the pools die: the
//! pool's bookkeeping ([`BlockCache`]) driven through the graph pools' holding rules, without a
//! GPU.

use std::sync::Arc;

use cuweave_driver::{Context, DriverError};
use parking_lot::Mutex;

use super::cache::{BlockCache, Capacity, Fence, Released};
use crate::caching::graph_pool_test_support::{bind, flushed_until};
use crate::caching::{
    GraphHeld, GraphPool, NO_POOL, hold_for_graphs, pool_tag_of_capture, stranded_graph_memory,
};

const PAGE: usize = 4 << 10;

#[derive(Debug)]
struct Block(usize);

impl Capacity for Block {
    fn capacity(&self) -> usize {
        self.0
    }
}

#[derive(Debug)]
struct Passed;

impl Fence for Passed {
    fn passed(&self) -> Result<bool, DriverError> {
        Ok(true)
    }

    fn wait(&self) -> Result<(), DriverError> {
        Ok(())
    }
}

type Cache = Arc<Mutex<BlockCache<Block, Passed>>>;

/// What the pinned pool's hold does, on a fake cache (no context to synchronise).
struct Hold {
    cache: Cache,
    ticket: u64,
}

impl GraphHeld for Hold {
    fn give_back(
        self: Box<Self>,
        _synced: &mut Vec<Arc<Context>>,
    ) -> crate::Result<Option<Box<dyn GraphHeld>>> {
        let mut released = Released::default();
        assert!(
            self.cache
                .lock()
                .release_captured(self.ticket, &mut released)
        );
        Ok(None)
    }

    fn strand(self: Box<Self>) {}
}

/// A block of `PAGE` from the cache, pinning one when none is ready (as `PinnedPool::get`).
fn get(cache: &Cache) -> Block {
    let mut cache = cache.lock();
    let mut released = Released::default();
    cache.take(PAGE, &mut released).unwrap_or_else(|| {
        cache.add_pinned(PAGE);
        Block(PAGE)
    })
}

/// Frees `block` after captures of the pools `tags` used it (as a pinned buffer's drop).
fn free_captured(cache: &Cache, block: Block, tags: &[u64]) {
    let mut released = Released::default();
    let ticket = cache
        .lock()
        .give_back_captured(block, vec![Passed], &mut released);
    let hold = Hold {
        cache: Arc::clone(cache),
        ticket,
    };
    hold_for_graphs(Box::new(hold), tags, PAGE);
}

#[test]
fn pinned_memory_stays_bounded_over_many_recaptures_whose_pools_die() {
    // A serving loop: each round captures a graph with a pinned staging block into a new pool,
    // frees the buffer, replays, and drops the graph. The block must come back every round.
    let cache: Cache = Arc::new(Mutex::new(BlockCache::new(usize::MAX)));
    for round in 0..100_000u64 {
        let pool = GraphPool::new();
        let capture = u64::MAX - 10_000_000 - round;
        let binding = bind(capture, &pool);
        let tag = pool_tag_of_capture(capture);
        assert_ne!(tag, NO_POOL);
        let block = get(&cache);
        drop(binding); // the capture ends
        free_captured(&cache, block, &[tag]);
        assert_eq!(
            cache.lock().stats().pending_blocks,
            1,
            "held while the graph's pool lives"
        );
        assert!(
            cache.lock().take(PAGE, &mut Released::default()).is_none(),
            "a held block was handed out again"
        );
        drop(pool); // the last graph of the pool goes
        assert!(
            flushed_until(|| cache.lock().stats().pending_blocks == 0),
            "returned once the pool died"
        );
    }
    let stats = cache.lock().stats();
    assert_eq!(
        (stats.pinned_bytes, stats.misses, stats.pending_blocks),
        (PAGE, 1, 0),
        "one block served every round: {stats:?}"
    );
}

#[test]
fn a_pinned_block_two_pools_captured_returns_when_both_have_died() {
    let cache: Cache = Arc::new(Mutex::new(BlockCache::new(usize::MAX)));
    let (first, second) = (GraphPool::new(), GraphPool::new());
    let (c1, c2) = (u64::MAX - 9_000_001, u64::MAX - 9_000_002);
    let tags = {
        let _bindings = (bind(c1, &first), bind(c2, &second));
        [pool_tag_of_capture(c1), pool_tag_of_capture(c2)]
    };
    let block = get(&cache);
    free_captured(&cache, block, &tags);
    drop(first);
    assert_eq!(
        cache.lock().stats().pending_blocks,
        1,
        "the second graph may replay"
    );
    drop(second);
    assert!(flushed_until(|| cache.lock().stats().pending_blocks == 0));
    // A pool dead before the free: returned at once.
    let dead = GraphPool::new();
    let capture = u64::MAX - 9_000_003;
    let tag = {
        let _binding = bind(capture, &dead);
        pool_tag_of_capture(capture)
    };
    drop(dead);
    let block = get(&cache);
    free_captured(&cache, block, &[tag]);
    assert!(flushed_until(|| cache.lock().stats().pending_blocks == 0));
    assert_eq!(cache.lock().stats().pinned_bytes, PAGE);
}

#[test]
fn a_pinned_block_of_a_capture_with_no_pool_stays_quarantined_and_is_counted() {
    let cache: Cache = Arc::new(Mutex::new(BlockCache::new(usize::MAX)));
    let (count, bytes) = stranded_graph_memory();
    let block = get(&cache);
    free_captured(&cache, block, &[NO_POOL]);
    let (count_after, bytes_after) = stranded_graph_memory();
    assert!(count_after > count && bytes_after >= bytes + PAGE as u64);
    let stats = cache.lock().stats();
    assert_eq!(stats.pending_blocks, 1, "never handed out again");
    let other = get(&cache);
    assert_eq!(
        cache.lock().stats().pinned_bytes,
        2 * PAGE,
        "{other:?} is a new block"
    );
}
