//! A third look at programs written the way PyTorch caching-allocator users and RAPIDS RMM users
//! write them, aimed at what the earlier program files leave out:
//!
//! - `torch.cuda.max_memory_allocated()` across two streams: exact with one shard, and the
//!   documented upper bound across shards; a stashed block reused for a smaller request counts
//!   the smaller request;
//! - two caches sharing one `limiting_resource_adaptor` (two libraries in one process under one
//!   budget), and a cap below one small segment;
//! - `x[:n]` and `x[n:]` written late by kernels on two streams, then `del x`;
//! - `torch.cuda.empty_cache()` from a monitoring thread while workers churn;
//! - ten thousand dynamic-shape steps under a tight budget, checked on the device;
//! - eight threads allocating on one shared stream and reading on their own;
//! - a caching allocator dropped before its buffers, the last one under a late writer;
//! - own pinned and managed buffers dropped under a copy still reading them;
//! - a host running ahead of its stream (no `.item()` per step), with and without a budget.
//!
//! Each test checks bytes (on the host or by a device checksum), kernel-observed ordering or
//! statistics that must reconcile exactly; they use private allocators, well under a GiB of
//! device memory and 8 MiB of managed memory, and take well under five seconds each. All take
//! the serial guard: several hold a stream behind a spin while the host checks what happened
//! meanwhile, and another test's `cuMemFree` or `empty_cache` (which wait for the device) on a
//! parallel thread could stall this host thread until the spin ends.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_memory::{
    Buffer, CachingAllocator, DeviceBuffer, DriverResource, LimitAdaptor, ManagedCapabilities,
    MemoryError, MemoryResource, PinnedBuffer, StatisticsAdaptor, StreamKey, UnifiedBuffer,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip};

#[path = "common/async_pool.rs"]
mod async_pool;
use async_pool::async_pool_or_skip;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const MS: u64 = 1_000_000;

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

/// Downloads the first and last (up to) 1024 elements of `buffer` on `stream` and checks that
/// each equals `value`.
fn check_ends(buffer: &DeviceBuffer<u32>, value: u32, stream: &Stream, what: &str) {
    let probe = buffer.len().min(1024);
    for offset in [0, buffer.len() - probe] {
        let host = buffer
            .copy_range_to_host_async(offset, vec![0u32; probe], stream)
            .expect("download")
            .wait()
            .expect("downloaded");
        if let Some(i) = host.iter().position(|&v| v != value) {
            panic!(
                "{what}: element {} is {:#x}, expected {value:#x}",
                offset + i,
                host[i]
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// memory_stats() across streams and shards
// ---------------------------------------------------------------------------------------------

/// The shard of `allocator` that holds `stream`'s blocks.
fn shard_of(allocator: &CachingAllocator, stream: &Stream) -> usize {
    StreamKey::of(stream).as_usize() & (allocator.shards() - 1)
}

/// `x = empty(32 MiB, s1); y = empty(16 MiB, s2); del x; del y; z = empty(32 MiB, s2); del z`,
/// then `reset_peak_memory_stats()`, `empty_cache()`, and a 1000 B tensor freed and followed by
/// a 600 B one. PyTorch reports `max_memory_allocated() == 48 MiB` (x and y at once). The
/// allocator documents its allocated / requested / active peaks as exact for one shard and the
/// sum of the shards' peaks across shards: with one shard they must be 48 MiB exactly, with the
/// default 32 shards (s1 and s2 in different shards) between 48 MiB and 32 + 32 = 64 MiB.
/// Reserved bytes and segments are exact either way (80 MiB: z cannot use s2's freed 16 MiB),
/// a statistics adaptor underneath agrees and resets its own peak, and the 600 B request served
/// from the stashed 1024 B block counts 600 requested bytes, not 1000.
#[test]
fn max_memory_allocated_across_two_streams_is_exact_in_one_shard_and_bounded_across_shards() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    for shards in [1, 32] {
        let counted = Arc::new(StatisticsAdaptor::new(DriverResource::new(context)));
        let allocator = CachingAllocator::with_shards(counted.clone(), shards);
        assert_eq!(allocator.shards(), shards);
        let s1 = stream(context);
        let mut s2 = stream(context);
        while shards > 1 && shard_of(&allocator, &s2) == shard_of(&allocator, &s1) {
            s2 = stream(context);
        }

        let x = allocator.allocate(32 * MIB, &s1).expect("x");
        let y = allocator.allocate(16 * MIB, &s2).expect("y");
        assert_eq!((x.block_size(), y.block_size()), (32 * MIB, 16 * MIB));
        drop(x);
        drop(y);
        let z = allocator.allocate(32 * MIB, &s2).expect("z");
        drop(z);

        let stats = allocator.stats();
        assert_eq!(
            (
                stats.allocations,
                stats.frees,
                stats.cache_hits,
                stats.cache_misses
            ),
            (3, 3, 0, 3),
            "{shards} shard(s): {stats:?}"
        );
        assert_eq!(
            (stats.reserved_bytes.current, stats.reserved_bytes.peak),
            (80 * MIB, 80 * MIB)
        );
        assert_eq!((stats.segments.current, stats.segments.peak), (3, 3));
        assert_eq!(
            (
                stats.allocated_bytes.current,
                stats.requested_bytes.current,
                stats.active_bytes.current
            ),
            (0, 0, 0)
        );
        let peaks = [
            stats.allocated_bytes.peak,
            stats.requested_bytes.peak,
            stats.active_bytes.peak,
        ];
        if shards == 1 {
            assert_eq!(
                peaks,
                [48 * MIB; 3],
                "one shard: the peaks are what was held at once"
            );
        } else {
            for peak in peaks {
                assert!(
                    (48 * MIB..=64 * MIB).contains(&peak),
                    "{shards} shards: a peak of {peak} B is outside [48 MiB, 64 MiB]"
                );
            }
            eprintln!(
                "max_memory_allocated over 2 streams in 2 of 32 shards: {} MiB (PyTorch: 48 MiB)",
                peaks[0] / MIB
            );
        }
        let upstream = counted.stats();
        assert_eq!(
            (
                upstream.current_bytes,
                upstream.peak_bytes,
                upstream.current_allocations,
                upstream.peak_allocations,
                upstream.total_allocations
            ),
            (80 * MIB, 80 * MIB, 3, 3, 3)
        );

        allocator.reset_peak();
        let stats = allocator.stats();
        assert_eq!(
            (
                stats.allocated_bytes.peak,
                stats.requested_bytes.peak,
                stats.active_bytes.peak,
                stats.reserved_bytes.peak,
                stats.segments.peak
            ),
            (0, 0, 0, 80 * MIB, 3),
            "reset_peak sets every peak to its current value"
        );
        assert_eq!(allocator.empty_cache().expect("empty_cache"), 80 * MIB);
        let stats = allocator.stats();
        assert_eq!(
            (stats.reserved_bytes.current, stats.reserved_bytes.peak),
            (0, 80 * MIB),
            "emptying keeps the peak until the next reset"
        );
        assert_eq!(stats.segments_released, 3);
        let upstream = counted.stats();
        assert_eq!(
            (
                upstream.current_bytes,
                upstream.total_deallocations,
                upstream.peak_bytes
            ),
            (0, 3, 80 * MIB)
        );
        counted.reset_peak();
        allocator.reset_peak();
        let upstream = counted.stats();
        assert_eq!((upstream.peak_bytes, upstream.peak_allocations), (0, 0));
        assert_eq!(allocator.stats().reserved_bytes.peak, 0);

        // A small tensor freed, then a smaller one of the same 512 B class: the stash hands the
        // same block back, and the books count what was asked for this time.
        let a = allocator.allocate(1000, &s1).expect("1000 B");
        assert_eq!((a.size(), a.block_size()), (1000, 1024));
        let a_ptr = a.ptr();
        drop(a);
        let b = allocator.allocate(600, &s1).expect("600 B");
        assert_eq!(
            (b.ptr(), b.size(), b.block_size()),
            (a_ptr, 600, 1024),
            "the stashed block comes back for the smaller request"
        );
        let c = allocator.allocate(1024, &s1).expect("1024 B");
        assert_ne!(c.ptr(), b.ptr());
        let stats = allocator.stats();
        assert_eq!(
            (
                stats.allocated_bytes.current,
                stats.requested_bytes.current,
                stats.reserved_bytes.current
            ),
            (2048, 1624, 2 * MIB)
        );
        assert_eq!((stats.cache_hits, stats.cache_misses), (2, 4));
        drop((b, c));
        let stats = allocator.stats();
        assert_eq!(
            (stats.allocated_bytes.current, stats.requested_bytes.current),
            (0, 0)
        );
        assert_eq!(
            (stats.allocated_bytes.peak, stats.requested_bytes.peak),
            (2048, 1624),
            "one stream: exact peaks in any number of shards"
        );
        assert_eq!(allocator.empty_cache().expect("empty_cache"), 2 * MIB);
        assert_eq!(counted.stats().current_bytes, 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Budgets: two caches over one limit, a cap below a segment
// ---------------------------------------------------------------------------------------------

/// Two libraries in one process each keep a caching allocator over one shared
/// `statistics(limit(driver, 64 MiB))` (RMM: two `pool_memory_resource`s over one
/// `limiting_resource_adaptor`). Library A frees a 40 MiB tensor, which its cache keeps. B's
/// 40 MiB request then cannot fit: B's out-of-memory retry can only empty B's own (empty)
/// cache, so it is a typed out-of-memory error naming the cap, with B's books untouched and A's
/// cache intact, and the adaptor counts both refused upstream requests. 16 MiB still fit beside
/// A's cache; once A empties its cache, B's 40 MiB fits, and both tensors hold their fills.
#[test]
fn two_caches_sharing_one_limit_refuse_until_the_other_gives_its_cache_back() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let cap = 64 * MIB;
    let shared = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        DriverResource::new(context),
        cap,
    )));
    let library_a = CachingAllocator::new(shared.clone());
    let library_b = CachingAllocator::new(shared.clone());
    let s = stream(context);
    const WORDS_40_MIB: usize = 10 * MIB;

    let mut x = library_a
        .buffer::<u32>(WORDS_40_MIB, &s)
        .expect("A's 40 MiB");
    x.fill_async(0xA1A1_0001, &s).expect("fill x");
    check_ends(&x, 0xA1A1_0001, &s, "A's tensor");
    drop(x);
    assert_eq!(library_a.stats().reserved_bytes.current, 40 * MIB);

    let refused = library_b
        .buffer::<u32>(WORDS_40_MIB, &s)
        .expect_err("B's 40 MiB must not fit beside A's cache");
    assert_eq!(
        refused,
        MemoryError::OutOfMemory {
            requested: 40 * MIB,
            allocated: 0,
            reserved: 0,
            limit: Some(cap),
        }
    );
    let b_stats = library_b.stats();
    assert_eq!(
        (b_stats.oom_retries, b_stats.ooms, b_stats.allocations),
        (1, 1, 0)
    );
    let a_stats = library_a.stats();
    assert_eq!(
        (a_stats.reserved_bytes.current, a_stats.segments_released),
        (40 * MIB, 0),
        "B's retry cannot reach A's cache"
    );
    let upstream = shared.stats();
    assert_eq!(
        (
            upstream.failed_allocations,
            upstream.total_allocations,
            upstream.current_bytes
        ),
        (2, 1, 40 * MIB)
    );
    assert_eq!(shared.upstream().used(), 40 * MIB);

    let mut y = library_b.buffer::<u32>(4 * MIB, &s).expect("16 MiB fits");
    y.fill_async(0xB0B0_0016, &s).expect("fill y");
    assert_eq!(library_a.empty_cache().expect("A empties"), 40 * MIB);
    assert_eq!(shared.upstream().used(), 16 * MIB);
    let mut z = library_b
        .buffer::<u32>(WORDS_40_MIB, &s)
        .expect("40 MiB fits once A gave its cache back");
    z.fill_async(0xB0B0_0040, &s).expect("fill z");
    check_ends(&y, 0xB0B0_0016, &s, "B's 16 MiB tensor");
    check_ends(&z, 0xB0B0_0040, &s, "B's 40 MiB tensor");
    let b_stats = library_b.stats();
    assert_eq!(
        (b_stats.allocations, b_stats.oom_retries, b_stats.ooms),
        (2, 1, 1)
    );
    let upstream = shared.stats();
    assert_eq!(
        (
            upstream.total_allocations,
            upstream.total_deallocations,
            upstream.failed_allocations,
            upstream.current_bytes
        ),
        (3, 1, 2, 56 * MIB)
    );

    drop((y, z));
    assert_eq!(library_b.empty_cache().expect("B empties"), 56 * MIB);
    assert_eq!(shared.upstream().used(), 0);
    assert_eq!(shared.stats().current_allocations, 0);
}

/// `torch.cuda.set_per_process_memory_fraction` with a share smaller than one 2 MiB small
/// segment: every request to a caching allocator over a 1 MiB `LimitAdaptor`, even 1000 bytes,
/// needs a whole segment, so it is a typed out-of-memory error naming the cap (requested as the
/// rounded 1024 B block), after one retry, holding nothing. Typed buffers made on the limit
/// directly (RMM's `device_buffer` on the adaptor) take exactly their bytes: 1000 B fits,
/// `1 MiB - 999` more does not (an error with the budget's use), exactly the rest does, both
/// round-trip, and dropping them gives the whole budget back.
#[test]
fn a_cap_below_one_small_segment_refuses_every_cached_request_but_serves_resource_buffers() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let s = stream(context);
    let cap = MIB;
    let limited = Arc::new(LimitAdaptor::new(DriverResource::new(context), cap));
    let cache = CachingAllocator::new(limited.clone());

    let refused = cache.buffer::<u8>(1000, &s).expect_err("no segment fits");
    assert_eq!(
        refused,
        MemoryError::OutOfMemory {
            requested: 1024,
            allocated: 0,
            reserved: 0,
            limit: Some(cap),
        }
    );
    let stats = cache.stats();
    assert_eq!(
        (
            stats.oom_retries,
            stats.ooms,
            stats.allocations,
            stats.reserved_bytes.current
        ),
        (1, 1, 0, 0)
    );
    assert_eq!(limited.used(), 0);
    assert!(matches!(
        cache.buffer::<u8>(0, &s),
        Err(MemoryError::ZeroLength { .. })
    ));

    let resource: Arc<dyn MemoryResource> = limited.clone();
    let mut small =
        DeviceBuffer::<u8>::with_resource(resource.clone(), 1000, &s).expect("1000 B fits");
    assert_eq!(limited.used(), 1000);
    let over = DeviceBuffer::<u8>::with_resource(resource.clone(), cap - 999, &s)
        .expect_err("one byte past the cap");
    assert_eq!(
        over,
        MemoryError::OutOfMemory {
            requested: cap - 999,
            allocated: 1000,
            reserved: 1000,
            limit: Some(cap),
        }
    );
    assert_eq!(limited.used(), 1000, "a refusal keeps none of the budget");
    let mut rest =
        DeviceBuffer::<u8>::with_resource(resource, cap - 1000, &s).expect("exactly the rest");
    assert_eq!(limited.used(), cap);
    let small_bytes: Vec<u8> = (0..1000).map(|i| (i * 7 + 1) as u8).collect();
    let rest_bytes: Vec<u8> = (0..cap - 1000).map(|i| (i * 13 + 5) as u8).collect();
    small.copy_from_host(&small_bytes).expect("upload small");
    rest.copy_from_host(&rest_bytes).expect("upload rest");
    assert_eq!(small.to_vec().expect("small back"), small_bytes);
    assert_eq!(rest.to_vec().expect("rest back"), rest_bytes);
    drop((small, rest));
    assert_eq!(limited.used(), 0);
    assert_eq!(limited.upstream().outstanding(), 0);
}

// ---------------------------------------------------------------------------------------------
// Views written late on two streams, then freed
// ---------------------------------------------------------------------------------------------

/// `x[:n]` written on stream a and `x[n:]` on stream b by kernels that store their marks behind
/// 300 ms spins (declared with the views' `prepare_write` / `record_write`), then `del x` at
/// once. The drop does not wait for them; the block is pending (`active_bytes` exceeds
/// `allocated_bytes` by exactly its 1 MiB), so the next 1 MiB tensor on x's stream gets the other
/// half of the segment and its fill is never overwritten by the late marks. Once both writers
/// are done the block comes back at its address, holding x's fill with both marks on it: they
/// landed in x's memory, before it was handed out again.
#[test]
fn view_writes_landing_late_on_two_streams_hold_the_dropped_block_until_both_land() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let (home, a, b) = (stream(context), stream(context), stream(context));
    const N: usize = MIB / 4; // 1 MiB of u32: a small-pool block, half a segment
    const HALF: usize = N / 2;
    const FILL: u32 = 0x1111_1111;
    const NEXT: u32 = 0x2222_2222;
    const MARK_A: u32 = 0xAAAA_0001;
    const MARK_B: u32 = 0xBBBB_0002;

    let mut x = allocator.buffer::<u32>(N, &home).expect("x");
    assert_eq!(x.allocated_for(), Some(StreamKey::of(&home)));
    x.fill_async(FILL, &home).expect("fill x");
    {
        let low = x.slice_mut(..HALF).expect("x[:n]");
        low.prepare_write(&a).expect("prepare a");
        // SAFETY: one u32 at the view's start; the write is recorded below, so x's block is not
        // handed out before the kernel has run.
        unsafe { kernels.spin_then_store_u32(&a, 300 * MS, low.device_ptr(), MARK_A) }
            .expect("late write on a");
        low.record_write(&a).expect("record a");
    }
    {
        let high = x.slice_mut(HALF..).expect("x[n:]");
        high.prepare_write(&b).expect("prepare b");
        // SAFETY: as above, for the other view.
        unsafe { kernels.spin_then_store_u32(&b, 300 * MS, high.device_ptr(), MARK_B) }
            .expect("late write on b");
        high.record_write(&b).expect("record b");
    }
    let (old, block) = (x.device_ptr(), x.allocated_bytes());
    assert_eq!(block, MIB);
    drop(x);
    assert_eq!(allocator.pending_frees(), 1);
    let stats = allocator.stats();
    assert_eq!(
        (stats.allocated_bytes.current, stats.active_bytes.current),
        (0, MIB),
        "a freed block waiting for other streams stays active"
    );

    let mut next = allocator.buffer::<u32>(N, &home).expect("next");
    assert!(
        !a.query().expect("query a") && !b.query().expect("query b"),
        "a writer finished before the next allocation: the test proves nothing"
    );
    assert_ne!(
        next.device_ptr(),
        old,
        "got the block two late writers still target"
    );
    next.fill_async(NEXT, &home).expect("fill next");
    a.synchronize().expect("sync a");
    b.synchronize().expect("sync b");
    home.synchronize().expect("sync home");
    assert!(
        next.to_vec().expect("next back").iter().all(|&v| v == NEXT),
        "a late view write landed in the next tensor"
    );

    let back = allocator.buffer::<u32>(N, &home).expect("back");
    assert_eq!(
        back.device_ptr(),
        old,
        "the block came back once both wrote"
    );
    let mut expected = vec![FILL; N];
    expected[0] = MARK_A;
    expected[HALF] = MARK_B;
    assert_eq!(
        back.to_vec().expect("old bytes"),
        expected,
        "both marks landed in x's memory, over x's fill"
    );
    assert_eq!(allocator.pending_frees(), 0);
    let stats = allocator.stats();
    assert_eq!(
        (stats.cache_misses, stats.cache_hits, stats.segments.current),
        (1, 2, 1)
    );
    assert_eq!(
        (stats.allocated_bytes.current, stats.active_bytes.current),
        (2 * MIB, 2 * MIB)
    );
}

// ---------------------------------------------------------------------------------------------
// empty_cache() from another thread while workers churn
// ---------------------------------------------------------------------------------------------

/// Counts a worker as finished when dropped, panicking or not.
struct Finished<'a>(&'a AtomicUsize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

/// A monitoring thread calls `empty_cache()` every few worker steps while four workers, each on
/// its own stream, allocate tensors of mixed sizes (small pool, shared 20 MiB segments, own
/// segments), fill them behind a short spin, keep up to three alive and check each one's ends
/// when they let it go. `empty_cache` must give back only wholly free segments: every checked
/// tensor holds its own fill however many times the cache was emptied under it, the books stay
/// consistent at every call, and at the end every segment the upstream handed out has gone back.
#[test]
fn empty_cache_from_a_monitor_thread_never_takes_a_block_that_workers_still_use() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let counted = Arc::new(StatisticsAdaptor::new(DriverResource::new(context)));
    let allocator = CachingAllocator::new(counted.clone());
    const WORKERS: usize = 4;
    const ROUNDS: usize = 250;
    let steps = AtomicUsize::new(0);
    let finished = AtomicUsize::new(0);

    let (calls, released) = std::thread::scope(|scope| {
        for worker in 0..WORKERS {
            let (allocator, kernels, steps, finished) = (&allocator, &kernels, &steps, &finished);
            scope.spawn(move || {
                // Counted even if the worker panics, so that the monitor stops.
                let _finished = Finished(finished);
                let s = stream(context);
                let mut state = 0x3A11_0000 + worker as u64;
                let mut held: VecDeque<(DeviceBuffer<u32>, u32)> = VecDeque::new();
                for round in 0..ROUNDS {
                    let r = next(&mut state);
                    let len = match r % 4 {
                        0 => 1 + r % (16 * KIB),
                        1 => 64 * KIB + r % (192 * KIB),
                        2 => 700 * KIB + r % (1300 * KIB),
                        _ => 3 * MIB,
                    };
                    let tag = ((worker as u32 + 1) << 24) | round as u32;
                    let mut buffer = allocator.buffer::<u32>(len, &s).expect("allocate");
                    buffer.fill_async(tag, &s).expect("fill");
                    kernels.spin_ns(&s, 20_000).expect("spin");
                    held.push_back((buffer, tag));
                    if held.len() > 2 {
                        let (buffer, tag) = held.pop_front().expect("held");
                        check_ends(&buffer, tag, &s, "a tensor across empty_cache calls");
                    }
                    steps.fetch_add(1, Ordering::Release);
                }
                for (buffer, tag) in held.drain(..) {
                    check_ends(&buffer, tag, &s, "a tensor across empty_cache calls");
                }
            });
        }
        let (allocator, steps, finished) = (&allocator, &steps, &finished);
        let monitor = scope.spawn(move || {
            let (mut calls, mut released, mut last) = (0u64, 0usize, 0usize);
            while finished.load(Ordering::Acquire) < WORKERS {
                let now = steps.load(Ordering::Acquire);
                if now < last + 8 {
                    std::thread::yield_now();
                    continue;
                }
                last = now;
                released += allocator.empty_cache().expect("empty_cache");
                calls += 1;
                let stats = allocator.stats();
                assert!(
                    stats.requested_bytes.current <= stats.allocated_bytes.current
                        && stats.allocated_bytes.current <= stats.active_bytes.current
                        && stats.active_bytes.current <= stats.reserved_bytes.current,
                    "inconsistent books after empty_cache: {stats:?}"
                );
            }
            (calls, released)
        });
        monitor.join().expect("monitor")
    });

    assert!(
        calls > 0,
        "the monitor never emptied the cache: the test proves nothing"
    );
    assert!(
        released > 0,
        "{calls} empty_cache calls released nothing: the test proves nothing"
    );
    let stats = allocator.stats();
    let total = (WORKERS * ROUNDS) as u64;
    assert_eq!((stats.allocations, stats.frees), (total, total));
    assert_eq!(stats.allocated_bytes.current, 0);
    let rest = allocator.empty_cache().expect("final empty_cache");
    let stats = allocator.stats();
    assert_eq!(
        (stats.reserved_bytes.current, stats.segments.current),
        (0, 0)
    );
    assert_eq!(stats.active_bytes.current, 0);
    let upstream = counted.stats();
    assert_eq!(
        (upstream.current_bytes, upstream.current_allocations),
        (0, 0)
    );
    assert_eq!(upstream.total_allocations, stats.cache_misses);
    assert_eq!(upstream.total_deallocations, stats.segments_released);
    assert_eq!(upstream.total_allocations, upstream.total_deallocations);
    eprintln!(
        "{calls} empty_cache calls under {WORKERS} workers released {} MiB, the last {} MiB; \
         {} segments in all",
        released / MIB,
        rest / MIB,
        upstream.total_allocations
    );
}

// ---------------------------------------------------------------------------------------------
// Dynamic shapes under a tight budget
// ---------------------------------------------------------------------------------------------

/// Ten thousand steps of a variable-length model (batch shapes change every step: small-pool
/// tensors, tensors sharing 20 MiB segments, tensors of their own 10-24 MiB segments), three
/// alive at a time, under a 160 MiB `LimitAdaptor`. Live memory never needs more than
/// 3 x 24 + 2 + 24 MiB, so fragmentation must never end in an out-of-memory error: the retry
/// (wait for pending blocks, give back whole free segments, ask again) always finds room. Every
/// step's tensor is filled and checksummed at both ends on the device into its own slot; every
/// checksum matches, and the books reconcile with the adaptor's.
#[test]
fn ten_thousand_dynamic_shape_steps_under_a_tight_budget_never_fail_and_every_checksum_matches() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let cap = 160 * MIB;
    let counted = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        DriverResource::new(context),
        cap,
    )));
    let allocator = CachingAllocator::new(counted.clone());
    let s = stream(context);
    const STEPS: usize = 10_000;
    const PROBE: usize = 4096;

    let mut sums = allocator.buffer::<u64>(2 * STEPS, &s).expect("sums");
    sums.fill_async(0, &s).expect("zero sums");
    let sums_ptr = sums.device_ptr();
    let mut expected = Vec::with_capacity(2 * STEPS);
    let mut ring: VecDeque<DeviceBuffer<u32>> = VecDeque::new();
    let mut state = 0xD1A_5EED;
    for step in 0..STEPS {
        let r = next(&mut state);
        let len = match r % 10 {
            0..=3 => 1 + r % (64 * KIB),
            4..=6 => 256 * KIB + r % (2200 * KIB),
            _ => 2560 * KIB + r % 3_400_000,
        };
        let tag = step as u32 + 1;
        let mut buffer = match allocator.buffer::<u32>(len, &s) {
            Ok(buffer) => buffer,
            Err(error) => panic!(
                "step {step}: {len} u32s refused with {} MiB live at most: {error:?}; {:?}",
                ring.iter().map(|b| b.byte_size()).sum::<usize>() / MIB,
                allocator.stats()
            ),
        };
        buffer.fill_async(tag, &s).expect("fill");
        let probe = len.min(PROBE);
        let tail = buffer.device_ptr() + (4 * (len - probe)) as u64;
        let slot = sums_ptr + (16 * step) as u64;
        // SAFETY: both ranges lie in the buffer (probe <= len), the slots in `sums`; everything
        // runs on `s`, the stream both were allocated on, so the buffer's block is reused (and
        // `sums` read) only behind these kernels.
        unsafe {
            kernels
                .checksum_u32(&s, buffer.device_ptr(), probe, slot)
                .expect("checksum head");
            kernels
                .checksum_u32(&s, tail, probe, slot + 8)
                .expect("checksum tail");
        }
        expected.push(probe as u64 * u64::from(tag));
        expected.push(probe as u64 * u64::from(tag));
        ring.push_back(buffer);
        if ring.len() > 3 {
            ring.pop_front();
        }
    }
    ring.clear();
    s.synchronize().expect("sync");
    let got = sums.to_vec().expect("sums back");
    for (i, (&got, &want)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(got, want, "step {} {}", i / 2, ["head", "tail"][i % 2]);
    }

    let stats = allocator.stats();
    let upstream = counted.stats();
    assert_eq!(stats.ooms, 0);
    assert_eq!(stats.allocations, STEPS as u64 + 1);
    assert_eq!(stats.frees, STEPS as u64);
    assert!(stats.reserved_bytes.peak <= cap, "{stats:?}");
    assert_eq!(upstream.failed_allocations, stats.oom_retries);
    assert_eq!(upstream.current_bytes, stats.reserved_bytes.current);
    assert_eq!(upstream.total_allocations, stats.cache_misses);
    assert_eq!(upstream.total_deallocations, stats.segments_released);
    eprintln!(
        "{STEPS} dynamic-shape steps under {} MiB: {} hits, {} misses, {} OOM retries, \
         reserved peak {} MiB",
        cap / MIB,
        stats.cache_hits,
        stats.cache_misses,
        stats.oom_retries,
        stats.reserved_bytes.peak / MIB
    );
    drop(sums);
    allocator.empty_cache().expect("empty_cache");
    assert_eq!(counted.upstream().used(), 0);
}

// ---------------------------------------------------------------------------------------------
// One shared allocation stream, many threads
// ---------------------------------------------------------------------------------------------

/// PyTorch's threads sharing the current stream: eight threads allocate on one shared stream
/// and fill there, then each reads its tensor on its own side stream (declared with
/// `prepare_read` / `record_read`) behind a short spin, checksums it on the device and drops it
/// at once. All blocks live in one shard; a block must not come back to the shared stream, where
/// another thread's fill would overwrite it, before its reader is done: every one of the 1600
/// checksums equals its own tensor's fill, and the books balance with nothing left pending.
#[test]
fn eight_threads_allocating_on_one_shared_stream_never_see_each_others_fills() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let scratch = CachingAllocator::with_driver(context);
    let shared = stream(context);
    const THREADS: usize = 8;
    const ROUNDS: usize = 200;

    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let (allocator, scratch, kernels, shared) = (&allocator, &scratch, &kernels, &shared);
            scope.spawn(move || {
                let side = stream(context);
                let mut sums = scratch.buffer::<u64>(ROUNDS, &side).expect("sums");
                sums.fill_async(0, &side).expect("zero sums");
                let mut expected = Vec::with_capacity(ROUNDS);
                let mut state = 0x5A4E_D000 + thread as u64;
                for round in 0..ROUNDS {
                    let r = next(&mut state);
                    let len = match r % 3 {
                        0 => 1 + r % 4096,
                        1 => 16 * KIB + r % (64 * KIB),
                        _ => 256 * KIB + 1 + r % (200 * KIB),
                    };
                    let tag = ((thread as u32 + 1) << 20) | (round as u32 + 1);
                    let mut tensor = allocator.buffer::<u32>(len, shared).expect("allocate");
                    tensor
                        .fill_async(tag, shared)
                        .expect("fill on the shared stream");
                    tensor.prepare_read(&side).expect("prepare read");
                    kernels.spin_ns(&side, 20_000).expect("spin");
                    // SAFETY: `len` u32s of the tensor, whose read is recorded below (its block
                    // waits for it); one u64 slot of `sums`, allocated on `side`, read after
                    // `side` is synchronised.
                    unsafe {
                        kernels.checksum_u32(
                            &side,
                            tensor.device_ptr(),
                            len,
                            sums.device_ptr() + (8 * round) as u64,
                        )
                    }
                    .expect("checksum");
                    tensor.record_read(&side).expect("record read");
                    drop(tensor);
                    expected.push(len as u64 * u64::from(tag));
                }
                side.synchronize().expect("sync side");
                let got = sums.to_vec().expect("sums back");
                for (round, (&got, &want)) in got.iter().zip(&expected).enumerate() {
                    assert_eq!(
                        got, want,
                        "thread {thread} round {round}: another thread's fill reached the tensor"
                    );
                }
            });
        }
    });

    shared.synchronize().expect("sync shared");
    let total = (THREADS * ROUNDS) as u64;
    let stats = allocator.stats();
    assert_eq!((stats.allocations, stats.frees), (total, total));
    assert_eq!(stats.allocated_bytes.current, 0);
    // The next allocation on the shared stream polls every waiting block back.
    drop(allocator.buffer::<u32>(1, &shared).expect("poll"));
    assert_eq!(allocator.pending_frees(), 0);
    let stats = allocator.stats();
    assert_eq!(
        (stats.allocated_bytes.current, stats.active_bytes.current),
        (0, 0)
    );
}

// ---------------------------------------------------------------------------------------------
// Lifetimes: the allocator before its buffers, own allocations under a copy
// ---------------------------------------------------------------------------------------------

/// A library makes a caching allocator over `statistics(async pool)`, hands out a 16 MiB tensor
/// and caches a small one, and drops its allocator handle: the segments stay (the tensor keeps
/// the allocator's state). The tensor is then written late on another stream (recorded) and
/// dropped while that kernel spins: it is the allocator's last handle, so every segment goes
/// back to the pool, and the pool trims to nothing. The write must have landed before: when the
/// drop returns the writer has finished (and its stream reports no fault), nothing is
/// outstanding in the pool or the adaptor, and the pool holds no memory.
#[test]
fn an_allocator_dropped_before_its_buffers_gives_everything_back_after_the_last_late_writer() {
    let name =
        "an_allocator_dropped_before_its_buffers_gives_everything_back_after_the_last_late_writer";
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let Some(pool) = async_pool_or_skip(name, context) else {
        return;
    };
    let kernels = TestKernels::load(context).expect("kernels");
    let counted = Arc::new(StatisticsAdaptor::new(Arc::clone(&pool)));
    let allocator = CachingAllocator::new(counted.clone());
    let (s, writer) = (stream(context), stream(context));
    const N: usize = 4 * MIB; // u32s: 16 MiB, its own segment

    let mut tensor = allocator.buffer::<u32>(N, &s).expect("tensor");
    tensor.fill_async(5, &s).expect("fill");
    drop(allocator.buffer::<u32>(1000, &s).expect("small"));
    drop(allocator);
    let upstream = counted.stats();
    assert_eq!(
        (upstream.current_allocations, upstream.current_bytes),
        (2, 16 * MIB + 2 * MIB),
        "the segments stay while a buffer lives"
    );
    check_ends(&tensor, 5, &s, "the tensor of a dropped allocator");

    tensor.prepare_write(&writer).expect("prepare write");
    let last = tensor.device_ptr() + (4 * (N - 1)) as u64;
    // SAFETY: the last u32 of the tensor; the write is recorded below, so the tensor's memory
    // is not freed before the kernel has run.
    unsafe { kernels.spin_then_store_u32(&writer, 300 * MS, last, 0xFEED) }.expect("late write");
    tensor.record_write(&writer).expect("record write");
    assert!(
        !writer.query().expect("query"),
        "the writer finished too early: the test proves nothing"
    );
    drop(tensor);
    assert!(
        writer.query().expect("query writer"),
        "the allocator's memory went back while the writer could still store into it"
    );
    writer
        .synchronize()
        .expect("the writer ran without a fault");
    let upstream = counted.stats();
    assert_eq!(
        (
            upstream.current_allocations,
            upstream.current_bytes,
            upstream.total_allocations,
            upstream.total_deallocations
        ),
        (0, 0, 2, 2)
    );
    assert_eq!(pool.outstanding(), 0);
    assert_eq!(
        pool.pool().reserved_bytes().expect("reserved"),
        0,
        "the pool was trimmed when the last segment came back"
    );

    // The pool still serves, byte for byte.
    let resource: Arc<dyn MemoryResource> = pool.clone();
    let mut again = DeviceBuffer::<u32>::with_resource(resource, N, &s).expect("again");
    again.fill_async(9, &s).expect("fill again");
    check_ends(&again, 9, &s, "a pool buffer after the allocator went");
}

/// `pinned = torch.empty(n, pin_memory=True)` made without the caching host allocator
/// (`PinnedBuffer::new_unpooled`) and a managed tensor, each the source of a device copy queued
/// behind a 200 ms spin, dropped at once, and new host memory of the same size written with
/// other bytes straight after (the host may hand the freed pages out again). The copies must
/// read the old bytes: the drop frees an own allocation only after its uses' events (it blocks
/// until then), so the copy's stream is done when it returns, and each destination holds
/// exactly what its source held.
#[test]
fn own_pinned_and_managed_buffers_dropped_under_a_queued_copy_are_freed_only_after_it() {
    let name = "own_pinned_and_managed_buffers_dropped_under_a_queued_copy_are_freed_only_after_it";
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let w = stream(context);
    const N: usize = MIB; // u32s: 4 MiB
    let original: Vec<u32> = (0..N as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let other: Vec<u32> = original.iter().map(|&v| !v).collect();

    let mut pinned = PinnedBuffer::<u32>::new_unpooled(context, N).expect("pinned");
    pinned
        .as_mut_slice()
        .expect("host slice")
        .copy_from_slice(&original);
    let mut from_pinned = allocator.buffer::<u32>(N, &w).expect("destination");
    kernels.spin_ns(&w, 200 * MS).expect("spin");
    from_pinned
        .copy_from_async(&pinned, &w)
        .expect("copy from pinned");
    assert!(!w.query().expect("query"), "the spin ended too early");
    drop(pinned);
    assert!(
        w.query().expect("query"),
        "the pinned memory was freed before the copy that reads it ran"
    );
    let mut reused = PinnedBuffer::<u32>::new_unpooled(context, N).expect("new pinned");
    reused
        .as_mut_slice()
        .expect("host slice")
        .copy_from_slice(&other);
    assert!(
        from_pinned.to_vec().expect("read back") == original,
        "the copy read freed pinned memory"
    );
    drop(reused);

    let usable = ManagedCapabilities::of(gpu.device)
        .map(|caps| caps.managed_memory && caps.concurrent_managed_access)
        .unwrap_or(false);
    if !usable {
        skip(
            name,
            "managed half: host writes while a copy runs need concurrent managed access",
        );
        return;
    }
    let managed = UnifiedBuffer::<u32>::from_slice(context, &original).expect("managed");
    let mut from_managed = allocator.buffer::<u32>(N, &w).expect("destination");
    kernels.spin_ns(&w, 200 * MS).expect("spin");
    from_managed
        .copy_from_async(&managed, &w)
        .expect("copy from managed");
    assert!(!w.query().expect("query"), "the spin ended too early");
    drop(managed);
    assert!(
        w.query().expect("query"),
        "the managed memory was freed before the copy that reads it ran"
    );
    let again = UnifiedBuffer::<u32>::from_slice(context, &other).expect("new managed");
    assert!(
        from_managed.to_vec().expect("read back") == original,
        "the copy read freed managed memory"
    );
    drop(again);
}

// ---------------------------------------------------------------------------------------------
// A host that runs ahead of its stream
// ---------------------------------------------------------------------------------------------

/// One pass of the run-ahead loop: behind a 200 ms spin on `s`, `STEPS` times allocate a 4 MiB
/// tensor from `allocator`, fill it with `step + 1`, copy its first element into `log[step]`
/// and drop it, never synchronising (no `.item()`). Returns whether `s` was still behind the
/// spin when the loop ended, and the allocator's pending frees then.
fn run_ahead(
    allocator: &CachingAllocator,
    kernels: &TestKernels,
    log: &mut DeviceBuffer<u32>,
    s: &Stream,
    steps: usize,
) -> (bool, usize) {
    log.fill_async(0, s).expect("zero log");
    kernels.spin_ns(s, 200 * MS).expect("spin");
    for step in 0..steps {
        let mut tensor = allocator.buffer::<u32>(MIB, s).expect("allocate");
        tensor.fill_async(step as u32 + 1, s).expect("fill");
        log.copy_range_from_async(step, &tensor, 0, 1, s)
            .expect("log");
        drop(tensor);
    }
    let behind = !s.query().expect("query");
    (behind, allocator.pending_frees())
}

/// A loop that never synchronises (inference without `.item()`): the host queues 64 steps of
/// allocate 4 MiB / fill / copy out / free behind a 200 ms kernel. PyTorch reuses the one block
/// in stream order (one 20 MiB segment). cuweave documents that same-stream reuse waits for the
/// freed tensor's events, so "a loop that allocates faster than the GPU runs keeps as many
/// blocks as it has in flight": with no budget every freed block is still pending, the reserve
/// is what the steps in flight need (at most 13 segments: five 4 MiB blocks per 20 MiB segment)
/// and all of it comes back once the stream moves. Under a 24 MiB `LimitAdaptor` the same loop
/// must not fail: the out-of-memory retry waits for the pending blocks instead (no OOM, never
/// more than one segment). Both passes log every step's value exactly.
#[test]
fn a_host_running_ahead_of_its_stream_holds_blocks_in_flight_and_a_budget_turns_that_into_waits() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let s = stream(context);
    let scratch = CachingAllocator::with_driver(context);
    const STEPS: usize = 64;
    let mut log = scratch.buffer::<u32>(STEPS, &s).expect("log");
    let expected: Vec<u32> = (1..=STEPS as u32).collect();

    // No budget.
    let counted = Arc::new(StatisticsAdaptor::new(DriverResource::new(context)));
    let unlimited = CachingAllocator::new(counted.clone());
    let (behind, pending) = run_ahead(&unlimited, &kernels, &mut log, &s, STEPS);
    assert!(
        behind,
        "the spin ended before the loop did: the test proves nothing"
    );
    let stats = unlimited.stats();
    assert!(
        pending <= STEPS,
        "{pending} pending frees for {STEPS} tensors"
    );
    assert_eq!(stats.allocated_bytes.current, 0);
    assert!(
        (1..=STEPS.div_ceil(5)).contains(&stats.segments.current),
        "{} segments for {STEPS} tensors in flight",
        stats.segments.current
    );
    assert_eq!(
        stats.reserved_bytes.current,
        stats.segments.current * 20 * MIB
    );
    assert_eq!(
        stats.active_bytes.current,
        pending * 4 * MIB,
        "pending blocks count as active"
    );
    eprintln!(
        "{STEPS} steps queued behind a busy stream: {pending} blocks pending, {} segments \
         ({} MiB reserved; PyTorch's stream-ordered reuse needs one segment)",
        stats.segments.current,
        stats.reserved_bytes.current / MIB
    );
    s.synchronize().expect("sync");
    assert_eq!(log.to_vec().expect("log"), expected, "unbudgeted pass");
    let reserved = stats.reserved_bytes.current;
    drop(
        unlimited
            .buffer::<u32>(MIB, &s)
            .expect("after the stream moved"),
    );
    assert_eq!(unlimited.pending_frees(), 0, "every block came back");
    assert_eq!(
        unlimited.stats().reserved_bytes.current,
        reserved,
        "served from the blocks that came back"
    );
    assert_eq!(unlimited.empty_cache().expect("empty"), reserved);
    assert_eq!(counted.stats().current_bytes, 0);

    // A 24 MiB budget: room for one 20 MiB segment.
    let cap = 24 * MIB;
    let limited = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        DriverResource::new(context),
        cap,
    )));
    let budgeted = CachingAllocator::new(limited.clone());
    run_ahead(&budgeted, &kernels, &mut log, &s, STEPS);
    s.synchronize().expect("sync");
    assert_eq!(log.to_vec().expect("log"), expected, "budgeted pass");
    let stats = budgeted.stats();
    assert_eq!(
        stats.ooms, 0,
        "the retry waits for in-flight blocks: {stats:?}"
    );
    assert_eq!(stats.allocations, STEPS as u64);
    assert_eq!(stats.segments.peak, 1);
    assert!(stats.reserved_bytes.peak <= cap);
    assert!(
        stats.oom_retries >= 1,
        "six 4 MiB tensors in flight never needed a second segment: {stats:?}"
    );
    assert_eq!(limited.stats().failed_allocations, stats.oom_retries);
    budgeted.empty_cache().expect("empty");
    assert_eq!(limited.upstream().used(), 0);
}
