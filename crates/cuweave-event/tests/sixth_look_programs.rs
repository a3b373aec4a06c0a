//! A sixth look at the event layer, aimed at this round's changes:
//!
//! - a `PriorityStream`'s outstanding-work markers pruned at submission (binary search, back-off
//!   while the GPU is behind, never while a capture is active): `outstanding_work` stays exact
//!   with eight threads submitting behind gates, the GPU catching up a phase at a time, global
//!   graph captures running on another stream meanwhile; a stream nobody asks holds few events;
//!   `LoadBalanced` still avoids the stream far behind and picks it again once it catches up;
//! - `AsStream::note_queued_wait`: a pool stream held by a coordinator dependency or by a barrier
//!   over mixed driver and pool streams is pending while the wait holds, and `has_pending_waits`
//!   clears (and the `Priority` pool hands the stream out again) once the wait has passed;
//! - cancelled ids evicted least recently cancelled first: thousands of withdrawals in runs
//!   built out of order, between completions, then more isolated withdrawals past the bound:
//!   the most recent runs still read unknown, completions read completed, nothing stays live.
//!
//! `cuweave-collective` is not a dev-dependency of this crate, so `CoordinatedCollectives` over
//! pool streams is not probed here.
//!
//! Every outcome is the GPU's or the public API's: kernels that wait on mapped words, then store
//! into them. Every GPU test takes `serial()`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Flags, coordinator, copy_flag, gate, hold, register, store_after, unknown};
use cuweave_driver::{CaptureMode, DriverError, Stream};
use cuweave_event::{
    AsStream, CrossStreamBarrier, EventPool, EventPriority, OperationId, OperationState,
    OperationType,
};
use cuweave_stream::{
    AllocationStrategy, OperationKind, PriorityStream, StreamPool, StreamPoolConfig, StreamPriority,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{poll_until, require_gpu, serial};

/// One counted operation that queues nothing but its marker.
fn submit(stream: &PriorityStream) {
    stream
        .enqueue(OperationKind::Other, 0, |_| Ok::<(), DriverError>(()))
        .unwrap();
}

/// `threads` threads each submitting `each` operations on `stream` at once.
fn submit_from_threads(stream: &Arc<PriorityStream>, threads: usize, each: usize) {
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                for _ in 0..each {
                    submit(stream);
                }
            });
        }
    });
}

/// A stream of a user's program that is either a plain driver stream (a library's own stream
/// wrapped with `Stream`) or a pool stream: what a barrier over both kinds needs, since
/// `CrossStreamBarrier<S>` takes one `S`. It forwards `note_queued_wait` as the docs ask.
enum Lane {
    Driver(Stream),
    Pool(Arc<PriorityStream>),
}

impl AsStream for Lane {
    fn as_stream(&self) -> &Stream {
        match self {
            Self::Driver(stream) => stream,
            Self::Pool(stream) => stream.stream(),
        }
    }

    fn note_queued_wait(&self) {
        if let Self::Pool(stream) = self {
            stream.note_queued_wait();
        }
    }
}

/// A data loader feeding a stream from eight threads (PyTorch's `DataLoader` workers each
/// queueing onto one side stream) while the GPU is far behind: two gates split the work into
/// two phases of 121 operations each (under the 256 markers kept, so every count is exact).
/// While both gates are closed `outstanding_work` reads all 242, asked repeatedly (the
/// submissions' searches found nothing finished and backed off); once the first gate opens it
/// must read exactly the second phase's 121 (the finished markers of the first phase dropped,
/// none of the second's); once the second opens, 0. Five rounds on the same stream, so the
/// backed-off search marks recover each time.
#[test]
fn outstanding_work_is_exact_with_eight_threads_submitting_and_the_gpu_catching_up_by_phases() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream = Arc::new(PriorityStream::new(context, StreamPriority::Normal).unwrap());
    for round in 0..5 {
        let flags = Flags::new(context, 2);
        hold(&kernels, &stream, flags.device(0));
        submit_from_threads(&stream, 8, 15);
        hold(&kernels, &stream, flags.device(1));
        submit_from_threads(&stream, 8, 15);
        for _ in 0..3 {
            assert_eq!(
                stream.outstanding_work().unwrap(),
                242,
                "round {round}: both gates closed"
            );
        }
        flags.write(0, 1);
        let mut seen = 0;
        let caught_up = poll_until(Duration::from_secs(10), || {
            seen = stream.outstanding_work().unwrap();
            seen == 121
        });
        assert!(
            caught_up,
            "round {round}: the first phase finished, the second is gated: outstanding_work \
             read {seen}, not 121"
        );
        // Submissions while the GPU has caught up with the first phase: their searches may drop
        // the first phase's markers, never the gated second phase's.
        submit_from_threads(&stream, 4, 10);
        assert_eq!(stream.outstanding_work().unwrap(), 161, "round {round}");
        flags.write(1, 1);
        assert!(
            poll_until(Duration::from_secs(10), || stream
                .outstanding_work()
                .unwrap()
                == 0),
            "round {round}: everything finished, {} outstanding",
            stream.outstanding_work().unwrap()
        );
        stream.synchronize().unwrap();
    }
    assert_eq!(stream.metrics().unwrap().operations, 5 * (2 + 240 + 40));
}

/// A training step loop that never asks its side stream how busy it is (the common case: only
/// the pool's strategies ever ask): 5000 submissions from four threads, the host letting the GPU
/// catch up every 40. The markers are pruned at submission, so the stream holds about
/// `PRUNE_AT` (32) events of its context's pool (the search backs off at most once here, to 64),
/// not the 256 it used to: at most 128 in use at any check. At the end, nothing outstanding and every marker back in the pool.
#[test]
fn a_side_stream_nobody_asks_holds_few_marker_events_over_five_thousand_submissions() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = Arc::new(PriorityStream::new(context, StreamPriority::Normal).unwrap());
    let events = stream.event_pool().clone();
    stream.synchronize().unwrap();
    let before = events.utilization().in_use;
    let mut most = 0;
    for _ in 0..125 {
        submit_from_threads(&stream, 4, 10);
        stream.synchronize().unwrap();
        most = most.max(events.utilization().in_use.saturating_sub(before));
    }
    assert!(
        most <= 128,
        "a stream whose outstanding work nobody asks for held {most} marker events at once \
         (pruning at submission should keep it near 32)"
    );
    assert_eq!(stream.outstanding_work().unwrap(), 0);
    assert_eq!(
        events.utilization().in_use,
        before,
        "every marker went back to the pool once outstanding_work found it finished"
    );
    assert_eq!(stream.metrics().unwrap().operations, 5000);
}

/// A program that captures a CUDA graph in global mode (PyTorch's default
/// `capture_error_mode="global"`) on its own stream, fifty times, while four threads keep
/// submitting onto a gated pool-style stream far ahead of the GPU (so the submissions' searches
/// for finished markers would query events). Searches are skipped while a capture is active;
/// no query of another thread may break the captures: every `end_capture` must succeed. Once
/// the captures are over, `outstanding_work` is exact (1 gate + 4 × 60 operations, under the
/// 256 markers kept) and reads 0 once the gate opens.
#[test]
fn submissions_far_ahead_of_the_gpu_never_break_global_captures_on_another_stream() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream = Arc::new(PriorityStream::new(context, StreamPriority::Normal).unwrap());
    let capturing = common::stream(context);
    let flags = Flags::new(context, 1);
    hold(&kernels, &stream, flags.device(0));
    // Markers made before the captures, so the threads only record events meanwhile.
    submit_from_threads(&stream, 4, 20);
    let failures = std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                for _ in 0..40 {
                    submit(&stream);
                    std::thread::yield_now();
                }
            });
        }
        let mut failures = Vec::new();
        for round in 0..50 {
            capturing.begin_capture(CaptureMode::Global).unwrap();
            kernels.spin_ns(&capturing, 1_000).unwrap();
            if let Err(error) = capturing.end_capture() {
                failures.push(format!("round {round}: {error}"));
            }
        }
        failures
    });
    assert!(
        failures.is_empty(),
        "global captures broken by submissions on another thread: {failures:?}"
    );
    assert_eq!(stream.outstanding_work().unwrap(), 1 + 4 * 60);
    flags.write(0, 1);
    assert!(poll_until(Duration::from_secs(10), || stream
        .outstanding_work()
        .unwrap()
        == 0));
    stream.synchronize().unwrap();
}

/// A server on a `LoadBalanced` pool: one of its normal streams is fed 600 operations behind a
/// closed gate (past the 256 markers kept, so its searches back off and its newest marker is
/// re-recorded). While it is behind, the strategy must never hand it out (its count is 601,
/// the others' 0); once the gate opens and it has caught up, its count is exactly 0 again and
/// the strategy hands it out in turn with the other idle streams.
#[test]
fn load_balanced_avoids_a_stream_far_behind_and_picks_it_again_once_it_caught_up() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced).with_counts(1, 4, 1),
    )
    .unwrap();
    let behind = Arc::clone(&pool.streams_of(StreamPriority::Normal)[1]);
    let flags = Flags::new(context, 1);
    hold(&kernels, &behind, flags.device(0));
    submit_from_threads(&behind, 6, 100);
    assert_eq!(behind.outstanding_work().unwrap(), 601);
    let picks: Vec<u64> = (0..12).map(|_| pool.get_stream().unwrap().id()).collect();
    let handed = picks.iter().filter(|&&id| id == behind.id()).count();
    flags.write(0, 1);
    behind.synchronize().unwrap();
    assert_eq!(
        handed, 0,
        "LoadBalanced handed out the stream 601 operations behind {handed} times: {picks:?}"
    );
    assert_eq!(behind.outstanding_work().unwrap(), 0);
    let after: Vec<u64> = (0..12).map(|_| pool.get_stream().unwrap().id()).collect();
    assert!(
        after.contains(&behind.id()),
        "once caught up the stream is idle like the others and is handed out in turn: \
         {after:?} (stream {})",
        behind.id()
    );
}

/// A server begins a request on the `Priority` pool's only high stream (`begin_on_pool` for a
/// `Critical` request) after two producers, each on its own gated stream. While either gate
/// holds, the high stream is pending and the pool hands out its normal stream instead; the
/// first gate opening is not enough; once both open and the wait has passed,
/// `has_pending_waits` must clear and the pool hands out the high stream again (a stream
/// marked pending for good would never serve urgent work again). What the high stream ran
/// reads both producers' stores.
#[test]
fn a_pool_stream_held_by_two_dependencies_is_pending_until_both_pass_then_handed_out_again() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream_kernels = StreamKernels::load(context).unwrap();
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority).with_counts(1, 1, 1),
    )
    .unwrap();
    let (coordinator, _waiter, _events) = coordinator(context);
    // Words 0, 1: gates; 2, 3: the producers' stores; 4, 5: what the consumer read.
    let flags = Flags::new(context, 6);
    let producers = common::streams(context, 2);
    let mut produced = Vec::new();
    for (i, producer) in producers.iter().enumerate() {
        let id = register(&coordinator, EventPriority::Low, &[], "probe");
        coordinator.begin_operation(id, producer).unwrap();
        gate(&kernels, producer, flags.device(i));
        store_after(&kernels, producer, 0, flags.device(2 + i), 40 + i as u32);
        coordinator.complete_operation(id).unwrap();
        produced.push(id);
    }
    let consume = register(&coordinator, EventPriority::Critical, &produced, "probe");
    let high = coordinator.begin_on_pool(consume, &pool).unwrap();
    assert_eq!(high.priority(), StreamPriority::High);
    high.launch(|s| {
        copy_flag(&stream_kernels, s, flags.device(2), flags.device(4));
        copy_flag(&stream_kernels, s, flags.device(3), flags.device(5));
        Ok::<(), DriverError>(())
    })
    .unwrap();
    coordinator.complete_operation(consume).unwrap();

    assert!(high.has_pending_waits().unwrap(), "both gates closed");
    let while_held = pool.get_stream().unwrap();
    assert_ne!(
        while_held.id(),
        high.id(),
        "the held high stream handed out"
    );
    flags.write(0, 1);
    producers[0].synchronize().unwrap();
    assert!(
        high.has_pending_waits().unwrap(),
        "the second dependency still holds the stream"
    );
    flags.write(1, 1);
    high.synchronize().unwrap();
    assert!(
        !high.has_pending_waits().unwrap(),
        "the waits have passed (the stream is idle) but has_pending_waits still reads true"
    );
    assert_eq!(high.outstanding_work().unwrap(), 0);
    assert_eq!(
        pool.get_stream().unwrap().id(),
        high.id(),
        "the idle high stream is the Priority pool's first pick again"
    );
    assert_eq!((flags.read(4), flags.read(5)), (40, 41));
    assert!(poll_until(Duration::from_secs(5), || {
        coordinator.retire_finished();
        coordinator.live_operations() == 0
    }));
}

/// A pipeline joins a library's own driver stream (a decoder's, gated) with the pool's only
/// high stream through one `CrossStreamBarrier` over both kinds (a user enum implementing
/// `AsStream` and forwarding `note_queued_wait`), the pool stream first, so it is the hub that
/// waits for the driver stream. The pool stream must read pending and the `Priority` pool hand
/// out its normal stream instead; after the gate opens, `has_pending_waits` clears and the high
/// stream is the first pick again. What the pool stream ran after the barrier read the
/// decoder's store; a barrier of one stream queues no wait and leaves nothing pending.
#[test]
fn a_barrier_over_a_driver_stream_and_a_pool_stream_holds_the_pool_stream_until_it_passes() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream_kernels = StreamKernels::load(context).unwrap();
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority).with_counts(1, 1, 1),
    )
    .unwrap();
    let high = Arc::clone(&pool.streams_of(StreamPriority::High)[0]);
    let decoder = Stream::new(context, cuweave_driver::StreamFlags::NON_BLOCKING).unwrap();
    let flags = Flags::new(context, 3);
    gate(&kernels, &decoder, flags.device(0));
    store_after(&kernels, &decoder, 0, flags.device(1), 0xD0);

    let events = EventPool::new(context, 0, 0).unwrap();
    let lone = CrossStreamBarrier::from_streams(
        vec![Arc::new(Lane::Pool(Arc::clone(&high)))],
        events.clone(),
    )
    .unwrap();
    lone.queue().unwrap();
    assert!(
        !high.has_pending_waits().unwrap(),
        "a one-stream barrier waits for nothing"
    );

    let lanes = vec![
        Arc::new(Lane::Pool(Arc::clone(&high))),
        Arc::new(Lane::Driver(decoder)),
    ];
    let barrier = CrossStreamBarrier::from_streams(lanes, events.clone()).unwrap();
    barrier.queue().unwrap();
    let pending = high.has_pending_waits().unwrap();
    let pick_while_held = pool.get_stream().unwrap().id();
    high.launch(|s| {
        copy_flag(&stream_kernels, s, flags.device(1), flags.device(2));
        Ok::<(), DriverError>(())
    })
    .unwrap();
    flags.write(0, 1);
    barrier.synchronize().unwrap();
    assert!(pending, "the hub pool stream waits for the gated decoder");
    assert_ne!(
        pick_while_held,
        high.id(),
        "the held high stream handed out"
    );
    assert_eq!(flags.read(2), 0xD0, "the pool stream ran after the barrier");
    assert!(
        !high.has_pending_waits().unwrap(),
        "the barrier's waits have passed"
    );
    assert_eq!(pool.get_stream().unwrap().id(), high.id());
    assert_eq!(events.utilization().in_use, 0, "barrier events returned");
}

/// A batch server, 12 000 requests in 3000 groups of four: the first three of each group are
/// withdrawn (clients gone) in a scrambled order (the middle one first, then the third, and the
/// first only during the next group, so runs form out of order and merge late), the fourth runs
/// to completion on a stream. That is 3000 runs of withdrawn ids, under the 4096 kept: every
/// withdrawn id reads unknown to `state`, `completion` and as a dependency; every completed one
/// reads `Completed`. Then 2000 more isolated withdrawals (each between two completions) push
/// past the bound: the least recently cancelled runs go, but the 2000 new ones and the latest
/// 2000 groups of the first phase (all within the most recent 4096 runs) must still read
/// unknown. Nothing stays live.
#[test]
fn withdrawals_interleaved_with_completions_forget_only_the_least_recently_cancelled_runs() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (coordinator, _waiter, _events) = coordinator(context);
    let stream = common::stream(context);
    let complete = |id: OperationId| {
        coordinator.begin_operation(id, &stream).unwrap();
        coordinator.complete_operation(id).unwrap();
    };
    let mut groups: Vec<[OperationId; 4]> = Vec::with_capacity(3000);
    let mut late_first: Option<OperationId> = None;
    for _ in 0..3000 {
        let ids = [(); 4].map(|()| register(&coordinator, EventPriority::Normal, &[], "probe"));
        coordinator.cancel_operation(ids[1]).unwrap();
        if let Some(first) = late_first.take() {
            coordinator.cancel_operation(first).unwrap();
        }
        coordinator.cancel_operation(ids[2]).unwrap();
        complete(ids[3]);
        late_first = Some(ids[0]);
        groups.push(ids);
    }
    coordinator
        .cancel_operation(late_first.take().unwrap())
        .unwrap();
    stream.synchronize().unwrap();
    coordinator.retire_finished();
    let check_group = |ids: &[OperationId; 4], what: &str| {
        for &id in &ids[..3] {
            assert!(
                unknown(&coordinator.state(id), id),
                "{what}: withdrawn {id:?} reads {:?}",
                coordinator.state(id)
            );
            assert!(unknown(&coordinator.completion(id), id), "{what}: {id:?}");
            let dependant = coordinator.register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                None,
                &[id],
                "after a withdrawn request",
            );
            assert!(
                unknown(&dependant, id),
                "{what}: {id:?} taken as a dependency"
            );
        }
        assert_eq!(
            coordinator.state(ids[3]).unwrap(),
            OperationState::Completed,
            "{what}"
        );
    };
    for ids in &groups {
        check_group(ids, "phase one");
    }

    let mut isolated = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let id = register(&coordinator, EventPriority::Normal, &[], "probe");
        coordinator.cancel_operation(id).unwrap();
        complete(register(&coordinator, EventPriority::Normal, &[], "probe"));
        isolated.push(id);
    }
    stream.synchronize().unwrap();
    coordinator.retire_finished();
    for &id in &isolated {
        assert!(
            unknown(&coordinator.state(id), id),
            "phase two: a withdrawal among the latest 2000 reads {:?}",
            coordinator.state(id)
        );
    }
    for ids in &groups[1000..] {
        check_group(ids, "phase one, among the latest 4096 runs");
    }
    assert!(poll_until(Duration::from_secs(5), || {
        coordinator.retire_finished();
        coordinator.live_operations() == 0
    }));
}

/// A program that captures a graph in thread-local mode (cuweave's default) on a worker thread
/// and keeps the capture open while the main thread serves from a `LoadBalanced` pool, one of
/// whose streams is 601 operations behind a closed gate. Event queries from the main thread do
/// not break a thread-local capture of another thread, so the strategy must still read the
/// real counts and avoid the stream behind; work submitted to it meanwhile (its searches
/// skipped while the capture is active) keeps `outstanding_work` exact. The capture ends
/// cleanly; once the gate opens everything finishes.
#[test]
fn load_balanced_still_reads_real_counts_while_another_thread_captures_thread_locally() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced).with_counts(1, 3, 1),
    )
    .unwrap();
    let behind = Arc::clone(&pool.streams_of(StreamPriority::Normal)[0]);
    let flags = Flags::new(context, 1);
    hold(&kernels, &behind, flags.device(0));
    submit_from_threads(&behind, 6, 100);
    let capturing = common::stream(context);
    let (begun_tx, begun_rx) = std::sync::mpsc::channel();
    let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
    let (picks, during) = std::thread::scope(|scope| {
        let (capturing, kernels) = (&capturing, &kernels);
        let worker = scope.spawn(move || {
            capturing.begin_capture(CaptureMode::ThreadLocal).unwrap();
            kernels.spin_ns(capturing, 1_000).unwrap();
            begun_tx.send(()).unwrap();
            end_rx.recv().unwrap();
            capturing.end_capture().map(drop)
        });
        begun_rx.recv().unwrap();
        let picks: Vec<u64> = (0..9).map(|_| pool.get_stream().unwrap().id()).collect();
        submit_from_threads(&behind, 5, 10);
        let during = behind.outstanding_work();
        end_tx.send(()).unwrap();
        worker
            .join()
            .unwrap()
            .expect("the thread-local capture ended cleanly");
        (picks, during)
    });
    let handed = picks.iter().filter(|&&id| id == behind.id()).count();
    flags.write(0, 1);
    behind.synchronize().unwrap();
    assert_eq!(
        during.unwrap(),
        651,
        "outstanding_work during another thread's thread-local capture"
    );
    assert_eq!(
        handed,
        0,
        "LoadBalanced handed out the stream 601 operations behind {handed} times while another \
         thread captured thread-locally: {picks:?} (stream {})",
        behind.id()
    );
    assert_eq!(behind.outstanding_work().unwrap(), 0);
}

/// A request queue that withdraws a request early, then serves thousands of others, each
/// withdrawn between completions (every withdrawal its own run), and much later withdraws the
/// request registered right after the first (still waiting all that time): the two ids are
/// neighbours, so their withdrawals join into one run, cancelled into most recently. Past the
/// 4096 runs kept, the runs least recently cancelled into go, and the joined run is not one of
/// them: both of its ids must still read unknown (never `Completed`), while completions read
/// completed and nothing stays live.
#[test]
fn a_run_joined_by_a_late_withdrawal_counts_as_recently_cancelled() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (coordinator, _waiter, _events) = coordinator(context);
    let stream = common::stream(context);
    let complete = |id: OperationId| {
        coordinator.begin_operation(id, &stream).unwrap();
        coordinator.complete_operation(id).unwrap();
    };
    let early = register(&coordinator, EventPriority::Normal, &[], "probe");
    let neighbour = register(&coordinator, EventPriority::Normal, &[], "probe");
    coordinator.cancel_operation(early).unwrap();
    let mut completed = Vec::new();
    let mut storm = Vec::new();
    for _ in 0..4000 {
        let done = register(&coordinator, EventPriority::Normal, &[], "probe");
        complete(done);
        completed.push(done);
        let gone = register(&coordinator, EventPriority::Normal, &[], "probe");
        coordinator.cancel_operation(gone).unwrap();
        storm.push(gone);
    }
    // `early` is still among the 4096 latest runs; joining `neighbour` to it refreshes it.
    assert!(unknown(&coordinator.state(early), early));
    coordinator.cancel_operation(neighbour).unwrap();
    for _ in 0..1000 {
        let done = register(&coordinator, EventPriority::Normal, &[], "probe");
        complete(done);
        completed.push(done);
        let gone = register(&coordinator, EventPriority::Normal, &[], "probe");
        coordinator.cancel_operation(gone).unwrap();
        storm.push(gone);
    }
    stream.synchronize().unwrap();
    coordinator.retire_finished();
    for id in [early, neighbour] {
        assert!(
            unknown(&coordinator.state(id), id),
            "{id:?}, withdrawn (joined) 1000 runs ago, reads {:?}",
            coordinator.state(id)
        );
        let dependant = coordinator.register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            None,
            &[id],
            "after a withdrawn request",
        );
        assert!(
            unknown(&dependant, id),
            "{id:?} taken as a finished dependency"
        );
    }
    // The latest 4000 isolated withdrawals are within the bound too (4000 + the joined run).
    for &id in &storm[1000..] {
        assert!(unknown(&coordinator.state(id), id), "{id:?}");
    }
    for &id in completed.iter().step_by(97) {
        assert_eq!(coordinator.state(id).unwrap(), OperationState::Completed);
    }
    assert!(poll_until(Duration::from_secs(5), || {
        coordinator.retire_finished();
        coordinator.live_operations() == 0
    }));
}
