//! The caching allocator as a memory resource on a real GPU, under adaptors as RMM programs stack
//! them (`statistics(limit(caching(…)))`): typed buffers through the stack round-trip, the
//! statistics count what the program holds, the limit refuses with a typed error, freed memory
//! comes back from the cache, a free on another stream waits for that stream's kernel (a watch
//! kernel proves no byte was reused early), bad frees are typed, the registry stays bounded, and
//! captures are handled.
//!
//! The tests take one lock: the watch tests need their streams to really overlap.

use std::sync::{Arc, MutexGuard};

use cuweave_driver::graph::{CaptureMode, CaptureStatus};
use cuweave_driver::memory::{self, DevicePtr};
use cuweave_driver::{Context, Event, EventFlags, InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::caching::{
    CachingAllocator, CachingResource, GraphPool, MissPolicy, begin_allocate_to_pool,
};
use cuweave_memory::resource::{DriverResource, LimitAdaptor, MemoryResource, StatisticsAdaptor};
use cuweave_memory::{Buffer, DeviceBuffer, MemoryError};
mod common;

use common::{counter, read_u32};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const MIB: usize = 1 << 20;
/// How long the watch kernel reads a freed block: long enough that the host's allocations and
/// launches all happen while it runs.
const WATCH_NS: u64 = 200_000_000;
const EXPECTED: u32 = 0xA5A5_A5A5;

type Driver = Arc<StatisticsAdaptor<DriverResource>>;
type Stack = StatisticsAdaptor<LimitAdaptor<CachingResource>>;

fn exclusive() -> MutexGuard<'static, ()> {
    cuweave_test_support::serial()
}

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// `statistics(limit(caching(statistics(driver))))`: the outer statistics count what the program
/// holds, the inner ones the driver allocations the cache makes.
fn stack(context: &Arc<Context>, cap: usize) -> (Arc<Stack>, CachingAllocator, Driver) {
    let driver = Arc::new(StatisticsAdaptor::new(DriverResource::new(context)));
    let allocator = CachingAllocator::new(driver.clone());
    let stack = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        CachingResource::new(allocator.clone()),
        cap,
    )));
    (stack, allocator, driver)
}

fn caching(stack: &Stack) -> &CachingResource {
    stack.upstream().upstream()
}

fn words(bytes: usize) -> usize {
    bytes / 4
}

#[test]
fn typed_buffers_on_statistics_over_limit_over_the_cache() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let (stack, allocator, driver) = stack(ctx, 8 * MIB);
    assert_eq!(
        stack.name(),
        "statistics(limit(caching(statistics(driver))))"
    );
    let resource: Arc<dyn MemoryResource> = stack.clone();

    let pattern: Vec<u32> = (0..1000u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let mut a = DeviceBuffer::<u32>::with_resource(resource.clone(), 1000, &s).unwrap();
    let a_ptr = a.device_ptr();
    let mut b = DeviceBuffer::<u64>::with_resource(resource.clone(), 300, &s).unwrap();
    assert_eq!(a.resource_name(), stack.name());
    a.copy_from_host(&pattern).unwrap();
    b.fill(0x0123_4567_89AB_CDEF).unwrap();
    assert_eq!(
        a.to_vec().unwrap(),
        pattern,
        "bytes round-trip through the stack"
    );
    assert!(
        b.to_vec()
            .unwrap()
            .iter()
            .all(|&v| v == 0x0123_4567_89AB_CDEF)
    );

    let stats = stack.stats();
    assert_eq!(
        (stats.current_bytes, stats.current_allocations),
        (4000 + 2400, 2),
        "the outer statistics count exactly what the program holds"
    );
    assert_eq!(stack.upstream().used(), 6400);
    assert_eq!(caching(&stack).live_allocations(), 2);
    assert_eq!(
        driver.stats().total_allocations,
        1,
        "both from one cached segment"
    );

    // The limit counts what is held, not what the cache reserved: 8 MiB more does not fit.
    let error = DeviceBuffer::<u8>::with_resource(resource.clone(), 8 * MIB, &s).unwrap_err();
    assert_eq!(
        error,
        MemoryError::OutOfMemory {
            requested: 8 * MIB,
            allocated: 6400,
            reserved: 6400,
            limit: Some(8 * MIB),
        }
    );
    assert_eq!(stack.stats().failed_allocations, 1);
    assert_eq!(
        allocator.stats().cache_misses,
        1,
        "the cache was never asked"
    );

    drop(a);
    let stats = stack.stats();
    assert_eq!((stats.current_bytes, stats.current_allocations), (2400, 1));
    assert_eq!(stack.upstream().used(), 2400);
    assert_eq!(caching(&stack).live_allocations(), 1);

    // The freed block comes back from the cache: no new driver allocation. (The drop freed it
    // on the legacy stream, after the buffer's uses: once the device has passed that, the
    // next allocation on `s` finds it.)
    ctx.synchronize().unwrap();
    let again = DeviceBuffer::<u32>::with_resource(resource.clone(), 1000, &s).unwrap();
    assert_eq!(again.device_ptr(), a_ptr, "the freed block, from the cache");
    assert_eq!(
        driver.stats().total_allocations,
        1,
        "no new driver allocation"
    );
    assert_eq!(allocator.stats().cache_misses, 1);
    assert_eq!(allocator.pending_frees(), 0);
    drop((again, b));
    let stats = stack.stats();
    assert_eq!((stats.current_bytes, stats.current_allocations), (0, 0));
    assert_eq!(stats.peak_bytes, 6400);
    assert_eq!(stats.total_allocations, 3);
    assert_eq!(caching(&stack).live_allocations(), 0);
    ctx.synchronize().unwrap();
    stack.release_unused().unwrap();
    assert_eq!(
        driver.stats().current_bytes,
        0,
        "release_unused emptied the cache"
    );
}

#[test]
fn a_free_on_the_allocating_stream_is_reused_once_its_work_ran_without_a_driver_allocation() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    let (stack, allocator, driver) = stack(&gpu.context, 64 * MIB);
    let first = stack.allocate(MIB, &s).unwrap();
    // SAFETY: `first` holds MIB bytes until it is freed below, after this fill on `s`.
    unsafe { memory::memset_d32_async(first, 7, words(MIB), &s).unwrap() };
    stack.deallocate(first, MIB, &s).unwrap();
    // The allocator hands blocks to typed buffers too, which may use them on any stream: even
    // on its own stream the block waits for the work queued there (one event).
    assert_eq!(
        allocator.pending_frees(),
        1,
        "an event on the allocating stream"
    );
    s.synchronize().unwrap();
    let second = stack.allocate(MIB, &s).unwrap();
    assert_eq!(allocator.pending_frees(), 0, "the event was polled");
    assert_eq!(second, first, "the same block, on the same stream");
    let stats = allocator.stats();
    assert_eq!((stats.cache_misses, stats.cache_hits), (1, 1));
    assert_eq!(
        driver.stats().total_allocations,
        1,
        "no new driver allocation"
    );
    stack.deallocate(second, MIB, &s).unwrap();
    assert_eq!(stack.stats().current_bytes, 0);
}

/// Fills a block from the stack on `s1`, starts a 200 ms watch of it on `s2` (ordered after the
/// fill), frees it on `free_on`, then allocates the same size on `s1` and fills it with other
/// bytes. Returns the old and new addresses, the watch's mismatch count and `s1`.
fn free_under_watch(
    ctx: &Arc<Context>,
    stack: &Stack,
    cross_stream: bool,
) -> (DevicePtr, DevicePtr, u32, Stream) {
    let kernels = TestKernels::load(ctx).expect("load test kernels");
    let (s1, s2) = (stream(ctx), stream(ctx));
    let n = words(MIB);
    let mismatches = counter(ctx);
    let old = stack.allocate(MIB, &s1).unwrap();
    let filled = Event::new(ctx, EventFlags::DISABLE_TIMING).unwrap();
    // SAFETY: `old` holds `n` u32s and stays mapped while watched (its block stays in the
    // allocator's segment; in the control run it is deliberately reused, which the watch
    // tolerates, as it only reads); `mismatches` lives until after s2 is synchronised.
    unsafe {
        kernels.fill_u32(&s1, old, EXPECTED, n).unwrap();
        filled.record(&s1).unwrap();
        s2.wait_event(&filled).unwrap();
        kernels
            .watch_u32(&s2, old, n, EXPECTED, WATCH_NS, mismatches.ptr())
            .unwrap();
    }
    let free_on = if cross_stream { &s2 } else { &s1 };
    if !cross_stream {
        // A free on the allocating stream waits for the work queued there so far (its fill):
        // past it, nothing known uses the block, and only the unrecorded watch on s2 reads it.
        s1.synchronize().unwrap();
    }
    stack.deallocate(old, MIB, free_on).unwrap();
    let new = stack.allocate(MIB, &s1).unwrap();
    // SAFETY: `new` holds `n` u32s until the caller frees it, after s1 is synchronised here.
    unsafe { kernels.fill_u32(&s1, new, !EXPECTED, n).unwrap() };
    assert!(
        !s2.query().unwrap(),
        "the watch kernel must still be running when the block is reallocated"
    );
    s2.synchronize().unwrap();
    s1.synchronize().unwrap();
    stack.deallocate(new, MIB, &s1).unwrap();
    (old, new, read_u32(ctx, mismatches.ptr()), s1)
}

#[test]
fn a_free_on_another_stream_waits_for_the_kernel_queued_there() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    if cuweave_test_support::skip_under_sanitizer(
        "a_free_on_another_stream_waits_for_the_kernel_queued_there",
        "needs two streams at once",
    ) {
        return;
    }
    let (stack, allocator, driver) = stack(&gpu.context, 64 * MIB);
    let (old, new, mismatches, s1) = free_under_watch(&gpu.context, &stack, true);
    assert_ne!(new, old, "not handed out while the watch kernel reads it");
    assert_eq!(
        mismatches, 0,
        "the watch kernel saw its bytes unchanged for 200 ms"
    );
    assert_eq!(driver.stats().total_allocations, 1, "both from one segment");
    // The old block waits for its event on s2; `new`, freed on its stream after that stream
    // was synchronised, for the next allocation to poll its event.
    assert_eq!(
        allocator.pending_frees(),
        2,
        "the old block waits for its event"
    );
    // The watch is over (s2 synchronised): the next allocation on the block's stream polls the
    // event, and the old block goes back to the free list.
    let held = stack.allocate(MIB, &s1).unwrap();
    assert_eq!(allocator.pending_frees(), 0);
    stack.deallocate(held, MIB, &s1).unwrap();
    assert_eq!(caching(&stack).live_allocations(), 0);
}

#[test]
fn a_free_on_the_allocating_stream_is_reused_under_the_watch_control() {
    // The control for the test above: the watch kernel does catch a reuse, so its zero there
    // means the cross-stream free prevented one.
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    if cuweave_test_support::skip_under_sanitizer(
        "a_free_on_the_allocating_stream_is_reused_under_the_watch_control",
        "needs two streams at once",
    ) {
        return;
    }
    let (stack, _allocator, _driver) = stack(&gpu.context, 64 * MIB);
    let (old, new, mismatches, _s1) = free_under_watch(&gpu.context, &stack, false);
    assert_eq!(
        new, old,
        "same stream, its queued work done, no other use known: reused at once"
    );
    assert!(mismatches > 0, "the watch kernel saw the new fill");
}

#[test]
fn bad_frees_are_typed_and_leave_the_allocation_live() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let (s1, s2) = (stream(&gpu.context), stream(&gpu.context));
    let (stack, allocator, _driver) = stack(&gpu.context, 64 * MIB);
    assert!(matches!(
        stack.allocate(0, &s1),
        Err(MemoryError::ZeroLength { .. })
    ));
    let ptr = stack.allocate(4096, &s1).unwrap();
    for free_on in [&s1, &s2] {
        assert_eq!(
            stack.deallocate(ptr, 512, free_on),
            Err(MemoryError::SizeMismatch {
                operation: "CachingResource::deallocate",
                expected: 4096,
                actual: 512,
            })
        );
        assert_eq!(
            stack.deallocate(ptr + 512, 4096, free_on),
            Err(MemoryError::UnknownAllocation {
                operation: "CachingResource::deallocate",
                ptr: ptr + 512,
            })
        );
    }
    assert_eq!(stack.stats().current_allocations, 1, "still live");
    assert_eq!(stack.upstream().used(), 4096, "still counted by the limit");
    assert_eq!(caching(&stack).live_allocations(), 1);
    assert_eq!(allocator.stats().allocated_bytes.current, 4096);
    stack.deallocate(ptr, 4096, &s1).unwrap();
    assert_eq!(
        stack.deallocate(ptr, 4096, &s1),
        Err(MemoryError::UnknownAllocation {
            operation: "CachingResource::deallocate",
            ptr,
        }),
        "a second free is refused, not passed to the cache"
    );
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
}

#[test]
fn the_registry_holds_exactly_the_live_allocations_over_100k_cycles() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let (s1, s2) = (stream(&gpu.context), stream(&gpu.context));
    let driver = Arc::new(StatisticsAdaptor::new(DriverResource::new(&gpu.context)));
    let allocator = CachingAllocator::new(driver.clone());
    let resource = CachingResource::new(allocator.clone());
    let sizes = [512, 4096, 100_000, 3 * MIB];
    let mut live: Vec<(DevicePtr, usize)> = Vec::new();
    for i in 0..100_000usize {
        let bytes = sizes[i % sizes.len()];
        live.push((resource.allocate(bytes, &s1).unwrap(), bytes));
        if live.len() > 4 {
            let (ptr, bytes) = live.remove(0);
            // Every tenth free on another stream: an event there, a pending block.
            let free_on = if i % 10 == 0 { &s2 } else { &s1 };
            resource.deallocate(ptr, bytes, free_on).unwrap();
        }
        assert_eq!(resource.live_allocations(), live.len());
    }
    for (ptr, bytes) in live.drain(..) {
        resource.deallocate(ptr, bytes, &s1).unwrap();
    }
    assert_eq!(resource.live_allocations(), 0);
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
    assert!(
        driver.stats().total_allocations <= 16,
        "the cache served the loop: {:?}",
        driver.stats()
    );
    gpu.context.synchronize().unwrap();
    // The next allocation polls the pending blocks, whose events have all completed.
    let last = resource.allocate(512, &s1).unwrap();
    assert_eq!(
        allocator.pending_frees(),
        0,
        "every pending block came back"
    );
    resource.deallocate(last, 512, &s1).unwrap();
}

#[test]
fn dropping_the_resource_with_live_allocations_waits_for_the_work_using_them() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    if cuweave_test_support::skip_under_sanitizer(
        "dropping_the_resource_with_live_allocations_waits_for_the_work_using_them",
        "needs two streams at once",
    ) {
        return;
    }
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).expect("load test kernels");
    let (s1, s2) = (stream(ctx), stream(ctx));
    let allocator = CachingAllocator::with_driver(ctx);
    let resource = CachingResource::new(allocator.clone());
    let n = words(MIB);
    let mismatches = counter(ctx);
    let old = resource.allocate(MIB, &s1).unwrap();
    let filled = Event::new(ctx, EventFlags::DISABLE_TIMING).unwrap();
    // SAFETY: `old` holds `n` u32s and stays mapped (the allocator keeps its segment) while the
    // watch reads it; `mismatches` lives until after s2 is synchronised.
    unsafe {
        kernels.fill_u32(&s1, old, EXPECTED, n).unwrap();
        filled.record(&s1).unwrap();
        s2.wait_event(&filled).unwrap();
        kernels
            .watch_u32(&s2, old, n, EXPECTED, WATCH_NS, mismatches.ptr())
            .unwrap();
    }
    drop(resource);
    assert!(
        s2.query().unwrap(),
        "the drop waited for the watch before giving the memory back"
    );
    assert_eq!(allocator.stats().allocated_bytes.current, 0, "given back");
    let new = allocator.allocate(MIB, &s1).unwrap();
    assert_eq!(new.ptr(), old, "back in the cache");
    // SAFETY: `new` holds `n` u32s and outlives the fill (s1 is synchronised below).
    unsafe { kernels.fill_u32(&s1, new.ptr(), !EXPECTED, n).unwrap() };
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    assert_eq!(
        read_u32(ctx, mismatches.ptr()),
        0,
        "no byte was reused under the watch"
    );
}

fn assert_capture_active(stream: &Stream) {
    let status = stream.capture_status().unwrap();
    assert!(
        matches!(status, CaptureStatus::Active { .. }),
        "the capture was broken: {status:?}"
    );
}

#[test]
fn captures_allocate_from_their_graph_pool_and_refuse_cross_stream_frees() {
    let _exclusive = exclusive();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let (s, other) = (stream(ctx), stream(ctx));
    let resource = CachingResource::new(CachingAllocator::with_driver(ctx));

    // A capture with no graph pool bound: the allocation cannot be made safe, so it is refused.
    s.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let refused = resource.allocate(MIB, &s).unwrap_err();
    assert!(refused.is_capture_refusal(), "{refused}");
    assert_eq!(resource.live_allocations(), 0);
    drop(s.end_capture().unwrap());

    let pool = GraphPool::new();
    s.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let routed = begin_allocate_to_pool(&s, &pool, MissPolicy::default()).unwrap();
    let scratch = resource.allocate(MIB, &s).unwrap();
    // SAFETY: `scratch` holds MIB bytes for the graph's life (its pool keeps them).
    unsafe { memory::memset_d32_async(scratch, 3, words(MIB), &s).unwrap() };
    let refused = resource.deallocate(scratch, MIB, &other).unwrap_err();
    assert!(refused.is_capture_refusal(), "{refused}");
    assert_eq!(
        resource.live_allocations(),
        1,
        "the refused free left it live"
    );
    assert_capture_active(&s);
    resource.deallocate(scratch, MIB, &s).unwrap();
    let again = resource.allocate(MIB, &s).unwrap();
    assert_eq!(
        again, scratch,
        "reused later in the same capture, on the same stream"
    );
    resource.deallocate(again, MIB, &s).unwrap();
    assert_capture_active(&s);
    let mut graph = s.end_capture().unwrap();
    drop(routed);
    graph.keep_alive(pool.keep_alive());
    drop(pool);

    // The graph's memory is its own: eager work on the same stream gets other memory.
    let eager = resource.allocate(MIB, &s).unwrap();
    assert_ne!(eager, scratch, "graph memory is not handed to eager work");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.launch(&s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        read_u32(ctx, scratch),
        3,
        "the replay wrote the graph's memory"
    );
    resource.deallocate(eager, MIB, &other).unwrap();
    assert_eq!(resource.live_allocations(), 0);
}
