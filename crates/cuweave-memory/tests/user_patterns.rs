//! What users of PyTorch's caching allocator and of RMM's memory resources write every day, on a
//! real GPU: a training loop that allocates and drops tensors of many sizes on one and on two
//! streams (reserved memory flat after warm-up, statistics that add up, `empty_cache` giving the
//! memory back to the driver), a tensor dropped on the host while another stream still reads it
//! (a non-blocking download, a device copy), an allocation larger than the device, composed
//! resources with a limit and statistics, views, pinned staging buffers and the pinned pool,
//! unified memory with advice and prefetches, element types of several sizes, and buffers that
//! move between threads and die on another one than the one that made them.

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use cuweave_driver::memory::MemLocation;
use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_memory::{
    AsyncPoolResource, Buffer, CachingAllocator, DeviceBuffer, DriverResource, LimitAdaptor,
    ManagedCapabilities, MemAdvice, MemoryError, MemoryResource, MigrationPolicy, PinnedBuffer,
    PinnedPool, StatisticsAdaptor, UnifiedBuffer,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip, skip_under_sanitizer};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// The byte sizes of one iteration's "activations": small-pool sizes (up to 1 MiB, odd ones
/// included) and large-pool ones (under 10 MiB, which share 20 MiB segments, and above).
const ACTIVATIONS: [usize; 8] = [
    4 * KIB,
    100 * KIB,
    700 * KIB + 12,
    MIB,
    3 * MIB,
    6 * MIB + 12,
    12 * MIB + 4,
    25 * MIB,
];
const ITERATIONS: usize = 20;
const WARM_UP: usize = 2;
/// Bytes checked at each end of every buffer, every iteration.
const PROBE: usize = 4 * KIB;

/// One tensor of the loop: its bytes must all equal `value`.
struct Tensor {
    buffer: DeviceBuffer<u8>,
    value: u8,
}

/// Checks the first and last `PROBE` bytes of `tensor` (blocking copies).
fn check_ends(tensor: &Tensor, what: &str) {
    let len = tensor.buffer.len();
    let probe = PROBE.min(len);
    let mut head = vec![0u8; probe];
    let mut tail = vec![0u8; probe];
    tensor
        .buffer
        .copy_range_to_host(0, &mut head)
        .expect("download head");
    tensor
        .buffer
        .copy_range_to_host(len - probe, &mut tail)
        .expect("download tail");
    assert!(
        head.iter().chain(&tail).all(|&b| b == tensor.value),
        "{what}: a tensor of {len} bytes lost its value {:#x}",
        tensor.value
    );
}

/// A training loop: every iteration allocates activations of many sizes (on `a`, or alternately
/// on `a` and `b`), derives a second tensor from each by a device copy on `a` (reading across
/// streams in the two-stream case), checks bytes, drops everything and synchronizes (as
/// `loss.item()` does). Reserved memory must not grow after the warm-up, the statistics must
/// add up, and `empty_cache` must give the memory back to the driver.
fn training_loop(context: &Arc<Context>, two_streams: bool) {
    let allocator = CachingAllocator::with_driver(context);
    let (a, b) = (stream(context), stream(context));
    let mut warm = None;
    let mut peak_in_iteration = 0usize;
    for iteration in 0..ITERATIONS {
        let mut held: Vec<Tensor> = Vec::new();
        let mut requested = 0usize;
        for (index, &bytes) in ACTIVATIONS.iter().enumerate() {
            let on = if two_streams && index % 2 == 1 {
                &b
            } else {
                &a
            };
            let value = (iteration * ACTIVATIONS.len() + index) as u8 | 1;
            let mut x = allocator.buffer::<u8>(bytes, on).expect("activation");
            x.fill_async(value, on).expect("fill activation");
            let half = bytes / 2 + 4;
            let mut y = allocator.buffer::<u8>(half, &a).expect("derived");
            y.copy_range_from_async(0, &x, 0, half, &a)
                .expect("derive on a");
            requested += bytes + half;
            held.push(Tensor { buffer: x, value });
            held.push(Tensor { buffer: y, value });
        }
        let stats = allocator.stats();
        let allocated: usize = held.iter().map(|t| t.buffer.allocated_bytes()).sum();
        assert_eq!(
            stats.allocated_bytes.current, allocated,
            "iteration {iteration}"
        );
        assert_eq!(
            stats.requested_bytes.current, requested,
            "iteration {iteration}"
        );
        assert!(stats.reserved_bytes.current >= allocated);
        peak_in_iteration = peak_in_iteration.max(allocated);
        for tensor in &held {
            check_ends(tensor, &format!("iteration {iteration}"));
        }
        drop(held);
        a.synchronize().expect("sync a");
        b.synchronize().expect("sync b");
        let stats = allocator.stats();
        assert_eq!(stats.allocated_bytes.current, 0, "iteration {iteration}");
        assert_eq!(stats.requested_bytes.current, 0, "iteration {iteration}");
        if iteration + 1 == WARM_UP {
            warm = Some((stats.reserved_bytes.current, stats.cache_misses));
        } else if let Some((reserved, misses)) = warm {
            assert_eq!(
                (stats.reserved_bytes.current, stats.cache_misses),
                (reserved, misses),
                "iteration {iteration}: reserved memory grew (or a segment was allocated) after warm-up"
            );
        }
    }
    let stats = allocator.stats();
    let per_iteration = 2 * ACTIVATIONS.len() as u64;
    assert_eq!(stats.allocations, per_iteration * ITERATIONS as u64);
    assert_eq!(stats.frees, stats.allocations);
    assert_eq!(stats.cache_hits + stats.cache_misses, stats.allocations);
    assert!(stats.cache_hits >= per_iteration * (ITERATIONS - WARM_UP) as u64);
    assert!(stats.allocated_bytes.peak >= peak_in_iteration);
    assert_eq!(
        stats.segments_released, 0,
        "nothing was released before empty_cache"
    );

    let cached = context.memory_info().expect("memory info").free;
    let released = allocator.empty_cache().expect("empty_cache");
    assert_eq!(released, stats.reserved_bytes.current);
    let after_empty = allocator.stats();
    assert_eq!(
        (
            after_empty.reserved_bytes.current,
            after_empty.segments.current
        ),
        (0, 0)
    );
    let freed = context.memory_info().expect("memory info").free;
    // The slack covers what the driver may take for the allocator's release stream, made on
    // this first release.
    assert!(
        freed.saturating_sub(cached) + 8 * MIB >= released,
        "empty_cache gave {released} bytes back but free memory rose only from {cached} to {freed}"
    );
}

#[test]
fn a_training_loop_on_one_stream_keeps_reserved_memory_flat_and_gives_it_back() {
    let gpu = require_gpu!();
    let _serial = serial();
    training_loop(&gpu.context, false);
}

#[test]
fn a_training_loop_on_two_streams_keeps_reserved_memory_flat_and_gives_it_back() {
    let gpu = require_gpu!();
    let _serial = serial();
    training_loop(&gpu.context, true);
}

/// `x.to("cpu", non_blocking=True)` on a busy side stream, then `del x`: the download (and a
/// device copy queued the same way) must read `x`'s bytes, not those of the next tensor made
/// from the same allocator on `x`'s stream while the side stream is still busy.
#[test]
fn a_tensor_dropped_while_another_stream_still_reads_it_keeps_its_bytes_until_the_reads_end() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "a_tensor_dropped_while_another_stream_still_reads_it_keeps_its_bytes_until_the_reads_end",
        "needs the side stream's spin to overlap the main stream's work",
    ) {
        return;
    }
    const N: usize = MIB / 4;
    const VALUE: u32 = 0x5A5A_1234;
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let (main, side) = (stream(context), stream(context));
    let sink = PinnedBuffer::<u32>::new(context, N).expect("pinned sink");
    let mut copy = allocator.buffer::<u32>(N, &side).expect("copy target");

    let mut x = allocator.buffer::<u32>(N, &main).expect("x");
    x.fill_async(VALUE, &main).expect("fill x");
    let old = x.device_ptr();
    kernels
        .spin_ns(&side, 200_000_000)
        .expect("busy side stream");
    let download = x.copy_to_host_async(sink, &side).expect("download x");
    copy.copy_from_async(&x, &side).expect("copy x");
    drop(x);

    let mut next = allocator.buffer::<u32>(N, &main).expect("next");
    next.fill_async(!VALUE, &main).expect("fill next");
    main.synchronize().expect("sync main");
    assert!(
        !side.query().expect("query side"),
        "the side stream must still be spinning when the next tensor is written"
    );
    assert_ne!(
        next.device_ptr(),
        old,
        "x's block was handed out under its reads"
    );

    let sink = download.wait().expect("download");
    assert!(
        sink.as_slice().expect("sink").iter().all(|&v| v == VALUE),
        "the download read x's bytes"
    );
    assert!(
        copy.to_vec().expect("copy").iter().all(|&v| v == VALUE),
        "the device copy read x's bytes"
    );
    assert!(next.to_vec().expect("next").iter().all(|&v| v == !VALUE));
    // Once the side stream is past its reads, x's block comes back (`next` still holds the
    // other half of the segment).
    side.synchronize().expect("sync side");
    let again = allocator.buffer::<u32>(N, &main).expect("again");
    assert_eq!(
        again.device_ptr(),
        old,
        "x's block is reused once its reads are done"
    );
    drop(next);
}

/// An allocation larger than the free memory is a typed out-of-memory error after the allocator
/// gave its cache back and retried, not a panic; the allocator (and the default one, through
/// `DeviceBuffer::new_on`) keeps working.
#[test]
fn an_allocation_larger_than_free_memory_is_a_typed_oom_and_the_allocator_recovers() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let s = stream(context);
    let allocator = CachingAllocator::with_driver(context);
    let mut warm = allocator.buffer::<u8>(40 * MIB, &s).expect("warm");
    warm.fill_async(1, &s).expect("fill warm");
    drop(warm);
    s.synchronize().expect("sync");
    assert!(allocator.stats().reserved_bytes.current >= 40 * MIB);

    let huge = context.memory_info().expect("memory info").free + GIB;
    let error = allocator
        .buffer::<u8>(huge, &s)
        .expect_err("more than the free memory");
    assert!(error.is_out_of_memory(), "{error}");
    match error {
        MemoryError::OutOfMemory {
            requested,
            allocated,
            limit,
            ..
        } => {
            assert!(requested >= huge);
            assert_eq!(allocated, 0);
            assert_eq!(limit, None, "the device refused, not a limit");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let stats = allocator.stats();
    assert_eq!((stats.oom_retries, stats.ooms), (1, 1));
    assert!(
        stats.segments_released >= 1,
        "the cached segment went back first"
    );
    assert_eq!(stats.reserved_bytes.current, 0);

    let mut after = allocator.buffer::<u32>(MIB, &s).expect("after the OOM");
    after.fill_async(0xC0FFEE, &s).expect("fill after");
    assert!(
        after
            .to_vec()
            .expect("after")
            .iter()
            .all(|&v| v == 0xC0FFEE)
    );

    let error = DeviceBuffer::<f32>::new_on(&s, huge / 4 + 1).expect_err("default allocator");
    assert!(error.is_out_of_memory(), "{error}");
    let small = DeviceBuffer::<f32>::from_slice(context, &[1.0, 2.0, 3.0]).expect("small");
    assert_eq!(small.to_vec().expect("small"), [1.0, 2.0, 3.0]);
}

/// RMM's shape: statistics over a limit over a stream-ordered pool; typed buffers allocated
/// through it, a refusal past the limit as a typed error, statistics that match; then a caching
/// allocator over the same composition.
#[test]
fn composed_resources_serve_typed_buffers_refuse_past_their_limit_and_count_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let s = stream(context);
    let pool = match AsyncPoolResource::new(context) {
        Ok(pool) => pool,
        Err(error) => {
            skip(
                "composed_resources_serve_typed_buffers_refuse_past_their_limit_and_count_exactly",
                &format!("no stream-ordered pool on this device: {error}"),
            );
            return;
        }
    };
    let cap = 8 * MIB;
    let stats = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(pool, cap)));
    let resource: Arc<dyn MemoryResource> = stats.clone();

    let weights: Vec<f64> = (0..512 * 1024).map(|i| i as f64 * 0.5).collect();
    let mut a = DeviceBuffer::<f64>::with_resource(Arc::clone(&resource), weights.len(), &s)
        .expect("4 MiB of f64");
    let half: Vec<u16> = (0..MIB).map(|i| (i * 7) as u16).collect();
    let mut b = DeviceBuffer::<u16>::with_resource(Arc::clone(&resource), half.len(), &s)
        .expect("2 MiB of u16");
    assert_eq!(a.resource_name(), resource.name());
    let upload = a
        .copy_from_host_async(weights.clone(), &s)
        .expect("upload a");
    b.copy_from_host(&half).expect("upload b");
    upload.wait().expect("upload a done");

    let error = DeviceBuffer::<u8>::with_resource(Arc::clone(&resource), 3 * MIB, &s)
        .expect_err("past the limit");
    assert_eq!(
        error,
        MemoryError::OutOfMemory {
            requested: 3 * MIB,
            allocated: 6 * MIB,
            reserved: 6 * MIB,
            limit: Some(cap),
        }
    );
    let counted = stats.stats();
    assert_eq!(counted.current_bytes, 6 * MIB);
    assert_eq!(counted.current_allocations, 2);
    assert_eq!(counted.total_allocations, 2);
    assert_eq!(counted.failed_allocations, 1);
    assert_eq!(a.to_vec().expect("a"), weights);
    assert_eq!(b.to_vec().expect("b"), half);

    drop(a);
    let mut c = DeviceBuffer::<u8>::with_resource(Arc::clone(&resource), 5 * MIB, &s)
        .expect("fits once a is gone");
    c.fill_async(0x3C, &s).expect("fill c");
    assert!(c.to_vec().expect("c").iter().all(|&v| v == 0x3C));
    drop((b, c));
    let counted = stats.stats();
    assert_eq!(counted.current_bytes, 0);
    assert_eq!(counted.current_allocations, 0);
    assert_eq!(counted.total_deallocations, 3);
    assert_eq!(counted.peak_bytes, 7 * MIB);

    // A caching allocator drawing from the composition: one 2 MiB small segment serves many
    // small buffers, the statistics see the segment only; a request whose segment exceeds the
    // limit is a typed error that names it.
    let caching = CachingAllocator::new(Arc::clone(&resource));
    for round in 0..10u32 {
        let mut small = caching.buffer::<u32>(1000, &s).expect("small");
        small.fill_async(round, &s).expect("fill small");
        assert!(small.to_vec().expect("small").iter().all(|&v| v == round));
    }
    let counted = stats.stats();
    assert_eq!(counted.total_allocations, 4, "one segment for ten buffers");
    assert_eq!(counted.current_bytes, 2 * MIB);
    let error = caching
        .buffer::<u8>(9 * MIB, &s)
        .expect_err("a segment past the limit");
    assert!(
        matches!(error, MemoryError::OutOfMemory { limit: Some(l), .. } if l == cap),
        "{error:?}"
    );
    assert_eq!(caching.stats().ooms, 1);
    caching.empty_cache().expect("empty_cache");
    assert_eq!(stats.stats().current_bytes, 0, "the segment went back up");
}

/// Views: sub-ranges copied to and from the host, filled, copied between buffers; bad ranges
/// and writes through read-only views are typed errors.
#[test]
fn views_copy_and_fill_sub_ranges_and_bad_views_are_typed_errors() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let s = stream(context);
    let mut buffer = DeviceBuffer::<u32>::zeroed(context, 1000).expect("zeroed");
    let ramp: Vec<u32> = (0..100).collect();
    buffer
        .slice_mut(100..200)
        .expect("view")
        .copy_from_host(&ramp)
        .expect("upload to a view");
    buffer
        .slice_mut(300..310)
        .expect("view")
        .fill(7)
        .expect("fill a view");
    buffer
        .slice_mut(990..)
        .expect("tail view")
        .fill_async(9, &s)
        .expect("fill the tail on a stream");
    let mut other = DeviceBuffer::<u32>::new_on(&s, 50).expect("other");
    other
        .copy_from_async(&buffer.slice(150..200).expect("view"), &s)
        .expect("copy a view");

    let all = buffer.to_vec().expect("all");
    for (index, &value) in all.iter().enumerate() {
        let expected = match index {
            100..200 => (index - 100) as u32,
            300..310 => 7,
            990.. => 9,
            _ => 0,
        };
        assert_eq!(value, expected, "element {index}");
    }
    let view = buffer.slice(95..105).expect("view");
    assert_eq!(view.len(), 10);
    assert_eq!(view.to_vec().expect("view"), [0, 0, 0, 0, 0, 0, 1, 2, 3, 4]);
    assert_eq!(
        view.slice(5..)
            .expect("a view of a view")
            .to_vec()
            .expect("v"),
        [0, 1, 2, 3, 4]
    );
    assert_eq!(
        other.to_vec().expect("other"),
        (50..100).collect::<Vec<u32>>()
    );

    assert!(matches!(
        buffer.slice(5..5),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        buffer.slice(990..1001),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        buffer.slice(..=usize::MAX),
        Err(MemoryError::OutOfRange { .. })
    ));
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = 10..5;
    assert!(matches!(
        buffer.slice(backwards),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        buffer.slice(usize::MAX..),
        Err(MemoryError::OutOfRange { .. } | MemoryError::ZeroLength { .. })
    ));
    let mut short = [0u32; 3];
    assert!(matches!(
        buffer.slice(0..4).expect("view").copy_to_host(&mut short),
        Err(MemoryError::SizeMismatch { .. })
    ));
    assert!(matches!(
        buffer.copy_range_to_host(999, &mut short),
        Err(MemoryError::OutOfRange { .. })
    ));
    let mut shared = buffer.slice(0..10).expect("view");
    assert!(matches!(
        shared.fill(1),
        Err(MemoryError::ReadOnlyView { .. })
    ));
    assert!(matches!(
        shared.slice_mut(0..5).expect("still a view").fill(1),
        Err(MemoryError::ReadOnlyView { .. })
    ));
    assert_eq!(
        buffer.slice(0..10).expect("v").to_vec().expect("v"),
        [0; 10]
    );
}

/// Pinned staging buffers: the host slice is reachable only once queued device work that
/// touches the buffer is done; an upload and a download through pinned memory round-trip byte
/// for byte across two streams; the pool reuses its blocks instead of pinning more.
#[test]
fn pinned_buffers_guard_host_access_round_trip_and_the_pool_reuses_its_blocks() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (a, b) = (stream(context), stream(context));
    const N: usize = 64 * KIB;

    let mut written = PinnedBuffer::<u32>::new(context, N).expect("pinned");
    kernels.spin_ns(&a, 50_000_000).expect("busy a");
    written.prepare_write(&a).expect("prepare");
    // SAFETY: `written` is mapped pinned memory of N u32s that lives until after the kernel has
    // finished (as_slice below waits for the recorded write), and the host does not touch it
    // meanwhile.
    unsafe { kernels.fill_u32(&a, written.device_ptr(), 0xAB, N) }.expect("fill kernel");
    written.record_write(&a).expect("record");
    assert!(matches!(
        written.try_as_slice(),
        Err(MemoryError::DeviceBusy { .. })
    ));
    assert!(matches!(
        written.try_as_mut_slice(),
        Err(MemoryError::DeviceBusy { .. })
    ));
    assert!(
        written.as_slice().expect("wait").iter().all(|&v| v == 0xAB),
        "the host sees the kernel's bytes after waiting"
    );

    let pool = PinnedPool::new(context);
    let pattern: Vec<u64> = (0..N as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let mut device = DeviceBuffer::<u64>::new_on(&a, N).expect("device");
    for round in 0..50u64 {
        let mut up = pool.buffer::<u64>(N).expect("staging up");
        for (slot, value) in up.as_mut_slice().expect("up").iter_mut().zip(&pattern) {
            *slot = value ^ round;
        }
        let upload = device.copy_from_host_async(up, &a).expect("upload");
        let down = pool.buffer::<u64>(N).expect("staging down");
        // Read back on the other stream: it waits for the upload on `a`.
        let download = device.copy_to_host_async(down, &b).expect("download");
        let down = download.wait().expect("downloaded");
        drop(upload.wait().expect("uploaded"));
        assert!(
            down.as_slice()
                .expect("down")
                .iter()
                .zip(&pattern)
                .all(|(&got, &value)| got == value ^ round),
            "round {round}: bytes changed on the way"
        );
    }
    let stats = pool.stats();
    assert_eq!(stats.gets, 100);
    assert!(
        stats.misses <= 4,
        "the pool pinned {} blocks for two buffers in use at a time",
        stats.misses
    );
    assert!(stats.pinned_bytes <= 4 * N * 8 * 2, "{stats:?}");
    assert!(matches!(
        pool.buffer::<u64>(0),
        Err(MemoryError::ZeroLength { .. })
    ));
}

/// Unified memory: advice, a prefetch to the device, a kernel writing there, a prefetch back and
/// a host read of what the kernel wrote; ranges past the end are typed errors.
#[test]
fn unified_buffers_take_advice_prefetch_both_ways_and_show_the_kernels_bytes_on_the_host() {
    let gpu = require_gpu!();
    let _serial = serial();
    let name =
        "unified_buffers_take_advice_prefetch_both_ways_and_show_the_kernels_bytes_on_the_host";
    let context = &gpu.context;
    let capabilities = ManagedCapabilities::of(gpu.device).expect("capabilities");
    if !capabilities.managed_memory || !capabilities.concurrent_managed_access {
        skip(
            name,
            "no managed memory with concurrent access on this device",
        );
        return;
    }
    const N: usize = 4 * MIB / 4; // 4 MiB of managed memory, far under the 1 GiB cap
    let free = context.memory_info().expect("memory info").free;
    if free < 64 * MIB {
        skip(name, "less than 64 MiB of device memory free");
        return;
    }
    let kernels = TestKernels::load(context).expect("kernels");
    let s = stream(context);
    let ordinal = gpu.device.ordinal();
    let mut buffer = UnifiedBuffer::<u32>::from_slice(context, &vec![41u32; N]).expect("unified");
    buffer
        .apply_policy(&MigrationPolicy::PreferDevice(ordinal))
        .expect("prefer device");
    buffer
        .advise(MemAdvice::SetAccessedBy(MemLocation::Host))
        .expect("accessed by host");
    buffer
        .prefetch_to(MemLocation::Device(ordinal), &s)
        .expect("prefetch to device");
    buffer.prepare_write(&s).expect("prepare");
    // SAFETY: the buffer holds N u32s and stays alive until the kernel has finished (the host
    // read below waits for the recorded write); the host does not touch it meanwhile.
    unsafe { kernels.increment_u32(&s, buffer.device_ptr(), N) }.expect("increment");
    buffer.record_write(&s).expect("record");
    buffer
        .prefetch_range(N / 2, N / 2, MemLocation::Host, &s)
        .expect("prefetch the upper half back");
    assert!(
        buffer.as_slice().expect("host").iter().all(|&v| v == 42),
        "the host reads the kernel's bytes"
    );
    buffer.as_mut_slice().expect("host write")[0] = 7;
    assert_eq!(
        buffer.slice(0..2).expect("view").to_vec().expect("v"),
        [7, 42]
    );
    assert!(matches!(
        buffer.prefetch_range(N - 1, 2, MemLocation::Host, &s),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        buffer.prefetch_range(0, 0, MemLocation::Host, &s),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert_eq!(
        buffer
            .hints()
            .expect("hints")
            .preferred_location()
            .expect("preferred"),
        Some(MemLocation::Device(ordinal))
    );
}

/// A plain-data struct as users define one for a tensor of records.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
struct Particle {
    position: [f32; 3],
    id: u32,
    charge: f64,
}

/// Element types of 1, 2, 8 and 24 bytes round-trip; zero lengths and zero-sized elements are
/// typed errors; buffers move to other threads, are used there, and are dropped on another
/// thread than the one that made them (each kind of buffer, and a resource's buffer).
#[test]
fn element_types_round_trip_and_buffers_move_and_drop_across_threads() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = Arc::clone(&gpu.context);
    let s = stream(&context);

    let bytes: Vec<u8> = (0..1001).map(|i| (i * 31) as u8).collect();
    let halves: Vec<u16> = (0..777).map(|i| (i * 1009) as u16).collect();
    let doubles: Vec<f64> = (0..333).map(|i| f64::from(i) / 3.0).collect();
    let particles: Vec<Particle> = (0..100)
        .map(|i| Particle {
            position: [i as f32, -(i as f32), 0.5],
            id: i,
            charge: f64::from(i) * -1.5,
        })
        .collect();
    let d8 = DeviceBuffer::from_slice(&context, &bytes).expect("u8");
    let d16 = DeviceBuffer::from_slice(&context, &halves).expect("u16");
    let d64 = DeviceBuffer::from_slice(&context, &doubles).expect("f64");
    let mut dp = DeviceBuffer::<Particle>::new_on(&s, particles.len()).expect("Particle");
    dp.copy_from_host_async(particles.clone(), &s)
        .expect("upload particles")
        .wait()
        .expect("uploaded");
    assert_eq!(dp.byte_size(), particles.len() * size_of::<Particle>());

    let pinned = PinnedBuffer::from_slice(&context, &doubles).expect("pinned");
    let unified = UnifiedBuffer::from_slice(&context, &halves).ok();
    let driver = Arc::new(DriverResource::new(&context));
    let resource: Arc<dyn MemoryResource> = driver.clone();
    let mut owned = DeviceBuffer::<u64>::with_resource(Arc::clone(&resource), 4096, &s)
        .expect("driver resource");
    owned.fill_async(u64::MAX - 1, &s).expect("fill owned");

    // Used and dropped on another thread (no context made current there by the test).
    let (expect8, expect16, expect64, expectp) = (
        bytes.clone(),
        halves.clone(),
        doubles.clone(),
        particles.clone(),
    );
    std::thread::spawn(move || {
        assert_eq!(d8.to_vec().expect("u8"), expect8);
        assert_eq!(d16.to_vec().expect("u16"), expect16);
        assert_eq!(d64.to_vec().expect("f64"), expect64);
        assert_eq!(dp.to_vec().expect("Particle"), expectp);
        assert_eq!(pinned.as_slice().expect("pinned"), &expect64[..]);
        if let Some(unified) = &unified {
            assert_eq!(unified.to_vec().expect("unified"), expect16);
        }
        assert!(
            owned
                .to_vec()
                .expect("owned")
                .iter()
                .all(|&v| v == u64::MAX - 1)
        );
        drop((d8, d16, d64, dp, pinned, unified, owned));
    })
    .join()
    .expect("the other thread");
    assert_eq!(
        driver.outstanding(),
        0,
        "the resource's buffer was freed there"
    );

    // Made on other threads, dropped here, after work queued from here.
    let made: Vec<DeviceBuffer<u16>> = (0..4)
        .map(|t| {
            let context = Arc::clone(&context);
            std::thread::spawn(move || {
                let local = stream(&context);
                let mut buffer = DeviceBuffer::<u16>::new_on(&local, 4096).expect("made there");
                buffer.fill_async(t as u16 + 1, &local).expect("fill there");
                buffer
            })
            .join()
            .expect("maker thread")
        })
        .collect();
    for (t, buffer) in made.iter().enumerate() {
        assert!(
            buffer
                .to_vec()
                .expect("here")
                .iter()
                .all(|&v| v == t as u16 + 1)
        );
    }
    drop(made);

    // Zero lengths and zero-sized elements are refused, for every kind of buffer.
    assert!(matches!(
        DeviceBuffer::<u8>::new_on(&s, 0),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        DeviceBuffer::<()>::new_on(&s, 10),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        DeviceBuffer::<f32>::from_slice(&context, &[]),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        DeviceBuffer::<u8>::with_resource(resource, 0, &s),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        PinnedBuffer::<u32>::new(&context, 0),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        UnifiedBuffer::<u32>::new(&context, 0),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        DeviceBuffer::<u64>::new_on(&s, usize::MAX / 4),
        Err(MemoryError::Misaligned { .. })
    ));
}

/// An inference server: one weights buffer shared (`Arc`) by request threads that each read it
/// on their own stream, many times over, into their own buffers; once the threads are done the
/// owner takes the buffer back and updates it in place.
#[test]
fn weights_shared_by_request_threads_are_read_on_their_own_streams_then_updated() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = Arc::clone(&gpu.context);
    const LEN: usize = 64 * KIB;
    let data: Arc<Vec<f32>> = Arc::new((0..LEN).map(|i| i as f32 * 0.25).collect());
    let weights = Arc::new(DeviceBuffer::from_slice(&context, &data).expect("weights"));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (context, weights, data) = (
                Arc::clone(&context),
                Arc::clone(&weights),
                Arc::clone(&data),
            );
            std::thread::spawn(move || {
                let s = stream(&context);
                let mut out = DeviceBuffer::<f32>::new_on(&s, LEN).expect("activation");
                for _ in 0..20 {
                    out.copy_from_async(&*weights, &s)
                        .expect("read the weights");
                    let host = out
                        .copy_to_host_async(vec![0.0f32; LEN], &s)
                        .expect("download")
                        .wait()
                        .expect("downloaded");
                    assert_eq!(&host, &*data);
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("request thread");
    }
    let mut weights = Arc::try_unwrap(weights).expect("the threads gave their handles back");
    weights.fill(0.5).expect("update");
    assert!(weights.to_vec().expect("weights").iter().all(|&w| w == 0.5));
}
