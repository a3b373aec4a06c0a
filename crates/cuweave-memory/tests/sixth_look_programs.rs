//! A sixth look, at the code changed last: PyTorch's allocator settings
//! (`max_split_size_mb`, `set_per_process_memory_fraction`) through
//! `CachingAllocator::with_config`, the out-of-memory retry's last try with a segment of the
//! request's own size, host reads of pinned and unified buffers that now wait only for device
//! writes, and the `LoggingAdaptor`'s line order around a refused free.
//!
//! - a training loop alternating an oversize activation with small and medium pieces: the
//!   oversize block is never carved, is reused whole, and the books stop growing;
//! - oversize blocks taken whole only within 20 MiB, and `empty_cache` keeping exactly the live
//!   oversize segment, the snapshot agreeing with the statistics;
//! - a `record_stream`'d oversize block, freed while its second stream is held behind a gate:
//!   never handed out again until that stream has passed it, then reused whole;
//! - a memory fraction refusing an allocation inside a capture (private pool): the typed error
//!   names the cap, as the same refusal outside a capture does;
//! - two threads on two streams under a 24 MiB budget, each holding a 4 MiB buffer (one in a
//!   segment of its own size), then churning without a single out-of-memory;
//! - a memory fraction with three streams: the own-size segment fits once, the third is refused
//!   naming the cap, and after a drop the cache of another stream is released to make room;
//! - a pinned buffer: a queued device read does not hold a host read back but does hold a host
//!   write; a gated kernel write into a view on another stream (and a device read of it queued
//!   behind on the same stream) holds the host read until it lands;
//! - a unified buffer: a gated copy into one of its views holds host reads; a gated device read
//!   holds host writes only, and the device read sees the bytes from before the host write;
//! - a captured graph that reads one pinned buffer and writes a view of another, launched
//!   behind a gate: the host write of the first and the host read of the second both wait;
//! - a `LoggingAdaptor` over a tracking adaptor refusing a free of the wrong size: `free`, then
//!   `free failure` for the same address, the address still live, its real free logged after.
//!
//! Every GPU test takes the serial guard: several hold a stream behind a gate, capture, or need
//! the device's memory to themselves for a budget.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::{Context, InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::caching::{
    AllocatorConfig, CachingAllocator, GraphPool, MissPolicy, begin_allocate_to_pool,
};
use cuweave_memory::resource::{
    DriverResource, LOG_HEADER, LimitAdaptor, LoggingAdaptor, MemoryResource, TrackingAdaptor,
};
use cuweave_memory::{
    Buffer, DeviceBuffer, ManagedCapabilities, MemoryError, PinnedBuffer, UnifiedBuffer,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{poll_until, require_gpu, serial, skip};

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

#[path = "common/tracked.rs"]
mod tracked;
use tracked::{fill_kernel, tracked_fill};

const MIB: usize = 1 << 20;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

fn assert_busy<T>(result: cuweave_memory::Result<T>, what: &str) {
    match result {
        Err(MemoryError::DeviceBusy { .. }) => {}
        Err(other) => panic!("{what}: expected DeviceBusy, got {other:?}"),
        Ok(_) => panic!("{what}: host access granted while queued GPU work conflicts with it"),
    }
}

/// The cap `with_config` derives from `fraction` (the library's own arithmetic).
fn cap_of(fraction: f64, total: usize) -> usize {
    ((total as f64 * fraction) as usize).max(1)
}

/// A round trip of a few words at both ends and the middle of `buffer`, which must be real
/// memory of its full length.
fn round_trip_ends(buffer: &mut DeviceBuffer<u32>, seed: u32) {
    let n = buffer.len();
    for offset in [0, n / 2, n - 64] {
        let words: Vec<u32> = (0..64u32).map(|i| seed ^ (i + offset as u32)).collect();
        buffer
            .copy_range_from_host(offset, &words)
            .expect("upload a range");
        let mut back = vec![0u32; 64];
        buffer
            .copy_range_to_host(offset, &mut back)
            .expect("download a range");
        assert_eq!(back, words, "bytes at {offset} of {n} words");
    }
}

// ---------------------------------------------------------------------------------------------
// max_split_size
// ---------------------------------------------------------------------------------------------

/// A PyTorch training loop under `max_split_size_mb:64`: each step makes a 100 MiB activation,
/// frees it, then makes an 8 MiB, a 30 MiB and a 512 KiB temporary. The temporaries never land
/// inside the freed activation's block, every step's activation gets that same block back whole,
/// and from the second step on nothing new is reserved (segments, reserved bytes and misses
/// flat over 20 steps). Bytes round-trip in every buffer.
#[test]
fn an_oversize_activation_alternating_with_temporaries_is_reused_whole_and_never_carved() {
    let _serial = serial();
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    let config: AllocatorConfig = "max_split_size_mb:64".parse().unwrap();
    let allocator =
        CachingAllocator::with_config(Arc::new(DriverResource::new(&gpu.context)), config).unwrap();
    let mut activation_at = None;
    let mut after_first = None;
    for step in 0..20u32 {
        let mut activation = allocator.buffer::<u32>(100 * MIB / 4, &s).unwrap();
        round_trip_ends(&mut activation, step);
        let base = activation.device_ptr();
        match activation_at {
            None => activation_at = Some(base),
            Some(first) => assert_eq!(base, first, "step {step}: the oversize block reused whole"),
        }
        drop(activation);
        let mut pieces = Vec::new();
        for len in [8 * MIB / 4, 30 * MIB / 4, 128 * 1024] {
            let mut piece = allocator.buffer::<u32>(len, &s).unwrap();
            let start = piece.device_ptr();
            let end = start + piece.byte_size() as u64;
            assert!(
                end <= base || start >= base + 100 * MIB as u64,
                "step {step}: a {len}-word temporary at {start:#x} carved the oversize block at \
                 {base:#x}"
            );
            round_trip_ends(&mut piece, step ^ len as u32);
            pieces.push(piece);
        }
        drop(pieces);
        let stats = allocator.stats();
        let books = (
            stats.segments.current,
            stats.reserved_bytes.current,
            stats.cache_misses,
        );
        match after_first {
            None => after_first = Some(books),
            Some(first) => assert_eq!(books, first, "step {step}: the cache kept growing"),
        }
    }
    s.synchronize().unwrap();
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

/// `max_split_size_mb:32` with raw allocations: a freed 64 MiB block is not taken by a 26 MiB
/// request (below the limit) nor by a 40 MiB one (more than 20 MiB smaller), but a 46 MiB
/// request takes it whole (its block is 64 MiB). `empty_cache` with only that one live keeps
/// exactly its segment; the snapshot agrees with the statistics at each step.
#[test]
fn oversize_blocks_are_taken_whole_only_within_twenty_mib_and_empty_cache_keeps_the_live_one() {
    let _serial = serial();
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    let config = AllocatorConfig::default().with_max_split_size(32 * MIB);
    let allocator =
        CachingAllocator::with_config(Arc::new(DriverResource::new(&gpu.context)), config).unwrap();
    let agree = |when: &str| {
        let stats = allocator.stats();
        let snapshot = allocator.snapshot();
        assert_eq!(
            snapshot.reserved_bytes(),
            stats.reserved_bytes.current,
            "{when}: {snapshot}"
        );
        assert_eq!(
            snapshot.segments.len(),
            stats.segments.current,
            "{when}: {snapshot}"
        );
    };
    let big = allocator.allocate(64 * MIB, &s).unwrap();
    let big_ptr = big.ptr();
    big.free().unwrap();
    let below = allocator.allocate(26 * MIB, &s).unwrap();
    assert_ne!(
        below.ptr(),
        big_ptr,
        "a request below the limit took an oversize block"
    );
    let far = allocator.allocate(40 * MIB, &s).unwrap();
    assert_ne!(
        far.ptr(),
        big_ptr,
        "a 40 MiB request took a 64 MiB oversize block (24 MiB more)"
    );
    let near = allocator.allocate(46 * MIB, &s).unwrap();
    assert_eq!(
        near.ptr(),
        big_ptr,
        "within 20 MiB the oversize block is reused"
    );
    assert_eq!(near.block_size(), 64 * MIB, "taken whole, never split");
    assert_eq!(
        allocator.stats().segments.current,
        3,
        "no fourth segment: {}",
        allocator.snapshot()
    );
    agree("three live");
    below.free().unwrap();
    far.free().unwrap();
    s.synchronize().unwrap();
    allocator.empty_cache().unwrap();
    agree("after empty_cache");
    let stats = allocator.stats();
    assert_eq!(
        (stats.segments.current, stats.reserved_bytes.current),
        (1, 64 * MIB),
        "only the live oversize segment is left"
    );
    near.free().unwrap();
    s.synchronize().unwrap();
    allocator.empty_cache().unwrap();
    agree("all released");
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

/// PyTorch's `x.record_stream(side)` on an oversize tensor: a 64 MiB block under
/// `max_split_size_mb:32` is recorded on a second stream held behind a gate, then freed. A
/// 64 MiB request on the home stream meanwhile gets other memory; once the side stream has
/// passed the gate, a 50 MiB request on the home stream takes the old block whole.
#[test]
fn a_record_streamed_oversize_block_waits_for_its_side_stream_then_is_reused_whole() {
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let home = stream(context);
    let side = Arc::new(stream(context));
    let config = AllocatorConfig::default().with_max_split_size(32 * MIB);
    let allocator =
        CachingAllocator::with_config(Arc::new(DriverResource::new(context)), config).unwrap();
    let gate = Gate::new(context);
    gate.hold(&kernels, &side);
    let mut block = allocator.allocate(64 * MIB, &home).unwrap();
    let old = block.ptr();
    block.record_stream(&side).unwrap();
    block.free().unwrap();
    let other = allocator.allocate(64 * MIB, &home).unwrap();
    assert_ne!(
        other.ptr(),
        old,
        "an oversize block handed out while its recorded stream may still use it"
    );
    gate.open();
    side.synchronize().unwrap();
    let again = allocator.allocate(50 * MIB, &home).unwrap();
    assert_eq!(
        again.ptr(),
        old,
        "the settled oversize block is reused: {}",
        allocator.snapshot()
    );
    assert_eq!(again.block_size(), 64 * MIB);
    other.free().unwrap();
    again.free().unwrap();
    home.synchronize().unwrap();
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

// ---------------------------------------------------------------------------------------------
// memory_fraction and the out-of-memory retry's own-size segment
// ---------------------------------------------------------------------------------------------

/// `torch.cuda.set_per_process_memory_fraction` and `torch.cuda.graph(pool=...)`: with a cap of
/// about 30 MiB, a 16 MiB scratch allocated inside the capture fits, a second one does not. The
/// refusal is `OutOfMemory` naming the cap (`limit`, documented as "the cap of a limiting
/// adaptor, when one refused"), as the same refusal outside a capture is.
#[test]
fn a_memory_fraction_refusal_inside_a_capture_names_the_cap() {
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let total = gpu.device.total_memory().unwrap();
    let fraction = (30 * MIB) as f64 / total as f64;
    let cap = cap_of(fraction, total);
    let config = AllocatorConfig::default().with_memory_fraction(fraction);
    let allocator =
        CachingAllocator::with_config(Arc::new(DriverResource::new(context)), config).unwrap();
    let s = stream(context);

    let eager = allocator.buffer::<u8>(16 * MIB, &s).unwrap();
    match allocator.buffer::<u8>(16 * MIB, &s) {
        Err(MemoryError::OutOfMemory { limit, .. }) => assert_eq!(limit, Some(cap), "eager"),
        other => panic!("eager, past the cap: {other:?}"),
    }
    drop(eager);
    s.synchronize().unwrap();
    allocator.empty_cache().unwrap();

    let pool = GraphPool::new();
    s.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let routed = begin_allocate_to_pool(&s, &pool, MissPolicy::default()).unwrap();
    let mut first = allocator.buffer::<u32>(16 * MIB / 4, &s).unwrap();
    first.fill_async(5, &s).unwrap();
    let refused = allocator.buffer::<u32>(16 * MIB / 4, &s);
    drop(first);
    drop(routed);
    let graph = s.end_capture().unwrap();
    match refused {
        Err(MemoryError::OutOfMemory {
            requested, limit, ..
        }) => {
            assert_eq!(requested, 16 * MIB);
            assert_eq!(
                limit,
                Some(cap),
                "inside a capture the refusal of the memory fraction's cap must name it"
            );
        }
        other => panic!("inside the capture, past the cap: {other:?}"),
    }
    drop(graph);
    drop(pool);
    s.synchronize().unwrap();
    allocator.empty_cache().unwrap();
    assert!(allocator.stats().reserved_bytes.current <= cap);
}

/// Two data-loader threads, each on its own stream, under a 24 MiB `LimitAdaptor` budget: each
/// holds a 4 MiB buffer at once (one in a shared 20 MiB segment, the other, after the retry, in
/// a segment of its own size), the bytes of both round-trip, and then 50 rounds each of free and
/// re-allocate on its own stream never run out of memory nor pass the budget.
#[test]
fn two_threads_on_two_streams_each_hold_4_mib_under_a_24_mib_budget_and_churn_without_ooms() {
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let limit = Arc::new(LimitAdaptor::new(DriverResource::new(context), 24 * MIB));
    let allocator = CachingAllocator::new(limit.clone());
    let both = Barrier::new(2);
    std::thread::scope(|scope| {
        for worker in 0..2u32 {
            let (allocator, both, context, limit) = (&allocator, &both, context, &limit);
            scope.spawn(move || {
                let s = stream(context);
                both.wait();
                let held = allocator.buffer::<u32>(MIB, &s);
                both.wait(); // both asked; on success both are held at once
                let mut held = held.unwrap_or_else(|e| panic!("worker {worker}: 4 MiB: {e}"));
                round_trip_ends(&mut held, worker);
                assert!(limit.used() <= 24 * MIB);
                for round in 0..50u32 {
                    drop(held);
                    held = allocator
                        .buffer::<u32>(MIB, &s)
                        .unwrap_or_else(|e| panic!("worker {worker} round {round}: {e}"));
                    round_trip_ends(&mut held, worker << 16 | round);
                }
                drop(held);
                s.synchronize().unwrap();
            });
        }
    });
    let stats = allocator.stats();
    assert_eq!(stats.ooms, 0, "{stats:?}");
    assert!(stats.reserved_bytes.peak <= 24 * MIB, "{stats:?}");
    allocator.empty_cache().unwrap();
    assert_eq!(limit.used(), 0);
}

/// `memory_fraction` worth about 26 MiB, three streams: 4 MiB on the first takes a 20 MiB
/// segment, 4 MiB on the second a 4 MiB one; 4 MiB on the third is refused naming the cap, with
/// one counted out-of-memory. Once the second stream's buffer is dropped, the third's request
/// releases that cached segment and fits in one of its own; its bytes round-trip.
#[test]
fn a_memory_fraction_fits_one_own_size_segment_and_frees_another_streams_cache_for_the_next() {
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let total = gpu.device.total_memory().unwrap();
    let fraction = (26 * MIB) as f64 / total as f64;
    let cap = cap_of(fraction, total);
    let text = format!("max_split_size_mb:64,memory_fraction:{fraction}");
    let config: AllocatorConfig = text.parse().unwrap();
    let allocator =
        CachingAllocator::with_config(Arc::new(DriverResource::new(context)), config).unwrap();
    let (a, b, c) = (stream(context), stream(context), stream(context));
    let mut first = allocator.buffer::<u32>(MIB, &a).unwrap();
    let mut second = allocator.buffer::<u32>(MIB, &b).unwrap();
    round_trip_ends(&mut first, 1);
    round_trip_ends(&mut second, 2);
    let stats = allocator.stats();
    assert_eq!(
        stats.reserved_bytes.current,
        24 * MIB,
        "{}",
        allocator.snapshot()
    );
    assert_eq!(stats.ooms, 0);
    match allocator.buffer::<u32>(MIB, &c) {
        Err(MemoryError::OutOfMemory {
            requested, limit, ..
        }) => assert_eq!((requested, limit), (4 * MIB, Some(cap))),
        other => panic!("a third 4 MiB past the cap: {other:?}"),
    }
    assert_eq!(allocator.stats().ooms, 1);
    drop(second);
    b.synchronize().unwrap();
    let mut third = allocator
        .buffer::<u32>(MIB, &c)
        .expect("the second stream's cached segment released for the third");
    round_trip_ends(&mut third, 3);
    let stats = allocator.stats();
    assert!(stats.reserved_bytes.current <= cap, "{stats:?}");
    assert_eq!(stats.ooms, 1, "{stats:?}");
    drop((first, third));
    a.synchronize().unwrap();
    c.synchronize().unwrap();
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

// ---------------------------------------------------------------------------------------------
// Host reads wait for device writes only
// ---------------------------------------------------------------------------------------------

/// A loader's pinned batch: a device copy out of it queued behind a gate does not hold back a
/// host read (which sees the batch) but holds a host write. Then a kernel writing the middle
/// third of it through a view on another stream, with a device read of that view queued behind
/// it on the same stream, both gated: the host read is refused, and a blocking read on another
/// thread returns only after the gate opens, with the kernel's words in the middle and the batch
/// elsewhere.
#[test]
fn a_pinned_host_read_passes_queued_device_reads_but_waits_for_a_gated_view_write() {
    const N: usize = 1 << 18;
    const LO: usize = N / 3;
    const HI: usize = 2 * N / 3;
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let fill = fill_kernel(&kernels);
    let (r, w) = (stream(context), stream(context));
    let data: Vec<u32> = (0..N as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let mut pinned = PinnedBuffer::from_slice(context, &data).unwrap();
    let mut device = DeviceBuffer::<u32>::new(context, N).unwrap();

    let read_gate = Gate::new(context);
    read_gate.hold(&kernels, &r);
    device.copy_from_async(&pinned, &r).unwrap();
    {
        let host = pinned
            .try_as_slice()
            .expect("a queued device read does not hold a host read back");
        assert!(host.iter().eq(data.iter()));
    }
    assert_busy(
        pinned.try_as_mut_slice(),
        "host write under a gated device read",
    );
    read_gate.open();
    r.synchronize().unwrap();
    assert_eq!(device.to_vec().unwrap(), data);

    let write_gate = Gate::new(context);
    write_gate.hold(&kernels, &w);
    tracked_fill(
        &fill,
        &w,
        &mut pinned.slice_mut(LO..HI).unwrap(),
        0xABCD_0123,
    );
    let mut back = DeviceBuffer::<u32>::new(context, HI - LO).unwrap();
    back.copy_from_async(&pinned.slice(LO..HI).unwrap(), &w)
        .unwrap();
    assert_busy(pinned.try_as_slice(), "host read under a gated view write");
    let started = AtomicBool::new(false);
    let got = std::thread::scope(|scope| {
        let (pinned, started) = (&pinned, &started);
        let reader = scope.spawn(move || {
            started.store(true, Ordering::SeqCst);
            pinned.as_slice().expect("blocking read").to_vec()
        });
        assert!(poll_until(Duration::from_secs(10), || started.load(Ordering::SeqCst)));
        write_gate.open();
        reader.join().unwrap()
    });
    for (i, (&got, &was)) in got.iter().zip(&data).enumerate() {
        let expected = if (LO..HI).contains(&i) {
            0xABCD_0123
        } else {
            was
        };
        assert_eq!(
            got, expected,
            "element {i}: the host read ran under the write"
        );
    }
    assert!(back.to_vec().unwrap().iter().all(|&x| x == 0xABCD_0123));
}

/// A unified (managed) buffer shared by host and GPU: a copy into one of its views on a gated
/// stream holds host reads (polled and blocking); a gated device read of the whole buffer on
/// another stream lets the host read but holds the host write, and the device read gets the
/// bytes from before that write.
#[test]
fn a_unified_host_read_waits_for_a_gated_copy_into_a_view_and_a_host_write_for_a_gated_read() {
    const N: usize = 1 << 18; // 1 MiB of u32s
    const LO: usize = 1000;
    const HI: usize = N - 777;
    let test =
        "a_unified_host_read_waits_for_a_gated_copy_into_a_view_and_a_host_write_for_a_gated_read";
    let _serial = serial();
    let gpu = require_gpu!();
    let capabilities = ManagedCapabilities::of(gpu.device).unwrap();
    if !(capabilities.managed_memory && capabilities.concurrent_managed_access) {
        skip(test, "no managed memory with concurrent access on device 0");
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let (r, w) = (stream(context), stream(context));
    let data: Vec<u32> = (0..N as u32).collect();
    let mut unified = UnifiedBuffer::from_slice(context, &data).unwrap();
    let nines = DeviceBuffer::from_slice(context, &vec![9u32; HI - LO]).unwrap();

    let gate = Gate::new(context);
    gate.hold(&kernels, &w);
    unified
        .slice_mut(LO..HI)
        .unwrap()
        .copy_from_async(&nines, &w)
        .unwrap();
    assert_busy(
        unified.try_as_slice(),
        "host read under a gated copy into a view",
    );
    assert_busy(unified.try_as_mut_slice(), "host write under a gated copy");
    let started = AtomicBool::new(false);
    let got = std::thread::scope(|scope| {
        let (unified, started) = (&unified, &started);
        let reader = scope.spawn(move || {
            started.store(true, Ordering::SeqCst);
            unified.as_slice().expect("blocking read").to_vec()
        });
        assert!(poll_until(Duration::from_secs(10), || started.load(Ordering::SeqCst)));
        gate.open();
        reader.join().unwrap()
    });
    let mut expected = data.clone();
    expected[LO..HI].fill(9);
    assert!(
        got == expected,
        "the host read ran under the copy into the view"
    );

    let read_gate = Gate::new(context);
    read_gate.hold(&kernels, &r);
    let mut device = DeviceBuffer::<u32>::new(context, N).unwrap();
    device.copy_from_async(&unified, &r).unwrap();
    {
        let host = unified
            .try_as_slice()
            .expect("a queued device read does not hold a host read back");
        assert!(*host == expected[..]);
    }
    assert_busy(
        unified.try_as_mut_slice(),
        "host write under a gated device read",
    );
    read_gate.open();
    unified.as_mut_slice().unwrap().fill(7);
    assert!(
        device.to_vec().unwrap() == expected,
        "the device read saw the host's later write"
    );
    assert!(unified.as_slice().unwrap().iter().all(|&x| x == 7));
}

/// `torch.cuda.graph` replaying a step that reads a pinned input and writes a view of a pinned
/// output, launched behind a gate: the host may neither write the input nor read the output
/// until it has run. After the gate opens, the output view holds the kernel's words, and the
/// host's new input does not reach the launch that already read the old one.
#[test]
fn a_gated_graph_launch_holds_host_writes_of_what_it_reads_and_host_reads_of_what_it_writes() {
    const N: usize = 1 << 16;
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let fill = fill_kernel(&kernels);
    let g = stream(context);
    let old: Vec<u32> = (0..N as u32).map(|i| i ^ 0x5A5A).collect();
    let mut input = PinnedBuffer::from_slice(context, &old).unwrap();
    let mut output = PinnedBuffer::<u32>::zeroed(context, N).unwrap();
    let mut out = DeviceBuffer::<u32>::new(context, N).unwrap();

    g.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    out.copy_from_async(&input, &g).unwrap();
    tracked_fill(
        &fill,
        &g,
        &mut output.slice_mut(N / 4..N / 2).unwrap(),
        0xFEED,
    );
    let graph = g.end_capture().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    let gate = Gate::new(context);
    gate.hold(&kernels, &g);
    exec.launch(&g).unwrap();
    assert_busy(
        input.try_as_mut_slice(),
        "host write of what a gated graph reads",
    );
    assert_busy(
        output.try_as_slice(),
        "host read of what a gated graph writes",
    );
    gate.open();
    {
        let host = output.as_slice().unwrap();
        for (i, &x) in host.iter().enumerate() {
            let expected = if (N / 4..N / 2).contains(&i) {
                0xFEED
            } else {
                0
            };
            assert_eq!(x, expected, "output element {i}");
        }
    }
    input.as_mut_slice().unwrap().fill(0xDEAD);
    g.synchronize().unwrap();
    assert_eq!(
        out.to_vec().unwrap(),
        old,
        "the launch read the host's later write"
    );
    drop(exec);
    drop(graph);
}

// ---------------------------------------------------------------------------------------------
// LoggingAdaptor line order
// ---------------------------------------------------------------------------------------------

/// A `Write` sink the test reads back.
#[derive(Clone, Default)]
struct SharedSink(Arc<Mutex<Vec<u8>>>);

impl Write for SharedSink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// RMM's `logging_resource_adaptor` over a tracking one: a free with the wrong size is refused
/// by the books (typed, nothing freed). The log has `free` and right after it `free failure`
/// for that address; the allocation is still live (the real free goes through, logged as a
/// plain `free` after), and the books balance to nothing.
#[test]
fn a_refused_free_is_logged_free_then_free_failure_and_the_address_stays_live() {
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let s = stream(context);
    let sink = SharedSink::default();
    let logged = LoggingAdaptor::new(
        TrackingAdaptor::new(DriverResource::new(context)),
        sink.clone(),
    )
    .unwrap();
    let ptr = logged.allocate(MIB, &s).unwrap();
    let refused = logged.deallocate(ptr, MIB / 2, &s);
    assert!(refused.is_err(), "a free of the wrong size went through");
    assert_eq!(logged.upstream().outstanding_count(), 1);
    assert_eq!(logged.upstream().outstanding_bytes(), MIB);
    logged.deallocate(ptr, MIB, &s).unwrap();
    assert_eq!(logged.upstream().outstanding_count(), 0);
    logged.flush().unwrap();
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], LOG_HEADER);
    let actions: Vec<(&str, &str, &str)> = lines[1..]
        .iter()
        .map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            assert_eq!(fields.len(), 6, "{line}");
            (fields[2], fields[3], fields[4])
        })
        .collect();
    let address = format!("{ptr:#x}");
    let half = (MIB / 2).to_string();
    let whole = MIB.to_string();
    assert_eq!(
        actions,
        vec![
            ("allocate", address.as_str(), whole.as_str()),
            ("free", address.as_str(), half.as_str()),
            ("free failure", address.as_str(), half.as_str()),
            ("free", address.as_str(), whole.as_str()),
        ],
        "{text}"
    );
}
