//! Programs written the way PyTorch users drive streams, written against the public API of
//! this crate: a profiler left on beside a slow batch stream, a copy/compute ping-pong over
//! 10^5 rounds, host callbacks queued from many threads on pooled streams, `on_all_complete`
//! every step, load-balanced and priority pools with real queued work (past the marker cap,
//! and behind a replaying graph), `wait_for_any_ready` from several threads, one CUDA graph
//! replayed by eight server threads on different pool streams, a captured step whose scratch
//! comes from the stream-ordered allocator, memory handed around a ring of streams, a profiler
//! fed by eight threads, and a data-parallel step with a barrier on both sides of its
//! reduction.
//!
//! Ordering is proven by bytes: kernels that spin before they write, and order-sensitive
//! transforms whose exact result the host recomputes. Every GPU test takes `serial()`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use cuweave_driver::{Context, InstantiateOptions};
use cuweave_memory::caching::CachingAllocator;
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_stream::capture::CaptureOptions;
use cuweave_stream::timing::DEFAULT_PENDING_SPANS;
use cuweave_stream::{
    AllocationStrategy, MultiStreamCoordinator, OperationKind, PriorityStream,
    StreamOrderedAllocator, StreamPool, StreamPoolConfig, StreamPriority, StreamProfiler,
    WorkloadType,
};
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip_under_sanitizer};

mod common;
use common::Kit;
use common::mapped::Mapped;
use cuweave_test_support::resident_bytes;

const MS: u64 = 1_000_000;
const US: u64 = 1_000;
/// Elements of the graph tests' tensors.
const G: usize = 1 << 14;

/// `u32` words of mapped pinned memory: kernels store into them through `device(i)`, the host
/// reads and writes them with volatile accesses while kernels may run. Dropping it opens
/// Queues a `wait_u32` gate on `stream` that holds it until word 0 of `gate` becomes 1 (or
/// 10 s pass), counted as one operation.
fn hold(kernels: &TestKernels, stream: &PriorityStream, gate: &Mapped) {
    let flag = gate.device(0);
    // SAFETY: `flag` is a mapped word of `gate`, which outlives the kernel (the gate is opened
    // before it is freed, and freeing pinned memory waits for the device).
    stream
        .launch(|s| unsafe { kernels.wait_u32(s, flag, 1, 10_000 * MS) })
        .unwrap();
}

fn normal_stream(context: &Arc<Context>) -> Arc<PriorityStream> {
    Arc::new(PriorityStream::new(context, StreamPriority::Normal).unwrap())
}

/// What the order-sensitive transform `x -> x * mul + add` gives, as the kernel computes it.
fn affine(x: u32, mul: u32, add: u32) -> u32 {
    x.wrapping_mul(mul).wrapping_add(add)
}

/// Small integers, so that `2x + 1` is exact in `f32`.
fn input(round: usize) -> Vec<f32> {
    (0..G).map(|j| ((round * 7 + j) % 1000) as f32).collect()
}

fn assert_bits(actual: &[f32], expected: impl Fn(usize) -> f32, what: &str) {
    assert_eq!(actual.len(), G, "{what}");
    if let Some((i, value)) = actual
        .iter()
        .enumerate()
        .find(|(i, value)| value.to_bits() != expected(*i).to_bits())
    {
        panic!("{what}: element {i} is {value}, expected {}", expected(i));
    }
}

/// A profiler left on beside a slow batch job: one 1.5 s operation on a low-priority stream is
/// profiled first, then more than `DEFAULT_PENDING_SPANS` short operations on a high-priority
/// stream, which is synchronised every 512 of them. The docs promise an operation is left
/// untimed only if no pending one has finished; here thousands have (the fast stream is idle),
/// so none of the fast operations may be skipped, and the report must hold all of them.
#[test]
fn a_slow_batch_stream_does_not_leave_a_fast_streams_profiled_operations_untimed() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "a_slow_batch_stream_does_not_leave_a_fast_streams_profiled_operations_untimed",
        "the fast stream must run beside the slow one",
    ) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    let slow = PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap();
    let fast = PriorityStream::new(&gpu.context, StreamPriority::High).unwrap();
    profiler
        .profile(&slow, "batch", OperationKind::KernelLaunch, 0, |s| {
            s.launch(|raw| kernels.spin_ns(raw, 1_500 * MS))
        })
        .unwrap();
    let steps = DEFAULT_PENDING_SPANS + 256;
    let mut first_skip = None;
    for i in 0..steps {
        profiler
            .profile(&fast, "step", OperationKind::KernelLaunch, 0, |s| {
                s.launch(|raw| kernels.spin_ns(raw, US))
            })
            .unwrap();
        if first_skip.is_none() && profiler.skipped() > 0 {
            first_skip = Some(i);
        }
        if i % 512 == 511 {
            fast.synchronize().unwrap();
        }
    }
    fast.synchronize().unwrap();
    let slow_still_running = !slow.is_ready().unwrap();
    let skipped = profiler.skipped();
    let report = profiler.report().unwrap();
    assert!(
        slow_still_running,
        "premise: the batch job must still run while the fast steps are profiled"
    );
    assert_eq!(
        skipped, 0,
        "{skipped} fast operations went untimed (the first at step {first_skip:?}) although \
         every earlier fast operation had finished: the slow stream's pending span blocks the \
         harvest of every other stream's"
    );
    let fast_report = report
        .streams
        .iter()
        .find(|stream| stream.stream == fast.id())
        .expect("the fast stream is in the report");
    assert_eq!(fast_report.operations, steps as u64);
    assert_eq!(report.combined.operations, steps as u64 + 1);
}

/// The copy/compute alternation of a double-buffered loop, 10^5 times: each round one stream
/// waits for the other (`add_dependency`, always accepted) and applies an order-sensitive
/// transform from one buffer into the other; some rounds spin first, so an unordered round
/// would be overtaken. The result is exact, the dependency graph holds two edges (its cycle is
/// a diagnostic), and events, markers and resident memory stay flat.
#[test]
fn a_hundred_thousand_ping_pong_dependencies_stay_exact_and_bounded() {
    const ROUNDS: usize = 100_000;
    const N: usize = 256;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let (a, b) = (normal_stream(&gpu.context), normal_stream(&gpu.context));
    let coordinator = MultiStreamCoordinator::new();
    let buffers = [
        DeviceBuffer::<u32>::from_slice(&gpu.context, &[1u32; N]).unwrap(),
        DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap(),
    ];
    let ptrs = [buffers[0].device_ptr(), buffers[1].device_ptr()];
    let unfinished = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    let unfinished_ptr = unfinished.device_ptr();
    let events = a.event_pool().clone();
    let created = || {
        let counters = events.counters();
        counters.created_regular + counters.created_timing
    };
    let created_before = created();
    let mut rss_warm = 0;
    let mut expected = 1u32;
    for round in 0..ROUNDS {
        let (stream, other) = if round % 2 == 0 { (&a, &b) } else { (&b, &a) };
        coordinator.add_dependency(stream, other).unwrap();
        if round % 997 == 0 {
            stream.launch(|s| kernels.spin_ns(s, 100 * US)).unwrap();
        }
        let (mul, add) = (3 + (round % 5) as u32 * 2, (round % 7) as u32 + 1);
        let (src, dst) = (ptrs[round % 2], ptrs[(round + 1) % 2]);
        // SAFETY: both buffers hold N u32s and `unfinished` one, alive past the final
        // synchronisation; src and dst are different buffers; only these launches touch them.
        stream
            .launch(|s| unsafe {
                event_kernels.transform_checked_u32(s, src, dst, N, mul, add, 0, unfinished_ptr)
            })
            .unwrap();
        expected = affine(expected, mul, add);
        if round == ROUNDS / 10 {
            rss_warm = resident_bytes();
        }
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    let rss_end = resident_bytes();
    let result = buffers[ROUNDS % 2].to_vec().unwrap();
    assert!(
        result.iter().all(|&v| v == expected),
        "a round ran out of order: {:#x} != {expected:#x}",
        result[0]
    );
    assert_eq!(coordinator.stats().dependencies, ROUNDS as u64);
    assert_eq!(
        coordinator.dependencies().len(),
        2,
        "the diagnostic graph grew past the two stream pairs"
    );
    assert!(coordinator.has_cycles(), "ping-pong is a cycle, reported");
    assert_eq!(coordinator.cycles().len(), 1);
    let made = created() - created_before;
    assert!(
        made <= 1024,
        "{made} events created for 10^5 rounds (markers are capped at 256 per stream)"
    );
    assert_eq!(a.outstanding_work().unwrap(), 0);
    assert_eq!(b.outstanding_work().unwrap(), 0);
    assert!(
        rss_end <= rss_warm + (16 << 20),
        "resident memory grew from {rss_warm} to {rss_end} bytes"
    );
    coordinator.create_barrier().unwrap();
    assert!(
        !coordinator.has_cycles(),
        "a barrier starts the graph afresh"
    );
}

/// Eight request threads take streams from one pool (round robin, and by priority) and queue
/// host callbacks (half through `MultiStreamCoordinator::on_stream_complete`) between small
/// kernels. Every callback runs exactly once, on each stream in the order it was queued,
/// without a synchronize being needed to trigger it; none is reported failed.
#[test]
fn callbacks_queued_from_eight_threads_on_pool_streams_run_once_each_in_stream_order() {
    const THREADS: usize = 8;
    const PER_THREAD: usize = 250;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let coordinator = MultiStreamCoordinator::new();
    // One lock per stream makes "queue order" well defined: a sequence number is taken and the
    // callback queued under it.
    let order: HashMap<u64, Mutex<u64>> = pool
        .streams()
        .map(|stream| (stream.id(), Mutex::new(0)))
        .collect();
    let log: Arc<Mutex<Vec<(u64, u64)>>> = Arc::new(Mutex::new(Vec::new()));
    let ran = Arc::new(AtomicUsize::new(0));
    let callbacks_before: u64 = pool
        .streams()
        .map(|stream| stream.metrics().unwrap().callbacks)
        .sum();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (pool, order, log, ran, kernels, coordinator) =
                (&pool, &order, &log, &ran, &kernels, &coordinator);
            scope.spawn(move || {
                for i in 0..PER_THREAD {
                    let stream = if t % 2 == 0 {
                        pool.get_stream().unwrap()
                    } else {
                        let level = [
                            StreamPriority::High,
                            StreamPriority::Normal,
                            StreamPriority::Low,
                        ][i % 3];
                        pool.get_priority_stream(level).unwrap()
                    };
                    if i % 25 == 0 {
                        stream.launch(|s| kernels.spin_ns(s, 50 * US)).unwrap();
                    }
                    let mut next = order[&stream.id()].lock().unwrap();
                    let entry = (stream.id(), *next);
                    *next += 1;
                    let (log, ran) = (Arc::clone(log), Arc::clone(ran));
                    let callback = move || {
                        log.lock().unwrap().push(entry);
                        ran.fetch_add(1, Ordering::SeqCst);
                    };
                    if i % 2 == 0 {
                        stream.add_callback(callback).unwrap();
                    } else {
                        coordinator.on_stream_complete(&stream, callback).unwrap();
                    }
                    drop(next);
                }
            });
        }
    });
    let total = THREADS * PER_THREAD;
    // The callbacks run when the GPU gets there, not at a synchronize: wait for them alone.
    let deadline = Instant::now() + Duration::from_secs(10);
    while ran.load(Ordering::SeqCst) < total && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        ran.load(Ordering::SeqCst),
        total,
        "callbacks run exactly once"
    );
    let log = log.lock().unwrap();
    let mut seen: HashMap<u64, u64> = HashMap::new();
    for &(stream, sequence) in log.iter() {
        let expected = seen.entry(stream).or_insert(0);
        assert_eq!(
            sequence, *expected,
            "stream {stream}: callback {sequence} ran where {expected} was due"
        );
        *expected += 1;
    }
    for stream in pool.streams() {
        stream.synchronize().unwrap();
        assert!(stream.callback_failures().is_empty());
        assert_eq!(
            seen.get(&stream.id()).copied().unwrap_or(0),
            *order[&stream.id()].lock().unwrap()
        );
    }
    let callbacks_after: u64 = pool
        .streams()
        .map(|stream| stream.metrics().unwrap().callbacks)
        .sum();
    assert_eq!(callbacks_after - callbacks_before, total as u64);
}

/// A step number and the stream flags its hook saw.
type Hook = (u32, Vec<u32>);

/// A training loop's "step done" hook: every step each of four streams spins a different time
/// and stores the step number into its own mapped flag, then `on_all_complete` queues the
/// hook. 300 steps: each hook runs exactly once, and when it runs every stream's flag has
/// reached its step. With no stream the hook runs at once.
#[test]
fn on_all_complete_runs_once_per_step_after_every_streams_work() {
    const STREAMS: usize = 4;
    const STEPS: u32 = 300;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let streams: Vec<_> = (0..STREAMS).map(|_| normal_stream(&gpu.context)).collect();
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let flags = Arc::new(Mapped::new(&gpu.context, STREAMS));
    let hooks: Arc<Mutex<Vec<Hook>>> = Arc::new(Mutex::new(Vec::new()));
    for step in 1..=STEPS {
        for (k, stream) in streams.iter().enumerate() {
            let spin = ((k as u64 + u64::from(step)) % STREAMS as u64) * 50 * US;
            let flag = flags.device(k);
            // SAFETY: a mapped word of `flags`, which outlives every stream's work (the streams
            // are synchronised before it is dropped).
            stream
                .launch(|s| unsafe { kernels.spin_then_store_u32(s, spin, flag, step) })
                .unwrap();
        }
        let (flags, hooks) = (Arc::clone(&flags), Arc::clone(&hooks));
        coordinator
            .on_all_complete(move || {
                let seen = (0..STREAMS).map(|k| flags.read(k)).collect();
                hooks.lock().unwrap().push((step, seen));
            })
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while hooks.lock().unwrap().len() < STEPS as usize && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    let mut hooks = hooks.lock().unwrap().clone();
    assert_eq!(hooks.len(), STEPS as usize, "one hook per step");
    hooks.sort_by_key(|(step, _)| *step);
    for (i, (step, seen)) in hooks.iter().enumerate() {
        assert_eq!(*step, i as u32 + 1, "a step's hook ran twice or never");
        assert!(
            seen.iter().all(|&flag| flag >= *step),
            "step {step}'s hook ran before every stream finished it: {seen:?}"
        );
    }
    let empty = MultiStreamCoordinator::new();
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&ran);
    empty
        .on_all_complete(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

/// Queued work that the strategies must read from the GPU: normal streams hold 300, 10, 0 and
/// 5 operations behind a closed gate (300 is past the 256 markers a stream keeps). The counts
/// read back exactly; eight threads asking a load-balanced pool all get the idle stream;
/// `Priority` walks high, normal, low for an idle stream as they fill, and `wait_for_any_ready`
/// times out while every stream is held. Opened, everything drains to zero.
#[test]
fn strategies_read_queued_work_behind_a_gate_past_the_marker_cap() {
    let gpu = require_gpu!();
    let _serial = serial();
    if !gpu.device.can_map_host_memory().unwrap() {
        cuweave_test_support::skip(
            "strategies_read_queued_work_behind_a_gate_past_the_marker_cap",
            "the device cannot map host memory",
        );
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced).with_counts(1, 4, 1),
    )
    .unwrap();
    let gate = Mapped::new(&gpu.context, 1);
    let normal = pool.streams_of(StreamPriority::Normal);
    let high = &pool.streams_of(StreamPriority::High)[0];
    let low = &pool.streams_of(StreamPriority::Low)[0];
    for (k, count) in [(0usize, 300u64), (1, 10), (3, 5)] {
        hold(&kernels, &normal[k], &gate);
        for _ in 1..count {
            normal[k].launch(|s| kernels.spin_ns(s, US)).unwrap();
        }
    }
    let loads: Vec<u64> = normal
        .iter()
        .map(|stream| stream.outstanding_work().unwrap())
        .collect();
    assert_eq!(loads, vec![300, 10, 0, 5], "queued work read from the GPU");
    let idle = normal[2].id();
    std::thread::scope(|scope| {
        for _ in 0..8 {
            let pool = &pool;
            scope.spawn(move || {
                for _ in 0..50 {
                    assert_eq!(
                        pool.get_stream().unwrap().id(),
                        idle,
                        "LoadBalanced handed out a stream with queued work"
                    );
                }
            });
        }
    });

    pool.set_strategy(AllocationStrategy::Priority);
    assert_eq!(pool.get_stream().unwrap().id(), high.id(), "high is idle");
    hold(&kernels, high, &gate);
    assert_eq!(
        pool.get_stream().unwrap().id(),
        idle,
        "then the idle normal"
    );
    hold(&kernels, &normal[2], &gate);
    assert_eq!(pool.get_stream().unwrap().id(), low.id(), "then low");
    hold(&kernels, low, &gate);
    assert_eq!(
        pool.get_stream().unwrap().id(),
        high.id(),
        "none idle: the least loaded high-priority stream"
    );
    assert!(!pool.has_ready_streams().unwrap());
    let started = Instant::now();
    assert!(
        pool.wait_for_any_ready(Duration::from_millis(20))
            .unwrap()
            .is_none()
    );
    assert!(started.elapsed() >= Duration::from_millis(20));

    gate.write(0, 1);
    for stream in pool.streams() {
        stream.synchronize().unwrap();
        assert_eq!(stream.outstanding_work().unwrap(), 0);
    }
    let ready = pool
        .wait_for_any_ready(Duration::from_secs(1))
        .unwrap()
        .expect("every stream is ready");
    assert_eq!(ready.id(), high.id(), "pool order: high first");
}

/// Several server threads wait for "any stream free" at once: those with a short timeout get
/// `None` after it, those with a long one get the stream whose spin ends first (not one still
/// spinning). Meanwhile eight threads ask for the device's process-wide pool and all get the
/// same one.
#[test]
fn wait_for_any_ready_from_several_threads_returns_the_first_free_stream_or_none() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "wait_for_any_ready_from_several_threads_returns_the_first_free_stream_or_none",
        "the streams' spins must run at once",
    ) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::default().with_counts(1, 2, 1),
    )
    .unwrap();
    let spins: Vec<u64> = vec![400, 120, 250, 400];
    let streams: Vec<_> = pool.streams().cloned().collect();
    for (stream, ms) in streams.iter().zip(&spins) {
        stream.launch(|s| kernels.spin_ns(s, ms * MS)).unwrap();
    }
    let first = streams[1].id();
    let start = Barrier::new(6);
    let (waits, pools) = std::thread::scope(|scope| {
        let waits: Vec<_> = [30u64, 30, 5_000, 5_000]
            .into_iter()
            .map(|timeout| {
                let (pool, start) = (&pool, &start);
                scope.spawn(move || {
                    start.wait();
                    let began = Instant::now();
                    let found = pool
                        .wait_for_any_ready(Duration::from_millis(timeout))
                        .unwrap();
                    (timeout, found.map(|stream| stream.id()), began.elapsed())
                })
            })
            .collect();
        let pools: Vec<_> = (0..2)
            .map(|_| {
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    (0..4)
                        .map(|_| StreamPool::for_device(gpu.device).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        (
            waits
                .into_iter()
                .map(|handle| handle.join().unwrap())
                .collect::<Vec<_>>(),
            pools
                .into_iter()
                .flat_map(|handle| handle.join().unwrap())
                .collect::<Vec<_>>(),
        )
    });
    for (timeout, found, took) in waits {
        if timeout == 30 {
            assert_eq!(found, None, "every stream spins for 120 ms or more");
            assert!(took >= Duration::from_millis(30), "{took:?}");
            assert!(took < Duration::from_millis(110), "{took:?}");
        } else {
            assert_eq!(found, Some(first), "not the stream that finished first");
            assert!(took < Duration::from_millis(240), "{took:?}");
        }
    }
    assert!(
        pools.windows(2).all(|pair| Arc::ptr_eq(&pair[0], &pair[1])),
        "StreamPool::for_device gave different pools to racing threads"
    );
    for stream in &streams {
        stream.synchronize().unwrap();
    }
}

/// One captured step (`out = 2 * in + 1`, its scratch from the capture's private pool, a
/// 100 µs spin inside) replayed by eight server threads, each on the pool stream it is given.
/// A lock is held only while a request queues its upload, launch and download; the waits
/// happen outside it, so the next request's upload (on another stream) races the previous
/// launch, and its launch races the previous download. Every request reads back exactly its
/// own answer.
#[test]
fn one_graph_replayed_by_eight_threads_on_pool_streams_answers_every_request_exactly() {
    const THREADS: usize = 8;
    const REQUESTS: usize = 40;
    let gpu = require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let origin = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let mut static_in = allocator.buffer::<f32>(G, origin.stream()).unwrap();
    let mut static_out = allocator.buffer::<f32>(G, origin.stream()).unwrap();
    origin
        .copy_from_host(&mut static_in, input(0))
        .unwrap()
        .wait()
        .unwrap();

    let capture = origin.begin_capture(CaptureOptions::default()).unwrap();
    let mut scratch = allocator.buffer::<f32>(G, origin.stream()).unwrap();
    origin
        .enqueue(OperationKind::KernelLaunch, 0, |s| {
            kit.fill(s, &mut scratch, 1.0)
        })
        .unwrap();
    origin.launch(|s| kit.test.spin_ns(s, 100 * US)).unwrap();
    origin
        .enqueue(OperationKind::KernelLaunch, 0, |s| {
            kit.saxpy(s, 2.0, &static_in, &mut scratch)
        })
        .unwrap();
    origin.copy_buffer(&mut static_out, &scratch).unwrap();
    drop(scratch);
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    let tensors = Mutex::new((static_in, static_out));
    let answered = AtomicUsize::new(0);
    let launches_before: u64 = pool
        .streams()
        .map(|stream| stream.metrics().unwrap().graph_launches)
        .sum();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (pool, tensors, exec, answered) = (&pool, &tensors, &exec, &answered);
            scope.spawn(move || {
                for r in 0..REQUESTS {
                    let request = 1 + t * 1000 + r;
                    let x = input(request);
                    let (upload, download) = {
                        let mut guard = tensors.lock().unwrap();
                        let (static_in, static_out) = &mut *guard;
                        let stream = match t % 4 {
                            0 => pool.get_priority_stream(StreamPriority::High).unwrap(),
                            1 => pool.get_priority_stream(StreamPriority::Low).unwrap(),
                            _ => pool.get_stream().unwrap(),
                        };
                        let upload = stream.copy_from_host(static_in, x.clone()).unwrap();
                        stream.launch_graph(exec).unwrap();
                        let download = stream.copy_to_host(&*static_out, vec![0f32; G]).unwrap();
                        (upload, download)
                    };
                    let host = download.wait().unwrap();
                    drop(upload.wait().unwrap());
                    assert_bits(
                        &host,
                        |i| 2.0 * x[i] + 1.0,
                        &format!("thread {t}, request {r}"),
                    );
                    answered.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    assert_eq!(answered.load(Ordering::SeqCst), THREADS * REQUESTS);
    let launches_after: u64 = pool
        .streams()
        .map(|stream| stream.metrics().unwrap().graph_launches)
        .sum();
    assert_eq!(
        launches_after - launches_before,
        (THREADS * REQUESTS) as u64
    );
    for stream in pool.streams() {
        stream.synchronize().unwrap();
    }
    drop(exec);
    drop(graph);
    drop(tensors);
}

/// `cudaMallocAsync`-backed scratch inside a graph (PyTorch's `backend:cudaMallocAsync` with
/// `torch.cuda.graph`): a step captured on a pool stream takes a typed buffer and a raw
/// receipt from the stream-ordered allocator, uses and frees both inside the capture; the
/// graph replays 500 new inputs exactly; afterwards the allocator serves eager work as before
/// and its books are clean.
#[test]
fn a_step_with_stream_ordered_scratch_captured_on_a_pool_stream_replays_500_inputs() {
    const N: usize = 1 << 14;
    let gpu = require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let origin = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let allocator = StreamOrderedAllocator::default();
    let mut static_in = DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap();
    let mut static_out = DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap();
    let marker = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    let marker_ptr = marker.device_ptr();

    let step = |static_in: &DeviceBuffer<u32>, static_out: &mut DeviceBuffer<u32>| {
        let mut scratch = allocator.buffer::<u32>(&origin, N).unwrap();
        origin.copy_buffer(&mut scratch, static_in).unwrap();
        origin
            .enqueue(OperationKind::KernelLaunch, 0, |s| {
                kit.increment(s, &mut scratch)
            })
            .unwrap();
        origin.copy_buffer(static_out, &scratch).unwrap();
    };
    // Warm-up, eagerly, as the torch recipe does: it also makes the allocator's pool.
    step(&static_in, &mut static_out);
    let warm = origin
        .copy_to_host(&static_out, vec![0u32; N])
        .unwrap()
        .wait()
        .unwrap();
    assert!(warm.iter().all(|&v| v == 1), "the eager step");

    let capture = origin.begin_capture(CaptureOptions::default()).unwrap();
    step(&static_in, &mut static_out);
    let receipt = allocator.allocate_for_stream(&origin, 4096).unwrap();
    let raw = allocator.device_ptr(&receipt).unwrap();
    // SAFETY: the receipt holds 4096 bytes on `origin` until its free below, inside the same
    // capture; `marker` holds one u32 and outlives the graph's launches.
    origin
        .launch(|s| unsafe { kit.test.fill_u32(s, raw, 7, 1024) })
        .unwrap();
    // SAFETY: as above: one u32 of the receipt to `marker`.
    origin
        .enqueue(OperationKind::Copy, 4, |s| unsafe {
            cuweave_driver::memory::copy_dtod_async(marker_ptr, raw, 4, s)
        })
        .unwrap();
    allocator.free(receipt).unwrap();
    let graph = capture.finish().unwrap();
    assert_eq!(allocator.outstanding(), 0);
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    for round in 1..=500u32 {
        let x: Vec<u32> = (0..N as u32)
            .map(|j| j.wrapping_mul(round) ^ round)
            .collect();
        origin
            .copy_from_host(&mut static_in, x.clone())
            .unwrap()
            .wait()
            .unwrap();
        origin.launch_graph(&exec).unwrap();
        if round % 50 == 0 || round == 1 {
            let host = origin
                .copy_to_host(&static_out, vec![0u32; N])
                .unwrap()
                .wait()
                .unwrap();
            let expected: Vec<u32> = x.iter().map(|v| v.wrapping_add(1)).collect();
            assert!(host == expected, "replay {round} read back wrong bytes");
        }
    }
    origin.synchronize().unwrap();
    assert_eq!(marker.to_vec().unwrap(), vec![7]);
    drop(exec);
    drop(graph);
    origin.synchronize().unwrap();

    // Eager use of the same allocator afterwards.
    let mut eager = allocator.buffer::<u32>(&origin, N).unwrap();
    origin.fill(&mut eager, 0xA5A5_A5A5).unwrap();
    let host = origin
        .copy_to_host(&eager, vec![0u32; N])
        .unwrap()
        .wait()
        .unwrap();
    assert!(host.iter().all(|&v| v == 0xA5A5_A5A5));
    drop(eager);
    let stats = allocator.stats();
    assert_eq!((stats.allocations, stats.frees), (1, 1), "{stats:?}");
    assert_eq!(allocator.outstanding(), 0);
    origin.synchronize().unwrap();
    allocator.trim().unwrap();
}

/// Stream-ordered memory handed around a ring of four streams: allocated and written on one,
/// transformed on the next (after a recorded dependency), checksummed on the one after that
/// (which depends on the second, so it may use the memory transitively), then freed. The free
/// must wait for both users, or the next round, allocating on another stream, gets the block
/// while the checksum (delayed by a spin) still reads it. 2000 rounds: every sum exact, the
/// pool and the books bounded.
#[test]
fn memory_handed_around_a_ring_of_four_streams_is_freed_only_after_every_user() {
    const STREAMS: usize = 4;
    const ROUNDS: usize = 2000;
    const N: usize = 1 << 14;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let streams: Vec<_> = (0..STREAMS).map(|_| normal_stream(&gpu.context)).collect();
    let allocator = StreamOrderedAllocator::default();
    let sums = DeviceBuffer::<u64>::zeroed(&gpu.context, ROUNDS).unwrap();
    let sums_ptr = sums.device_ptr();
    for round in 0..ROUNDS {
        let owner = &streams[round % STREAMS];
        let first = &streams[(round + 1) % STREAMS];
        let second = &streams[(round + 2) % STREAMS];
        let block = allocator.allocate_for_stream(owner, N * 4).unwrap();
        let ptr = allocator.device_ptr(&block).unwrap();
        let value = round as u32;
        // SAFETY: the block holds N u32s; it is used on `owner`, then on `first` and `second`
        // after recorded dependencies, and freed only through the allocator below.
        owner
            .launch(|s| unsafe { kernels.fill_u32(s, ptr, value, N) })
            .unwrap();
        allocator.add_stream_dependency(first, owner).unwrap();
        if round % 8 == 0 {
            first.launch(|s| kernels.spin_ns(s, 200 * US)).unwrap();
        }
        // SAFETY: as above; `first` waits for the fill.
        first
            .launch(|s| unsafe { kernels.increment_u32(s, ptr, N) })
            .unwrap();
        allocator.add_stream_dependency(second, first).unwrap();
        if round % 8 == 4 {
            second.launch(|s| kernels.spin_ns(s, 300 * US)).unwrap();
        }
        let out = sums_ptr + 8 * round as u64;
        // SAFETY: as above; `second` waits for the increment; `out` is this round's u64 of
        // `sums`, which outlives the final synchronisation.
        second
            .launch(|s| unsafe { kernels.checksum_u32(s, ptr, N, out) })
            .unwrap();
        allocator.free(block).unwrap();
        if round % 250 == 249 {
            // A training loop's periodic sync (to log): bounds what is in flight.
            for stream in &streams {
                stream.synchronize().unwrap();
            }
        }
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    let sums = sums.to_vec().unwrap();
    for (round, sum) in sums.iter().enumerate() {
        assert_eq!(
            *sum,
            N as u64 * (round as u64 + 1),
            "round {round}: the block changed under its last user"
        );
    }
    let stats = allocator.stats();
    assert_eq!(
        (stats.allocations, stats.frees),
        (ROUNDS as u64, ROUNDS as u64)
    );
    assert_eq!(allocator.outstanding(), 0);
    for stream in &streams {
        assert!(allocator.dependencies_satisfied(stream).unwrap());
    }
    let reserved = allocator.reserved_bytes(gpu.device.ordinal()).unwrap();
    assert!(
        reserved <= 64 << 20,
        "{ROUNDS} rounds of 64 KiB kept {reserved} bytes reserved"
    );
}

/// Eight threads profile work on their own pool streams at once: every operation is reported
/// (none skipped, none lost), per stream and per name, and on each stream the profiled spans
/// follow each other on the shared GPU clock without overlapping.
#[test]
fn eight_threads_profiling_their_pool_streams_are_all_reported_in_order() {
    const THREADS: usize = 8;
    const PER_THREAD: usize = 300;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    assert_eq!(pool.len(), THREADS);
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    std::thread::scope(|scope| {
        for (t, stream) in pool.streams().enumerate() {
            let (profiler, kernels) = (&profiler, &kernels);
            scope.spawn(move || {
                for i in 0..PER_THREAD {
                    let spin = (5 + (i % 4) as u64 * 5) * US;
                    profiler
                        .profile(
                            stream,
                            format!("t{t}"),
                            OperationKind::KernelLaunch,
                            0,
                            |s| s.launch(|raw| kernels.spin_ns(raw, spin)),
                        )
                        .unwrap();
                }
            });
        }
    });
    let operations = profiler.operations().unwrap();
    assert_eq!(profiler.skipped(), 0);
    assert_eq!(profiler.pending(), 0);
    assert_eq!(operations.len(), THREADS * PER_THREAD);
    let report = profiler.report().unwrap();
    assert_eq!(report.streams.len(), THREADS);
    for stream_report in &report.streams {
        assert_eq!(stream_report.operations, PER_THREAD as u64);
        assert_eq!(stream_report.kernel_launches, PER_THREAD as u64);
        assert_eq!(stream_report.by_name.len(), 1);
        assert_eq!(stream_report.by_name[0].count, PER_THREAD as u64);
    }
    for stream in pool.streams() {
        let mut spans: Vec<_> = operations
            .iter()
            .filter(|op| op.stream == stream.id())
            .collect();
        spans.sort_by_key(|op| op.start_ns);
        for pair in spans.windows(2) {
            assert!(
                pair[0].end_ns() <= pair[1].start_ns + 2_000,
                "two spans of one stream overlap: {:?} and {:?}",
                pair[0],
                pair[1]
            );
        }
        assert!(
            spans.iter().all(|op| op.duration_ns >= 2_000),
            "a span shorter than its 5 µs spin"
        );
    }
}

/// A data-parallel step, 100 times: `execute_parallel` has each of four streams spin a
/// different time and write its part; a barrier; one stream (a different one each step) sums
/// every part; a second barrier, so the next step's writes wait for that read. Every step's
/// sum is exact.
#[test]
fn barriers_on_both_sides_of_each_steps_reduction_keep_every_sum_exact() {
    const STREAMS: usize = 4;
    const STEPS: usize = 100;
    const N: usize = 1 << 14;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let streams: Vec<_> = (0..STREAMS).map(|_| normal_stream(&gpu.context)).collect();
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let parts: Vec<DeviceBuffer<u32>> = (0..STREAMS)
        .map(|_| DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap())
        .collect();
    let part_ptrs: Vec<u64> = parts.iter().map(DeviceBuffer::device_ptr).collect();
    let sums = DeviceBuffer::<u64>::zeroed(&gpu.context, STEPS).unwrap();
    let sums_ptr = sums.device_ptr();
    let index: HashMap<u64, usize> = streams
        .iter()
        .enumerate()
        .map(|(k, stream)| (stream.id(), k))
        .collect();
    let step_now = AtomicU64::new(0);
    for step in 0..STEPS {
        step_now.store(step as u64, Ordering::SeqCst);
        coordinator
            .execute_parallel(|stream| {
                let k = index[&stream.id()];
                let step = step_now.load(Ordering::SeqCst) as usize;
                let spin = ((k * 37 + step * 13) % 4) as u64 * 100 * US;
                stream.launch(|s| kernels.spin_ns(s, spin))?;
                let (ptr, value) = (part_ptrs[k], (step * STREAMS + k + 1) as u32);
                // SAFETY: part k holds N u32s, written only on stream k between barriers,
                // alive past the final synchronisation.
                stream.launch(|s| unsafe { kernels.fill_u32(s, ptr, value, N) })?;
                Ok(())
            })
            .unwrap();
        let info = coordinator.create_barrier().unwrap();
        assert_eq!(info.waits, 2 * (STREAMS - 1));
        let reader = &streams[step % STREAMS];
        let out = sums_ptr + 8 * step as u64;
        for &ptr in &part_ptrs {
            // SAFETY: every part holds N u32s; the barrier ordered its writer before; `out` is
            // this step's u64 of `sums`.
            reader
                .launch(|s| unsafe { kernels.checksum_u32(s, ptr, N, out) })
                .unwrap();
        }
        coordinator.create_barrier().unwrap();
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    let sums = sums.to_vec().unwrap();
    for (step, sum) in sums.iter().enumerate() {
        let expected: u64 = (0..STREAMS)
            .map(|k| N as u64 * (step * STREAMS + k + 1) as u64)
            .sum();
        assert_eq!(*sum, expected, "step {step}: a part was read early or late");
    }
    let stats = coordinator.stats();
    assert_eq!(
        (stats.barriers, stats.parallel_runs),
        (2 * STEPS as u64, STEPS as u64)
    );
}

/// A pool stream busy replaying a long graph (four launches of a 50 ms spin) has queued work
/// like any other: its graph launches count as outstanding operations, `LoadBalanced` hands
/// out the other streams, and `wait_for_any_ready` finds an idle one at once.
#[test]
fn a_pool_stream_replaying_a_long_graph_is_busy_for_load_balancing() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced).with_counts(0, 3, 0),
    )
    .unwrap();
    let busy = Arc::clone(&pool.streams_of(StreamPriority::Normal)[0]);
    let capture = busy.begin_capture(CaptureOptions::default()).unwrap();
    busy.launch(|s| kernels.spin_ns(s, 50 * MS)).unwrap();
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    let launches_before = busy.metrics().unwrap().graph_launches;
    for _ in 0..4 {
        busy.launch_graph(&exec).unwrap();
    }
    assert_eq!(busy.metrics().unwrap().graph_launches - launches_before, 4);
    let queued = busy.outstanding_work().unwrap();
    assert!(
        (3..=4).contains(&queued),
        "{queued} graph launches read as queued (4 launched, 200 ms of work)"
    );
    for _ in 0..30 {
        assert_ne!(
            pool.get_stream().unwrap().id(),
            busy.id(),
            "LoadBalanced handed out the stream replaying a graph"
        );
    }
    let ready = pool
        .wait_for_any_ready(Duration::from_millis(10))
        .unwrap()
        .expect("two streams are idle");
    assert_ne!(ready.id(), busy.id());
    busy.synchronize().unwrap();
    assert_eq!(busy.outstanding_work().unwrap(), 0);
    drop(exec);
    drop(graph);
}
