//! Adversarial probes of the rule "bad input gets a clear typed error, never a panic, never lost
//! data, never UB", as PyTorch, RMM and cudarc users hit it: allocations far larger than the
//! card, zero lengths, ranges past the end, views of views, byte sizes that overflow, copies of
//! mismatched lengths, pointers a resource never gave out, host slices of buffers with queued
//! work. Each probe asserts the exact typed outcome and that the object still works afterwards.
//!
//! Out-of-memory probes only ask for plain device memory (never managed memory past 1 GiB); a
//! request that fails leaves nothing behind, one that succeeds is freed at once.

use std::sync::Arc;

use cuweave_driver::{Stream, StreamFlags};
use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer};
use cuweave_memory::{
    AsyncPoolResource, CachingAllocator, DriverResource, LimitAdaptor, MemLocation, MemoryError,
    MemoryResource, PinnedPool, PrefetchPlan,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

const TIB: usize = 1 << 40;
const GB: usize = 1_000_000_000;
const MS: u64 = 1_000_000;

fn stream(gpu: &cuweave_test_support::Gpu) -> Stream {
    Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("stream")
}

fn pattern(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

/// A small buffer round-trips its bytes through `allocator` on `stream`.
fn round_trips(allocator: &CachingAllocator, stream: &Stream) {
    let data = pattern(4096, 0xabcd);
    let mut buffer = allocator.buffer::<u32>(data.len(), stream).unwrap();
    buffer.copy_from_host(&data).unwrap();
    assert_eq!(buffer.to_vec().unwrap(), data);
}

// ---------------------------------------------------------------------------------------------
// CPU-only: checks that run before any driver call and need no device.
// ---------------------------------------------------------------------------------------------

// An empty prefetch plan is refused before the stream is looked at; making one needs no device.
// (Executing needs a stream, which needs a device: this probe checks construction and the
// bookkeeping only.)
#[test]
fn an_empty_prefetch_plan_has_no_bytes_and_no_entries() {
    let plan = PrefetchPlan::new();
    assert!(plan.is_empty());
    assert_eq!(plan.len(), 0);
    assert_eq!(plan.total_bytes(), 0);
    assert_eq!(plan.entries().count(), 0);
}

// Error values describe themselves without panicking, even with extreme numbers.
#[test]
fn errors_with_extreme_values_display_and_classify() {
    let oom = MemoryError::OutOfMemory {
        requested: usize::MAX,
        allocated: usize::MAX,
        reserved: usize::MAX,
        limit: Some(usize::MAX),
    };
    assert!(oom.is_out_of_memory());
    assert!(oom.to_string().contains("out of memory"), "{oom}");
    let range = MemoryError::OutOfRange {
        operation: "x",
        offset: usize::MAX,
        len: usize::MAX,
        capacity: 0,
    };
    assert!(!range.is_out_of_memory());
    assert!(!range.to_string().is_empty());
}

// ---------------------------------------------------------------------------------------------
// Out of memory.
// ---------------------------------------------------------------------------------------------

// PyTorch: `torch.empty(2**40, device="cuda")` is `torch.cuda.OutOfMemoryError`, and the
// allocator keeps serving. Here: the default caching allocator's typed `OutOfMemory`, after
// its free-and-retry, with allocated bytes back where they were.
#[test]
fn a_tebibyte_from_the_default_allocator_is_a_typed_oom_and_the_allocator_still_serves() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let allocator = CachingAllocator::for_device(ctx.device()).unwrap();
    let before = allocator.stats();
    let got = DeviceBuffer::<u8>::new(ctx, TIB);
    assert!(
        matches!(
            got,
            Err(MemoryError::OutOfMemory {
                requested,
                limit: None,
                ..
            }) if requested >= TIB
        ),
        "{got:?}"
    );
    let after = allocator.stats();
    assert_eq!(
        after.allocated_bytes.current,
        before.allocated_bytes.current
    );
    assert_eq!(after.ooms, before.ooms + 1);
    assert!(after.oom_retries > before.oom_retries);
    let data = pattern(1 << 16, 7);
    let buffer = DeviceBuffer::from_slice(ctx, &data).unwrap();
    assert_eq!(buffer.to_vec().unwrap(), data);
    drop(buffer);
    assert_eq!(
        allocator.stats().allocated_bytes.current,
        before.allocated_bytes.current
    );
}

// 100 GB twice on a ~141 GB card: the first fits, the second is a typed OOM, the first
// buffer's bytes are intact, and once it is dropped the allocator is back where it was.
#[test]
fn the_second_of_two_100_gb_buffers_is_a_typed_oom_and_the_first_keeps_its_bytes() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let info = ctx.memory_info().unwrap();
    if info.free < 101 * GB || info.total >= 200 * GB {
        cuweave_test_support::skip(
            "the_second_of_two_100_gb_buffers_is_a_typed_oom",
            "needs a card with 101..200 GB, most of it free",
        );
        return;
    }
    let s = stream(&gpu);
    let allocator = CachingAllocator::with_driver(ctx);
    let mut first = allocator.buffer::<u8>(100 * GB, &s).unwrap();
    first.fill(0x5a).unwrap();
    let second = allocator.buffer::<u8>(100 * GB, &s);
    assert!(
        matches!(second, Err(MemoryError::OutOfMemory { limit: None, .. })),
        "{second:?}"
    );
    let stats = allocator.stats();
    assert_eq!(stats.ooms, 1);
    assert_eq!(stats.allocated_bytes.current, first.allocated_bytes());
    let mut probe = [0u8; 64];
    first.copy_range_to_host(100 * GB - 64, &mut probe).unwrap();
    assert_eq!(probe, [0x5a; 64]);
    drop(first);
    s.synchronize().unwrap();
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
    round_trips(&allocator, &s);
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

// RMM's `limiting_resource_adaptor`: a request over the cap through a caching allocator is
// `OutOfMemory` carrying the cap, the cap's budget is not leaked by the failure, and a request
// within the cap succeeds afterwards.
#[test]
fn a_limit_adaptor_under_a_caching_allocator_reports_its_cap_and_keeps_its_budget() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(&gpu);
    let cap = 64 << 20;
    let limited = Arc::new(LimitAdaptor::new(DriverResource::new(ctx), cap));
    let allocator = CachingAllocator::new(limited.clone() as Arc<dyn MemoryResource>);
    let got = allocator.buffer::<u8>(TIB, &s);
    assert!(
        matches!(got, Err(MemoryError::OutOfMemory { limit: Some(c), .. }) if c == cap),
        "{got:?}"
    );
    assert_eq!(
        limited.used(),
        0,
        "a refused request kept part of the budget"
    );
    let over = allocator.buffer::<u8>(cap + 1, &s);
    assert!(
        matches!(over, Err(MemoryError::OutOfMemory { limit: Some(c), .. }) if c == cap),
        "{over:?}"
    );
    round_trips(&allocator, &s);
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
}

// A limit adaptor alone: a zero-byte request is `ZeroLength`; a too-large one is refused
// without calling the upstream (nothing outstanding there); `usize::MAX` does not overflow its
// budget arithmetic.
#[test]
fn a_limit_adaptor_refuses_zero_and_usize_max_without_touching_its_upstream() {
    let _serial = serial();
    let gpu = require_gpu!();
    let s = stream(&gpu);
    let limited = LimitAdaptor::new(DriverResource::new(&gpu.context), 1 << 20);
    assert!(matches!(
        limited.allocate(0, &s),
        Err(MemoryError::ZeroLength { .. })
    ));
    let huge = limited.allocate(usize::MAX, &s);
    assert!(
        matches!(huge, Err(MemoryError::OutOfMemory { limit: Some(_), .. })),
        "{huge:?}"
    );
    assert_eq!(limited.used(), 0);
    assert_eq!(limited.upstream().outstanding(), 0);
    let ptr = limited.allocate(1 << 20, &s).unwrap();
    assert_eq!(limited.used(), 1 << 20);
    limited.deallocate(ptr, 1 << 20, &s).unwrap();
    assert_eq!(limited.used(), 0);
}

// `cuMemAlloc` of 1 TiB through a bare driver resource: the driver's out-of-memory error,
// classified as such, and nothing recorded as outstanding.
#[test]
fn a_tebibyte_from_the_driver_resource_is_an_oom_and_nothing_stays_outstanding() {
    let _serial = serial();
    let gpu = require_gpu!();
    let s = stream(&gpu);
    let resource = DriverResource::new(&gpu.context);
    let got = resource.allocate(TIB, &s);
    match &got {
        Err(error) => assert!(error.is_out_of_memory(), "{error:?}"),
        Ok(_) => panic!("1 TiB of device memory was granted"),
    }
    assert!(
        matches!(got, Err(MemoryError::Driver(_))),
        "the bare resource reports the driver's own error: {got:?}"
    );
    assert_eq!(resource.outstanding(), 0);
    let ptr = resource.allocate(4096, &s).unwrap();
    resource.deallocate(ptr, 4096, &s).unwrap();
    assert_eq!(resource.outstanding(), 0);
}

// `cudaMallocAsync` of 1 TiB: the stream-ordered pool reports out of memory at the call, the
// stream is not poisoned, and a small buffer from the same pool round-trips afterwards.
#[test]
fn a_tebibyte_from_the_async_pool_is_an_oom_and_the_pool_and_stream_still_work() {
    let _serial = serial();
    let gpu = require_gpu!();
    let s = stream(&gpu);
    let pool = Arc::new(AsyncPoolResource::new(&gpu.context).unwrap());
    let got = DeviceBuffer::<u8>::with_resource(pool.clone(), TIB, &s);
    match &got {
        Err(error) => assert!(error.is_out_of_memory(), "{error:?}"),
        Ok(_) => panic!("1 TiB of device memory was granted"),
    }
    assert_eq!(pool.outstanding(), 0);
    s.synchronize()
        .expect("the stream survives a refused allocation");
    let data = pattern(1000, 3);
    let mut buffer = DeviceBuffer::<u32>::with_resource(pool.clone(), data.len(), &s).unwrap();
    buffer.copy_from_host(&data).unwrap();
    assert_eq!(buffer.to_vec().unwrap(), data);
    drop(buffer);
    s.synchronize().unwrap();
    assert_eq!(pool.outstanding(), 0);
}

// A request whose rounding to the block size overflows `usize` never reaches the driver.
#[test]
fn a_caching_request_near_usize_max_is_a_typed_oom_not_an_overflow() {
    let _serial = serial();
    let gpu = require_gpu!();
    let s = stream(&gpu);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    for bytes in [usize::MAX, usize::MAX - 511, isize::MAX as usize + 1] {
        let got = allocator.allocate(bytes, &s);
        assert!(
            matches!(got, Err(MemoryError::OutOfMemory { .. })),
            "{bytes}: {:?}",
            got.map(|a| a.ptr())
        );
    }
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
    assert!(matches!(
        allocator.allocate(0, &s).map(|a| a.ptr()),
        Err(MemoryError::ZeroLength { .. })
    ));
    round_trips(&allocator, &s);
}

// ---------------------------------------------------------------------------------------------
// Sizes, lengths and ranges.
// ---------------------------------------------------------------------------------------------

// `torch.empty(0)` is legal in PyTorch; cuweave refuses empty buffers with a typed error.
#[test]
fn zero_length_buffers_of_every_kind_are_zero_length_errors() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(&gpu);
    let expect_zero = |what: &str, got: Result<(), MemoryError>| {
        assert!(
            matches!(got, Err(MemoryError::ZeroLength { .. })),
            "{what}: {got:?}"
        );
    };
    expect_zero("new", DeviceBuffer::<u32>::new(ctx, 0).map(drop));
    expect_zero("new_on", DeviceBuffer::<u32>::new_on(&s, 0).map(drop));
    expect_zero("zeroed", DeviceBuffer::<u32>::zeroed(ctx, 0).map(drop));
    expect_zero(
        "from_slice",
        DeviceBuffer::<u32>::from_slice(ctx, &[]).map(drop),
    );
    expect_zero("zero-sized T", DeviceBuffer::<()>::new(ctx, 10).map(drop));
    expect_zero("pinned", PinnedBuffer::<u32>::new(ctx, 0).map(drop));
    expect_zero(
        "pinned unpooled",
        PinnedBuffer::<u32>::new_unpooled(ctx, 0).map(drop),
    );
    expect_zero("unified", UnifiedBuffer::<u32>::new(ctx, 0).map(drop));
    let pool = Arc::new(DriverResource::new(ctx));
    expect_zero(
        "with_resource",
        DeviceBuffer::<u32>::with_resource(pool, 0, &s).map(drop),
    );
    expect_zero("pinned pool", PinnedPool::new(ctx).get(0).map(drop));
}

// `len * size_of::<T>()` overflowing `usize` is `Misaligned` (the crate's overflow variant),
// decided before any allocation.
#[test]
fn element_counts_whose_bytes_overflow_usize_are_refused_before_allocating() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(&gpu);
    let allocator = CachingAllocator::for_device(ctx.device()).unwrap();
    let before = allocator.stats();
    for len in [usize::MAX, usize::MAX / 8 + 1, usize::MAX / 4] {
        let got = DeviceBuffer::<u64>::new(ctx, len);
        assert!(
            matches!(
                got,
                Err(MemoryError::Misaligned {
                    element_size: 8,
                    ..
                })
            ),
            "{len}: {got:?}"
        );
        // `len` elements of 3 bytes overflow only from `usize::MAX / 3 + 1`.
        let len3 = len.max(usize::MAX / 3 + 1);
        let got = DeviceBuffer::<[u8; 3]>::new_on(&s, len3);
        assert!(
            matches!(
                got,
                Err(MemoryError::Misaligned {
                    element_size: 3,
                    ..
                })
            ),
            "{len3}: {got:?}"
        );
        let got = PinnedBuffer::<u64>::new(ctx, len);
        assert!(
            matches!(got, Err(MemoryError::Misaligned { .. })),
            "{len}: {got:?}"
        );
    }
    assert_eq!(allocator.stats().allocations, before.allocations);
}

// A pinned pool asked for a size that cannot be rounded to a size class: `OutOfMemory`, no
// pinning attempted, the pool still serves.
#[test]
fn a_pinned_pool_request_past_isize_max_is_a_typed_oom() {
    let _serial = serial();
    let gpu = require_gpu!();
    let pool = PinnedPool::new(&gpu.context);
    for bytes in [usize::MAX, isize::MAX as usize + 1] {
        let got = pool.get(bytes);
        assert!(
            matches!(got, Err(MemoryError::OutOfMemory { .. })),
            "{bytes}: {:?}",
            got.map(|b| b.len())
        );
    }
    let block = pool.get(4096).unwrap();
    assert!(block.len() >= 4096);
}

// Views: empty, past the end, reversed, unbounded at `usize::MAX`, views of views past the
// parent view's end (not the buffer's), and `RangeInclusive` overflow.
#[test]
fn views_past_the_end_and_views_of_views_are_typed_errors() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let data = pattern(100, 1);
    let mut buffer = DeviceBuffer::from_slice(ctx, &data).unwrap();

    assert!(matches!(
        buffer.slice(10..10).map(|v| v.len()),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        buffer.slice(90..101).map(|v| v.len()),
        Err(MemoryError::OutOfRange { capacity: 100, .. })
    ));
    assert!(matches!(
        buffer.slice(100..).map(|v| v.len()),
        Err(MemoryError::ZeroLength { .. } | MemoryError::OutOfRange { .. })
    ));
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = buffer.slice(50..10).map(|v| v.len());
    assert!(
        matches!(
            reversed,
            Err(MemoryError::ZeroLength { .. } | MemoryError::OutOfRange { .. })
        ),
        "{reversed:?}"
    );
    let inclusive_max = buffer.slice(0..=usize::MAX).map(|v| v.len());
    assert!(
        matches!(inclusive_max, Err(MemoryError::OutOfRange { .. })),
        "{inclusive_max:?}"
    );
    let from_max = buffer.slice(usize::MAX..).map(|v| v.len());
    assert!(from_max.is_err(), "{from_max:?}");

    // A view of elements 10..30 (20 long): its own 15..25 is past *its* end, though inside
    // the buffer.
    let view = buffer.slice(10..30).unwrap();
    assert!(matches!(
        view.slice(15..25).map(|v| v.len()),
        Err(MemoryError::OutOfRange { capacity: 20, .. })
    ));
    let inner = view.slice(5..10).unwrap();
    assert_eq!(inner.to_vec().unwrap(), &data[15..20]);
    assert!(matches!(
        inner.slice(0..6).map(|v| v.len()),
        Err(MemoryError::OutOfRange { capacity: 5, .. })
    ));

    // Writable view of a writable view, out of range.
    let mut outer = buffer.slice_mut(40..60).unwrap();
    assert!(matches!(
        outer.slice_mut(0..21).map(|v| v.len()),
        Err(MemoryError::OutOfRange { capacity: 20, .. })
    ));
    outer.slice_mut(19..20).unwrap().fill(0xdead_beef).unwrap();
    let mut expected = data.clone();
    expected[59] = 0xdead_beef;
    assert_eq!(buffer.to_vec().unwrap(), expected);
}

// Host copies of the wrong length, ranges past the end, offsets that overflow: typed errors,
// and the buffer's bytes are untouched by every refused copy.
#[test]
fn host_copies_with_bad_lengths_and_offsets_are_refused_and_leave_the_bytes() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let data = pattern(64, 2);
    let mut buffer = DeviceBuffer::from_slice(ctx, &data).unwrap();

    assert!(matches!(
        buffer.copy_from_host(&[1u32; 63]),
        Err(MemoryError::SizeMismatch {
            expected: 64,
            actual: 63,
            ..
        })
    ));
    assert!(matches!(
        buffer.copy_from_host(&[1u32; 65]),
        Err(MemoryError::SizeMismatch {
            expected: 64,
            actual: 65,
            ..
        })
    ));
    assert!(matches!(
        buffer.copy_range_from_host(60, &[1u32; 5]),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        buffer.copy_range_from_host(usize::MAX, &[1u32; 2]),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        buffer.copy_range_from_host(3, &[]),
        Err(MemoryError::ZeroLength { .. })
    ));
    let mut short = [0u32; 10];
    assert!(matches!(
        buffer.copy_to_host(&mut short),
        Err(MemoryError::SizeMismatch { .. })
    ));
    assert!(matches!(
        buffer.copy_range_to_host(usize::MAX - 3, &mut short),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert_eq!(short, [0; 10], "a refused download wrote the host slice");
    assert_eq!(buffer.to_vec().unwrap(), data);
}

// Device-to-device copies between buffers of different lengths, overlapping ranges of one
// buffer through views, and zero-length ranges: typed errors, destination untouched.
#[test]
fn device_copies_with_mismatched_lengths_are_refused_and_leave_the_destination() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(&gpu);
    let src = DeviceBuffer::from_slice(ctx, &pattern(32, 3)).unwrap();
    let dst_data = pattern(48, 4);
    let mut dst = DeviceBuffer::from_slice(ctx, &dst_data).unwrap();

    assert!(matches!(
        dst.copy_from(&src),
        Err(MemoryError::SizeMismatch {
            expected: 48,
            actual: 32,
            ..
        })
    ));
    assert!(matches!(
        dst.copy_from_async(&src, &s),
        Err(MemoryError::SizeMismatch { .. })
    ));
    assert!(matches!(
        dst.copy_range_from(0, &src, 0, 33),
        Err(MemoryError::OutOfRange { capacity: 32, .. })
    ));
    assert!(matches!(
        dst.copy_range_from(40, &src, 0, 9),
        Err(MemoryError::OutOfRange { capacity: 48, .. })
    ));
    assert!(matches!(
        dst.copy_range_from_async(0, &src, usize::MAX, 2, &s),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        dst.copy_range_from(0, &src, 0, 0),
        Err(MemoryError::ZeroLength { .. })
    ));
    s.synchronize().unwrap();
    assert_eq!(dst.to_vec().unwrap(), dst_data);

    // Overlapping ranges of one buffer cannot be expressed in safe code (`dst.copy_from(&dst
    // .slice(..))` is a borrow error). A valid copy after the refusals lands exactly.
    dst.copy_range_from(0, &src, 0, 32).unwrap();
    assert_eq!(&dst.to_vec().unwrap()[..32], &pattern(32, 3)[..]);
}

// Writes through a shared (read-only) view are `ReadOnlyView`, never a silent write.
#[test]
fn writes_through_a_shared_view_are_read_only_view_errors() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(&gpu);
    let data = pattern(16, 5);
    let buffer = DeviceBuffer::from_slice(ctx, &data).unwrap();
    let other = DeviceBuffer::from_slice(ctx, &pattern(16, 6)).unwrap();
    let mut view = buffer.slice(..).unwrap();
    let got = view.fill(0);
    assert!(
        matches!(got, Err(MemoryError::ReadOnlyView { .. })),
        "{got:?}"
    );
    let got = view.fill_async(0, &s);
    assert!(
        matches!(got, Err(MemoryError::ReadOnlyView { .. })),
        "{got:?}"
    );
    let got = view.copy_from_host(&[0u32; 16]);
    assert!(
        matches!(got, Err(MemoryError::ReadOnlyView { .. })),
        "{got:?}"
    );
    let got = view.copy_from(&other);
    assert!(
        matches!(got, Err(MemoryError::ReadOnlyView { .. })),
        "{got:?}"
    );
    s.synchronize().unwrap();
    assert_eq!(buffer.to_vec().unwrap(), data);
}

// Fills of views that start and end off word boundaries, for element sizes 1, 2, 3 and 8:
// exactly the view's bytes change (the memset plan must not round out to a word).
#[test]
fn fills_of_views_at_odd_byte_offsets_write_exactly_the_view() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(&gpu);

    let bytes: Vec<u8> = (0..=255).collect();
    let mut b8 = DeviceBuffer::from_slice(ctx, &bytes).unwrap();
    b8.slice_mut(3..7).unwrap().fill(0xee).unwrap();
    b8.slice_mut(9..10).unwrap().fill_async(0x11, &s).unwrap();
    let mut expected = bytes.clone();
    expected[3..7].fill(0xee);
    expected[9] = 0x11;
    assert_eq!(b8.to_vec().unwrap(), expected);

    let halves: Vec<u16> = (0..101).collect();
    let mut b16 = DeviceBuffer::from_slice(ctx, &halves).unwrap();
    b16.slice_mut(1..4).unwrap().fill(0xabcd).unwrap();
    let mut expected = halves.clone();
    expected[1..4].fill(0xabcd);
    assert_eq!(b16.to_vec().unwrap(), expected);

    let triples: Vec<[u8; 3]> = (0..50u8).map(|i| [i, i ^ 0x55, i ^ 0xaa]).collect();
    let mut b24 = DeviceBuffer::from_slice(ctx, &triples).unwrap();
    b24.slice_mut(7..13).unwrap().fill([1, 2, 3]).unwrap();
    b24.slice_mut(20..21)
        .unwrap()
        .fill_async([9, 8, 7], &s)
        .unwrap();
    let mut expected = triples.clone();
    expected[7..13].fill([1, 2, 3]);
    expected[20] = [9, 8, 7];
    assert_eq!(b24.to_vec().unwrap(), expected);

    let longs: Vec<u64> = (0..33).map(|i| i * 0x0101_0101_0101).collect();
    let mut b64 = DeviceBuffer::from_slice(ctx, &longs).unwrap();
    b64.slice_mut(31..33)
        .unwrap()
        .fill(0x0123_4567_89ab_cdef)
        .unwrap();
    let mut expected = longs.clone();
    expected[31..33].fill(0x0123_4567_89ab_cdef);
    assert_eq!(b64.to_vec().unwrap(), expected);
}

// ---------------------------------------------------------------------------------------------
// Resources handed pointers they never gave out.
// ---------------------------------------------------------------------------------------------

// RMM users sometimes `deallocate` with the wrong size or twice. Each is a typed error; the
// allocation stays live and is freed correctly afterwards.
#[test]
fn deallocating_a_foreign_pointer_a_wrong_size_or_twice_is_a_typed_error() {
    let _serial = serial();
    let gpu = require_gpu!();
    let s = stream(&gpu);
    let resource = DriverResource::new(&gpu.context);
    let ptr = resource.allocate(8192, &s).unwrap();

    let foreign = resource.deallocate(ptr + 4096, 4096, &s);
    assert!(
        matches!(foreign, Err(MemoryError::UnknownAllocation { .. })),
        "{foreign:?}"
    );
    let wrong_size = resource.deallocate(ptr, 4096, &s);
    assert!(
        matches!(
            wrong_size,
            Err(MemoryError::SizeMismatch {
                expected: 8192,
                actual: 4096,
                ..
            })
        ),
        "{wrong_size:?}"
    );
    assert_eq!(
        resource.outstanding(),
        1,
        "a refused free took it off the books"
    );
    resource.deallocate(ptr, 8192, &s).unwrap();
    let twice = resource.deallocate(ptr, 8192, &s);
    assert!(
        matches!(twice, Err(MemoryError::UnknownAllocation { .. })),
        "{twice:?}"
    );
    assert!(matches!(
        resource.deallocate(0, 1, &s),
        Err(MemoryError::UnknownAllocation { .. })
    ));
    assert_eq!(resource.outstanding(), 0);
}

// A typed buffer's memory handed to its resource's `deallocate`: `OwnedAllocation`, and the
// buffer still holds its bytes (no double free when it drops).
#[test]
fn deallocating_a_typed_buffers_memory_through_its_resource_is_refused() {
    let _serial = serial();
    let gpu = require_gpu!();
    let s = stream(&gpu);
    let resource = Arc::new(DriverResource::new(&gpu.context));
    let data = pattern(1024, 8);
    let mut buffer = DeviceBuffer::<u32>::with_resource(resource.clone(), data.len(), &s).unwrap();
    buffer.copy_from_host(&data).unwrap();
    let got = resource.deallocate(buffer.device_ptr(), buffer.allocated_bytes(), &s);
    assert!(
        matches!(got, Err(MemoryError::OwnedAllocation { .. })),
        "{got:?}"
    );
    assert_eq!(buffer.to_vec().unwrap(), data);
    drop(buffer);
    assert_eq!(resource.outstanding(), 0);
}

// ---------------------------------------------------------------------------------------------
// Host access while device work is queued.
// ---------------------------------------------------------------------------------------------

// `try_as_slice` on a pinned buffer that a queued device copy still writes is `DeviceBusy` at once
// (no block, no panic); the blocking form then waits and sees the copied bytes.
#[test]
fn try_host_slices_of_a_pinned_buffer_with_queued_work_are_device_busy() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let s = stream(&gpu);
    let data = pattern(1 << 16, 9);
    let device = DeviceBuffer::from_slice(ctx, &data).unwrap();
    let mut pinned = PinnedBuffer::<u32>::new(ctx, data.len()).unwrap();

    // A device-side copy into the (mapped) pinned buffer, queued behind a spin: a
    // `PendingCopy` would wait when dropped, so the buffer's own tracked copy is used instead.
    kernels.spin_ns(&s, 200 * MS).unwrap();
    pinned.copy_from_async(&device, &s).unwrap();

    let started = std::time::Instant::now();
    let busy = pinned.try_as_slice().map(|v| v.len());
    assert!(
        matches!(busy, Err(MemoryError::DeviceBusy { .. })),
        "{busy:?}"
    );
    let busy = pinned.try_as_mut_slice().map(|v| v.len());
    assert!(
        matches!(busy, Err(MemoryError::DeviceBusy { .. })),
        "{busy:?}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_millis(100),
        "try_ forms blocked for {:?}",
        started.elapsed()
    );
    assert_eq!(&*pinned.as_slice().unwrap(), &data[..]);
    assert!(pinned.try_as_slice().is_ok());
}

// Unified memory: `try_as_slice` with queued work is `DeviceBusy`; prefetch ranges past the
// end, of zero length, and to a device that does not exist are typed errors before any
// driver call. Kept to 4 MiB of managed memory.
#[test]
fn unified_buffers_refuse_busy_host_slices_and_bad_prefetch_ranges() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let caps = cuweave_memory::ManagedCapabilities::of(ctx.device()).unwrap();
    if !(caps.managed_memory && caps.concurrent_managed_access) {
        cuweave_test_support::skip(
            "unified_buffers_refuse_busy_host_slices_and_bad_prefetch_ranges",
            "needs concurrent managed access",
        );
        return;
    }
    let kernels = TestKernels::load(ctx).unwrap();
    let s = stream(&gpu);
    let len = 1 << 20;
    let mut unified = UnifiedBuffer::<u32>::zeroed(ctx, len).unwrap();

    assert!(matches!(
        unified.range(len - 1, 2).map(|r| r.bytes()),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        unified.range(0, 0).map(|r| r.bytes()),
        Err(MemoryError::ZeroLength { .. })
    ));
    let hints = unified.hints().unwrap();
    assert!(matches!(
        hints.prefetch_range(len, 1, MemLocation::Host, &s),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        hints.prefetch_range(usize::MAX, 2, MemLocation::Host, &s),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        hints.subrange(0, 0).map(|r| r.bytes()),
        Err(MemoryError::ZeroLength { .. })
    ));
    let mut plan = PrefetchPlan::new();
    let bad_target = plan
        .add(&unified, MemLocation::Device(4096))
        .map(|p| p.len());
    assert!(bad_target.is_err(), "{bad_target:?}");
    assert!(
        matches!(
            bad_target,
            Err(MemoryError::Driver(
                cuweave_driver::DriverError::InvalidArgument { .. }
            ))
        ),
        "a prefetch to device 4096 should be the driver layer's InvalidArgument: {bad_target:?}"
    );
    assert!(plan.is_empty(), "a refused entry was added");
    assert!(matches!(
        plan.execute(&s),
        Err(MemoryError::ZeroLength { .. })
    ));
    drop(plan);
    drop(hints);

    kernels.spin_ns(&s, 200 * MS).unwrap();
    unified.fill_async(7, &s).unwrap();
    let busy = unified.try_as_slice().map(|v| v.len());
    assert!(
        matches!(busy, Err(MemoryError::DeviceBusy { .. })),
        "{busy:?}"
    );
    assert!(unified.as_slice().unwrap().iter().all(|&x| x == 7));
}

// A stream of another device: on a one-GPU machine this cannot be made, so the check is made
// through an allocator of device 0 with a stream of device 0 (accepted) only when there is no
// second device; with two devices, a stream of device 1 is `WrongDevice` for every entry point.
#[test]
fn streams_of_another_device_are_wrong_device_errors() {
    let _serial = serial();
    let gpu = require_gpu!();
    let Ok(count) = cuweave_driver::Device::count() else {
        return;
    };
    if count < 2 {
        cuweave_test_support::skip(
            "streams_of_another_device_are_wrong_device_errors",
            "needs two devices",
        );
        return;
    }
    let other = cuweave_driver::Context::primary(cuweave_driver::Device::get(1).unwrap()).unwrap();
    let foreign = Stream::new(&other, StreamFlags::NON_BLOCKING).unwrap();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    assert!(matches!(
        allocator.buffer::<u32>(16, &foreign).map(drop),
        Err(MemoryError::WrongDevice { .. })
    ));
    let resource = Arc::new(DriverResource::new(&gpu.context));
    assert!(matches!(
        DeviceBuffer::<u32>::with_resource(resource, 16, &foreign).map(drop),
        Err(MemoryError::WrongDevice { .. })
    ));
    let mut buffer = DeviceBuffer::from_slice(&gpu.context, &[1u32; 16]).unwrap();
    let on_other = DeviceBuffer::from_slice(&other, &[2u32; 16]).unwrap();
    assert!(matches!(
        buffer.copy_from(&on_other),
        Err(MemoryError::WrongDevice { .. })
    ));
    assert_eq!(buffer.to_vec().unwrap(), [1; 16]);
}
