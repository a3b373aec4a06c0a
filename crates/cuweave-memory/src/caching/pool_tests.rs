//! The pools on made-up addresses: reuse, splitting, merging, best fit, streams, pools, pending
//! blocks, release, and a randomized workload checked against every invariant.

use super::*;
use crate::caching::size_class::{SMALL_SEGMENT, round_size, segment_size};
use rstest::rstest;

const MIB: usize = 1 << 20;
const S1: StreamKey = StreamKey::from_raw(1);

/// Allocates like the engine does, with a counter for upstream addresses.
fn alloc(pools: &mut Pools, next_ptr: &mut u64, stream: StreamKey, bytes: usize) -> Grant {
    let rounded = round_size(bytes).unwrap();
    let grant = pools.take_free(stream, rounded, bytes).unwrap_or_else(|| {
        let segment = segment_size(rounded).unwrap();
        let ptr = *next_ptr;
        *next_ptr += segment as u64 + 0x1000_0000;
        pools.add_segment(stream, ptr, segment, rounded, bytes)
    });
    pools.check_invariants();
    grant
}

#[test]
fn a_freed_block_of_the_same_size_is_reused() {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    let a = alloc(&mut pools, &mut next, S1, 4000);
    assert_eq!(a.size, 4096);
    pools.free(a.id, a.ptr).unwrap();
    pools.check_invariants();
    let b = alloc(&mut pools, &mut next, S1, 4000);
    assert_eq!(b.ptr, a.ptr);
    let stats = pools.stats();
    assert_eq!((stats.cache_hits, stats.cache_misses), (1, 1));
    assert_eq!(stats.reserved_bytes.current, SMALL_SEGMENT);
    assert_eq!(stats.allocated_bytes.current, 4096);
    assert_eq!(stats.requested_bytes.current, 4000);
}

#[test]
fn small_blocks_split_from_one_segment_and_merge_back() {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    let grants: Vec<Grant> = (0..4)
        .map(|_| alloc(&mut pools, &mut next, S1, 512 * 1024))
        .collect();
    assert_eq!(
        pools.stats().segments.current,
        1,
        "four 512 KiB blocks share a 2 MiB segment"
    );
    for pair in grants.windows(2) {
        assert_eq!(
            pair[0].ptr + 512 * 1024,
            pair[1].ptr,
            "carved in address order"
        );
    }
    // Free out of order: the middle ones cannot merge until a neighbour is free.
    for index in [1, 3, 0, 2] {
        pools.free(grants[index].id, grants[index].ptr).unwrap();
        pools.check_invariants();
    }
    // Freed blocks park whole for their size's next request; flushing merges them.
    pools.flush_stash();
    pools.check_invariants();
    assert_eq!(
        pools.free_blocks(),
        1,
        "everything merged back into the segment"
    );
    let segments = pools.take_free_segments();
    assert_eq!(
        segments,
        vec![Segment {
            ptr: grants[0].ptr,
            size: SMALL_SEGMENT,
            stream: S1
        }]
    );
    pools.check_invariants();
    assert_eq!(pools.stats().reserved_bytes.current, 0);
}

#[test]
fn a_parked_block_comes_back_without_splitting_or_merging() {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    let a = alloc(&mut pools, &mut next, S1, MIB);
    let blocks_in_use = pools.free_blocks();
    pools.free(a.id, a.ptr).unwrap();
    pools.check_invariants();
    assert_eq!(
        pools.free_blocks(),
        blocks_in_use,
        "the freed block is parked, not merged into the free lists"
    );
    let b = alloc(&mut pools, &mut next, S1, MIB);
    assert_eq!((b.ptr, b.size), (a.ptr, MIB));
    assert_eq!(
        pools.free_blocks(),
        blocks_in_use,
        "and taken back without a split"
    );
    assert_eq!(
        (pools.stats().cache_hits, pools.stats().cache_misses),
        (1, 1)
    );
    pools.free(b.id, b.ptr).unwrap();
    let other = alloc(&mut pools, &mut next, StreamKey::from_raw(9), MIB);
    assert_ne!(other.ptr, b.ptr, "another stream never gets a parked block");
    assert_eq!(pools.stats().cache_misses, 2, "it got a segment of its own");
}

#[test]
fn parked_blocks_are_merged_before_a_request_goes_upstream() {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    // Fill one 2 MiB segment: 512 KiB + 512 KiB + 1 MiB.
    let x = alloc(&mut pools, &mut next, S1, 512 * 1024);
    let y = alloc(&mut pools, &mut next, S1, 512 * 1024);
    let z = alloc(&mut pools, &mut next, S1, MIB);
    assert_eq!(pools.stats().segments.current, 1);
    // Both land in one stash bucket: y evicts x into the free lists, y stays parked.
    pools.free(x.id, x.ptr).unwrap();
    pools.free(y.id, y.ptr).unwrap();
    pools.check_invariants();
    // No single free or parked block holds 1 MiB, but x and y together do once merged.
    let w = alloc(&mut pools, &mut next, S1, MIB);
    assert_eq!(
        w.ptr, x.ptr,
        "served from x and y merged, not from a new segment"
    );
    assert_eq!(pools.stats().segments.current, 1);
    assert_eq!(pools.stats().cache_misses, 1);
    pools.free(w.id, w.ptr).unwrap();
    pools.free(z.id, z.ptr).unwrap();
    assert_eq!(
        pools.take_free_segments().len(),
        1,
        "releasing flushes the stash"
    );
    pools.check_invariants();
}

#[test]
fn best_fit_picks_the_smallest_block_that_fits() {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    // Three large segments of different sizes, all freed.
    let sizes = [40 * MIB, 12 * MIB, 24 * MIB];
    let grants: Vec<Grant> = sizes
        .iter()
        .map(|&s| alloc(&mut pools, &mut next, S1, s))
        .collect();
    for grant in &grants {
        pools.free(grant.id, grant.ptr).unwrap();
    }
    let fit = alloc(&mut pools, &mut next, S1, 11 * MIB);
    assert_eq!(
        fit.ptr, grants[1].ptr,
        "the 12 MiB block is the best fit for 11 MiB"
    );
    assert_eq!(
        fit.size,
        12 * MIB,
        "a 1 MiB remainder is not worth splitting in the large pool"
    );
    let fit = alloc(&mut pools, &mut next, S1, 20 * MIB);
    assert_eq!(fit.ptr, grants[2].ptr);
    assert_eq!(fit.size, 20 * MIB, "a 4 MiB remainder is split off");
    assert_eq!(pools.stats().cache_misses, 3);
}

#[test]
fn streams_have_separate_free_lists() {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    let s2 = StreamKey::from_raw(2);
    let a = alloc(&mut pools, &mut next, S1, 4096);
    pools.free(a.id, a.ptr).unwrap();
    let b = alloc(&mut pools, &mut next, s2, 4096);
    assert_ne!(
        b.ptr, a.ptr,
        "a block of stream 1 is not handed to stream 2"
    );
    assert_eq!(pools.stats().segments.current, 2);
    let c = alloc(&mut pools, &mut next, S1, 4096);
    assert_eq!(c.ptr, a.ptr);
}

#[rstest]
#[case(1, PoolKind::Small)]
#[case(MIB, PoolKind::Small)]
#[case(MIB + 1, PoolKind::Large)]
fn small_and_large_pools_do_not_mix(#[case] bytes: usize, #[case] pool: PoolKind) {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    // A freed 20 MiB large segment never serves a small request, and vice versa.
    let large = alloc(&mut pools, &mut next, S1, 5 * MIB);
    let small = alloc(&mut pools, &mut next, S1, 4096);
    pools.free(large.id, large.ptr).unwrap();
    pools.free(small.id, small.ptr).unwrap();
    pools.flush_stash();
    let grant = alloc(&mut pools, &mut next, S1, bytes);
    let expected = match pool {
        PoolKind::Small => small.ptr,
        PoolKind::Large => large.ptr,
    };
    assert_eq!(grant.ptr, expected);
    assert_eq!(pools.stats().cache_hits, 1);
}

#[test]
fn pending_blocks_are_neither_reused_nor_merged() {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    let a = alloc(&mut pools, &mut next, S1, 4096);
    let b = alloc(&mut pools, &mut next, S1, 4096);
    pools.free_to_pending(a.id, a.ptr).unwrap();
    pools.check_invariants();
    assert_eq!(pools.stats().allocated_bytes.current, 4096);
    assert_eq!(pools.stats().active_bytes.current, 8192);
    pools.free(b.id, b.ptr).unwrap();
    pools.check_invariants();
    let c = alloc(&mut pools, &mut next, S1, 4096);
    assert_eq!(c.ptr, b.ptr, "the pending block below is skipped");
    pools.free(c.id, c.ptr).unwrap();
    pools.flush_stash();
    pools.release_pending(a.id);
    pools.check_invariants();
    assert_eq!(
        pools.free_blocks(),
        1,
        "released, it merges with its free neighbour"
    );
    assert_eq!(pools.stats().active_bytes.current, 0);
}

#[test]
fn freeing_twice_or_a_stale_id_is_a_typed_error() {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    let a = alloc(&mut pools, &mut next, S1, 4096);
    pools.free(a.id, a.ptr).unwrap();
    assert!(matches!(
        pools.free(a.id, a.ptr),
        Err(MemoryError::UnknownAllocation { ptr, .. }) if ptr == a.ptr
    ));
    assert!(pools.free(999, 0).is_err());
    pools.check_invariants();
}

#[test]
fn only_whole_free_segments_are_released() {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    let kept = alloc(&mut pools, &mut next, S1, 4096);
    let large = alloc(&mut pools, &mut next, S1, 30 * MIB);
    pools.free(large.id, large.ptr).unwrap();
    let segments = pools.take_free_segments();
    assert_eq!(segments.len(), 1, "the small segment is split and in use");
    assert_eq!(segments[0].size, 30 * MIB);
    pools.check_invariants();
    assert_eq!(pools.stats().reserved_bytes.current, SMALL_SEGMENT);
    assert_eq!(pools.stats().segments_released, 1);
    pools.free(kept.id, kept.ptr).unwrap();
    assert_eq!(pools.take_free_segments().len(), 1);
    assert_eq!(pools.stats().reserved_bytes.current, 0);
}

#[rstest]
#[case::no_split_limit(None)]
#[case::max_split_size_24_mib(Some(24 * MIB))]
fn random_workloads_keep_every_invariant_and_balance(#[case] max_split: Option<usize>) {
    let mut pools = Pools::default();
    if let Some(bytes) = max_split {
        pools.set_max_split(bytes);
    }
    let mut next = 0x1000_0000;
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut live: Vec<Grant> = Vec::new();
    for _ in 0..4000 {
        if live.is_empty() || random() % 3 != 0 {
            let stream = StreamKey::from_raw(1 + (random() % 3) as usize);
            let bytes = match random() % 4 {
                0 => 1 + (random() % 4096) as usize,
                1 => 1 + (random() % MIB as u64) as usize,
                2 => MIB + 1 + (random() % (12 * MIB as u64)) as usize,
                _ => 1 + (random() % (40 * MIB as u64)) as usize,
            };
            live.push(alloc(&mut pools, &mut next, stream, bytes));
        } else {
            let grant = live.swap_remove((random() % live.len() as u64) as usize);
            pools.free(grant.id, grant.ptr).unwrap();
            pools.check_invariants();
        }
    }
    for grant in live.drain(..) {
        pools.free(grant.id, grant.ptr).unwrap();
    }
    pools.check_invariants();
    let reserved = pools.stats().reserved_bytes.current;
    let released: usize = pools.take_free_segments().iter().map(|s| s.size).sum();
    assert_eq!(released, reserved, "every segment merged back whole");
    let stats = pools.stats();
    assert_eq!(stats.allocations, stats.frees);
    assert_eq!(stats.allocations, stats.cache_hits + stats.cache_misses);
    assert_eq!(
        (
            stats.allocated_bytes.current,
            stats.active_bytes.current,
            stats.requested_bytes.current
        ),
        (0, 0, 0)
    );
    assert_eq!(
        (stats.reserved_bytes.current, stats.segments.current),
        (0, 0)
    );
}

#[test]
fn a_snapshot_lists_each_segment_with_its_blocks_in_address_order() {
    use crate::caching::snapshot::{BlockStatus, MemorySnapshot};

    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    let s2 = StreamKey::from_raw(2);
    let a = alloc(&mut pools, &mut next, S1, 512 * 1024);
    let b = alloc(&mut pools, &mut next, S1, 500 * 1024);
    let c = alloc(&mut pools, &mut next, S1, 512 * 1024);
    let large = alloc(&mut pools, &mut next, s2, 3 * MIB);
    pools.free(a.id, a.ptr).unwrap();
    pools.free_to_pending(c.id, c.ptr).unwrap();
    let mut segments = Vec::new();
    pools.snapshot_segments(&mut segments);
    segments.sort_unstable_by_key(|segment| segment.address);
    let snapshot = MemorySnapshot { segments };

    assert_eq!(snapshot.segments.len(), 2);
    let small = &snapshot.segments[0];
    assert_eq!(
        (small.address, small.total_size, small.stream, small.pool),
        (a.ptr, SMALL_SEGMENT, S1, PoolKind::Small)
    );
    let blocks: Vec<_> = small
        .blocks
        .iter()
        .map(|block| {
            (
                block.address,
                block.size,
                block.requested_size,
                block.status,
            )
        })
        .collect();
    let rest = SMALL_SEGMENT - 2 * 512 * 1024 - b.size;
    assert_eq!(
        blocks,
        [
            (a.ptr, 512 * 1024, 0, BlockStatus::Free),
            (b.ptr, b.size, 500 * 1024, BlockStatus::Allocated),
            (c.ptr, 512 * 1024, 0, BlockStatus::PendingFree),
            (c.ptr + 512 * 1024, rest, 0, BlockStatus::Free),
        ]
    );
    assert_eq!(small.graph_pool, None);
    let big = &snapshot.segments[1];
    assert_eq!(
        (big.address, big.stream, big.pool),
        (large.ptr, s2, PoolKind::Large)
    );
    assert_eq!(big.allocated_size(), large.size);

    assert_eq!(
        snapshot.reserved_bytes(),
        pools.stats().reserved_bytes.current
    );
    assert_eq!(snapshot.bytes(BlockStatus::Allocated), b.size + large.size);
    assert_eq!(snapshot.bytes(BlockStatus::PendingFree), 512 * 1024);
    assert_eq!(
        snapshot.largest_free_block(),
        rest.max(512 * 1024).max(big.total_size - large.size)
    );
    assert_eq!(
        snapshot.split_segments(),
        1 + usize::from(big.total_size > large.size)
    );
    let summary = snapshot.to_string();
    assert!(
        summary.starts_with(&format!(
            "2 segments, {} blocks: reserved {} bytes",
            4 + big.blocks.len(),
            snapshot.reserved_bytes()
        )),
        "{summary}"
    );
    assert!(
        summary.contains(&format!(
            "[524288 free] [{} allocated] [524288 pending] [{rest} free]",
            b.size
        )),
        "{summary}"
    );

    // Back to whole segments once everything is free: nothing split, nothing allocated.
    pools.release_pending(c.id);
    pools.free(b.id, b.ptr).unwrap();
    pools.free(large.id, large.ptr).unwrap();
    // (A block freed whole may be parked for an exact-size reuse: free, but not merged yet.)
    pools.flush_stash();
    let mut segments = Vec::new();
    pools.snapshot_segments(&mut segments);
    let snapshot = MemorySnapshot { segments };
    assert!(
        snapshot
            .segments
            .iter()
            .all(|segment| segment.blocks.len() == 1)
    );
    assert_eq!(snapshot.bytes(BlockStatus::Free), snapshot.reserved_bytes());
    assert_eq!(snapshot.split_segments(), 0);
}

/// PyTorch's `max_split_size_mb:64`: a 200 MiB block freed by one step is not carved up by the
/// next step's 30 MiB requests (they get segments of their own), a 190 MiB request takes it
/// whole (within 20 MiB), a 100 MiB one does not (it would waste 100 MiB), and an oversize
/// block is handed out whole, never split.
#[test]
fn max_split_size_keeps_large_blocks_whole_and_for_large_requests() {
    let mut pools = Pools::default();
    pools.set_max_split(64 * MIB);
    let mut next = 0x1000_0000;
    let big = alloc(&mut pools, &mut next, S1, 200 * MIB);
    assert_eq!(big.size, 200 * MIB);
    pools.free(big.id, big.ptr).unwrap();
    pools.check_invariants();

    let small = alloc(&mut pools, &mut next, S1, 30 * MIB);
    assert_ne!(
        small.ptr, big.ptr,
        "a request below the limit never splits an oversize block"
    );
    assert_eq!(pools.stats().segments.current, 2);

    let rounded = round_size(100 * MIB).unwrap();
    assert!(
        pools.take_free(S1, rounded, 100 * MIB).is_none(),
        "a 200 MiB block is more than 20 MiB too large for a 100 MiB request"
    );

    let near = alloc(&mut pools, &mut next, S1, 190 * MIB);
    assert_eq!(
        near.ptr, big.ptr,
        "within 20 MiB, the oversize block is reused"
    );
    assert_eq!(
        near.size,
        200 * MIB,
        "whole: the 10 MiB left over is not split off"
    );
    assert_eq!(pools.stats().segments.current, 2);
    for grant in [near, small] {
        pools.free(grant.id, grant.ptr).unwrap();
    }
    pools.check_invariants();
}

/// Without a limit, the same 200 MiB block serves a 30 MiB request by splitting (the default,
/// PyTorch's too).
#[test]
fn without_max_split_size_large_blocks_split_for_any_large_request() {
    let mut pools = Pools::default();
    let mut next = 0x1000_0000;
    let big = alloc(&mut pools, &mut next, S1, 200 * MIB);
    pools.free(big.id, big.ptr).unwrap();
    let small = alloc(&mut pools, &mut next, S1, 30 * MIB);
    assert_eq!(small.ptr, big.ptr);
    assert_eq!(small.size, 30 * MIB);
    assert_eq!(pools.stats().segments.current, 1);
    pools.free(small.id, small.ptr).unwrap();
    pools.check_invariants();
}
