//! Programs written the way users of RMM's `cuda_async_memory_resource` and its adaptors
//! (`limiting_resource_adaptor`, `statistics_resource_adaptor`, `device_buffer` /
//! `device_uvector` on a stream), of PyTorch's `cudaMallocAsync` backend and of cudarc's
//! stream-ordered `alloc` / `free` drive cuweave's stream-ordered pool: the async pool under a
//! statistics-over-limit stack whose counters must match exactly, memory allocated on one
//! stream, used on a second and freed on a third under a slow reader, typed buffers of the
//! stream-ordered allocator dropped on other threads, an allocator and its streams dropped
//! under queued work, 10^4-10^5 allocate/free cycles with bounded reserves and books, many
//! threads on their own streams, allocation racing `free_for_stream`, the per-thread default
//! stream, the release threshold and trimming, bad input, and two devices.
//!
//! Ordering is proven by bytes: `watch_u32` kernels that count changed elements while the code
//! under test frees and reallocates, spins that hold a stream, checksums the host recomputes.
//! Nothing is timed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use cuweave_driver::{Context, Device, Stream, StreamFlags};
use cuweave_memory::{
    AsyncPoolResource, Buffer, DeviceBuffer, LimitAdaptor, MemoryError, MemoryResource,
    StatisticsAdaptor,
};
use cuweave_stream::{
    PriorityStream, StreamError, StreamOrderedAllocator, StreamOrderedAllocatorConfig,
    StreamPriority,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{Gpu, require_gpu, serial, skip, skip_under_sanitizer};

mod common;
use common::Kit;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const MS: u64 = 1_000_000;
/// `u32`s of the watched blocks: 4 MiB.
const N: usize = 1 << 20;
const A_VALUE: u32 = 0xA5A5_A5A5;
const C_VALUE: u32 = 0x3C3C_3C3C;

/// A 64-bit LCG: the same "random" program on every run.
fn next(state: &mut u64) -> usize {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (*state >> 33) as usize
}

fn raw_stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

fn normal_stream(context: &Arc<Context>) -> Arc<PriorityStream> {
    Arc::new(PriorityStream::new(context, StreamPriority::Normal).expect("priority stream"))
}

/// The async pool of `gpu`, or `None` after printing why the test is skipped.
fn async_pool(gpu: &Gpu, test: &str) -> Option<Arc<AsyncPoolResource>> {
    match AsyncPoolResource::new(&gpu.context) {
        Ok(pool) => Some(Arc::new(pool)),
        Err(error) => {
            skip(test, &format!("no stream-ordered memory pool: {error}"));
            None
        }
    }
}

/// Whether the device has stream-ordered pools (printing a skip when not).
fn has_pools(gpu: &Gpu, test: &str) -> bool {
    let pools = gpu.device.supports_memory_pools().unwrap_or(false);
    if !pools {
        skip(test, "the device has no stream-ordered memory pools");
    }
    pools
}

/// A handle on `CU_STREAM_PER_THREAD`: one handle that names the calling thread's own default
/// stream, as `rmm::cuda_stream_per_thread` and `cudaStreamPerThread` do.
fn per_thread_stream(context: &Arc<Context>) -> Stream {
    // SAFETY: CU_STREAM_PER_THREAD (2) is a valid stream of every context; the handle does not
    // own it, so dropping it destroys nothing.
    unsafe { Stream::from_raw(context, 2usize as cuweave_driver::sys::CUstream, false) }
}

fn pattern(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// RMM: statistics_resource_adaptor<limiting_resource_adaptor<cuda_async_memory_resource>>
// ---------------------------------------------------------------------------------------------

/// RMM's usual stack over the async pool, serving typed buffers on three streams: after every
/// step the statistics equal exactly what the program holds, the limit's `used` agrees, a
/// request past the cap is a typed `OutOfMemory` that changes nothing, the same request fits
/// once a buffer is dropped, every live buffer keeps its bytes, and once everything is dropped
/// the pool holds nothing, keeps its memory, and gives it all back on `release_unused`.
#[test]
fn statistics_over_limit_over_the_async_pool_count_typed_buffers_exactly() {
    let name = "statistics_over_limit_over_the_async_pool_count_typed_buffers_exactly";
    let gpu = require_gpu!();
    let Some(pool) = async_pool(&gpu, name) else {
        return;
    };
    const CAP: usize = 16 * MIB;
    let stack = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        Arc::clone(&pool),
        CAP,
    )));
    assert_eq!(stack.name(), "statistics(limit(async-pool))");
    let resource: Arc<dyn MemoryResource> = stack.clone();
    let streams: Vec<Stream> = (0..3).map(|_| raw_stream(&gpu.context)).collect();

    // Odd sizes on purpose: the counters are in bytes asked for, not rounded.
    let lens = [3 * MIB / 4, (5 * MIB + 28) / 4, KIB];
    let mut buffers: Vec<Option<DeviceBuffer<u32>>> = Vec::new();
    let mut held = 0usize;
    for (k, (&len, s)) in lens.iter().zip(&streams).enumerate() {
        let mut buffer = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), len, s)
            .expect("within the cap");
        assert_eq!(buffer.resource_name(), "statistics(limit(async-pool))");
        assert_eq!(buffer.allocated_bytes(), len * 4);
        buffer
            .copy_from_host_async(pattern(len, k as u32), s)
            .expect("upload")
            .wait()
            .expect("uploaded");
        held += len * 4;
        buffers.push(Some(buffer));
        let stats = stack.stats();
        assert_eq!(stats.current_bytes, held, "after buffer {k}");
        assert_eq!(stats.current_allocations, k + 1);
        assert_eq!(stats.total_allocations, k as u64 + 1);
        assert_eq!(stack.upstream().used(), held);
        assert_eq!(pool.outstanding(), k + 1);
    }
    let first_peak = held;

    // 8 MiB more would pass the cap: refused, typed, nothing changes.
    let request = 8 * MIB;
    assert!(held + request > CAP);
    match DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), request / 4, &streams[2]) {
        Err(MemoryError::OutOfMemory {
            requested,
            allocated,
            limit,
            ..
        }) => {
            assert_eq!((requested, allocated, limit), (request, held, Some(CAP)));
        }
        other => panic!("a request past the cap must be a typed OutOfMemory: {other:?}"),
    }
    let stats = stack.stats();
    assert_eq!(stats.failed_allocations, 1);
    assert_eq!((stats.current_bytes, stats.current_allocations), (held, 3));
    assert_eq!(stack.upstream().used(), held);
    assert_eq!(pool.outstanding(), 3, "the pool was never asked");

    // Dropping the 5 MiB buffer makes room: the same request now fits.
    let dropped = buffers[1].take().expect("buffer 1");
    held -= dropped.byte_size();
    drop(dropped);
    assert_eq!(stack.stats().current_bytes, held);
    let mut big =
        DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), request / 4, &streams[2])
            .expect("fits after the drop");
    big.fill_async(C_VALUE, &streams[2]).expect("fill");
    held += request;
    let stats = stack.stats();
    assert_eq!(stats.current_bytes, held);
    assert_eq!(stats.peak_bytes, held.max(first_peak));
    assert_eq!(stats.peak_allocations, 3);
    assert_eq!((stats.total_allocations, stats.total_deallocations), (4, 1));
    stack.reset_peak();
    let stats = stack.stats();
    assert_eq!(
        (stats.peak_bytes, stats.peak_allocations),
        (held, stats.current_allocations)
    );

    // Every live buffer kept its bytes.
    for (k, buffer) in buffers.iter().enumerate() {
        if let Some(buffer) = buffer {
            assert!(
                buffer.to_vec().expect("download") == pattern(lens[k], k as u32),
                "buffer {k} changed"
            );
        }
    }
    assert!(
        big.to_vec()
            .expect("download")
            .iter()
            .all(|&v| v == C_VALUE)
    );

    drop(buffers);
    drop(big);
    gpu.context.synchronize().expect("sync");
    let stats = stack.stats();
    assert_eq!((stats.current_bytes, stats.current_allocations), (0, 0));
    assert_eq!((stats.total_allocations, stats.total_deallocations), (4, 4));
    assert_eq!(stats.failed_allocations, 1);
    assert_eq!(stack.upstream().used(), 0);
    assert_eq!(pool.outstanding(), 0);
    assert_eq!(pool.pool().used_bytes().expect("used"), 0);
    assert!(
        pool.pool().reserved_bytes().expect("reserved") >= request as u64,
        "the async pool keeps what was freed"
    );
    stack.release_unused().expect("release through the stack");
    assert_eq!(pool.pool().reserved_bytes().expect("reserved"), 0);
}

/// PyTorch's `cudaMallocAsync` backend under a per-process memory fraction: a training loop on
/// four streams allocates activations until the limit refuses, frees the oldest and retries.
/// Over 300 steps the counters always equal the sum of what is live, the cap is never passed,
/// every refusal is counted, and each surviving activation holds exactly its step's value.
#[test]
fn a_training_loop_under_a_limit_frees_its_oldest_activations_and_retries_exactly() {
    let name = "a_training_loop_under_a_limit_frees_its_oldest_activations_and_retries_exactly";
    let gpu = require_gpu!();
    let Some(pool) = async_pool(&gpu, name) else {
        return;
    };
    const CAP: usize = 24 * MIB;
    let stack = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        Arc::clone(&pool),
        CAP,
    )));
    let resource: Arc<dyn MemoryResource> = stack.clone();
    let streams: Vec<Stream> = (0..4).map(|_| raw_stream(&gpu.context)).collect();
    let mut live: std::collections::VecDeque<(u32, DeviceBuffer<u32>)> = Default::default();
    let mut refusals = 0u64;
    let mut state = 7u64;
    for step in 0..300u32 {
        let s = &streams[step as usize % streams.len()];
        let len = 64 * KIB + next(&mut state) % (3 * MIB / 4);
        let mut buffer = loop {
            match DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), len, s) {
                Ok(buffer) => break buffer,
                Err(error) => {
                    assert!(
                        matches!(
                            error,
                            MemoryError::OutOfMemory {
                                limit: Some(CAP),
                                ..
                            }
                        ),
                        "step {step}: {error:?}"
                    );
                    refusals += 1;
                    let (_, oldest) = live.pop_front().expect("something to free");
                    drop(oldest);
                }
            }
        };
        buffer.fill_async(step, s).expect("fill");
        live.push_back((step, buffer));
        let held: usize = live.iter().map(|(_, b)| b.byte_size()).sum();
        let stats = stack.stats();
        assert_eq!(stats.current_bytes, held, "step {step}");
        assert_eq!(stats.current_allocations, live.len());
        assert_eq!(stack.upstream().used(), held);
        assert!(stats.peak_bytes <= CAP);
        assert_eq!(stats.failed_allocations, refusals);
    }
    assert!(refusals > 0, "the loop must have run into the limit");
    for (step, buffer) in &live {
        assert!(
            buffer.to_vec().expect("download").iter().all(|v| v == step),
            "the activation of step {step} changed"
        );
    }
    let stats = stack.stats();
    assert_eq!(stats.total_allocations, 300);
    assert_eq!(stats.total_deallocations, 300 - live.len() as u64);
    drop(live);
    gpu.context.synchronize().expect("sync");
    assert_eq!(stack.stats().current_bytes, 0);
    assert_eq!(pool.outstanding(), 0);
    assert_eq!(pool.pool().used_bytes().expect("used"), 0);
}

// ---------------------------------------------------------------------------------------------
// Allocated on one stream, used on a second, freed on a third
// ---------------------------------------------------------------------------------------------

/// cudarc's stream-ordered `alloc` / `free` on three streams: A allocates and fills, B (after
/// `join`ing A) runs a slow watch that rescans the block, C (after joining B) frees it and
/// allocates the same size until the pool hands the block back, then overwrites it. C's free
/// is ordered after the watch, so the watch must count no changed element, and C's checksum
/// is exactly its own data.
#[test]
fn async_pool_memory_used_on_b_and_freed_on_c_is_not_reused_under_bs_watch() {
    let name = "async_pool_memory_used_on_b_and_freed_on_c_is_not_reused_under_bs_watch";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(name, "needs C's fill to overlap B's watch") {
        return;
    }
    let Some(pool) = async_pool(&gpu, name) else {
        return;
    };
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let (a, b, c) = (
        raw_stream(&gpu.context),
        raw_stream(&gpu.context),
        raw_stream(&gpu.context),
    );
    let mismatches = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).expect("mismatches");
    let sum = DeviceBuffer::<u64>::zeroed(&gpu.context, 1).expect("sum");
    let bytes = N * 4;

    let ptr = pool.allocate(bytes, &a).expect("allocate on A");
    // SAFETY: `ptr` holds N u32s ordered on `a`; it is freed only on `c` after `c` waited for
    // `b`, which waited for `a`.
    unsafe { kernels.fill_u32(&a, ptr, A_VALUE, N) }.expect("fill on A");
    b.wait_stream(&a).expect("B joins A");
    // SAFETY: as above; `mismatches` is one u32 alive until after the synchronisations below.
    unsafe { kernels.watch_u32(&b, ptr, N, A_VALUE, 150 * MS, mismatches.device_ptr()) }
        .expect("watch on B");
    c.wait_stream(&b).expect("C joins B");
    pool.deallocate(ptr, bytes, &c).expect("free on C");
    assert_eq!(pool.outstanding(), 0);

    // C allocates the same size until the pool hands the block back (it may first hand out
    // never-used memory of its chunk), and fills every block it got: each is ordered after the
    // free, so none may land under the watch.
    let mut held = Vec::new();
    for _ in 0..16 {
        let p = pool.allocate(bytes, &c).expect("allocate on C");
        held.push(p);
        if p == ptr {
            break;
        }
    }
    let reused = held.last() == Some(&ptr);
    let last = *held.last().expect("one block at least");
    for &p in &held {
        // SAFETY: `p` is C's live allocation of N u32s, ordered on `c`.
        unsafe { kernels.fill_u32(&c, p, C_VALUE, N) }.expect("fill on C");
    }
    // SAFETY: `last` is C's live allocation; `sum` is one u64 alive until after the sync.
    unsafe { kernels.checksum_u32(&c, last, N, sum.device_ptr()) }.expect("checksum on C");
    c.synchronize().expect("sync C");
    b.synchronize().expect("sync B");
    assert_eq!(
        mismatches.to_vec().expect("mismatches")[0],
        0,
        "B's watch saw C's writes: the block was reused under it (old block reused: {reused})"
    );
    assert_eq!(sum.to_vec().expect("sum")[0], u64::from(C_VALUE) * N as u64);
    assert!(
        reused,
        "the pool hands the freed block back on the stream that freed it (else the proof above \
         proves nothing)"
    );
    for p in held {
        pool.deallocate(p, bytes, &c).expect("free");
    }
    c.synchronize().expect("sync C");
    assert_eq!(pool.outstanding(), 0);
}

/// A typed buffer of the stream-ordered allocator (RMM's `device_uvector` on a stream): filled
/// on A, read by a slow tracked watch on B, moved to another thread and dropped there. C then
/// takes buffers of the same size from the same pool until it gets the old address (or 16),
/// filling each: the watch must count no changed element, and every new buffer holds C's value.
#[test]
fn a_typed_pool_buffer_dropped_on_another_thread_is_not_reused_under_a_tracked_read() {
    let name = "a_typed_pool_buffer_dropped_on_another_thread_is_not_reused_under_a_tracked_read";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(name, "needs C's fills to overlap B's watch") || !has_pools(&gpu, name)
    {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let (a, b, c) = (
        normal_stream(&gpu.context),
        normal_stream(&gpu.context),
        normal_stream(&gpu.context),
    );
    let allocator = StreamOrderedAllocator::default();
    let mismatches = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).expect("mismatches");

    let mut x = allocator.buffer::<u32>(&a, N).expect("x on A");
    a.fill(&mut x, A_VALUE).expect("fill on A");
    x.prepare_read(b.stream()).expect("B waits for the fill");
    let (x_ptr, watched) = (x.device_ptr(), mismatches.device_ptr());
    // SAFETY: `x` holds N u32s and is kept alive (by its tracked read, recorded below) until
    // the watch is done; `mismatches` lives until after the synchronisations.
    b.launch(|s| unsafe { kernels.watch_u32(s, x_ptr, N, A_VALUE, 150 * MS, watched) })
        .expect("watch on B");
    x.record_read(b.stream()).expect("record the read");
    std::thread::spawn(move || drop(x))
        .join()
        .expect("drop on another thread");

    let mut held = Vec::new();
    let mut reused = false;
    for _ in 0..16 {
        let mut y = allocator.buffer::<u32>(&c, N).expect("y on C");
        c.fill(&mut y, C_VALUE).expect("fill on C");
        reused = y.device_ptr() == x_ptr;
        held.push(y);
        if reused {
            break;
        }
    }
    c.synchronize().expect("sync C");
    b.synchronize().expect("sync B");
    eprintln!("{name}: the old block came back: {reused}");
    assert_eq!(
        mismatches.to_vec().expect("mismatches")[0],
        0,
        "the watch on B saw a later buffer's fill (old block reused: {reused})"
    );
    for y in &held {
        assert!(y.to_vec().expect("download").iter().all(|&v| v == C_VALUE));
    }
    drop(held);
    gpu.context.synchronize().expect("sync");
}

// ---------------------------------------------------------------------------------------------
// Dropping the allocator and its streams under queued work
// ---------------------------------------------------------------------------------------------

/// A program tears down its allocator and streams while work is still queued: a raw allocation
/// filled behind a spin on A and summed on B (after a recorded dependency), and a typed buffer
/// of the same pool filled on A. The allocator's drop frees the raw allocation in stream order
/// after B; the typed buffer keeps the pool alive and is read on a new stream. The sum and the
/// buffer are exact, and a new allocator works afterwards.
#[test]
fn dropping_the_allocator_and_its_streams_under_queued_work_stays_safe_and_exact() {
    let name = "dropping_the_allocator_and_its_streams_under_queued_work_stays_safe_and_exact";
    let gpu = require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let sum = DeviceBuffer::<u64>::zeroed(&gpu.context, 1).expect("sum");
    let sum_ptr = sum.device_ptr();
    let (a, b) = (normal_stream(&gpu.context), normal_stream(&gpu.context));
    let allocator = StreamOrderedAllocator::default();
    let block = allocator.allocate_for_stream(&a, N * 4).expect("raw");
    let ptr = allocator.device_ptr(&block).expect("ptr");
    a.launch(|s| kernels.spin_ns(s, 100 * MS))
        .expect("spin on A");
    // SAFETY: the block holds N u32s on `a`; `b` uses it only after the dependency below, and
    // the allocator frees it only after `b`'s work (it was given to `b`).
    a.launch(|s| unsafe { kernels.fill_u32(s, ptr, A_VALUE, N) })
        .expect("fill on A");
    allocator.add_stream_dependency(&b, &a).expect("B after A");
    // SAFETY: as above; `sum` is one u64 alive until after the final synchronisation.
    b.launch(|s| unsafe { kernels.checksum_u32(s, ptr, N, sum_ptr) })
        .expect("sum on B");
    let mut typed = allocator.buffer::<u32>(&a, N).expect("typed");
    a.fill(&mut typed, C_VALUE)
        .expect("typed fill behind the spin");
    assert_eq!(allocator.outstanding(), 1);

    // Everything but the typed buffer goes while the spin still holds A.
    drop(allocator);
    drop(a);
    drop(b);

    let c = normal_stream(&gpu.context);
    let back = c
        .copy_to_host(&typed, vec![0u32; N])
        .expect("download on a new stream")
        .wait()
        .expect("downloaded");
    assert!(
        back.iter().all(|&v| v == C_VALUE),
        "the typed buffer outlived its allocator"
    );
    drop(typed);
    gpu.context.synchronize().expect("sync");
    assert_eq!(
        sum.to_vec().expect("sum")[0],
        u64::from(A_VALUE) * N as u64,
        "B summed A's fill, not a reused block"
    );

    let fresh = StreamOrderedAllocator::default();
    let block = fresh
        .allocate_for_stream(&c, 4096)
        .expect("a new allocator works");
    assert_eq!(fresh.free_for_stream(&c).expect("free"), 1);
    let _ = block;
    c.synchronize().expect("sync");
    assert_eq!(fresh.stats().live, 0);
}

// ---------------------------------------------------------------------------------------------
// Long-running loops
// ---------------------------------------------------------------------------------------------

/// 2·10^4 typed buffers of the async pool through a statistics adaptor, one live at a time on
/// two alternating streams, and 10^5 raw stream-ordered allocate/free cycles with a dependency
/// every 16: the counters balance exactly, the peaks say one at a time, spot-checked data is
/// exact, and neither pool's reserve grows with the number of iterations.
#[test]
fn a_hundred_thousand_stream_ordered_cycles_keep_counters_exact_and_reserves_flat() {
    let name = "a_hundred_thousand_stream_ordered_cycles_keep_counters_exact_and_reserves_flat";
    let gpu = require_gpu!();
    let _serial = serial();
    let Some(pool) = async_pool(&gpu, name) else {
        return;
    };
    let counted = Arc::new(StatisticsAdaptor::new(Arc::clone(&pool)));
    let resource: Arc<dyn MemoryResource> = counted.clone();
    let streams = [raw_stream(&gpu.context), raw_stream(&gpu.context)];
    const TYPED: u32 = 20_000;
    let sizes = [1usize, 1000, 64 * KIB, 300 * KIB];
    for i in 0..TYPED {
        let s = &streams[i as usize % 2];
        let len = sizes[i as usize % sizes.len()];
        let mut buffer =
            DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), len, s).expect("typed");
        buffer.fill_async(i, s).expect("fill");
        if i % 2000 == 1999 {
            assert!(
                buffer.to_vec().expect("download").iter().all(|&v| v == i),
                "iteration {i}"
            );
        }
    }
    gpu.context.synchronize().expect("sync");
    let stats = counted.stats();
    assert_eq!(
        (stats.total_allocations, stats.total_deallocations),
        (u64::from(TYPED), u64::from(TYPED))
    );
    assert_eq!((stats.current_bytes, stats.current_allocations), (0, 0));
    assert_eq!(stats.peak_allocations, 1, "one buffer alive at a time");
    assert_eq!(stats.peak_bytes, 300 * KIB * 4);
    assert_eq!(pool.outstanding(), 0);
    let reserved = pool.pool().reserved_bytes().expect("reserved");
    assert!(
        reserved <= 64 * MIB as u64,
        "{TYPED} typed buffers kept {reserved} bytes reserved"
    );

    let (a, b) = (normal_stream(&gpu.context), normal_stream(&gpu.context));
    let allocator = StreamOrderedAllocator::new(
        StreamOrderedAllocatorConfig::with_release_threshold(64 << 20),
    );
    const RAW: u64 = 100_000;
    let raw_sizes = [100usize, 4000, 70_000, (1 << 20) + 1];
    for i in 0..RAW {
        let s = if i % 2 == 0 { &a } else { &b };
        let block = allocator
            .allocate_for_stream(s, raw_sizes[i as usize % raw_sizes.len()])
            .expect("raw");
        if i % 16 == 0 {
            let other = if i % 2 == 0 { &b } else { &a };
            allocator
                .add_stream_dependency(other, s)
                .expect("dependency");
        }
        allocator.free(block).expect("free");
        if i % 10_000 == 9_999 {
            assert_eq!(allocator.outstanding(), 0);
            a.synchronize().expect("sync A");
            b.synchronize().expect("sync B");
        }
    }
    a.synchronize().expect("sync A");
    b.synchronize().expect("sync B");
    let stats = allocator.stats();
    assert_eq!((stats.allocations, stats.frees, stats.live), (RAW, RAW, 0));
    assert_eq!((stats.live_bytes, stats.requested_bytes), (0, 0));
    assert_eq!(
        stats.peak_bytes,
        2 << 20,
        "one block (at most 2 MiB) at a time"
    );
    assert_eq!(stats.dependencies, RAW / 16);
    let per_class: u64 = stats.classes.iter().map(|c| c.allocations).sum();
    assert_eq!(per_class, RAW);
    assert!(stats.classes.iter().all(|c| c.allocations == c.frees));
    assert!(allocator.dependencies_satisfied(&a).expect("query"));
    assert!(allocator.dependencies_satisfied(&b).expect("query"));
    let reserved = allocator
        .reserved_bytes(gpu.device.ordinal())
        .expect("reserved");
    assert!(
        reserved <= 64 << 20,
        "{RAW} cycles kept {reserved} bytes reserved"
    );
    assert_eq!(a.outstanding_work().expect("A"), 0);
    assert_eq!(b.outstanding_work().expect("B"), 0);
}

// ---------------------------------------------------------------------------------------------
// Many threads
// ---------------------------------------------------------------------------------------------

/// Eight threads, each on its own stream, share one stream-ordered allocator: every step
/// allocates a random size, fills it with the thread's step value, sums it into the thread's
/// own slot and frees it; every eighth step also round-trips a typed buffer of the same pool
/// and increments it with a tracked kernel. Every sum and every typed buffer is exact, and the
/// allocator's books balance to zero.
#[test]
fn eight_threads_on_their_own_streams_allocate_and_free_through_one_allocator_exactly() {
    let name = "eight_threads_on_their_own_streams_allocate_and_free_through_one_allocator_exactly";
    let gpu = require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    const THREADS: usize = 8;
    const STEPS: usize = 400;
    let kit = Kit::load(&gpu.context, 1 << 16);
    let allocator = StreamOrderedAllocator::default();
    let start = Barrier::new(THREADS);
    let typed_checked = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (kit, allocator, start, typed_checked, gpu) =
                (&kit, &allocator, &start, &typed_checked, &gpu);
            scope.spawn(move || {
                let s = normal_stream(&gpu.context);
                let sums = DeviceBuffer::<u64>::zeroed(&gpu.context, STEPS).expect("sums");
                let sums_ptr = sums.device_ptr();
                let mut state = t as u64 + 1;
                let mut lens = Vec::with_capacity(STEPS);
                start.wait();
                for step in 0..STEPS {
                    let len = 1 + next(&mut state) % (64 * KIB);
                    lens.push(len);
                    let block = allocator
                        .allocate_for_stream(&s, len * 4)
                        .expect("allocate");
                    let ptr = allocator.device_ptr(&block).expect("ptr");
                    let value = (t * STEPS + step) as u32;
                    let out = sums_ptr + 8 * step as u64;
                    // SAFETY: the block holds at least `len` u32s on `s`, freed in `s`'s order
                    // below; `out` is this step's u64 of `sums`, alive until after the sync.
                    s.launch(|st| unsafe {
                        kit.test.fill_u32(st, ptr, value, len)?;
                        kit.test.checksum_u32(st, ptr, len, out)
                    })
                    .expect("fill and sum");
                    allocator.free(block).expect("free");
                    if step % 8 == 0 {
                        let data = pattern(len, value);
                        let mut typed = allocator.buffer::<u32>(&s, len).expect("typed");
                        s.copy_from_host(&mut typed, data.clone())
                            .expect("upload")
                            .wait()
                            .expect("uploaded");
                        kit.increment(s.stream(), &mut typed).expect("increment");
                        let back = s
                            .copy_to_host(&typed, vec![0u32; len])
                            .expect("download")
                            .wait()
                            .expect("downloaded");
                        assert!(
                            back.iter().zip(&data).all(|(b, d)| *b == d.wrapping_add(1)),
                            "thread {t} step {step}: typed buffer"
                        );
                        typed_checked.fetch_add(1, Ordering::Relaxed);
                    }
                }
                s.synchronize().expect("sync");
                let sums = sums.to_vec().expect("sums");
                for (step, (sum, len)) in sums.iter().zip(&lens).enumerate() {
                    let value = (t * STEPS + step) as u64;
                    assert_eq!(*sum, value * *len as u64, "thread {t} step {step}");
                }
            });
        }
    });
    assert_eq!(
        typed_checked.load(Ordering::Relaxed),
        (THREADS * STEPS.div_ceil(8)) as u64
    );
    let stats = allocator.stats();
    let total = (THREADS * STEPS) as u64;
    assert_eq!(
        (stats.allocations, stats.frees, stats.live),
        (total, total, 0)
    );
    assert_eq!((stats.live_bytes, stats.requested_bytes), (0, 0));
    assert_eq!(allocator.outstanding(), 0);
}

/// A worker thread allocates on a stream while a cleanup thread keeps calling
/// `free_for_stream` on the same stream (a server freeing a request's scratch as the request
/// still grows it). Every allocation is freed exactly once, and the statistics balance: no
/// free is counted before its allocation (which would take `live` below zero: an overflow
/// panic in a debug build, a wrapped `live_bytes` and a nonsense peak in a release one).
#[test]
fn allocating_while_another_thread_frees_the_same_stream_keeps_the_books_exact() {
    let name = "allocating_while_another_thread_frees_the_same_stream_keeps_the_books_exact";
    let gpu = require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    const ALLOCATORS: usize = 4;
    const FREERS: usize = 4;
    const EACH: usize = 5_000;
    let s = normal_stream(&gpu.context);
    let allocator = StreamOrderedAllocator::default();
    let done = AtomicBool::new(false);
    let freed = AtomicU64::new(0);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..ALLOCATORS)
            .map(|_| {
                let (allocator, s) = (&allocator, &s);
                scope.spawn(move || {
                    for _ in 0..EACH {
                        allocator.allocate_for_stream(s, 512).expect("allocate");
                    }
                })
            })
            .collect();
        for _ in 0..FREERS {
            let (allocator, s, done, freed) = (&allocator, &s, &done, &freed);
            scope.spawn(move || {
                while !done.load(Ordering::Acquire) {
                    let n = allocator.free_for_stream(s).expect("free_for_stream");
                    freed.fetch_add(n as u64, Ordering::Relaxed);
                }
            });
        }
        // A metrics exporter reading the statistics meanwhile: a snapshot never shows more
        // frees than allocations, nor a `live` count below zero (wrapped).
        let (allocator, done) = (&allocator, &done);
        let monitor = scope.spawn(move || {
            let total = (ALLOCATORS * EACH) as u64;
            let mut snapshots = 0u64;
            while !done.load(Ordering::Acquire) {
                let stats = allocator.stats();
                assert!(
                    stats.frees <= stats.allocations && stats.live <= total,
                    "a free was counted before its allocation: {stats}"
                );
                assert_eq!(stats.live_bytes, stats.live * 512, "{stats}");
                snapshots += 1;
            }
            snapshots
        });
        for worker in workers {
            worker.join().expect("allocating thread");
        }
        done.store(true, Ordering::Release);
        let snapshots = monitor.join().expect("monitor");
        eprintln!("{snapshots} statistics snapshots taken meanwhile");
    });
    let rest = allocator.free_for_stream(&s).expect("the rest");
    let total = (ALLOCATORS * EACH) as u64;
    assert_eq!(freed.load(Ordering::Relaxed) + rest as u64, total);
    s.synchronize().expect("sync");
    let stats = allocator.stats();
    assert_eq!(
        (stats.allocations, stats.frees, stats.live),
        (total, total, 0)
    );
    assert_eq!((stats.live_bytes, stats.requested_bytes), (0, 0));
    assert!(
        stats.peak_bytes <= total * 512,
        "peak {} bytes is more than was ever allocated",
        stats.peak_bytes
    );
    assert_eq!(stats.classes[0].allocations, stats.classes[0].frees);
    assert_eq!(allocator.outstanding(), 0);
}

// ---------------------------------------------------------------------------------------------
// The per-thread default stream
// ---------------------------------------------------------------------------------------------

/// `rmm::cuda_stream_per_thread` with the stream-ordered allocator's raw receipts: one
/// `PriorityStream` wrapping `CU_STREAM_PER_THREAD` names a different stream on each thread.
/// The allocator must refuse it with a typed error, or else keep its promise anyway: here
/// thread 1 fills a block and watches it on its per-thread stream, thread 2 frees it through
/// the allocator (on the block's "owner") and allocates on the owner again until the block
/// comes back, then fills it. If the free was queued on thread 2's own per-thread stream, it
/// was not ordered after the watch, and the watch sees the new fill.
#[test]
fn the_per_thread_default_stream_is_refused_or_kept_in_order_by_the_stream_ordered_allocator() {
    let name =
        "the_per_thread_default_stream_is_refused_or_kept_in_order_by_the_stream_ordered_allocator";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(name, "needs another thread's fill to overlap the watch")
        || !has_pools(&gpu, name)
    {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let mismatches = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).expect("mismatches");
    let watched = mismatches.device_ptr();
    let owner = Arc::new(
        PriorityStream::from_stream(per_thread_stream(&gpu.context)).expect("wrap per-thread"),
    );
    let allocator = StreamOrderedAllocator::default();
    let block = match allocator.allocate_for_stream(&owner, N * 4) {
        Ok(block) => block,
        Err(error) => {
            assert!(
                matches!(
                    error,
                    StreamError::InvalidArgument { .. }
                        | StreamError::Memory(MemoryError::InvalidStream { .. })
                ),
                "a refusal must be typed: {error:?}"
            );
            assert_eq!(allocator.outstanding(), 0);
            return;
        }
    };
    let ptr = allocator.device_ptr(&block).expect("ptr");
    // SAFETY: the block holds N u32s on `owner` (this thread's per-thread stream); it is freed
    // only through the allocator, on its owner; `mismatches` lives until after the syncs.
    owner
        .launch(|s| unsafe {
            kernels.fill_u32(s, ptr, A_VALUE, N)?;
            kernels.watch_u32(s, ptr, N, A_VALUE, 200 * MS, watched)
        })
        .expect("fill and watch on this thread's per-thread stream");

    let reused = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                allocator.free(block).expect("free on the owner");
                let mut reused = false;
                for _ in 0..16 {
                    let next = allocator.allocate_for_stream(&owner, N * 4).expect("again");
                    if allocator.device_ptr(&next).expect("ptr") == ptr {
                        reused = true;
                        break;
                    }
                }
                if reused {
                    // SAFETY: the block is this thread's live allocation on `owner` again, as
                    // the allocator's contract reads: used on its owner stream.
                    owner
                        .launch(|s| unsafe { kernels.fill_u32(s, ptr, C_VALUE, N) })
                        .expect("fill");
                }
                owner.synchronize().expect("sync this thread's stream");
                assert!(allocator.free_for_stream(&owner).is_ok());
                owner.synchronize().expect("sync this thread's stream");
                reused
            })
            .join()
            .expect("second thread")
    });
    owner.synchronize().expect("sync");
    gpu.context.synchronize().expect("sync");
    let seen = mismatches.to_vec().expect("mismatches")[0];
    assert_eq!(
        seen, 0,
        "the watch on thread 1's per-thread stream saw {seen} changed reads: the allocation was \
         freed on thread 2's per-thread stream, unordered after it (block reused: {reused})"
    );
    assert_eq!(allocator.outstanding(), 0);
}

/// `rmm::device_buffer(size, cuda_stream_per_thread, async_mr)` and the allocator's typed
/// buffers on a per-thread `PriorityStream`: made and filled behind a spin on one thread,
/// downloaded and refilled on a second thread's per-thread stream, dropped on a third. Either
/// the stream is refused with a typed error, or every byte moves in order.
#[test]
fn typed_buffers_on_the_per_thread_stream_move_across_threads_in_order_or_are_refused() {
    let name = "typed_buffers_on_the_per_thread_stream_move_across_threads_in_order_or_are_refused";
    let gpu = require_gpu!();
    let _serial = serial();
    let Some(pool) = async_pool(&gpu, name) else {
        return;
    };
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let resource: Arc<dyn MemoryResource> = pool.clone();
    let allocator = StreamOrderedAllocator::default();
    const LEN: usize = 1 << 18;
    for via_allocator in [false, true] {
        let made = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let pt = per_thread_stream(&gpu.context);
                    let made = if via_allocator {
                        let owner = Arc::new(PriorityStream::from_stream(pt).expect("wrap"));
                        allocator
                            .buffer::<u32>(&owner, LEN)
                            .map_err(|e| format!("{e:?}"))
                    } else {
                        DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), LEN, &pt)
                            .map_err(|e| format!("{e:?}"))
                    };
                    let mut buffer = match made {
                        Ok(buffer) => buffer,
                        Err(error) => {
                            assert!(
                                error.contains("InvalidStream")
                                    || error.contains("InvalidArgument"),
                                "a refusal must be typed: {error}"
                            );
                            return None;
                        }
                    };
                    let pt = per_thread_stream(&gpu.context);
                    kernels.spin_ns(&pt, 50 * MS).expect("spin");
                    buffer
                        .fill_async(A_VALUE, &pt)
                        .expect("fill behind the spin");
                    Some(buffer)
                })
                .join()
                .expect("first thread")
        });
        let Some(buffer) = made else {
            continue;
        };
        let (kernels, gpu) = (&kernels, &gpu);
        let buffer = std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    let mut buffer = buffer;
                    let pt = per_thread_stream(&gpu.context);
                    let back = buffer
                        .copy_to_host_async(vec![0u32; LEN], &pt)
                        .expect("download")
                        .wait()
                        .expect("downloaded");
                    assert!(
                        back.iter().all(|&v| v == A_VALUE),
                        "via_allocator {via_allocator}: the other thread's fill"
                    );
                    kernels.spin_ns(&pt, 30 * MS).expect("spin");
                    buffer.fill_async(C_VALUE, &pt).expect("refill");
                    buffer
                })
                .join()
                .expect("second thread")
        });
        assert!(
            buffer.to_vec().expect("read").iter().all(|&v| v == C_VALUE),
            "via_allocator {via_allocator}: the second thread's refill"
        );
        std::thread::spawn(move || drop(buffer))
            .join()
            .expect("drop on a third thread");
    }
    gpu.context.synchronize().expect("sync");
    assert_eq!(pool.outstanding(), 0);
}

// ---------------------------------------------------------------------------------------------
// The release threshold and trimming
// ---------------------------------------------------------------------------------------------

/// PyTorch's `empty_cache` for the `cudaMallocAsync` backend and RMM's release threshold: a pool
/// with threshold 0 gives freed memory back at the next synchronisation; one with the default
/// threshold keeps it until `trim`, which keeps a live allocation (whose bytes stay exact) and
/// gives the rest back once that is freed too.
#[test]
fn the_release_threshold_and_trim_give_back_only_unused_pool_memory() {
    let name = "the_release_threshold_and_trim_give_back_only_unused_pool_memory";
    let gpu = require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let device = gpu.device.ordinal();
    let s = normal_stream(&gpu.context);
    const BLOCK: usize = 4 * MIB;

    let eager =
        StreamOrderedAllocator::new(StreamOrderedAllocatorConfig::with_release_threshold(0));
    assert_eq!(eager.reserved_bytes(device).expect("before"), 0);
    for _ in 0..8 {
        eager.allocate_for_stream(&s, BLOCK).expect("allocate");
    }
    assert!(eager.reserved_bytes(device).expect("reserved") >= 8 * BLOCK as u64);
    assert_eq!(eager.free_for_stream(&s).expect("free"), 8);
    s.synchronize().expect("sync");
    gpu.context.synchronize().expect("sync");
    assert_eq!(
        eager.reserved_bytes(device).expect("reserved"),
        0,
        "threshold 0: freed memory goes back at the synchronisation"
    );

    let keeping = StreamOrderedAllocator::default();
    let blocks: Vec<_> = (0..8)
        .map(|_| keeping.allocate_for_stream(&s, BLOCK).expect("allocate"))
        .collect();
    let kept = blocks[3];
    let kept_ptr = keeping.device_ptr(&kept).expect("ptr");
    // SAFETY: the kept block holds BLOCK / 4 u32s on `s` and is freed only at the end.
    s.launch(|st| unsafe { kernels.fill_u32(st, kept_ptr, C_VALUE, BLOCK / 4) })
        .expect("fill");
    for block in blocks.iter().filter(|b| b.id() != kept.id()) {
        keeping.free(*block).expect("free");
    }
    s.synchronize().expect("sync");
    let before_trim = keeping.reserved_bytes(device).expect("reserved");
    assert!(
        before_trim >= 8 * BLOCK as u64,
        "the default threshold keeps freed memory across a synchronisation ({before_trim})"
    );
    keeping.trim().expect("trim");
    let after_trim = keeping.reserved_bytes(device).expect("reserved");
    assert!(
        (BLOCK as u64..=before_trim).contains(&after_trim),
        "trim keeps the live block and gives nothing it needs back ({after_trim})"
    );
    let sum = DeviceBuffer::<u64>::zeroed(&gpu.context, 1).expect("sum");
    let sum_ptr = sum.device_ptr();
    // SAFETY: the kept block is live; `sum` is one u64 alive until after the sync.
    s.launch(|st| unsafe { kernels.checksum_u32(st, kept_ptr, BLOCK / 4, sum_ptr) })
        .expect("checksum");
    s.synchronize().expect("sync");
    assert_eq!(
        sum.to_vec().expect("sum")[0],
        u64::from(C_VALUE) * (BLOCK / 4) as u64,
        "trim left the live block's bytes alone"
    );
    keeping.free(kept).expect("free the kept block");
    s.synchronize().expect("sync");
    keeping.trim().expect("trim");
    assert_eq!(keeping.reserved_bytes(device).expect("reserved"), 0);
    assert_eq!(keeping.stats().live, 0);
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

/// Zero, huge and overflowing sizes, misaligned element counts, receipts of another allocator,
/// repeated and mismatched frees, and a self-dependency, through the stream-ordered allocator
/// and a statistics-over-limit stack over the async pool: each is a typed error, never a panic,
/// the books do not move, and both keep working (on the legacy default stream too, RMM's
/// `cuda_stream_default`).
#[test]
fn bad_input_to_the_allocator_and_the_async_stack_is_typed_and_leaves_them_usable() {
    let name = "bad_input_to_the_allocator_and_the_async_stack_is_typed_and_leaves_them_usable";
    let gpu = require_gpu!();
    let Some(pool) = async_pool(&gpu, name) else {
        return;
    };
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let (a, b) = (normal_stream(&gpu.context), normal_stream(&gpu.context));
    let allocator = StreamOrderedAllocator::default();

    assert!(matches!(
        allocator.allocate_for_stream(&a, 0),
        Err(StreamError::InvalidArgument { .. })
    ));
    for bytes in [usize::MAX, usize::MAX - 5] {
        assert!(matches!(
            allocator.allocate_for_stream(&a, bytes),
            Err(StreamError::InvalidArgument { .. })
        ));
    }
    for bytes in [usize::MAX / 2, 1 << 50] {
        let error = allocator
            .allocate_for_stream(&a, bytes)
            .expect_err("more than any device holds");
        eprintln!("{bytes} bytes: {error}");
    }
    assert!(matches!(
        allocator.buffer::<u32>(&a, 0),
        Err(StreamError::Memory(MemoryError::ZeroLength { .. }))
    ));
    assert!(matches!(
        allocator.buffer::<u64>(&a, usize::MAX / 4),
        Err(StreamError::Memory(MemoryError::Misaligned { .. }))
    ));
    assert!(allocator.buffer::<u8>(&a, 1 << 50).is_err());
    assert!(matches!(
        allocator.add_stream_dependency(&a, &a),
        Err(StreamError::SelfDependency { .. })
    ));
    let stats = allocator.stats();
    assert_eq!((stats.allocations, stats.live), (0, 0));
    assert_eq!(allocator.outstanding(), 0);

    let other = StreamOrderedAllocator::default();
    let foreign = other.allocate_for_stream(&a, 4096).expect("other's block");
    assert!(matches!(
        allocator.device_ptr(&foreign),
        Err(StreamError::UnknownAllocation { .. })
    ));
    assert!(matches!(
        allocator.free(foreign),
        Err(StreamError::UnknownAllocation { .. })
    ));
    assert_eq!(
        other.outstanding(),
        1,
        "a refused free leaves the owner's book alone"
    );
    other.free(foreign).expect("its own allocator frees it");
    assert_eq!(allocator.free_for_stream(&b).expect("nothing owned"), 0);

    let block = allocator
        .allocate_for_stream(&a, 3000)
        .expect("works after refusals");
    allocator.free(block).expect("free");
    assert!(matches!(
        allocator.free(block),
        Err(StreamError::UnknownAllocation { .. })
    ));
    assert!(matches!(
        allocator.device_ptr(&block),
        Err(StreamError::UnknownAllocation { .. })
    ));

    // RMM's cuda_stream_default: the legacy stream as an owner works and round-trips.
    let legacy = Arc::new(
        PriorityStream::from_stream(Stream::legacy_default(&gpu.context)).expect("legacy"),
    );
    let block = allocator
        .allocate_for_stream(&legacy, 1000 * 4)
        .expect("legacy");
    let ptr = allocator.device_ptr(&block).expect("ptr");
    let sum = DeviceBuffer::<u64>::zeroed(&gpu.context, 1).expect("sum");
    let sum_ptr = sum.device_ptr();
    // SAFETY: the block holds 1000 u32s on the legacy stream, freed below in its order; `sum`
    // is one u64 alive until after the sync.
    legacy
        .launch(|s| unsafe {
            kernels.fill_u32(s, ptr, 7, 1000)?;
            kernels.checksum_u32(s, ptr, 1000, sum_ptr)
        })
        .expect("fill and sum");
    assert_eq!(allocator.free_for_stream(&legacy).expect("free"), 1);
    legacy.synchronize().expect("sync");
    assert_eq!(sum.to_vec().expect("sum")[0], 7000);

    // The stack.
    const CAP: usize = 8 * MIB;
    let stack = StatisticsAdaptor::new(LimitAdaptor::new(Arc::clone(&pool), CAP));
    let s = a.stream();
    assert!(matches!(
        stack.allocate(0, s),
        Err(MemoryError::ZeroLength { .. })
    ));
    for bytes in [usize::MAX, CAP + 1, 1 << 50] {
        assert!(matches!(
            stack.allocate(bytes, s),
            Err(MemoryError::OutOfMemory {
                limit: Some(CAP),
                ..
            })
        ));
    }
    let ptr = stack.allocate(MIB, s).expect("within the cap");
    let held = stack.stats();
    assert!(matches!(
        stack.deallocate(ptr, 512, s),
        Err(MemoryError::SizeMismatch { expected, actual: 512, .. }) if expected == MIB
    ));
    assert!(matches!(
        stack.deallocate(ptr + 4, MIB, s),
        Err(MemoryError::UnknownAllocation { .. })
    ));
    let after = stack.stats();
    assert_eq!(
        (after.current_bytes, after.total_deallocations),
        (held.current_bytes, 0),
        "refused frees are not counted"
    );
    assert_eq!(stack.upstream().used(), MIB);
    assert_eq!(pool.outstanding(), 1, "the allocation is still live");
    stack.deallocate(ptr, MIB, s).expect("the right free");
    assert!(matches!(
        stack.deallocate(ptr, MIB, s),
        Err(MemoryError::UnknownAllocation { .. })
    ));
    let stats = stack.stats();
    assert_eq!(stats.failed_allocations, 4, "zero and three past the cap");
    assert_eq!((stats.current_bytes, stats.total_deallocations), (0, 1));
    assert_eq!(stack.upstream().used(), 0);
    let resource: Arc<dyn MemoryResource> = Arc::new(stack);
    assert!(matches!(
        DeviceBuffer::<u64>::with_resource(Arc::clone(&resource), usize::MAX / 4, s),
        Err(MemoryError::Misaligned { .. })
    ));
    let mut buffer =
        DeviceBuffer::<u32>::with_resource(resource, 1000, s).expect("the stack still works");
    buffer
        .copy_from_host_async(pattern(1000, 9), s)
        .expect("upload")
        .wait()
        .expect("uploaded");
    assert_eq!(buffer.to_vec().expect("download"), pattern(1000, 9));
    drop(buffer);
    gpu.context.synchronize().expect("sync");
    assert_eq!(pool.outstanding(), 0);
}

// ---------------------------------------------------------------------------------------------
// Two devices
// ---------------------------------------------------------------------------------------------

/// Streams of device 1 handed to device 0's pool, stack, typed buffers and allocator
/// dependencies: typed `WrongDevice` errors that reserve nothing and leave a device-0
/// allocation live; the allocator makes one pool per device and frees each on its own.
#[test]
fn streams_of_another_device_are_typed_errors_and_each_device_gets_its_own_pool() {
    let name = "streams_of_another_device_are_typed_errors_and_each_device_gets_its_own_pool";
    let gpu = require_gpu!();
    let count = Device::count().expect("count");
    if count < 2 {
        skip(name, &format!("needs two GPUs, found {count}"));
        return;
    }
    let device1 = Device::get(1).expect("device 1");
    if !device1.supports_memory_pools().unwrap_or(false) {
        skip(name, "device 1 has no stream-ordered memory pools");
        return;
    }
    let Some(pool) = async_pool(&gpu, name) else {
        return;
    };
    let context1 = Context::primary(device1).expect("context 1");
    let (s0, s1) = (raw_stream(&gpu.context), raw_stream(&context1));
    let stack = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        Arc::clone(&pool),
        64 * MIB,
    )));
    let wrong = |error: &MemoryError| {
        matches!(
            error,
            MemoryError::WrongDevice {
                expected: 0,
                actual: 1,
                ..
            }
        )
    };
    let error = stack.allocate(MIB, &s1).expect_err("a stream of device 1");
    assert!(wrong(&error), "{error:?}");
    assert_eq!(stack.upstream().used(), 0, "the refusal reserved nothing");
    assert_eq!(stack.stats().failed_allocations, 1);
    let ptr = stack.allocate(MIB, &s0).expect("device 0");
    let error = stack
        .deallocate(ptr, MIB, &s1)
        .expect_err("freed on device 1");
    assert!(wrong(&error), "{error:?}");
    assert_eq!(pool.outstanding(), 1, "still live");
    let resource: Arc<dyn MemoryResource> = stack.clone();
    let error = DeviceBuffer::<u32>::with_resource(resource, 16, &s1).expect_err("typed");
    assert!(wrong(&error), "{error:?}");
    stack.deallocate(ptr, MIB, &s0).expect("the right free");
    assert_eq!(stack.stats().current_bytes, 0);

    let (a0, a1) = (normal_stream(&gpu.context), normal_stream(&context1));
    let allocator = StreamOrderedAllocator::default();
    assert!(matches!(
        allocator.add_stream_dependency(&a1, &a0),
        Err(StreamError::WrongDevice { .. })
    ));
    let x0 = allocator
        .allocate_for_stream(&a0, 3 * MIB)
        .expect("device 0");
    let x1 = allocator
        .allocate_for_stream(&a1, 3 * MIB)
        .expect("device 1");
    assert_eq!((x0.device(), x1.device()), (0, 1));
    assert!(allocator.reserved_bytes(0).expect("pool 0") >= 4 * MIB as u64);
    assert!(allocator.reserved_bytes(1).expect("pool 1") >= 4 * MIB as u64);
    let mut y1 = allocator
        .buffer::<u32>(&a1, 1000)
        .expect("typed on device 1");
    a1.fill(&mut y1, 5).expect("fill");
    assert_eq!(y1.to_vec().expect("read"), vec![5; 1000]);
    assert_eq!(allocator.free_for_stream(&a0).expect("free 0"), 1);
    assert_eq!(allocator.free_for_stream(&a1).expect("free 1"), 1);
    drop(y1);
    a0.synchronize().expect("sync");
    a1.synchronize().expect("sync");
    assert_eq!(allocator.stats().live, 0);
}
