//! A seventh look, at the newest code: the queries the caching allocator, the buffer tracker
//! and the pinned pool make of their own accord now run inside `outside_captures` and are
//! skipped while any capture is active or beginning. Skipped work must happen later, and
//! nothing may grow without bound while a long capture is open on another thread. The programs
//! are the ones PyTorch users write around `torch.cuda.graph` (a capture on one thread, a data
//! loader or a second model allocating and freeing on its own streams on another), and RMM
//! users' stream-ordered frees across streams:
//!
//! - `record_stream`'d raw blocks freed on another thread while an unbound capture is open:
//!   once it ends, they come back to the cache (active bytes drain, `empty_cache` returns every
//!   segment), and `empty_cache` during the capture is a typed refusal;
//! - typed buffers filled on their own stream and dropped during another thread's unbound
//!   capture: the same, with bytes checked;
//! - typed buffers made on a statistics adaptor over the driver (no cache) and dropped during
//!   another thread's plain capture: deallocated after it, the adaptor's books back to zero;
//! - typed buffers of an unrelated stream dropped during another thread's capture bound to a
//!   graph pool: they were never used by the capture, so they come back once it ends, not only
//!   when the graph dies;
//! - a loop allocating, filling and dropping a 4 MiB buffer on its own stream 256 times while a
//!   capture is open elsewhere: the memory reserved stays bounded;
//! - `record_stream` frees left pending behind a gated stream before another thread's capture
//!   begins: never handed out during it while the gate holds, settled after it, and reused
//!   without a new segment;
//! - a long-lived block recorded on a fresh stream per request during another thread's capture
//!   (nothing retired then): after the capture the next record retires every finished one;
//! - pinned-pool staging buffers whose copies finished, dropped during a capture elsewhere: the
//!   pool pins new blocks meanwhile, and after the capture every block becomes ready and the
//!   next gets are hits;
//! - a dropped stream's cached segments, left alone by misses during another thread's capture,
//!   adopted by the next miss after it (no new reservation);
//! - 10^4 small allocations with `record_stream` during a capture elsewhere, then 10^4 after:
//!   after the capture the pending list drains and the cache stops growing.
//!
//! Every GPU test takes the serial guard: each opens a capture, whose presence anywhere in the
//! process changes every allocator's paths.

use std::sync::mpsc;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use cuweave_driver::graph::{CaptureMode, GraphError, active_captures};
use cuweave_driver::{
    Context, DriverError, Graph, GraphExec, InstantiateOptions, Stream, StreamFlags,
};
use cuweave_memory::caching::{CachingAllocator, GraphPool, MissPolicy, begin_allocate_to_pool};
use cuweave_memory::pinned_pool::PinnedPool;
use cuweave_memory::resource::{DriverResource, MemoryResource, StatisticsAdaptor};
use cuweave_memory::{Buffer, DeviceBuffer, MemoryError};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{poll_until, require_gpu, serial};

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

const MIB: usize = 1 << 20;

/// How long a test waits for skipped work to be done after a capture ends: far more than it
/// takes (one poll), so a miss is a leak, not a slow machine.
const SETTLE: Duration = Duration::from_secs(10);

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// A capture held open on a thread of its own (ThreadLocal mode, on its own non-blocking
/// stream, a short spin kernel captured), bound to a graph pool or not, until
/// [`close`](Self::close). Dropping it without closing ends the capture too (the thread sees
/// its channel closed).
struct CaptureElsewhere {
    done: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<Captured>>,
}

/// A capture's graph, with the module of the kernel it captured (declared after the graph, so
/// it is unloaded only once the graph is gone).
struct Captured {
    graph: Graph,
    _kernels: TestKernels,
}

impl CaptureElsewhere {
    /// Begins the capture on a new thread and returns once it is active.
    fn open(context: &Arc<Context>, pool: Option<GraphPool>) -> Self {
        let (opened_tx, opened_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let context = Arc::clone(context);
        let thread = std::thread::spawn(move || {
            let kernels = TestKernels::load(&context).expect("load test kernels");
            let s = stream(&context);
            s.begin_capture(CaptureMode::ThreadLocal)
                .expect("begin capture");
            let routed = pool
                .as_ref()
                .map(|pool| begin_allocate_to_pool(&s, pool, MissPolicy::default()).unwrap());
            kernels.spin_ns(&s, 1_000).expect("captured spin");
            opened_tx.send(()).unwrap();
            let _ = done_rx.recv();
            let mut graph = s.end_capture().expect("end capture");
            drop(routed);
            if let Some(pool) = &pool {
                graph.keep_alive(pool.keep_alive());
            }
            Captured {
                graph,
                _kernels: kernels,
            }
        });
        opened_rx
            .recv()
            .expect("the capture thread began its capture");
        assert!(active_captures() > 0, "the capture is active");
        Self {
            done: Some(done_tx),
            thread: Some(thread),
        }
    }

    /// Ends the capture and returns its graph (with the captured kernel's module).
    fn close(mut self) -> Captured {
        drop(self.done.take());
        self.thread.take().unwrap().join().expect("capture thread")
    }
}

impl Drop for CaptureElsewhere {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Waits until `allocator` has no active bytes (nothing allocated, nothing pending), making a
/// small allocation and free on `s` at each try (the normal path, which polls pending frees);
/// panics with the statistics when it does not happen within [`SETTLE`].
fn drain(allocator: &CachingAllocator, s: &Stream, what: &str) {
    let drained = poll_until(SETTLE, || {
        drop(allocator.allocate(512, s).expect("nudge allocation"));
        allocator.stats().active_bytes.current == 0
    });
    assert!(
        drained,
        "{what}: memory freed during the capture never came back after it ended: {:?}",
        allocator.stats()
    );
}

fn is_capture_refusal<T: std::fmt::Debug>(result: &cuweave_memory::Result<T>) -> bool {
    matches!(
        result,
        Err(MemoryError::Driver(DriverError::Graph(
            GraphError::Capturing { .. }
        )))
    )
}

// ---------------------------------------------------------------------------------------------
// Frees deferred during a capture come back after it
// ---------------------------------------------------------------------------------------------

/// A data loader thread frees `record_stream`'d blocks (PyTorch's `tensor.record_stream(s)`
/// then `del tensor`) while another thread holds a plain capture (no graph pool bound) open:
/// the frees must wait, but once the capture ends they come back: active bytes drain to zero
/// and `empty_cache` returns every segment. `empty_cache` during the capture is refused with
/// `GraphError::Capturing`.
#[test]
fn record_streamed_frees_during_another_threads_plain_capture_come_back_after_it() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let side = Arc::new(stream(ctx));
    let allocator = CachingAllocator::with_driver(ctx);
    let capture = CaptureElsewhere::open(ctx, None);
    for _ in 0..8 {
        let mut block = allocator.allocate(4 * MIB, &s).unwrap();
        block.record_stream(&side).unwrap();
        drop(block);
    }
    assert!(
        is_capture_refusal(&allocator.empty_cache()),
        "empty_cache during a capture must be refused as Capturing"
    );
    drop(capture.close());
    assert_eq!(active_captures(), 0);
    side.synchronize().unwrap();
    drain(&allocator, &s, "record_stream'd raw blocks");
    allocator.empty_cache().unwrap();
    assert_eq!(
        allocator.stats().reserved_bytes.current,
        0,
        "every segment goes back after the capture: {:?}",
        allocator.stats()
    );
}

/// A second model on its own stream makes typed buffers, fills them there, reads them back and
/// drops them while another thread holds a plain capture open. The bytes are exact, and once
/// the capture ends every buffer's memory comes back to the cache (nothing of it was used by
/// the capture).
#[test]
fn typed_buffers_dropped_during_another_threads_plain_capture_come_back_after_it() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let allocator = CachingAllocator::with_driver(ctx);
    let capture = CaptureElsewhere::open(ctx, None);
    for round in 0..8u32 {
        let mut buffer = allocator.buffer::<u32>(MIB, &s).unwrap();
        buffer.fill_async(0x1000 + round, &s).unwrap();
        s.synchronize().unwrap();
        let back = buffer.to_vec().unwrap();
        assert!(back.iter().all(|&v| v == 0x1000 + round), "round {round}");
        drop(buffer);
    }
    drop(capture.close());
    drain(
        &allocator,
        &s,
        "typed buffers of a plain capture's bystander",
    );
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

/// `torch.cuda.graph(g, pool=...)` on one thread while another thread's model makes, fills and
/// drops its own buffers on its own stream. None of them is used by the capture, so none is
/// graph memory: once the capture ends they come back to their cache while the graph lives on
/// and replays (a serving program keeps its graphs for its whole life). The graph is launched
/// to show it is real; after it dies nothing is left either.
#[test]
fn a_bystanders_buffers_are_not_kept_for_the_life_of_a_bound_capture_graph() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let allocator = CachingAllocator::with_driver(ctx);
    let pool = GraphPool::new();
    let capture = CaptureElsewhere::open(ctx, Some(pool.clone()));
    for round in 0..6u32 {
        let mut buffer = allocator.buffer::<u32>(MIB, &s).unwrap();
        buffer.fill_async(round, &s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(buffer.to_vec().unwrap()[MIB - 1], round);
    }
    let captured = capture.close();
    drop(pool);
    let graph = &captured.graph;
    let exec: GraphExec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.launch(&s).unwrap();
    s.synchronize().unwrap();
    // The graph and its pool live on: the bystander's memory must not be theirs.
    drain(
        &allocator,
        &s,
        "a bystander's buffers while the graph lives",
    );
    drop(exec);
    drop(captured);
    drain(&allocator, &s, "after the graph died");
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

/// RMM's `statistics_resource_adaptor` over the driver, with typed buffers made directly on it
/// (no caching allocator), filled on their own stream and dropped while another thread holds a
/// plain capture open: the adaptor may not be asked to free during the capture, but once it has
/// ended every allocation is deallocated (the adaptor's current bytes and allocations drain to
/// zero) while the program goes on allocating through it.
#[test]
fn resource_buffers_dropped_during_a_capture_elsewhere_are_deallocated_after_it() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let stats = Arc::new(StatisticsAdaptor::new(DriverResource::new(ctx)));
    let resource: Arc<dyn MemoryResource> = stats.clone();
    let capture = CaptureElsewhere::open(ctx, None);
    for round in 0..4u32 {
        let mut buffer =
            DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), MIB, &s).unwrap();
        buffer.fill_async(round, &s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(buffer.to_vec().unwrap()[MIB - 1], round);
    }
    drop(capture.close());
    let drained = poll_until(SETTLE, || {
        let mut next = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 256, &s).unwrap();
        next.fill(1).unwrap();
        drop(next);
        stats.stats().current_allocations == 0
    });
    assert!(
        drained,
        "buffers dropped during the capture were never deallocated after it: {:?}",
        stats.stats()
    );
    assert_eq!(stats.stats().current_bytes, 0);
}

// ---------------------------------------------------------------------------------------------
// Bounds while a capture is open elsewhere
// ---------------------------------------------------------------------------------------------

/// A data loader's loop (allocate a 4 MiB batch on its stream, fill it, read one word, drop it)
/// runs 256 times while another thread holds a capture open. In PyTorch the same block serves
/// every step; here the reserved memory must stay bounded too (at most 64 MiB, where a leak
/// would reach 1 GiB), and all of it comes back after the capture.
#[test]
fn a_loaders_loop_during_a_long_capture_elsewhere_stays_bounded() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let allocator = CachingAllocator::with_driver(ctx);
    let capture = CaptureElsewhere::open(ctx, None);
    let mut worst = 0;
    for step in 0..256u32 {
        let mut batch = allocator.buffer::<u32>(MIB, &s).unwrap();
        batch.fill_async(step, &s).unwrap();
        let mut word = [0u32; 1];
        batch.copy_range_to_host(MIB / 2, &mut word).unwrap();
        assert_eq!(word[0], step, "step {step}");
        drop(batch);
        worst = worst.max(allocator.stats().reserved_bytes.current);
    }
    let during = allocator.stats();
    drop(capture.close());
    assert!(
        worst <= 64 * MIB,
        "256 steps of a 4 MiB batch reserved {worst} bytes during a capture elsewhere: {during:?}"
    );
    drain(&allocator, &s, "the loader's batches");
}

/// Blocks freed with `record_stream` while their side stream is held behind a gate are
/// pending when another thread's capture begins. During the capture the allocator polls
/// nothing: new requests on the same stream never get a pending block (the gate still holds
/// its reader). After the gate opens and the capture ends, the pending blocks settle and the
/// next requests are served from them without a new segment.
#[test]
fn pending_frees_from_before_a_capture_elsewhere_settle_after_it_and_are_reused() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let s = stream(ctx);
    let side = Arc::new(stream(ctx));
    let gate = Gate::new(ctx);
    gate.hold(&kernels, &side);
    let allocator = CachingAllocator::with_driver(ctx);
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut block = allocator.allocate(4 * MIB, &s).unwrap();
        held.push(block.ptr());
        block.record_stream(&side).unwrap();
        drop(block);
    }
    let capture = CaptureElsewhere::open(ctx, None);
    let mut during = Vec::new();
    for _ in 0..4 {
        let block = allocator.allocate(4 * MIB, &s).unwrap();
        assert!(
            !held.contains(&block.ptr()),
            "a block the gated side stream still reads was handed out during a capture"
        );
        during.push(block);
    }
    drop(during);
    gate.open();
    side.synchronize().unwrap();
    drop(capture.close());
    drain(&allocator, &s, "blocks pending since before the capture");
    let misses = allocator.stats().cache_misses;
    let again: Vec<_> = (0..8)
        .map(|_| allocator.allocate(4 * MIB, &s).unwrap())
        .collect();
    assert_eq!(
        allocator.stats().cache_misses,
        misses,
        "after the capture the settled blocks serve the requests: {:?}",
        allocator.stats()
    );
    drop(again);
}

/// A long-lived block (a KV cache) read by a fresh stream per request, each recorded with
/// `record_stream`, while another thread holds a capture open: nothing is retired during the
/// capture, but once it ends the next new stream's record retires every finished one (their
/// handles die with the block's list, seen through weak handles).
#[test]
fn streams_recorded_during_a_capture_elsewhere_are_retired_after_it() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let allocator = CachingAllocator::with_driver(ctx);
    let mut cache = allocator.allocate(MIB, &s).unwrap();
    let capture = CaptureElsewhere::open(ctx, None);
    let mut recorded: Vec<Weak<Stream>> = Vec::new();
    for _ in 0..64 {
        let request = Arc::new(stream(ctx));
        cache.record_stream(&request).unwrap();
        recorded.push(Arc::downgrade(&request));
    }
    drop(capture.close());
    let last = Arc::new(stream(ctx));
    cache.record_stream(&last).unwrap();
    let alive = recorded
        .iter()
        .filter(|weak| weak.upgrade().is_some())
        .count();
    assert_eq!(
        alive, 0,
        "{alive} of 64 finished request streams recorded during the capture were never retired"
    );
    drop(cache);
    last.synchronize().unwrap();
    drain(&allocator, &s, "the recorded block");
}

/// Pinned staging buffers (a pinned-memory data loader) whose copies to the device finished
/// are dropped while another thread holds a capture open (their fences are then queried in
/// relaxed capture mode, which breaks no capture). After the capture, every block is ready at
/// the next get and the following gets are all hits: the pool stops growing.
#[test]
fn pinned_staging_dropped_during_a_capture_elsewhere_is_reused_after_it() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let pool = PinnedPool::new(ctx);
    let allocator = CachingAllocator::with_driver(ctx);
    let mut device = allocator.buffer::<u32>(1 << 16, &s).unwrap();
    let capture = CaptureElsewhere::open(ctx, None);
    for round in 0..4u32 {
        let mut staging = pool.buffer::<u32>(1 << 16).unwrap();
        staging.fill(round).unwrap();
        device.copy_from_async(&staging, &s).unwrap();
        s.synchronize().unwrap();
        drop(staging);
    }
    drop(capture.close());
    assert_eq!(device.to_vec().unwrap()[7], 3);
    assert_eq!(
        pool.stats().allocated_blocks,
        0,
        "every staging buffer went back to the pool: {:?}",
        pool.stats()
    );
    // The first get after the capture polls the fences (all passed long ago).
    let ready = poll_until(SETTLE, || {
        drop(pool.buffer::<u32>(1 << 16).unwrap());
        pool.stats().pending_blocks == 0
    });
    assert!(ready, "pinned blocks stayed pending: {:?}", pool.stats());
    let before = pool.stats();
    for round in 0..16u32 {
        let mut staging = pool.buffer::<u32>(1 << 16).unwrap();
        staging.fill(round).unwrap();
        device.copy_from_async(&staging, &s).unwrap();
        s.synchronize().unwrap();
    }
    let after = pool.stats();
    assert_eq!(
        after.misses, before.misses,
        "after the capture the pool pinned again: {before:?} -> {after:?}"
    );
    assert_eq!(after.pinned_bytes, before.pinned_bytes);
}

/// A worker's stream is dropped with its cached segments (a finished request's stream), and
/// another stream misses during another thread's capture (the dropped stream's end is not
/// queried then). After the capture, the next miss adopts the dropped stream's segment: the
/// request is served without reserving more.
#[test]
fn a_dropped_streams_segment_is_adopted_by_the_first_miss_after_a_capture_elsewhere() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let allocator = CachingAllocator::with_driver(ctx);
    {
        let worker = stream(ctx);
        let mut buffer = allocator.buffer::<u32>(4 * MIB / 4, &worker).unwrap();
        buffer.fill_async(7, &worker).unwrap();
        worker.synchronize().unwrap();
        drop(buffer);
        // Settle the buffer's use on the normal path, so its segment is wholly free.
        drain(&allocator, &worker, "the worker's buffer");
    }
    let reserved_by_worker = allocator.stats().reserved_bytes.current;
    assert!(reserved_by_worker >= 4 * MIB);
    let s = stream(ctx);
    let capture = CaptureElsewhere::open(ctx, None);
    // A small miss during the capture (its own small segment; the large one stays unasked).
    let during = allocator.allocate(4096, &s).unwrap();
    drop(during);
    drop(capture.close());
    let reserved = allocator.stats().reserved_bytes.current;
    let mut taken = Vec::new();
    let mut adopted = false;
    // Ask for what the dropped stream's segment can serve; one of the requests must land there
    // rather than in a new segment.
    for _ in 0..4 {
        taken.push(allocator.allocate(4 * MIB, &s).unwrap());
        if allocator.stats().reserved_bytes.current == reserved {
            adopted = true;
            break;
        }
    }
    assert!(
        adopted,
        "no miss after the capture adopted the dropped stream's segment: {:?}",
        allocator.stats()
    );
    drop(taken);
}

/// 10^4 small tensors on one stream each marked used by a side stream (`record_stream`) while
/// another thread holds a capture open, then 10^4 more after it ends. During the capture the
/// frees wait (nothing polls); after it the pending list drains and the cache stops growing:
/// the second half adds no segment after its first few hundred steps.
#[test]
fn ten_thousand_record_stream_frees_around_a_capture_elsewhere_settle_and_stop_growing() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let side = Arc::new(stream(ctx));
    let allocator = CachingAllocator::with_driver(ctx);
    let churn = |count: usize| {
        for _ in 0..count {
            let mut block = allocator.allocate(4096, &s).unwrap();
            block.record_stream(&side).unwrap();
            drop(block);
        }
    };
    let capture = CaptureElsewhere::open(ctx, None);
    churn(10_000);
    drop(capture.close());
    side.synchronize().unwrap();
    churn(500);
    let segments = allocator.stats().segments.current;
    churn(9_500);
    let stats = allocator.stats();
    assert_eq!(
        stats.segments.current, segments,
        "the cache kept growing after the capture: {stats:?}"
    );
    side.synchronize().unwrap();
    drain(&allocator, &s, "10^4 record_stream frees");
}
