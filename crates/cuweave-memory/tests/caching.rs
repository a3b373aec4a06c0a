//! The caching allocator on a real GPU: cache hits without driver calls, cross-stream safety
//! observed by a kernel, the out-of-memory retry under a limit, memory returned to the driver,
//! and concurrent use.
//!
//! The tests take one lock: `empty_cache` is checked against `cuMemGetInfo`, which every other
//! allocation in the process would disturb.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cuweave_driver::memory;
use cuweave_driver::{Context, Event, EventFlags, Stream, StreamFlags};
use cuweave_memory::caching::{BlockStatus, CachedAllocation, CachingAllocator};
use cuweave_memory::resource::{
    AsyncPoolResource, DriverResource, LimitAdaptor, MemoryResource, StatisticsAdaptor,
};
use cuweave_memory::{Buffer, MemoryError};
mod common;

use common::{counter, read_u32};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const MIB: usize = 1 << 20;
/// How long the watch kernel reads a freed block: long enough that the host's allocations and
/// launches all happen while it runs.
const WATCH_NS: u64 = 200_000_000;

static GPU: Mutex<()> = Mutex::new(());

fn exclusive() -> MutexGuard<'static, ()> {
    GPU.lock().unwrap_or_else(PoisonError::into_inner)
}

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// Fills the requested bytes of `block` with `tag` on `stream` and reads back its first and last
/// words there: the memory is real and nobody else's.
fn fill_and_check(block: &CachedAllocation, stream: &Stream, tag: u32) {
    let words = block.size().div_ceil(4);
    let mut ends = [0u32; 2];
    // SAFETY: the block holds `block_size() >= words * 4` bytes until it is freed, which happens
    // after this function has synchronised `stream`; `ends` outlives that synchronisation.
    unsafe {
        memory::memset_d32_async(block.ptr(), tag, words, stream).expect("memset");
        memory::copy_dtoh_async((&raw mut ends[0]).cast(), block.ptr(), 4, stream)
            .expect("read first word");
        let last = block.ptr() + (words as u64 - 1) * 4;
        memory::copy_dtoh_async((&raw mut ends[1]).cast(), last, 4, stream)
            .expect("read last word");
    }
    stream.synchronize().expect("synchronize");
    assert_eq!(
        ends,
        [tag, tag],
        "block {:#x} holds what was written",
        block.ptr()
    );
}

#[test]
fn a_freed_block_of_the_same_size_comes_back_without_a_driver_allocation() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s1 = stream(ctx);
    let upstream = Arc::new(StatisticsAdaptor::new(DriverResource::new(ctx)));
    let allocator = CachingAllocator::new(upstream.clone());

    let first = allocator.allocate(MIB, &s1).unwrap();
    fill_and_check(&first, &s1, 0x1111_1111);
    let ptr = first.ptr();
    drop(first);
    let second = allocator.allocate(MIB, &s1).unwrap();
    assert_eq!(second.ptr(), ptr, "the cached block is handed out again");
    fill_and_check(&second, &s1, 0x2222_2222);
    // A smaller request is carved from the same cached 2 MiB segment.
    let third = allocator.allocate(1000, &s1).unwrap();
    fill_and_check(&third, &s1, 0x3333_3333);

    let driver = upstream.stats();
    assert_eq!(driver.total_allocations, 1, "one cuMemAlloc for all three");
    assert_eq!(driver.current_bytes, 2 * MIB);
    let stats = allocator.stats();
    assert_eq!((stats.cache_hits, stats.cache_misses), (2, 1));
    assert_eq!(stats.allocated_bytes.current, MIB + 1024);
    assert_eq!(stats.reserved_bytes.current, 2 * MIB);
    drop((second, third));
    assert_eq!(allocator.empty_cache().unwrap(), 2 * MIB);
    assert_eq!(upstream.stats().total_deallocations, 1);
}

/// Frees a block that a 200 ms watch kernel on `s2` still reads, allocates the same size on `s1`
/// and fills it; returns the allocation made during the watch and the watch's mismatch count.
fn free_under_watch(
    ctx: &Arc<Context>,
    allocator: &CachingAllocator,
    record: bool,
) -> (u64, CachedAllocation, u32, Stream) {
    const EXPECTED: u32 = 0xA5A5_A5A5;
    let kernels = TestKernels::load(ctx).expect("load test kernels");
    let s1 = stream(ctx);
    let s2 = Arc::new(stream(ctx));
    let n = MIB / 4;
    let mismatches = counter(ctx);

    let mut old = allocator.allocate(MIB, &s1).unwrap();
    let filled = Event::new(ctx, EventFlags::DISABLE_TIMING).unwrap();
    // SAFETY: `old` holds `n` u32s and stays allocated until the watch has finished (it is
    // recorded on s2 below) or, in the control run, is deliberately reused while watched, which
    // the kernel tolerates (it only reads); `mismatches` lives until after s2 is synchronised.
    unsafe {
        kernels.fill_u32(&s1, old.ptr(), EXPECTED, n).unwrap();
        filled.record(&s1).unwrap();
        s2.wait_event(&filled).unwrap();
        kernels
            .watch_u32(&s2, old.ptr(), n, EXPECTED, WATCH_NS, mismatches.ptr())
            .unwrap();
    }
    if record {
        old.record_stream(&s2).unwrap();
    }
    let old_ptr = old.ptr();
    drop(old);

    let new = allocator.allocate(MIB, &s1).unwrap();
    // SAFETY: `new` holds `n` u32s and outlives the fill (the caller synchronises s1 first).
    unsafe { kernels.fill_u32(&s1, new.ptr(), !EXPECTED, n).unwrap() };
    assert!(
        !s2.query().unwrap(),
        "the watch kernel must still be running when the block is reallocated"
    );
    s2.synchronize().unwrap();
    s1.synchronize().unwrap();
    (old_ptr, new, read_u32(ctx, mismatches.ptr()), s1)
}

#[test]
fn a_block_recorded_on_a_second_stream_is_not_reused_while_a_kernel_there_reads_it() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let upstream = Arc::new(StatisticsAdaptor::new(DriverResource::new(ctx)));
    let allocator = CachingAllocator::new(upstream.clone());

    let (old_ptr, new, mismatches, s1) = free_under_watch(ctx, &allocator, true);
    assert_ne!(
        new.ptr(),
        old_ptr,
        "not handed out while the watch kernel reads it"
    );
    assert_eq!(
        mismatches, 0,
        "the watch kernel saw its data unchanged for 200 ms"
    );
    assert_eq!(
        allocator.pending_frees(),
        1,
        "the old block waits for its event"
    );
    assert_eq!(allocator.stats().active_bytes.current, 2 * MIB);
    // The memory snapshot (torch.cuda.memory_snapshot) shows the same instant block by block.
    let snapshot = allocator.snapshot();
    assert_eq!(snapshot.segments.len(), 1, "{snapshot}");
    let status_at = |ptr| {
        snapshot.segments[0]
            .blocks
            .iter()
            .find(|block| block.address == ptr)
            .map(|block| (block.size, block.status))
    };
    assert_eq!(status_at(old_ptr), Some((MIB, BlockStatus::PendingFree)));
    assert_eq!(status_at(new.ptr()), Some((MIB, BlockStatus::Allocated)));
    assert_eq!(
        snapshot.reserved_bytes(),
        allocator.stats().reserved_bytes.current
    );

    // The watch is over (s2 synchronised): the next allocation polls the event, and the old
    // block, back in its stream's free lists, is reused. (`new` stays held so that the stash of
    // recently freed blocks cannot serve the request instead.)
    let again = allocator.allocate(MIB, &s1).unwrap();
    assert_eq!(
        again.ptr(),
        old_ptr,
        "reused once the recorded stream has passed it"
    );
    assert_eq!(allocator.pending_frees(), 0);
    assert_eq!(
        upstream.stats().total_allocations,
        1,
        "all from one segment"
    );
    let snapshot = allocator.snapshot();
    assert_eq!(snapshot.bytes(BlockStatus::PendingFree), 0, "{snapshot}");
    assert_eq!(snapshot.bytes(BlockStatus::Allocated), 2 * MIB);
    drop(again);
    drop(new);
    assert_eq!(allocator.stats().active_bytes.current, 0);
    assert_eq!(allocator.snapshot().bytes(BlockStatus::Allocated), 0);
}

#[test]
fn without_record_stream_the_watch_kernel_sees_the_reuse() {
    // The control for the test above: it shows the watch kernel does catch a reuse, so its zero
    // there means the allocator prevented one.
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let (old_ptr, new, mismatches, _s1) = free_under_watch(&gpu.context, &allocator, false);
    assert_eq!(
        new.ptr(),
        old_ptr,
        "same stream, no recorded use: reused at once"
    );
    assert!(mismatches > 0, "the watch kernel saw the new fill");
}

#[test]
fn with_a_64_mib_limit_the_oom_path_frees_the_cache_retries_and_fails_cleanly() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let (s1, s2) = (stream(ctx), stream(ctx));
    let limit = 64 * MIB;
    let upstream = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        DriverResource::new(ctx),
        limit,
    )));
    let allocator = CachingAllocator::new(upstream.clone());

    // 40 MiB cached on s1; 30 MiB on s2 cannot use it and does not fit beside it.
    drop(allocator.allocate(40 * MIB, &s1).unwrap());
    let held = allocator.allocate(30 * MIB, &s2).unwrap();
    fill_and_check(&held, &s2, 7);
    let stats = allocator.stats();
    assert_eq!((stats.oom_retries, stats.ooms), (1, 0));
    assert_eq!(
        stats.segments_released, 1,
        "the cached 40 MiB went back before the retry"
    );
    assert_eq!(stats.reserved_bytes.current, 30 * MIB);

    // 40 MiB more cannot fit beside the 30 MiB in use, cache or no cache.
    let error = allocator.allocate(40 * MIB, &s1).unwrap_err();
    assert_eq!(
        error,
        MemoryError::OutOfMemory {
            requested: 40 * MIB,
            allocated: 30 * MIB,
            reserved: 30 * MIB,
            limit: Some(limit),
        }
    );
    let stats = allocator.stats();
    assert_eq!((stats.oom_retries, stats.ooms), (2, 1));
    let driver = upstream.stats();
    assert_eq!(
        driver.failed_allocations, 3,
        "the limit refused three upstream requests"
    );
    assert_eq!(
        (driver.total_allocations, driver.total_deallocations),
        (2, 1)
    );
    assert_eq!(driver.current_bytes, 30 * MIB);

    // Cleanly: what fits still works.
    let small = allocator.allocate(16 * MIB, &s1).unwrap();
    fill_and_check(&small, &s1, 9);
    drop((held, small));
    allocator.empty_cache().unwrap();
    assert_eq!(upstream.upstream().used(), 0);
}

#[test]
fn empty_cache_gives_the_memory_back_to_the_driver() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let (s1, s2) = (stream(ctx), stream(ctx));
    let allocator = CachingAllocator::with_driver(ctx);
    // Warm up: the first cycle makes the allocator's release stream and lets the driver set up
    // what it keeps for the context.
    drop(allocator.allocate(MIB, &s1).unwrap());
    allocator.empty_cache().unwrap();
    let before = ctx.memory_info().unwrap().free;

    let mut blocks = Vec::new();
    for index in 0..8 {
        let stream = if index % 2 == 0 { &s1 } else { &s2 };
        blocks.push((allocator.allocate(32 * MIB, stream).unwrap(), index % 2));
    }
    for index in 0..32 {
        let stream = if index % 2 == 0 { &s1 } else { &s2 };
        blocks.push((
            allocator.allocate(64 * 1024 + index * 512, stream).unwrap(),
            index % 2,
        ));
    }
    for (tag, (block, which)) in blocks.iter().enumerate() {
        fill_and_check(block, if *which == 0 { &s1 } else { &s2 }, tag as u32);
    }
    let during = ctx.memory_info().unwrap().free;
    assert!(
        before.saturating_sub(during) >= 256 * MIB,
        "256 MiB and more came from the driver"
    );
    drop(blocks);

    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    assert!(stats.reserved_bytes.current >= 256 * MIB);
    let cached = ctx.memory_info().unwrap().free;
    assert!(
        before.saturating_sub(cached) >= 256 * MIB,
        "freed blocks stay cached"
    );

    let released = allocator.empty_cache().unwrap();
    assert_eq!(released, stats.reserved_bytes.current);
    let after = ctx.memory_info().unwrap().free;
    assert!(
        before.abs_diff(after) <= 2 * MIB,
        "free memory back to where it started: before {before}, after {after}"
    );
    let stats = allocator.stats();
    assert_eq!(
        (stats.reserved_bytes.current, stats.segments.current),
        (0, 0)
    );

    // An allocation outlives its allocator; the last one to go returns the cache.
    let survivor = allocator.allocate(64 * MIB, &s1).unwrap();
    drop(allocator);
    fill_and_check(&survivor, &s1, 0x5eed);
    assert!(before.saturating_sub(ctx.memory_info().unwrap().free) >= 64 * MIB);
    drop(survivor);
    let last = ctx.memory_info().unwrap().free;
    assert!(
        before.abs_diff(last) <= 2 * MIB,
        "dropping the last allocation released the segment: before {before}, after {last}"
    );
}

#[test]
fn empty_cache_over_the_async_pool_gives_the_memory_back_to_the_driver() {
    const GIB: usize = 1 << 30;
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    if !gpu.device.supports_memory_pools().unwrap() {
        eprintln!("device lacks memory pools; AsyncPoolResource::new must say so");
        assert!(AsyncPoolResource::new(ctx).is_err());
        return;
    }
    if ctx.memory_info().unwrap().free < 3 * GIB {
        eprintln!("SKIPPED: less than 3 GiB free on the device");
        return;
    }
    let s = stream(ctx);
    let pool = Arc::new(AsyncPoolResource::new(ctx).unwrap());
    // Through both adaptors, so each must forward the release to the pool.
    let upstream: Arc<dyn MemoryResource> = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        Arc::clone(&pool),
        2 * GIB,
    )));
    let allocator = CachingAllocator::new(upstream);
    drop(allocator.allocate(MIB, &s).unwrap());
    allocator.empty_cache().unwrap();
    let before = ctx.memory_info().unwrap().free;

    let block = allocator.allocate(GIB, &s).unwrap();
    fill_and_check(&block, &s, 0x600d);
    drop(block);
    let cached = ctx.memory_info().unwrap().free;
    assert!(
        before.saturating_sub(cached) >= GIB,
        "the gibibyte came from the driver and stays cached"
    );

    let released = allocator.empty_cache().unwrap();
    assert!(released >= GIB);
    assert_eq!(pool.outstanding(), 0, "every segment went back to the pool");
    assert_eq!(
        pool.pool().reserved_bytes().unwrap(),
        0,
        "and the pool gave it back"
    );
    let after = ctx.memory_info().unwrap().free;
    assert!(
        after >= cached + GIB - 2 * MIB && before.abs_diff(after) <= 2 * MIB,
        "free memory back to where it started: before {before}, cached {cached}, after {after}"
    );
}

#[test]
fn eight_threads_allocating_and_freeing_concurrently_lose_nothing() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let streams: Arc<Vec<Arc<Stream>>> = Arc::new((0..4).map(|_| Arc::new(stream(ctx))).collect());
    let upstream = Arc::new(StatisticsAdaptor::new(DriverResource::new(ctx)));
    let allocator = CachingAllocator::new(upstream.clone());

    let threads: Vec<_> = (0..8u32)
        .map(|thread| {
            let (allocator, streams) = (allocator.clone(), Arc::clone(&streams));
            std::thread::spawn(move || {
                let mut state = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(thread + 1);
                let mut random = move || {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state
                };
                let mut live: Vec<(CachedAllocation, usize, u32)> = Vec::new();
                for step in 0..300u32 {
                    if live.len() < 8 && random() % 3 != 0 {
                        let which = (random() % 4) as usize;
                        let bytes = match random() % 3 {
                            0 => 1 + (random() % 4096) as usize,
                            1 => 1 + (random() % MIB as u64) as usize,
                            _ => 1 + (random() % (24 * MIB as u64)) as usize,
                        };
                        let mut block = allocator.allocate(bytes, &streams[which]).unwrap();
                        let tag = (thread << 24) | step;
                        // SAFETY: the block holds at least `bytes` rounded up to 4 until it is
                        // freed, after its stream is synchronised in `fill_and_check`.
                        unsafe {
                            memory::memset_d32_async(
                                block.ptr(),
                                tag,
                                bytes.div_ceil(4),
                                &streams[which],
                            )
                            .unwrap();
                        }
                        if random() % 4 == 0 {
                            block.record_stream(&streams[(which + 1) % 4]).unwrap();
                        }
                        live.push((block, which, tag));
                    } else if !live.is_empty() {
                        let index = (random() % live.len() as u64) as usize;
                        let (block, which, tag) = live.swap_remove(index);
                        // Still holding its own tag: no other live allocation overlapped it.
                        fill_and_check_existing(&block, &streams[which], tag);
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("worker thread");
    }

    let stats = allocator.stats();
    assert_eq!(
        stats.allocations, stats.frees,
        "every allocation was freed once"
    );
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(stats.requested_bytes.current, 0);
    assert_eq!(stats.allocations, stats.cache_hits + stats.cache_misses);
    allocator.empty_cache().unwrap();
    let stats = allocator.stats();
    assert_eq!(
        stats.active_bytes.current, 0,
        "recorded uses were waited for"
    );
    assert_eq!(
        (stats.reserved_bytes.current, stats.segments.current),
        (0, 0)
    );
    let driver = upstream.stats();
    assert_eq!(driver.total_allocations, driver.total_deallocations);
    assert_eq!(driver.current_bytes, 0);
    assert_eq!(driver.total_allocations, stats.cache_misses);
}

/// Reads back the first and last word of `block`, which was filled with `tag` on `stream`.
fn fill_and_check_existing(block: &CachedAllocation, stream: &Stream, tag: u32) {
    let words = block.size().div_ceil(4);
    let mut ends = [0u32; 2];
    // SAFETY: the block is live for this whole function and `ends` outlives the synchronisation.
    unsafe {
        memory::copy_dtoh_async((&raw mut ends[0]).cast(), block.ptr(), 4, stream).unwrap();
        let last = block.ptr() + (words as u64 - 1) * 4;
        memory::copy_dtoh_async((&raw mut ends[1]).cast(), last, 4, stream).unwrap();
    }
    stream.synchronize().unwrap();
    assert_eq!(
        ends,
        [tag, tag],
        "block {:#x} kept its own contents",
        block.ptr()
    );
}

#[test]
fn emptying_the_process_caches_gives_the_default_allocators_memory_back_to_the_driver() {
    let gpu = require_gpu!();
    let _gpu = exclusive();
    let stream = stream(&gpu.context);
    let default = CachingAllocator::for_device(gpu.device).unwrap();
    cuweave_driver::empty_process_caches();
    let before = gpu.context.memory_info().unwrap().free;
    let reserved_before = default.stats().reserved_bytes.current;
    {
        let mut buffer = cuweave_memory::DeviceBuffer::<u8>::new_on(&stream, 64 * MIB).unwrap();
        buffer.fill_async(7, &stream).unwrap();
        let mut back = vec![0u8; 64 * MIB];
        buffer.copy_to_host(&mut back).unwrap();
        assert!(back.iter().all(|&b| b == 7));
    }
    // Dropped: its block stays cached (that is the point of the cache) ...
    let cached = default.stats().reserved_bytes.current;
    assert!(cached >= reserved_before + 64 * MIB, "{cached}");
    // ... until the process caches are emptied, which waits for the queued work and frees it.
    assert!(cuweave_driver::empty_process_caches() >= 64 * MIB);
    assert_eq!(default.stats().reserved_bytes.current, 0);
    let after = gpu.context.memory_info().unwrap().free;
    assert!(
        after + 2 * MIB >= before,
        "cuMemGetInfo free went from {before} to {after}"
    );
    assert!(
        cuweave_driver::process_caches::process_cache_names()
            .iter()
            .any(|name| name.contains("default caching allocators"))
    );
}
