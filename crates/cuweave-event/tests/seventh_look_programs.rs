//! A seventh look at the event layer, aimed at this round's changes: the coordinator's polls
//! and GPU-time harvests made inside `outside_captures` (skipped, as "not yet", while any
//! capture begun through cuweave is active or beginning), the reactor's own queries (relaxed
//! capture mode, else `outside_captures`), and the completion words' wake check.
//!
//! What an async inference server does: many tasks await events while a graph is captured and
//! replayed on another thread; a coordinator runs dependent operations across streams for 10^4
//! steps meanwhile; requests time out under load; barriers span pool streams while another
//! thread captures. The questions: do futures and callbacks still resolve during those
//! captures, and does the coordinator retire (and run the callbacks of) what it skipped once
//! they end, without a later call from the program?
//!
//! Every outcome is the GPU's or the public API's: kernels that wait on mapped words, then store
//! into them; counters read after `poll_until` with generous limits. Every GPU test takes
//! `serial()`.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use common::{Flags, MS, gate, read_u32s, register_kernel, store_after, within};
use cuweave_driver::memory::DeviceAllocation;
use cuweave_driver::{CaptureMode, DriverError, InstantiateOptions};
use cuweave_event::{
    AsyncEventWaiter, CrossStreamBarrier, EventError, EventPool, OperationCoordinator,
    OperationState, WaitOptions, WakeMechanism,
};
use cuweave_stream::{AllocationStrategy, StreamPool, StreamPoolConfig, StreamPriority};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{poll_until, require_gpu, serial};

/// A capture held open on its own thread (what a server's graph-building thread does while the
/// request threads go on): begun in `mode` on a fresh stream with one short kernel in it, ended
/// when [`HeldCapture::end`] is called, which returns the graph's node count (1 when nothing
/// else was recorded into it and nothing broke it).
struct HeldCapture {
    end: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<Result<usize, DriverError>>,
}

impl HeldCapture {
    fn begin(
        context: &Arc<cuweave_driver::Context>,
        kernels: &Arc<TestKernels>,
        mode: CaptureMode,
    ) -> Self {
        let stream = common::stream(context);
        let kernels = Arc::clone(kernels);
        let (began_tx, began_rx) = mpsc::channel();
        let (end, end_rx) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            stream.begin_capture(mode).unwrap();
            kernels.spin_ns(&stream, 1000).unwrap();
            began_tx.send(()).unwrap();
            end_rx.recv().unwrap();
            stream.end_capture().and_then(|graph| graph.node_count())
        });
        began_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the capture thread began its capture");
        Self { end, thread }
    }

    fn end(self) -> Result<usize, DriverError> {
        self.end.send(()).unwrap();
        self.thread.join().unwrap()
    }
}

/// A callback that counts its `Ok` calls (and panics on an error, which the coordinator
/// contains and counts in `callback_panics`).
fn counting(
    calls: &Arc<AtomicUsize>,
) -> impl FnOnce(cuweave_event::OperationId, cuweave_event::WaitResult) + Send + 'static {
    let calls = Arc::clone(calls);
    move |_, result| {
        result.expect("the callback was told a failure");
        calls.fetch_add(1, Ordering::SeqCst);
    }
}

/// A training step captured into a graph on the stream that just ran an eager warm-up step
/// (PyTorch's warm-up iterations, then `torch.cuda.graph` on the same side stream): the eager
/// step (no callback) is held on the GPU by a gate when the capture begins; the captured step
/// gets a completion callback that tells the program the graph is built. The capture ends;
/// the waiter watched for its end and polled once (its `pending()` reaches 0), finding the
/// eager step still running in front of the captured one on the stream's queue. The gate then
/// opens and the program makes no coordinator call: it only waits for the callback, as
/// `complete_operation`'s docs promise ("the waiter watches for that end, so that callbacks
/// need no later coordinator call").
///
/// Expected: the callback runs once within 5 s of the gate opening. Suspected: the capture-end
/// watch polls once; the eager step in front is "not yet" then, and nothing ever polls again
/// (the eager step has no callback, so the waiter does not watch it), so the callback waits
/// for an unrelated coordinator call.
#[test]
fn a_captured_steps_callback_behind_a_gated_eager_step_runs_once_the_gate_opens() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let (coordinator, waiter, _pool) = common::coordinator(context);
    let stream = common::stream(context);
    kernels.spin_ns(&stream, 0).unwrap();
    stream.synchronize().unwrap();
    let flags = Flags::new(context, 1);

    let eager = register_kernel(&coordinator, &[], "eager warm-up step");
    coordinator.begin_operation(eager, &stream).unwrap();
    gate(&kernels, &stream, flags.device(0));
    coordinator.complete_operation(eager).unwrap();

    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let captured = register_kernel(&coordinator, &[], "captured step");
    coordinator.begin_operation(captured, &stream).unwrap();
    kernels.spin_ns(&stream, 1000).unwrap();
    coordinator.complete_operation(captured).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    coordinator.on_complete(captured, counting(&calls)).unwrap();
    let graph = stream.end_capture().unwrap();
    assert_eq!(graph.node_count().unwrap(), 1);
    common::settle(&waiter, "the capture-end watch");

    flags.write(0, 1);
    let ran = poll_until(Duration::from_secs(5), || calls.load(Ordering::SeqCst) == 1);
    // What a coordinator call does, for the report.
    stream.synchronize().unwrap();
    let state = coordinator.state(captured).unwrap();
    let after_call = calls.load(Ordering::SeqCst);
    assert!(
        ran,
        "the captured step's callback did not run within 5 s of the eager step in front of it \
         finishing, with no coordinator call made (after one: state {state:?}, {after_call} \
         calls)"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "ran more than once");
    assert_eq!(coordinator.state(eager).unwrap(), OperationState::Completed);
    assert_eq!(coordinator.live_operations(), 0);
}

/// Two graph builders at once (a server capturing a decode graph per batch size on two
/// threads): thread B holds a capture on its own stream; this thread ran an eager step on its
/// stream (finished on the GPU, no callback), then captures the next step there with a
/// completion callback and ends its capture. The waiter's capture-end watch fires while B's
/// capture is still active, so the poll it makes keeps out of captures and skips the eager
/// step's query. B then ends its capture; the program makes no coordinator call.
///
/// Expected: the callback runs within 5 s of B's capture ending (the docs: captured
/// operations' callbacks need no later coordinator call); B's capture is not broken.
/// Suspected: the one poll the watch makes was skipped (`outside_captures` refused it) and
/// nothing polls again.
#[test]
fn a_captured_steps_callback_runs_once_another_threads_capture_ends_too() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).unwrap());
    let (coordinator, waiter, _pool) = common::coordinator(context);
    let stream = common::stream(context);

    let eager = register_kernel(&coordinator, &[], "eager step");
    coordinator.begin_operation(eager, &stream).unwrap();
    kernels.spin_ns(&stream, 1000).unwrap();
    coordinator.complete_operation(eager).unwrap();
    stream.synchronize().unwrap();

    let other = HeldCapture::begin(context, &kernels, CaptureMode::ThreadLocal);
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let captured = register_kernel(&coordinator, &[], "captured step");
    coordinator.begin_operation(captured, &stream).unwrap();
    kernels.spin_ns(&stream, 1000).unwrap();
    coordinator.complete_operation(captured).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    coordinator.on_complete(captured, counting(&calls)).unwrap();
    let graph = stream.end_capture().unwrap();
    common::settle(&waiter, "the capture-end watch");
    let during = calls.load(Ordering::SeqCst);
    assert_eq!(other.end(), Ok(1), "the other thread's capture was broken");

    let ran = poll_until(Duration::from_secs(5), || calls.load(Ordering::SeqCst) == 1);
    let state = coordinator.state(captured).unwrap();
    assert!(
        ran,
        "the captured step's callback did not run within 5 s of every capture ending, with no \
         coordinator call made (ran {during} times while the other capture was active; after \
         a call: state {state:?}, {} calls)",
        calls.load(Ordering::SeqCst)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(graph.node_count().unwrap(), 1);
    assert_eq!(coordinator.live_operations(), 0);
}

/// An inference server keeps serving while its graph thread captures in global mode
/// (`torch.cuda.graph`'s default): 500 dependent requests alternate between two streams, each
/// incrementing one buffer; every 50th request's completion future is awaited during the
/// capture. The coordinator's own polls keep out of the capture (nothing retires meanwhile),
/// but the futures resolve through the reactor's relaxed mode. The capture ends unbroken (one
/// node); then, after one `retire_finished`, every request has completed and retired, the
/// buffer reads exactly 500 everywhere, and the event pool made up front never grew.
#[test]
fn requests_during_another_threads_global_capture_resolve_then_retire_after_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    const STEPS: usize = 500;
    const N: usize = 256;
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).unwrap());
    let pool = EventPool::new(context, STEPS + 64, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(pool.clone(), Arc::clone(&waiter));
    let lanes = common::streams(context, 2);
    let data = common::filled(context, N, 0);
    // Warm the waiter (its relaxed mode, slab, sleeper) outside the capture.
    futures::executor::block_on(waiter.stream_idle(&lanes[0]).unwrap()).unwrap();
    let grown_before = pool.counters().grown;

    let capture = HeldCapture::begin(context, &kernels, CaptureMode::Global);
    let mut previous = Vec::new();
    let mut futures = Vec::new();
    let mut last = None;
    for step in 0..STEPS {
        let op = register_kernel(&coordinator, &previous, "request");
        let lane = &lanes[step % 2];
        coordinator.begin_operation(op, lane).unwrap();
        // SAFETY: `data` holds N u32s and outlives the streams' work (synchronised below).
        unsafe { kernels.increment_u32(lane, data.ptr(), N).unwrap() };
        coordinator.complete_operation(op).unwrap();
        if step % 50 == 49 {
            futures.push(coordinator.completion(op).unwrap());
        }
        previous = vec![op];
        last = Some(op);
    }
    let results = within(Duration::from_secs(10), move || {
        futures
            .into_iter()
            .map(futures::executor::block_on)
            .collect::<Vec<_>>()
    });
    let live_during = coordinator.live_operations();
    let graph = capture.end();

    assert!(
        results.iter().all(Result::is_ok),
        "completion futures failed during the capture: {results:?}"
    );
    assert_eq!(results.len(), STEPS / 50);
    assert_eq!(graph, Ok(1), "the requests broke the global capture");
    for lane in &lanes {
        lane.synchronize().unwrap();
    }
    coordinator.retire_finished();
    assert_eq!(
        coordinator.state(last.unwrap()).unwrap(),
        OperationState::Completed
    );
    assert_eq!(
        coordinator.live_operations(),
        0,
        "{live_during} live during the capture; not all retired after it"
    );
    let metrics = coordinator.metrics();
    assert_eq!((metrics.completed, metrics.failed), (STEPS as u64, 0));
    assert!(
        read_u32s(context, data.ptr(), N)
            .iter()
            .all(|&v| v == STEPS as u32)
    );
    assert_eq!(pool.counters().grown, grown_before, "the pool grew");
    common::settle(&waiter, "the completion futures");
}

/// A decode loop of 10^4 dependent steps hopping between two streams while another thread
/// captures, instantiates and replays a small graph over and over (thread-local mode: a CUDA
/// graph per request shape). The coordinator's polls keep out of each capture, so they are
/// skipped part of the time. Sampled every 1000 steps, the live operations stay bounded (the
/// polls between captures retire what the GPU finished); at the end everything retires, every
/// step counted completed, and the buffer reads exactly 10^4.
#[test]
fn ten_thousand_steps_beside_a_capture_and_replay_loop_are_exact_bounded_and_retire() {
    let gpu = require_gpu!();
    let _serial = serial();
    const STEPS: usize = 10_000;
    const N: usize = 64;
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).unwrap());
    let (coordinator, _waiter, _pool) = common::coordinator(context);
    let lanes = common::streams(context, 2);
    let data = common::filled(context, N, 0);

    let stop = Arc::new(AtomicBool::new(false));
    let replays = Arc::new(AtomicUsize::new(0));
    let replayer = std::thread::spawn({
        let (kernels, stop, replays) = (
            Arc::clone(&kernels),
            Arc::clone(&stop),
            Arc::clone(&replays),
        );
        let stream = common::stream(context);
        move || -> Result<(), DriverError> {
            while !stop.load(Ordering::SeqCst) {
                stream.begin_capture(CaptureMode::ThreadLocal)?;
                kernels.spin_ns(&stream, 2000)?;
                let graph = stream.end_capture()?;
                let exec = graph.instantiate(&InstantiateOptions::default())?;
                exec.launch(&stream)?;
                stream.synchronize()?;
                replays.fetch_add(1, Ordering::SeqCst);
            }
            Ok(())
        }
    });

    let mut previous = Vec::new();
    let mut max_live = 0;
    for step in 0..STEPS {
        let op = register_kernel(&coordinator, &previous, "decode step");
        let lane = &lanes[(step / 3) % 2];
        coordinator.begin_operation(op, lane).unwrap();
        // SAFETY: `data` holds N u32s and outlives the streams' work (synchronised below).
        unsafe { kernels.increment_u32(lane, data.ptr(), N).unwrap() };
        coordinator.complete_operation(op).unwrap();
        previous = vec![op];
        if step % 1000 == 999 {
            max_live = max_live.max(coordinator.live_operations());
        }
    }
    stop.store(true, Ordering::SeqCst);
    replayer.join().unwrap().expect("the replay loop failed");
    for lane in &lanes {
        lane.synchronize().unwrap();
    }
    coordinator.retire_finished();
    assert!(replays.load(Ordering::SeqCst) > 0, "no graph was replayed");
    assert_eq!(coordinator.live_operations(), 0);
    let metrics = coordinator.metrics();
    assert_eq!((metrics.completed, metrics.failed), (STEPS as u64, 0));
    assert!(
        max_live < STEPS / 2,
        "{max_live} operations live at a sample: the polls between captures retired nothing"
    );
    assert!(
        read_u32s(context, data.ptr(), N)
            .iter()
            .all(|&v| v == STEPS as u32)
    );
}

/// Request deadlines under a global capture on another thread (a server builds a graph while
/// clients with 5 ms deadlines wait on a stream a gate holds): 100 callback waits with a 5 ms
/// timeout and 100 without on one gated event, plus 20 stream futures with a 5 ms timeout and
/// 20 without, all made during the capture. The timed ones time out (`TimedOut`, never a
/// failure, never `Ok` before the gate opens); once the gate opens the others complete `Ok`,
/// still during the capture. The books balance (every wait in exactly one counter), nothing
/// stays pending, and the capture ends unbroken.
#[test]
fn deadlines_and_completions_during_another_threads_global_capture_balance() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).unwrap());
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let pool = EventPool::new(context, 8, 0).unwrap();
    let gated = common::stream(context);
    let flags = Flags::new(context, 2);
    futures::executor::block_on(waiter.stream_idle(&gated).unwrap()).unwrap();
    // The blocking-sync events the completion words record behind each wait (their check of
    // the stream's last one is skipped during the capture) exist before it: nothing below
    // needs the driver to make an event while the capture runs.
    let shared = EventPool::for_context(context).unwrap();
    let warm: Vec<_> = (0..48)
        .map(|_| shared.acquire_blocking_owned().unwrap())
        .collect();
    drop(warm);
    gate(&kernels, &gated, flags.device(0));
    store_after(&kernels, &gated, 0, flags.device(1), 7);
    let event = Arc::new(pool.acquire_owned(false).unwrap());
    event.record(&gated).unwrap();
    let before = waiter.stats();

    let capture = HeldCapture::begin(context, &kernels, CaptureMode::Global);
    let (ok, timed_out, other) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let sort = |result: cuweave_event::WaitResult,
                ok: &AtomicUsize,
                timed_out: &AtomicUsize,
                other: &AtomicUsize| match result {
        Ok(()) => ok.fetch_add(1, Ordering::SeqCst),
        Err(EventError::TimedOut { .. }) => timed_out.fetch_add(1, Ordering::SeqCst),
        Err(_) => other.fetch_add(1, Ordering::SeqCst),
    };
    for timed in [true, false] {
        for _ in 0..100 {
            let (ok, timed_out, other) =
                (Arc::clone(&ok), Arc::clone(&timed_out), Arc::clone(&other));
            let callback = move |result| {
                sort(result, &ok, &timed_out, &other);
            };
            if timed {
                waiter.wait_async_timeout(Arc::clone(&event), Duration::from_millis(5), callback);
            } else {
                waiter.wait_async(Arc::clone(&event), callback);
            }
        }
    }
    let timed_futures: Vec<_> = (0..20)
        .map(|_| {
            waiter
                .stream_idle_with(
                    &gated,
                    WaitOptions::new(WakeMechanism::CompletionWord)
                        .with_timeout(Duration::from_millis(5)),
                )
                .unwrap()
        })
        .collect();
    let plain_futures: Vec<_> = (0..20)
        .map(|_| waiter.stream_idle(&gated).unwrap())
        .collect();
    let timed_results = within(Duration::from_secs(10), move || {
        timed_futures
            .into_iter()
            .map(futures::executor::block_on)
            .collect::<Vec<_>>()
    });
    let all_timed_out = poll_until(Duration::from_secs(10), || {
        timed_out.load(Ordering::SeqCst) == 100
    });
    let early = (ok.load(Ordering::SeqCst), flags.read(1));
    flags.write(0, 1);
    let plain_results = within(Duration::from_secs(10), move || {
        plain_futures
            .into_iter()
            .map(futures::executor::block_on)
            .collect::<Vec<_>>()
    });
    let all_ok = poll_until(Duration::from_secs(10), || ok.load(Ordering::SeqCst) == 100);
    let graph = capture.end();

    assert!(
        all_timed_out,
        "{} of 100 callbacks timed out",
        timed_out.load(Ordering::SeqCst)
    );
    assert_eq!(early, (0, 0), "a wait completed before the gate opened");
    assert!(
        timed_results
            .iter()
            .all(|result| matches!(result, Err(EventError::TimedOut { .. }))),
        "{timed_results:?}"
    );
    assert!(
        all_ok,
        "{} of 100 callbacks completed",
        ok.load(Ordering::SeqCst)
    );
    assert!(plain_results.iter().all(Result::is_ok), "{plain_results:?}");
    assert_eq!(other.load(Ordering::SeqCst), 0, "a wait failed");
    assert_eq!(flags.read(1), 7);
    assert_eq!(graph, Ok(1), "the waits broke the global capture");
    common::settle(&waiter, "deadline waits");
    let after = waiter.stats();
    assert_eq!(after.registered - before.registered, 240);
    assert_eq!(after.timed_out - before.timed_out, 120);
    assert_eq!(after.completed - before.completed, 120);
    assert_eq!(after.failed - before.failed, 0);
    gated.synchronize().unwrap();
}

/// A barrier across a stream pool's streams queued while another thread holds a global-mode
/// capture (a server syncs its worker streams between batches while the graph thread
/// captures): one pool stream is gated and then stores a flag; after the barrier another pool
/// stream copies the flag. The barrier's device waits are queued fine during the capture; its
/// host wait is refused with a capture refusal (the driver forbids the synchronisation on this
/// thread), leaving the capture valid. The gate opens, the capture ends with its one node, and
/// then the host wait succeeds and the copy saw the flag: ordered by the barrier, not by luck.
#[test]
fn a_barrier_over_pool_streams_during_another_threads_global_capture_orders_and_refuses_host_waits()
{
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).unwrap());
    let stream_kernels = StreamKernels::load(context).unwrap();
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::RoundRobin).with_counts(1, 2, 1),
    )
    .unwrap();
    let workers = pool.streams_of(StreamPriority::Normal).to_vec();
    assert_eq!(workers.len(), 2);
    let events = EventPool::new(context, 8, 0).unwrap();
    let barrier = CrossStreamBarrier::from_streams(workers.clone(), events.clone()).unwrap();
    let flags = Flags::new(context, 3);

    let capture = HeldCapture::begin(context, &kernels, CaptureMode::Global);
    common::hold(&kernels, &workers[0], flags.device(0));
    workers[0]
        .launch(|s| {
            store_after(&kernels, s, 2 * MS, flags.device(1), 0xBEEF);
            Ok::<(), DriverError>(())
        })
        .unwrap();
    barrier.queue().unwrap();
    workers[1]
        .launch(|s| {
            common::copy_flag(&stream_kernels, s, flags.device(1), flags.device(2));
            Ok::<(), DriverError>(())
        })
        .unwrap();
    let refused = barrier.synchronize();
    flags.write(0, 1);
    let graph = capture.end();

    let error = refused.expect_err("a host wait during a global capture was accepted");
    assert!(error.is_capture_refusal(), "{error:?}");
    assert_eq!(graph, Ok(1), "the barrier broke the global capture");
    within(Duration::from_secs(10), move || barrier.synchronize())
        .expect("the barrier's host wait after the capture");
    assert_eq!(flags.read(2), 0xBEEF, "the copy ran before the gated store");
    assert_eq!(events.utilization().in_use, 0, "barrier events returned");
}

/// Completion futures made before a global capture on another thread begins and awaited
/// after it ended, under a multi-threaded tokio runtime (64 tasks, a server's request
/// handlers): their operations finished on the GPU during the capture (the coordinator could
/// not poll meanwhile). Every task's future resolves `Ok` once the gates open, none before;
/// then the coordinator retires everything with one call.
#[test]
fn tokio_tasks_awaiting_operations_that_finish_during_a_global_capture_all_resolve() {
    let gpu = require_gpu!();
    let _serial = serial();
    const TASKS: usize = 64;
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).unwrap());
    let (coordinator, waiter, _pool) = common::coordinator(context);
    let lanes = common::streams(context, 4);
    let flags = Arc::new(Flags::new(context, 1 + TASKS));
    futures::executor::block_on(waiter.stream_idle(&lanes[0]).unwrap()).unwrap();
    let mut futures = Vec::new();
    for task in 0..TASKS {
        let lane = &lanes[task % lanes.len()];
        let op = register_kernel(&coordinator, &[], "request");
        coordinator.begin_operation(op, lane).unwrap();
        gate(&kernels, lane, flags.device(0));
        store_after(&kernels, lane, 0, flags.device(1 + task), task as u32 + 1);
        coordinator.complete_operation(op).unwrap();
        futures.push((task, coordinator.completion(op).unwrap()));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let capture = HeldCapture::begin(context, &kernels, CaptureMode::Global);
    let handles: Vec<_> = futures
        .into_iter()
        .map(|(task, future)| {
            let flags = Arc::clone(&flags);
            runtime.spawn(async move {
                let result = future.await;
                (result, flags.read(1 + task) == task as u32 + 1)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(20));
    let early = handles.iter().filter(|handle| handle.is_finished()).count();
    flags.write(0, 1);
    let results = runtime.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), async {
            let mut results = Vec::new();
            for handle in handles {
                results.push(handle.await.unwrap());
            }
            results
        })
        .await
    });
    let graph = capture.end();

    assert_eq!(early, 0, "a future resolved before its gate opened");
    let results = results.expect("the futures did not resolve within 10 s");
    assert!(
        results.iter().all(|(result, saw)| result.is_ok() && *saw),
        "{results:?}"
    );
    assert_eq!(graph, Ok(1));
    for lane in &lanes {
        lane.synchronize().unwrap();
    }
    coordinator.retire_finished();
    assert_eq!(coordinator.live_operations(), 0);
    assert_eq!(coordinator.metrics().completed, TASKS as u64);
}

/// A data-parallel step's operations recorded into a capture, a callback each, the graph then
/// replayed 50 times, then an eager step behind the replays on the same stream, depending on
/// the last captured operation: every captured operation's callback runs exactly once (at the
/// capture's end, with no coordinator call, not per replay), the eager one's once after the
/// replays, and the replays' work reads exact: each of 50 launches incremented the buffer once.
#[test]
fn captured_callbacks_run_once_however_often_the_graph_is_replayed() {
    let gpu = require_gpu!();
    let _serial = serial();
    const N: usize = 1024;
    const REPLAYS: u32 = 50;
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let (coordinator, waiter, _pool) = common::coordinator(context);
    let stream = common::stream(context);
    let data: DeviceAllocation = common::filled(context, N, 0);
    kernels.spin_ns(&stream, 0).unwrap();
    stream.synchronize().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));

    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let mut previous = Vec::new();
    for _ in 0..4 {
        let op = register_kernel(&coordinator, &previous, "captured layer");
        coordinator.begin_operation(op, &stream).unwrap();
        coordinator.complete_operation(op).unwrap();
        coordinator.on_complete(op, counting(&calls)).unwrap();
        previous = vec![op];
    }
    // SAFETY: `data` holds N u32s and outlives every launch (synchronised below).
    unsafe { kernels.increment_u32(&stream, data.ptr(), N).unwrap() };
    let graph = stream.end_capture().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    assert!(
        poll_until(Duration::from_secs(5), || calls.load(Ordering::SeqCst) == 4),
        "{} of 4 captured callbacks ran after the capture ended",
        calls.load(Ordering::SeqCst)
    );
    for _ in 0..REPLAYS {
        exec.launch(&stream).unwrap();
    }
    let eager = register_kernel(&coordinator, &previous, "eager after the replays");
    coordinator.begin_operation(eager, &stream).unwrap();
    kernels.spin_ns(&stream, 1000).unwrap();
    coordinator.complete_operation(eager).unwrap();
    coordinator.on_complete(eager, counting(&calls)).unwrap();
    assert!(
        poll_until(Duration::from_secs(10), || calls.load(Ordering::SeqCst)
            == 5),
        "the eager step's callback did not run"
    );
    stream.synchronize().unwrap();
    common::settle(&waiter, "callbacks");
    assert_eq!(calls.load(Ordering::SeqCst), 5, "a callback ran per replay");
    assert!(
        read_u32s(context, data.ptr(), N)
            .iter()
            .all(|&v| v == REPLAYS)
    );
    assert_eq!(coordinator.live_operations(), 0);
}

/// A profiler's completion callback (timing on, as `torch.cuda.Event(enable_timing=True)`
/// users do) logs each step's GPU time while the graph thread holds a global-mode capture:
/// a 5 ms step is begun, completed and given a callback that reads the step's metadata. The
/// coordinator harvests GPU times before it runs callbacks "so that a callback already finds
/// its operation's" (`observe.rs`), and the waiter's reactor (relaxed capture mode) decides the
/// step during the capture.
///
/// Expected: the callback runs during the capture and sees a GPU time of at least 5 ms; after
/// the capture ends and one `retire_finished`, the metrics hold one timed kernel of at least
/// 5 ms. Suspected: the harvest runs inside `outside_captures` even on the reactor's relaxed
/// thread, so during any capture the callback finds no GPU time.
#[test]
fn a_timed_steps_callback_sees_its_gpu_time_while_another_thread_captures() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).unwrap());
    let pool = EventPool::new(context, 8, 8).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(pool, Arc::clone(&waiter));
    coordinator.set_timing(true);
    let stream = common::stream(context);
    futures::executor::block_on(waiter.stream_idle(&stream).unwrap()).unwrap();

    let capture = HeldCapture::begin(context, &kernels, CaptureMode::Global);
    let step = register_kernel(&coordinator, &[], "timed step");
    coordinator.begin_operation(step, &stream).unwrap();
    kernels.spin_ns(&stream, 5 * MS).unwrap();
    coordinator.complete_operation(step).unwrap();
    let (seen_tx, seen_rx) = mpsc::channel();
    let observer = coordinator.clone();
    coordinator
        .on_complete(step, move |id, result| {
            let gpu_time = observer.metadata(id).map(|metadata| metadata.gpu_time);
            let _ = seen_tx.send((result, gpu_time));
        })
        .unwrap();
    let seen = seen_rx.recv_timeout(Duration::from_secs(10));
    let graph = capture.end();

    let (result, gpu_time) = seen.expect("the callback did not run during the capture");
    assert_eq!(result, Ok(()));
    assert_eq!(graph, Ok(1), "the timed step broke the global capture");
    stream.synchronize().unwrap();
    coordinator.retire_finished();
    let metrics = coordinator.metrics();
    let timed = metrics
        .timed_by_type
        .get(&cuweave_event::OperationType::Kernel)
        .copied();
    let total = metrics
        .gpu_time_by_type
        .get(&cuweave_event::OperationType::Kernel)
        .copied();
    assert!(
        matches!(gpu_time, Ok(Some(time)) if time >= Duration::from_millis(5)),
        "the callback saw GPU time {gpu_time:?} during another thread's capture (metrics after \
         it: {timed:?} timed, {total:?})"
    );
    assert_eq!(timed, Some(1));
    assert!(
        total.is_some_and(|time| time >= Duration::from_millis(5)),
        "{total:?}"
    );
    assert_eq!(coordinator.live_operations(), 0);
}

/// Request handlers that each make a waiter and drop it without ever registering a wait
/// (a config path that never reaches the GPU), from eight threads, 50 each: no driver is needed
/// for that (the reactor enters relaxed mode only at its first registration), every drop
/// returns promptly, and each waiter's counters read zero. Runs without a GPU.
#[test]
fn waiters_made_and_dropped_unused_from_eight_threads_stop_at_once_without_a_driver() {
    let dropped = within(Duration::from_secs(30), || {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    scope.spawn(|| {
                        let mut clean = 0;
                        for _ in 0..50 {
                            let waiter = AsyncEventWaiter::new().unwrap();
                            let stats = waiter.stats();
                            assert_eq!(
                                (stats.registered, stats.pending, waiter.pending()),
                                (0, 0, 0)
                            );
                            drop(waiter);
                            clean += 1;
                        }
                        clean
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .sum::<usize>()
        })
    });
    assert_eq!(dropped, 400);
}
