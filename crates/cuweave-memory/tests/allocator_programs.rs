//! Allocator programs PyTorch and RMM users write every day, beyond `user_patterns.rs`: a
//! thousand training iterations of changing shapes with `memory_allocated` /
//! `max_memory_allocated` / `memory_reserved` / `reset_peak_memory_stats` checked at every step,
//! a per-process limit whose out-of-memory retry must wait for a block another stream still
//! reads, buffers of sizes straddling every pool and rounding boundary alive together, PyTorch's
//! `record_stream` on a raw block and on a typed buffer whose reading stream is gone, an RMM
//! composition used by eight threads at once that reconciles exactly, buffers dropped on other
//! threads under queued work or after their stream, and `pin_memory()` + `non_blocking=True`.

use std::sync::Arc;

use cuweave_driver::{Context, Event, EventFlags, Stream, StreamFlags};
use cuweave_memory::{
    Buffer, CachingAllocator, DeviceBuffer, DriverResource, LimitAdaptor, MemoryError,
    PinnedBuffer, PinnedPool, StatisticsAdaptor,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip_under_sanitizer};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// A 64-bit LCG: the same "random" shapes on every run.
fn next(state: &mut u64) -> usize {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (*state >> 33) as usize
}

const BATCHES: [usize; 4] = [3, 8, 13, 16];
const SEQUENCES: [usize; 4] = [17, 64, 77, 256];
const HIDDEN: usize = 64;
const VOCAB: usize = 1000;

/// The `u32` element counts of one forward pass: four layers, attention scores and logits
/// (odd counts; small-pool, shared-large-segment and own-segment sizes depending on the shape).
fn activations(batch: usize, sequence: usize) -> Vec<usize> {
    let tokens = batch * sequence;
    let mut counts: Vec<usize> = (0..4)
        .map(|layer| tokens * HIDDEN * (1 + layer % 2) + 2 * layer + 1)
        .collect();
    counts.push(tokens * sequence / 2 + 3);
    counts.push(tokens * VOCAB + 5);
    counts
}

/// One live tensor of the loop and the bookkeeping PyTorch's counters are checked against.
struct Live {
    buffer: DeviceBuffer<u32>,
    value: u32,
}

fn live_totals(live: &[&Live]) -> (usize, usize) {
    live.iter().fold((0, 0), |(allocated, requested), t| {
        (
            allocated + t.buffer.allocated_bytes(),
            requested + t.buffer.byte_size(),
        )
    })
}

/// A thousand iterations of a training loop whose batch and sequence length change every
/// iteration: forward activations, `loss.item()` (a synchronisation), then a backward pass that
/// allocates each gradient and frees the activation it replaces, then the optimizer's
/// synchronisation. `memory_allocated` (allocated bytes) and the requested bytes match what is
/// live after every allocation and free, `max_memory_allocated` after `reset_peak_memory_stats`
/// is the iteration's own peak, reserved is at least allocated and does not grow once every
/// shape has been seen, and `empty_cache` hands the reserve to the driver (`cuMemGetInfo`).
#[test]
fn a_thousand_training_iterations_keep_the_memory_stats_exact_and_reserved_memory_flat() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let allocator = CachingAllocator::with_driver(context);
    let s = stream(context);
    let mut state = 0x5eed_u64;
    let mut warm: Option<(usize, u64)> = None;
    const WARM_UP: usize = 64;
    const ITERATIONS: usize = 1000;
    let check = |live: &[&Live], what: &str| {
        let stats = allocator.stats();
        let (allocated, requested) = live_totals(live);
        assert_eq!(stats.allocated_bytes.current, allocated, "{what}");
        assert_eq!(stats.requested_bytes.current, requested, "{what}");
        assert!(stats.reserved_bytes.current >= allocated, "{what}");
        allocated
    };
    for iteration in 0..ITERATIONS {
        let r = next(&mut state);
        let (batch, sequence) = (BATCHES[r % 4], SEQUENCES[(r / 4) % 4]);
        allocator.reset_peak();
        assert_eq!(allocator.stats().allocated_bytes.peak, 0);
        let mut peak = 0;
        let mut forward: Vec<Live> = Vec::new();
        for (index, &count) in activations(batch, sequence).iter().enumerate() {
            let value = (iteration as u32) << 8 | index as u32 | 0x8000_0000;
            let mut buffer = allocator.buffer::<u32>(count, &s).expect("activation");
            buffer.fill_async(value, &s).expect("fill activation");
            forward.push(Live { buffer, value });
            let refs: Vec<&Live> = forward.iter().collect();
            peak = peak.max(check(
                &refs,
                &format!("iteration {iteration} forward {index}"),
            ));
        }
        s.synchronize().expect("loss.item()");
        if iteration % 100 == 0 {
            // A spot check of the last element of every activation (a read on `s`).
            for t in &forward {
                let last = t
                    .buffer
                    .copy_range_to_host_async(t.buffer.len() - 1, vec![0u32; 1], &s)
                    .expect("probe")
                    .wait()
                    .expect("probe done");
                assert_eq!(last[0], t.value, "iteration {iteration}");
            }
        }
        let mut gradients: Vec<Live> = Vec::new();
        while let Some(activation) = forward.pop() {
            let mut buffer = allocator
                .buffer::<u32>(activation.buffer.len(), &s)
                .expect("gradient");
            buffer
                .fill_async(!activation.value, &s)
                .expect("fill gradient");
            gradients.push(Live {
                buffer,
                value: !activation.value,
            });
            let refs: Vec<&Live> = forward
                .iter()
                .chain(&gradients)
                .chain([&activation])
                .collect();
            peak = peak.max(check(&refs, &format!("iteration {iteration} backward")));
            drop(activation);
            let refs: Vec<&Live> = forward.iter().chain(&gradients).collect();
            check(&refs, &format!("iteration {iteration} after a free"));
        }
        s.synchronize().expect("optimizer step");
        drop(gradients);
        let stats = allocator.stats();
        assert_eq!(stats.allocated_bytes.current, 0, "iteration {iteration}");
        assert_eq!(stats.requested_bytes.current, 0, "iteration {iteration}");
        assert_eq!(
            stats.allocated_bytes.peak, peak,
            "iteration {iteration}: max_memory_allocated after reset_peak_memory_stats"
        );
        match warm {
            None if iteration + 1 == WARM_UP => {
                warm = Some((stats.reserved_bytes.current, stats.cache_misses));
            }
            Some(before) => assert_eq!(
                (stats.reserved_bytes.current, stats.cache_misses),
                before,
                "iteration {iteration}: memory_reserved grew after every shape had been seen"
            ),
            None => {}
        }
    }
    let stats = allocator.stats();
    assert_eq!(stats.frees, stats.allocations);
    assert_eq!(stats.allocations, 12 * ITERATIONS as u64);
    assert_eq!(stats.cache_hits + stats.cache_misses, stats.allocations);
    assert_eq!((stats.ooms, stats.oom_retries), (0, 0));

    s.synchronize().expect("sync");
    let before = context.memory_info().expect("cuMemGetInfo").free;
    let released = allocator.empty_cache().expect("empty_cache");
    assert_eq!(released, stats.reserved_bytes.current);
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
    let after = context.memory_info().expect("cuMemGetInfo").free;
    assert!(
        after.saturating_sub(before) + 8 * MIB >= released,
        "empty_cache released {released} bytes, free memory went from {before} to {after}"
    );
}

/// `torch.cuda.set_per_process_memory_fraction`: an allocator over a limit. A 40 MiB tensor is
/// read by a slow kernel on another stream and dropped; a second 40 MiB tensor does not fit
/// beside its still-pending block, so the out-of-memory retry must wait for the reader and then
/// take that block (no segment given back and re-allocated) without the kernel seeing the new
/// tensor's bytes. A request past the limit with the memory really in use is a typed error
/// naming the limit.
#[test]
fn a_per_process_limit_retries_after_waiting_for_a_cached_block_still_read_elsewhere() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "a_per_process_limit_retries_after_waiting_for_a_cached_block_still_read_elsewhere",
        "needs the reader's spin to outlast the host's enqueue",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let cap = 64 * MIB;
    let limited = Arc::new(LimitAdaptor::new(DriverResource::new(context), cap));
    let allocator = CachingAllocator::new(limited.clone());
    let (a, b) = (stream(context), stream(context));
    const N: usize = 40 * MIB / 4;
    const VALUE: u32 = 0x0102_0304;

    let sum = DeviceBuffer::<u64>::zeroed(context, 1).expect("sum (outside the limit)");
    let mut x = allocator.buffer::<u32>(N, &a).expect("x");
    x.fill_async(VALUE, &a).expect("fill x");
    x.prepare_read(&b).expect("b waits for the fill");
    sum.prepare_write(&b).expect("b waits for the zeroing");
    kernels.spin_ns(&b, 200_000_000).expect("slow reader");
    // SAFETY: x holds N u32s and sum one u64; both stay allocated until the kernel is done (the
    // uses are recorded just below, so the allocator and the buffers wait for them).
    unsafe { kernels.checksum_u32(&b, x.device_ptr(), N, sum.device_ptr()) }.expect("checksum");
    x.record_read(&b).expect("record the read");
    sum.record_write(&b).expect("record the write");
    drop(x);
    assert_eq!(allocator.stats().allocated_bytes.current, 0);

    let mut y = allocator
        .buffer::<u32>(N, &a)
        .expect("fits after the retry");
    y.fill_async(!VALUE, &a).expect("fill y");
    let stats = allocator.stats();
    assert_eq!((stats.oom_retries, stats.ooms), (1, 0));
    assert_eq!(
        stats.segments_released, 0,
        "the block that waited for the reader was taken, not freed and allocated again"
    );
    assert_eq!(stats.reserved_bytes.current, 40 * MIB);
    assert_eq!(limited.used(), 40 * MIB);
    assert_eq!(
        sum.to_vec().expect("sum"),
        [N as u64 * u64::from(VALUE)],
        "the reader saw x's bytes"
    );
    assert!(y.to_vec().expect("y").iter().all(|&v| v == !VALUE));

    let error = allocator
        .buffer::<u8>(30 * MIB, &b)
        .expect_err("past the limit");
    assert_eq!(
        error,
        MemoryError::OutOfMemory {
            requested: 30 * MIB,
            allocated: 40 * MIB,
            reserved: 40 * MIB,
            limit: Some(cap),
        }
    );
    assert!(error.is_out_of_memory());
    drop(y);
    let z = allocator
        .buffer::<u8>(30 * MIB, &b)
        .expect("fits once y is gone");
    drop(z);
    allocator.empty_cache().expect("empty_cache");
    assert_eq!(limited.used(), 0);
}

/// Buffers of sizes on every side of the 512 B rounding, the 1 MiB small/large boundary, the
/// 10 MiB shared-segment boundary and the 2 MiB large rounding, of 1-, 2-, 4- and 8-byte
/// elements (byte, half, word and staged-pattern fills), all alive at once, some freed and
/// their holes refilled by a second wave: every buffer reads back its own pattern byte for
/// byte and no two live buffers' blocks overlap.
#[test]
fn buffers_straddling_every_size_boundary_keep_distinct_patterns_and_never_overlap() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let allocator = CachingAllocator::with_driver(context);
    let s = stream(context);

    enum Typed {
        U8(DeviceBuffer<u8>, u8),
        U16(DeviceBuffer<u16>, u16),
        U32(DeviceBuffer<u32>, u32),
        U64(DeviceBuffer<u64>, u64),
    }
    impl Typed {
        fn range(&self) -> (u64, u64) {
            let (ptr, bytes) = match self {
                Typed::U8(b, _) => (b.device_ptr(), b.allocated_bytes()),
                Typed::U16(b, _) => (b.device_ptr(), b.allocated_bytes()),
                Typed::U32(b, _) => (b.device_ptr(), b.allocated_bytes()),
                Typed::U64(b, _) => (b.device_ptr(), b.allocated_bytes()),
            };
            (ptr, ptr + bytes as u64)
        }
        fn check(&self, what: usize) {
            match self {
                Typed::U8(b, v) => assert!(b.to_vec().unwrap().iter().all(|x| x == v), "{what}"),
                Typed::U16(b, v) => assert!(b.to_vec().unwrap().iter().all(|x| x == v), "{what}"),
                Typed::U32(b, v) => assert!(b.to_vec().unwrap().iter().all(|x| x == v), "{what}"),
                Typed::U64(b, v) => assert!(b.to_vec().unwrap().iter().all(|x| x == v), "{what}"),
            }
        }
    }
    let make = |bytes: usize, index: usize| -> Typed {
        let tag = index as u64 + 1;
        match index % 4 {
            0 => {
                let mut b = allocator.buffer::<u8>(bytes, &s).expect("u8");
                let v = tag as u8 | 0x80;
                b.fill_async(v, &s).expect("fill u8");
                Typed::U8(b, v)
            }
            1 => {
                let mut b = allocator.buffer::<u16>(bytes.div_ceil(2), &s).expect("u16");
                let v = 0xA500 | tag as u16 & 0xff;
                b.fill_async(v, &s).expect("fill u16");
                Typed::U16(b, v)
            }
            2 => {
                let mut b = allocator.buffer::<u32>(bytes.div_ceil(4), &s).expect("u32");
                let v = 0x1234_0000 | tag as u32;
                b.fill_async(v, &s).expect("fill u32");
                Typed::U32(b, v)
            }
            _ => {
                let mut b = allocator.buffer::<u64>(bytes.div_ceil(8), &s).expect("u64");
                let v = 0x0102_0304_0506_0000 | tag;
                b.fill_async(v, &s).expect("fill u64");
                Typed::U64(b, v)
            }
        }
    };
    let first: [usize; 24] = [
        1,
        511,
        512,
        513,
        1023,
        4097,
        64 * KIB + 3,
        MIB - 513,
        MIB - 1,
        MIB,
        MIB + 1,
        MIB + 513,
        2 * MIB - 1,
        2 * MIB + 1,
        3 * MIB + 7,
        10 * MIB - 1,
        10 * MIB,
        10 * MIB + 1,
        12 * MIB - 511,
        12 * MIB + 1,
        20 * MIB - 1,
        20 * MIB + 1,
        5,
        777_777,
    ];
    let mut live: Vec<Option<Typed>> = first
        .iter()
        .enumerate()
        .map(|(index, &bytes)| Some(make(bytes, index)))
        .collect();
    // Free every third buffer and fill the holes with other sizes and patterns.
    for slot in live.iter_mut().step_by(3) {
        *slot = None;
    }
    let second = [300, 900 * KIB + 1, 4 * MIB + 3, 9 * MIB + 511, 1, 6 * MIB];
    for (index, &bytes) in second.iter().enumerate() {
        live.push(Some(make(bytes, first.len() + index)));
    }
    let live: Vec<Typed> = live.into_iter().flatten().collect();
    let mut ranges: Vec<(u64, u64)> = live.iter().map(Typed::range).collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        assert!(pair[0].1 <= pair[1].0, "blocks overlap: {pair:x?}");
    }
    for (index, buffer) in live.iter().enumerate() {
        buffer.check(index);
    }
    let stats = allocator.stats();
    let allocated: u64 = ranges.iter().map(|(start, end)| end - start).sum();
    assert_eq!(stats.allocated_bytes.current as u64, allocated);
}

/// PyTorch's `record_stream`: a block allocated on `a` and read by a slow kernel on `b`,
/// recorded there and freed (with `b`'s only handle dropped first), is not handed to the next
/// allocation on `a` until the kernel is done: the memset of the next allocation does not
/// change what the kernel sums. The same for a typed buffer read on a stream the program
/// dropped before the buffer.
#[test]
fn a_block_recorded_on_a_dropped_stream_is_not_handed_out_under_its_slow_reader() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "a_block_recorded_on_a_dropped_stream_is_not_handed_out_under_its_slow_reader",
        "needs the reader's spin to overlap the allocating stream's work",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let a = stream(context);
    const N: usize = MIB / 4;
    const VALUE: u32 = 3;
    let sums = DeviceBuffer::<u64>::zeroed(context, 2).expect("sums");
    let sums_ptr = sums.device_ptr();
    sums.prepare_write(&a).expect("order after the zeroing");

    // The raw block.
    let b = Arc::new(stream(context));
    let mut block = allocator.allocate(N * 4, &a).expect("block");
    // SAFETY: the block holds N u32s and is recorded on `b` before it is freed.
    unsafe { kernels.fill_u32(&a, block.ptr(), VALUE, N) }.expect("fill");
    let filled = Event::new(context, EventFlags::DISABLE_TIMING).expect("event");
    filled.record(&a).expect("record");
    b.wait_event(&filled).expect("b after the fill");
    kernels.spin_ns(&b, 150_000_000).expect("slow");
    // SAFETY: the block stays allocated until the kernel ends (record_stream below); `sums`
    // is recorded as written on `b` before it can be freed or read.
    unsafe { kernels.checksum_u32(&b, block.ptr(), N, sums_ptr) }.expect("sum");
    sums.record_write(&b).expect("record the sum");
    block.record_stream(&b).expect("record_stream");
    let old = block.ptr();
    drop(b);
    drop(block);
    let next = allocator.allocate(N * 4, &a).expect("next");
    assert_ne!(next.ptr(), old, "the block came back under its reader");
    // SAFETY: `next` holds N u32s, used on its own stream.
    unsafe { kernels.fill_u32(&a, next.ptr(), 0xDEAD, N) }.expect("memset next");
    a.synchronize().expect("sync a");

    // The typed buffer, read on a stream dropped before the buffer.
    let c = stream(context);
    let mut x = allocator.buffer::<u32>(N, &a).expect("x");
    x.fill_async(VALUE, &a).expect("fill x");
    x.prepare_read(&c).expect("c after the fill");
    kernels.spin_ns(&c, 150_000_000).expect("slow");
    // SAFETY: x holds N u32s, sums 2 u64s; both uses are recorded on `c` at once.
    unsafe { kernels.checksum_u32(&c, x.device_ptr(), N, sums_ptr + 8) }.expect("sum x");
    x.record_read(&c).expect("record the read");
    sums.record_write(&c).expect("record the sum");
    let old = x.device_ptr();
    drop(c);
    drop(x);
    let mut y = allocator.buffer::<u32>(N, &a).expect("y");
    assert_ne!(y.device_ptr(), old, "x's block came back under its reader");
    y.fill_async(0xBEEF, &a).expect("memset y");
    a.synchronize().expect("sync a");
    assert_eq!(
        sums.to_vec().expect("sums"),
        [N as u64 * u64::from(VALUE); 2],
        "a reader saw another allocation's memset"
    );
    assert!(y.to_vec().expect("y").iter().all(|&v| v == 0xBEEF));
    drop((next, y));
    context.synchronize().expect("sync");
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
}

/// RMM's composition under load: a caching allocator over statistics over a limit over the
/// driver, shared by eight threads on eight streams that allocate, fill, read a shared tensor
/// into, check and drop buffers of many sizes at once. At the end every count reconciles:
/// allocations and frees, hits and misses, the segments the statistics saw and the bytes the
/// limit holds; after `empty_cache` nothing is outstanding anywhere.
#[test]
fn eight_threads_through_a_composed_resource_stack_reconcile_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = Arc::clone(&gpu.context);
    let cap = 1 << 30;
    let counted = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        DriverResource::new(&context),
        cap,
    )));
    let allocator = CachingAllocator::new(counted.clone());
    let shared_len = 64 * KIB;
    let shared = Arc::new(
        DeviceBuffer::from_slice(&context, &(0..shared_len as u32).collect::<Vec<u32>>())
            .expect("shared"),
    );
    const ROUNDS: usize = 150;
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let (context, allocator, shared) = (
                Arc::clone(&context),
                allocator.clone(),
                Arc::clone(&shared),
            );
            std::thread::spawn(move || {
                let s = stream(&context);
                let mut state = u64::from(t) * 7919 + 1;
                let (mut ok, mut oom) = (0u64, 0u64);
                let mut held: Vec<(DeviceBuffer<u32>, u32)> = Vec::new();
                for round in 0..ROUNDS {
                    let r = next(&mut state);
                    let len = match r % 5 {
                        0 => r % 1000 + 1,
                        1 => 200 * 1024 + r % 4096,
                        2 => MIB / 4 + r % 777,
                        3 => 2 * MIB + r % 5000,
                        _ => shared_len,
                    };
                    match allocator.buffer::<u32>(len, &s) {
                        Ok(mut buffer) => {
                            ok += 1;
                            let value = t << 24 | round as u32;
                            if len == shared_len {
                                buffer.copy_from_async(&*shared, &s).expect("read shared");
                                held.push((buffer, u32::MAX));
                            } else {
                                buffer.fill_async(value, &s).expect("fill");
                                held.push((buffer, value));
                            }
                        }
                        Err(error) => {
                            assert!(
                                matches!(error, MemoryError::OutOfMemory { limit: Some(l), .. } if l == cap),
                                "{error:?}"
                            );
                            oom += 1;
                        }
                    }
                    if held.len() > 3 || round + 1 == ROUNDS {
                        for (buffer, value) in held.drain(..) {
                            // Both ends of every buffer (the whole of a small one).
                            let probe = buffer.len().min(1024);
                            for offset in [0, buffer.len() - probe] {
                                let host = buffer
                                    .copy_range_to_host_async(offset, vec![0u32; probe], &s)
                                    .expect("download")
                                    .wait()
                                    .expect("downloaded");
                                for (i, &v) in host.iter().enumerate() {
                                    let expected = if value == u32::MAX {
                                        (offset + i) as u32
                                    } else {
                                        value
                                    };
                                    assert_eq!(v, expected, "thread {t} element {}", offset + i);
                                }
                            }
                        }
                    }
                }
                (ok, oom)
            })
        })
        .collect();
    let (mut ok, mut oom) = (0, 0);
    for thread in threads {
        let (o, f) = thread.join().expect("worker");
        ok += o;
        oom += f;
    }
    assert_eq!(ok + oom, 8 * ROUNDS as u64);
    let stats = allocator.stats();
    let upstream = counted.stats();
    assert_eq!(stats.allocations, ok);
    assert_eq!(stats.ooms, oom);
    assert_eq!(stats.frees, stats.allocations);
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(stats.requested_bytes.current, 0);
    assert_eq!(stats.cache_hits + stats.cache_misses, stats.allocations);
    assert_eq!(upstream.total_allocations, stats.cache_misses);
    assert_eq!(
        upstream.total_allocations - upstream.total_deallocations,
        stats.segments.current as u64
    );
    assert_eq!(upstream.total_deallocations, stats.segments_released);
    assert_eq!(upstream.failed_allocations, stats.oom_retries + stats.ooms);
    assert_eq!(upstream.current_bytes, stats.reserved_bytes.current);
    assert_eq!(counted.upstream().used(), stats.reserved_bytes.current);

    drop(shared);
    context.synchronize().expect("sync");
    let released = allocator.empty_cache().expect("empty_cache");
    assert_eq!(released, stats.reserved_bytes.current);
    let upstream = counted.stats();
    assert_eq!(
        (upstream.current_bytes, upstream.current_allocations),
        (0, 0)
    );
    assert_eq!(counted.upstream().used(), 0);
    assert_eq!(allocator.stats().segments.current, 0);
}

/// A buffer moved to another thread and dropped there while its stream still has its fill and
/// a copy out of it queued behind a slow kernel: the drop returns at once, the copy reads the
/// fill, and the next buffer on that stream does not overwrite it first. A buffer whose stream
/// the program dropped first still reads back and is freed; its memory (cached for a stream that
/// no longer exists) is not handed to another stream while the dead stream's work still runs,
/// is adopted by the next miss of a live stream once it has finished (the reserve does not
/// grow), and goes back with `empty_cache`.
#[test]
fn buffers_dropped_on_another_thread_under_queued_work_or_after_their_stream_stay_correct() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "buffers_dropped_on_another_thread_under_queued_work_or_after_their_stream_stay_correct",
        "needs the spin to outlast the other thread's drop",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let s = stream(context);
    const N: usize = 256 * KIB;

    let mut copy = allocator.buffer::<u32>(N, &s).expect("copy");
    let mut x = allocator.buffer::<u32>(N, &s).expect("x");
    kernels.spin_ns(&s, 150_000_000).expect("slow");
    x.fill_async(0x600D, &s).expect("fill x");
    copy.copy_from_async(&x, &s).expect("copy x");
    let old = x.device_ptr();
    std::thread::spawn(move || drop(x))
        .join()
        .expect("dropping thread");
    assert!(!s.query().expect("query"), "the drop waited for the stream");
    let mut next = allocator.buffer::<u32>(N, &s).expect("next");
    assert_ne!(
        next.device_ptr(),
        old,
        "x's block came back under its queued work"
    );
    next.fill_async(0xBAD, &s).expect("fill next");
    assert!(copy.to_vec().expect("copy").iter().all(|&v| v == 0x600D));
    assert!(next.to_vec().expect("next").iter().all(|&v| v == 0xBAD));
    drop((copy, next));

    // The stream goes first.
    let gone = stream(context);
    let mut y = allocator.buffer::<u32>(N, &gone).expect("y");
    kernels.spin_ns(&gone, 50_000_000).expect("slow");
    y.fill_async(0x5EED, &gone).expect("fill y");
    let y_ptr = y.device_ptr();
    drop(gone);
    assert!(y.to_vec().expect("y").iter().all(|&v| v == 0x5EED));
    drop(y);
    assert_eq!(allocator.stats().allocated_bytes.current, 0);

    // `gone`'s work has finished: the next miss of a live stream adopts its free block.
    context.synchronize().expect("sync");
    let dying = stream(context);
    let mut w = allocator.buffer::<u32>(N, &dying).expect("w");
    let w_ptr = w.device_ptr();
    assert_eq!(
        w_ptr, y_ptr,
        "a finished dead stream's free block was not adopted"
    );
    // A dead stream's block freed under its still running work: not another stream's yet.
    kernels.spin_ns(&dying, 300_000_000).expect("slow");
    w.fill_async(0xD1E, &dying).expect("fill w");
    drop(dying);
    drop(w);
    let fresh = stream(context);
    let z = allocator.buffer::<u32>(N, &fresh).expect("z");
    assert_ne!(
        z.device_ptr(),
        w_ptr,
        "a new stream got a dead stream's block under its running work"
    );
    assert_ne!(
        allocator.stats().allocated_bytes.current,
        0,
        "z is allocated"
    );
    // Once the dead streams' work has finished, a live stream's miss adopts their free
    // segments instead of growing the reserve.
    context.synchronize().expect("sync");
    let reserved = allocator.stats().reserved_bytes.current;
    let other = stream(context);
    let v = allocator.buffer::<u32>(N, &other).expect("v");
    assert_eq!(
        v.device_ptr(),
        w_ptr,
        "a finished dead stream's free block was not adopted"
    );
    assert_eq!(allocator.stats().reserved_bytes.current, reserved);
    drop(v);
    drop(z);
    context.synchronize().expect("sync");
    allocator.empty_cache().expect("empty_cache");
    let stats = allocator.stats();
    assert_eq!(
        (stats.reserved_bytes.current, stats.segments.current),
        (0, 0)
    );
}

/// `pin_memory()` + `copy_(non_blocking=True)` and host reuse: an owned pinned buffer is gone
/// into the copy until it lands; a borrowed one is refused (`DeviceBusy`) or waited for after
/// its `PendingCopy` is forgotten; a pool buffer dropped under its copy is not handed out again
/// until the copy has read it. The device always gets the bytes the host had at the copy.
#[test]
fn pinned_non_blocking_copies_never_let_the_host_reuse_memory_before_the_copy_lands() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "pinned_non_blocking_copies_never_let_the_host_reuse_memory_before_the_copy_lands",
        "needs the spin to outlast the host's checks",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let s = stream(context);
    const N: usize = 512 * KIB;
    let batch: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
    let mut device = DeviceBuffer::<f32>::new_on(&s, N).expect("device");

    // Owned: the PendingCopy holds the pinned buffer until the copy lands.
    let pinned = PinnedBuffer::from_slice(context, &batch).expect("pin_memory");
    kernels.spin_ns(&s, 100_000_000).expect("slow");
    let pending = device.copy_from_host_async(pinned, &s).expect("upload");
    assert!(!pending.is_complete().expect("query"));
    let mut pinned = pending.wait().expect("landed");
    pinned.as_mut_slice().expect("host reuse").fill(-1.0);
    assert_eq!(device.to_vec().expect("device"), batch);

    // Borrowed, with the PendingCopy forgotten: the host side is refused, then waited for.
    pinned.copy_from_host(&batch).expect("refill");
    kernels.spin_ns(&s, 100_000_000).expect("slow");
    let mut other = DeviceBuffer::<f32>::new_on(&s, N).expect("other");
    std::mem::forget(other.copy_from_host_async(&mut pinned, &s).expect("upload"));
    assert!(matches!(
        pinned.try_as_mut_slice(),
        Err(MemoryError::DeviceBusy { .. })
    ));
    pinned.as_mut_slice().expect("waits").fill(-2.0);
    assert_eq!(other.to_vec().expect("other"), batch);

    // Downloads into a borrowed buffer: the host sees the bytes only after they land.
    kernels.spin_ns(&s, 100_000_000).expect("slow");
    std::mem::forget(other.copy_to_host_async(&mut pinned, &s).expect("download"));
    assert!(matches!(
        pinned.try_as_slice(),
        Err(MemoryError::DeviceBusy { .. })
    ));
    assert_eq!(pinned.as_slice().expect("waits"), &batch[..]);

    // A pool buffer dropped under its upload.
    let pool = PinnedPool::new(context);
    let mut staged = pool.buffer::<f32>(N).expect("staging");
    staged
        .as_mut_slice()
        .expect("fresh")
        .copy_from_slice(&batch);
    let old = staged.as_host_ptr();
    let mut third = DeviceBuffer::<f32>::new_on(&s, N).expect("third");
    kernels.spin_ns(&s, 100_000_000).expect("slow");
    std::mem::forget(third.copy_from_host_async(&staged, &s).expect("upload"));
    drop(staged);
    let mut again = pool.buffer::<f32>(N).expect("again");
    assert!(!s.query().expect("query"), "the spin outlasts the checks");
    assert_ne!(
        again.as_host_ptr(),
        old,
        "the pool handed out a block under its copy"
    );
    again.as_mut_slice().expect("new block").fill(-3.0);
    assert_eq!(third.to_vec().expect("third"), batch);
}
