//! Seventh look at the stream layer, written as programs users of PyTorch, RMM and cudarc run:
//! the three-thread shape behind the marker prune's deadlock (threads submitting past 32
//! markers on pool streams with `wait_stream`-style waits, threads picking `LoadBalanced` and
//! `Priority` streams and queuing on them, and a thread beginning and ending global captures in
//! a loop) finishing within a deadline with every capture intact; a cudarc-style raw
//! `cuStreamWaitEvent` announced with `note_queued_wait`; a barrier refused across an open
//! capture; RMM-style allocator dependencies inside a `torch.cuda.graph` side-stream capture and
//! 10^4 of them in ping-pong; the profiler beside a global capture on its own thread; and (no GPU
//! needed) a pipeline planner's `DependencyGraph` of 10^4 to 10^5 stages: retired stage by
//! stage, asked for cycles over thousands of double-buffered pairs, and layered like barriers.
//!
//! Ordering is proven by words the kernels write (gates, stores behind them, counters each
//! stream increments), never by durations. Every GPU test takes `serial()`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use cuweave_driver::graph::{CaptureMode, GraphError};
use cuweave_driver::{Context, InstantiateOptions};
use cuweave_stream::{
    AllocationStrategy, CaptureOptions, DependencyGraph, MultiStreamCoordinator, OperationKind,
    PriorityStream, StreamError, StreamOrderedAllocator, StreamPool, StreamPoolConfig,
    StreamPriority, StreamProfiler,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{poll_until, require_gpu, serial};

mod common;
use common::mapped::{Mapped, copy_flag, hold, increment, maps_host_memory};

/// The most markers a stream keeps (`stream::outstanding::MAX_MARKERS`, private to the crate).
const MAX_MARKERS: usize = 256;

/// Events of the shared pool taken by something else meanwhile (a capture's fork events, a
/// thread's cached slot): slack on every event bound below.
const SLACK: usize = 16;

/// Events of `stream`'s context pool handed out and not returned.
fn events_in_use(stream: &PriorityStream) -> usize {
    stream.event_pool().utilization().in_use
}

/// Queues a kernel that keeps `stream` busy for `ns` nanoseconds and touches no memory.
fn spin(kernels: &TestKernels, stream: &PriorityStream, ns: u64) {
    stream.launch(|s| kernels.spin_ns(s, ns)).unwrap();
}

// ---------------------------------------------------------------------------------------------
// The three-thread shape of the marker prune's deadlock, as a stress program.
// ---------------------------------------------------------------------------------------------

/// Submitting threads, two per stream, each incrementing its own word.
const SUBMITTERS: usize = 4;
/// Increments per submitting thread (plus a spin every fourth, so the GPU falls behind and
/// markers pile up past the prune mark).
const SUBMISSIONS: u32 = 800;
/// Capture rounds of the capturing thread.
const CAPTURE_ROUNDS: u32 = 40;

/// What the stress run saw, checked by the test thread.
struct StressOutcome {
    capture_failures: Vec<String>,
    graphs_launched: u32,
    words: Vec<u32>,
    pool_operations: u64,
    expected_pool_operations: u64,
    capturing_operations: u64,
    capturing_graph_launches: u64,
    outstanding_after: Vec<u64>,
    pending_waits_after: Vec<bool>,
    events_before: usize,
    events_after: usize,
}

/// The run itself: four submitting threads on two pool streams (`wait_for` on each other every
/// 50 submissions), a `LoadBalanced` picker and a `Priority` picker queuing a spin on every
/// stream they are handed, and this thread capturing in global mode forty times (through
/// `StreamCapture`, which synchronises the context first, and through the driver stream's own
/// begin), launching every graph once.
fn stress(context: &Arc<Context>) -> StressOutcome {
    let kernels = TestKernels::load(context).unwrap();
    let balanced = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced).with_counts(1, 4, 1),
    )
    .unwrap();
    let urgent = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority).with_counts(2, 2, 1),
    )
    .unwrap();
    let capturing = PriorityStream::new(context, StreamPriority::Normal).unwrap();
    // Words 0..SUBMITTERS: each submitter's count; word SUBMITTERS: the graphs' count.
    let words = Mapped::new(context, SUBMITTERS + 1);
    let shared = [
        Arc::clone(&balanced.streams_of(StreamPriority::Normal)[0]),
        Arc::clone(&urgent.streams_of(StreamPriority::High)[0]),
    ];
    let events_before = events_in_use(&capturing);
    let stop = AtomicBool::new(false);
    let picks = AtomicU64::new(0);
    let mut capture_failures = Vec::new();
    let mut graphs_launched = 0;
    let mut execs = Vec::new();
    std::thread::scope(|scope| {
        for submitter in 0..SUBMITTERS {
            let stream = &shared[submitter / 2];
            let other = &shared[1 - submitter / 2];
            let (kernels, words) = (&kernels, &words);
            scope.spawn(move || {
                for i in 0..SUBMISSIONS {
                    increment(kernels, stream, words.device(submitter));
                    if i % 4 == 0 {
                        spin(kernels, stream, 20_000);
                    }
                    if i % 50 == 49 {
                        stream.wait_for(other).unwrap();
                    }
                }
            });
        }
        for pool in [&balanced, &urgent] {
            let (kernels, stop, picks) = (&kernels, &stop, &picks);
            scope.spawn(move || {
                let mut mine = 0u64;
                while !stop.load(Ordering::Acquire) || mine < 200 {
                    let stream = pool.get_stream().unwrap();
                    spin(kernels, &stream, 1_000);
                    mine += 1;
                }
                picks.fetch_add(mine, Ordering::Relaxed);
            });
        }
        for round in 0..CAPTURE_ROUNDS {
            let ended = if round % 2 == 0 {
                let capture = capturing
                    .begin_capture(CaptureOptions::default().with_mode(CaptureMode::Global))
                    .unwrap();
                increment(&kernels, &capturing, words.device(SUBMITTERS));
                capture.finish()
            } else {
                capturing
                    .stream()
                    .begin_capture(CaptureMode::Global)
                    .unwrap();
                increment(&kernels, &capturing, words.device(SUBMITTERS));
                capturing.stream().end_capture().map_err(StreamError::from)
            };
            match ended {
                Ok(graph) => {
                    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
                    capturing.launch_graph(&exec).unwrap();
                    graphs_launched += 1;
                    execs.push(exec);
                }
                Err(error) => capture_failures.push(format!("round {round}: {error}")),
            }
        }
        stop.store(true, Ordering::Release);
    });
    let streams: Vec<Arc<PriorityStream>> = balanced
        .streams()
        .chain(urgent.streams())
        .cloned()
        .collect();
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    capturing.synchronize().unwrap();
    drop(execs);
    let per_submitter = u64::from(SUBMISSIONS) + u64::from(SUBMISSIONS).div_ceil(4);
    let capturing_metrics = capturing.metrics().unwrap();
    let outstanding_after: Vec<u64> = streams
        .iter()
        .map(|stream| stream.outstanding_work().unwrap())
        .collect();
    // The graph launches' markers go back once asked for, as the pool streams' just did.
    assert_eq!(capturing.outstanding_work().unwrap(), 0);
    poll_until(Duration::from_secs(10), || {
        events_in_use(&capturing) <= events_before + SLACK
    });
    StressOutcome {
        capture_failures,
        graphs_launched,
        words: (0..=SUBMITTERS).map(|i| words.read(i)).collect(),
        pool_operations: streams
            .iter()
            .map(|stream| stream.metrics().unwrap().operations)
            .sum(),
        expected_pool_operations: SUBMITTERS as u64 * per_submitter + picks.load(Ordering::Relaxed),
        capturing_operations: capturing_metrics.operations,
        capturing_graph_launches: capturing_metrics.graph_launches,
        outstanding_after,
        pending_waits_after: streams
            .iter()
            .map(|stream| stream.has_pending_waits().unwrap())
            .collect(),
        events_before,
        events_after: events_in_use(&capturing),
    }
}

/// The program the marker prune's three-way deadlock came from, as users write it: a data
/// loader's threads feed two pool streams far ahead of the GPU (past the 32 markers that make a
/// submission search for finished ones, with `wait_stream`-style waits between the two), request
/// threads pick streams from a `LoadBalanced` and a `Priority` pool (each pick holds a stream's
/// markers lock across queries that wait out an announced capture begin) and queue work on them,
/// and a training thread captures a CUDA graph in global mode (PyTorch's default
/// `capture_error_mode`) forty times, half through `StreamCapture` (synchronising the context
/// first, as `torch.cuda.graph` does) and half through the driver stream's own begin.
///
/// It must finish well within a generous deadline (a deadlock fails it instead of hanging the
/// suite), no capture may be broken by the other threads' queries, every graph replays once,
/// every submission ran exactly once (each submitter's word), every operation is counted once,
/// and once synchronised every stream reads idle with its marker events back in the pool.
#[test]
fn submitters_pickers_and_a_global_capture_loop_finish_with_every_capture_intact() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = Arc::clone(&gpu.context);
    let (sender, receiver) = mpsc::channel();
    let started = Instant::now();
    // Not scoped: a deadlocked run must not keep the test from failing.
    std::thread::spawn(move || {
        let _ = sender.send(stress(&context));
    });
    let outcome = match receiver.recv_timeout(Duration::from_secs(120)) {
        Ok(outcome) => outcome,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!(
            "submitters, pool pickers and a global capture loop did not finish in 120 s \
             (a deadlock between a submission's marker search, a pick's queries and a capture \
             begin)"
        ),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            panic!("the stress run panicked (its message is above)")
        }
    };
    let elapsed = started.elapsed();

    assert!(
        outcome.capture_failures.is_empty(),
        "global captures broken by other threads' submissions or picks: {:?}",
        outcome.capture_failures
    );
    assert_eq!(outcome.graphs_launched, CAPTURE_ROUNDS);
    assert_eq!(
        outcome.words[..SUBMITTERS],
        [SUBMISSIONS; SUBMITTERS],
        "every submitter's increments ran exactly once"
    );
    assert_eq!(
        outcome.words[SUBMITTERS], CAPTURE_ROUNDS,
        "each captured graph incremented its word once when launched (never while captured)"
    );
    assert_eq!(
        outcome.pool_operations, outcome.expected_pool_operations,
        "every submission and every picker's launch counted once on the pool streams"
    );
    assert_eq!(
        (
            outcome.capturing_operations,
            outcome.capturing_graph_launches
        ),
        (u64::from(CAPTURE_ROUNDS), u64::from(CAPTURE_ROUNDS)),
        "the capturing stream counts its graph launches, never the captured kernels"
    );
    assert!(
        outcome.outstanding_after.iter().all(|&work| work == 0),
        "outstanding work after synchronising: {:?}",
        outcome.outstanding_after
    );
    assert!(
        outcome.pending_waits_after.iter().all(|&pending| !pending),
        "waits read pending after synchronising: {:?}",
        outcome.pending_waits_after
    );
    assert!(
        outcome.events_after <= outcome.events_before + SLACK,
        "marker events not returned: {} in use before, {} after",
        outcome.events_before,
        outcome.events_after
    );
    assert!(
        elapsed < Duration::from_secs(60),
        "the run took {elapsed:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// note_queued_wait: a user's own device wait.
// ---------------------------------------------------------------------------------------------

/// A cudarc-interop program queues its own `cuStreamWaitEvent` on a `Priority` pool's high
/// stream (through the driver stream, on an event recorded behind a gated producer) and
/// announces it with `note_queued_wait`, as the docs ask of work not queued through the stream
/// type. The stream has no operation of its own queued, but while the gate holds it must read
/// pending and the pool must hand out the other high stream instead. A stray burst of 10^4
/// notes on that other, idle stream costs one query and leaves it idle. Once the gate opens,
/// the work the held stream got reads the producer's store and it is handed out again.
#[test]
fn a_raw_event_wait_noted_by_the_user_holds_a_priority_pool_stream_until_it_passes() {
    let name = "a_raw_event_wait_noted_by_the_user_holds_a_priority_pool_stream_until_it_passes";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream_kernels = StreamKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority).with_counts(2, 1, 1),
    )
    .unwrap();
    let held = Arc::clone(&pool.streams_of(StreamPriority::High)[0]);
    let idle = Arc::clone(&pool.streams_of(StreamPriority::High)[1]);
    let producer = PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap();
    let words = Mapped::new(&gpu.context, 3);
    hold(&kernels, &producer, &words, 0);
    let stored = words.device(1);
    // SAFETY: word 1 of `words`, alive until the producer is synchronized below.
    producer
        .launch(|s| unsafe { kernels.spin_then_store_u32(s, 0, stored, 7) })
        .unwrap();
    let event = producer.event_pool().acquire_owned(false).unwrap();
    event.record(producer.stream()).unwrap();
    held.stream().wait_event(&event).unwrap();
    held.note_queued_wait();

    let pending = held.has_pending_waits().unwrap();
    let picks: Vec<u64> = (0..6).map(|_| pool.get_stream().unwrap().id()).collect();
    for _ in 0..10_000 {
        idle.note_queued_wait();
    }
    let stray_pending = idle.has_pending_waits().unwrap();
    copy_flag(&stream_kernels, &held, words.device(1), words.device(2));
    words.write(0, 1);
    held.synchronize().unwrap();
    producer.synchronize().unwrap();

    assert!(
        pending,
        "a noted raw wait behind a closed gate reads pending"
    );
    assert!(
        !picks.contains(&held.id()),
        "the Priority pool handed out the stream held by a noted raw wait: {picks:?} (held {})",
        held.id()
    );
    assert!(
        !stray_pending,
        "10^4 notes with nothing queued behind them leave an idle stream idle"
    );
    assert_eq!(
        words.read(2),
        7,
        "the held stream's work ran after the store"
    );
    assert!(
        !held.has_pending_waits().unwrap(),
        "passed once the gate opened"
    );
    let after: Vec<u64> = (0..6).map(|_| pool.get_stream().unwrap().id()).collect();
    assert!(
        after.contains(&held.id()),
        "once passed, the stream is handed out again: {after:?} (held {})",
        held.id()
    );
}

// ---------------------------------------------------------------------------------------------
// Barriers across a capture.
// ---------------------------------------------------------------------------------------------

/// A pipeline coordinator over three streams calls `create_barrier` while one of them is
/// capturing a graph (a `torch.cuda.graph` block opened on a stream the coordinator also
/// synchronises). The barrier would cross the capture's boundary: it must be refused with the
/// typed `GraphError::Capturing` naming `queue_barrier`, before anything is queued, so the
/// capture still ends cleanly; a refused barrier is not counted and does not clear the
/// diagnostic dependency graph (the ping-pong cycle stays reported); no stream reads held
/// afterwards. A real barrier after the capture then orders a gated stream's store before
/// another stream's read, and the graph replays exactly.
#[test]
fn a_barrier_across_an_open_capture_is_refused_without_breaking_it_and_a_later_one_orders() {
    let name =
        "a_barrier_across_an_open_capture_is_refused_without_breaking_it_and_a_later_one_orders";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream_kernels = StreamKernels::load(&gpu.context).unwrap();
    let [a, b, c] = [(); 3]
        .map(|_| Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap()));
    let coordinator =
        MultiStreamCoordinator::with_streams([Arc::clone(&a), Arc::clone(&b), Arc::clone(&c)]);
    coordinator.add_dependency(&b, &a).unwrap();
    coordinator.add_dependency(&a, &b).unwrap();
    assert!(coordinator.has_cycles());
    let barriers_before = coordinator.stats().barriers;
    // Words 0: the graph's count; 1: the gate; 2: c's store; 3: what b read.
    let words = Mapped::new(&gpu.context, 4);

    let capture = a.begin_capture(CaptureOptions::default()).unwrap();
    increment(&kernels, &a, words.device(0));
    let refused = coordinator.create_barrier();
    let finished = capture.finish();

    let error = refused.expect_err("a barrier across an open capture is refused");
    assert!(
        matches!(
            error.graph_error(),
            Some(GraphError::Capturing {
                operation: "queue_barrier",
                ..
            })
        ),
        "{error:?}"
    );
    let graph = finished.expect("the refused barrier queued nothing into the capture");
    assert_eq!(
        coordinator.stats().barriers,
        barriers_before,
        "a refused barrier is not counted"
    );
    assert!(
        coordinator.has_cycles(),
        "a refused barrier does not clear the dependency graph"
    );
    for stream in [&a, &b, &c] {
        assert!(
            !stream.has_pending_waits().unwrap(),
            "stream {} reads held after a refused barrier",
            stream.id()
        );
    }

    hold(&kernels, &c, &words, 1);
    let stored = words.device(2);
    // SAFETY: word 2 of `words`, alive until c is synchronized below.
    c.launch(|s| unsafe { kernels.spin_then_store_u32(s, 0, stored, 9) })
        .unwrap();
    let info = coordinator.create_barrier().unwrap();
    assert_eq!((info.streams, info.waits), (3, 4));
    assert!(
        !coordinator.has_cycles(),
        "a barrier starts the graph afresh"
    );
    let held = b.has_pending_waits().unwrap();
    copy_flag(&stream_kernels, &b, words.device(2), words.device(3));
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        a.launch_graph(&exec).unwrap();
    }
    words.write(1, 1);
    for stream in [&a, &b, &c] {
        stream.synchronize().unwrap();
    }
    assert!(held, "b is held behind the gated stream by the barrier");
    assert_eq!(words.read(3), 9, "b's read ran after c's store");
    assert_eq!(words.read(0), 3, "the graph replayed once per launch");
    assert_eq!(coordinator.stats().barriers, barriers_before + 1);
}

// ---------------------------------------------------------------------------------------------
// StreamOrderedAllocator::add_stream_dependency.
// ---------------------------------------------------------------------------------------------

/// A `torch.cuda.graph` with a side stream, ordered the RMM way: inside the capture on a
/// `LoadBalanced` pool's first stream, the allocator's `add_stream_dependency(side, main)`
/// forks the side stream into the capture (a graph edge, not a wait the allocator tracks); the
/// side stream works and is joined back. The capture ends cleanly and the graph replays
/// exactly, the captured wait leaves nothing for `dependencies_satisfied` to wait on, the side
/// stream does not read held afterwards, the pool hands out both streams again, and the
/// allocation made before the capture (given to the side stream) is freed after it.
#[test]
fn an_allocator_dependency_inside_a_side_stream_capture_is_a_graph_edge_and_holds_nothing() {
    let name =
        "an_allocator_dependency_inside_a_side_stream_capture_is_a_graph_edge_and_holds_nothing";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    if !gpu.device.supports_memory_pools().unwrap_or(false) {
        cuweave_test_support::skip(name, "the device has no stream-ordered memory pools");
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced).with_counts(0, 2, 0),
    )
    .unwrap();
    let main = Arc::clone(&pool.streams_of(StreamPriority::Normal)[0]);
    let side = Arc::clone(&pool.streams_of(StreamPriority::Normal)[1]);
    let allocator = StreamOrderedAllocator::default();
    let block = allocator.allocate_for_stream(&main, 4096).unwrap();
    let words = Mapped::new(&gpu.context, 2);

    let mut capture = main.begin_capture(CaptureOptions::default()).unwrap();
    increment(&kernels, &main, words.device(0));
    allocator.add_stream_dependency(&side, &main).unwrap();
    increment(&kernels, &side, words.device(1));
    capture.join(side.stream()).unwrap();
    let graph = capture
        .finish()
        .expect("the side stream was joined back: the capture ends cleanly");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        main.launch_graph(&exec).unwrap();
    }
    main.synchronize().unwrap();
    side.synchronize().unwrap();

    assert_eq!(
        [words.read(0), words.read(1)],
        [3, 3],
        "both streams' captured kernels ran once per replay, none while captured"
    );
    assert!(
        allocator.dependencies_satisfied(&side).unwrap(),
        "a captured dependency is a graph edge, not a wait to track"
    );
    assert!(!side.has_pending_waits().unwrap());
    let picks: Vec<u64> = (0..4).map(|_| pool.get_stream().unwrap().id()).collect();
    assert!(
        picks.contains(&main.id()) && picks.contains(&side.id()),
        "both idle streams are handed out in turn: {picks:?}"
    );
    assert_eq!(allocator.free_for_stream(&main).unwrap(), 1);
    assert_eq!(allocator.outstanding(), 0);
    let _ = block;
    main.synchronize().unwrap();
}

/// A double-buffered RMM program orders two pool streams in ping-pong through the allocator,
/// 10^4 times each way, each stream working on its own counter between the waits, while each
/// stream owns an allocation the other is given. The allocator keeps one wait per pair of
/// streams and the streams prune their markers, so the events in use stay bounded however long
/// it runs; every dependency is counted, all are satisfied once the streams are synchronised,
/// every kernel ran exactly once, and both allocations are freed after their users.
#[test]
fn ten_thousand_allocator_ping_pongs_keep_events_bounded_and_counts_exact() {
    let name = "ten_thousand_allocator_ping_pongs_keep_events_bounded_and_counts_exact";
    let gpu = require_gpu!();
    let _serial = serial();
    if !gpu.device.supports_memory_pools().unwrap_or(false) {
        cuweave_test_support::skip(name, "the device has no stream-ordered memory pools");
        return;
    }
    const ROUNDS: u32 = 10_000;
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let a = Arc::clone(&pool.streams_of(StreamPriority::Normal)[0]);
    let b = Arc::clone(&pool.streams_of(StreamPriority::Normal)[1]);
    let allocator = StreamOrderedAllocator::default();
    let words = Mapped::new(&gpu.context, 2);
    let before = events_in_use(&a);
    let _on_a = allocator.allocate_for_stream(&a, 1 << 16).unwrap();
    let _on_b = allocator.allocate_for_stream(&b, 1 << 16).unwrap();
    let mut most = 0;
    for round in 0..ROUNDS {
        increment(&kernels, &a, words.device(0));
        allocator.add_stream_dependency(&b, &a).unwrap();
        increment(&kernels, &b, words.device(1));
        allocator.add_stream_dependency(&a, &b).unwrap();
        if round % 64 == 0 {
            most = most.max(events_in_use(&a));
        }
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();

    assert_eq!([words.read(0), words.read(1)], [ROUNDS, ROUNDS]);
    assert_eq!(allocator.stats().dependencies, 2 * u64::from(ROUNDS));
    assert!(allocator.dependencies_satisfied(&a).unwrap());
    assert!(allocator.dependencies_satisfied(&b).unwrap());
    assert!(
        most <= before + 2 * MAX_MARKERS + 2 + SLACK,
        "{most} events in use during 2 x 10^4 allocator dependencies ({before} before)"
    );
    assert_eq!(allocator.free_for_stream(&a).unwrap(), 1);
    assert_eq!(allocator.free_for_stream(&b).unwrap(), 1);
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    assert_eq!(a.outstanding_work().unwrap(), 0);
    assert_eq!(b.outstanding_work().unwrap(), 0);
    assert!(!a.has_pending_waits().unwrap() && !b.has_pending_waits().unwrap());
    assert!(
        poll_until(Duration::from_secs(10), || events_in_use(&a)
            <= before + SLACK),
        "events not returned: {} in use, {before} before",
        events_in_use(&a)
    );
}

// ---------------------------------------------------------------------------------------------
// The profiler beside a capture on its own thread.
// ---------------------------------------------------------------------------------------------

/// A training loop profiles its steps (`torch.profiler` style) while the same thread captures
/// a CUDA graph in global mode: one profiled launch goes into the capture, five go to an eager
/// stream. Reading the profile meanwhile must be refused (a wait on the spans' events would
/// break the capture) with a capture refusal, and the capture must still end cleanly. Once it
/// has, the profile holds each eager operation exactly once and no captured one, and two
/// profiled replays of the graph are reported as two operations; the kernels ran the number of
/// times each word says.
#[test]
fn the_profiler_beside_a_global_capture_on_its_thread_reports_each_eager_operation_once() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    let eager = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let capturing = PriorityStream::new(&gpu.context, StreamPriority::High).unwrap();
    let words = Mapped::new(&gpu.context, 2);
    let bump = |stream: &PriorityStream, word: usize| -> cuweave_stream::Result<()> {
        let data = words.device(word);
        // SAFETY: one mapped word of `words`, which outlives every stream's synchronisation
        // below; only work ordered on one stream touches each word.
        stream.launch(|s| unsafe { kernels.increment_u32(s, data, 1) })
    };

    let capture = capturing
        .begin_capture(CaptureOptions::default().with_mode(CaptureMode::Global))
        .unwrap();
    profiler
        .profile(
            &capturing,
            "captured",
            OperationKind::KernelLaunch,
            0,
            |s| bump(s, 0),
        )
        .unwrap();
    for _ in 0..5 {
        profiler
            .profile(&eager, "eager", OperationKind::KernelLaunch, 0, |s| {
                bump(s, 1)
            })
            .unwrap();
    }
    let during = profiler.operations();
    let finished = capture.finish();

    let graph = finished.expect("profiling beside the capture did not break it");
    let refusal = during.expect_err("reading the profile during a global capture is refused");
    assert!(refusal.is_capture_refusal(), "{refusal:?}");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..2 {
        profiler
            .profile(&capturing, "replay", OperationKind::GraphLaunch, 0, |s| {
                s.launch_graph(&exec)
            })
            .unwrap();
    }
    capturing.synchronize().unwrap();
    eager.synchronize().unwrap();
    let operations = profiler.operations().unwrap();
    let count = |name: &str| operations.iter().filter(|op| op.name == name).count();
    assert_eq!(
        (count("captured"), count("eager"), count("replay")),
        (0, 5, 2),
        "{operations:?}"
    );
    assert_eq!([words.read(0), words.read(1)], [2, 5]);
    assert_eq!(profiler.pending(), 0);
}

// ---------------------------------------------------------------------------------------------
// DependencyGraph at pipeline scale (no GPU).
// ---------------------------------------------------------------------------------------------

/// A pipeline planner (the kind that keeps PyTorch's pipeline-parallel schedules or a task
/// graph of many stages) builds the dependency chain of 10^5 stages once, checking each stage
/// with `try_add`, then retires the stages as they finish, oldest first, with `remove`. The
/// graph's paths must stay exact while it shrinks (half-way, the newest stage still reaches the
/// oldest remaining one through every stage between), and retiring must cost about as much as
/// building: it must finish in well under 30 s (a `remove` that scans every node makes it
/// quadratic: 10^10 steps). The deadline is checked as it goes, so a slow `remove` fails
/// instead of hanging.
#[test]
fn a_planner_retiring_a_hundred_thousand_stages_one_by_one_is_not_quadratic() {
    const STAGES: u64 = 100_000;
    const LIMIT: Duration = Duration::from_secs(30);
    let started = Instant::now();
    let mut graph = DependencyGraph::new();
    for stage in 1..STAGES {
        assert_eq!(graph.try_add(stage, stage - 1), Ok(true));
    }
    for stage in 0..STAGES {
        graph.remove(stage);
        if stage == STAGES / 2 {
            let rest: Vec<u64> = (STAGES / 2 + 1..STAGES).rev().collect();
            assert_eq!(
                graph.path(STAGES - 1, STAGES / 2 + 1).as_deref(),
                Some(&rest[..])
            );
            assert_eq!(graph.prerequisites(STAGES / 2 + 1), Vec::<u64>::new());
            assert_eq!(graph.len(), rest.len());
        }
        if stage % 1_000 == 0 {
            let elapsed = started.elapsed();
            assert!(
                elapsed < LIMIT,
                "retiring stages one by one: {stage} of {STAGES} retired after {elapsed:?} \
                 (DependencyGraph::remove walks every node, so retiring n stages is O(n^2))"
            );
        }
    }
    assert!(graph.is_empty());
    assert!(started.elapsed() < LIMIT, "took {:?}", started.elapsed());
}

/// A double-buffered pipeline of 10^4 stages: each of 5,000 compute stages and its copy stage
/// wait on each other in turn (`wait_stream` both ways: the ping-pong the coordinator's docs
/// call correct), described in one `DependencyGraph`. `has_cycles` must say yes and `cycles`
/// must list each pair once, and both must take time linear in the graph (Tarjan's components
/// are), far under 5 s; a graph that rebuilds the whole edge list for every component with a
/// cycle makes them quadratic (tens of seconds here).
#[test]
fn cycles_over_five_thousand_ping_pong_pairs_are_found_in_linear_time() {
    const PAIRS: u64 = 5_000;
    let mut graph = DependencyGraph::new();
    for pair in 0..PAIRS {
        graph.add_unchecked(2 * pair, 2 * pair + 1);
        graph.add_unchecked(2 * pair + 1, 2 * pair);
    }
    let started = Instant::now();
    let has = graph.has_cycles();
    let has_took = started.elapsed();
    let started = Instant::now();
    let cycles = graph.cycles();
    let cycles_took = started.elapsed();

    assert!(has);
    assert_eq!(cycles.len(), PAIRS as usize);
    for (pair, cycle) in (0..PAIRS).zip(&cycles) {
        assert_eq!(cycle, &vec![2 * pair, 2 * pair + 1]);
    }
    assert!(
        has_took < Duration::from_secs(5) && cycles_took < Duration::from_secs(5),
        "has_cycles took {has_took:?} and cycles {cycles_took:?} over {} nodes \
         (DependencyGraph::cycles rebuilds the whole graph for every component with a cycle)",
        2 * PAIRS
    );
}

/// A planner's graph of 25,000 barrier layers of four streams each (10^5 stages): every stage
/// waits on all four stages of the layer before (the fan-in/fan-out of a barrier, 4 x 10^5
/// edges). It has no cycle; the newest stage reaches the oldest layer through exactly one stage
/// per layer; closing it with an edge from the oldest stage to the newest is refused with a real
/// cycle (each stage waits on the next, the last on the first) of one stage per layer plus the
/// closing one, and nothing is added. All in well under 30 s.
#[test]
fn a_hundred_thousand_stage_barrier_lattice_has_exact_paths_and_refuses_its_closing_edge() {
    const LAYERS: u64 = 25_000;
    const WIDTH: u64 = 4;
    let started = Instant::now();
    let stage = |layer: u64, lane: u64| layer * WIDTH + lane;
    let mut graph = DependencyGraph::new();
    for layer in 1..LAYERS {
        for lane in 0..WIDTH {
            for before in 0..WIDTH {
                graph.add_unchecked(stage(layer, lane), stage(layer - 1, before));
            }
        }
    }
    assert!(!graph.has_cycles());
    let newest = stage(LAYERS - 1, WIDTH - 1);
    let path = graph
        .path(newest, stage(0, 0))
        .expect("the newest reaches the oldest");
    assert_eq!(path.len(), LAYERS as usize, "one stage per layer");
    for (layer, &node) in (0..LAYERS).rev().zip(&path) {
        assert_eq!(node / WIDTH, layer);
    }
    let edges = graph.edges().len();
    let cycle = graph
        .try_add(stage(0, 0), newest)
        .expect_err("closing the lattice is a cycle");
    assert_eq!(cycle.len(), LAYERS as usize);
    for (i, &node) in cycle.iter().enumerate() {
        let next = cycle[(i + 1) % cycle.len()];
        let closing = node == stage(0, 0) && next == newest;
        assert!(
            closing || graph.prerequisites(node).contains(&next),
            "{node} does not wait on {next}"
        );
    }
    assert_eq!(graph.edges().len(), edges, "a refused edge is not added");
    assert!(!graph.has_cycles());
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
}
