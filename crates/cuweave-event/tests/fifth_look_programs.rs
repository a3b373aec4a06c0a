//! A fifth look at the event layer through programs that combine it with the stream layer,
//! aimed at what the earlier files leave out:
//!
//! - an inference server's request registered first, kept waiting while thousands of later
//!   requests are withdrawn one by one between completions, then withdrawn itself: it must read
//!   unknown (never "completed") and no later request may take it as a finished dependency;
//! - a `StreamPool` handing out streams by priority while one of its streams is held on the
//!   device by the event layer (an `OperationCoordinator` dependency begun on the pool, a
//!   `CrossStreamBarrier` over pool streams): the held stream must count as pending, as it does
//!   when the stream layer's own `wait_for` or coordinator queued the wait;
//! - `EventPriority` mapped onto pool stream priorities (`Critical` on a high stream waiting for
//!   a `Cleanup` producer on a low one), ordering proven by what the kernel read;
//! - a waiter dropped while thousands of callbacks and futures are pending: no callback runs,
//!   every closure is dropped, every future resolves `WaiterShutDown`, every event goes back;
//! - tokio rounds of four thousand stream futures, half dropped mid-flight by a timeout while
//!   the streams are gated, the other half seeing the gated stores when they resolve;
//! - smol awaiting coordinator completions (half the futures dropped before the gate opens)
//!   while completion callbacks read what the kernels wrote;
//! - a cancellation storm from four threads racing callback timeouts: a successful cancel means
//!   the callback never runs, a refused one that it ran exactly once, never with `Ok` before
//!   the gate opened;
//! - ten thousand requests on pool streams, a third withdrawn between completions: an exact
//!   device counter, every withdrawn id unknown, nothing live and events bounded;
//! - (no GPU) waiters made and dropped by request handlers, and the priority mapping.
//!
//! Every outcome is the GPU's: kernels that wait on mapped words, then store or count into
//! them. Every GPU test takes `serial()`.

mod common;

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    Flags, MS, coordinator, copy_flag, filled, gate, hold, read_u32s, register, settle,
    store_after, unknown, within,
};
use cuweave_event::{
    AsyncEventWaiter, CrossStreamBarrier, EventError, EventPool, EventPriority, OperationId,
    OperationState, OperationType, WaitFuture,
};
use cuweave_stream::{
    AllocationStrategy, PriorityStream, StreamPool, StreamPoolConfig, StreamPriority,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{poll_until, require_gpu, serial};

/// How many events `pool` has made, of every kind.
fn events_created(pool: &EventPool) -> u64 {
    let counters = pool.counters();
    counters.created_regular + counters.created_timing + counters.created_blocking
}

/// An inference server registers a long request first, then serves thousands of short ones:
/// each is registered, a neighbour stays registered, and the short one is withdrawn (a client
/// disconnect), so the withdrawn ids never join into one run. Then the long request is
/// withdrawn too. `cancel_operation` documents that later calls with the id answer
/// `UnknownOperation`: its state, `on_complete`, `completion` and registering a dependant on it
/// must all refuse it. A withdrawn request read as completed would let a dependant skip its
/// wait and a client be told its request finished. Also every one of the latest short
/// withdrawals still reads unknown.
///
/// Suspected: `Cancelled::insert` (coordinator/cancel.rs) evicts the run with the lowest ids
/// once past `CANCELLED_KEPT`: an old id withdrawn last is the lowest, so it is evicted at once
/// and reads as retired (`Completed`) the moment it is withdrawn.
#[test]
fn the_oldest_request_withdrawn_after_a_storm_of_withdrawals_reads_unknown_not_completed() {
    let gpu = require_gpu!();
    let _serial = serial();
    let (coordinator, waiter, _pool) = coordinator(&gpu.context);

    let long = register(&coordinator, EventPriority::Low, &[], "long request");
    let mut kept = Vec::new();
    let mut withdrawn = Vec::new();
    for i in 0..4_200 {
        let short = register(&coordinator, EventPriority::Normal, &[], "short request");
        kept.push(register(
            &coordinator,
            EventPriority::Normal,
            &[],
            &format!("neighbour {i}"),
        ));
        coordinator.cancel_operation(short).unwrap();
        withdrawn.push(short);
    }
    for &id in withdrawn.iter().rev().take(1_000) {
        assert!(
            unknown(&coordinator.state(id), id),
            "a recently withdrawn request {id} reads {:?}",
            coordinator.state(id)
        );
    }

    let told = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&told);
    coordinator
        .on_complete(long, move |_, result| {
            seen.lock()
                .unwrap()
                .push(format!("before withdrawal: {result:?}"));
        })
        .unwrap();
    coordinator.cancel_operation(long).unwrap();
    assert!(
        matches!(told.lock().unwrap().as_slice(), [s] if s.contains("Cancelled")),
        "the callback registered before withdrawal is told Cancelled: {:?}",
        told.lock().unwrap()
    );

    let state = coordinator.state(long);
    let seen = Arc::clone(&told);
    let late_callback = coordinator.on_complete(long, move |_, result| {
        seen.lock()
            .unwrap()
            .push(format!("after withdrawal: {result:?}"));
    });
    let completion = coordinator.completion(long).map(|_| ());
    let dependant = coordinator.register_operation(
        OperationType::Kernel,
        EventPriority::Normal,
        None,
        &[long],
        "depends on the withdrawn request",
    );
    let told_after = told.lock().unwrap().clone();

    // Clean up before asserting, so a failure leaves nothing registered behind.
    if let Ok(dependant) = dependant {
        coordinator.cancel_operation(dependant).unwrap();
    }
    coordinator.cancel_operations(&kept).unwrap();
    assert_eq!(coordinator.live_operations(), 0);
    settle(&waiter, "after the withdrawals");

    assert!(
        unknown(&state, long),
        "the withdrawn long request reads {state:?} right after cancel_operation"
    );
    assert!(
        unknown(&late_callback, long),
        "on_complete on the withdrawn request answered {late_callback:?}; callbacks: \
         {told_after:?}"
    );
    assert_eq!(
        told_after.len(),
        1,
        "no callback told of completion: {told_after:?}"
    );
    assert!(
        unknown(&completion, long),
        "completion() of the withdrawn request answered {completion:?}"
    );
    assert!(
        unknown(&dependant, long),
        "a request registered after the withdrawn one was accepted: {dependant:?}"
    );
}

/// A server begins each request on a pool stream (`begin_on_pool`) after a producer request on
/// another stream that is still held by a closed gate, then asks the `Priority` pool for idle
/// streams for other work. The stream it began on waits on the device for the producer: it is
/// not idle (the driver says so), and `has_pending_waits` must say so, as it does for a
/// stream layer `wait_for`, or the strategy hands it out as idle and new work queues behind the
/// gate. The work queued on the held stream must read the producer's store.
///
/// Suspected: `begin_operation` (coordinator/lifecycle.rs) queues `stream.wait_event` on a
/// `PriorityStream` without telling it (`note_queued_wait` is crate-private to cuweave-stream),
/// so `has_pending_waits` answers `false` and `load_of` counts the held stream as idle.
#[test]
fn a_pool_stream_begun_behind_a_gated_dependency_is_not_handed_out_as_idle() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream_kernels = StreamKernels::load(context).unwrap();
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority),
    )
    .unwrap();
    let producer = Arc::new(PriorityStream::new(context, StreamPriority::Low).unwrap());
    let (coordinator, waiter, _events) = coordinator(context);
    // Word 0: the gate; 1: what the producer stores; 2: what the held stream read.
    let flags = Flags::new(context, 3);

    let produce = register(&coordinator, EventPriority::Low, &[], "produce");
    coordinator.begin_operation(produce, &producer).unwrap();
    hold(&kernels, &producer, flags.device(0));
    store_after(&kernels, producer.stream(), 0, flags.device(1), 7);
    coordinator.complete_operation(produce).unwrap();

    let consume = register(&coordinator, EventPriority::Critical, &[produce], "consume");
    let held = coordinator.begin_on_pool(consume, &pool).unwrap();
    assert_eq!(held.priority(), StreamPriority::High);
    let busy = !held.is_ready().unwrap();
    let pending = held.has_pending_waits().unwrap();
    let picks: Vec<u64> = (0..6).map(|_| pool.get_stream().unwrap().id()).collect();
    let handed_held = picks.iter().filter(|&&id| id == held.id()).count();

    held.launch(|s| {
        copy_flag(&stream_kernels, s, flags.device(1), flags.device(2));
        Ok::<(), cuweave_driver::DriverError>(())
    })
    .unwrap();
    coordinator.complete_operation(consume).unwrap();
    flags.write(0, 1);
    held.synchronize().unwrap();
    producer.synchronize().unwrap();
    assert_eq!(
        flags.read(2),
        7,
        "the held stream ran after the producer's store"
    );
    assert!(
        busy,
        "precondition: the driver reports the held stream busy"
    );
    assert!(
        pending,
        "has_pending_waits is false on a pool stream waiting on the device for a gated \
         dependency (queued by OperationCoordinator::begin_on_pool)"
    );
    assert_eq!(
        handed_held,
        0,
        "the Priority strategy handed out the held stream {handed_held} times in 6 picks \
         (held {}, picks {picks:?}) while another high stream was idle",
        held.id()
    );
    coordinator.retire_finished();
    assert!(poll_until(Duration::from_secs(2), || coordinator
        .live_operations()
        == 0));
    settle(&waiter, "at the end");
}

/// A training loop syncs a gated loader stream with one high-priority pool stream through the
/// event layer's barrier (`CrossStreamBarrier::from_streams` over `PriorityStream`s, as the
/// barrier's docs suggest for pool streams), then asks the `Priority` pool for idle streams.
/// The stream behind the barrier waits for the gate: `has_pending_waits` must say so and the
/// strategy must prefer the other, idle high stream. What the held stream runs after the
/// barrier reads the loader's store.
///
/// Suspected: `CrossStreamBarrier::queue` (barrier.rs) queues its waits through
/// `queue_barrier` on the driver streams and never notes them on the `PriorityStream`s, where
/// `MultiStreamCoordinator::create_barrier` does.
#[test]
fn an_event_barrier_over_pool_streams_marks_the_held_stream_as_pending() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream_kernels = StreamKernels::load(context).unwrap();
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority),
    )
    .unwrap();
    let loader = Arc::new(PriorityStream::new(context, StreamPriority::Low).unwrap());
    let held = Arc::clone(&pool.streams_of(StreamPriority::High)[0]);
    let flags = Flags::new(context, 3);
    hold(&kernels, &loader, flags.device(0));
    store_after(&kernels, loader.stream(), 0, flags.device(1), 0xBEEF);

    let events = EventPool::new(context, 0, 0).unwrap();
    let barrier = CrossStreamBarrier::from_streams(
        vec![Arc::clone(&loader), Arc::clone(&held)],
        events.clone(),
    )
    .unwrap();
    let info = barrier.queue().unwrap();
    let pending = held.has_pending_waits().unwrap();
    let picks: Vec<u64> = (0..6).map(|_| pool.get_stream().unwrap().id()).collect();
    let handed_held = picks.iter().filter(|&&id| id == held.id()).count();
    held.launch(|s| {
        copy_flag(&stream_kernels, s, flags.device(1), flags.device(2));
        Ok::<(), cuweave_driver::DriverError>(())
    })
    .unwrap();

    flags.write(0, 1);
    barrier.synchronize().unwrap();
    assert_eq!(
        flags.read(2),
        0xBEEF,
        "the held stream ran after the barrier"
    );
    assert_eq!(
        events.utilization().in_use,
        0,
        "barrier events returned: {info:?}"
    );
    assert!(
        pending,
        "has_pending_waits is false on a pool stream behind a CrossStreamBarrier on a gated \
         stream"
    );
    assert_eq!(
        handed_held,
        0,
        "the Priority strategy handed out the stream held by the barrier {handed_held} times in \
         6 picks (held {}, picks {picks:?})",
        held.id()
    );
}

/// `begin_on_pool` runs an operation at its `EventPriority`: a `Cleanup` producer lands on a
/// low-priority pool stream, a `Critical` consumer on a high one (PyTorch's
/// `torch.cuda.Stream(priority=-1)` for latency-critical work), and the consumer, begun while
/// the producer is gated, still reads the producer's store: priority never overtakes a
/// dependency. Ten rounds, each with its own word; nothing live at the end.
#[test]
fn critical_work_on_high_streams_waits_for_cleanup_producers_on_low_ones() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream_kernels = StreamKernels::load(context).unwrap();
    let pool = StreamPool::new(context, StreamPoolConfig::default()).unwrap();
    let (coordinator, waiter, _events) = coordinator(context);
    const ROUNDS: usize = 10;
    // Per round: gate, stored word, read word.
    let flags = Flags::new(context, 3 * ROUNDS);
    let mut used = Vec::new();
    for round in 0..ROUNDS {
        let (g, stored, read) = (3 * round, 3 * round + 1, 3 * round + 2);
        let produce = register(&coordinator, EventPriority::Cleanup, &[], "produce");
        let low = coordinator.begin_on_pool(produce, &pool).unwrap();
        hold(&kernels, &low, flags.device(g));
        store_after(
            &kernels,
            low.stream(),
            0,
            flags.device(stored),
            100 + round as u32,
        );
        coordinator.complete_operation(produce).unwrap();

        let consume = register(&coordinator, EventPriority::Critical, &[produce], "consume");
        let high = coordinator.begin_on_pool(consume, &pool).unwrap();
        copy_flag(
            &stream_kernels,
            high.stream(),
            flags.device(stored),
            flags.device(read),
        );
        coordinator.complete_operation(consume).unwrap();
        used.push((low.priority(), high.priority()));

        flags.write(g, 1);
        high.synchronize().unwrap();
        low.synchronize().unwrap();
        assert_eq!(
            flags.read(read),
            100 + round as u32,
            "round {round}: the critical consumer read before the cleanup producer stored"
        );
    }
    assert!(
        used.iter()
            .all(|&p| p == (StreamPriority::Low, StreamPriority::High)),
        "streams by priority (producer, consumer): {used:?}"
    );
    assert!(poll_until(Duration::from_secs(2), || coordinator
        .live_operations()
        == 0));
    settle(&waiter, "at the end");
}

/// A server shuts its waiter down while 2000 callbacks and 2000 event futures wait on a gated
/// stream (the waiter documents: pending callbacks are cancelled, never run; pending futures
/// resolve to `WaiterShutDown`). The drop must return (not hang on the pending work), no
/// callback may run even after the gate opens, every callback closure must be dropped (its
/// captured `Arc` released), every future must resolve `WaiterShutDown`, and every event must
/// go back to its pool.
#[test]
fn dropping_the_waiter_with_thousands_pending_runs_no_callback_and_frees_everything() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream = common::stream(context);
    let events = EventPool::new(context, 0, 0).unwrap();
    let flags = Flags::new(context, 1);
    gate(&kernels, &stream, flags.device(0));

    let waiter = AsyncEventWaiter::new().unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let token = Arc::new(());
    for _ in 0..2_000 {
        let event = events.acquire_owned(false).unwrap();
        event.record(&stream).unwrap();
        let (ran, token) = (Arc::clone(&ran), Arc::clone(&token));
        waiter.wait_async(event, move |_| {
            let _keep = &token;
            ran.fetch_add(1, Ordering::SeqCst);
        });
    }
    let futures: Vec<WaitFuture> = (0..2_000)
        .map(|_| {
            let event = events.acquire_owned(false).unwrap();
            event.record(&stream).unwrap();
            waiter.event_done(event)
        })
        .collect();
    assert!(futures.iter().all(|f| !f.is_complete()), "gate closed");

    within(Duration::from_secs(10), move || drop(waiter));
    let outcomes: Vec<_> = within(Duration::from_secs(10), move || {
        futures
            .into_iter()
            .map(futures::executor::block_on)
            .collect::<Vec<_>>()
    });
    flags.write(0, 1);
    stream.synchronize().unwrap();
    // The waiter's drop joined its reactor thread, where callbacks run: none can run from now
    // on, so what `ran` reads is final.

    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "callbacks ran after shutdown"
    );
    assert_eq!(
        Arc::strong_count(&token),
        1,
        "callback closures are still held after the waiter was dropped"
    );
    let shut = outcomes
        .iter()
        .filter(|r| matches!(r, Err(EventError::WaiterShutDown)))
        .count();
    assert_eq!(shut, 2_000, "outcomes other than WaiterShutDown: {:?}", {
        outcomes
            .iter()
            .filter(|r| !matches!(r, Err(EventError::WaiterShutDown)))
            .take(4)
            .collect::<Vec<_>>()
    });
    assert_eq!(
        events.utilization().in_use,
        0,
        "every event back in the pool"
    );
}

/// An async inference server on tokio: per round, eight streams each hold a closed gate and a
/// store behind it; 4096 tasks await `stream_idle` futures, half of them under a 1 ms
/// `tokio::time::timeout` that must fire (the future dropped mid-flight while the GPU is
/// gated); then the gates open and the other half must resolve `Ok` and see their stream's
/// store. Ten rounds on one waiter: each round ends with nothing pending and the waiter's
/// registrations counted exactly.
#[test]
fn tokio_rounds_with_half_the_stream_futures_dropped_mid_flight_stay_exact_and_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    const STREAMS: usize = 8;
    const TASKS: usize = 4_096;
    const ROUNDS: u32 = 10;
    let streams = common::streams(context, STREAMS);
    let flags = Arc::new(Flags::new(context, 1 + STREAMS));
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap();

    for round in 1..=ROUNDS {
        let before = waiter.stats();
        flags.write(0, 0);
        for (i, stream) in streams.iter().enumerate() {
            gate(&kernels, stream, flags.device(0));
            store_after(&kernels, stream, 0, flags.device(1 + i), round);
        }
        let mut dropped = Vec::new();
        let mut awaited = Vec::new();
        for task in 0..TASKS {
            let s = task % STREAMS;
            let future = waiter.stream_idle(&streams[s]).unwrap();
            if task % 2 == 1 {
                dropped.push(runtime.spawn(async move {
                    tokio::time::timeout(Duration::from_millis(1), future)
                        .await
                        .is_err()
                }));
            } else {
                let flags = Arc::clone(&flags);
                awaited.push(runtime.spawn(async move {
                    let result = future.await;
                    (result.is_ok(), flags.read(1 + s) == round)
                }));
            }
        }
        let timed_out = runtime.block_on(async {
            let mut n = 0;
            for handle in dropped {
                n += usize::from(handle.await.unwrap());
            }
            n
        });
        assert_eq!(
            timed_out,
            TASKS / 2,
            "round {round}: a timeout did not fire"
        );
        flags.write(0, 1);
        let results = runtime.block_on(async {
            let mut all = Vec::new();
            for handle in awaited {
                all.push(tokio::time::timeout(Duration::from_secs(10), handle).await);
            }
            all
        });
        let good = results
            .iter()
            .filter(|r| matches!(r, Ok(Ok((true, true)))))
            .count();
        assert_eq!(
            good,
            TASKS / 2,
            "round {round}: futures that failed, hung or resolved before their store"
        );
        settle(&waiter, "after a round");
        let after = waiter.stats();
        assert_eq!(after.registered - before.registered, TASKS as u64);
        assert_eq!(
            (after.completed + after.cancelled + after.timed_out + after.failed)
                - (before.completed + before.cancelled + before.timed_out + before.failed),
            TASKS as u64,
            "round {round}: every wait ended exactly once: {before:?} -> {after:?}"
        );
        for stream in &streams {
            stream.synchronize().unwrap();
        }
    }
}

/// A request router on smol: one gated producer request and 32 consumers on four other
/// streams, each with a completion callback that reads what its consumer's kernel copied. The
/// router awaits the completion futures of half the consumers and drops the other half before
/// the gate opens (clients gone). Every callback still runs exactly once, after the kernel
/// wrote the producer's value; every awaited future resolves `Ok`; nothing stays live.
#[test]
fn smol_awaits_completions_while_half_are_dropped_and_callbacks_see_the_gated_store() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream_kernels = StreamKernels::load(context).unwrap();
    const CONSUMERS: usize = 32;
    let streams = common::streams(context, 5);
    let flags = Arc::new(Flags::new(context, 2 + CONSUMERS));
    let (coordinator, waiter, _events) = coordinator(context);

    let produce = register(&coordinator, EventPriority::High, &[], "produce");
    coordinator.begin_operation(produce, &streams[0]).unwrap();
    gate(&kernels, &streams[0], flags.device(0));
    store_after(&kernels, &streams[0], 0, flags.device(1), 4242);
    coordinator.complete_operation(produce).unwrap();

    let seen: Arc<Vec<AtomicU32>> = Arc::new((0..CONSUMERS).map(|_| AtomicU32::new(0)).collect());
    let calls = Arc::new(AtomicUsize::new(0));
    let mut kept = Vec::new();
    let mut gone = Vec::new();
    for i in 0..CONSUMERS {
        let id = register(&coordinator, EventPriority::Normal, &[produce], "consume");
        let stream = &streams[1 + i % 4];
        coordinator.begin_operation(id, stream).unwrap();
        copy_flag(
            &stream_kernels,
            stream,
            flags.device(1),
            flags.device(2 + i),
        );
        coordinator.complete_operation(id).unwrap();
        let (flags, seen, calls) = (Arc::clone(&flags), Arc::clone(&seen), Arc::clone(&calls));
        coordinator
            .on_complete(id, move |_, result| {
                if result.is_ok() {
                    seen[i].store(flags.read(2 + i), Ordering::SeqCst);
                }
                calls.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        let future = coordinator.completion(id).unwrap();
        if i % 2 == 0 {
            kept.push(future);
        } else {
            gone.push(future);
        }
    }
    assert!(kept.iter().chain(&gone).all(|f| !f.is_complete()));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "no callback before the gate opens"
    );
    drop(gone);
    flags.write(0, 1);
    let results = within(Duration::from_secs(10), move || {
        smol::block_on(async move {
            let mut all = Vec::new();
            for future in kept {
                all.push(future.await);
            }
            all
        })
    });
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert!(
        poll_until(Duration::from_secs(5), || calls.load(Ordering::SeqCst)
            == CONSUMERS),
        "{} of {CONSUMERS} callbacks ran",
        calls.load(Ordering::SeqCst)
    );
    let values: Vec<u32> = seen.iter().map(|v| v.load(Ordering::SeqCst)).collect();
    assert!(
        values.iter().all(|&v| v == 4242),
        "callbacks saw {values:?}"
    );
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert!(poll_until(Duration::from_secs(2), || coordinator
        .live_operations()
        == 0));
    // The reactor counts a wait off only after its callback has returned: with none pending,
    // every callback that will ever run has run.
    settle(&waiter, "at the end");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        CONSUMERS,
        "a callback ran twice"
    );
}

/// A cancellation storm: 2000 callback waits with timeouts on a gated stream (even ones 0-19
/// ms, odd ones 30 s), withdrawn by four threads at once while the timeouts fire. A `true`
/// from `cancel_wait` means that callback never runs; a `false` means it ran (or is running)
/// exactly once, and only with `TimedOut` (the gate is closed). Every long wait is cancelled.
/// After the gate opens, nothing more runs.
#[test]
fn a_cancellation_storm_from_four_threads_racing_timeouts_runs_each_callback_at_most_once() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream = common::stream(context);
    let events = EventPool::new(context, 0, 0).unwrap();
    let flags = Flags::new(context, 1);
    gate(&kernels, &stream, flags.device(0));
    const WAITS: usize = 2_000;
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    // 0: not run; 1: ran with TimedOut; 2: ran with anything else; +10 per extra run.
    let slots: Arc<Vec<AtomicU32>> = Arc::new((0..WAITS).map(|_| AtomicU32::new(0)).collect());
    let ids: Vec<_> = (0..WAITS)
        .map(|i| {
            let event = events.acquire_owned(false).unwrap();
            event.record(&stream).unwrap();
            let timeout = if i % 2 == 0 {
                Duration::from_millis((i % 20) as u64)
            } else {
                Duration::from_secs(30)
            };
            let slots = Arc::clone(&slots);
            waiter.wait_async_timeout(event, timeout, move |result| {
                let value = if matches!(result, Err(EventError::TimedOut { .. })) {
                    1
                } else {
                    2
                };
                if slots[i]
                    .compare_exchange(0, value, Ordering::SeqCst, Ordering::SeqCst)
                    .is_err()
                {
                    slots[i].fetch_add(10, Ordering::SeqCst);
                }
            })
        })
        .collect();
    let ids = Arc::new(ids);
    let cancelled: Vec<Vec<(usize, bool)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let (ids, waiter) = (Arc::clone(&ids), Arc::clone(&waiter));
                scope.spawn(move || {
                    (t..WAITS)
                        .step_by(4)
                        .map(|i| (i, waiter.cancel_wait(ids[i])))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let cancelled: Vec<(usize, bool)> = cancelled.into_iter().flatten().collect();
    assert_eq!(cancelled.len(), WAITS);
    // A refused cancel: the callback ran or is running; wait for it.
    for &(i, ok) in &cancelled {
        if !ok {
            assert!(
                poll_until(Duration::from_secs(5), || slots[i].load(Ordering::SeqCst)
                    != 0),
                "wait {i}: cancel_wait refused but its callback never ran"
            );
        }
    }
    let before_open: Vec<u32> = slots.iter().map(|s| s.load(Ordering::SeqCst)).collect();
    flags.write(0, 1);
    stream.synchronize().unwrap();
    // The reactor counts a wait off only after its callback has returned: with none pending,
    // every callback that will ever run has run.
    settle(&waiter, "after the storm");
    for &(i, ok) in &cancelled {
        let slot = slots[i].load(Ordering::SeqCst);
        if ok {
            assert_eq!(
                slot, 0,
                "wait {i}: cancelled, yet its callback ran ({slot})"
            );
        } else {
            assert_eq!(
                before_open[i], 1,
                "wait {i}: cancel refused, callback state {} before the gate opened",
                before_open[i]
            );
            assert_eq!(slot, 1, "wait {i}: ran more than once ({slot})");
        }
        if i % 2 == 1 {
            assert!(ok, "wait {i} with a 30 s timeout could not be cancelled");
        }
    }
    assert!(
        !waiter.cancel_wait(ids[1]),
        "a second cancel of one id is refused"
    );
    assert_eq!(
        events.utilization().in_use,
        0,
        "every event back in the pool"
    );
}

/// Ten thousand requests of a server on `Priority`-pool streams, each after the last request
/// that ran (so they hop streams and wait on the device), every third withdrawn before it
/// begins (a client gone), the next one then depending on the last that ran. The device counter
/// equals the number that ran; every withdrawn id still reads unknown (3334 separate runs of
/// withdrawn ids, under the documented 4096); nothing stays live; the coordinator's events stay
/// bounded.
#[test]
fn ten_thousand_requests_with_a_third_withdrawn_are_exact_unknown_and_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority),
    )
    .unwrap();
    let (coordinator, waiter, events) = coordinator(context);
    let counter = filled(context, 1, 0);
    const REQUESTS: usize = 10_000;
    let mut last: Option<OperationId> = None;
    let mut withdrawn = Vec::new();
    let mut ran = 0u32;
    let priorities = [
        EventPriority::High,
        EventPriority::Normal,
        EventPriority::Low,
    ];
    for i in 0..REQUESTS {
        let deps: Vec<OperationId> = last.into_iter().collect();
        let id = register(&coordinator, priorities[i % 3], &deps, "request");
        if i % 3 == 2 {
            coordinator.cancel_operation(id).unwrap();
            withdrawn.push(id);
            continue;
        }
        let stream = coordinator.begin_on_pool(id, &pool).unwrap();
        let ptr = counter.ptr();
        stream
            .launch(|s| {
                // SAFETY: one word of `counter`, alive until every pool stream is synchronized
                // below; the dependency chain orders every increment after the one before.
                unsafe { kernels.increment_u32(s, ptr, 1) }
            })
            .unwrap();
        coordinator.complete_operation(id).unwrap();
        last = Some(id);
        ran += 1;
        if i % 2_000 == 1_999 {
            assert!(
                poll_until(Duration::from_secs(5), || coordinator.live_operations()
                    <= 64),
                "request {i}: {} live once the GPU caught up",
                coordinator.live_operations()
            );
        }
    }
    for stream in pool.streams() {
        stream.synchronize().unwrap();
    }
    assert_eq!(read_u32s(context, counter.ptr(), 1), [ran]);
    let still_known: Vec<_> = withdrawn
        .iter()
        .filter(|&&id| !unknown(&coordinator.state(id), id))
        .take(4)
        .collect();
    assert!(
        still_known.is_empty(),
        "withdrawn ids that read known: {still_known:?}"
    );
    assert!(poll_until(Duration::from_secs(2), || coordinator
        .live_operations()
        == 0));
    assert_eq!(
        coordinator.state(last.unwrap()).unwrap(),
        OperationState::Completed
    );
    let created = events_created(&events);
    assert!(created <= 4_096, "{created} events for {ran} operations");
    assert_eq!(events.utilization().in_use, 0);
    settle(&waiter, "at the end");
}

/// No GPU needed: a server that builds a waiter per handler makes and drops 64 of them; each
/// starts idle (nothing registered, nothing pending) and drops promptly; and the documented
/// mapping of `EventPriority` onto stream priorities holds for every level.
#[test]
fn waiters_made_and_dropped_per_handler_start_idle_and_priorities_map_as_documented() {
    for _ in 0..64 {
        let waiter = AsyncEventWaiter::new().unwrap();
        let stats = waiter.stats();
        assert_eq!(
            (stats.registered, stats.pending, waiter.pending()),
            (0, 0, 0)
        );
        within(Duration::from_secs(5), move || drop(waiter));
    }
    for (priority, expected) in [
        (EventPriority::Critical, StreamPriority::High),
        (EventPriority::High, StreamPriority::High),
        (EventPriority::Normal, StreamPriority::Normal),
        (EventPriority::Low, StreamPriority::Low),
        (EventPriority::Cleanup, StreamPriority::Low),
    ] {
        assert_eq!(priority.stream_priority(), expected, "{priority:?}");
    }
    assert_eq!(OperationId::UNREGISTERED.get(), 0);
}

/// A profiled training step loop (PyTorch's `torch.cuda.Event(enable_timing=True)` plus a
/// timed stream): a pool stream with GPU timing on carries 6000 coordinator operations, with
/// the coordinator timing them too, and nobody reads the stream's metrics until the end (the
/// stream's timer fills at 4096 pending spans and must read its finished ones itself). The host
/// lets the GPU catch up every 1000 steps, so every span has finished before the timer could
/// be full. Expected: the device counter is exact; the stream counts and times every launch;
/// the coordinator times every operation; a 2 ms spin between two timing events of the
/// coordinator's pool reads at least 1.9 ms, and adds at least that to the stream's GPU time.
#[test]
fn a_timed_pool_stream_under_a_timed_coordinator_times_every_one_of_6000_steps() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let pool = StreamPool::new(context, StreamPoolConfig::default()).unwrap();
    let stream = Arc::clone(&pool.streams_of(StreamPriority::Normal)[0]);
    stream.set_timing(true);
    let before = stream.metrics().unwrap();
    let (coordinator, waiter, events) = coordinator(context);
    coordinator.set_timing(true);
    let counter = filled(context, 1, 0);
    const STEPS: u64 = 6_000;
    let mut last: Option<OperationId> = None;
    for step in 0..STEPS {
        let deps: Vec<OperationId> = last.into_iter().collect();
        let id = register(&coordinator, EventPriority::Normal, &deps, "step");
        coordinator.begin_operation(id, &stream).unwrap();
        let ptr = counter.ptr();
        stream
            .launch(|s| {
                // SAFETY: one word of `counter`, alive until the stream is synchronized below.
                unsafe { kernels.increment_u32(s, ptr, 1) }
            })
            .unwrap();
        coordinator.complete_operation(id).unwrap();
        last = Some(id);
        if step % 1_000 == 999 {
            stream.synchronize().unwrap();
        }
    }
    stream.synchronize().unwrap();
    assert_eq!(read_u32s(context, counter.ptr(), 1), [STEPS as u32]);
    let after_steps = stream.metrics().unwrap();
    assert_eq!(after_steps.kernel_launches - before.kernel_launches, STEPS);
    assert_eq!(
        after_steps.timed_operations - before.timed_operations,
        STEPS,
        "the timed stream stopped timing once its timer filled"
    );
    assert!(poll_until(Duration::from_secs(2), || coordinator
        .live_operations()
        == 0));
    let timed = coordinator
        .metrics()
        .timed_by_type
        .get(&OperationType::Kernel)
        .copied()
        .unwrap_or(0);
    assert_eq!(timed, STEPS, "operations the coordinator timed");

    let (start, end) = (
        events.acquire_owned(true).unwrap(),
        events.acquire_owned(true).unwrap(),
    );
    let scratch = filled(context, 1, 0);
    start.record(stream.stream()).unwrap();
    let dst = scratch.ptr();
    stream
        .launch(|s| {
            // SAFETY: one word of `scratch`, alive until the stream is synchronized below.
            unsafe { kernels.spin_then_store_u32(s, 2 * MS, dst, 1) }
        })
        .unwrap();
    end.record(stream.stream()).unwrap();
    end.synchronize().unwrap();
    let elapsed = start.elapsed_ms(&end).unwrap();
    assert!(elapsed >= 1.9, "a 2 ms spin read {elapsed} ms");
    let spun = stream.metrics().unwrap().gpu_time_ns - after_steps.gpu_time_ns;
    assert!(
        spun >= 1_900_000,
        "the stream timed the 2 ms spin as {spun} ns"
    );
    assert_eq!(read_u32s(context, scratch.ptr(), 1), [1]);
    settle(&waiter, "at the end");
}
