//! Programs users of PyTorch's caching allocator, RMM's memory resources and cudarc write, aimed
//! at what `user_patterns.rs` and `allocator_programs.rs` leave out: an RMM resource buffer on
//! the default stream whose block the typed layer hands out again, a cache drawing segments from
//! a stream-ordered pool, thousands of `record_stream` frees waiting behind a busy communication
//! stream, a producer and a consumer thread passing tensors across streams, thousands of
//! overlapping view fills on two streams checked against a host model, `empty_cache` with live
//! and pending blocks, views of odd-sized elements at odd offsets copied between buffer kinds,
//! tracked launches that name one buffer twice, pool-staged uploads of records, prefetch plans
//! naming several ranges of one managed buffer, requests past every limit, an RMM stack serving
//! ten thousand typed buffers, `record_stream` on four readers, and an async-pool chain.
//!
//! Every test checks real outcomes (bytes that round-trip exactly, statistics that reconcile,
//! memory that stays flat) and finishes in a few seconds on an H200 with well under a GiB.

use std::collections::VecDeque;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytemuck::{Pod, Zeroable};
use cuweave_driver::memory::MemLocation;
use cuweave_driver::{Context, Event, EventFlags, LaunchConfig, Stream, StreamFlags};
use cuweave_memory::resource::CachingResource;
use cuweave_memory::{
    AsyncPoolResource, Buffer, CachingAllocator, DeviceBuffer, DriverResource, LimitAdaptor,
    ManagedCapabilities, MemAdvice, MemoryError, MemoryResource, MigrationPolicy, PinnedBuffer,
    PinnedPool, PrefetchPlan, StatisticsAdaptor, TrackedLaunch, UnifiedBuffer,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip, skip_under_sanitizer};

#[path = "common/async_pool.rs"]
mod async_pool;
use async_pool::async_pool_or_skip;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const US: u64 = 1_000;
const MS: u64 = 1_000_000;

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

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

/// Runs `body` on its own thread and fails the test if it has not finished within `limit`: a
/// deadlock (a lock taken twice, a wait that never ends) shows as a failure, not a hung run.
fn within<R: Send + 'static>(
    what: &str,
    limit: Duration,
    body: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (done, finished) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let result = body();
        let _ = done.send(());
        result
    });
    match finished.recv_timeout(limit) {
        Ok(()) => worker.join().expect("the body panicked"),
        // The sender was dropped without a send: the body panicked; join surfaces its panic.
        Err(mpsc::RecvTimeoutError::Disconnected) => worker.join().expect("the body panicked"),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: not finished after {limit:?} (deadlock?)")
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RMM: a resource buffer on the default stream
// ---------------------------------------------------------------------------------------------

/// RMM's `device_buffer(size, cuda_stream_default, mr)` over the cache: a typed buffer of a
/// `CachingResource`, allocated on the legacy default stream, read by a slow kernel on another
/// stream and dropped. Its drop frees it on the legacy stream (after a device-side wait for the
/// reader), which is the allocating stream, so the resource takes the plain free path. The next
/// typed buffer the same cache hands out for the legacy stream must still not be writable on a
/// third stream before the reader is done: the reader must see its own tensor's bytes.
#[test]
fn a_resource_buffer_freed_on_the_legacy_stream_is_not_handed_to_a_typed_buffer_under_its_reads() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "a_resource_buffer_freed_on_the_legacy_stream_is_not_handed_to_a_typed_buffer_under_its_reads",
        "needs the reader's spin to overlap the other stream's fill",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let resource: Arc<dyn MemoryResource> = Arc::new(CachingResource::new(allocator.clone()));
    let legacy = Stream::legacy_default(context);
    let (reader, writer) = (stream(context), stream(context));
    const N: usize = MIB / 4;
    const VALUE: u32 = 0x1357_9BDF;

    let mut out = allocator.buffer::<u32>(N, &reader).expect("out");
    let mut x = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &legacy)
        .expect("x on the default stream");
    x.fill(VALUE).expect("fill x");
    kernels
        .spin_ns(&reader, 300 * MS)
        .expect("slow reader stream");
    out.copy_from_async(&x, &reader)
        .expect("read x after the spin");
    let old = x.device_ptr();
    drop(x);

    let mut y = allocator
        .buffer::<u32>(N, &legacy)
        .expect("the next tensor for the default stream");
    let reused = y.device_ptr() == old;
    y.fill_async(!VALUE, &writer).expect("fill y elsewhere");
    writer.synchronize().expect("sync writer");
    let reader_was_busy = !reader.query().expect("query reader");
    let got = out.to_vec().expect("out");
    let wrong = got.iter().filter(|&&v| v != VALUE).count();
    assert_eq!(
        wrong, 0,
        "the slow reader saw {wrong} of {N} elements of the next tensor (block reused: {reused}, \
         reader still busy when the next tensor was written: {reader_was_busy})"
    );
    assert!(y.to_vec().expect("y").iter().all(|&v| v == !VALUE));
    drop((y, out));
    context.synchronize().expect("sync");
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
}

// ---------------------------------------------------------------------------------------------
// A cache over a stream-ordered pool
// ---------------------------------------------------------------------------------------------

/// RMM's `pool_memory_resource` over `cuda_async_memory_resource`, in cuweave's shape: a caching
/// allocator whose upstream is an `AsyncPoolResource`. A typed buffer of the pool is read by a
/// slow kernel and dropped (freed on the pool in stream order); the cache then misses and draws
/// a segment from the pool on its own stream, which the pool may serve from the freed memory by
/// making that stream wait. The typed buffer the cache hands out is then written on a third
/// stream: it must not land before the slow reader has read the old buffer.
#[test]
fn a_segment_the_cache_draws_from_a_stream_ordered_pool_is_not_written_under_the_pools_last_reader()
{
    let gpu = require_gpu!();
    let _serial = serial();
    let name = "a_segment_the_cache_draws_from_a_stream_ordered_pool_is_not_written_under_the_pools_last_reader";
    if skip_under_sanitizer(
        name,
        "needs the reader's spin to overlap the other stream's fill",
    ) {
        return;
    }
    let context = &gpu.context;
    let Some(pool) = async_pool_or_skip(name, context) else {
        return;
    };
    let kernels = TestKernels::load(context).expect("kernels");
    let resource: Arc<dyn MemoryResource> = pool.clone();
    let allocator = CachingAllocator::new(Arc::clone(&resource));
    let scratch = CachingAllocator::with_driver(context);
    let (reader, home, writer) = (stream(context), stream(context), stream(context));
    const N: usize = 20 * MIB / 4;
    const VALUE: u32 = 0x2468_ACE1;

    let mut out = scratch.buffer::<u32>(N, &reader).expect("out");
    let mut x = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &reader)
        .expect("x from the pool");
    x.fill_async(VALUE, &reader).expect("fill x");
    kernels.spin_ns(&reader, 300 * MS).expect("slow reader");
    out.copy_from_async(&x, &reader)
        .expect("read x after the spin");
    let old = x.device_ptr();
    drop(x);

    let mut y = allocator
        .buffer::<u32>(N, &home)
        .expect("a segment drawn from the pool");
    assert_eq!(allocator.stats().cache_misses, 1);
    let reused = y.device_ptr() == old;
    y.fill_async(!VALUE, &writer)
        .expect("fill y on another stream");
    writer.synchronize().expect("sync writer");
    let got = out.to_vec().expect("out");
    let wrong = got.iter().filter(|&&v| v != VALUE).count();
    assert_eq!(
        wrong, 0,
        "the pool's last reader saw {wrong} elements of the cache's new tensor (the pool served \
         the segment from the freed memory: {reused})"
    );
    assert!(y.to_vec().expect("y").iter().all(|&v| v == !VALUE));
    drop(y);
    context.synchronize().expect("sync");
    allocator.empty_cache().expect("empty_cache");
    assert_eq!(pool.outstanding(), 0, "every segment went back to the pool");
}

// ---------------------------------------------------------------------------------------------
// record_stream behind a busy communication stream
// ---------------------------------------------------------------------------------------------

/// PyTorch's `tensor.record_stream(nccl_stream)` in a loop while the communication stream is
/// held up (here by a gate): every freed block waits for its event. Ten thousand such frees must
/// not lose a block: each comes back once the stream moves. A poll stops at the held stream's
/// first unfinished event, so an allocation's cost does not grow with the frees waiting
/// (printed, not asserted: timings belong in benchmarks).
#[test]
fn ten_thousand_frees_waiting_on_a_busy_stream_all_come_back_once_it_moves() {
    let gpu = require_gpu!();
    let _serial = serial();
    let name = "ten_thousand_frees_waiting_on_a_busy_stream_all_come_back_once_it_moves";
    if skip_under_sanitizer(name, "measures host-side allocation times") {
        return;
    }
    if !gpu.device.can_map_host_memory().expect("attribute") {
        skip(name, "the device cannot map host memory for the gate");
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let home = stream(context);
    let comm = Arc::new(stream(context));
    // Warm the event pool and the first segment outside the timed loop.
    let mut warm = allocator.allocate(512, &home).expect("warm");
    warm.record_stream(&comm).expect("warm record");
    drop(warm);
    comm.synchronize().expect("sync comm");

    // The loop must finish well inside the gate kernel's 10 s: it does, since an allocation
    // queries the held stream's first event only, however many frees wait behind it.
    const ROUNDS: usize = 10_000;
    const WINDOW: usize = 100;
    let gate = Gate::new(context);
    gate.hold(&kernels, &comm);
    let mut elapsed = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let started = Instant::now();
        let mut block = allocator.allocate(512, &home).expect("allocate");
        block.record_stream(&comm).expect("record_stream");
        drop(block);
        elapsed.push(started.elapsed());
    }
    let stats = allocator.stats();
    let pending = allocator.pending_frees();
    gate.open();
    comm.synchronize().expect("the gate opened");

    assert_eq!(pending, ROUNDS, "every free waits for the held stream");
    assert_eq!(stats.allocated_bytes.current, 0);
    assert!(
        stats.active_bytes.current >= ROUNDS * 512,
        "{:?}",
        stats.active_bytes
    );
    let again = allocator
        .allocate(512, &home)
        .expect("after the stream moved");
    assert_eq!(
        allocator.pending_frees(),
        0,
        "every waiting block came back"
    );
    let after = allocator.stats();
    assert_eq!(after.active_bytes.current, after.allocated_bytes.current);
    assert_eq!(
        after.cache_misses, stats.cache_misses,
        "served from the blocks that came back"
    );
    drop(again);

    // Reported, not asserted (timings belong in benchmarks).
    let mean = |window: &[Duration]| window.iter().sum::<Duration>() / window.len() as u32;
    let (early, late) = (mean(&elapsed[..WINDOW]), mean(&elapsed[ROUNDS - WINDOW..]));
    eprintln!(
        "an allocation with {ROUNDS} frees waiting took {late:?}, with few waiting {early:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Producer and consumer threads
// ---------------------------------------------------------------------------------------------

/// A data-loader thread makes batches on its stream and sends them to a training thread, which
/// copies each on its own (lagging) stream and drops the batch at once, on its thread, while the
/// copy is still queued. The loader keeps allocating the same size on its stream: a block must
/// not come back to it before the consumer's copy has read it. Every copy holds its batch.
#[test]
fn a_producer_and_a_consumer_thread_pass_batches_across_streams_without_a_block_coming_back_early()
{
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "a_producer_and_a_consumer_thread_pass_batches_across_streams_without_a_block_coming_back_early",
        "needs the consumer's spins to overlap the producer's fills",
    ) {
        return;
    }
    let context = Arc::clone(&gpu.context);
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    let allocator = CachingAllocator::with_driver(&context);
    const ROUNDS: u32 = 1500;
    const N: usize = 64 * KIB;
    const RING: usize = 8;
    let (send, receive) = mpsc::sync_channel::<(DeviceBuffer<u32>, u32)>(4);

    let producer = {
        let (context, kernels, allocator) = (
            Arc::clone(&context),
            Arc::clone(&kernels),
            allocator.clone(),
        );
        std::thread::spawn(move || {
            let p = stream(&context);
            for round in 0..ROUNDS {
                let value = 0xA000_0000 | round;
                let mut batch = allocator.buffer::<u32>(N, &p).expect("batch");
                if round % 8 == 0 {
                    kernels.spin_ns(&p, 50 * US).expect("loader work");
                }
                batch.fill_async(value, &p).expect("fill batch");
                send.send((batch, value)).expect("send");
            }
        })
    };

    let c = stream(&context);
    let mut ring: VecDeque<(DeviceBuffer<u32>, u32)> = VecDeque::new();
    let check = |copy: DeviceBuffer<u32>, value: u32| {
        let host = copy
            .copy_to_host_async(vec![0u32; N], &c)
            .expect("download")
            .wait()
            .expect("downloaded");
        let wrong = host.iter().filter(|&&v| v != value).count();
        assert_eq!(
            wrong, 0,
            "batch {value:#x}: {wrong} elements were overwritten before the consumer read them"
        );
    };
    for (batch, value) in receive {
        if value % 4 == 0 {
            kernels.spin_ns(&c, 100 * US).expect("consumer lags");
        }
        let mut copy = allocator.buffer::<u32>(N, &c).expect("copy");
        copy.copy_from_async(&batch, &c).expect("consume");
        drop(batch);
        ring.push_back((copy, value));
        if ring.len() > RING {
            let (copy, value) = ring.pop_front().expect("ring");
            check(copy, value);
        }
    }
    producer.join().expect("producer");
    for (copy, value) in ring.drain(..) {
        check(copy, value);
    }
    context.synchronize().expect("sync");
    let probe = allocator.buffer::<u32>(N, &c).expect("probe");
    drop(probe);
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(stats.frees, stats.allocations);
    assert_eq!(stats.allocations, 2 * u64::from(ROUNDS) + 1);
    // Waiting blocks come back when their own shard allocates, or here.
    allocator.empty_cache().expect("empty_cache");
    assert_eq!(allocator.pending_frees(), 0);
    assert!(
        stats.reserved_bytes.peak <= 64 * MIB,
        "the cache grew to {} bytes for a few batches in flight",
        stats.reserved_bytes.peak
    );
}

// ---------------------------------------------------------------------------------------------
// Thousands of overlapping view fills on two streams
// ---------------------------------------------------------------------------------------------

/// Pixels of three bytes: every fill with distinct bytes takes the staged pattern path (a host
/// chunk, device doublings and a host function), equal bytes a byte memset.
type Rgb = [u8; 3];

/// Three thousand fills of random views of one buffer of 3-byte elements, alternating between
/// two streams (one of them often held back by a spin), read back at random on the other stream
/// and in full every 500 fills: every byte matches a host model, so no use merged or pruned by
/// the tracker's bound lost an ordering; the tracker never holds more than its 32 uses.
#[test]
fn thousands_of_overlapping_view_fills_on_two_streams_match_a_host_model_with_bounded_tracking() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let (a, b) = (stream(context), stream(context));
    const LEN: usize = 10_007;
    const ROUNDS: usize = 3000;
    let mut buffer = allocator.buffer::<Rgb>(LEN, &a).expect("buffer");
    buffer.fill_async([0; 3], &a).expect("clear");
    let mut model: Vec<Rgb> = vec![[0; 3]; LEN];
    let mut state = 0x00C0_FFEE_u64;
    let mut max_tracked = 0;
    for round in 0..ROUNDS {
        let start = next(&mut state) % LEN;
        let len = 1 + next(&mut state) % (LEN - start).min(1500);
        let on = if round % 3 == 0 { &b } else { &a };
        if round % 97 == 0 {
            kernels.spin_ns(&b, 300 * US).expect("hold b back");
        }
        let value: Rgb = if round % 5 == 0 {
            [round as u8; 3]
        } else {
            [round as u8, (round >> 8) as u8 | 0x80, 0x5A]
        };
        buffer
            .slice_mut(start..start + len)
            .expect("view")
            .fill_async(value, on)
            .expect("fill view");
        model[start..start + len].fill(value);
        max_tracked = max_tracked.max(buffer.tracked_uses());
        assert!(
            buffer.tracked_uses() <= 32,
            "round {round}: {} uses tracked",
            buffer.tracked_uses()
        );
        if round % 50 == 49 {
            // A read of a random range on the stream that did not write last.
            let other = if round % 3 == 0 { &a } else { &b };
            let from = next(&mut state) % LEN;
            let count = 1 + next(&mut state) % (LEN - from).min(3000);
            let host = buffer
                .slice(from..from + count)
                .expect("read view")
                .copy_to_host_async(vec![[0u8; 3]; count], other)
                .expect("download view")
                .wait()
                .expect("downloaded");
            assert_eq!(
                host,
                &model[from..from + count],
                "round {round}: a read on the other stream missed a write"
            );
        }
        if round % 500 == 499 {
            assert_eq!(
                buffer.to_vec().expect("whole"),
                model,
                "round {round}: the buffer differs from the model"
            );
        }
    }
    assert!(max_tracked > 8, "the test did not exercise the bound");
    assert_eq!(buffer.to_vec().expect("whole"), model);
}

// ---------------------------------------------------------------------------------------------
// empty_cache with live and pending blocks
// ---------------------------------------------------------------------------------------------

/// `torch.cuda.empty_cache()` while some tensors live and others were just dropped under a slow
/// reader on another stream: it waits for the reader (the reads see their tensors' bytes), gives
/// back exactly the segments that are then wholly free, keeps every segment with a live block
/// (whose bytes stay intact), and leaves the statistics consistent.
#[test]
fn empty_cache_waits_for_pending_blocks_releases_only_whole_free_segments_and_keeps_live_bytes() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let scratch = CachingAllocator::with_driver(context);
    let (a, b, reader, other) = (
        stream(context),
        stream(context),
        stream(context),
        stream(context),
    );
    let words = |bytes: usize| bytes / 4;
    let make = |bytes: usize, on: &Stream, value: u32| {
        let mut buffer = allocator.buffer::<u32>(words(bytes), on).expect("tensor");
        buffer.fill_async(value, on).expect("fill");
        (buffer, value)
    };
    // Six 3 MiB tensors share one 20 MiB segment of `a`; two 100 KiB ones a 2 MiB segment of
    // `b`; a 12 MiB tensor has its own segment; so has a 24 MiB one of `other`.
    let mut live = Vec::new();
    let mut dropped = Vec::new();
    for k in 0..6u32 {
        let tensor = make(3 * MIB, &a, 0x100 + k);
        if k % 2 == 0 {
            live.push(tensor);
        } else {
            dropped.push(tensor);
        }
    }
    live.push(make(100 * KIB, &b, 0x200));
    dropped.push(make(100 * KIB, &b, 0x201));
    dropped.push(make(12 * MIB, &a, 0x300));
    let untouched = allocator
        .buffer::<u32>(words(24 * MIB), &other)
        .expect("24 MiB");
    drop(untouched);
    let reserved = allocator.stats().reserved_bytes.current;
    assert_eq!(reserved, (20 + 2 + 12 + 24) * MIB);

    kernels.spin_ns(&reader, 150 * MS).expect("slow reader");
    let mut copies = Vec::new();
    for (tensor, value) in &dropped {
        let mut copy = scratch.buffer::<u32>(tensor.len(), &reader).expect("copy");
        copy.copy_from_async(tensor, &reader).expect("read");
        copies.push((copy, *value));
    }
    let dropped_bytes: usize = dropped.iter().map(|(t, _)| t.allocated_bytes()).sum();
    drop(dropped);
    let live_bytes: usize = live.iter().map(|(t, _)| t.allocated_bytes()).sum();
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, live_bytes);
    assert_eq!(allocator.pending_frees(), 5);
    assert_eq!(stats.active_bytes.current, live_bytes + dropped_bytes);

    let released = allocator.empty_cache().expect("empty_cache");
    assert!(
        reader.query().expect("query"),
        "empty_cache returned before the reader of its pending blocks"
    );
    assert_eq!(released, (12 + 24) * MIB, "only the wholly free segments");
    let stats = allocator.stats();
    assert_eq!(stats.reserved_bytes.current, (20 + 2) * MIB);
    assert_eq!(stats.segments.current, 2);
    assert_eq!(stats.segments_released, 2);
    assert_eq!(allocator.pending_frees(), 0);
    assert_eq!(stats.allocated_bytes.current, live_bytes);
    assert_eq!(stats.active_bytes.current, live_bytes);
    for (copy, value) in &copies {
        assert!(
            copy.to_vec().expect("copy").iter().all(|v| v == value),
            "the reader of tensor {value:#x} saw other bytes"
        );
    }
    for (tensor, value) in &live {
        assert!(
            tensor.to_vec().expect("live").iter().all(|v| v == value),
            "live tensor {value:#x} changed across empty_cache"
        );
    }
    // The cache keeps working: a new 12 MiB tensor takes a new segment and round-trips.
    let (again, value) = make(12 * MIB, &a, 0x400);
    assert!(again.to_vec().expect("again").iter().all(|&v| v == value));
    assert_eq!(allocator.stats().cache_misses, 5);
    drop((again, live, copies));
    context.synchronize().expect("sync");
    allocator.empty_cache().expect("empty_cache");
    let stats = allocator.stats();
    assert_eq!(
        (stats.reserved_bytes.current, stats.segments.current),
        (0, 0)
    );
    assert_eq!(stats.frees, stats.allocations);
}

// ---------------------------------------------------------------------------------------------
// Views of odd-sized elements at odd offsets
// ---------------------------------------------------------------------------------------------

/// `dst[a:b].copy_(src[c:d])` with 3-byte and 2-byte elements at odd offsets: view-to-view
/// device copies on two streams (overlapping ones ordered), range uploads, a pinned view and a
/// managed view as copy sources, ranged downloads and views of views, all byte for byte.
#[test]
fn views_at_odd_offsets_of_odd_sized_elements_copy_between_buffers_streams_and_kinds_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (s1, s2) = (stream(context), stream(context));
    let data: Vec<Rgb> = (0..1001u32)
        .map(|i| [i as u8, (i * 7) as u8, (i * 13) as u8 | 1])
        .collect();
    let mut src = DeviceBuffer::<Rgb>::new_on(&s1, data.len()).expect("src");
    drop(
        src.copy_from_host_async(data.clone(), &s1)
            .expect("upload")
            .wait()
            .expect("uploaded"),
    );
    let mut dst = DeviceBuffer::<Rgb>::zeroed(context, 997).expect("dst");
    let mut model: Vec<Rgb> = vec![[0; 3]; 997];
    let copies = [
        (1, 2, 13),
        (14, 501, 333),
        (400, 0, 1),
        (401, 999, 2),
        (500, 3, 97),
    ];
    for (k, &(d, s, n)) in copies.iter().enumerate() {
        let on = if k % 2 == 0 { &s1 } else { &s2 };
        dst.slice_mut(d..d + n)
            .expect("dst view")
            .copy_from_async(&src.slice(s..s + n).expect("src view"), on)
            .expect("view copy");
        model[d..d + n].copy_from_slice(&data[s..s + n]);
    }
    // Overlapping copies on two streams: the first is held back, the second must land after it.
    kernels.spin_ns(&s1, 30 * MS).expect("hold s1");
    dst.slice_mut(600..700)
        .expect("view")
        .copy_from_async(&src.slice(10..110).expect("view"), &s1)
        .expect("first");
    model[600..700].copy_from_slice(&data[10..110]);
    dst.slice_mut(650..750)
        .expect("view")
        .copy_from_async(&src.slice(800..900).expect("view"), &s2)
        .expect("second");
    model[650..750].copy_from_slice(&data[800..900]);
    // Uploads into views.
    let up: Vec<Rgb> = (0..50u8).map(|i| [i, !i, i ^ 0x3C]).collect();
    drop(
        dst.slice_mut(900..950)
            .expect("view")
            .copy_from_host_async(up.clone(), &s2)
            .expect("upload view")
            .wait()
            .expect("uploaded"),
    );
    model[900..950].copy_from_slice(&up);
    drop(
        dst.copy_range_from_host_async(951, up[..40].to_vec(), &s1)
            .expect("range upload")
            .wait()
            .expect("uploaded"),
    );
    model[951..991].copy_from_slice(&up[..40]);
    // A pinned buffer's view as the source of a device copy.
    let pinned = PinnedBuffer::from_slice(context, &data[..64]).expect("pinned");
    dst.slice_mut(991..997)
        .expect("view")
        .copy_from_async(&pinned.slice(7..13).expect("pinned view"), &s2)
        .expect("from pinned");
    model[991..997].copy_from_slice(&data[7..13]);
    // A managed buffer's view, where the device has managed memory.
    let capabilities = ManagedCapabilities::of(gpu.device).expect("capabilities");
    if capabilities.managed_memory {
        let managed = UnifiedBuffer::from_slice(context, &data).expect("managed");
        dst.slice_mut(250..255)
            .expect("view")
            .copy_from_async(&managed.slice(995..1000).expect("managed view"), &s1)
            .expect("from managed");
        model[250..255].copy_from_slice(&data[995..1000]);
        dst.synchronize()
            .expect("the copy out of managed memory is done");
    }

    let part = dst
        .slice(3..700)
        .expect("view")
        .copy_to_host_async(vec![[0u8; 3]; 697], &s1)
        .expect("download view")
        .wait()
        .expect("downloaded");
    assert_eq!(part, &model[3..700]);
    assert_eq!(dst.to_vec().expect("dst"), model);
    assert_eq!(
        dst.slice(100..900)
            .expect("view")
            .slice(5..10)
            .expect("view of a view")
            .to_vec()
            .expect("v"),
        &model[105..110]
    );
    let mut tail = vec![[0u8; 3]; 7];
    dst.slice(990..997)
        .expect("tail")
        .copy_to_host(&mut tail)
        .expect("blocking view download");
    assert_eq!(tail, &model[990..997]);

    // Two-byte elements at odd element offsets (addresses 2 bytes off a word).
    let halves: Vec<u16> = (0..777u32).map(|i| (i * 2654 + 7) as u16).collect();
    let hsrc = DeviceBuffer::from_slice(context, &halves).expect("halves");
    let mut hdst = DeviceBuffer::<u16>::zeroed(context, 777).expect("hdst");
    let mut hmodel = vec![0u16; 777];
    hdst.slice_mut(1..300)
        .expect("view")
        .copy_from_async(&hsrc.slice(2..301).expect("view"), &s2)
        .expect("u16 copy");
    hmodel[1..300].copy_from_slice(&halves[2..301]);
    hdst.slice_mut(299..777)
        .expect("view")
        .copy_from_async(&hsrc.slice(0..478).expect("view"), &s1)
        .expect("u16 overlapping copy");
    hmodel[299..777].copy_from_slice(&halves[0..478]);
    hdst.slice_mut(5..6)
        .expect("one")
        .fill(0xBEEF)
        .expect("fill one");
    hmodel[5] = 0xBEEF;
    assert_eq!(hdst.to_vec().expect("hdst"), hmodel);
}

// ---------------------------------------------------------------------------------------------
// Tracked launches naming one buffer twice
// ---------------------------------------------------------------------------------------------

/// cudarc's `launch_builder().arg(&a).arg(&a).arg(&mut out)`: `add_f32(a, a, out, n)` with the
/// input declared read twice, through the buffer and through views of it (one tracker locked
/// for several declared uses), writing a view, a pinned buffer and, on another stream after a
/// spin, a buffer computed from the first launch's output. Nothing deadlocks and every value is
/// the sum the kernel computes.
#[test]
fn tracked_launches_that_read_one_buffer_twice_or_through_views_neither_deadlock_nor_misorder() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = Arc::clone(&gpu.context);
    within(
        "tracked launches naming one buffer twice",
        Duration::from_secs(60),
        move || {
            let kernels = TestKernels::load(&context).expect("kernels");
            let add = kernels.module().function("add_f32").expect("add_f32");
            let (s1, s2) = (stream(&context), stream(&context));
            const N: usize = 4099;
            let host: Vec<f32> = (0..N).map(|i| i as f32 * 0.5 - 7.0).collect();
            let a = DeviceBuffer::from_slice(&context, &host).expect("a");
            let mut out = DeviceBuffer::<f32>::new_on(&s1, N).expect("out");
            let n = N as u64;
            let config = LaunchConfig::for_elements(N, 256).expect("config");
            kernels.spin_ns(&s1, 20 * MS).expect("slow s1");
            // SAFETY: add_f32(const float* a, const float* b, float* out, size_t n) reads n
            // elements of `a` (passed twice, declared read) and writes n of `out`.
            unsafe {
                TrackedLaunch::new(&add, &s1, config)
                    .read(&a)
                    .read(&a)
                    .write(&mut out)
                    .arg(&n)
                    .launch()
            }
            .expect("a + a");
            // Views of `a`: the same tracker under two ranges, and the whole buffer declared too.
            let view = a.slice(1..N).expect("view");
            let m = (N - 1) as u64;
            let view_config = LaunchConfig::for_elements(N - 1, 256).expect("config");
            let mut shifted = DeviceBuffer::<f32>::zeroed(&context, N).expect("shifted");
            {
                let mut target = shifted.slice_mut(0..N - 1).expect("target view");
                // SAFETY: as above with n - 1 elements of the view of `a` (passed twice) and of
                // the target view; `reads(&a)` passes no argument.
                unsafe {
                    TrackedLaunch::new(&add, &s2, view_config)
                        .read(&view)
                        .read(&view)
                        .reads(&a)
                        .write(&mut target)
                        .arg(&m)
                        .launch()
                }
                .expect("view + view");
            }
            // A mapped pinned buffer written by the kernel in place.
            let mut pinned = PinnedBuffer::<f32>::new(&context, N).expect("pinned");
            // SAFETY: as the first launch, `pinned` being mapped pinned memory of n floats.
            unsafe {
                TrackedLaunch::new(&add, &s2, config)
                    .read(&a)
                    .read(&a)
                    .write(&mut pinned)
                    .arg(&n)
                    .launch()
            }
            .expect("into pinned");
            // On s2, from `out`, which s1 writes behind its spin: ordered after that write.
            let mut twice = DeviceBuffer::<f32>::new_on(&s2, N).expect("twice");
            // SAFETY: as the first launch, reading `out` twice and writing `twice`.
            unsafe {
                TrackedLaunch::new(&add, &s2, config)
                    .read(&out)
                    .read(&out)
                    .write(&mut twice)
                    .arg(&n)
                    .launch()
            }
            .expect("out + out");
            assert_eq!(out.concurrent_readers(), 1);

            let expect2: Vec<f32> = host.iter().map(|&x| x + x).collect();
            let expect4: Vec<f32> = expect2.iter().map(|&x| x + x).collect();
            let mut expect_shifted: Vec<f32> = host[1..].iter().map(|&x| x + x).collect();
            expect_shifted.push(0.0);
            assert_eq!(out.to_vec().expect("out"), expect2);
            assert_eq!(twice.to_vec().expect("twice"), expect4);
            assert_eq!(shifted.to_vec().expect("shifted"), expect_shifted);
            assert_eq!(pinned.as_slice().expect("pinned"), &expect2[..]);
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Pool-staged uploads of records
// ---------------------------------------------------------------------------------------------

/// A record as data loaders define one: 12 bytes, no padding.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
struct Record {
    id: u32,
    xyz: [u16; 3],
    flag: u8,
    kind: u8,
}

fn record(round: usize, index: usize) -> Record {
    Record {
        id: (round * 100_003 + index) as u32,
        xyz: [index as u16, round as u16, (index ^ round) as u16],
        flag: (index % 251) as u8,
        kind: round as u8 | 1,
    }
}

/// A DataLoader with `pin_memory=True` staging through the pinned pool: typed pool blocks (warm
/// ones for uploads, cold ones for downloads) and pool-backed pinned buffers of 12-byte records
/// of odd counts, three thousand round trips through a device buffer on two streams. Every record
/// comes back; the pool's books balance; the pinned memory stays within what its design allows.
#[test]
fn pool_staged_round_trips_of_odd_sized_records_come_back_exactly_and_pinned_memory_stays_bounded()
{
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (a, b) = (stream(context), stream(context));
    let pool = PinnedPool::new(context);
    const COUNTS: [usize; 4] = [1, 333, 4097, 70_001];
    const ROUNDS: usize = 3000;
    let mut device = DeviceBuffer::<Record>::new_on(&a, 70_001).expect("device");
    for round in 0..ROUNDS {
        let count = COUNTS[round % COUNTS.len()];
        let upload = if round % 3 == 2 {
            let mut staged = pool.buffer::<Record>(count).expect("pool buffer");
            for (index, slot) in staged.as_mut_slice().expect("fresh").iter_mut().enumerate() {
                *slot = record(round, index);
            }
            let pending = device
                .copy_range_from_host_async(0, staged, &a)
                .expect("upload");
            drop(pending.wait().expect("uploaded"));
            None
        } else {
            let mut block = pool.get_typed::<Record>(count).expect("block");
            for (index, slot) in block.as_mut_slice().iter_mut().enumerate() {
                *slot = record(round, index);
            }
            Some(
                device
                    .copy_range_from_host_async(0, block, &a)
                    .expect("upload"),
            )
        };
        // Downloaded on the other stream, which waits for the upload on the device.
        let down = pool.get_typed_cold::<Record>(count).expect("cold block");
        let down = device
            .copy_range_to_host_async(0, down, &b)
            .expect("download")
            .wait()
            .expect("downloaded");
        if let Some(upload) = upload {
            drop(upload.wait().expect("uploaded"));
        }
        for (index, got) in down.as_slice().iter().enumerate() {
            assert_eq!(*got, record(round, index), "round {round} record {index}");
        }
    }
    let stats = pool.stats();
    assert_eq!(stats.gets, stats.hits + stats.misses);
    assert_eq!(stats.gets, 2 * ROUNDS as u64);
    assert_eq!(stats.returns, stats.gets);
    assert_eq!(stats.allocated_bytes, 0);
    assert_eq!(stats.allocated_blocks, 0);
    assert_eq!(
        stats.pinned_bytes,
        stats.allocated_bytes + stats.cached_bytes
    );
    assert!(stats.hit_rate() > 0.95, "{stats:?}");
    // Size classes 4 KiB, 64 KiB and 1 MiB: at most the cold rotation plus a few in flight each.
    let bound: usize = [4 * KIB, 64 * KIB, MIB]
        .iter()
        .map(|&class| {
            let rotation = (PinnedPool::COLD_ROTATION_BYTES / class)
                .clamp(1, PinnedPool::COLD_ROTATION_BLOCKS);
            class * (rotation + 4)
        })
        .sum();
    assert!(
        stats.peak_pinned_bytes <= bound,
        "the pool pinned {} bytes (bound {bound}): {stats:?}",
        stats.peak_pinned_bytes
    );
}

// ---------------------------------------------------------------------------------------------
// Unified memory: a prefetch plan naming several ranges of one buffer
// ---------------------------------------------------------------------------------------------

/// A prefetch plan with three ranges of one managed buffer (one tracker named three times), a
/// whole second buffer and a range sent back to the host, executed without deadlock; a kernel
/// then writes the first buffer on the device and the host reads it back; migration policies
/// replace each other exactly as read back from the driver. Managed buffers stay at 4 MiB.
#[test]
fn a_prefetch_plan_naming_one_managed_buffer_three_times_executes_and_policies_replace_each_other()
{
    let gpu = require_gpu!();
    let _serial = serial();
    let name = "a_prefetch_plan_naming_one_managed_buffer_three_times_executes_and_policies_replace_each_other";
    let capabilities = ManagedCapabilities::of(gpu.device).expect("capabilities");
    if !capabilities.managed_memory || !capabilities.concurrent_managed_access {
        skip(name, "no managed memory with concurrent access");
        return;
    }
    let context = Arc::clone(&gpu.context);
    let ordinal = gpu.device.ordinal();
    within(
        "prefetch plan and policies",
        Duration::from_secs(60),
        move || {
            let kernels = TestKernels::load(&context).expect("kernels");
            let s = stream(&context);
            const N: usize = 4 * MIB / 4;
            let mut first =
                UnifiedBuffer::<u32>::from_slice(&context, &vec![1u32; N]).expect("first");
            let mut second = UnifiedBuffer::<u64>::zeroed(&context, MIB / 8 + 5).expect("second");
            second
                .as_mut_slice()
                .expect("host write")
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = i as u64 * 3);
            let device = MemLocation::Device(ordinal);
            {
                let mut plan = PrefetchPlan::new();
                plan.add(first.range(0, N / 4).expect("q1"), device)
                    .expect("add q1")
                    .add(first.range(N / 2, N / 4).expect("q3"), device)
                    .expect("add q3")
                    .add(&second, device)
                    .expect("add second")
                    .add(first.range(N / 4, N / 4).expect("q2"), MemLocation::Host)
                    .expect("add q2");
                assert_eq!(plan.len(), 4);
                assert_eq!(plan.total_bytes(), 3 * N + second.byte_size());
                let path = plan.execute(&s).expect("execute");
                let _ = path;
            }
            first.prepare_write(&s).expect("prepare");
            // SAFETY: `first` holds N u32s of managed memory that outlive the kernel (the host
            // read below waits for the recorded write); the host does not touch it meanwhile.
            unsafe { kernels.increment_u32(&s, first.device_ptr(), N) }.expect("increment");
            first.record_write(&s).expect("record");
            first
                .prefetch_to(MemLocation::Host, &s)
                .expect("prefetch back");
            assert!(
                first.as_slice().expect("host").iter().all(|&v| v == 2),
                "the host reads the kernel's increments"
            );
            // The second buffer, read on the device after its prefetch, round-trips.
            let copy_stream = stream(&context);
            let mut copy = DeviceBuffer::<u64>::new_on(&copy_stream, second.len()).expect("copy");
            copy.copy_from_async(&second, &copy_stream)
                .expect("device copy of managed memory");
            assert_eq!(
                copy.to_vec().expect("copy"),
                second.as_slice().expect("second").to_vec()
            );

            let hints = first.hints().expect("hints");
            hints
                .apply_policy(&MigrationPolicy::ReadMostly)
                .expect("read mostly");
            assert!(hints.read_mostly().expect("read back"));
            hints
                .apply_policy(&MigrationPolicy::PreferHost)
                .expect("prefer host");
            assert!(!hints.read_mostly().expect("read back"));
            assert_eq!(
                hints.preferred_location().expect("read back"),
                Some(MemLocation::Host)
            );
            hints
                .apply_policy(&MigrationPolicy::PreferDevice(ordinal))
                .expect("prefer device");
            assert_eq!(hints.preferred_location().expect("read back"), Some(device));
            assert!(hints.accessed_by().expect("read back").contains(&device));
            hints
                .apply_policy(&MigrationPolicy::Default)
                .expect("default");
            assert_eq!(hints.preferred_location().expect("read back"), None);
            assert!(!hints.read_mostly().expect("read back"));
            assert!(hints.accessed_by().expect("read back").is_empty());
            hints
                .prefetch_range(N - 8, 8, device, &s)
                .expect("last eight");
            assert!(matches!(
                hints.prefetch_range(N - 8, 9, device, &s),
                Err(MemoryError::OutOfRange { .. })
            ));
            assert!(matches!(
                hints.subrange(N, 1),
                Err(MemoryError::OutOfRange { .. })
            ));
            first.as_mut_slice().expect("host write")[N - 1] = 9;
            assert_eq!(
                first.slice(N - 2..N).expect("view").to_vec().expect("v"),
                [2, 9]
            );
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Requests past every limit
// ---------------------------------------------------------------------------------------------

fn assert_err<T>(result: cuweave_memory::Result<T>, what: &str) -> MemoryError {
    match result {
        Ok(_) => panic!("{what}: accepted"),
        Err(error) => error,
    }
}

/// Sizes far past the device, the host and `usize`, offsets at `usize::MAX`, lanes, ranges and
/// targets that do not exist, through every public entry point: each is a typed error, never a
/// panic, and the allocators keep working afterwards.
#[test]
fn huge_and_overflowing_requests_everywhere_are_typed_errors_not_panics() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let s = stream(context);
    const HUGE: usize = 1 << 50;

    // The caching allocator, raw and typed, and the default allocator.
    let allocator = CachingAllocator::with_driver(context);
    // Sizes whose rounding overflows are the allocator's own out-of-memory; sizes the driver
    // refuses are its error, whatever code it picks.
    for bytes in [usize::MAX, usize::MAX - 511] {
        let error = assert_err(allocator.allocate(bytes, &s), "allocate");
        assert!(error.is_out_of_memory(), "{bytes}: {error:?}");
    }
    for bytes in [usize::MAX / 2, HUGE] {
        assert_err(allocator.allocate(bytes, &s), "allocate");
    }
    assert!(matches!(
        allocator.buffer::<u64>(usize::MAX / 4, &s),
        Err(MemoryError::Misaligned { .. })
    ));
    assert_err(DeviceBuffer::<u8>::new_on(&s, HUGE), "new_on");
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    assert!(stats.ooms >= 2, "{stats:?}");
    drop(allocator.allocate(4096, &s).expect("still works"));

    // Resources and adaptors.
    let counted = StatisticsAdaptor::new(DriverResource::new(context));
    assert_err(counted.allocate(HUGE, &s), "statistics(driver)");
    assert_err(counted.allocate(usize::MAX, &s), "statistics(driver) MAX");
    let seen = counted.stats();
    assert_eq!((seen.failed_allocations, seen.current_bytes), (2, 0));
    let limited = LimitAdaptor::new(DriverResource::new(context), 64 * MIB);
    assert!(matches!(
        limited.allocate(usize::MAX, &s),
        Err(MemoryError::OutOfMemory { limit: Some(cap), .. }) if cap == 64 * MIB
    ));
    assert_eq!(limited.used(), 0);
    if let Ok(pool) = AsyncPoolResource::new(context) {
        assert_err(pool.allocate(HUGE, &s), "async pool");
        assert_err(pool.deallocate(0x1000, 4096, &s), "unknown free");
        assert_eq!(pool.outstanding(), 0);
    }
    let resource: Arc<dyn MemoryResource> = Arc::new(DriverResource::new(context));
    assert!(matches!(
        DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), usize::MAX / 2, &s),
        Err(MemoryError::Misaligned { .. })
    ));
    assert_err(
        DeviceBuffer::<u8>::with_resource(resource, HUGE, &s),
        "with_resource",
    );

    // Pinned memory and the pool.
    let pool = PinnedPool::new(context);
    assert_err(pool.get(HUGE), "pool.get");
    assert_err(pool.get(usize::MAX), "pool.get MAX");
    assert_err(pool.get_cold(usize::MAX - 5), "pool.get_cold");
    assert!(matches!(
        pool.get_typed::<u64>(usize::MAX / 4),
        Err(MemoryError::Misaligned { .. })
    ));
    assert_err(pool.buffer::<Rgb>(usize::MAX / 2), "pool.buffer");
    assert!(matches!(pool.get(0), Err(MemoryError::ZeroLength { .. })));
    assert_err(PinnedBuffer::<u8>::new(context, HUGE), "PinnedBuffer::new");
    assert!(cuweave_memory::pinned_pool::block_size(usize::MAX).is_none());
    assert_eq!(pool.stats().allocated_bytes, 0);
    drop(pool.get(100).expect("the pool still works"));

    // Ranges and views.
    let source = DeviceBuffer::from_slice(context, &[1u32, 2, 3, 4]).expect("source");
    let mut target = DeviceBuffer::<u32>::zeroed(context, 4).expect("target");
    assert_err(
        source.slice((Bound::Excluded(usize::MAX), Bound::Unbounded)),
        "slice excluded MAX",
    );
    assert_err(source.slice(2..=usize::MAX), "slice ..=MAX");
    assert_err(source.slice(usize::MAX - 1..usize::MAX), "slice MAX-1..MAX");
    assert_err(
        source.copy_range_to_host(usize::MAX, &mut [0u32; 2]),
        "ranged download",
    );
    assert_err(
        target.copy_range_from_host(usize::MAX - 1, &[1, 2]),
        "ranged upload",
    );
    let refused = source
        .copy_range_to_host_async(usize::MAX - 1, vec![0u32; 2], &s)
        .expect_err("ranged async download");
    assert!(matches!(refused.error(), MemoryError::OutOfRange { .. }));
    assert_eq!(refused.into_host(), Some(vec![0u32; 2]), "handed back");
    assert_err(
        target.copy_range_from_async(usize::MAX, &source, 0, 1, &s),
        "dst offset",
    );
    assert_err(
        target.copy_range_from_async(0, &source, 3, usize::MAX, &s),
        "length",
    );
    assert_err(
        target.copy_range_from_async(1, &source, 0, 4, &s),
        "past the end",
    );
    assert_err(
        target
            .slice_mut(1..3)
            .expect("view")
            .slice_mut(0..3)
            .map(|_| ()),
        "view of a view past its end",
    );
    let lanes = [stream(context)];
    assert_err(
        target.staged_write(usize::MAX, 1, &lanes, |_| ()),
        "staged range",
    );
    let lane_refused = target
        .staged_write(0, 4, &lanes, |staged| {
            staged.copy_in(5, 0, vec![0u32; 4]).map(drop)
        })
        .expect("staged write");
    assert!(matches!(lane_refused, Err(MemoryError::OutOfRange { .. })));
    assert_eq!(target.to_vec().expect("untouched"), [0; 4]);

    // Managed memory.
    assert!(matches!(
        UnifiedBuffer::<u64>::new(context, usize::MAX / 4),
        Err(MemoryError::Misaligned { .. })
    ));
    let capabilities = ManagedCapabilities::of(gpu.device).expect("capabilities");
    if capabilities.managed_memory && capabilities.concurrent_managed_access {
        let managed = UnifiedBuffer::<u32>::zeroed(context, 1024).expect("managed");
        assert_err(managed.range(usize::MAX, 2).map(|_| ()), "range");
        assert_err(
            managed.prefetch_range(3, usize::MAX, MemLocation::Host, &s),
            "prefetch range",
        );
        assert_err(
            managed.advise(MemAdvice::SetPreferredLocation(MemLocation::Device(10_000))),
            "advice to a missing device",
        );
        assert_err(
            managed.advise(MemAdvice::SetAccessedBy(MemLocation::Device(usize::MAX))),
            "accessed by a missing device",
        );
        assert!(matches!(
            managed.hints().expect("hints").subrange(0, 0),
            Err(MemoryError::ZeroLength { .. })
        ));
        let mut plan = PrefetchPlan::new();
        assert_err(
            plan.add(&managed, MemLocation::Device(10_000)).map(|_| ()),
            "plan target",
        );
        assert!(matches!(
            PrefetchPlan::new().execute(&s),
            Err(MemoryError::ZeroLength { .. })
        ));
        assert!(managed.as_slice().expect("host").iter().all(|&v| v == 0));
    }
}

// ---------------------------------------------------------------------------------------------
// An RMM stack serving ten thousand typed buffers
// ---------------------------------------------------------------------------------------------

/// `statistics_resource_adaptor<limiting_resource_adaptor<pool>>` with cuweave's cache as the
/// pool: ten thousand typed buffers of three sizes on three streams, a few alive at a time and
/// each dropped on the default stream's free path. The counters reconcile exactly, the limit
/// refuses a request past it without disturbing them, the cache's reserve stays bounded, and
/// the registry of live allocations ends empty.
#[test]
fn an_rmm_stack_over_the_cache_serves_ten_thousand_typed_buffers_with_a_bounded_reserve() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let allocator = CachingAllocator::with_driver(context);
    let cap = 64 * MIB;
    let stack = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        CachingResource::new(allocator.clone()),
        cap,
    )));
    assert_eq!(stack.name(), "statistics(limit(caching(driver)))");
    let resource: Arc<dyn MemoryResource> = stack.clone();
    let streams = [stream(context), stream(context), stream(context)];
    const COUNTS: [usize; 3] = [1000, 70_001, 300_001];
    const ROUNDS: usize = 10_000;
    let mut live: VecDeque<(DeviceBuffer<u32>, u32)> = VecDeque::new();
    let mut reserved_at_warm = 0;
    for round in 0..ROUNDS {
        let on = &streams[round % 3];
        let count = COUNTS[(round / 3) % 3];
        let value = round as u32 | 0x4000_0000;
        let mut buffer = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), count, on)
            .expect("typed buffer through the stack");
        buffer.fill_async(value, on).expect("fill");
        if round % 997 == 0 {
            let last = buffer
                .copy_range_to_host_async(count - 1, vec![0u32; 1], on)
                .expect("probe")
                .wait()
                .expect("probed");
            assert_eq!(last, [value], "round {round}");
        }
        live.push_back((buffer, value));
        if live.len() > 3 {
            drop(live.pop_front());
        }
        if round == 1000 {
            reserved_at_warm = allocator.stats().reserved_bytes.current;
            let refused = DeviceBuffer::<u8>::with_resource(Arc::clone(&resource), cap, on)
                .expect_err("past the limit");
            assert!(
                matches!(refused, MemoryError::OutOfMemory { limit: Some(l), .. } if l == cap),
                "{refused:?}"
            );
        }
    }
    for (buffer, value) in &live {
        let last = buffer
            .copy_range_to_host_async(buffer.len() - 1, vec![0u32; 1], &streams[0])
            .expect("probe")
            .wait()
            .expect("probed");
        assert_eq!(last, [*value]);
    }
    drop(live);
    context.synchronize().expect("sync");
    let counted = stack.stats();
    assert_eq!(counted.current_bytes, 0);
    assert_eq!(counted.current_allocations, 0);
    assert_eq!(counted.total_allocations, ROUNDS as u64);
    assert_eq!(counted.total_deallocations, ROUNDS as u64);
    assert_eq!(counted.failed_allocations, 1);
    assert!(counted.peak_allocations <= 5, "{counted:?}");
    assert_eq!(stack.upstream().used(), 0);
    assert_eq!(stack.upstream().upstream().live_allocations(), 0);
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(stats.frees, stats.allocations);
    assert_eq!(stats.allocations, ROUNDS as u64);
    assert!(
        stats.reserved_bytes.peak <= 2 * reserved_at_warm.max(64 * MIB),
        "the cache grew from {reserved_at_warm} to a peak of {} bytes",
        stats.reserved_bytes.peak
    );
    let probe = allocator.buffer::<u32>(16, &streams[0]).expect("probe");
    drop(probe);
    // Waiting blocks come back when their own shard allocates, or at `empty_cache`.
    allocator.empty_cache().expect("empty_cache");
    assert_eq!(allocator.pending_frees(), 0);
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

// ---------------------------------------------------------------------------------------------
// record_stream on four readers
// ---------------------------------------------------------------------------------------------

/// A raw block filled on its stream and read by four slow readers on four streams, each recorded
/// with `record_stream` (one twice, plus the allocating stream, both no-ops), then freed from
/// another thread: while any reader runs, the allocating stream gets other blocks, which it fills
/// at once; every reader sums the original bytes; once all are done the block comes back.
#[test]
fn a_block_recorded_on_four_reader_streams_and_freed_on_another_thread_waits_for_every_reader() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "a_block_recorded_on_four_reader_streams_and_freed_on_another_thread_waits_for_every_reader",
        "needs the readers' spins to overlap the allocating stream's fills",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let home = Arc::new(stream(context));
    let readers: Vec<Arc<Stream>> = (0..4).map(|_| Arc::new(stream(context))).collect();
    const N: usize = MIB / 4;
    const VALUE: u32 = 7;
    let mut sums = DeviceBuffer::<u64>::zeroed(context, 4).expect("sums");

    let mut block = allocator.allocate(N * 4, &home).expect("block");
    // SAFETY: the block holds N u32s; it is recorded on every stream that reads it before it is
    // freed, and used on its own stream otherwise.
    unsafe { kernels.fill_u32(&home, block.ptr(), VALUE, N) }.expect("fill");
    let filled = Event::new(context, EventFlags::DISABLE_TIMING).expect("event");
    filled.record(&home).expect("record");
    for (k, reader) in readers.iter().enumerate() {
        reader.wait_event(&filled).expect("after the fill");
        kernels
            .spin_ns(reader, (50 + 50 * k as u64) * MS)
            .expect("slow reader");
        let out = sums.slice_mut(k..k + 1).expect("sum slot");
        out.prepare_write(reader).expect("order after the zeroing");
        // SAFETY: the block holds N u32s and stays allocated until this kernel ends (recorded
        // below); `out` is one u64 of `sums`, recorded as written on this stream.
        unsafe { kernels.checksum_u32(reader, block.ptr(), N, out.device_ptr()) }
            .expect("checksum");
        out.record_write(reader).expect("record the sum");
        block.record_stream(reader).expect("record_stream");
    }
    block.record_stream(&readers[0]).expect("again");
    block.record_stream(&home).expect("its own stream");
    assert_eq!(block.recorded_streams().len(), 4);
    let old = block.ptr();
    std::thread::spawn(move || block.free())
        .join()
        .expect("freeing thread")
        .expect("free");
    assert_eq!(allocator.pending_frees(), 1);

    let mut others = Vec::new();
    for round in 0..4u32 {
        let next = allocator.allocate(N * 4, &home).expect("next");
        assert_ne!(
            next.ptr(),
            old,
            "round {round}: the block came back under a reader"
        );
        // SAFETY: `next` holds N u32s, used on its own stream only.
        unsafe { kernels.fill_u32(&home, next.ptr(), 0xDEAD_0000 | round, N) }.expect("fill");
        others.push(next);
    }
    home.synchronize().expect("sync home");
    assert!(
        !readers[3].query().expect("query"),
        "the slowest reader still runs after the other stream's fills"
    );
    assert_eq!(
        sums.to_vec().expect("sums"),
        [N as u64 * u64::from(VALUE); 4],
        "a reader saw another block's fill"
    );
    let again = allocator.allocate(N * 4, &home).expect("again");
    assert_eq!(
        again.ptr(),
        old,
        "the block comes back once every reader is done"
    );
    assert_eq!(allocator.pending_frees(), 0);
    drop((again, others));
    sums.fill(0).expect("reuse sums");
}

// ---------------------------------------------------------------------------------------------
// An async-pool chain across four streams
// ---------------------------------------------------------------------------------------------

/// RMM's `cuda_async_memory_resource` serving typed buffers on four streams, each a stage of a
/// pipeline that copies the previous stage's buffer behind a spin: the last stage holds the
/// upload exactly; after every buffer is dropped the pool has nothing outstanding, keeps its
/// memory (release threshold at the maximum) and gives it all back on `release_unused`.
#[test]
fn an_async_pool_pipeline_across_four_streams_round_trips_and_gives_its_memory_back() {
    let gpu = require_gpu!();
    let _serial = serial();
    let name = "an_async_pool_pipeline_across_four_streams_round_trips_and_gives_its_memory_back";
    let context = &gpu.context;
    let Some(pool) = async_pool_or_skip(name, context) else {
        return;
    };
    let kernels = TestKernels::load(context).expect("kernels");
    let resource: Arc<dyn MemoryResource> = pool.clone();
    let streams: Vec<Stream> = (0..4).map(|_| stream(context)).collect();
    const N: usize = 3 * MIB / 4 + 3;
    let data: Vec<u32> = (0..N as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let mut stages: Vec<DeviceBuffer<u32>> = streams
        .iter()
        .map(|s| DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, s).expect("stage"))
        .collect();
    assert!(stages.iter().all(|s| s.resource_name() == "async-pool"));
    kernels.spin_ns(&streams[0], 20 * MS).expect("slow upload");
    let upload = stages[0]
        .copy_from_host_async(data.clone(), &streams[0])
        .expect("upload");
    for (k, on) in streams.iter().enumerate().skip(1) {
        kernels.spin_ns(on, 10 * MS).expect("slow stage");
        let (done, rest) = stages.split_at_mut(k);
        rest[0]
            .copy_from_async(&done[k - 1], on)
            .expect("stage copy");
    }
    let back = stages[3]
        .copy_to_host_async(vec![0u32; N], &streams[1])
        .expect("download")
        .wait()
        .expect("downloaded");
    drop(upload.wait().expect("uploaded"));
    assert_eq!(back, data);
    drop(stages);
    context.synchronize().expect("sync");
    assert_eq!(pool.outstanding(), 0);
    assert_eq!(pool.pool().used_bytes().expect("used"), 0);
    assert!(pool.pool().reserved_bytes().expect("reserved") >= (4 * N * 4) as u64 / 2);
    pool.release_unused().expect("trim");
    assert_eq!(pool.pool().reserved_bytes().expect("reserved"), 0);
}
