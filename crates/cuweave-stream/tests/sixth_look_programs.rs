//! Sixth look at the stream layer, written as programs users of PyTorch, RMM and cudarc run:
//! RMM-style stream dependencies of the stream-ordered allocator holding a pool stream behind a
//! gated producer while `Priority` and `LoadBalanced` pools pick streams, a refused copy on a
//! GPU-timed, profiled stream, markers piled up on a busy stream while a capture is open and
//! dropped once it ends, a full GPU timer meeting a capture on its own thread, 10^5 picks of a
//! `Priority` pool with `wait_stream`-style waits kept exact and bounded, a `torch.cuda.graph`
//! fork/join over two pool streams whose captured waits leave nothing pending, and (no GPU
//! needed) the dependency graph of a 10^4-stage pipeline.
//!
//! Ordering is proven by words the kernels write (a gate, a store behind it, counters each
//! stream increments), never by durations. Every GPU test takes `serial()`.

use std::collections::HashMap;
use std::sync::Arc;

use cuweave_driver::InstantiateOptions;
use cuweave_memory::{Buffer, DeviceBuffer, MemoryError};
use cuweave_stream::timing::DEFAULT_PENDING_SPANS;
use cuweave_stream::{
    AllocationStrategy, CaptureOptions, DependencyGraph, OperationKind, PriorityStream,
    StreamError, StreamOrderedAllocator, StreamOrderedAllocatorConfig, StreamPool,
    StreamPoolConfig, StreamPriority, StreamProfiler,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{require_gpu, serial};

mod common;
use common::mapped::{Mapped, copy_flag, hold, increment, maps_host_memory};

/// The markers a stream keeps before a submission drops finished ones
/// (`stream::outstanding::PRUNE_AT`, private to the crate).
const PRUNE_AT: usize = 32;

/// The most markers a stream keeps (`stream::outstanding::MAX_MARKERS`).
const MAX_MARKERS: usize = 256;

/// Events of the shared pool taken by something else meanwhile (a capture's fork events, a
/// thread's cached slot): slack on every event bound below.
const SLACK: usize = 16;

/// Events of `stream`'s context pool handed out and not returned.
fn events_in_use(stream: &PriorityStream) -> usize {
    stream.event_pool().utilization().in_use
}

/// A producer behind a closed gate (word 0 of the returned words) that stores 7 into word 1
/// once it opens; word 2 is left for the consumer's copy.
fn gated_producer(
    gpu: &cuweave_test_support::Gpu,
    kernels: &TestKernels,
) -> (Arc<PriorityStream>, Mapped) {
    let producer = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap());
    let words = Mapped::new(&gpu.context, 3);
    hold(kernels, &producer, &words, 0);
    let stored = words.device(1);
    // SAFETY: word 1 of `words`, alive until the producer is synchronized by the caller.
    producer
        .launch(|s| unsafe { kernels.spin_then_store_u32(s, 0, stored, 7) })
        .unwrap();
    (producer, words)
}

/// RMM's `stream_ordered_memory_resource` users order a consumer stream after a producer with
/// the allocator's own dependency call (`add_stream_dependency`), not `wait_for`. That queues a
/// device wait on the consumer, a high-priority stream of a `Priority` pool, behind a producer
/// held by a closed gate. The stream has nothing of its own queued but is not idle: the driver
/// reports it busy, and work handed to it waits for the gate. `has_pending_waits` must say so,
/// and the pool must not hand it out while the other high-priority stream is really idle. The
/// work the held stream does get reads the producer's store.
#[test]
fn an_allocator_dependency_on_a_gated_stream_keeps_a_priority_pool_stream_from_reading_idle() {
    let name =
        "an_allocator_dependency_on_a_gated_stream_keeps_a_priority_pool_stream_from_reading_idle";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream_kernels = StreamKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority),
    )
    .unwrap();
    let held = Arc::clone(&pool.streams_of(StreamPriority::High)[0]);
    let allocator = StreamOrderedAllocator::new(StreamOrderedAllocatorConfig::default());
    let (producer, words) = gated_producer(&gpu, &kernels);
    allocator.add_stream_dependency(&held, &producer).unwrap();

    let busy = !held.is_ready().unwrap();
    let pending = held.has_pending_waits().unwrap();
    let picks: Vec<u64> = (0..6).map(|_| pool.get_stream().unwrap().id()).collect();
    let handed_held = picks.iter().filter(|&&id| id == held.id()).count();
    copy_flag(&stream_kernels, &held, words.device(1), words.device(2));
    words.write(0, 1);
    held.synchronize().unwrap();
    producer.synchronize().unwrap();

    assert!(
        busy,
        "precondition: the driver reports the waiting stream busy"
    );
    assert_eq!(
        words.read(2),
        7,
        "the held stream's work ran after the store"
    );
    assert!(
        pending,
        "has_pending_waits is false for a stream held by the allocator's dependency wait"
    );
    assert_eq!(
        handed_held,
        0,
        "the Priority strategy handed out the stream held by add_stream_dependency {handed_held} \
         times in 6 picks (held {}, picks {picks:?}) while the other high stream was idle",
        held.id()
    );
    assert!(allocator.dependencies_satisfied(&held).unwrap());
    assert!(
        !held.has_pending_waits().unwrap(),
        "passed once the gate opened"
    );
}

/// The same RMM-style dependency under `LoadBalanced` (PyTorch users picking "the least busy
/// side stream"): of two normal streams, one is held behind the gated producer through
/// `add_stream_dependency`, the other is idle. Every pick must be the idle one; round robin
/// between equal loads would hand out the held one every other time.
#[test]
fn an_allocator_dependency_on_a_gated_stream_is_load_for_a_load_balanced_pool() {
    let name = "an_allocator_dependency_on_a_gated_stream_is_load_for_a_load_balanced_pool";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream_kernels = StreamKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced).with_counts(1, 2, 1),
    )
    .unwrap();
    let normal = pool.streams_of(StreamPriority::Normal);
    let (held, idle) = (Arc::clone(&normal[0]), normal[1].id());
    let allocator = StreamOrderedAllocator::new(StreamOrderedAllocatorConfig::default());
    let (producer, words) = gated_producer(&gpu, &kernels);
    allocator.add_stream_dependency(&held, &producer).unwrap();

    let picks: Vec<u64> = (0..8).map(|_| pool.get_stream().unwrap().id()).collect();
    copy_flag(&stream_kernels, &held, words.device(1), words.device(2));
    words.write(0, 1);
    held.synchronize().unwrap();
    producer.synchronize().unwrap();

    assert_eq!(
        words.read(2),
        7,
        "the held stream's work ran after the store"
    );
    assert!(
        picks.iter().all(|&id| id == idle),
        "LoadBalanced handed out the stream held by add_stream_dependency (held {}, idle {idle}, \
         picks {picks:?})",
        held.id()
    );
}

/// A training script copies a batch into a tensor of the wrong length on a GPU-timed stream
/// under the profiler (`torch.profiler` around a `copy_`): the copy is refused with the memory
/// layer's `SizeMismatch`, nothing was queued, and the right copy after it lands. The profiler
/// reports one operation; the stream counts one copy and must have timed only that one: a
/// refused operation is no GPU work, so `timed_operations` cannot exceed `operations`.
#[test]
fn a_refused_copy_on_a_timed_profiled_stream_is_neither_counted_nor_timed() {
    let gpu = require_gpu!();
    let _serial = serial();
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    stream.set_timing(true);
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    let mut batch = DeviceBuffer::<u32>::zeroed(&gpu.context, 16).unwrap();
    let too_long = DeviceBuffer::<u32>::from_slice(&gpu.context, &[5u32; 32]).unwrap();
    let right = DeviceBuffer::<u32>::from_slice(&gpu.context, &[9u32; 16]).unwrap();

    let refused = profiler
        .profile(&stream, "bad copy", OperationKind::Copy, 128, |s| {
            s.copy_buffer(&mut batch, &too_long)
        })
        .unwrap_err();
    assert!(
        matches!(
            refused,
            StreamError::Memory(MemoryError::SizeMismatch {
                expected: 16,
                actual: 32,
                ..
            })
        ),
        "{refused:?}"
    );
    profiler
        .profile(&stream, "copy", OperationKind::Copy, 64, |s| {
            s.copy_buffer(&mut batch, &right)
        })
        .unwrap();
    stream.synchronize().unwrap();
    let metrics = stream.metrics().unwrap();
    let operations = profiler.operations().unwrap();

    let mut host = vec![0u32; 16];
    batch.copy_to_host(&mut host).unwrap();
    assert_eq!(host, vec![9u32; 16], "the right copy landed");
    assert_eq!(operations.len(), 1, "the profiler reports the one copy");
    assert_eq!(operations[0].name, "copy");
    assert_eq!((metrics.operations, metrics.copies), (1, 1), "{metrics}");
    assert_eq!(stream.outstanding_work().unwrap(), 0);
    assert!(
        metrics.timed_operations <= metrics.operations,
        "the stream timed the refused copy as work: {metrics}"
    );
    assert_eq!(metrics.timed_operations, 1, "{metrics}");
}

/// A data-loader stream keeps launching while the main thread captures a graph
/// (`torch.cuda.graph` beside an eager side stream, PyTorch's warm-up pattern): while any capture
/// is open a submission never queries its markers, so they pile up to the cap (256, the newest
/// re-recorded past it). Once the capture ends, the next submissions drop the finished ones:
/// with the loader synchronized after each launch, it holds at most `PRUNE_AT` markers again.
/// Every increment lands and the captured graph replays.
#[test]
fn markers_piled_up_while_a_capture_is_open_are_dropped_once_it_ends() {
    let name = "markers_piled_up_while_a_capture_is_open_are_dropped_once_it_ends";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let loader = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let origin = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let words = Mapped::new(&gpu.context, 2);
    loader.synchronize().unwrap();
    let base = events_in_use(&loader);

    let capture = origin.begin_capture(CaptureOptions::default()).unwrap();
    increment(&kernels, &origin, words.device(1));
    for _ in 0..1_000 {
        increment(&kernels, &loader, words.device(0));
    }
    let during = events_in_use(&loader).saturating_sub(base);
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    origin.launch_graph(&exec).unwrap();
    origin.synchronize().unwrap();
    drop(exec);
    drop(graph);

    loader.synchronize().unwrap();
    let mut most_after = 0;
    for _ in 0..200 {
        increment(&kernels, &loader, words.device(0));
        loader.synchronize().unwrap();
        most_after = most_after.max(events_in_use(&loader).saturating_sub(base));
    }
    let settled = events_in_use(&loader).saturating_sub(base);

    assert_eq!(words.read(0), 1_200, "every loader increment ran once");
    assert_eq!(
        words.read(1),
        1,
        "the captured increment ran once, at the replay"
    );
    assert_eq!(loader.outstanding_work().unwrap(), 0);
    assert!(
        during <= MAX_MARKERS + SLACK,
        "{during} events held during the capture"
    );
    assert!(
        settled <= PRUNE_AT + 1 + SLACK,
        "{settled} events still held after 200 synchronized launches past the capture \
         (at most {most_after} along the way; {during} during it)"
    );
}

/// A GPU-timed stream (`set_timing`, PyTorch's `enable_timing` events around every op) whose
/// owner never asks for metrics fills its timer (4096 spans, all finished). Then the thread
/// captures a graph on another stream and keeps launching on the timed one: the timer cannot be
/// read while this thread captures, so those launches are queued untimed, never refused. After
/// the capture the next launch reads the 4096 finished spans and timing resumes: the counts
/// are exact.
#[test]
fn a_full_timer_meeting_a_capture_on_its_thread_skips_then_times_again_after_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let timed = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let origin = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    timed.set_timing(true);
    let spans = DEFAULT_PENDING_SPANS as u64;
    for _ in 0..spans {
        timed.launch(|s| kernels.spin_ns(s, 0)).unwrap();
    }
    timed.synchronize().unwrap();

    let capture = origin.begin_capture(CaptureOptions::default()).unwrap();
    origin.launch(|s| kernels.spin_ns(s, 1_000)).unwrap();
    let during: Vec<_> = (0..10)
        .map(|_| timed.launch(|s| kernels.spin_ns(s, 0)))
        .collect();
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    origin.launch_graph(&exec).unwrap();
    origin.synchronize().unwrap();

    timed.synchronize().unwrap();
    for _ in 0..10 {
        timed.launch(|s| kernels.spin_ns(s, 0)).unwrap();
    }
    timed.synchronize().unwrap();
    let metrics = timed.metrics().unwrap();

    for (i, result) in during.iter().enumerate() {
        assert!(result.is_ok(), "launch {i} beside the capture: {result:?}");
    }
    assert_eq!(metrics.operations, spans + 20, "{metrics}");
    assert_eq!(metrics.kernel_launches, spans + 20, "{metrics}");
    assert_eq!(
        metrics.timed_operations,
        spans + 10,
        "the full timer skipped the 10 launches beside the capture and timed the 10 after: \
         {metrics}"
    );
    assert!(metrics.gpu_time_ns > 0, "{metrics}");
    assert_eq!(timed.outstanding_work().unwrap(), 0);
}

/// A long-running server picks a stream from a `Priority` pool for each of 10^5 requests; every
/// 100th request first waits for a shared producer stream (`stream.wait_stream(producer)`). Each
/// pool stream increments its own counter, so the counts prove every launch ran once; every
/// 1000 requests the server synchronizes the pool (a step end). Afterwards no stream reads as
/// held by a wait, nothing is outstanding, and after 300 synchronized launches per stream (past
/// any back-off of the marker search) each stream holds at most `PRUNE_AT` markers, not the
/// 256 of the cap.
#[test]
fn a_hundred_thousand_priority_picks_with_periodic_waits_stay_exact_and_bounded() {
    let name = "a_hundred_thousand_priority_picks_with_periodic_waits_stay_exact_and_bounded";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority),
    )
    .unwrap();
    let producer = PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap();
    let streams: Vec<Arc<PriorityStream>> = pool.streams().cloned().collect();
    let index: HashMap<u64, usize> = streams
        .iter()
        .enumerate()
        .map(|(i, stream)| (stream.id(), i))
        .collect();
    let producer_word = streams.len();
    let words = Mapped::new(&gpu.context, streams.len() + 1);
    let synchronize_all = || {
        for stream in &streams {
            stream.synchronize().unwrap();
        }
        producer.synchronize().unwrap();
    };
    synchronize_all();
    let base = events_in_use(&producer);
    let all = streams.len() + 1;
    const REQUESTS: u64 = 100_000;
    let mut most = 0;
    for request in 0..REQUESTS {
        let stream = pool.get_stream().unwrap();
        if request % 100 == 0 {
            increment(&kernels, &producer, words.device(producer_word));
            stream.wait_for(&producer).unwrap();
        }
        increment(&kernels, &stream, words.device(index[&stream.id()]));
        if request % 1_000 == 999 {
            synchronize_all();
            most = most.max(events_in_use(&producer).saturating_sub(base));
        }
    }
    synchronize_all();
    for (i, stream) in streams.iter().enumerate() {
        assert!(
            !stream.has_pending_waits().unwrap(),
            "stream {i} reads as held by a wait after everything finished"
        );
        assert_eq!(stream.outstanding_work().unwrap(), 0, "stream {i}");
    }
    let total: u64 = (0..streams.len()).map(|i| u64::from(words.read(i))).sum();
    assert_eq!(total, REQUESTS, "every request's increment ran once");
    assert_eq!(u64::from(words.read(producer_word)), REQUESTS / 100);
    assert!(
        most <= all * MAX_MARKERS + SLACK,
        "{most} events held at a step end (cap {} per stream)",
        MAX_MARKERS
    );

    for stream in streams.iter().map(Arc::as_ref).chain([&producer]) {
        let word = index.get(&stream.id()).copied().unwrap_or(producer_word);
        for _ in 0..MAX_MARKERS + PRUNE_AT + 12 {
            increment(&kernels, stream, words.device(word));
            stream.synchronize().unwrap();
        }
    }
    let settled = events_in_use(&producer).saturating_sub(base);
    assert!(
        settled <= all * (PRUNE_AT + 1) + SLACK,
        "{settled} events held by {all} idle streams after 300 synchronized launches each \
         (at most {most} at the step ends)"
    );
}

/// `torch.cuda.graph` with a side stream: the capture begins on one high-priority pool stream,
/// the other forks in with `wait_for` (PyTorch's `side.wait_stream(main)`), both launch, and
/// main joins the side back. The waits were recorded into the graph, not run: once the capture
/// ends neither stream may read as held by a wait, and the `Priority` pool hands out a
/// high-priority stream again. The graph then replays 100 times with exact counts, and the
/// streams end idle.
#[test]
fn captured_fork_and_join_waits_leave_pool_streams_idle_and_replay_exactly() {
    let name = "captured_fork_and_join_waits_leave_pool_streams_idle_and_replay_exactly";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority).with_counts(2, 1, 0),
    )
    .unwrap();
    let high = pool.streams_of(StreamPriority::High);
    let (main, side) = (Arc::clone(&high[0]), Arc::clone(&high[1]));
    let words = Mapped::new(&gpu.context, 2);

    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    side.wait_for(&main).unwrap();
    increment(&kernels, &side, words.device(0));
    increment(&kernels, &main, words.device(1));
    main.wait_for(&side).unwrap();
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    assert_eq!(
        (words.read(0), words.read(1)),
        (0, 0),
        "nothing captured ran"
    );
    assert!(!main.has_pending_waits().unwrap(), "main after the capture");
    assert!(!side.has_pending_waits().unwrap(), "side after the capture");
    let picked = pool.get_stream().unwrap();
    assert_eq!(
        picked.priority(),
        StreamPriority::High,
        "an idle high-priority stream is handed out after the capture"
    );

    for _ in 0..100 {
        main.launch_graph(&exec).unwrap();
    }
    main.synchronize().unwrap();
    assert_eq!((words.read(0), words.read(1)), (100, 100));
    for stream in [&main, &side] {
        assert!(stream.is_ready().unwrap());
        assert!(!stream.has_pending_waits().unwrap());
        assert_eq!(stream.outstanding_work().unwrap(), 0);
    }
    assert_eq!(main.metrics().unwrap().graph_launches, 100);
    assert_eq!(
        side.metrics().unwrap().operations,
        0,
        "the side's captured launch is not an operation"
    );
}

/// A pipeline-parallel schedule over 10^4 stages declared as coordinator-style dependencies
/// (stage k+1 after stage k), with no GPU: no cycle while it is a chain; the edge closing the
/// ring is refused by `try_add` with the whole ring, and added unchecked it is the one cycle
/// (reported by `cycles` and `elementary_cycles`); removing one stage (a stream retired) breaks
/// it. Long chains must not overflow the stack of the checking thread.
#[test]
fn a_ten_thousand_stage_pipeline_graph_reports_its_ring_and_forgets_it_when_a_stage_retires() {
    const STAGES: u64 = 10_000;
    let mut graph = DependencyGraph::new();
    // As the coordinator declares them (`add_unchecked`); `try_add` over a chain is covered by
    // the graph module's own unit tests (one walk per edge).
    for stage in 1..STAGES {
        assert!(graph.add_unchecked(stage, stage - 1), "stage {stage}");
    }
    assert!(!graph.add_unchecked(1, 0), "a repeated edge is not new");
    assert_eq!(graph.len(), STAGES as usize);
    assert!(!graph.has_cycles());
    assert!(graph.elementary_cycles().is_empty());

    let refused = graph.try_add(0, STAGES - 1).unwrap_err();
    assert_eq!(
        refused.len(),
        STAGES as usize,
        "the refusal names the whole ring"
    );
    assert_eq!(refused[0], 0);
    assert!(!graph.has_cycles(), "a refused edge is not added");

    assert!(graph.add_unchecked(0, STAGES - 1));
    let cycles = graph.cycles();
    assert_eq!(cycles.len(), 1);
    assert_eq!(cycles[0].len(), STAGES as usize);
    let elementary = graph.elementary_cycles();
    assert_eq!(elementary.len(), 1);
    assert_eq!(elementary[0].len(), STAGES as usize);

    graph.remove(STAGES / 2);
    assert!(!graph.has_cycles(), "a retired stage breaks the ring");
    assert_eq!(graph.len(), STAGES as usize - 1);
    assert!(graph.prerequisites(STAGES / 2 + 1).is_empty());
}
