//! GPU tests: a graph's private-pool memory outlives the caching allocator it came from. The
//! allocator is dropped while the graph lives; the graph's segments stay mapped and the graph
//! replays byte-exact into them; once the graph is gone the memory goes back to the upstream
//! (driver, limit adaptor, async pool, and the default per-device allocator).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::memory::address_range;
use cuweave_driver::{Context, Graph, InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::buffer::{Buffer, DeviceBuffer};
use cuweave_memory::caching::{CachingAllocator, GraphPool, MissPolicy, begin_allocate_to_pool};
use cuweave_memory::resource::{
    AsyncPoolResource, DriverResource, LimitAdaptor, MemoryResource, StatisticsAdaptor,
};
use cuweave_test_support::require_gpu;

/// Elements of the large scratch buffer (4 MiB: the large pool).
const LARGE: usize = 1 << 20;
/// Elements of the small scratch buffer (64 KiB: the small pool).
const SMALL: usize = 1 << 14;
const PATTERN: u32 = 0x5a5a_5a5a;
const SENTINEL: u32 = 0xdead_beef;

/// Serializes this file's tests: a capture active in one holds back the other's returns.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

fn input(round: u32) -> Vec<u32> {
    (0..LARGE as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(round))
        .collect()
}

/// What a capture made: the graph (holding its pool), and the addresses of its scratch memory.
struct Captured {
    graph: Graph,
    scratch: [u64; 2],
}

/// Captures on `stream`: `large` (from `allocate`, during the capture) takes `x`, `small` is
/// set to [`PATTERN`]; both are copied out to `out_large` / `out_small`, and freed in the
/// capture. The graph holds the capture's pool; no other handle of it is left.
fn capture(
    stream: &Stream,
    allocate: impl Fn(usize) -> DeviceBuffer<u32>,
    x: &DeviceBuffer<u32>,
    out_large: &mut DeviceBuffer<u32>,
    out_small: &mut DeviceBuffer<u32>,
) -> Captured {
    let pool = GraphPool::new();
    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let routed = begin_allocate_to_pool(stream, &pool, MissPolicy::default()).unwrap();
    let mut large = allocate(LARGE);
    let mut small = allocate(SMALL);
    let scratch = [large.device_ptr(), small.device_ptr()];
    large.copy_from_async(x, stream).unwrap();
    small.fill_async(PATTERN, stream).unwrap();
    out_large.copy_from_async(&large, stream).unwrap();
    out_small.copy_from_async(&small, stream).unwrap();
    drop((large, small));
    let mut graph = stream.end_capture().unwrap();
    drop(routed);
    graph.keep_alive(pool.keep_alive());
    drop(pool);
    Captured { graph, scratch }
}

/// Replays `graph` a few times with new inputs, with plain driver allocations (filled with a
/// sentinel) made meanwhile, and checks every output and sentinel bit for bit.
fn replay_exactly(
    context: &Arc<Context>,
    stream: &Stream,
    captured: &Captured,
    x: &mut DeviceBuffer<u32>,
    out_large: &mut DeviceBuffer<u32>,
    out_small: &mut DeviceBuffer<u32>,
) {
    for ptr in captured.scratch {
        let (base, size) = address_range(context, ptr)
            .expect("the graph's memory is still mapped after its allocator was dropped");
        assert!(base <= ptr && ptr < base + size as u64);
    }
    // Memory the driver hands out now: where freed graph memory would be reused.
    let mut eager: Vec<DeviceBuffer<u32>> = (0..4)
        .map(|_| DeviceBuffer::with_resource(Arc::new(DriverResource::new(context)), LARGE, stream))
        .collect::<Result<_, _>>()
        .unwrap();
    for buffer in &mut eager {
        buffer.fill(SENTINEL).unwrap();
    }
    let exec = captured
        .graph
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    for round in 1..=5 {
        let host = input(round);
        x.copy_from_host(&host).unwrap();
        out_large.fill(0).unwrap();
        out_small.fill(0).unwrap();
        exec.launch(stream).unwrap();
        stream.synchronize().unwrap();
        assert!(
            out_large.to_vec().unwrap() == host,
            "round {round}: the replay's large scratch was not exact"
        );
        assert!(
            out_small.to_vec().unwrap().iter().all(|&v| v == PATTERN),
            "round {round}: the replay's small scratch was not exact"
        );
    }
    for buffer in &eager {
        assert!(
            buffer.to_vec().unwrap().iter().all(|&v| v == SENTINEL),
            "a replay wrote memory the driver handed out after the allocator was dropped"
        );
    }
    drop(eager);
    drop(exec);
}

/// The whole pattern over `base` (counted by a statistics adaptor): capture with a private
/// allocator, drop it, replay, drop the graph, see every byte go back.
fn allocator_dropped_under_a_live_graph(context: &Arc<Context>, base: Arc<dyn MemoryResource>) {
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let counted = Arc::new(StatisticsAdaptor::new(base));
    let mut x = DeviceBuffer::<u32>::from_slice(context, &input(0)).unwrap();
    let mut out_large = DeviceBuffer::<u32>::new(context, LARGE).unwrap();
    let mut out_small = DeviceBuffer::<u32>::new(context, SMALL).unwrap();

    let allocator = CachingAllocator::new(Arc::clone(&counted) as Arc<dyn MemoryResource>);
    // A segment of the general cache too, which the allocator's drop does give back.
    drop(allocator.buffer::<u32>(LARGE, &stream).unwrap());
    let captured = capture(
        &stream,
        |len| allocator.buffer::<u32>(len, &stream).unwrap(),
        &x,
        &mut out_large,
        &mut out_small,
    );
    assert_eq!(counted.stats().current_allocations, 3, "two graph segments");
    allocator.empty_cache().unwrap();
    assert_eq!(
        counted.stats().current_allocations,
        2,
        "empty_cache leaves the graph's segments"
    );
    drop(allocator);
    let graph_bytes = counted.stats().current_bytes;
    assert_eq!(
        counted.stats().current_allocations,
        2,
        "dropping the allocator freed the memory a live graph replays into"
    );
    assert!(
        Arc::strong_count(&counted) >= 2,
        "the graph's pool keeps the upstream"
    );

    replay_exactly(
        context,
        &stream,
        &captured,
        &mut x,
        &mut out_large,
        &mut out_small,
    );
    assert_eq!(counted.stats().current_bytes, graph_bytes);

    drop(captured);
    let stats = counted.stats();
    assert_eq!(
        (stats.current_allocations, stats.current_bytes),
        (0, 0),
        "the graph's memory went back to the upstream when the graph died: {stats:?}"
    );
    assert_eq!(
        Arc::strong_count(&counted),
        1,
        "nothing holds the upstream any more"
    );
}

#[test]
fn a_graph_replays_after_its_driver_backed_allocator_is_dropped_and_its_memory_returns_after() {
    let _serial = serial();
    let gpu = require_gpu!();
    let base = Arc::new(DriverResource::new(&gpu.context));
    allocator_dropped_under_a_live_graph(&gpu.context, Arc::clone(&base) as _);
    assert_eq!(base.outstanding(), 0, "every cuMemAlloc was freed");
}

#[test]
fn a_graph_replays_after_its_limited_allocator_is_dropped_and_its_memory_returns_after() {
    let _serial = serial();
    let gpu = require_gpu!();
    let base = Arc::new(LimitAdaptor::new(
        DriverResource::new(&gpu.context),
        64 << 20,
    ));
    allocator_dropped_under_a_live_graph(&gpu.context, Arc::clone(&base) as _);
    assert_eq!(base.used(), 0, "the limit counts nothing left");
}

#[test]
fn a_graph_replays_after_its_async_pool_allocator_is_dropped_and_its_memory_returns_after() {
    let _serial = serial();
    let gpu = require_gpu!();
    let base = Arc::new(AsyncPoolResource::new(&gpu.context).unwrap());
    allocator_dropped_under_a_live_graph(&gpu.context, Arc::clone(&base) as _);
    assert_eq!(
        base.pool().used_bytes().unwrap(),
        0,
        "nothing allocated from the pool"
    );
    assert_eq!(
        base.pool().reserved_bytes().unwrap(),
        0,
        "the pool gave the returned segments to the driver"
    );
}

#[test]
fn a_graph_of_a_replaced_default_allocator_replays_and_its_memory_returns_after() {
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let mut x = DeviceBuffer::<u32>::from_slice(context, &input(0)).unwrap();
    let mut out_large = DeviceBuffer::<u32>::new(context, LARGE).unwrap();
    let mut out_small = DeviceBuffer::<u32>::new(context, SMALL).unwrap();

    let counted = Arc::new(StatisticsAdaptor::new(DriverResource::new(context)));
    let ours = CachingAllocator::new(Arc::clone(&counted) as Arc<dyn MemoryResource>);
    let previous = CachingAllocator::set_default_for_device(ours);
    let captured = capture(
        &stream,
        |len| DeviceBuffer::<u32>::new_on(&stream, len).unwrap(),
        &x,
        &mut out_large,
        &mut out_small,
    );
    assert_eq!(counted.stats().current_allocations, 2);
    // Put the default back; our allocator's last handles (the replaced one, this thread's
    // clone, dropped at its next default allocation) go.
    let restored = previous.unwrap_or_else(|| CachingAllocator::with_driver(context));
    drop(CachingAllocator::set_default_for_device(restored));
    drop(DeviceBuffer::<u32>::new_on(&stream, 1).unwrap());
    assert_eq!(
        Arc::strong_count(&counted),
        2,
        "the allocator is gone; its graph pool holds the upstream"
    );
    assert_eq!(counted.stats().current_allocations, 2);

    replay_exactly(
        context,
        &stream,
        &captured,
        &mut x,
        &mut out_large,
        &mut out_small,
    );
    drop(captured);
    let stats = counted.stats();
    assert_eq!(
        (stats.current_allocations, stats.current_bytes),
        (0, 0),
        "{stats:?}"
    );
    assert_eq!(Arc::strong_count(&counted), 1);
}
