//! A fourth look at programs written the way PyTorch caching-allocator users and RAPIDS RMM users
//! write them, aimed at what the earlier program files leave out:
//!
//! - one stream walking every pool boundary: 1 MiB requests that halve a small segment, a
//!   1 MiB + 1 B request that must not take the freed small segment, three blocks split off one
//!   20 MiB segment and freed middle first, then a 12 MiB request that PyTorch serves from the
//!   merged segment instead of asking the driver;
//! - `set_per_process_memory_fraction`-style budgets: a request on one stream that only fits
//!   once another stream's cache is given back (across shards), a refused request that must
//!   change no book, ten thousand refused requests that must leak nothing, and four threads whose
//!   live demand fits the budget (PyTorch's retry runs under one lock: none of them ever OOMs);
//! - a hundred thousand requests of a hundred odd sizes (more than the stash has buckets) in a
//!   sliding window: live blocks never overlap and the reserve stays at a couple of segments;
//! - `torch.cuda.memory_stats()` polled by a monitor thread while workers churn with
//!   `record_stream`: every snapshot reconciles;
//! - `record_stream` of the allocating stream and of one stream twice, then an explicit `free`;
//! - one-element buffers of one byte and of a three-byte element, of every kind, through views.
//!
//! Every test takes the serial guard: some hold a stream behind a gate and others synchronise
//! the device (`cuMemFree`), which must not meet.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cuweave_driver::{Context, Event, EventFlags, Stream, StreamFlags};
use cuweave_memory::{
    Buffer, CachedAllocation, CachingAllocator, DeviceBuffer, DriverResource, LimitAdaptor,
    MemoryError, MemoryStats, PinnedBuffer, StatisticsAdaptor, StreamKey, UnifiedBuffer,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

#[allow(dead_code)] // `counter` is for watch kernels, which these tests do not use
mod common;
use common::read_u32;

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

type Budgeted = StatisticsAdaptor<LimitAdaptor<DriverResource>>;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// A 64-bit LCG: the same "random" program on every run.
fn next(state: &mut u64) -> usize {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (*state >> 33) as usize
}

/// A driver resource under a `cap`, counted: RMM's `statistics(limiting(cuda))`.
fn budgeted(context: &Arc<Context>, cap: usize) -> Arc<Budgeted> {
    Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        DriverResource::new(context),
        cap,
    )))
}

/// Queues `value` into every whole `u32` of `block` on `stream`.
fn fill_block(kernels: &TestKernels, block: &CachedAllocation, value: u32, stream: &Stream) {
    let words = block.size() / 4;
    assert!(words > 0, "fill_block needs at least one word");
    // SAFETY: the block is live device memory of at least `size` bytes for as long as `block`
    // lives, and it is freed in `stream`'s order behind this kernel.
    unsafe { kernels.fill_u32(stream, block.ptr(), value, words) }.expect("fill kernel");
}

/// The first and last whole `u32` of `block` (the caller has synchronised its writers).
fn ends(context: &Context, block: &CachedAllocation) -> (u32, u32) {
    let last = block.ptr() + ((block.size() / 4 - 1) * 4) as u64;
    (read_u32(context, block.ptr()), read_u32(context, last))
}

/// Whether `[a, a + a_len)` and `[b, b + b_len)` share a byte.
fn overlaps(a: u64, a_len: usize, b: u64, b_len: usize) -> bool {
    a < b + b_len as u64 && b < a + a_len as u64
}

/// The books any one snapshot must satisfy, whatever runs concurrently.
fn assert_consistent(stats: &MemoryStats, what: &str) {
    assert!(
        stats.requested_bytes.current <= stats.allocated_bytes.current,
        "{what}: requested exceeds allocated: {stats:?}"
    );
    assert!(
        stats.allocated_bytes.current <= stats.active_bytes.current,
        "{what}: allocated exceeds active: {stats:?}"
    );
    assert!(
        stats.active_bytes.current <= stats.reserved_bytes.current,
        "{what}: active exceeds reserved: {stats:?}"
    );
    assert!(
        stats.frees <= stats.allocations,
        "{what}: more frees than allocations: {stats:?}"
    );
    assert_eq!(
        stats.cache_hits + stats.cache_misses,
        stats.allocations,
        "{what}: every allocation is a hit or a miss: {stats:?}"
    );
    for (name, stat) in [
        ("allocated", stats.allocated_bytes),
        ("requested", stats.requested_bytes),
        ("reserved", stats.reserved_bytes),
        ("active", stats.active_bytes),
        ("segments", stats.segments),
    ] {
        assert!(
            stat.current <= stat.peak,
            "{what}: {name} above its peak: {stats:?}"
        );
    }
    assert!(
        stats.segments.current * 2 * MIB <= stats.reserved_bytes.current,
        "{what}: a segment is at least 2 MiB: {stats:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Pool boundaries, splitting and merging on one stream
// ---------------------------------------------------------------------------------------------

/// One stream walks the size table the way a model's first steps do:
///
/// - two 1 MiB tensors halve one 2 MiB small segment; a 1 B one takes a 512 B block of another;
/// - after both halves are freed, a 1 MiB + 1 B tensor (the large pool) must not take the now
///   wholly free small segment: it gets a 20 MiB segment of its own;
/// - 3 MiB and 5 MiB tensors are split off that segment right behind it; freed middle first,
///   then first, then last, the four pieces merge, so a 12 MiB tensor (which would get a 12 MiB
///   segment of its own on a miss) is carved from the segment's start with no driver call, and
///   an 8 MiB one takes the exact rest;
/// - a 2 MiB tensor (large) is split off a new large segment, never off the free small one, and
///   a 1 MiB tensor best-fits into the 1 B tensor's segment, the smallest free block that fits.
///
/// Every live block is then filled with its own value on the device and read back at both ends,
/// and the books match: 4 segments (2 + 2 + 20 + 20 MiB) and the upstream saw 4 allocations.
#[test]
fn one_stream_walking_every_pool_boundary_splits_merges_and_never_mixes_pools() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let counted = Arc::new(StatisticsAdaptor::new(DriverResource::new(context)));
    let allocator = CachingAllocator::new(counted.clone());
    let s = stream(context);

    let a = allocator.allocate(MIB, &s).expect("a");
    let b = allocator.allocate(MIB, &s).expect("b");
    assert_eq!((a.block_size(), b.block_size()), (MIB, MIB));
    assert_eq!(
        b.ptr(),
        a.ptr() + MIB as u64,
        "two 1 MiB halves of one segment"
    );
    let small_segment = a.ptr();
    let tiny = allocator.allocate(1, &s).expect("1 B");
    assert_eq!(tiny.block_size(), 512);
    assert!(
        !overlaps(tiny.ptr(), 512, small_segment, 2 * MIB),
        "the full segment cannot hold the 1 B tensor"
    );
    assert_eq!(allocator.stats().segments.current, 2);
    drop(a);
    drop(b);

    let d = allocator.allocate(MIB + 1, &s).expect("1 MiB + 1 B");
    assert_eq!(
        d.block_size(),
        MIB + 512,
        "rounded to 512 B, in the large pool"
    );
    assert!(
        !overlaps(d.ptr(), d.block_size(), small_segment, 2 * MIB),
        "a large request was carved from a small segment"
    );
    let large_segment = d.ptr();
    let e = allocator.allocate(3 * MIB, &s).expect("3 MiB");
    let f = allocator.allocate(5 * MIB, &s).expect("5 MiB");
    assert_eq!(
        e.ptr(),
        d.ptr() + (MIB + 512) as u64,
        "split right behind d"
    );
    assert_eq!(f.ptr(), e.ptr() + (3 * MIB) as u64, "split right behind e");
    assert_eq!(allocator.stats().segments.current, 3);
    drop(e);
    drop(d);
    drop(f);

    let g = allocator.allocate(12 * MIB, &s).expect("12 MiB");
    assert_eq!(
        g.ptr(),
        large_segment,
        "the merged 20 MiB segment serves 12 MiB from its start without a driver call"
    );
    assert_eq!(g.block_size(), 12 * MIB);
    let h = allocator.allocate(8 * MIB, &s).expect("8 MiB");
    assert_eq!(h.ptr(), large_segment + (12 * MIB) as u64, "the exact rest");
    assert_eq!(allocator.stats().segments.current, 3);
    assert_eq!(counted.stats().total_allocations, 3);

    let i = allocator.allocate(MIB + 512, &s).expect("1 MiB + 512 B");
    let j = allocator.allocate(2 * MIB, &s).expect("2 MiB");
    assert_eq!(allocator.stats().segments.current, 4, "a new large segment");
    assert_eq!(j.ptr(), i.ptr() + (MIB + 512) as u64, "split behind i");
    for (name, block) in [("i", &i), ("j", &j)] {
        assert!(
            !overlaps(block.ptr(), block.block_size(), small_segment, 2 * MIB),
            "{name}: a large block came from the free small segment"
        );
    }
    let k = allocator.allocate(MIB, &s).expect("1 MiB again");
    assert_eq!(
        k.ptr(),
        tiny.ptr() + 512,
        "best fit: the 2 MiB - 512 B rest beside the 1 B tensor, not the whole free segment"
    );

    let live = [
        (&tiny, 0x7100_0001u32),
        (&g, 0x7100_0002),
        (&h, 0x7100_0003),
        (&i, 0x7100_0004),
        (&j, 0x7100_0005),
        (&k, 0x7100_0006),
    ];
    for (x, (p, _)) in live.iter().enumerate() {
        for (q, _) in &live[x + 1..] {
            assert!(
                !overlaps(p.ptr(), p.block_size(), q.ptr(), q.block_size()),
                "live blocks {:#x}+{} and {:#x}+{} overlap",
                p.ptr(),
                p.block_size(),
                q.ptr(),
                q.block_size()
            );
        }
    }
    // The 1 B tensor's whole 512 B block is usable: fill it as 128 words.
    // SAFETY: the block holds 512 bytes (block_size) for as long as `tiny` lives.
    unsafe { kernels.fill_u32(&s, tiny.ptr(), live[0].1, 128) }.expect("fill tiny");
    for (block, value) in &live[1..] {
        fill_block(&kernels, block, *value, &s);
    }
    s.synchronize().expect("sync");
    assert_eq!(read_u32(context, tiny.ptr() + 508), live[0].1);
    for (block, value) in &live[1..] {
        assert_eq!(
            ends(context, block),
            (*value, *value),
            "block {:#x}",
            block.ptr()
        );
    }

    let stats = allocator.stats();
    assert_consistent(&stats, "boundaries");
    let blocks = [512, 12 * MIB, 8 * MIB, MIB + 512, 2 * MIB, MIB];
    let asked = [1, 12 * MIB, 8 * MIB, MIB + 512, 2 * MIB, MIB];
    assert_eq!(stats.allocated_bytes.current, blocks.iter().sum::<usize>());
    assert_eq!(stats.requested_bytes.current, asked.iter().sum::<usize>());
    assert_eq!(stats.reserved_bytes.current, 44 * MIB);
    assert_eq!((stats.segments.current, stats.cache_misses), (4, 4));
    assert_eq!((stats.allocations, stats.frees), (11, 5));
    assert_eq!(counted.stats().total_allocations, 4);
    assert_eq!(counted.stats().current_bytes, 44 * MIB);
}

// ---------------------------------------------------------------------------------------------
// Budgets: the out-of-memory retry across streams, refusals, and threads
// ---------------------------------------------------------------------------------------------

/// Under a 22 MiB budget, stream 1 holds a 512 B tensor (a 2 MiB segment) and a 3 MiB one (a
/// 20 MiB segment). A 1 MiB + 1 B request on stream 2 (another shard) needs a 20 MiB segment:
/// refused with the cap named, after one retry, and the refusal changes nothing else: no
/// reserved byte, no allocation, no release, and both tensors keep their bytes. Once stream 1
/// frees its 3 MiB tensor the same request succeeds: the retry gives stream 1's wholly free
/// segment back (PyTorch's `free_cached_blocks` covers every stream) and the budget is exactly
/// full again. Emptying the cache at the end gives back every byte of the budget.
#[test]
fn a_request_on_one_stream_is_served_by_giving_back_another_streams_cache_and_a_refusal_changes_no_book()
 {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    const CAP: usize = 22 * MIB;
    let counted = budgeted(context, CAP);
    let allocator = CachingAllocator::new(counted.clone());
    let (s1, s2) = (stream(context), stream(context));
    let shard = |s: &Stream| StreamKey::of(s).as_usize() & (allocator.shards() - 1);
    assert_ne!(shard(&s1), shard(&s2), "consecutive streams share a shard");

    let x = allocator.allocate(512, &s1).expect("x");
    let y = allocator.allocate(3 * MIB, &s1).expect("y");
    fill_block(&kernels, &x, 0x0000_1111, &s1);
    fill_block(&kernels, &y, 0x0000_2222, &s1);
    assert_eq!(counted.upstream().used(), CAP);

    let before = allocator.stats();
    let refused = allocator.allocate(MIB + 1, &s2);
    match refused {
        Err(MemoryError::OutOfMemory {
            requested,
            allocated,
            reserved,
            limit,
        }) => {
            assert!(
                (MIB + 1..=MIB + 512).contains(&requested),
                "requested {requested}"
            );
            assert_eq!(allocated, 512 + 3 * MIB);
            assert_eq!(reserved, CAP);
            assert_eq!(limit, Some(CAP), "the limit adaptor's cap is named");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let after = allocator.stats();
    let expected = MemoryStats {
        oom_retries: before.oom_retries + 1,
        ooms: before.ooms + 1,
        ..before
    };
    assert_eq!(after, expected, "a refusal changed the books");
    assert!(counted.stats().failed_allocations >= 1);
    assert_eq!(counted.stats().current_allocations, 2);
    s1.synchronize().expect("sync s1");
    assert_eq!(ends(context, &x), (0x0000_1111, 0x0000_1111));
    assert_eq!(ends(context, &y), (0x0000_2222, 0x0000_2222));

    drop(y);
    let z = allocator
        .allocate(MIB + 1, &s2)
        .expect("served once stream 1's free segment goes back");
    assert_eq!(z.stream(), StreamKey::of(&s2));
    let stats = allocator.stats();
    assert_eq!(
        (stats.oom_retries, stats.ooms, stats.segments_released),
        (2, 1, 1)
    );
    assert_eq!(
        (stats.segments.current, stats.reserved_bytes.current),
        (2, CAP)
    );
    assert_eq!(counted.upstream().used(), CAP);
    assert_consistent(&stats, "after the retry");
    fill_block(&kernels, &z, 0x0000_3333, &s2);
    s2.synchronize().expect("sync s2");
    assert_eq!(ends(context, &z), (0x0000_3333, 0x0000_3333));
    assert_eq!(ends(context, &x), (0x0000_1111, 0x0000_1111), "x untouched");

    drop((x, z));
    let released = allocator.empty_cache().expect("empty cache");
    assert_eq!(released, CAP);
    assert_eq!(counted.upstream().used(), 0);
    assert_eq!(counted.stats().current_bytes, 0);
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

/// Ten thousand requests that can never be served (over the budget, zero bytes, an element
/// count whose bytes overflow) in a loop, as a retrying data loader would make them: each is a
/// typed error, never a panic, and nothing accumulates: the one live tensor keeps its bytes, the
/// budget's use and the upstream's outstanding allocations stay what they were, every over-budget
/// request is counted once as a retry and once as an OOM, and a request that fits afterwards is
/// served.
#[test]
fn ten_thousand_refused_requests_leak_nothing_and_leave_the_budget_usable() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    const CAP: usize = 64 * MIB;
    const ROUNDS: usize = 10_000;
    let counted = budgeted(context, CAP);
    let allocator = CachingAllocator::new(counted.clone());
    let s = stream(context);
    let live = allocator.allocate(3 * MIB, &s).expect("live");
    fill_block(&kernels, &live, 0x4C49_5645, &s);

    for round in 0..ROUNDS {
        match allocator.allocate(100 * MIB, &s) {
            Err(MemoryError::OutOfMemory {
                requested, limit, ..
            }) => {
                assert_eq!((requested, limit), (100 * MIB, Some(CAP)), "round {round}");
            }
            other => panic!("round {round}: expected OutOfMemory, got {other:?}"),
        }
        match allocator.allocate(0, &s) {
            Err(MemoryError::ZeroLength { .. }) => {}
            other => panic!("round {round}: expected ZeroLength, got {other:?}"),
        }
        let overflowing = allocator.buffer::<u64>(usize::MAX / 4, &s);
        assert!(
            overflowing.is_err(),
            "round {round}: an element count of usize::MAX / 4 u64s was served"
        );
    }

    let stats = allocator.stats();
    assert_eq!(
        (stats.oom_retries, stats.ooms),
        (ROUNDS as u64, ROUNDS as u64)
    );
    assert_eq!((stats.allocations, stats.frees), (1, 0));
    assert_eq!(
        (stats.segments.current, stats.reserved_bytes.current),
        (1, 20 * MIB)
    );
    assert_consistent(&stats, "after the refusals");
    assert_eq!(counted.upstream().used(), 20 * MIB);
    assert_eq!(
        (
            counted.stats().current_allocations,
            counted.stats().total_allocations
        ),
        (1, 1)
    );

    let fits = allocator
        .allocate(40 * MIB, &s)
        .expect("40 MiB fits the budget");
    fill_block(&kernels, &fits, 0x0F17_0F17, &s);
    s.synchronize().expect("sync");
    assert_eq!(ends(context, &fits), (0x0F17_0F17, 0x0F17_0F17));
    assert_eq!(ends(context, &live), (0x4C49_5645, 0x4C49_5645));
    assert_eq!(counted.upstream().used(), 60 * MIB);
}

/// Four worker threads, each on its own stream, each holding at most one tensor at a time:
/// mostly 2–9 MiB (a 20 MiB segment), every fourth one small (a 2 MiB segment). The budget is
/// 80 MiB, exactly four 20 MiB segments, so the live demand always fits (at most three other
/// live tensors, each in one segment, plus the new one). Cached segments do not fit all at once,
/// so workers keep running into the out-of-memory retry and giving back each other's caches.
/// PyTorch runs that retry under its allocator's one mutex and never fails such a program; every
/// request here must be served too, and every tensor must hold its own fill at both ends.
#[test]
fn four_threads_whose_live_demand_fits_the_budget_are_never_refused() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    const WORKERS: usize = 4;
    const STEPS: usize = 300;
    const CAP: usize = WORKERS * 20 * MIB;
    let counted = budgeted(context, CAP);
    let allocator = CachingAllocator::new(counted.clone());

    let refusals: Vec<Vec<String>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..WORKERS)
            .map(|worker| {
                let (allocator, kernels) = (&allocator, &kernels);
                scope.spawn(move || {
                    let s = stream(context);
                    let mut rng = 0x5EED_0000 + worker as u64;
                    let mut refusals = Vec::new();
                    for step in 0..STEPS {
                        let bytes = if step % 4 == 3 {
                            4 * (1 + next(&mut rng) % (MIB / 4))
                        } else {
                            2 * MIB + 4 * (next(&mut rng) % (7 * MIB / 4))
                        };
                        let block = match allocator.allocate(bytes, &s) {
                            Ok(block) => block,
                            Err(error) => {
                                refusals.push(format!("worker {worker} step {step}: {error}"));
                                continue;
                            }
                        };
                        let tag = ((worker as u32) << 24) | step as u32;
                        fill_block(kernels, &block, tag, &s);
                        s.synchronize().expect("sync worker");
                        assert_eq!(
                            ends(context, &block),
                            (tag, tag),
                            "worker {worker} step {step}: another tensor wrote this one"
                        );
                    }
                    refusals
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().expect("worker panicked"))
            .collect()
    });

    let stats = allocator.stats();
    let refusals: Vec<String> = refusals.into_iter().flatten().collect();
    assert!(
        refusals.is_empty(),
        "{} of {} requests refused although the live demand never exceeded the budget \
         ({} retries); first: {}",
        refusals.len(),
        WORKERS * STEPS,
        stats.oom_retries,
        refusals[0]
    );
    assert_eq!(stats.ooms, 0);
    assert_eq!(stats.allocations, (WORKERS * STEPS) as u64);
    assert_eq!(stats.frees, stats.allocations);
    assert_consistent(&stats, "after the workers");
    assert!(counted.upstream().used() <= CAP);
    allocator.empty_cache().expect("empty cache");
    assert_eq!(counted.upstream().used(), 0);
}

// ---------------------------------------------------------------------------------------------
// Long loops and stats under churn
// ---------------------------------------------------------------------------------------------

/// A hundred thousand requests on one stream, of a hundred odd sizes from 1 B to about 50 KiB
/// (more distinct sizes than the stash has buckets, so parked blocks keep being evicted and
/// merged), each kept alive for the next fifteen requests. No two live blocks ever share a
/// byte, at most about 800 KiB is live, and the reserve stays at one or two 2 MiB segments however
/// long the loop runs; at the end every allocation has been freed and the books are at zero.
#[test]
fn a_hundred_thousand_odd_sized_requests_in_a_window_never_overlap_and_keep_the_reserve_small() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    const ROUNDS: usize = 100_000;
    const WINDOW: usize = 16;
    let sizes: Vec<usize> = (0..100).map(|i| 1 + i * 509 + (i % 7) * 3).collect();
    let allocator = CachingAllocator::with_driver(context);
    let s = stream(context);
    let mut window: VecDeque<CachedAllocation> = VecDeque::with_capacity(WINDOW + 1);
    let mut rng = 0xD00D_u64;

    for round in 0..ROUNDS {
        let bytes = sizes[next(&mut rng) % sizes.len()];
        let block = allocator.allocate(bytes, &s).expect("allocate");
        assert_eq!(block.size(), bytes);
        assert!(block.block_size() >= bytes && block.block_size().is_multiple_of(512));
        if let Some(other) = window.iter().find(|other| {
            overlaps(
                other.ptr(),
                other.block_size(),
                block.ptr(),
                block.block_size(),
            )
        }) {
            panic!(
                "round {round}: {:#x}+{} overlaps the live {:#x}+{}",
                block.ptr(),
                block.block_size(),
                other.ptr(),
                other.block_size()
            );
        }
        window.push_back(block);
        if window.len() > WINDOW {
            window.pop_front();
        }
    }
    let stats = allocator.stats();
    assert_consistent(&stats, "in the loop");
    // One segment suffices: with at most 16 blocks of at most ~50 KiB live, the ~1.2 MiB left
    // free in a 2 MiB segment spread over at most 17 holes leaves one of over 70 KiB.
    assert!(
        stats.segments.peak <= 2,
        "at most ~800 KiB live, yet {} segments were reserved: {stats:?}",
        stats.segments.peak
    );
    assert_eq!(stats.cache_misses as usize, stats.segments.current);
    window.clear();
    let stats = allocator.stats();
    assert_eq!(
        (stats.allocations, stats.frees),
        (ROUNDS as u64, ROUNDS as u64)
    );
    assert_eq!(
        (
            stats.allocated_bytes.current,
            stats.requested_bytes.current,
            stats.active_bytes.current
        ),
        (0, 0, 0)
    );
}

/// A monitor thread polls `stats()` as fast as it can while four workers churn: mixed sizes on
/// their own streams, up to three tensors alive each, and one in three read on a shared reader
/// stream behind an event and freed with `record_stream` while that read (a short spin) may
/// still run, so blocks keep passing through the pending list. Every snapshot must reconcile
/// (requested <= allocated <= active <= reserved, each hit or miss counted once, no current
/// above its peak); at the end every free has come back, `empty_cache` returns everything, and
/// the upstream's own counts match the allocator's misses and releases.
#[test]
fn stats_polled_while_four_threads_churn_through_record_stream_always_reconcile() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    const WORKERS: usize = 4;
    const STEPS: usize = 400;
    let counted = Arc::new(StatisticsAdaptor::new(DriverResource::new(context)));
    let allocator = CachingAllocator::new(counted.clone());
    let reader = Arc::new(stream(context));
    let done = AtomicBool::new(false);
    let finished = AtomicUsize::new(0);

    let snapshots = std::thread::scope(|scope| {
        let monitor = scope.spawn(|| {
            let mut snapshots = 0usize;
            while !done.load(Ordering::Acquire) {
                assert_consistent(&allocator.stats(), "monitor");
                snapshots += 1;
            }
            snapshots
        });
        let workers: Vec<_> = (0..WORKERS)
            .map(|worker| {
                let (allocator, kernels, reader) = (&allocator, &kernels, &reader);
                let finished = &finished;
                scope.spawn(move || {
                    let s = stream(context);
                    let mut rng = 0xC0FF_EE00 + worker as u64;
                    let mut live: VecDeque<CachedAllocation> = VecDeque::new();
                    for step in 0..STEPS {
                        let bytes = match next(&mut rng) % 8 {
                            0 => 2 * MIB + 4 * (next(&mut rng) % MIB),
                            _ => 4 * (1 + next(&mut rng) % (64 * KIB)),
                        };
                        let mut block = allocator.allocate(bytes, &s).expect("allocate");
                        fill_block(kernels, &block, step as u32, &s);
                        if step % 3 == 0 {
                            let filled =
                                Event::new(context, EventFlags::DISABLE_TIMING).expect("event");
                            filled.record(&s).expect("record");
                            reader.wait_event(&filled).expect("wait");
                            kernels.spin_ns(reader, 20_000).expect("read");
                            block.record_stream(reader).expect("record_stream");
                        }
                        live.push_back(block);
                        if live.len() > 3 {
                            live.pop_front();
                        }
                    }
                    live.clear();
                    s.synchronize().expect("sync worker");
                    finished.fetch_add(1, Ordering::Release);
                })
            })
            .collect();
        for worker in workers {
            worker.join().expect("worker panicked");
        }
        done.store(true, Ordering::Release);
        monitor.join().expect("monitor panicked")
    });
    assert_eq!(finished.load(Ordering::Acquire), WORKERS);
    assert!(snapshots > 0);

    reader.synchronize().expect("sync reader");
    let stats = allocator.stats();
    assert_consistent(&stats, "after the churn");
    assert_eq!(stats.allocations, (WORKERS * STEPS) as u64);
    assert_eq!(stats.frees, stats.allocations);
    assert_eq!(
        (stats.allocated_bytes.current, stats.requested_bytes.current),
        (0, 0)
    );
    let reserved = stats.reserved_bytes.current;
    let released = allocator.empty_cache().expect("empty cache");
    assert_eq!(released, reserved, "every segment was wholly free");
    let stats = allocator.stats();
    assert_eq!(allocator.pending_frees(), 0);
    assert_eq!(
        (
            stats.active_bytes.current,
            stats.reserved_bytes.current,
            stats.segments.current
        ),
        (0, 0, 0),
        "{stats:?}"
    );
    let upstream = counted.stats();
    assert_eq!(upstream.current_bytes, 0);
    assert_eq!(upstream.total_allocations, stats.cache_misses);
    assert_eq!(upstream.total_deallocations, stats.segments_released);
}

// ---------------------------------------------------------------------------------------------
// record_stream bookkeeping and an explicit free
// ---------------------------------------------------------------------------------------------

/// `t.record_stream(torch.cuda.current_stream())` on the allocating stream, and the same reader
/// stream recorded twice, are what careless code does: the first must add nothing and the second
/// must count once. The reader is held behind a gate, so after an explicit `free()` (which must
/// report success) the block is pending: active exceeds allocated by exactly its size, the next
/// request of its size on its stream gets another block, and once the gate opens and the reader
/// finishes, the request after that gets the original block back with no new segment.
#[test]
fn record_stream_of_the_home_stream_or_twice_counts_once_and_an_explicit_free_waits_for_the_reader()
{
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let home = Arc::new(stream(context));
    let reader = Arc::new(stream(context));
    const BYTES: usize = 64 * KIB + 1;

    let mut block = allocator.allocate(BYTES, &home).expect("block");
    assert_eq!(block.block_size(), 64 * KIB + 512);
    fill_block(&kernels, &block, 0x5A5A_5A5A, &home);
    let filled = Event::new(context, EventFlags::DISABLE_TIMING).expect("event");
    filled.record(&home).expect("record");
    reader.wait_event(&filled).expect("wait");
    let gate = Gate::new(context);
    gate.hold(&kernels, &reader);

    block.record_stream(&home).expect("record home");
    assert!(
        block.recorded_streams().is_empty(),
        "recording the allocating stream must add nothing"
    );
    block.record_stream(&reader).expect("record reader");
    block.record_stream(&reader).expect("record reader again");
    assert_eq!(
        block.recorded_streams().len(),
        1,
        "one reader, counted once"
    );

    let (old, size) = (block.ptr(), block.block_size());
    block.free().expect("an explicit free reports success");
    assert_eq!(allocator.pending_frees(), 1);
    let stats = allocator.stats();
    assert_eq!(
        stats.active_bytes.current - stats.allocated_bytes.current,
        size,
        "the pending block stays active: {stats:?}"
    );

    let next_block = allocator.allocate(BYTES, &home).expect("next");
    assert!(
        !reader.query().expect("query reader"),
        "the gate opened early: the test proves nothing"
    );
    assert_ne!(next_block.ptr(), old, "got a block the reader still holds");
    gate.open();
    reader.synchronize().expect("sync reader");

    let again = allocator.allocate(BYTES, &home).expect("again");
    assert_eq!(
        again.ptr(),
        old,
        "the block comes back once the reader is done"
    );
    assert_eq!(allocator.pending_frees(), 0);
    let stats = allocator.stats();
    assert_consistent(&stats, "after the reader");
    assert_eq!((stats.segments.current, stats.cache_misses), (1, 1));
    assert_eq!(stats.active_bytes.current, stats.allocated_bytes.current);
    assert_eq!(stats.allocated_bytes.current, 2 * size);
    home.synchronize().expect("sync home");
    assert_eq!(
        ends(context, &again).0,
        0x5A5A_5A5A,
        "nothing wrote it since"
    );
}

// ---------------------------------------------------------------------------------------------
// The smallest buffers of every kind
// ---------------------------------------------------------------------------------------------

/// One-element buffers, the shapes scalar outputs and loss values take: a `u8` on the device
/// (default cache), in pinned and in managed memory, copied into each other across two streams
/// with tracked ordering, and a three-byte element (`[u8; 3]`, an RGB pixel) filled through a
/// view. Each byte must come back exactly; views past the one element are typed errors.
#[test]
fn one_element_buffers_of_every_kind_round_trip_through_views_and_two_streams() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (s1, s2) = (stream(context), stream(context));

    let mut device = DeviceBuffer::<u8>::new_on(&s1, 1).expect("device");
    let mut pinned = PinnedBuffer::<u8>::new(context, 1).expect("pinned");
    let mut unified = UnifiedBuffer::<u8>::new(context, 1).expect("unified");
    device.fill_async(0xA5, &s1).expect("fill");
    pinned
        .copy_from_async(&device, &s1)
        .expect("device to pinned on s1");
    unified
        .copy_from_async(&pinned, &s2)
        .expect("pinned to managed on s2, after s1's copy");
    let mut back = DeviceBuffer::<u8>::new_on(&s2, 1).expect("back");
    back.copy_from_async(&unified, &s2)
        .expect("managed to device");
    assert_eq!(back.to_vec().expect("back"), vec![0xA5]);
    assert_eq!(&*pinned.as_slice().expect("pinned slice"), &[0xA5]);
    assert_eq!(&*unified.as_slice().expect("managed slice"), &[0xA5]);

    device
        .slice_mut(0..1)
        .expect("the one element")
        .fill_async(0x3C, &s2)
        .expect("view fill on s2");
    match device.slice(1..) {
        Err(MemoryError::ZeroLength { .. }) => {}
        other => panic!("an empty view past the end: {:?}", other.map(|v| v.len())),
    }
    match device.slice(0..2) {
        Err(MemoryError::OutOfRange { .. }) => {}
        other => panic!("a view past the end: {:?}", other.map(|v| v.len())),
    }
    assert_eq!(device.to_vec().expect("device"), vec![0x3C]);

    let mut pixel = DeviceBuffer::<[u8; 3]>::new_on(&s1, 1).expect("pixel");
    pixel.fill_async([0, 0, 0], &s1).expect("clear");
    pixel
        .slice_mut(..)
        .expect("whole")
        .fill_async([1, 2, 3], &s2)
        .expect("fill pixel on s2");
    let mut pixels = DeviceBuffer::<[u8; 3]>::new_on(&s1, 7).expect("pixels");
    pixels.fill_async([9, 9, 9], &s1).expect("fill pixels");
    pixels
        .slice_mut(6..)
        .expect("last pixel")
        .copy_from_async(&pixel, &s2)
        .expect("copy the pixel into the last one");
    pixels
        .slice_mut(3..4)
        .expect("middle pixel")
        .fill_async([7, 8, 9], &s1)
        .expect("fill the middle");
    assert_eq!(pixel.to_vec().expect("pixel"), vec![[1, 2, 3]]);
    assert_eq!(
        pixels.to_vec().expect("pixels"),
        vec![
            [9, 9, 9],
            [9, 9, 9],
            [9, 9, 9],
            [7, 8, 9],
            [9, 9, 9],
            [9, 9, 9],
            [1, 2, 3]
        ]
    );
}
