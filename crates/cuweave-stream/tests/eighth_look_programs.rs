//! Eighth look at the stream layer, written as programs users of PyTorch, RMM and cudarc run
//! around the driver's newest capture rules (blocking calls in relaxed mode once their refusals
//! pass, queries and waits refused for events last recorded into an active capture, pooled
//! events recorded into a capture parked until it ends, the marker prune stopping without
//! backing off when a query is skipped):
//!
//! - a scheduler thread waiting for any ready pool stream while the training thread holds a
//!   `torch.cuda.graph`-style global capture open;
//! - `Priority` and `LoadBalanced` picks from another thread while a pool stream is a global
//!   capture's origin and another pool stream is forked into it;
//! - a fork-point event handed to a monitor thread (refused there, parked when dropped there);
//! - 10^4 `wait_stream`-style waits recorded into captures (events parked, then reused);
//! - RMM-style allocator churn and stream dependencies on eager streams, 10^4 times, during one
//!   long global capture on another thread;
//! - a thread synchronizing an eager stream beside a loop of global captures with forked and
//!   joined side streams;
//! - a profiled `make_graphed_callables`-style warmup on a side stream, capture and replays;
//! - a stream-ordered allocation made inside a capture, kept past it, freed between replays
//!   (refused while another capture on its owner runs).
//!
//! Ordering and completion are proven by words the kernels write, never by durations. Every GPU
//! test takes `serial()`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use cuweave_driver::graph::{CaptureMode, GraphError};
use cuweave_driver::{DriverError, InstantiateOptions};
use cuweave_stream::capture::note_wait_joined_capture;
use cuweave_stream::{
    AllocationStrategy, CaptureOptions, MultiStreamCoordinator, OperationKind, PriorityStream,
    StreamError, StreamOrderedAllocator, StreamPool, StreamPoolConfig, StreamPriority,
    StreamProfiler, WorkloadType,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{poll_until, require_gpu, serial, skip};

mod common;
use common::graph::read_u32;
use common::mapped::{Mapped, increment, maps_host_memory};

/// The most markers a stream keeps (`stream::outstanding::MAX_MARKERS`, private to the crate).
const MAX_MARKERS: usize = 256;

/// Events of the shared pool taken by something else meanwhile (a thread's cached slot, a
/// capture's own events): slack on every event bound below.
const SLACK: usize = 16;

/// Events of `stream`'s context pool handed out and not returned (parked ones included).
fn events_in_use(stream: &PriorityStream) -> usize {
    stream.event_pool().utilization().in_use
}

/// Non-timing events `stream`'s context pool has ever created.
fn events_created(stream: &PriorityStream) -> u64 {
    stream.event_pool().counters().created_regular
}

/// Global-mode capture options (PyTorch's default `capture_error_mode`).
fn global() -> CaptureOptions {
    CaptureOptions::default().with_mode(CaptureMode::Global)
}

/// Queues `*word += 1` on `stream`, returning the error instead of panicking (for threads that
/// report their failures to the test thread).
fn bump(kernels: &TestKernels, stream: &PriorityStream, word: u64) -> Result<(), StreamError> {
    // SAFETY: `word` is one mapped u32 of a `Mapped` the test keeps alive until every stream
    // that increments it is synchronized; only ordered increments touch it.
    stream.launch(|s| unsafe { kernels.increment_u32(s, word, 1) })
}

/// Whether `error` is the typed "not now" of a capture.
fn refused(error: &StreamError) -> bool {
    error.is_capture_refusal()
}

/// Whether a driver error is the typed "not now" of a capture.
fn driver_refused(error: &DriverError) -> bool {
    error.is_capture_refusal()
}

/// `false` (after saying why) when the device has no stream-ordered memory pools.
fn has_memory_pools(gpu: &cuweave_test_support::Gpu, test: &str) -> bool {
    if gpu.device.supports_memory_pools().unwrap_or(false) {
        return true;
    }
    skip(test, "the device has no stream-ordered memory pools");
    false
}

// ---------------------------------------------------------------------------------------------
// Pool readiness and picks beside another thread's global capture.
// ---------------------------------------------------------------------------------------------

/// A data-loader scheduler (RMM's `cuda_stream_pool` plus a "first free stream" loop) asks the
/// pool for any ready stream while the training thread holds a `torch.cuda.graph` capture open
/// in global mode on a stream of its own. The pool's streams are idle and none captures, so
/// `wait_for_any_ready` must hand one of them back (its docs: a capturing stream is skipped,
/// the others are still looked at) and `has_ready_streams` must say so, as `get_stream` with
/// `LoadBalanced` does during such a capture (docs/streams.md: every stream that is not
/// capturing counts as idle). The capture must survive the scheduler's calls and replay once.
/// `outstanding_work` from that thread may be refused, but only with a typed capture refusal.
#[test]
fn wait_for_any_ready_beside_another_threads_global_capture_hands_out_an_idle_pool_stream() {
    let name =
        "wait_for_any_ready_beside_another_threads_global_capture_hands_out_an_idle_pool_stream";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced).with_counts(1, 2, 1),
    )
    .unwrap();
    let capturing = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let words = Mapped::new(&gpu.context, 1);
    let pool_ids: Vec<u64> = pool.streams().map(|stream| stream.id()).collect();

    let capture = capturing.begin_capture(global()).unwrap();
    increment(&kernels, &capturing, words.device(0));
    let (ready, any, picked, outstanding) = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let ready = pool
                    .wait_for_any_ready(Duration::from_secs(10))
                    .map(|found| found.map(|stream| stream.id()));
                let any = pool.has_ready_streams();
                let picked = pool.get_stream().map(|stream| stream.id());
                let outstanding: Vec<Result<u64, StreamError>> = pool
                    .streams()
                    .map(|stream| stream.outstanding_work())
                    .collect();
                (ready, any, picked, outstanding)
            })
            .join()
            .unwrap()
    });
    increment(&kernels, &capturing, words.device(0));
    let graph = capture
        .finish()
        .expect("the scheduler thread's calls must not break the global capture");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    capturing.launch_graph(&exec).unwrap();
    capturing.synchronize().unwrap();
    assert_eq!(words.read(0), 2, "the graph ran its two increments once");

    let picked = picked.expect("LoadBalanced picks during another thread's global capture");
    assert!(pool_ids.contains(&picked));
    for (i, result) in outstanding.iter().enumerate() {
        if let Err(error) = result {
            assert!(
                refused(error),
                "outstanding_work of pool stream {i}: only a capture refusal, got {error}"
            );
        }
    }
    match ready {
        Ok(Some(id)) => assert!(pool_ids.contains(&id), "a stream of the pool: {id}"),
        Ok(None) => panic!("wait_for_any_ready timed out with four idle, non-capturing streams"),
        Err(error) => panic!(
            "wait_for_any_ready failed while another thread's global capture was open, though \
             no pool stream captures (the pickers count such streams as idle): {error}"
        ),
    }
    assert!(
        any.expect("has_ready_streams during another thread's global capture"),
        "four idle pool streams: at least one is ready"
    );
}

/// A serving program picks streams from a `Priority` pool (then `LoadBalanced`) on a request
/// thread while the model thread captures a CUDA graph in global mode on the pool's only
/// high-priority stream, with one normal-priority pool stream forked into the capture (the
/// `torch.cuda.Stream()` side stream of a `torch.cuda.graph` block). Neither stream may be
/// handed out while the capture runs: eager work queued on them would be recorded into the
/// graph. Every pick queues a short kernel. The capture ends intact, replays once, and once it
/// is over the idle high-priority stream is the `Priority` pick again.
#[test]
fn pool_picks_beside_a_global_capture_never_hand_out_its_origin_or_forked_side_stream() {
    let name = "pool_picks_beside_a_global_capture_never_hand_out_its_origin_or_forked_side_stream";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    const PICKS: usize = 300;
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority).with_counts(1, 3, 1),
    )
    .unwrap();
    let origin = Arc::clone(&pool.streams_of(StreamPriority::High)[0]);
    let side = Arc::clone(&pool.streams_of(StreamPriority::Normal)[0]);
    let words = Mapped::new(&gpu.context, 2);

    let mut capture = origin.begin_capture(global()).unwrap();
    increment(&kernels, &origin, words.device(0));
    capture.fork(side.stream()).unwrap();
    increment(&kernels, &side, words.device(1));
    let picks: Vec<Result<(AllocationStrategy, u64), String>> = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let mut picks = Vec::new();
                for strategy in [
                    AllocationStrategy::Priority,
                    AllocationStrategy::LoadBalanced,
                ] {
                    pool.set_strategy(strategy);
                    for _ in 0..PICKS {
                        let pick = pool
                            .get_stream()
                            .and_then(|stream| {
                                stream.launch(|s| kernels.spin_ns(s, 1_000))?;
                                Ok(stream.id())
                            })
                            .map(|id| (strategy, id))
                            .map_err(|error| error.to_string());
                        picks.push(pick);
                    }
                }
                picks
            })
            .join()
            .unwrap()
    });
    capture.join(side.stream()).unwrap();
    let graph = capture
        .finish()
        .expect("the request thread's picks and launches must not break the capture");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    origin.launch_graph(&exec).unwrap();
    for stream in pool.streams() {
        stream.synchronize().unwrap();
    }
    assert_eq!(
        [words.read(0), words.read(1)],
        [1, 1],
        "no eager pick's work was recorded into the graph, and the graph ran once"
    );
    assert_eq!(picks.len(), 2 * PICKS);
    for pick in &picks {
        let (strategy, id) = pick.as_ref().expect("a pick during the capture");
        assert!(
            *id != origin.id() && *id != side.id(),
            "{strategy:?} handed out a stream in the capture (origin {}, side {}): {id}",
            origin.id(),
            side.id()
        );
    }
    pool.set_strategy(AllocationStrategy::Priority);
    assert_eq!(
        pool.get_stream().unwrap().id(),
        origin.id(),
        "after the capture, the idle high-priority stream is the most urgent idle one"
    );
}

// ---------------------------------------------------------------------------------------------
// Events recorded into a capture.
// ---------------------------------------------------------------------------------------------

/// A cudarc-style program forks a side stream into a `torch.cuda.graph` capture (thread-local
/// mode) through an event of the shared pool recorded on the capturing stream, and hands that
/// fork-point event to a monitoring thread, as a progress tracker would. The monitor's query and
/// synchronize are refused with a typed capture refusal (the driver would answer with
/// `CUDA_ERROR_CAPTURED_EVENT` and invalidate the capture); the monitor then drops it while the
/// capture runs: it must be parked, not handed to the next taker (64 events taken on the
/// monitor thread meanwhile are all other events), and rejoin the pool after the capture. The
/// capture ends cleanly and replays exactly.
#[test]
fn a_fork_point_event_handed_to_a_monitor_is_refused_there_and_parked_until_the_capture_ends() {
    let name =
        "a_fork_point_event_handed_to_a_monitor_is_refused_there_and_parked_until_the_capture_ends";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let origin = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let side = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let words = Mapped::new(&gpu.context, 2);
    let before = events_in_use(&origin);

    let mut capture = origin.begin_capture(CaptureOptions::default()).unwrap();
    increment(&kernels, &origin, words.device(0));
    let fork_point = origin.event_pool().acquire_owned(false).unwrap();
    fork_point.record(origin.stream()).unwrap();
    side.stream().wait_event(&fork_point).unwrap();
    note_wait_joined_capture(side.stream()).unwrap();
    increment(&kernels, &side, words.device(1));
    let held_with_it = events_in_use(&origin);
    let events = origin.event_pool();
    let (query, wait, parked_raw, taken_raws) = std::thread::scope(|scope| {
        scope
            .spawn(move || {
                let query = fork_point.query();
                let wait = fork_point.synchronize();
                let raw = fork_point.as_raw() as usize;
                drop(fork_point);
                let taken: Vec<_> = (0..64)
                    .map(|_| events.acquire_owned(false).unwrap())
                    .collect();
                let raws: Vec<usize> = taken.iter().map(|event| event.as_raw() as usize).collect();
                (query, wait, raw, raws)
            })
            .join()
            .unwrap()
    });
    let held_while_parked = events_in_use(&origin);
    capture.join(side.stream()).unwrap();
    increment(&kernels, &origin, words.device(0));
    let graph = capture
        .finish()
        .expect("the monitor's refused calls did not break the capture");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    origin.launch_graph(&exec).unwrap();
    origin.launch_graph(&exec).unwrap();
    origin.synchronize().unwrap();
    side.synchronize().unwrap();

    let query = query.expect_err("a query of an event recorded into an active capture");
    assert!(driver_refused(&query), "a typed capture refusal: {query}");
    let wait = wait.expect_err("a synchronize of an event recorded into an active capture");
    assert!(driver_refused(&wait), "a typed capture refusal: {wait}");
    assert!(
        !taken_raws.contains(&parked_raw),
        "the fork-point event dropped during the capture was handed out again while it ran"
    );
    assert!(
        held_while_parked >= held_with_it,
        "the dropped fork-point event went back to the free lists during the capture \
         ({held_with_it} in use with it, {held_while_parked} after its drop)"
    );
    assert_eq!(
        [words.read(0), words.read(1)],
        [4, 2],
        "two replays of two origin increments and one side increment"
    );
    assert!(
        poll_until(Duration::from_secs(10), || events_in_use(&origin)
            <= before + SLACK),
        "the parked event rejoined the pool after the capture: {} in use, {before} before",
        events_in_use(&origin)
    );
}

/// `torch.cuda.graph` blocks with a side stream ordered by `wait_stream` both ways, 500
/// ping-pongs per capture and ten captures: 10^4 waits recorded into captures. Each wait takes
/// an event of the shared pool, recorded into the capture and given back at once, so it is
/// parked until its capture ends. The pool grows for the first capture only: the later ones
/// reuse the events parked by the earlier ones (no more than a little slack created after the
/// first), nothing stays in use after the last, and every graph replays its 1,000 increments
/// exactly once.
#[test]
fn ten_thousand_captured_wait_streams_park_their_events_and_later_captures_reuse_them() {
    let name = "ten_thousand_captured_wait_streams_park_their_events_and_later_captures_reuse_them";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    const ROUNDS: u32 = 10;
    const PINGS: u32 = 500;
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let origin = Arc::clone(&pool.streams_of(StreamPriority::Normal)[0]);
    let side = Arc::clone(&pool.streams_of(StreamPriority::Normal)[1]);
    let words = Mapped::new(&gpu.context, 2);
    let before = events_in_use(&origin);
    let mut created_after_first = 0;
    let mut failures = Vec::new();
    for round in 0..ROUNDS {
        let capture = origin.begin_capture(global()).unwrap();
        for _ in 0..PINGS {
            increment(&kernels, &origin, words.device(0));
            side.wait_for(&origin).unwrap();
            increment(&kernels, &side, words.device(1));
            origin.wait_for(&side).unwrap();
        }
        match capture.finish() {
            Ok(graph) => {
                let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
                origin.launch_graph(&exec).unwrap();
                origin.synchronize().unwrap();
            }
            Err(error) => failures.push(format!("round {round}: {error}")),
        }
        if round == 0 {
            // Asking for utilization returns the events parked by the ended capture.
            let _ = events_in_use(&origin);
            created_after_first = events_created(&origin);
        }
    }
    side.synchronize().unwrap();
    assert!(failures.is_empty(), "captures failed: {failures:?}");
    assert_eq!(
        [words.read(0), words.read(1)],
        [ROUNDS * PINGS, ROUNDS * PINGS],
        "each graph's increments ran once per replay, none while captured"
    );
    let created_later = events_created(&origin) - created_after_first;
    assert!(
        created_later <= SLACK as u64,
        "captures after the first created {created_later} events instead of reusing the ones \
         parked by the earlier captures"
    );
    assert_eq!(origin.outstanding_work().unwrap(), 0);
    assert!(!side.has_pending_waits().unwrap());
    assert!(
        poll_until(Duration::from_secs(10), || events_in_use(&origin)
            <= before + SLACK),
        "{} events in use after ten captures, {before} before",
        events_in_use(&origin)
    );
}

// ---------------------------------------------------------------------------------------------
// The stream-ordered allocator around captures.
// ---------------------------------------------------------------------------------------------

/// What the RMM worker of the long-capture test saw.
struct ChurnOutcome {
    failure: Option<String>,
    peak_events: usize,
}

/// An RMM-style worker (allocate on `a`, use, hand to `b` with `add_stream_dependency`, hand
/// back, free on `a`) runs 10^4 iterations on two eager pool streams while the training thread
/// holds one global capture open the whole time on a stream of its own. Every call the worker
/// makes must work (allocations and frees are stream-ordered, waits and records break nothing),
/// the capture must end intact, the allocator's dependency list, the streams' markers (their
/// prune is skipped during the capture) and the pool's events stay bounded throughout, and
/// after the capture everything retires: no allocation outstanding, every dependency counted
/// and satisfied, no marker held.
#[test]
fn rmm_churn_on_eager_streams_through_one_long_global_capture_stays_bounded_and_retires() {
    let name =
        "rmm_churn_on_eager_streams_through_one_long_global_capture_stays_bounded_and_retires";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) || !has_memory_pools(&gpu, name) {
        return;
    }
    const ITERATIONS: u32 = 10_000;
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::RoundRobin).with_counts(0, 2, 0),
    )
    .unwrap();
    let a = Arc::clone(&pool.streams_of(StreamPriority::Normal)[0]);
    let b = Arc::clone(&pool.streams_of(StreamPriority::Normal)[1]);
    let capturing = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let allocator = StreamOrderedAllocator::default();
    let words = Mapped::new(&gpu.context, 3);
    let before = events_in_use(&a);

    let capture = capturing.begin_capture(global()).unwrap();
    increment(&kernels, &capturing, words.device(0));
    let (sender, receiver) = mpsc::channel();
    let outcome = std::thread::scope(|scope| {
        let (allocator, kernels, words, a, b) = (&allocator, &kernels, &words, &a, &b);
        scope.spawn(move || {
            let mut peak_events = 0;
            let mut run = || -> Result<(), String> {
                for i in 0..ITERATIONS {
                    let step = |what: &str, error: StreamError| format!("{i}: {what}: {error}");
                    let block = allocator
                        .allocate_for_stream(a, 64 << 10)
                        .map_err(|e| step("allocate", e))?;
                    bump(kernels, a, words.device(1)).map_err(|e| step("a's kernel", e))?;
                    allocator
                        .add_stream_dependency(b, a)
                        .map_err(|e| step("b after a", e))?;
                    bump(kernels, b, words.device(2)).map_err(|e| step("b's kernel", e))?;
                    allocator
                        .add_stream_dependency(a, b)
                        .map_err(|e| step("a after b", e))?;
                    allocator.free(block).map_err(|e| step("free", e))?;
                    if i % 500 == 499 {
                        peak_events = peak_events.max(events_in_use(a));
                    }
                }
                Ok(())
            };
            let failure = run().err();
            let _ = sender.send(ChurnOutcome {
                failure,
                peak_events,
            });
        });
        // The capture stays open (and on this thread) until the worker is done.
        let outcome = receiver.recv_timeout(Duration::from_secs(120));
        increment(kernels, &capturing, words.device(0));
        let finished = capture.finish();
        (outcome, finished)
    });
    let (outcome, finished) = outcome;
    let outcome = outcome.expect("the RMM worker finished (or reported) within 120 s");
    let graph = finished.expect("the worker's allocator calls must not break the global capture");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    capturing.launch_graph(&exec).unwrap();
    capturing.synchronize().unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();

    assert_eq!(
        outcome.failure, None,
        "the worker's calls during the capture"
    );
    assert_eq!(words.read(0), 2, "the graph ran its two increments once");
    assert_eq!(
        [words.read(1), words.read(2)],
        [ITERATIONS, ITERATIONS],
        "every eager kernel ran exactly once"
    );
    assert!(
        outcome.peak_events <= before + 2 * MAX_MARKERS + 2 + SLACK,
        "{} events in use during the capture ({before} before): markers or dependencies piled \
         up past their bounds",
        outcome.peak_events
    );
    assert_eq!(allocator.outstanding(), 0);
    let stats = allocator.stats();
    assert_eq!(stats.allocations, u64::from(ITERATIONS));
    assert_eq!(stats.frees, u64::from(ITERATIONS));
    assert_eq!(stats.dependencies, 2 * u64::from(ITERATIONS));
    assert!(allocator.dependencies_satisfied(&a).unwrap());
    assert!(allocator.dependencies_satisfied(&b).unwrap());
    assert_eq!(a.outstanding_work().unwrap(), 0);
    assert_eq!(b.outstanding_work().unwrap(), 0);
    assert!(
        poll_until(Duration::from_secs(10), || events_in_use(&a)
            <= before + SLACK),
        "{} events in use once everything retired, {before} before",
        events_in_use(&a)
    );
}

/// An RMM program allocates a scratch buffer with the stream-ordered allocator inside a
/// `torch.cuda.graph` capture (a graph allocation node), fills it and writes `2 * 1.5` into an
/// output allocated before the capture, and keeps the scratch past the capture, as outputs that
/// live in graph memory are. After the first replay the scratch is freed in stream order (legal
/// once the graph has run), but not while a second capture on the same owner stream runs: that
/// free is refused with a typed capture refusal, nothing recorded, the second capture intact and
/// the scratch still held. After it, the free goes through and the first graph replays again
/// (a graph whose allocation was freed may be relaunched), with the output exact each time.
#[test]
fn an_allocation_made_in_a_capture_outlives_it_and_is_freed_between_replays_not_during_another() {
    let name = "an_allocation_made_in_a_capture_outlives_it_and_is_freed_between_replays_not_during_another";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) || !has_memory_pools(&gpu, name) {
        return;
    }
    const N: usize = 1 << 16;
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let owner = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let allocator = StreamOrderedAllocator::default();
    let words = Mapped::new(&gpu.context, 1);
    let output = allocator.allocate_for_stream(&owner, N * 4).unwrap();
    let out = allocator.device_ptr(&output).unwrap();
    owner.synchronize().unwrap();

    let capture = owner.begin_capture(CaptureOptions::default()).unwrap();
    let scratch = allocator.allocate_for_stream(&owner, N * 4).unwrap();
    let scratch_ptr = allocator.device_ptr(&scratch).unwrap();
    // SAFETY: scratch and out hold N u32/f32 each; the scratch is a graph allocation used only
    // by this capture's work, the output lives until the end of the test.
    owner
        .launch(|s| unsafe { kernels.fill_u32(s, scratch_ptr, 1.5f32.to_bits(), N) })
        .unwrap();
    // SAFETY: as above; add_f32 reads the scratch twice and writes the output, no overlap.
    owner
        .launch(|s| unsafe { kernels.add_f32(s, scratch_ptr, scratch_ptr, out, N) })
        .unwrap();
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    owner.launch_graph(&exec).unwrap();
    owner.synchronize().unwrap();
    let first = read_u32(&gpu.context, out, N);
    assert!(
        first.iter().all(|&bits| bits == 3.0f32.to_bits()),
        "the first replay wrote 2 * 1.5 everywhere"
    );
    assert_eq!(allocator.outstanding(), 2);

    // A second capture on the owner: the scratch (made in the first) cannot be freed in it.
    let second = owner.begin_capture(CaptureOptions::default()).unwrap();
    increment(&kernels, &owner, words.device(0));
    let refusal = allocator
        .free(scratch)
        .expect_err("a free into another capture than the allocation's");
    assert!(refused(&refusal), "a typed capture refusal, got {refusal}");
    assert!(matches!(
        refusal.graph_error(),
        Some(GraphError::Capturing { .. })
    ));
    assert_eq!(
        allocator.outstanding(),
        2,
        "the refused free keeps the scratch held"
    );
    let second_graph = second
        .finish()
        .expect("the refused free recorded nothing into the second capture");
    let second_exec = second_graph
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    owner.launch_graph(&second_exec).unwrap();

    allocator
        .free(scratch)
        .expect("the scratch is freed once no capture on its owner runs");
    // SAFETY: out holds N u32s; only the owner's ordered work touches it.
    owner
        .launch(|s| unsafe { kernels.fill_u32(s, out, 0, N) })
        .unwrap();
    owner
        .launch_graph(&exec)
        .expect("a graph whose allocation was freed after its launch may be launched again");
    owner.synchronize().unwrap();
    let second_read = read_u32(&gpu.context, out, N);
    assert!(
        second_read.iter().all(|&bits| bits == 3.0f32.to_bits()),
        "the relaunch wrote 2 * 1.5 everywhere again"
    );
    assert_eq!(words.read(0), 1, "the second graph ran once");
    allocator.free(output).unwrap();
    owner.synchronize().unwrap();
    assert_eq!(allocator.outstanding(), 0);
    let stats = allocator.stats();
    assert_eq!((stats.allocations, stats.frees, stats.live), (2, 2, 0));
}

// ---------------------------------------------------------------------------------------------
// Synchronizing and profiling beside captures.
// ---------------------------------------------------------------------------------------------

/// A training loop captures forty `torch.cuda.graph` steps in global mode, each forking a side
/// stream into the capture and joining it back (`StreamCapture::fork` / `join`), while an
/// evaluation thread keeps queuing work on its own eager stream and calling
/// `torch.cuda.current_stream().synchronize()` on it. Each capture waits until the evaluation
/// thread has made another synchronize, so their calls overlap. A synchronize during a capture
/// may be refused, typed, never anything else; no capture may be broken; every graph replays
/// once; and every kernel the evaluation thread queued ran exactly once.
#[test]
fn a_synchronizing_thread_beside_forked_global_captures_breaks_none_and_loses_no_work() {
    let name = "a_synchronizing_thread_beside_forked_global_captures_breaks_none_and_loses_no_work";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    const ROUNDS: u32 = 40;
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let origin = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let side = PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap();
    let eager = PriorityStream::new(&gpu.context, StreamPriority::High).unwrap();
    let words = Mapped::new(&gpu.context, 3);
    let stop = AtomicBool::new(false);
    let attempts = AtomicU64::new(0);
    let mut capture_failures = Vec::new();
    let mut execs = Vec::new();
    let (queued, refusals, others) = std::thread::scope(|scope| {
        let evaluator = scope.spawn(|| {
            let (mut queued, mut refusals, mut others) = (0u32, 0u32, Vec::new());
            while !stop.load(Ordering::Acquire) {
                if let Err(error) = bump(&kernels, &eager, words.device(2)) {
                    others.push(format!("queue: {error}"));
                    break;
                }
                queued += 1;
                match eager.synchronize() {
                    Ok(()) => {}
                    Err(error) if refused(&error) => refusals += 1,
                    Err(error) => others.push(format!("synchronize: {error}")),
                }
                attempts.fetch_add(1, Ordering::AcqRel);
            }
            (queued, refusals, others)
        });
        for round in 0..ROUNDS {
            let mut capture = origin.begin_capture(global()).unwrap();
            increment(&kernels, &origin, words.device(0));
            let seen = attempts.load(Ordering::Acquire);
            let overlapped = poll_until(Duration::from_secs(10), || {
                attempts.load(Ordering::Acquire) > seen || evaluator.is_finished()
            });
            let forked = capture.fork(side.stream());
            if forked.is_ok() {
                increment(&kernels, &side, words.device(1));
                if let Err(error) = capture.join(side.stream()) {
                    capture_failures.push(format!("round {round} join: {error}"));
                }
            } else if let Err(error) = forked {
                capture_failures.push(format!("round {round} fork: {error}"));
            }
            match capture.finish() {
                Ok(graph) => execs.push(graph.instantiate(&InstantiateOptions::default()).unwrap()),
                Err(error) => capture_failures.push(format!("round {round}: {error}")),
            }
            assert!(overlapped, "the evaluation thread made no call in 10 s");
        }
        stop.store(true, Ordering::Release);
        evaluator.join().unwrap()
    });
    for exec in &execs {
        origin.launch_graph(exec).unwrap();
    }
    origin.synchronize().unwrap();
    side.synchronize().unwrap();
    eager.synchronize().unwrap();

    assert!(
        capture_failures.is_empty(),
        "captures broken beside the synchronizing thread: {capture_failures:?}"
    );
    assert!(others.is_empty(), "untyped failures: {others:?}");
    assert!(refusals <= queued);
    assert_eq!(
        [words.read(0), words.read(1)],
        [ROUNDS, ROUNDS],
        "each graph's origin and side kernels ran once, at its replay"
    );
    assert_eq!(
        words.read(2),
        queued,
        "every kernel the evaluation thread queued ran exactly once"
    );
}

/// `torch.cuda.make_graphed_callables` profiled: the side stream waits for the main stream,
/// three warmup steps run on it eagerly (profiled), the main stream waits for the side, then the
/// step is captured in global mode on the main stream with the side stream forked in (the
/// profiled calls inside the capture are recorded into the graph, not profiled), and the graph
/// replays five times, each replay profiled. The profiler reports exactly the three warmups and
/// the five replays, nothing pending or skipped; the streams count only their eager work; and
/// the words show three eager steps plus five replays of both streams' kernels.
#[test]
fn a_profiled_graphed_callable_warmup_reports_eager_steps_and_replays_only() {
    let name = "a_profiled_graphed_callable_warmup_reports_eager_steps_and_replays_only";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let main = Arc::clone(&pool.streams_of(StreamPriority::Normal)[0]);
    let side = Arc::clone(&pool.streams_of(StreamPriority::Normal)[1]);
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    let words = Mapped::new(&gpu.context, 2);
    let step = |stream: &PriorityStream, word: usize| bump(&kernels, stream, words.device(word));

    side.wait_for(&main).unwrap();
    for _ in 0..3 {
        profiler
            .profile(&side, "warmup", OperationKind::KernelLaunch, 0, |s| {
                step(s, 0)
            })
            .unwrap();
    }
    main.wait_for(&side).unwrap();
    let mut capture = main.begin_capture(global()).unwrap();
    profiler
        .profile(&main, "step", OperationKind::KernelLaunch, 0, |s| {
            step(s, 0)
        })
        .unwrap();
    capture.fork(side.stream()).unwrap();
    profiler
        .profile(&side, "side step", OperationKind::KernelLaunch, 0, |s| {
            step(s, 1)
        })
        .unwrap();
    capture.join(side.stream()).unwrap();
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..5 {
        profiler
            .profile(&main, "replay", OperationKind::GraphLaunch, 0, |s| {
                s.launch_graph(&exec)
            })
            .unwrap();
    }
    let operations = profiler.operations().unwrap();
    main.synchronize().unwrap();
    side.synchronize().unwrap();

    let mut names: HashMap<&str, usize> = HashMap::new();
    for operation in &operations {
        *names.entry(operation.name.as_str()).or_default() += 1;
    }
    assert_eq!(
        names,
        HashMap::from([("warmup", 3), ("replay", 5)]),
        "only the eager warmups and the replays are profiled"
    );
    assert!(
        operations
            .iter()
            .filter(|op| op.name == "replay")
            .all(|op| op.stream == main.id() && op.kind == OperationKind::GraphLaunch)
    );
    assert_eq!(profiler.pending(), 0);
    assert_eq!(profiler.skipped(), 0);
    let (main_metrics, side_metrics) = (main.metrics().unwrap(), side.metrics().unwrap());
    assert_eq!(
        (main_metrics.kernel_launches, main_metrics.graph_launches),
        (0, 5),
        "the main stream counts its replays, not the captured step"
    );
    assert_eq!(
        side_metrics.kernel_launches, 3,
        "the side stream counts its warmups, not its captured step"
    );
    assert_eq!(
        [words.read(0), words.read(1)],
        [3 + 5, 5],
        "three eager warmups, then five replays of both streams' captured steps"
    );
    assert_eq!(main.outstanding_work().unwrap(), 0);
    assert_eq!(side.outstanding_work().unwrap(), 0);
}

/// A multi-model server captures one CUDA graph per pool stream at the same time, each on its
/// own thread (`MultiStreamCoordinator::execute_parallel`, thread-local mode as
/// `torch.cuda.graph(capture_error_mode="thread_local")` does), ten rounds: each thread begins
/// a capture (the begins synchronise the context only when no capture of it runs, and never
/// break another thread's), records one increment, ends it, instantiates, replays twice and
/// synchronizes its stream while the other threads may still be capturing. Every round must
/// succeed on every thread, each stream's word must show exactly two replays per round, and
/// each stream counts exactly its graph launches, with nothing left outstanding.
#[test]
fn four_threads_capturing_their_own_pool_streams_at_once_all_replay_exactly() {
    let name = "four_threads_capturing_their_own_pool_streams_at_once_all_replay_exactly";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    const ROUNDS: u32 = 10;
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::RoundRobin).with_counts(0, 4, 0),
    )
    .unwrap();
    let streams: Vec<Arc<PriorityStream>> = pool.streams_of(StreamPriority::Normal).to_vec();
    let ids: Vec<u64> = streams.iter().map(|stream| stream.id()).collect();
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let words = Mapped::new(&gpu.context, streams.len());
    let ran = coordinator.execute_parallel(|stream| {
        let word = words.device(ids.iter().position(|&id| id == stream.id()).unwrap());
        for _ in 0..ROUNDS {
            let capture = stream.begin_capture(CaptureOptions::default())?;
            bump(&kernels, stream, word)?;
            let graph = capture.finish()?;
            let exec = graph.instantiate(&InstantiateOptions::default())?;
            stream.launch_graph(&exec)?;
            stream.launch_graph(&exec)?;
            stream.synchronize()?;
        }
        Ok(())
    });
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    ran.expect("every thread's ten captures, replays and synchronizations");
    for (i, stream) in streams.iter().enumerate() {
        assert_eq!(
            words.read(i),
            2 * ROUNDS,
            "stream {i}: two replays per round"
        );
        let metrics = stream.metrics().unwrap();
        assert_eq!(
            (metrics.graph_launches, metrics.kernel_launches),
            (u64::from(2 * ROUNDS), 0),
            "stream {i} counts its replays, not its captured launches"
        );
        assert_eq!(stream.outstanding_work().unwrap(), 0);
    }
}

// ---------------------------------------------------------------------------------------------
// No GPU needed.
// ---------------------------------------------------------------------------------------------

/// A program that classifies failures before retrying (a scheduler that retries "not now"
/// and gives up on anything else) relies on `is_capture_refusal` and `graph_error` agreeing,
/// through both layers the stream crate wraps, for the refusals these probes expect: a
/// `Capturing` refusal is "not now" and found as a graph error; `UnjoinedFork` (an unfinished
/// capture) is a graph error but not "not now"; a wrong argument is neither. No driver is
/// needed.
#[test]
fn capture_refusals_and_broken_captures_are_told_apart_through_both_layers() {
    let capturing = || {
        DriverError::from(GraphError::Capturing {
            operation: "Stream::query",
            reason: "a probe",
        })
    };
    for error in [
        StreamError::from(capturing()),
        StreamError::from(cuweave_memory::MemoryError::Driver(capturing())),
    ] {
        assert!(refused(&error), "{error}");
        assert!(matches!(
            error.graph_error(),
            Some(GraphError::Capturing { .. })
        ));
    }
    let unjoined = StreamError::from(DriverError::from(GraphError::UnjoinedFork));
    assert!(!refused(&unjoined));
    assert_eq!(unjoined.graph_error(), Some(&GraphError::UnjoinedFork));
    let invalid = StreamError::NoStreamForWorkload {
        workload: WorkloadType::Memory,
    };
    assert!(!refused(&invalid));
    assert!(invalid.graph_error().is_none());
}
