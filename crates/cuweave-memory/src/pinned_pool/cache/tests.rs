//! The bookkeeping with fake blocks and fences whose passing each test controls.

use std::cell::Cell;
use std::collections::VecDeque;
use std::rc::Rc;

use cuweave_driver::DriverError;

use super::*;

const PAGE: usize = 4 << 10;

/// A block that counts its drops (its "frees").
#[derive(Debug)]
struct FakeBlock {
    id: u32,
    capacity: usize,
    drops: Rc<Cell<u32>>,
}

impl Capacity for FakeBlock {
    fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Drop for FakeBlock {
    fn drop(&mut self) {
        self.drops.set(self.drops.get() + 1);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    Running,
    Done,
    Faulted,
}

/// A fence whose work state the test sets; counts its queries.
#[derive(Debug)]
struct FakeFence {
    work: Rc<Cell<Work>>,
    queries: Rc<Cell<u32>>,
}

impl Fence for FakeFence {
    fn passed(&self) -> Result<bool, DriverError> {
        self.queries.set(self.queries.get() + 1);
        match self.work.get() {
            Work::Running => Ok(false),
            Work::Done => Ok(true),
            Work::Faulted => Err(fault()),
        }
    }

    fn wait(&self) -> Result<(), DriverError> {
        match self.work.get() {
            // Waiting returns once the work has run to completion.
            Work::Running | Work::Done => {
                self.work.set(Work::Done);
                Ok(())
            }
            Work::Faulted => Err(fault()),
        }
    }
}

/// The error a fence reports for work that faulted (also used by the property tests).
pub(super) fn fault() -> DriverError {
    DriverError::Cuda {
        code: 700,
        operation: "cuEventQuery",
    }
}

type Cache = BlockCache<FakeBlock, FakeFence>;
type Out = Released<FakeBlock, FakeFence>;

/// A cache plus the counters its fakes share.
struct Harness {
    cache: Cache,
    drops: Rc<Cell<u32>>,
    queries: Rc<Cell<u32>>,
    next_id: u32,
}

impl Harness {
    fn new(max_cached_bytes: usize) -> Self {
        Self {
            cache: Cache::new(max_cached_bytes),
            drops: Rc::default(),
            queries: Rc::default(),
            next_id: 0,
        }
    }

    /// What the pool's `get` does: a cached block, or a newly "pinned" one.
    fn get(&mut self, class: usize, out: &mut Out) -> FakeBlock {
        match self.cache.take(class, out) {
            Some(block) => block,
            None => self.pin(class),
        }
    }

    /// What the pool's `get_cold` does: the cold rotation's oldest block, or a newly "pinned" one.
    fn get_cold(&mut self, class: usize, keep: usize, out: &mut Out) -> FakeBlock {
        match self.cache.take_cold(class, keep, out) {
            Some(block) => block,
            None => self.pin(class),
        }
    }

    /// A newly "pinned" block of `class`, counted by the cache.
    fn pin(&mut self, class: usize) -> FakeBlock {
        self.cache.add_pinned(class);
        self.next_id += 1;
        FakeBlock {
            id: self.next_id,
            capacity: class,
            drops: Rc::clone(&self.drops),
        }
    }

    fn fence(&self, work: Work) -> (FakeFence, Rc<Cell<Work>>) {
        let work = Rc::new(Cell::new(work));
        let fence = FakeFence {
            work: Rc::clone(&work),
            queries: Rc::clone(&self.queries),
        };
        (fence, work)
    }

    fn stats(&self) -> PinnedPoolStats {
        let stats = self.cache.stats();
        assert_balanced(&stats);
        stats
    }
}

fn assert_balanced(stats: &PinnedPoolStats) {
    assert_eq!(
        stats.pinned_bytes,
        stats.allocated_bytes + stats.cached_bytes,
        "{stats:?}"
    );
    assert!(stats.pending_bytes <= stats.cached_bytes, "{stats:?}");
    assert!(stats.pending_blocks <= stats.cached_blocks, "{stats:?}");
    assert_eq!(stats.gets, stats.hits + stats.misses, "{stats:?}");
    assert!(stats.peak_pinned_bytes >= stats.pinned_bytes, "{stats:?}");
    assert!(
        stats.peak_allocated_bytes >= stats.allocated_bytes,
        "{stats:?}"
    );
}

#[test]
fn returned_block_is_reused_for_its_class_only() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let first = h.get(PAGE, &mut out);
    let id = first.id;
    h.cache.give_back(first, Vec::new(), &mut out);

    let other_class = h.get(2 * PAGE, &mut out);
    assert_ne!(
        other_class.id, id,
        "a block is never served to another class"
    );
    let again = h.get(PAGE, &mut out);
    assert_eq!(again.id, id);

    let stats = h.stats();
    assert_eq!((stats.gets, stats.hits, stats.misses), (3, 1, 2));
    assert_eq!(stats.allocated_bytes, 3 * PAGE);
    assert_eq!(stats.pinned_bytes, 3 * PAGE);
    assert_eq!((stats.cached_bytes, stats.returns), (0, 1));
    assert!(out.blocks.is_empty() && out.fences.is_empty());
}

#[test]
fn most_recently_returned_block_goes_out_first() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let a = h.get(PAGE, &mut out);
    let b = h.get(PAGE, &mut out);
    let b_id = b.id;
    h.cache.give_back(a, Vec::new(), &mut out);
    h.cache.give_back(b, Vec::new(), &mut out);
    assert_eq!(h.get(PAGE, &mut out).id, b_id);
}

#[test]
fn cold_blocks_go_out_oldest_first_once_the_rotation_is_full() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let keep = 3;
    // A download loop with two blocks in flight: the rotation grows to `keep + 1` ready blocks
    // (plus the two in use), then every block handed out is the one returned longest ago.
    let mut in_use: VecDeque<FakeBlock> = VecDeque::new();
    let mut returned_order: VecDeque<u32> = VecDeque::new();
    for step in 0..100_000 {
        let block = h.get_cold(PAGE, keep, &mut out);
        if step > keep + 2 {
            assert_eq!(
                Some(block.id),
                returned_order.pop_front(),
                "step {step}: the oldest returned block goes out"
            );
        } else {
            returned_order.retain(|&id| id != block.id);
        }
        in_use.push_back(block);
        if in_use.len() > 2 {
            let done = in_use.pop_front().unwrap();
            returned_order.push_back(done.id);
            h.cache.give_back(done, Vec::new(), &mut out);
        }
    }
    let stats = h.stats();
    assert_eq!(
        h.next_id as usize,
        keep + 1 + 2,
        "pinned once, then rotated"
    );
    assert_eq!(stats.cached_blocks, keep + 1);
    assert_eq!(stats.allocated_blocks, 2);
    assert_eq!(stats.misses, (keep + 1 + 2) as u64);
}

#[test]
fn warm_and_cold_takes_share_the_class_from_opposite_ends() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let blocks: Vec<FakeBlock> = (0..3).map(|_| h.get(PAGE, &mut out)).collect();
    let ids: Vec<u32> = blocks.iter().map(|b| b.id).collect();
    for block in blocks {
        h.cache.give_back(block, Vec::new(), &mut out);
    }
    // Three ready, returned in the order ids[0], ids[1], ids[2].
    assert!(
        h.cache.take_cold(PAGE, 3, &mut out).is_none(),
        "keep 3: none out of three"
    );
    let cold = h.cache.take_cold(PAGE, 2, &mut out).unwrap();
    assert_eq!(cold.id, ids[0], "the cold take hands out the oldest");
    let warm = h.get(PAGE, &mut out);
    assert_eq!(warm.id, ids[2], "the warm take hands out the newest");
    assert!(
        h.cache.take_cold(2 * PAGE, 0, &mut out).is_none(),
        "no block of another class"
    );
}

#[test]
fn a_cold_rotation_that_cannot_grow_reuses_its_oldest_block() {
    // Room for two cached pages: with `keep` 8 the rotation can never hold nine, so once the
    // cache is full the oldest ready block goes out instead of a page being pinned per request.
    let mut h = Harness::new(2 * PAGE);
    let mut out = Out::default();
    let first = h.get_cold(PAGE, 8, &mut out);
    let second = h.get_cold(PAGE, 8, &mut out);
    let (a, b) = (first.id, second.id);
    h.cache.give_back(first, Vec::new(), &mut out);
    h.cache.give_back(second, Vec::new(), &mut out);
    for _ in 0..1000 {
        let block = h.get_cold(PAGE, 8, &mut out);
        assert!(block.id == a || block.id == b, "a full cache is reused");
        h.cache.give_back(block, Vec::new(), &mut out);
    }
    assert_eq!(h.next_id, 2);
    assert_eq!(h.stats().pinned_bytes, 2 * PAGE);
}

#[test]
fn take_queries_no_fence_when_a_block_is_ready_or_none_is_pending() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let ready = h.get(PAGE, &mut out);
    let busy = h.get(2 * PAGE, &mut out);
    h.cache.give_back(ready, Vec::new(), &mut out);
    let (fence, _work) = h.fence(Work::Running);
    h.cache.give_back(busy, vec![fence], &mut out);

    let _hit = h.get(PAGE, &mut out);
    assert_eq!(
        h.queries.get(),
        0,
        "a ready block of the class needs no poll"
    );
    let _miss = h.get(2 * PAGE, &mut out);
    assert_eq!(
        h.queries.get(),
        1,
        "no ready block: pending ones are polled"
    );

    let mut empty = Harness::new(usize::MAX);
    let _ = empty.get(PAGE, &mut out);
    assert_eq!(empty.queries.get(), 0);
}

#[test]
fn pending_block_is_reused_only_after_every_fence_passed() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let block = h.get(PAGE, &mut out);
    let id = block.id;
    let (copy_done, copy) = h.fence(Work::Done);
    let (kernel_done, kernel) = h.fence(Work::Running);
    h.cache
        .give_back(block, vec![copy_done, kernel_done], &mut out);
    let stats = h.stats();
    assert_eq!((stats.pending_blocks, stats.pending_bytes), (1, PAGE));
    assert_eq!(stats.cached_bytes, PAGE);

    let while_running = h.get(PAGE, &mut out);
    assert_ne!(while_running.id, id, "handed out while a fence is pending");
    assert_eq!(
        out.fences.len(),
        1,
        "the passed fence is released for reuse"
    );
    assert_eq!(copy.get(), Work::Done);
    let stats = h.stats();
    assert_eq!((stats.misses, stats.hits, stats.pending_blocks), (2, 0, 1));

    kernel.set(Work::Done);
    let after = h.get(PAGE, &mut out);
    assert_eq!(after.id, id);
    assert_eq!(out.fences.len(), 2);
    let stats = h.stats();
    assert_eq!(
        (stats.hits, stats.pending_blocks, stats.pending_bytes),
        (1, 0, 0)
    );
    assert_eq!(stats.cached_bytes, 0);
    drop(while_running);
}

#[test]
fn ready_blocks_past_the_cap_are_freed_on_return() {
    let mut h = Harness::new(2 * PAGE);
    let mut out = Out::default();
    let blocks: Vec<_> = (0..3).map(|_| h.get(PAGE, &mut out)).collect();
    for block in blocks {
        h.cache.give_back(block, Vec::new(), &mut out);
    }
    assert_eq!(out.blocks.len(), 1);
    let stats = h.stats();
    assert_eq!((stats.cached_bytes, stats.cached_blocks), (2 * PAGE, 2));
    assert_eq!(
        (stats.pinned_bytes, stats.peak_pinned_bytes),
        (2 * PAGE, 3 * PAGE)
    );
    assert_eq!((stats.frees, stats.returns), (1, 3));
    assert_eq!(h.drops.get(), 0, "the cache itself frees nothing");
    out.blocks.clear();
    assert_eq!(h.drops.get(), 1);
}

#[test]
fn pending_blocks_may_exceed_the_cap_until_they_become_ready() {
    let mut h = Harness::new(PAGE);
    let mut out = Out::default();
    let kept = h.get(PAGE, &mut out);
    let busy = h.get(PAGE, &mut out);
    h.cache.give_back(kept, Vec::new(), &mut out);
    let (fence, work) = h.fence(Work::Running);
    h.cache.give_back(busy, vec![fence], &mut out);
    let stats = h.stats();
    assert_eq!(
        stats.cached_bytes,
        2 * PAGE,
        "a pending block cannot be freed yet"
    );
    assert!(out.blocks.is_empty());

    work.set(Work::Done);
    h.cache.poll(&mut out);
    assert_eq!(out.blocks.len(), 1, "ready now, and past the cap: freed");
    let stats = h.stats();
    assert_eq!((stats.cached_bytes, stats.pending_bytes), (PAGE, 0));
    assert_eq!((stats.pinned_bytes, stats.frees), (PAGE, 1));
}

#[test]
fn drain_ready_frees_ready_blocks_and_keeps_pending_ones() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let held = h.get(8 * PAGE, &mut out);
    let small = h.get(PAGE, &mut out);
    let large = h.get(4 * PAGE, &mut out);
    let busy = h.get(2 * PAGE, &mut out);
    let finished = h.get(2 * PAGE, &mut out);
    h.cache.give_back(small, Vec::new(), &mut out);
    h.cache.give_back(large, Vec::new(), &mut out);
    let (fence, work) = h.fence(Work::Running);
    h.cache.give_back(busy, vec![fence], &mut out);
    let (fence, _) = h.fence(Work::Done);
    h.cache.give_back(finished, vec![fence], &mut out);

    let freed = h.cache.drain_ready(&mut out);
    assert_eq!(
        freed,
        PAGE + 4 * PAGE + 2 * PAGE,
        "ready and newly passed blocks"
    );
    assert_eq!(out.blocks.len(), 3);
    let stats = h.stats();
    assert_eq!(stats.cached_bytes, 2 * PAGE);
    assert_eq!(stats.pending_bytes, 2 * PAGE);
    assert_eq!(stats.pinned_bytes, 8 * PAGE + 2 * PAGE);

    work.set(Work::Done);
    assert_eq!(h.cache.drain_ready(&mut out), 2 * PAGE);
    let stats = h.stats();
    assert_eq!((stats.cached_bytes, stats.pinned_bytes), (0, 8 * PAGE));
    assert_eq!(stats.frees, 4);
    drop(held);
}

#[test]
fn drain_ready_counts_blocks_its_poll_frees_past_the_cap() {
    let mut h = Harness::new(PAGE);
    let mut out = Out::default();
    let ready = h.get(PAGE, &mut out);
    let finished = h.get(PAGE, &mut out);
    h.cache.give_back(ready, Vec::new(), &mut out);
    let (fence, _) = h.fence(Work::Done);
    h.cache.give_back(finished, vec![fence], &mut out);

    assert_eq!(h.cache.drain_ready(&mut out), 2 * PAGE);
    assert_eq!(out.blocks.len(), 2);
    let stats = h.stats();
    assert_eq!((stats.pinned_bytes, stats.frees), (0, 2));
}

#[test]
fn faulted_fence_quarantines_its_block_and_is_queried_once() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let block = h.get(PAGE, &mut out);
    let id = block.id;
    let (fence, _) = h.fence(Work::Faulted);
    h.cache.give_back(block, vec![fence], &mut out);

    for _ in 0..3 {
        let other = h.get(PAGE, &mut out);
        assert_ne!(other.id, id);
        h.cache.give_back(other, Vec::new(), &mut out);
        h.cache.poll(&mut out);
    }
    assert_eq!(h.queries.get(), 1, "a faulted block is not queried again");
    assert_eq!(
        h.cache.drain_ready(&mut out),
        PAGE,
        "only the healthy block"
    );
    assert_eq!(h.stats().pending_blocks, 1);

    let drops_before = h.drops.get();
    h.cache.shutdown();
    assert_eq!(
        h.drops.get(),
        drops_before,
        "the faulted block is leaked, not freed"
    );
}

#[test]
fn shutdown_waits_for_pending_blocks_then_frees_everything() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let ready = h.get(PAGE, &mut out);
    let busy = h.get(PAGE, &mut out);
    h.cache.give_back(ready, Vec::new(), &mut out);
    let (fence, work) = h.fence(Work::Running);
    h.cache.give_back(busy, vec![fence], &mut out);

    h.cache.shutdown();
    assert_eq!(
        work.get(),
        Work::Done,
        "the pending block's fence was waited on"
    );
    assert_eq!(h.drops.get(), 2);
}

#[test]
fn random_traffic_keeps_the_books_balanced() {
    let mut h = Harness::new(64 * PAGE);
    let mut out = Out::default();
    let mut held: Vec<FakeBlock> = Vec::new();
    let mut works: Vec<Rc<Cell<Work>>> = Vec::new();
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..5_000 {
        match next() % 6 {
            0..=2 => {
                let class = PAGE << (next() % 5);
                held.push(h.get(class, &mut out));
            }
            3 | 4 if !held.is_empty() => {
                let block = held.swap_remove((next() as usize) % held.len());
                let fences = if next() % 2 == 0 {
                    Vec::new()
                } else {
                    let (fence, work) = h.fence(Work::Running);
                    works.push(work);
                    vec![fence]
                };
                h.cache.give_back(block, fences, &mut out);
            }
            5 => {
                // Some outstanding GPU work finishes.
                for work in works.iter().filter(|_| next() % 3 == 0) {
                    work.set(Work::Done);
                }
                if next() % 4 == 0 {
                    h.cache.drain_ready(&mut out);
                }
            }
            _ => {}
        }
        let stats = h.stats();
        assert_eq!(stats.allocated_blocks, held.len());
        assert_eq!(
            stats.allocated_bytes,
            held.iter().map(|b| b.capacity).sum::<usize>()
        );
        assert!(stats.cached_bytes - stats.pending_bytes <= 64 * PAGE);
    }
    for block in held.drain(..) {
        h.cache.give_back(block, Vec::new(), &mut out);
    }
    for work in &works {
        work.set(Work::Done);
    }
    h.cache.drain_ready(&mut out);
    let stats = h.stats();
    assert_eq!(stats.returns, stats.gets);
    assert_eq!(
        (
            stats.pinned_bytes,
            stats.cached_bytes,
            stats.allocated_bytes
        ),
        (0, 0, 0)
    );
    assert_eq!(stats.pending_blocks, 0);
    assert_eq!(out.blocks.len() as u64, stats.frees);
    assert_eq!(
        stats.misses, stats.frees,
        "every pinned block was freed once"
    );
}

#[test]
fn captured_block_is_never_handed_out_again_nor_freed() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let block = h.get(PAGE, &mut out);
    let id = block.id;
    // An eager use, long done, besides the capture's: the capture alone keeps the block.
    let (fence, _) = h.fence(Work::Done);
    h.cache.give_back_captured(block, vec![fence], &mut out);
    assert_eq!(out.fences.len(), 1, "the eager fence is released at once");
    assert_eq!(h.stats().pending_blocks, 1);

    for _ in 0..3 {
        let other = h.get(PAGE, &mut out);
        assert_ne!(other.id, id, "the captured block was handed out again");
        let other_cold = h.get_cold(PAGE, 0, &mut out);
        assert_ne!(other_cold.id, id, "the captured block was handed out again");
        h.cache.give_back(other, Vec::new(), &mut out);
        h.cache.give_back(other_cold, Vec::new(), &mut out);
        h.cache.poll(&mut out);
    }
    assert_eq!(
        h.queries.get(),
        0,
        "nothing of the captured block is queried"
    );
    assert_eq!(
        h.cache.drain_ready(&mut out),
        2 * PAGE,
        "trim frees only the other blocks"
    );
    let stats = h.stats();
    assert_eq!((stats.pending_blocks, stats.pinned_bytes), (1, PAGE));

    drop(out);
    let drops_before = h.drops.get();
    h.cache.shutdown();
    assert_eq!(
        h.drops.get(),
        drops_before,
        "the captured block is leaked, not freed: a graph may outlive the pool"
    );
}

#[test]
fn a_released_captured_block_is_ready_again_once() {
    let mut h = Harness::new(usize::MAX);
    let mut out = Out::default();
    let block = h.get(PAGE, &mut out);
    let id = block.id;
    let ticket = h.cache.give_back_captured(block, Vec::new(), &mut out);
    assert_ne!(h.get(PAGE, &mut out).id, id, "held: not handed out");
    assert!(h.cache.release_captured(ticket, &mut out));
    assert!(!h.cache.release_captured(ticket, &mut out), "released once");
    assert_eq!(h.stats().pending_blocks, 0);
    assert_eq!(
        h.get(PAGE, &mut out).id,
        id,
        "ready again after its graphs died"
    );
}
