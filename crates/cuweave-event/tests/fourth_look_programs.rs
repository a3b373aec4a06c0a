//! A fourth look at the event layer through programs its users write, aimed at what the earlier
//! files leave out:
//!
//! - point-in-time semantics (`torch.cuda.Event.record` then more work on the stream): a
//!   dependant, a stream-idle future and an event future wait only for the work queued before
//!   their point, never for a closed gate queued on the same stream after it;
//! - a fan-in of sixteen streams into one consumer, round after round, with write-after-read
//!   dependencies back onto the producers, every device wait counted exactly in the first round;
//! - one operation depending on dependencies in every state at once (retired, completed but
//!   kept, queued on another stream, queued on its own stream), and on one withdrawn;
//! - ten thousand operations in a chain that hops streams at every step, with GPU timing on:
//!   an exact device counter, nothing live at each checkpoint, every operation timed once;
//! - a hedged request: the winner's completion callback withdraws the backup (and the slot it
//!   was waiting for) from the reactor thread;
//! - a bulk-synchronous loop over thirty-two streams with two barriers per round;
//! - sixteen threads waiting at once, half on streams held by a long kernel with tight
//!   timeouts that must fire, half with generous ones that must not;
//! - a scheduler that always begins the most urgent ready operation of a random DAG over eight
//!   streams, every read of a dependency's output checked on the device;
//! - GPU timing decided by the state at `begin`, not at `complete`.
//!
//! Every outcome is the GPU's: kernels that spin and then store into mapped host memory,
//! kernels that copy or count those words, transforms that count input read before its
//! producer wrote it. Every GPU test takes `serial()`.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use common::{
    Flags, MS, US, copy_flag, filled, gate, read_u32s, register_kernel, settle, store_after, within,
};
use cuweave_driver::{Context, Stream};
use cuweave_event::{
    AsyncEventWaiter, CrossStreamBarrier, EventError, EventPool, EventPriority,
    OperationCoordinator, OperationId, OperationState, OperationType, WaitOptions, WaitResult,
    WakeMechanism,
};
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{poll_until, require_gpu, serial, skip_under_sanitizer};

/// Queues `*out = |{ i < n : flags[i] == expected }|` on `stream`.
fn count_flags(
    kernels: &EventKernels,
    stream: &Stream,
    flags: u64,
    n: usize,
    value: u32,
    out: u64,
) {
    // SAFETY: `n` words from `flags` and the word at `out` are mapped pinned memory that
    // outlives the kernel.
    unsafe {
        kernels
            .count_flags_u32(stream, flags, n, value, out)
            .unwrap()
    };
}

/// A coordinator with its own waiter and event pool (so its counters are this test's alone).
fn coordinator(context: &Arc<Context>) -> (OperationCoordinator, Arc<AsyncEventWaiter>, EventPool) {
    let pool = EventPool::new(context, 0, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(pool.clone(), Arc::clone(&waiter));
    (coordinator, waiter, pool)
}

/// Begins `id` on `stream`, queues `work` there, and completes it.
fn run(
    coordinator: &OperationCoordinator,
    id: OperationId,
    stream: &Arc<Stream>,
    work: impl FnOnce(),
) {
    coordinator.begin_operation(id, stream).unwrap();
    work();
    coordinator.complete_operation(id).unwrap();
}

/// Asserts that within 2 s no operation of `coordinator` is live; `why` ends the message.
fn assert_none_live(coordinator: &OperationCoordinator, why: &str) {
    assert!(
        poll_until(Duration::from_secs(2), || coordinator.live_operations()
            == 0),
        "{} operations {why}",
        coordinator.live_operations()
    );
}

/// How many kernel operations of `coordinator` have a GPU time.
fn kernels_timed(coordinator: &OperationCoordinator) -> u64 {
    coordinator
        .metrics()
        .timed_by_type
        .get(&OperationType::Kernel)
        .copied()
        .unwrap_or(0)
}

/// How many events `pool` has made, of every kind.
fn events_created(pool: &EventPool) -> u64 {
    let counters = pool.counters();
    counters.created_regular + counters.created_timing + counters.created_blocking
}

/// PyTorch programs record an event, keep queueing work on the same stream, and have another
/// stream `wait_event` on it: the wait covers the work before the record only. Sequence:
/// `produce` on `s1` stores 7 after a first gate and a 2 ms spin, and completes; a
/// `stream_idle` future and an event recorded on `s1` mark the same point; then `s1` gets a
/// second closed gate and, behind it, a store of 99 into the same word. `consume` on `s2`
/// depends on `produce` and copies the word; then the first gate opens.
///
/// Expected, all while the second gate is still closed: `consume` completes and saw 7 (never 99, never
/// 0); both futures resolve; `produce` reads `Completed` and retires; `completion(produce)`
/// resolves at once. After the gate opens the word is 99.
#[test]
fn work_queued_after_a_point_never_holds_back_what_waits_for_that_point() {
    let gpu = require_gpu!();
    if skip_under_sanitizer(
        "work_queued_after_a_point_never_holds_back_what_waits_for_that_point",
        "needs a stream to run beside a gated one",
    ) {
        return;
    }
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream_kernels = StreamKernels::load(&gpu.context).unwrap();
    // 0: the gate after the point; 1: the word `produce` and the gated store write; 2: what
    // `consume` saw; 3: a gate before `produce`'s store, so that it is surely still queued
    // when `consume` begins (its device wait is then certain).
    let flags = Flags::new(&gpu.context, 4);
    let (s1, s2) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let (coordinator, waiter, pool) = coordinator(&gpu.context);

    let produce = register_kernel(&coordinator, &[], "produce");
    let consume = register_kernel(&coordinator, &[produce], "consume");
    run(&coordinator, produce, &s1, || {
        gate(&kernels, &s1, flags.device(3));
        store_after(&kernels, &s1, 2 * MS, flags.device(1), 7);
    });
    let idle = waiter.stream_idle(&s1).unwrap();
    let marker = pool.acquire_owned(false).unwrap();
    marker.record(&s1).unwrap();
    let marked = waiter.event_done(marker);
    // Later work on the same stream: held until the host opens the gate.
    gate(&kernels, &s1, flags.device(0));
    store_after(&kernels, &s1, 0, flags.device(1), 99);

    run(&coordinator, consume, &s2, || {
        copy_flag(&stream_kernels, &s2, flags.device(1), flags.device(2))
    });
    flags.write(3, 1);
    assert_eq!(
        coordinator.metadata(consume).unwrap().cross_stream_waits,
        1,
        "`consume` is on another stream than `produce`"
    );

    let waiting = coordinator.clone();
    within(Duration::from_secs(5), move || waiting.synchronize(consume))
        .expect("`consume` waits only for `produce`, not for the gate queued after it");
    assert_eq!(flags.read(2), 7, "`consume` saw what `produce` stored");
    within(Duration::from_secs(5), move || {
        futures::executor::block_on(idle)
    })
    .expect("stream_idle covers the work queued before it, not the gate after it");
    within(Duration::from_secs(5), move || {
        futures::executor::block_on(marked)
    })
    .expect("an event recorded before the gate completes while the gate is closed");
    assert_eq!(
        coordinator.state(produce).unwrap(),
        OperationState::Completed
    );
    let answered = coordinator.clone();
    within(Duration::from_secs(5), move || {
        futures::executor::block_on(answered.completion(produce).unwrap())
    })
    .unwrap();
    assert_none_live(
        &coordinator,
        "live though both completed while the gate held s1",
    );
    assert!(
        matches!(coordinator.metadata(produce), Err(EventError::Retired { id }) if id == produce)
    );
    assert_eq!(
        flags.read(1),
        7,
        "the gate is still closed: 99 not stored yet"
    );
    assert!(!s1.query().unwrap(), "s1 is still held by its gate");

    flags.write(0, 1);
    s1.synchronize().unwrap();
    assert_eq!(flags.read(1), 99);
    settle(&waiter, "after the gate opened");
    let metrics = coordinator.metrics();
    assert_eq!((metrics.completed, metrics.failed), (2, 0));
}

/// A reduction that gathers sixteen streams into one, twenty rounds in a row: round `r`'s
/// producers (stream `i` spins `40 + 15 i` µs, then stores `r + 1` into word `i`) depend on
/// round `r - 1`'s consumer (they overwrite what it reads); the consumer, on stream 0 beside
/// producer 0, depends on all sixteen and counts the words equal to `r + 1`. Round 0's
/// producers are held behind a gate until the consumer has begun, so its waits are known:
/// fifteen device waits and one same-stream dependency skipped.
///
/// Expected: every round's count is 16; round 0's consumer queued exactly 15 waits; at the end
/// every operation completed and retired.
#[test]
fn sixteen_producer_streams_fan_into_one_consumer_round_after_round() {
    const STREAMS: usize = 16;
    const ROUNDS: usize = 20;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    // Words 0..16: the producers'; 16..36: each round's count; 36: the gate.
    let flags = Flags::new(&gpu.context, STREAMS + ROUNDS + 1);
    let gate_word = STREAMS + ROUNDS;
    let streams = common::streams(&gpu.context, STREAMS);
    let (coordinator, waiter, _pool) = coordinator(&gpu.context);

    let mut previous: Option<OperationId> = None;
    let mut last = None;
    for round in 0..ROUNDS {
        let value = round as u32 + 1;
        let deps: Vec<OperationId> = previous.into_iter().collect();
        let producers: Vec<OperationId> = (0..STREAMS)
            .map(|i| {
                let id = coordinator
                    .register_operation(
                        OperationType::Kernel,
                        EventPriority::High,
                        Some(&streams[i]),
                        &deps,
                        format!("produce {i} of round {round}"),
                    )
                    .unwrap();
                run(&coordinator, id, &streams[i], || {
                    if round == 0 {
                        gate(&kernels, &streams[i], flags.device(gate_word));
                    }
                    store_after(
                        &kernels,
                        &streams[i],
                        (40 + 15 * i as u64) * US,
                        flags.device(i),
                        value,
                    );
                });
                id
            })
            .collect();
        let consumer = coordinator
            .register_operation(
                OperationType::Reduction,
                EventPriority::Normal,
                Some(&streams[0]),
                &producers,
                format!("gather round {round}"),
            )
            .unwrap();
        let before = coordinator.metrics();
        coordinator.begin_operation(consumer, &streams[0]).unwrap();
        if round == 0 {
            let after = coordinator.metrics();
            assert_eq!(
                after.cross_stream_waits - before.cross_stream_waits,
                STREAMS as u64 - 1,
                "one device wait per producer on another stream"
            );
            assert_eq!(
                after.same_stream_waits_skipped - before.same_stream_waits_skipped,
                1,
                "producer 0 shares the consumer's stream"
            );
            assert_eq!(
                coordinator.metadata(consumer).unwrap().cross_stream_waits,
                STREAMS - 1
            );
        }
        count_flags(
            &event_kernels,
            &streams[0],
            flags.device(0),
            STREAMS,
            value,
            flags.device(STREAMS + round),
        );
        coordinator.complete_operation(consumer).unwrap();
        if round == 0 {
            flags.write(gate_word, 1);
        }
        previous = Some(consumer);
        last = Some(consumer);
    }
    coordinator.synchronize(last.unwrap()).unwrap();
    let counts: Vec<u32> = (0..ROUNDS).map(|r| flags.read(STREAMS + r)).collect();
    assert_eq!(
        counts,
        vec![STREAMS as u32; ROUNDS],
        "a gather saw a producer's word before its store"
    );
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_none_live(&coordinator, "still live");
    let metrics = coordinator.metrics();
    let total = (ROUNDS * (STREAMS + 1)) as u64;
    assert_eq!(
        (metrics.registered, metrics.begun, metrics.completed),
        (total, total, total)
    );
    settle(&waiter, "after the rounds");
}

/// One operation whose dependencies are in every state a dependency can be in when it begins:
/// `retired` (completed, nothing held it), `kept` (completed, held by a registered operation
/// that never begins), `remote` (queued on another stream, behind a closed gate) and `local`
/// (queued on the dependant's own stream, behind the same gate). A `withdrawn` operation was
/// cancelled before anything could depend on it. `gather` copies the four words they stored.
///
/// Expected: a dependency on `withdrawn` is refused as unknown (`register`, `state`,
/// `completion`, `on_complete`); `gather` queues exactly one device wait (for `remote`) and
/// skips one (for `local`); it copies 1, 2, 3, 4; cancelling the holder lets `kept` retire;
/// nothing is left live.
#[test]
fn one_operation_depends_on_retired_kept_remote_and_local_dependencies_at_once() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream_kernels = StreamKernels::load(&gpu.context).unwrap();
    // 0..4: the dependencies' words; 4..8: gather's copies; 8: the gate.
    let flags = Flags::new(&gpu.context, 9);
    let (s1, s2, s3) = (
        common::stream(&gpu.context),
        common::stream(&gpu.context),
        common::stream(&gpu.context),
    );
    let (coordinator, waiter, _pool) = coordinator(&gpu.context);

    let retired = register_kernel(&coordinator, &[], "retired");
    run(&coordinator, retired, &s1, || {
        store_after(&kernels, &s1, 0, flags.device(0), 1)
    });
    coordinator.synchronize(retired).unwrap();
    coordinator.retire_finished();
    assert!(matches!(
        coordinator.metadata(retired),
        Err(EventError::Retired { .. })
    ));

    let kept = register_kernel(&coordinator, &[], "kept");
    let holder = register_kernel(&coordinator, &[kept], "never begins");
    run(&coordinator, kept, &s1, || {
        store_after(&kernels, &s1, 0, flags.device(1), 2)
    });
    coordinator.synchronize(kept).unwrap();
    coordinator.retire_finished();
    assert_eq!(
        coordinator.metadata(kept).unwrap().state,
        OperationState::Completed,
        "completed, kept for `holder`"
    );

    let withdrawn = register_kernel(&coordinator, &[], "withdrawn");
    coordinator.cancel_operation(withdrawn).unwrap();
    assert!(matches!(
        coordinator.register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            None,
            &[retired, withdrawn],
            "after a withdrawn one",
        ),
        Err(EventError::UnknownOperation { id, .. }) if id == withdrawn
    ));
    assert!(matches!(
        coordinator.state(withdrawn),
        Err(EventError::UnknownOperation { .. })
    ));
    assert!(matches!(
        coordinator.completion(withdrawn),
        Err(EventError::UnknownOperation { .. })
    ));
    assert!(matches!(
        coordinator.on_complete(withdrawn, |_, _| panic!("never runs")),
        Err(EventError::UnknownOperation { .. })
    ));

    // `remote` and `local` each store behind the same closed gate, on `s2` and `s3`.
    let [remote, local] =
        [("remote", &s2, 2, 3), ("local", &s3, 3, 4)].map(|(what, stream, word, value)| {
            let id = register_kernel(&coordinator, &[], what);
            run(&coordinator, id, stream, || {
                gate(&kernels, stream, flags.device(8));
                store_after(&kernels, stream, 0, flags.device(word), value);
            });
            id
        });

    let gather = register_kernel(&coordinator, &[retired, kept, remote, local], "gather");
    let before = coordinator.metrics();
    coordinator.begin_operation(gather, &s3).unwrap();
    let after = coordinator.metrics();
    for word in 0..4 {
        copy_flag(
            &stream_kernels,
            &s3,
            flags.device(word),
            flags.device(4 + word),
        );
    }
    coordinator.complete_operation(gather).unwrap();
    assert_eq!(
        coordinator.metadata(gather).unwrap().cross_stream_waits,
        1,
        "only `remote` needs a device wait"
    );
    assert_eq!(after.cross_stream_waits - before.cross_stream_waits, 1);
    assert_eq!(
        after.same_stream_waits_skipped - before.same_stream_waits_skipped,
        1
    );
    flags.write(8, 1);
    coordinator.synchronize(gather).unwrap();
    assert_eq!(
        (4..8).map(|word| flags.read(word)).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );

    coordinator.cancel_operation(holder).unwrap();
    assert!(matches!(
        coordinator.metadata(kept),
        Err(EventError::Retired { .. })
    ));
    assert_none_live(&coordinator, "still live");
    let metrics = coordinator.metrics();
    assert_eq!(
        (metrics.completed, metrics.cancelled, metrics.failed),
        (5, 2, 0)
    );
    settle(&waiter, "at the end");
}

/// Ten thousand operations, each depending on the one before, begun on four streams in turn
/// (so every dependency is on another stream), each incrementing one device word, with GPU
/// timing on. Every thousand operations the program synchronizes the latest one.
///
/// Expected: the word ends at exactly 10 000 (a missed wait would let two increments race);
/// no same-stream skip; at every checkpoint nothing is live (everything before it completed,
/// and every dependant began); events stay bounded; every operation has a GPU time, once.
#[test]
fn ten_thousand_operations_hopping_streams_with_timing_are_exact_timed_and_retire() {
    const OPS: usize = 10_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let streams = common::streams(&gpu.context, 4);
    let (coordinator, waiter, pool) = coordinator(&gpu.context);
    coordinator.set_timing(true);
    let counter = filled(&gpu.context, 1, 0);

    let mut previous: Option<OperationId> = None;
    for i in 0..OPS {
        let deps: Vec<OperationId> = previous.into_iter().collect();
        let id = register_kernel(&coordinator, &deps, "");
        let stream = &streams[i % streams.len()];
        run(&coordinator, id, stream, || {
            // SAFETY: one word of a live allocation; the host touches it only after
            // synchronizing.
            unsafe { kernels.increment_u32(stream, counter.ptr(), 1).unwrap() };
        });
        if i % 1000 == 999 {
            coordinator.synchronize(id).unwrap();
            coordinator.retire_finished();
            assert_eq!(
                coordinator.live_operations(),
                0,
                "after synchronizing operation {i}, everything before it has completed"
            );
        }
        previous = Some(id);
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_eq!(
        read_u32s(&gpu.context, counter.ptr(), 1),
        vec![OPS as u32],
        "increments raced: a dependency's device wait was missing"
    );
    assert!(
        poll_until(Duration::from_secs(3), || kernels_timed(&coordinator)
            >= OPS as u64),
        "{} of {OPS} operations have a GPU time",
        kernels_timed(&coordinator)
    );
    let metrics = coordinator.metrics();
    assert_eq!(
        kernels_timed(&coordinator),
        OPS as u64,
        "an operation timed twice"
    );
    assert!(metrics.gpu_time_by_type[&OperationType::Kernel] > Duration::ZERO);
    assert_eq!(
        (metrics.registered, metrics.begun, metrics.completed),
        (OPS as u64, OPS as u64, OPS as u64)
    );
    assert_eq!(metrics.same_stream_waits_skipped, 0);
    assert!(metrics.cross_stream_waits < OPS as u64);
    assert_eq!(coordinator.live_operations(), 0);
    let created = events_created(&pool);
    assert!(
        created <= 4096,
        "{created} events for {OPS} operations: {:?}",
        pool.counters()
    );
    assert_eq!(pool.utilization().in_use, 0, "every event back in the pool");
    settle(&waiter, "at the end");
}

/// A hedged request, as inference servers send them: `upload` feeds both a `primary` and a
/// `backup`; the backup also waits for a `slot` that is never begun. When the primary
/// completes, its callback (on whichever thread observes it: the reactor's, usually) withdraws
/// the backup and then the slot.
///
/// Expected: before that, `wait_until_ready(backup)` reports `Stalled` on the slot; the
/// backup's own callback gets `Cancelled`, before the primary's callback returns; both
/// withdrawals succeed; the primary copied what the upload stored; afterwards the backup is
/// unknown and nothing stays live.
#[test]
fn a_hedged_requests_backup_is_withdrawn_by_the_winners_completion_callback() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream_kernels = StreamKernels::load(&gpu.context).unwrap();
    let flags = Flags::new(&gpu.context, 2);
    let (s0, s1) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let (coordinator, waiter, _pool) = coordinator(&gpu.context);

    let upload = register_kernel(&coordinator, &[], "upload");
    let slot = register_kernel(&coordinator, &[], "slot");
    let backup = register_kernel(&coordinator, &[upload, slot], "backup");
    let primary = register_kernel(&coordinator, &[upload], "primary");
    let (tx, rx) = mpsc::channel::<(&'static str, WaitResult)>();
    let backup_tx = tx.clone();
    coordinator
        .on_complete(backup, move |_, result| {
            let _ = backup_tx.send(("backup", result));
        })
        .unwrap();

    run(&coordinator, upload, &s0, || {
        store_after(&kernels, &s0, 2 * MS, flags.device(0), 5)
    });
    assert!(matches!(
        coordinator.wait_until_ready(backup, Duration::ZERO),
        Err(EventError::Stalled { id, ref blocked_on, .. }) if id == backup && *blocked_on == vec![slot]
    ));

    run(&coordinator, primary, &s1, || {
        copy_flag(&stream_kernels, &s1, flags.device(0), flags.device(1))
    });
    let hedger = coordinator.clone();
    coordinator
        .on_complete(primary, move |_, result| {
            let _ = tx.send(("primary", result));
            let _ = tx.send(("cancel backup", hedger.cancel_operation(backup)));
            let _ = tx.send(("cancel slot", hedger.cancel_operation(slot)));
        })
        .unwrap();

    let mut seen = Vec::new();
    while seen.len() < 4 {
        let message = rx
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("only {seen:?} within 5 s"));
        seen.push(message);
    }
    assert_eq!(
        seen,
        vec![
            ("primary", Ok(())),
            ("backup", Err(EventError::Cancelled { id: backup })),
            ("cancel backup", Ok(())),
            ("cancel slot", Ok(())),
        ]
    );
    assert_eq!(flags.read(1), 5, "the primary saw the upload");
    assert!(matches!(
        coordinator.state(backup),
        Err(EventError::UnknownOperation { .. })
    ));
    assert!(matches!(
        coordinator.wait_until_ready(backup, Duration::from_secs(1)),
        Err(EventError::UnknownOperation { .. })
    ));
    assert_none_live(&coordinator, "still live");
    let metrics = coordinator.metrics();
    assert_eq!(
        (
            metrics.completed,
            metrics.cancelled,
            metrics.callback_panics
        ),
        (2, 2, 0)
    );
    settle(&waiter, "at the end");
}

/// A bulk-synchronous loop over thirty-two streams: each round every stream stores the round
/// number after a short, uneven spin; a barrier; one stream (a different one each round)
/// counts the words equal to the round; a second barrier so that the next round's stores do
/// not overwrite what the count reads.
///
/// Expected: every count is 32 (with the hardware's few work queues aliasing the streams, a
/// wrong barrier would still be caught: the spins are uneven); the barrier reports `2 (n - 1)`
/// waits; its events go back to the pool (a bounded number made for 400 barriers).
#[test]
fn two_barriers_a_round_over_thirty_two_streams_order_every_round() {
    const STREAMS: usize = 32;
    const ROUNDS: usize = 200;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let flags = Flags::new(&gpu.context, STREAMS + ROUNDS);
    let streams = common::streams(&gpu.context, STREAMS);
    let pool = EventPool::new(&gpu.context, 0, 0).unwrap();
    let barrier = CrossStreamBarrier::new(streams.clone(), pool.clone()).unwrap();

    for round in 0..ROUNDS {
        let value = round as u32 + 1;
        for (i, stream) in streams.iter().enumerate() {
            let spin = ((i * 7 + round) % 5) as u64 * 10 * US;
            store_after(&kernels, stream, spin, flags.device(i), value);
        }
        let info = barrier.queue().unwrap();
        assert_eq!(
            (info.streams, info.waits),
            (STREAMS, 2 * (STREAMS - 1)),
            "{info:?}"
        );
        count_flags(
            &event_kernels,
            &streams[round % STREAMS],
            flags.device(0),
            STREAMS,
            value,
            flags.device(STREAMS + round),
        );
        barrier.wait_on_device().unwrap();
    }
    barrier.synchronize().unwrap();
    let wrong: Vec<(usize, u32)> = (0..ROUNDS)
        .map(|round| (round, flags.read(STREAMS + round)))
        .filter(|&(_, count)| count != STREAMS as u32)
        .collect();
    assert!(
        wrong.is_empty(),
        "rounds whose count missed a store: {wrong:?}"
    );
    assert_eq!(pool.utilization().in_use, 0, "every barrier event returned");
    let created = events_created(&pool);
    assert!(
        created <= 4 * STREAMS as u64,
        "{created} events made for {} barriers over {STREAMS} streams",
        2 * ROUNDS
    );
}

/// Sixteen threads of a server wait at once on one waiter. Eight own a stream held by a
/// one-second kernel and make twenty waits each with a 3 ms timeout, alternating completion
/// words and event queries: each must time out (the kernel is checked to be still running
/// after them). Eight own free streams and make fifty waits each behind a 20 µs spin with a
/// 10 s timeout: none may time out. Then each held stream is awaited with a 5 s timeout, which
/// must not fire though the kernel takes a second.
///
/// Expected: exact results per wait, and the waiter's books: 160 timed out, 16 + 400 + 8
/// completed, nothing failed, cancelled or pending.
#[test]
fn timeouts_that_must_fire_and_ones_that_must_not_from_sixteen_threads() {
    const HELD: usize = 8;
    const TIGHT: usize = 20;
    const FREE_WAITS: usize = 50;
    let gpu = require_gpu!();
    if skip_under_sanitizer(
        "timeouts_that_must_fire_and_ones_that_must_not_from_sixteen_threads",
        "needs free streams to run beside a one-second kernel",
    ) {
        return;
    }
    let _serial = serial();
    let kernels = Arc::new(TestKernels::load(&gpu.context).unwrap());
    let streams = common::streams(&gpu.context, 2 * HELD);
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    // Warm up: the waiter's completion words and the context's event pool exist before the
    // long kernels start.
    for stream in &streams {
        futures::executor::block_on(waiter.stream_idle(stream).unwrap()).unwrap();
    }
    for stream in &streams[..HELD] {
        kernels.spin_ns(stream, 1_000 * MS).unwrap();
    }

    let threads: Vec<_> = streams
        .iter()
        .enumerate()
        .map(|(i, stream)| {
            let (stream, waiter) = (Arc::clone(stream), Arc::clone(&waiter));
            let kernels = (i >= HELD).then(|| Arc::clone(&kernels));
            std::thread::spawn(move || -> Vec<String> {
                let mut wrong = Vec::new();
                if let Some(kernels) = kernels {
                    for n in 0..FREE_WAITS {
                        kernels.spin_ns(&stream, 20 * US).unwrap();
                        let options = WaitOptions::new(WakeMechanism::CompletionWord)
                            .with_timeout(Duration::from_secs(10));
                        let result = futures::executor::block_on(
                            waiter.stream_idle_with(&stream, options).unwrap(),
                        );
                        if result.is_err() {
                            wrong.push(format!("free stream {i}, wait {n}: {result:?}"));
                        }
                    }
                    return wrong;
                }
                let tight = Duration::from_millis(3);
                for n in 0..TIGHT {
                    let mechanism = if n % 2 == 0 {
                        WakeMechanism::CompletionWord
                    } else {
                        WakeMechanism::EventQuery
                    };
                    let options = WaitOptions::new(mechanism).with_timeout(tight);
                    let result = futures::executor::block_on(
                        waiter.stream_idle_with(&stream, options).unwrap(),
                    );
                    if result != Err(EventError::TimedOut { timeout: tight }) {
                        wrong.push(format!("held stream {i}, wait {n}: {result:?}"));
                    }
                }
                if stream.query().unwrap() {
                    wrong.push(format!(
                        "held stream {i}: its kernel ended before the tight waits did; the \
                         test proves nothing"
                    ));
                }
                wrong
            })
        })
        .collect();
    let wrong: Vec<String> = threads
        .into_iter()
        .flat_map(|thread| thread.join().unwrap())
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");

    for stream in &streams[..HELD] {
        let options =
            WaitOptions::new(WakeMechanism::CompletionWord).with_timeout(Duration::from_secs(5));
        futures::executor::block_on(waiter.stream_idle_with(stream, options).unwrap())
            .expect("a generous timeout must not fire before a one-second kernel ends");
        assert!(poll_until(Duration::from_secs(1), || stream
            .query()
            .unwrap()));
    }
    settle(&waiter, "after every wait");
    let stats = waiter.stats();
    let warm_up = 2 * HELD as u64;
    assert_eq!(stats.timed_out, (HELD * TIGHT) as u64, "{stats:?}");
    assert_eq!(
        stats.completed,
        warm_up + (HELD * FREE_WAITS) as u64 + HELD as u64,
        "{stats:?}"
    );
    assert_eq!((stats.failed, stats.cancelled, stats.pending), (0, 0, 0));
    assert_eq!(
        stats.registered,
        stats.completed + stats.timed_out,
        "{stats:?}"
    );
}

/// A small deterministic generator for the DAG below.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % below as u64) as usize
    }
}

/// A scheduler that always begins the most urgent ready operation, over a random DAG of 160
/// operations on eight streams: each has up to three dependencies among the twelve before it,
/// a random priority and a random stream (so some dependencies share its stream). Each
/// operation first reads every dependency's 4096-word output through a transform that counts
/// words still holding the sentinel (read before the producer wrote them), then spins 30 µs and
/// writes its own output.
///
/// Expected: `ready_operations` is never empty and always sorted most urgent first; the
/// device counted no unfinished input; every output holds its operation's value; nothing is
/// left live; the waits queued plus those skipped never exceed the dependencies.
#[test]
fn a_priority_scheduler_over_a_random_dag_on_eight_streams_reads_no_unfinished_input() {
    const OPS: usize = 160;
    const STREAMS: usize = 8;
    const N: usize = 4096;
    const SENTINEL: u32 = 0xFFFF_FFFF;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let streams = common::streams(&gpu.context, STREAMS);
    let outputs = filled(&gpu.context, OPS * N, SENTINEL);
    let scratch = filled(&gpu.context, STREAMS * N, 0);
    let unfinished = filled(&gpu.context, 1, 0);
    let output = |i: usize| outputs.ptr() + (i * N * 4) as u64;
    let (coordinator, waiter, _pool) = coordinator(&gpu.context);

    let priorities = [
        EventPriority::Critical,
        EventPriority::High,
        EventPriority::Normal,
        EventPriority::Low,
        EventPriority::Cleanup,
    ];
    let mut rng = Lcg(0x5eed);
    let mut index: HashMap<OperationId, usize> = HashMap::new();
    let mut plan = Vec::new();
    let mut ids = Vec::new();
    let mut dependency_pairs = 0u64;
    for i in 0..OPS {
        let mut deps: Vec<usize> = (0..rng.next(4))
            .filter(|_| i > 0)
            .map(|_| i - 1 - rng.next(i.min(12)))
            .collect();
        deps.sort_unstable();
        deps.dedup();
        dependency_pairs += deps.len() as u64;
        let priority = priorities[rng.next(priorities.len())];
        let stream = rng.next(STREAMS);
        let dep_ids: Vec<OperationId> = deps.iter().map(|&d| ids[d]).collect();
        let id = coordinator
            .register_operation(
                OperationType::Kernel,
                priority,
                Some(&streams[stream]),
                &dep_ids,
                format!("node {i}"),
            )
            .unwrap();
        index.insert(id, i);
        ids.push(id);
        plan.push((deps, priority, stream));
    }

    let mut begun = 0;
    let mut order = Vec::new();
    while begun < OPS {
        let ready = coordinator.ready_operations();
        assert!(!ready.is_empty(), "nothing ready after {begun} begun");
        let urgency: Vec<EventPriority> = ready.iter().map(|id| plan[index[id]].1).collect();
        assert!(
            urgency.windows(2).all(|pair| pair[0] <= pair[1]),
            "ready operations not most urgent first: {urgency:?}"
        );
        let id = ready[0];
        let i = index[&id];
        let (deps, _, stream) = &plan[i];
        let stream = &streams[*stream];
        coordinator.begin_operation(id, stream).unwrap();
        let own_scratch = scratch.ptr() + (plan[i].2 * N * 4) as u64;
        for &d in deps {
            // SAFETY: `N` words of live allocations (a dependency's output, a scratch area) and
            // one counter word; everything is synchronized before they are dropped.
            unsafe {
                event_kernels
                    .transform_checked_u32(
                        stream,
                        output(d),
                        own_scratch,
                        N,
                        1,
                        0,
                        SENTINEL,
                        unfinished.ptr(),
                    )
                    .unwrap();
            }
        }
        kernels.spin_ns(stream, 30 * US).unwrap();
        // SAFETY: `N` words of the live output allocation, written by this operation only.
        unsafe { kernels.fill_u32(stream, output(i), i as u32, N).unwrap() };
        coordinator.complete_operation(id).unwrap();
        order.push(i);
        begun += 1;
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_ne!(
        order,
        (0..OPS).collect::<Vec<_>>(),
        "priorities changed nothing: the test proves less than it says"
    );
    assert_eq!(
        read_u32s(&gpu.context, unfinished.ptr(), 1),
        vec![0],
        "an operation read a dependency's output before it was written"
    );
    let all = read_u32s(&gpu.context, outputs.ptr(), OPS * N);
    for (i, chunk) in all.chunks_exact(N).enumerate() {
        assert!(
            chunk.iter().all(|&word| word == i as u32),
            "output {i} is not all {i}"
        );
    }
    assert_none_live(&coordinator, "still live");
    let metrics = coordinator.metrics();
    assert_eq!((metrics.begun, metrics.completed), (OPS as u64, OPS as u64));
    assert!(
        metrics.cross_stream_waits + metrics.same_stream_waits_skipped <= dependency_pairs,
        "{metrics:?} for {dependency_pairs} dependencies"
    );
    settle(&waiter, "at the end");
}

/// Whether an operation is timed is decided when it begins: `timed` begins with timing on
/// (which is then turned off before it completes); `untimed` begins with timing off (turned on
/// before it completes). Each spins 2 ms. A registered operation holds both so their metadata
/// stays readable.
///
/// Expected: exactly one operation timed; `timed` has a GPU time of at least about 2 ms (its
/// own spin); `untimed` has none; no timing span is lost or invented.
#[test]
fn timing_is_decided_at_begin_not_at_complete() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = common::stream(&gpu.context);
    let (coordinator, waiter, _pool) = coordinator(&gpu.context);

    // Each begins with timing `at_begin` and completes with it flipped.
    let [timed, untimed] = [("timed", true), ("untimed", false)].map(|(what, at_begin)| {
        coordinator.set_timing(at_begin);
        let id = register_kernel(&coordinator, &[], what);
        run(&coordinator, id, &stream, || {
            kernels.spin_ns(&stream, 2 * MS).unwrap();
            coordinator.set_timing(!at_begin);
        });
        id
    });
    let holder = register_kernel(&coordinator, &[timed, untimed], "holder");

    coordinator.synchronize(untimed).unwrap();
    assert!(
        poll_until(Duration::from_secs(2), || kernels_timed(&coordinator) >= 1),
        "the operation begun with timing on has no GPU time"
    );
    coordinator.retire_finished();
    assert_eq!(
        kernels_timed(&coordinator),
        1,
        "only `timed` began with timing on"
    );
    let gpu_time = coordinator
        .metadata(timed)
        .unwrap()
        .gpu_time
        .expect("`timed` has its GPU time");
    assert!(
        gpu_time >= Duration::from_micros(1_900),
        "`timed` spun 2 ms on the GPU, measured {gpu_time:?}"
    );
    assert_eq!(coordinator.metadata(untimed).unwrap().gpu_time, None);
    coordinator.cancel_operation(holder).unwrap();
    assert_eq!(coordinator.live_operations(), 0);
    settle(&waiter, "at the end");
}
