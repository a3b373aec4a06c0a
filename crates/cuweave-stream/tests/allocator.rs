//! GPU tests of `StreamOrderedAllocator`: memory freed on one stream under a running kernel is
//! handed to another stream only after it waited, proven by a kernel that watches the bytes.

use std::sync::Arc;
use std::time::Duration;

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::memory::{HostAllocFlags, HostAllocation};
use cuweave_driver::{Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_stream::capture::CaptureOptions;
use cuweave_stream::{
    PriorityStream, StreamError, StreamOrderedAllocator, StreamOrderedAllocatorConfig,
    StreamPriority,
};
use cuweave_test_support::kernels::TestKernels;

const MS: u64 = 1_000_000;
const N: usize = 1 << 20; // u32s: 4 MiB
const A_VALUE: u32 = 0xA5A5_A5A5;
const B_VALUE: u32 = 0x5A5A_5A5A;

fn new_stream(gpu: &cuweave_test_support::Gpu) -> Arc<PriorityStream> {
    Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap())
}

/// Queues `fill_u32(ptr, value)` and a `watch_u32` of `ns` that counts reads != `value` into
/// `mismatches`, on `stream`.
fn fill_and_watch(
    kernels: &TestKernels,
    stream: &PriorityStream,
    ptr: u64,
    value: u32,
    ns: u64,
    mismatches: &DeviceBuffer<u32>,
) {
    stream
        .launch(|s| {
            // SAFETY: `ptr` is an allocation of N u32s ordered on `s`; the test frees it only
            // in stream order after these kernels.
            unsafe { kernels.fill_u32(s, ptr, value, N) }
        })
        .unwrap();
    stream
        .launch(|s| {
            // SAFETY: as above; `mismatches` is one u32 kept alive until after synchronization.
            unsafe { kernels.watch_u32(s, ptr, N, value, ns, mismatches.device_ptr()) }
        })
        .unwrap();
}

#[test]
fn memory_freed_under_a_reading_kernel_reaches_another_stream_only_after_it_waited() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let (a, b) = (new_stream(&gpu), new_stream(&gpu));
    let allocator = StreamOrderedAllocator::new(StreamOrderedAllocatorConfig::default());
    let mismatches = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    let sum = DeviceBuffer::<u64>::zeroed(&gpu.context, 1).unwrap();

    let x = allocator.allocate_for_stream(&a, N * 4).unwrap();
    let ptr_a = allocator.device_ptr(&x).unwrap();
    fill_and_watch(&kernels, &a, ptr_a, A_VALUE, 100 * MS, &mismatches);
    // Freed on A while A's watch still reads it.
    assert_eq!(allocator.free_for_stream(&a).unwrap(), 1);
    allocator.add_stream_dependency(&b, &a).unwrap();
    assert!(
        !allocator.dependencies_satisfied(&b).unwrap(),
        "A is still watching"
    );
    // Every allocation B makes from here on is ordered after A's free. The pool may first hand
    // out never-used memory of the chunk it reserved for X; keep allocating (at most 16 blocks)
    // until it hands out X's block again.
    let x_range = ptr_a..ptr_a + (N * 4) as u64;
    let mut reused = None;
    for _ in 0..16 {
        let y = allocator.allocate_for_stream(&b, N * 4).unwrap();
        let ptr = allocator.device_ptr(&y).unwrap();
        if x_range.contains(&ptr) {
            reused = Some(ptr);
            break;
        }
    }
    let stats = allocator.stats();
    eprintln!(
        "A's block {ptr_a:#x}; B made {} allocations, reused: {reused:x?}",
        stats.allocations - 1
    );
    let ptr_b = reused.expect("the pool handed A's freed block to B once B waited for A");
    b.launch(|s| {
        // SAFETY: `ptr_b` is B's allocation of N u32s, ordered on `s`.
        unsafe { kernels.fill_u32(s, ptr_b, B_VALUE, N) }
    })
    .unwrap();
    b.launch(|s| {
        // SAFETY: as above; `sum` is one u64 kept alive until after synchronization.
        unsafe { kernels.checksum_u32(s, ptr_b, N, sum.device_ptr()) }
    })
    .unwrap();
    b.synchronize().unwrap();
    a.synchronize().unwrap();
    assert!(allocator.dependencies_satisfied(&b).unwrap());
    assert_eq!(
        mismatches.to_vec().unwrap()[0],
        0,
        "A's kernel never saw its data change"
    );
    assert_eq!(
        sum.to_vec().unwrap()[0],
        u64::from(B_VALUE) * N as u64,
        "B wrote its block whole"
    );
    allocator.free_for_stream(&b).unwrap();
    b.synchronize().unwrap();
    assert_eq!(allocator.outstanding(), 0);
}

#[test]
fn the_watch_kernel_does_catch_a_concurrent_writer() {
    // The control for the test above: the same watch sees writes from an unordered stream.
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let (a, b) = (new_stream(&gpu), new_stream(&gpu));
    let allocator = StreamOrderedAllocator::default();
    let mismatches = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    let x = allocator.allocate_for_stream(&a, N * 4).unwrap();
    let ptr = allocator.device_ptr(&x).unwrap();
    fill_and_watch(&kernels, &a, ptr, A_VALUE, 100 * MS, &mismatches);
    std::thread::sleep(Duration::from_millis(10));
    b.launch(|s| {
        // SAFETY: the allocation is live (freed only below, after both streams synchronize);
        // racing A's watch on purpose is what this control test does.
        unsafe { kernels.fill_u32(s, ptr, B_VALUE, N) }
    })
    .unwrap();
    b.synchronize().unwrap();
    a.synchronize().unwrap();
    let seen = mismatches.to_vec().unwrap()[0];
    eprintln!("the watch saw {seen} changed reads");
    assert!(
        seen > 0,
        "an unordered writer during the watch must be seen"
    );
    allocator.free(x).unwrap();
    a.synchronize().unwrap();
}

#[test]
fn allocations_round_to_size_classes_and_are_counted() {
    let gpu = cuweave_test_support::require_gpu!();
    let a = new_stream(&gpu);
    let allocator = StreamOrderedAllocator::new(
        StreamOrderedAllocatorConfig::with_release_threshold(64 << 20),
    );
    let small = allocator.allocate_for_stream(&a, 3000).unwrap();
    let large = allocator.allocate_for_stream(&a, (3 << 20) + 1).unwrap();
    assert_eq!((small.bytes(), small.requested()), (4096, 3000));
    assert_eq!(large.bytes(), 4 << 20);
    assert!(matches!(
        allocator.allocate_for_stream(&a, 0),
        Err(StreamError::InvalidArgument { .. })
    ));
    let stats = allocator.stats();
    assert_eq!(
        (stats.allocations, stats.live, stats.live_bytes),
        (2, 2, 4096 + (4 << 20))
    );
    assert_eq!(stats.classes[3].allocations, 1);
    assert_eq!(stats.classes[12].allocations, 1);
    assert!(allocator.reserved_bytes(gpu.device.ordinal()).unwrap() >= 4 << 20);
    allocator.free(small).unwrap();
    assert!(matches!(
        allocator.free(small),
        Err(StreamError::UnknownAllocation { .. })
    ));
    assert_eq!(allocator.free_for_stream(&a).unwrap(), 1);
    a.synchronize().unwrap();
    let stats = allocator.stats();
    assert_eq!(
        (stats.frees, stats.live, stats.live_bytes, stats.peak_bytes),
        (2, 0, 0, 4096 + (4 << 20))
    );
    eprintln!("{stats}");
}

#[test]
fn typed_buffers_from_the_stream_ordered_pool_round_trip_across_streams() {
    let gpu = cuweave_test_support::require_gpu!();
    let (a, b) = (new_stream(&gpu), new_stream(&gpu));
    let allocator = StreamOrderedAllocator::default();
    let data: Vec<u32> = (0..N as u32).collect();
    for _ in 0..64 {
        let mut buffer = allocator.buffer::<u32>(&a, N).unwrap();
        let upload = a.copy_from_host(&mut buffer, data.clone()).unwrap();
        // Read back on another stream before the upload is waited for: the buffer's use
        // tracking orders the read after it on the device.
        let back = b
            .copy_to_host(&buffer, vec![0u32; N])
            .unwrap()
            .wait()
            .unwrap();
        upload.wait().unwrap();
        assert_eq!(back, data);
        // Dropped here: freed in stream order behind its uses, the pool reuses the memory.
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    assert!(matches!(
        allocator.buffer::<u32>(&a, 0),
        Err(StreamError::Memory(_))
    ));
    assert!(allocator.reserved_bytes(a.device().ordinal()).unwrap() >= (N * 4) as u64);
}

/// A gate on mapped pinned memory that a `wait_u32` kernel holds a stream behind until the host
/// opens it; dropping it opens it, so a failing test never frees the flag under the kernel.
struct Gate {
    flag: HostAllocation,
}

impl Gate {
    fn new(gpu: &cuweave_test_support::Gpu) -> Self {
        let mut flag =
            HostAllocation::new(&gpu.context, 4, HostAllocFlags::PORTABLE_MAPPED).unwrap();
        flag.as_bytes_mut().fill(0);
        Self { flag }
    }

    fn hold(&self, kernels: &TestKernels, stream: &PriorityStream) {
        let flag = self.flag.device_ptr().unwrap();
        // SAFETY: `flag` maps the 4 bytes of `self.flag`, which outlive the kernel (the gate is
        // opened before it is freed, and freeing pinned memory waits for the device); the host
        // writes it only volatile.
        unsafe { kernels.wait_u32(stream.stream(), flag, 1, 10_000 * MS) }.unwrap();
    }

    fn open(&self) {
        let flag = self.flag.as_ptr().cast::<u32>().cast_mut();
        // SAFETY: 4 aligned bytes of live pinned memory that kernels only read.
        unsafe { flag.write_volatile(1) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
    }
}

#[test]
fn a_query_refused_during_a_capture_forgets_no_pending_wait() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    if !gpu.device.can_map_host_memory().unwrap() {
        cuweave_test_support::skip(
            "a_query_refused_during_a_capture_forgets_no_pending_wait",
            "the device cannot map host memory",
        );
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let (a, b, c) = (new_stream(&gpu), new_stream(&gpu), new_stream(&gpu));
    let allocator = StreamOrderedAllocator::new(StreamOrderedAllocatorConfig::default());
    // Made before the gate closes: nothing below may synchronise the context until it opens.
    let capturing = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let gate = Gate::new(&gpu);
    gate.hold(&kernels, &a);
    allocator.add_stream_dependency(&b, &a).unwrap(); // b waits behind the gate
    allocator.add_stream_dependency(&c, &b).unwrap(); // c too, through b
    assert!(!allocator.dependencies_satisfied(&b).unwrap());

    // A capture on this thread: the driver's own begin, since `StreamCapture::begin` first
    // synchronises the context, which the closed gate would hold.
    capturing.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let refused = allocator.dependencies_satisfied(&b).unwrap_err();
    assert!(refused.is_capture_refusal(), "{refused}");
    drop(capturing.end_capture().unwrap());

    // The refused query forgot nothing: both waits are still pending on the GPU.
    assert!(!allocator.dependencies_satisfied(&b).unwrap());
    assert!(!allocator.dependencies_satisfied(&c).unwrap());
    gate.open();
    c.synchronize().unwrap();
    assert!(allocator.dependencies_satisfied(&b).unwrap());
    assert!(allocator.dependencies_satisfied(&c).unwrap());

    // A wait recorded inside a capture is a graph edge, not a wait to track: its event could
    // never be queried again (CUDA_ERROR_CAPTURED_EVENT).
    let capture = a.begin_capture(CaptureOptions::default()).unwrap();
    allocator.add_stream_dependency(&b, &a).unwrap(); // forks b into the capture
    a.wait_for(&b).unwrap(); // and joins it back
    drop(capture.finish().unwrap());
    assert!(allocator.dependencies_satisfied(&b).unwrap());
}

#[test]
fn a_wait_captured_for_a_pair_keeps_the_pairs_pending_eager_wait() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    if !gpu.device.can_map_host_memory().unwrap() {
        cuweave_test_support::skip(
            "a_wait_captured_for_a_pair_keeps_the_pairs_pending_eager_wait",
            "the device cannot map host memory",
        );
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let (a, b) = (new_stream(&gpu), new_stream(&gpu));
    let allocator = StreamOrderedAllocator::new(StreamOrderedAllocatorConfig::default());
    let gate = Gate::new(&gpu);
    gate.hold(&kernels, &b);
    allocator.add_stream_dependency(&a, &b).unwrap(); // a waits behind the gate, eagerly
    assert!(!allocator.dependencies_satisfied(&a).unwrap());

    // b captures (the driver's own begin: `StreamCapture::begin` would synchronise the
    // context, which the closed gate holds), and the same pair's wait is recorded into it.
    b.stream().begin_capture(CaptureMode::ThreadLocal).unwrap();
    allocator.add_stream_dependency(&a, &b).unwrap(); // forks a into the capture
    b.wait_for(&a).unwrap(); // and joins it back
    drop(b.stream().end_capture().unwrap());

    // The captured wait replaced nothing: the eager one is still pending behind the gate.
    assert!(
        !allocator.dependencies_satisfied(&a).unwrap(),
        "the eager wait of a on b was forgotten when the pair's wait was captured"
    );
    gate.open();
    a.synchronize().unwrap();
    assert!(allocator.dependencies_satisfied(&a).unwrap());
}
