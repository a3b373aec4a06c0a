//! A third look at the event layer through programs its users write, aimed at what the earlier
//! files leave out:
//!
//! - cudarc's `default_stream()` (the legacy null stream) inside a coordinator pipeline, a
//!   waiter's `stream_idle` and a barrier, beside non-blocking streams and a second handle of it;
//! - a fan-out to eight worker threads blocked in `wait_until_ready` and a gather that waits for
//!   all of them, with its device waits counted;
//! - work-stealing scheduler threads racing on `ready_operations` over a layered DAG;
//! - GPU time per operation: its own work, not the time its stream waited for a dependency, and
//!   already known to its completion callback;
//! - a barrier whose slowest stream is held by a host gate: no stream, and no host
//!   `synchronize`, gets past it first, whichever stream (hub or not) is held;
//! - waits on gated streams resolving in exactly the order their gates open, under tokio;
//! - every kind of wait on one gated point (futures of every mechanism, callbacks, blocking
//!   threads, a callback bridged to a oneshot before the operation was queued), typed
//!   timeouts while it is held, none resolving before the work's store;
//! - 20 000 requests of a server, half withdrawn (`cancel_operation`) before they begin;
//! - a dependency cycle closed by mistake, withdrawn;
//! - a dispatcher thread fed by completion callbacks through a channel, growing a tree of
//!   transforms across four streams.
//!
//! Every outcome is the GPU's: kernels that spin and then store into mapped host memory,
//! kernels that copy or count those words (so an ordering is proven by what a kernel saw), and
//! order-sensitive transforms whose exact result the host recomputes. Every GPU test takes
//! `serial()` and runs in well under five seconds on an H100.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use common::{
    Flags, MS, US, copy_flag, filled, gate, read_u32s, register_kernel, settle, store_after,
};
use cuweave_driver::Stream;
use cuweave_event::{
    AsyncEventWaiter, CrossStreamBarrier, EventError, EventPool, EventPriority,
    OperationCoordinator, OperationId, OperationState, OperationType, WaitFuture, WaitOptions,
    WaitResult, WakeMechanism,
};
use cuweave_stream::BarrierInfo;
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{poll_until, require_gpu, resident_bytes, serial, skip_under_sanitizer};

/// Waits as they resolve: which wait, its result, and the awaited work's stored word then.
type Resolved<K> = Arc<Mutex<Vec<(K, WaitResult, u32)>>>;

/// One poll of `future` with a waker that does nothing.
fn poll_once(future: &mut WaitFuture) -> Poll<Result<(), EventError>> {
    let mut cx = TaskContext::from_waker(Waker::noop());
    std::future::Future::poll(std::pin::Pin::new(future), &mut cx)
}

/// What `transform_checked_u32` computes for one element.
fn affine(x: u32, mul: u32, add: u32) -> u32 {
    x.wrapping_mul(mul).wrapping_add(add)
}

/// cudarc's `CudaContext::default_stream()` is CUDA's legacy null stream, and cudarc programs
/// mix it with forked non-blocking streams. Sequence: `produce` on a non-blocking stream (a
/// 30 ms spin, then it stores 7); `relay` on the legacy default stream, depending on it, copies
/// that word and, after a 20 ms spin, stores 9; `consume` on another non-blocking stream and
/// `reread` on a *second* handle of the null stream (`Stream::legacy_default` called again, as
/// code that asks for the default stream in two places does) each copy the 9, depending on
/// `relay`. A waiter's `stream_idle` on the null stream, then a barrier across the null stream
/// and both non-blocking streams (the hub a non-blocking one), the slow stream storing 11
/// before it and the others copying it after.
///
/// Non-blocking streams do not synchronise with the null stream on their own: only the
/// coordinator's and the barrier's device waits order them. Expected: the copies read 7, 9, 9,
/// 11 and 11 (without the waits they read 0); `stream_idle` on the null stream resolves only
/// after `relay`'s store; all four operations complete and retire.
#[test]
fn the_legacy_default_stream_takes_part_in_coordinated_pipelines_waits_and_barriers() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let copies = StreamKernels::load(context).unwrap();
    // 0: produce's store; 1: relay's copy of it; 2: relay's store; 3, 4: consume's and
    // reread's copies of it; 5: the barrier round's store; 6, 7: the copies of it.
    let flags = Flags::new(context, 8);
    let pool = EventPool::new(context, 8, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(pool.clone(), Arc::clone(&waiter));
    let (first, second) = (common::stream(context), common::stream(context));
    let legacy = Arc::new(Stream::legacy_default(context));
    let legacy_again = Arc::new(Stream::legacy_default(context));

    let produce = register_kernel(&coordinator, &[], "produce on a non-blocking stream");
    let relay = register_kernel(&coordinator, &[produce], "relay on the default stream");
    let consume = register_kernel(&coordinator, &[relay], "consume on a non-blocking stream");
    let reread = register_kernel(&coordinator, &[relay], "reread on the default stream");

    coordinator.begin_operation(produce, &first).unwrap();
    store_after(&kernels, &first, 30 * MS, flags.device(0), 7);
    coordinator.complete_operation(produce).unwrap();

    coordinator.begin_operation(relay, &legacy).unwrap();
    copy_flag(&copies, &legacy, flags.device(0), flags.device(1));
    store_after(&kernels, &legacy, 20 * MS, flags.device(2), 9);
    coordinator.complete_operation(relay).unwrap();

    coordinator.begin_operation(consume, &second).unwrap();
    copy_flag(&copies, &second, flags.device(2), flags.device(3));
    coordinator.complete_operation(consume).unwrap();

    coordinator.begin_operation(reread, &legacy_again).unwrap();
    copy_flag(&copies, &legacy_again, flags.device(2), flags.device(4));
    coordinator.complete_operation(reread).unwrap();

    let idle = waiter.stream_idle(&legacy).unwrap();
    let stored_when_idle = futures::executor::block_on(async {
        idle.await.unwrap();
        flags.read(2)
    });
    assert_eq!(
        stored_when_idle, 9,
        "stream_idle on the legacy default stream resolved before the work queued on it"
    );
    coordinator.synchronize(consume).unwrap();
    coordinator.synchronize(reread).unwrap();
    assert_eq!(
        flags.read(1),
        7,
        "the default stream's operation ran before its dependency on a non-blocking stream"
    );
    assert_eq!(
        flags.read(3),
        9,
        "a non-blocking stream's operation ran before its dependency on the default stream"
    );
    assert_eq!(
        flags.read(4),
        9,
        "the second handle of the default stream ran before the first handle's work"
    );

    let barrier = CrossStreamBarrier::new(
        vec![Arc::clone(&first), Arc::clone(&legacy), Arc::clone(&second)],
        pool.clone(),
    )
    .unwrap();
    store_after(&kernels, &second, 25 * MS, flags.device(5), 11);
    let info = barrier.queue().unwrap();
    assert_eq!((info.streams, info.waits), (3, 4));
    copy_flag(&copies, &legacy, flags.device(5), flags.device(6));
    copy_flag(&copies, &first, flags.device(5), flags.device(7));
    barrier.synchronize().unwrap();
    assert_eq!(
        (flags.read(6), flags.read(7)),
        (11, 11),
        "after a barrier across the default stream, a stream ran ahead of the slowest"
    );

    settle(&waiter, "legacy default stream");
    coordinator.retire_finished();
    let metrics = coordinator.metrics();
    assert_eq!(
        (metrics.registered, metrics.begun, metrics.completed),
        (4, 4, 4)
    );
    assert_eq!(coordinator.live_operations(), 0);
}

/// A broadcast and gather (an upload that eight workers read, a reduction over what they
/// wrote), each worker a thread of a pool blocked in `wait_until_ready` on its own operation
/// before the upload has even begun. The upload spins 100 ms and then stores 5; each worker
/// begins on its own stream, copies that word and, after `(i + 1)` ms, sets its done flag; the
/// main thread blocks in `wait_until_ready` on the gather, begins it on a tenth stream and
/// counts the done flags with a kernel.
///
/// Expected: only the upload is ready at first; no worker is told ready before the upload's
/// `complete_operation` was called; every worker copied 5 and the gather counted all eight
/// flags (so each of the nine device waits held); the gather queued exactly eight cross-stream
/// waits (its dependencies were all still in flight behind the upload), 16 in all; everything
/// completes and retires.
#[test]
fn eight_workers_blocked_in_wait_until_ready_fan_out_from_one_upload_into_one_gather() {
    const WORKERS: usize = 8;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let copies = StreamKernels::load(context).unwrap();
    let counters = EventKernels::load(context).unwrap();
    // 0: the upload's value; 1..=8: worker i's done flag; 9..=16: what worker i read; 17: the
    // gather's count.
    let flags = Flags::new(context, 2 * WORKERS + 2);
    let coordinator = OperationCoordinator::new(EventPool::new(context, 16, 0).unwrap()).unwrap();
    let upload = coordinator
        .register_operation(
            OperationType::MemoryTransfer,
            EventPriority::High,
            None,
            &[],
            "upload",
        )
        .unwrap();
    let workers: Vec<OperationId> = (0..WORKERS)
        .map(|i| {
            coordinator
                .register_operation(
                    OperationType::Kernel,
                    EventPriority::Normal,
                    None,
                    &[upload],
                    format!("worker {i}"),
                )
                .unwrap()
        })
        .collect();
    let gather = coordinator
        .register_operation(
            OperationType::Reduction,
            EventPriority::Normal,
            None,
            &workers,
            "gather",
        )
        .unwrap();
    assert_eq!(coordinator.ready_operations(), vec![upload]);
    let upload_stream = common::stream(context);
    let gather_stream = common::stream(context);
    let worker_streams: Vec<Arc<Stream>> = (0..WORKERS).map(|_| common::stream(context)).collect();
    let start = std::sync::Barrier::new(WORKERS + 1);

    let (queued_at, ready_at, gather_waits) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..WORKERS)
            .map(|i| {
                let (coordinator, start, kernels, copies, flags) =
                    (&coordinator, &start, &kernels, &copies, &flags);
                let (id, stream) = (workers[i], &worker_streams[i]);
                scope.spawn(move || {
                    start.wait();
                    coordinator
                        .wait_until_ready(id, Duration::from_secs(10))
                        .unwrap();
                    let ready = Instant::now();
                    coordinator.begin_operation(id, stream).unwrap();
                    copy_flag(
                        copies,
                        stream,
                        flags.device(0),
                        flags.device(1 + WORKERS + i),
                    );
                    store_after(kernels, stream, (i as u64 + 1) * MS, flags.device(1 + i), 1);
                    coordinator.complete_operation(id).unwrap();
                    ready
                })
            })
            .collect();
        start.wait();
        coordinator.begin_operation(upload, &upload_stream).unwrap();
        store_after(&kernels, &upload_stream, 100 * MS, flags.device(0), 5);
        let queued_at = Instant::now();
        coordinator.complete_operation(upload).unwrap();

        coordinator
            .wait_until_ready(gather, Duration::from_secs(10))
            .unwrap();
        coordinator.begin_operation(gather, &gather_stream).unwrap();
        let gather_waits = coordinator.metadata(gather).unwrap().cross_stream_waits;
        // SAFETY: words 1..=8 and 17 of the live mapped flags.
        unsafe {
            counters
                .count_flags_u32(
                    &gather_stream,
                    flags.device(1),
                    WORKERS,
                    1,
                    flags.device(2 * WORKERS + 1),
                )
                .unwrap();
        }
        coordinator.complete_operation(gather).unwrap();
        let ready_at: Vec<Instant> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        (queued_at, ready_at, gather_waits)
    });

    coordinator.synchronize(gather).unwrap();
    for stream in worker_streams
        .iter()
        .chain([&upload_stream, &gather_stream])
    {
        stream.synchronize().unwrap();
    }
    for (i, ready) in ready_at.iter().enumerate() {
        assert!(
            *ready >= queued_at,
            "worker {i} was told ready before the upload was queued"
        );
        assert_eq!(
            flags.read(1 + WORKERS + i),
            5,
            "worker {i} read the upload before the GPU wrote it"
        );
    }
    assert_eq!(
        flags.read(2 * WORKERS + 1),
        WORKERS as u32,
        "the gather ran before every worker had finished"
    );
    assert_eq!(
        gather_waits, WORKERS,
        "the gather's eight dependencies, all on other streams and still in flight, each need a device wait"
    );
    coordinator.retire_finished();
    let metrics = coordinator.metrics();
    assert_eq!(
        (metrics.registered, metrics.begun, metrics.completed),
        (10, 10, 10)
    );
    assert_eq!(metrics.cross_stream_waits, 2 * WORKERS as u64);
    assert_eq!(coordinator.live_operations(), 0);
}

/// A work-stealing scheduler: four worker threads, each with its own stream, loop over
/// `ready_operations()` and try to begin the first operation they can; the losers of a race
/// get a typed refusal and try the next. The DAG has six layers of eight operations, each
/// depending on every operation of the layer before, with priorities from `Critical` to
/// `Cleanup`. Each operation counts (with a kernel) the done flags of the layer before, spins
/// 50-250 µs, and sets its own done flag.
///
/// Expected: the first ready list is layer 0, most urgent first, ties in registration order;
/// every operation is begun exactly once; every refusal is `InvalidState` (or
/// `UnknownOperation` for one that already retired); every count is eight, whichever threads
/// and streams ran the layers; everything completes and retires.
#[test]
fn scheduler_threads_racing_on_ready_operations_begin_each_operation_exactly_once() {
    const LAYERS: usize = 6;
    const WIDTH: usize = 8;
    const WORKERS: usize = 4;
    const OPS: usize = LAYERS * WIDTH;
    const PRIORITIES: [EventPriority; 5] = [
        EventPriority::Critical,
        EventPriority::High,
        EventPriority::Normal,
        EventPriority::Low,
        EventPriority::Cleanup,
    ];
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let counters = EventKernels::load(context).unwrap();
    let done = Flags::new(context, OPS);
    let seen = Flags::new(context, OPS);
    let coordinator = OperationCoordinator::new(EventPool::new(context, 16, 0).unwrap()).unwrap();
    let mut ids: Vec<OperationId> = Vec::with_capacity(OPS);
    for layer in 0..LAYERS {
        let dependencies: Vec<OperationId> = if layer == 0 {
            Vec::new()
        } else {
            ids[(layer - 1) * WIDTH..layer * WIDTH].to_vec()
        };
        for w in 0..WIDTH {
            let id = coordinator
                .register_operation(
                    OperationType::Kernel,
                    PRIORITIES[w % PRIORITIES.len()],
                    None,
                    &dependencies,
                    format!("layer {layer} #{w}"),
                )
                .unwrap();
            ids.push(id);
        }
    }
    let index: HashMap<OperationId, usize> =
        ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let mut first_layer: Vec<(EventPriority, usize)> = (0..WIDTH)
        .map(|w| (PRIORITIES[w % PRIORITIES.len()], w))
        .collect();
    first_layer.sort();
    assert_eq!(
        coordinator.ready_operations(),
        first_layer.iter().map(|&(_, w)| ids[w]).collect::<Vec<_>>(),
        "the first ready list is layer 0, most urgent first"
    );

    let begins: Vec<AtomicU32> = (0..OPS).map(|_| AtomicU32::new(0)).collect();
    let finished = AtomicUsize::new(0);
    let lost_races = AtomicUsize::new(0);
    let streams: Vec<Arc<Stream>> = (0..WORKERS).map(|_| common::stream(context)).collect();
    std::thread::scope(|scope| {
        for stream in &streams {
            let (coordinator, kernels, counters, done, seen) =
                (&coordinator, &kernels, &counters, &done, &seen);
            let (index, begins, finished, lost_races) = (&index, &begins, &finished, &lost_races);
            scope.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(20);
                while finished.load(Ordering::SeqCst) < OPS {
                    assert!(
                        Instant::now() < deadline,
                        "the scheduler stalled with {} of {OPS} operations finished",
                        finished.load(Ordering::SeqCst)
                    );
                    let mut took = None;
                    for id in coordinator.ready_operations() {
                        match coordinator.begin_operation(id, stream) {
                            Ok(()) => {
                                took = Some(id);
                                break;
                            }
                            Err(EventError::InvalidState {
                                action: "begin", ..
                            }) => {
                                lost_races.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(EventError::UnknownOperation { .. })
                                if coordinator.state(id) == Ok(OperationState::Completed) =>
                            {
                                lost_races.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(error) => panic!("beginning ready {id}: {error}"),
                        }
                    }
                    let Some(id) = took else {
                        std::thread::yield_now();
                        continue;
                    };
                    let i = index[&id];
                    let layer = i / WIDTH;
                    begins[i].fetch_add(1, Ordering::SeqCst);
                    if layer > 0 {
                        // SAFETY: the previous layer's eight words and word `i` of the live
                        // mapped flags.
                        unsafe {
                            counters
                                .count_flags_u32(
                                    stream,
                                    done.device((layer - 1) * WIDTH),
                                    WIDTH,
                                    1,
                                    seen.device(i),
                                )
                                .unwrap();
                        }
                    }
                    let spin = (50 + (i as u64 * 37) % 200) * US;
                    store_after(kernels, stream, spin, done.device(i), 1);
                    coordinator.complete_operation(id).unwrap();
                    finished.fetch_add(1, Ordering::SeqCst);
                }
                stream.synchronize().unwrap();
            });
        }
    });

    let twice: Vec<usize> = (0..OPS)
        .filter(|&i| begins[i].load(Ordering::SeqCst) != 1)
        .collect();
    assert!(
        twice.is_empty(),
        "operations not begun exactly once: {twice:?}"
    );
    for i in WIDTH..OPS {
        assert_eq!(
            seen.read(i),
            WIDTH as u32,
            "operation {i} (layer {}) ran before its whole previous layer had",
            i / WIDTH
        );
    }
    coordinator.retire_finished();
    let metrics = coordinator.metrics();
    assert_eq!(
        (metrics.registered, metrics.begun, metrics.completed),
        (OPS as u64, OPS as u64, OPS as u64)
    );
    assert_eq!(coordinator.live_operations(), 0);
    eprintln!(
        "third_look scheduler: {} lost begin races",
        lost_races.load(Ordering::Relaxed)
    );
}

/// `torch.cuda.Event(enable_timing=True)` around a step measures the step, not how long its
/// stream waited for another stream; the coordinator's GPU time per operation (timing on)
/// should read the same. Sequence: `upload` spins 60 ms on one stream; `across` (a kernel on
/// another stream) and `behind` (a reduction queued behind the upload on the same stream)
/// depend on it and spin 5 ms each. A completion callback on each asks the coordinator for its
/// operation's metadata (the coordinator harvests GPU times before it runs callbacks "so that
/// a callback already finds its operation's").
///
/// Expected: each callback sees its operation completed with a GPU time of 5-8 ms (not 60+),
/// `across` with one cross-stream wait and `behind` with none; the metrics hold 60-63 ms of
/// transfers, 5-8 ms of kernels and 5-8 ms of reductions, one timed operation of each.
#[test]
fn an_operations_gpu_time_is_its_own_work_not_its_wait_and_its_callback_already_sees_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let coordinator = OperationCoordinator::new(EventPool::new(context, 8, 8).unwrap()).unwrap();
    coordinator.set_timing(true);
    let (slow, other) = (common::stream(context), common::stream(context));
    let upload = coordinator
        .register_operation(
            OperationType::MemoryTransfer,
            EventPriority::High,
            None,
            &[],
            "60 ms upload",
        )
        .unwrap();
    let across = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            None,
            &[upload],
            "5 ms kernel on another stream",
        )
        .unwrap();
    let behind = coordinator
        .register_operation(
            OperationType::Reduction,
            EventPriority::Normal,
            None,
            &[upload],
            "5 ms reduction behind it",
        )
        .unwrap();
    coordinator.begin_operation(upload, &slow).unwrap();
    kernels.spin_ns(&slow, 60 * MS).unwrap();
    coordinator.complete_operation(upload).unwrap();
    coordinator.begin_operation(across, &other).unwrap();
    kernels.spin_ns(&other, 5 * MS).unwrap();
    coordinator.complete_operation(across).unwrap();
    coordinator.begin_operation(behind, &slow).unwrap();
    kernels.spin_ns(&slow, 5 * MS).unwrap();
    coordinator.complete_operation(behind).unwrap();

    let (tx, rx) = std::sync::mpsc::channel();
    for id in [across, behind] {
        let (own, tx) = (coordinator.clone(), tx.clone());
        coordinator
            .on_complete(id, move |id, result| {
                let _ = tx.send((id, result, own.metadata(id)));
            })
            .unwrap();
    }
    let own_time = (5 * MS)..(8 * MS);
    for _ in 0..2 {
        let (id, result, metadata) = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("a completion callback never ran");
        assert_eq!(result, Ok(()));
        let metadata = metadata.expect("an operation's metadata inside its own callback");
        assert_eq!(metadata.state, OperationState::Completed);
        let gpu_time = metadata.gpu_time.unwrap_or_else(|| {
            panic!(
                "{id} ({}): no GPU time yet in its completion callback",
                metadata.description
            )
        });
        let ns = u64::try_from(gpu_time.as_nanos()).unwrap();
        assert!(
            own_time.contains(&ns),
            "{id} ({}): GPU time {gpu_time:?} for a 5 ms spin",
            metadata.description
        );
        let expected_waits = usize::from(id == across);
        assert_eq!(metadata.cross_stream_waits, expected_waits, "{id}");
    }
    slow.synchronize().unwrap();
    other.synchronize().unwrap();
    coordinator.retire_finished();
    let metrics = coordinator.metrics();
    let time = |kind: OperationType| {
        u64::try_from(
            metrics
                .gpu_time_by_type
                .get(&kind)
                .copied()
                .unwrap_or_default()
                .as_nanos(),
        )
        .unwrap()
    };
    assert!(
        ((60 * MS)..(63 * MS)).contains(&time(OperationType::MemoryTransfer)),
        "the 60 ms upload was timed at {} ns",
        time(OperationType::MemoryTransfer)
    );
    assert!(
        own_time.contains(&time(OperationType::Kernel)),
        "the kernel that waited 55 ms for the upload was timed at {} ns",
        time(OperationType::Kernel)
    );
    assert!(
        own_time.contains(&time(OperationType::Reduction)),
        "the reduction queued behind the upload was timed at {} ns",
        time(OperationType::Reduction)
    );
    for kind in [
        OperationType::MemoryTransfer,
        OperationType::Kernel,
        OperationType::Reduction,
    ] {
        assert_eq!(metrics.timed_by_type.get(&kind), Some(&1), "{kind:?}");
    }
    assert_eq!(coordinator.live_operations(), 0);
}

/// A data-parallel step's barrier where one rank is slow for a reason the GPU cannot see (a
/// host gate: input not there yet). Four streams; in round `r` stream `r` is held by a gate
/// and then stores `100 + r`, the others spin 1-4 ms; the barrier is queued (the held stream is
/// the hub in round 0 and a spoke in the others); then every stream copies the held stream's
/// word and sets its own "passed" flag, and another thread calls the barrier's `synchronize`.
///
/// Expected: the barrier queues `2 (n - 1)` waits; while the gate is closed no stream sets its
/// "passed" flag (watched for 30 ms) and `synchronize` has not returned; it returns only after
/// the gate was opened; every stream copied `100 + r`.
#[test]
fn a_barrier_holds_every_stream_and_its_host_synchronize_behind_a_gated_stream() {
    const STREAMS: usize = 4;
    const NAME: &str =
        "a_barrier_holds_every_stream_and_its_host_synchronize_behind_a_gated_stream";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(NAME, "needs the ungated streams to run while one is held") {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let copies = StreamKernels::load(context).unwrap();
    let streams: Vec<Arc<Stream>> = (0..STREAMS).map(|_| common::stream(context)).collect();
    let barrier = Arc::new(
        CrossStreamBarrier::new(streams.clone(), EventPool::new(context, 8, 0).unwrap()).unwrap(),
    );
    for round in 0..STREAMS {
        let value = 100 + round as u32;
        // 0: the gate; 1: the held stream's word; 2..6: what each stream copied; 6..10: each
        // stream's "passed" flag.
        let flags = Flags::new(context, 2 + 2 * STREAMS);
        for (i, stream) in streams.iter().enumerate() {
            if i == round {
                gate(&kernels, stream, flags.device(0));
                store_after(&kernels, stream, 2 * MS, flags.device(1), value);
            } else {
                kernels.spin_ns(stream, (i as u64 + 1) * MS).unwrap();
            }
        }
        let info = barrier.queue().unwrap();
        assert_eq!(
            info,
            BarrierInfo {
                streams: STREAMS,
                events: STREAMS,
                waits: 2 * (STREAMS - 1),
            }
        );
        for (i, stream) in streams.iter().enumerate() {
            copy_flag(&copies, stream, flags.device(1), flags.device(2 + i));
            store_after(&kernels, stream, 0, flags.device(2 + STREAMS + i), 1);
        }
        let host = {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let waited = barrier.synchronize();
                (waited, Instant::now())
            })
        };
        let passed_early = poll_until(Duration::from_millis(30), || {
            (0..STREAMS).any(|i| flags.read(2 + STREAMS + i) != 0)
        });
        assert!(
            !passed_early,
            "round {round}: a stream got past the barrier while stream {round} was held"
        );
        assert!(
            !host.is_finished(),
            "round {round}: the barrier's synchronize returned while stream {round} was held"
        );
        let opened = Instant::now();
        flags.write(0, 1);
        let (waited, returned) = host.join().unwrap();
        waited.unwrap();
        assert!(
            returned >= opened,
            "round {round}: synchronize returned before the gate opened"
        );
        for i in 0..STREAMS {
            assert_eq!(
                flags.read(2 + i),
                value,
                "round {round}: stream {i} read the held stream's word before it was stored"
            );
            assert_eq!(flags.read(2 + STREAMS + i), 1, "round {round}: stream {i}");
        }
    }
}

/// An async server awaiting several streams at once, each held by its own gate (a request
/// whose input has not arrived), under a multi-threaded tokio runtime: waits by completion
/// word, by event query and on a recorded event, one task each. The gates open one at a time
/// in reverse order, each only once the previous wait has resolved.
///
/// Expected: the waits resolve in exactly the order their gates open, none before its gate
/// (so none early, and none held back by another stream's wait); each task finds its stream's
/// store done when its wait resolves; the waiter counts six completed and ends with nothing
/// pending. (Six streams, made one after another, so that they get hardware queues of their
/// own: streams that share one serialize, and a gate would hold its neighbour.)
#[test]
fn waits_on_gated_streams_resolve_in_the_order_their_gates_open_under_tokio() {
    const STREAMS: usize = 6;
    const NAME: &str = "waits_on_gated_streams_resolve_in_the_order_their_gates_open_under_tokio";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(NAME, "needs gated streams to run independently") {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let pool = EventPool::new(context, 8, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    // 0..6: the gates; 6..12: each stream's store.
    let flags = Arc::new(Flags::new(context, 2 * STREAMS));
    let streams: Vec<Arc<Stream>> = (0..STREAMS).map(|_| common::stream(context)).collect();
    let mut waits = Vec::with_capacity(STREAMS);
    for (i, stream) in streams.iter().enumerate() {
        gate(&kernels, stream, flags.device(i));
        store_after(&kernels, stream, 200 * US, flags.device(STREAMS + i), 1);
        let wait = match i % 3 {
            0 => waiter.stream_idle(stream).unwrap(),
            1 => waiter
                .stream_idle_with(stream, WaitOptions::new(WakeMechanism::EventQuery))
                .unwrap(),
            _ => {
                let event = pool.acquire_owned(false).unwrap();
                event.record(stream).unwrap();
                waiter.event_done(event)
            }
        };
        waits.push(wait);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let resolved: Resolved<usize> = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = waits
        .into_iter()
        .enumerate()
        .map(|(i, wait)| {
            let (resolved, flags) = (Arc::clone(&resolved), Arc::clone(&flags));
            runtime.spawn(async move {
                let result = wait.await;
                let stored = flags.read(STREAMS + i);
                resolved.lock().unwrap().push((i, result, stored));
            })
        })
        .collect();
    for i in (0..STREAMS).rev() {
        let before = resolved.lock().unwrap().len();
        assert_eq!(
            before,
            STREAMS - 1 - i,
            "waits resolved before their gates opened: {:?}",
            resolved.lock().unwrap()
        );
        flags.write(i, 1);
        assert!(
            poll_until(Duration::from_secs(5), || resolved.lock().unwrap().len()
                > before),
            "the wait on stream {i} did not resolve within 5 s of its gate opening"
        );
    }
    runtime.block_on(async {
        for task in tasks {
            task.await.unwrap();
        }
    });
    let resolved = resolved.lock().unwrap();
    let order: Vec<usize> = resolved.iter().map(|(i, _, _)| *i).collect();
    assert_eq!(order, (0..STREAMS).rev().collect::<Vec<_>>());
    for (i, result, stored) in resolved.iter() {
        assert_eq!(*result, Ok(()), "stream {i}");
        assert_eq!(
            *stored, 1,
            "the wait on stream {i} resolved before its store"
        );
    }
    settle(&waiter, "gated streams");
    let stats = waiter.stats();
    assert_eq!(
        (
            stats.registered,
            stats.completed,
            stats.failed,
            stats.timed_out,
            stats.cancelled
        ),
        (STREAMS as u64, STREAMS as u64, 0, 0, 0)
    );
}

/// One point in GPU work (an operation held by a gate, then a 1 ms spin and a store) awaited
/// every way this crate offers at once, the way different parts of one server would: a
/// callback bridged to a oneshot channel registered before the operation was even begun (its
/// `completion()` refuses until it is queued), `stream_idle` by completion word, event query and
/// host function, `event_done` on a recorded event, the coordinator's `completion()` (the
/// coordinator sharing the waiter), the global waiter's `stream_idle`, `wait_async`,
/// `wait_stream_async` and `on_complete` callbacks, and threads blocked in the coordinator's
/// `synchronize` and the event's `synchronize`. While it is held: a dependant's
/// `wait_until_ready` stalls with a typed error naming it while it is begun (and is ready once
/// it is queued), and three waits with a 20 ms timeout (an event future, a completion-word
/// future and a callback) time out with `TimedOut`.
///
/// Expected: nothing resolves while the gate is closed; once it opens, every wait resolves
/// `Ok` and, at the moment it does, finds the store done; the timed-out ones saw it not done;
/// the waiter's books balance with exactly three timed out and nothing pending.
#[test]
fn every_kind_of_wait_on_one_gated_point_stays_pending_then_resolves_after_the_work() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    // 0: the gate; 1: the work's store.
    let flags = Arc::new(Flags::new(context, 2));
    let stream = common::stream(context);
    let pool = EventPool::new(context, 8, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(pool.clone(), Arc::clone(&waiter));
    let step = register_kernel(&coordinator, &[], "gated step");
    let next = register_kernel(&coordinator, &[step], "next step");

    assert!(
        matches!(
            coordinator.completion(step),
            Err(EventError::InvalidState {
                action: "await",
                ..
            })
        ),
        "completion() of an operation not yet queued"
    );
    let (early_tx, early_rx) = futures::channel::oneshot::channel::<(WaitResult, u32)>();
    {
        let flags = Arc::clone(&flags);
        coordinator
            .on_complete(step, move |_, result| {
                let _ = early_tx.send((result, flags.read(1)));
            })
            .unwrap();
    }
    coordinator.begin_operation(step, &stream).unwrap();
    gate(&kernels, &stream, flags.device(0));
    store_after(&kernels, &stream, MS, flags.device(1), 1);
    match coordinator.wait_until_ready(next, Duration::from_millis(20)) {
        Err(EventError::Stalled {
            id,
            waited,
            blocked_on,
        }) => {
            assert_eq!((id, blocked_on), (next, vec![step]));
            assert!(
                waited >= Duration::from_millis(20),
                "stalled after {waited:?}"
            );
        }
        other => panic!("wait_until_ready on a begun, unqueued dependency: {other:?}"),
    }
    coordinator.complete_operation(step).unwrap();
    coordinator
        .wait_until_ready(next, Duration::ZERO)
        .expect("queued is ready, however long the GPU takes");
    let event = Arc::new(pool.acquire_owned(false).unwrap());
    event.record(&stream).unwrap();

    let ran: Resolved<&'static str> = Arc::new(Mutex::new(Vec::new()));
    let record = |name: &'static str| {
        let (ran, flags) = (Arc::clone(&ran), Arc::clone(&flags));
        move |result: WaitResult| ran.lock().unwrap().push((name, result, flags.read(1)))
    };
    waiter.wait_async(Arc::clone(&event), record("wait_async"));
    waiter
        .wait_stream_async(&stream, record("wait_stream_async"))
        .unwrap();
    {
        let on_complete = record("on_complete");
        coordinator
            .on_complete(step, move |_, result| on_complete(result))
            .unwrap();
    }
    let mut futures: Vec<(&'static str, WaitFuture)> = vec![
        ("stream_idle", waiter.stream_idle(&stream).unwrap()),
        (
            "stream_idle by event query",
            waiter
                .stream_idle_with(&stream, WaitOptions::new(WakeMechanism::EventQuery))
                .unwrap(),
        ),
        (
            "stream_idle by host function",
            waiter
                .stream_idle_with(&stream, WaitOptions::new(WakeMechanism::HostFunction))
                .unwrap(),
        ),
        ("event_done", waiter.event_done(Arc::clone(&event))),
        ("completion", coordinator.completion(step).unwrap()),
        (
            "the global waiter's stream_idle",
            AsyncEventWaiter::global()
                .unwrap()
                .stream_idle(&stream)
                .unwrap(),
        ),
    ];
    let synchronizing = {
        let (coordinator, flags) = (coordinator.clone(), Arc::clone(&flags));
        std::thread::spawn(move || {
            coordinator.synchronize(step).unwrap();
            flags.read(1)
        })
    };
    let event_synchronizing = {
        let (event, flags) = (Arc::clone(&event), Arc::clone(&flags));
        std::thread::spawn(move || {
            event.synchronize().unwrap();
            flags.read(1)
        })
    };

    let timeout = Duration::from_millis(20);
    waiter.wait_async_timeout(Arc::clone(&event), timeout, record("wait_async_timeout"));
    assert_eq!(
        futures::executor::block_on(waiter.event_done_with(Arc::clone(&event), Some(timeout))),
        Err(EventError::TimedOut { timeout })
    );
    assert_eq!(
        futures::executor::block_on(
            waiter
                .stream_idle_with(
                    &stream,
                    WaitOptions::new(WakeMechanism::CompletionWord).with_timeout(timeout),
                )
                .unwrap()
        ),
        Err(EventError::TimedOut { timeout })
    );
    assert!(
        poll_until(Duration::from_secs(2), || !ran.lock().unwrap().is_empty()),
        "the timed callback was not told of its timeout"
    );

    for (name, future) in &mut futures {
        assert!(
            poll_once(future).is_pending(),
            "{name} resolved while the gate held the work"
        );
    }
    assert_eq!(
        *ran.lock().unwrap(),
        vec![(
            "wait_async_timeout",
            Err(EventError::TimedOut { timeout }),
            0
        )],
        "only the timed callback may have run while the gate held the work"
    );
    assert!(
        !synchronizing.is_finished(),
        "synchronize returned while held"
    );
    assert!(
        !event_synchronizing.is_finished(),
        "Event::synchronize returned while held"
    );
    let mut early_rx = early_rx;
    assert_eq!(
        early_rx.try_recv(),
        Ok(None),
        "the bridged callback ran while held"
    );

    flags.write(0, 1);
    let resolved = futures::executor::block_on(futures::future::join_all(futures.into_iter().map(
        |(name, future)| {
            let flags = Arc::clone(&flags);
            async move {
                let result = future.await;
                (name, result, flags.read(1))
            }
        },
    )));
    for (name, result, stored) in resolved {
        assert_eq!(result, Ok(()), "{name}");
        assert_eq!(stored, 1, "{name} resolved before the work's store");
    }
    assert_eq!(synchronizing.join().unwrap(), 1, "coordinator synchronize");
    assert_eq!(event_synchronizing.join().unwrap(), 1, "Event::synchronize");
    let (result, stored) = futures::executor::block_on(early_rx).unwrap();
    assert_eq!((result, stored), (Ok(()), 1), "the bridged callback");
    assert!(
        poll_until(Duration::from_secs(5), || ran.lock().unwrap().len() == 4),
        "callbacks never ran: {:?}",
        ran.lock().unwrap()
    );
    for (name, result, stored) in ran.lock().unwrap().iter().skip(1) {
        assert_eq!((result, *stored), (&Ok(()), 1), "{name}");
    }
    settle(&waiter, "one gated point");
    let stats = waiter.stats();
    assert_eq!((stats.timed_out, stats.failed, stats.pending), (3, 0, 0));
    assert_eq!(
        stats.registered,
        stats.completed + stats.timed_out + stats.cancelled + stats.failed,
        "{stats:?}"
    );
}

/// A server that loads its weights once (an operation spinning 20 ms, then storing 77) and
/// then takes 20 000 requests, each an operation depending on the weights with a completion
/// callback; every other client goes away before its request begins, and the server withdraws
/// it (`cancel_operation`); the others copy the weights' word into their own output slot.
/// Both request streams are synchronised every 1000 requests.
///
/// Expected: each withdrawn request's callback runs at once, on the withdrawing thread, with
/// `Cancelled` naming it, and its id then reads unknown; each served request's callback runs
/// once with `Ok`; every served slot holds 77 and every withdrawn one 0; the metrics count
/// exactly what happened; the weights' operation retires once nothing registered depends on
/// it; live operations, pooled events and resident memory stay bounded by what is in flight.
#[test]
fn twenty_thousand_requests_half_withdrawn_before_they_begin_stay_exact_and_bounded() {
    const REQUESTS: usize = 20_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let copies = StreamKernels::load(context).unwrap();
    let weights_word = Flags::new(context, 1);
    let outputs = filled(context, REQUESTS, 0);
    let (weights_stream, streams) = (
        common::stream(context),
        [common::stream(context), common::stream(context)],
    );
    let events = EventPool::new(context, 0, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(events.clone(), Arc::clone(&waiter));
    let weights = coordinator
        .register_operation(
            OperationType::MemoryTransfer,
            EventPriority::High,
            None,
            &[],
            "load weights",
        )
        .unwrap();
    coordinator
        .begin_operation(weights, &weights_stream)
        .unwrap();
    store_after(
        &kernels,
        &weights_stream,
        20 * MS,
        weights_word.device(0),
        77,
    );
    coordinator.complete_operation(weights).unwrap();

    let withdrawing_thread = std::thread::current().id();
    let served = Arc::new(AtomicUsize::new(0));
    let withdrawn = Arc::new(AtomicUsize::new(0));
    let wrong = Arc::new(AtomicUsize::new(0));
    let (mut live_peak, mut resident_warm) = (0, 0);
    for i in 0..REQUESTS {
        let request = coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                None,
                &[weights],
                "",
            )
            .unwrap();
        let withdraw = i % 2 == 1;
        {
            let (served, withdrawn, wrong) = (
                Arc::clone(&served),
                Arc::clone(&withdrawn),
                Arc::clone(&wrong),
            );
            coordinator
                .on_complete(request, move |id, result| match result {
                    Ok(()) if !withdraw && id == request => {
                        served.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(EventError::Cancelled { id: cancelled })
                        if withdraw
                            && id == request
                            && cancelled == request
                            && std::thread::current().id() == withdrawing_thread =>
                    {
                        withdrawn.fetch_add(1, Ordering::SeqCst);
                    }
                    _ => {
                        wrong.fetch_add(1, Ordering::SeqCst);
                    }
                })
                .unwrap();
        }
        if withdraw {
            coordinator.cancel_operation(request).unwrap();
            assert_eq!(
                withdrawn.load(Ordering::SeqCst),
                i.div_ceil(2),
                "request {i}: its callback did not run within cancel_operation"
            );
            if i % 1000 == 1 {
                assert!(
                    matches!(
                        coordinator.state(request),
                        Err(EventError::UnknownOperation { .. })
                    ),
                    "a withdrawn request must not read as anything the GPU did"
                );
            }
        } else {
            let stream = &streams[(i / 2) % 2];
            coordinator.begin_operation(request, stream).unwrap();
            copy_flag(
                &copies,
                stream,
                weights_word.device(0),
                outputs.ptr() + 4 * i as u64,
            );
            coordinator.complete_operation(request).unwrap();
        }
        if i % 1000 == 999 {
            for stream in &streams {
                stream.synchronize().unwrap();
            }
            coordinator.retire_finished();
            live_peak = live_peak.max(coordinator.live_operations());
        }
        if i == REQUESTS / 10 {
            resident_warm = resident_bytes();
        }
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert!(
        poll_until(Duration::from_secs(10), || {
            coordinator.retire_finished();
            served.load(Ordering::SeqCst) >= REQUESTS / 2
        }),
        "only {} of {} served requests' callbacks ran",
        served.load(Ordering::SeqCst),
        REQUESTS / 2
    );
    settle(&waiter, "withdrawn requests");
    coordinator.retire_finished();
    let resident_end = resident_bytes();

    assert_eq!(served.load(Ordering::SeqCst), REQUESTS / 2);
    assert_eq!(withdrawn.load(Ordering::SeqCst), REQUESTS / 2);
    assert_eq!(
        wrong.load(Ordering::SeqCst),
        0,
        "callbacks with the wrong outcome"
    );
    let outputs = read_u32s(context, outputs.ptr(), REQUESTS);
    for (i, output) in outputs.iter().enumerate() {
        let expected = if i % 2 == 1 { 0 } else { 77 };
        assert_eq!(*output, expected, "request {i}");
    }
    let metrics = coordinator.metrics();
    let half = REQUESTS as u64 / 2;
    assert_eq!(
        (
            metrics.registered,
            metrics.cancelled,
            metrics.begun,
            metrics.completed,
            metrics.failed,
            metrics.callback_panics
        ),
        (REQUESTS as u64 + 1, half, half + 1, half + 1, 0, 0)
    );
    assert_eq!(
        coordinator.live_operations(),
        0,
        "the weights (nothing depends on them any more) or a request stayed live"
    );
    assert!(
        live_peak <= 16,
        "{live_peak} operations live after a synchronisation"
    );
    assert_eq!(events.utilization().in_use, 0);
    let counters = events.counters();
    let created = counters.created_regular + counters.created_timing + counters.created_blocking;
    assert!(
        created <= 600,
        "{created} events made for {half} served requests, 500 between synchronisations"
    );
    assert!(
        resident_end <= resident_warm + (16 << 20),
        "resident memory grew from {resident_warm} to {resident_end} bytes"
    );
}

/// A scheduler closes a cycle by mistake (`add_dependency(a, b)` and `add_dependency(b, a)`,
/// both after an upload that has run). `begin_operation` names the cycle; the program, told
/// that neither can ever begin, withdraws both with `cancel_operation`, as it withdraws any
/// operation it gives up on. Beside it, the documented protection: an operation with a
/// registered dependant outside any cycle is not withdrawn until that dependant is.
///
/// Expected: the cycle is withdrawn (it stands for no order anyone could ever get, so
/// withdrawing it loses none), `detect_deadlocks` finds nothing, and the upload it held
/// retires and gives its event back: nothing stays live.
///
/// Found by reading the code: `cancel_operation` refuses any operation with a registered
/// dependant, and in a cycle every member is one, so before `cancel_operations` the cycle, and
/// every record and pooled event of what it depends on, stayed live for the coordinator's life.
#[test]
fn a_cycle_closed_by_mistake_can_be_withdrawn_and_gives_back_what_it_held() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let events = EventPool::new(context, 0, 0).unwrap();
    let coordinator = OperationCoordinator::new(events.clone()).unwrap();
    let stream = common::stream(context);
    let upload = register_kernel(&coordinator, &[], "upload");
    coordinator.begin_operation(upload, &stream).unwrap();
    kernels.spin_ns(&stream, MS).unwrap();
    coordinator.complete_operation(upload).unwrap();
    let a = register_kernel(&coordinator, &[upload], "a");
    let b = register_kernel(&coordinator, &[upload], "b");
    coordinator.add_dependency(a, b).unwrap();
    coordinator.add_dependency(b, a).unwrap();
    assert_eq!(coordinator.detect_deadlocks(), vec![vec![a, b]]);
    assert_eq!(
        coordinator.begin_operation(a, &stream),
        Err(EventError::DependencyCycle {
            id: a,
            cycle: vec![a, b]
        })
    );

    let x = register_kernel(&coordinator, &[], "x");
    let y = register_kernel(&coordinator, &[x], "y, after x");
    assert!(
        matches!(
            coordinator.cancel_operation(x),
            Err(EventError::InvalidState { .. })
        ),
        "x has a registered dependant outside any cycle: withdrawing it would lose y's order"
    );
    coordinator.cancel_operation(y).unwrap();
    coordinator.cancel_operation(x).unwrap();

    // Alone, neither member goes (the other depends on it); together, both do.
    assert!(matches!(
        coordinator.cancel_operation(a),
        Err(EventError::InvalidState { .. })
    ));
    assert_eq!(coordinator.cancel_operations(&[a, b]), Ok(()));
    assert!(coordinator.detect_deadlocks().is_empty());
    coordinator.synchronize(upload).unwrap();
    assert!(
        poll_until(Duration::from_secs(2), || coordinator.live_operations()
            == 0),
        "{} operations stay live",
        coordinator.live_operations()
    );
    assert_eq!(events.utilization().in_use, 0, "the upload's event is held");
    assert_eq!(coordinator.metrics().cancelled, 4);
}

/// Continuation scheduling through a channel (a tokio `mpsc`, a crossbeam channel to a
/// dispatcher thread): each operation's completion callback only sends its node number; the
/// dispatcher (the main thread) then registers the node's two children, depending on it, and
/// launches each on one of four streams: a 200 µs spin, then an order-sensitive transform of
/// the parent's slot into its own (`x * (3 + k % 5) + k`) that counts any input still holding
/// the sentinel. The root fills its slot with 1. 255 nodes, eight levels.
///
/// Expected: no transform ever read an unwritten input (the callback said "done" only once the
/// GPU was, so a child began only after its parent's work had run), every slot holds exactly
/// what the host computes, every callback ran once with `Ok`, and no device wait was queued
/// (each dependency had been seen complete before its dependant began); everything retires.
#[test]
fn a_dispatcher_fed_by_completion_callbacks_through_a_channel_grows_an_exact_tree() {
    const NODES: usize = 255;
    const N: usize = 4096;
    const STREAMS: usize = 4;
    const SENTINEL: u32 = 0xDEAD_BEEF;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let transforms = EventKernels::load(context).unwrap();
    let streams: Vec<Arc<Stream>> = (0..STREAMS).map(|_| common::stream(context)).collect();
    let slots = filled(context, NODES * N, SENTINEL);
    let unfinished = filled(context, 1, 0);
    let coordinator = OperationCoordinator::new(EventPool::new(context, 8, 0).unwrap()).unwrap();
    let (tx, rx) = crossbeam::channel::unbounded::<(usize, WaitResult)>();
    let runs: Arc<Vec<AtomicU32>> = Arc::new((0..NODES).map(|_| AtomicU32::new(0)).collect());
    let slot = |k: usize| slots.ptr() + (k * N * 4) as u64;
    let step = |k: usize| (3 + (k % 5) as u32, k as u32);
    let mut ids: Vec<Option<OperationId>> = vec![None; NODES];
    let mut launch = |k: usize| {
        let parent = k.checked_sub(1).map(|p| p / 2);
        let dependencies: Vec<OperationId> = parent.map(|p| ids[p].unwrap()).into_iter().collect();
        let id = coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                None,
                &dependencies,
                format!("node {k}"),
            )
            .unwrap();
        let stream = &streams[k % STREAMS];
        coordinator.begin_operation(id, stream).unwrap();
        kernels.spin_ns(stream, 200 * US).unwrap();
        match parent {
            // SAFETY: slot 0 holds N u32s of the live allocation.
            None => unsafe { kernels.fill_u32(stream, slot(0), 1, N).unwrap() },
            Some(parent) => {
                let (mul, add) = step(k);
                // SAFETY: both slots hold N u32s of the live allocation and do not overlap;
                // `unfinished` is one u32 of a live allocation.
                unsafe {
                    transforms
                        .transform_checked_u32(
                            stream,
                            slot(parent),
                            slot(k),
                            N,
                            mul,
                            add,
                            SENTINEL,
                            unfinished.ptr(),
                        )
                        .unwrap();
                }
            }
        }
        coordinator.complete_operation(id).unwrap();
        let (tx, runs) = (tx.clone(), Arc::clone(&runs));
        coordinator
            .on_complete(id, move |_, result| {
                runs[k].fetch_add(1, Ordering::SeqCst);
                let _ = tx.send((k, result));
            })
            .unwrap();
        ids[k] = Some(id);
    };
    launch(0);
    for _ in 0..NODES {
        let (k, result) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a completion callback never came");
        assert_eq!(result, Ok(()), "node {k}");
        for child in [2 * k + 1, 2 * k + 2] {
            if child < NODES {
                launch(child);
            }
        }
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_eq!(
        read_u32s(context, unfinished.ptr(), 1)[0],
        0,
        "a child read its parent's slot before the parent's transform wrote it"
    );
    let mut expected = vec![1u32; NODES];
    for k in 1..NODES {
        let (mul, add) = step(k);
        expected[k] = affine(expected[(k - 1) / 2], mul, add);
    }
    assert!(
        !expected.contains(&SENTINEL),
        "a node's value is the sentinel: the test cannot tell it from an unwritten slot"
    );
    let values = read_u32s(context, slots.ptr(), NODES * N);
    for (k, slot) in values.chunks_exact(N).enumerate() {
        assert!(
            slot.iter().all(|&value| value == expected[k]),
            "node {k}: expected {} everywhere, found e.g. {:?}",
            expected[k],
            slot.iter().find(|&&value| value != expected[k])
        );
    }
    let miscounted: Vec<usize> = (0..NODES)
        .filter(|&k| runs[k].load(Ordering::SeqCst) != 1)
        .collect();
    assert!(
        miscounted.is_empty(),
        "callbacks not run exactly once: {miscounted:?}"
    );
    assert!(
        poll_until(Duration::from_secs(2), || coordinator.live_operations()
            == 0),
        "{} operations stay live",
        coordinator.live_operations()
    );
    let metrics = coordinator.metrics();
    assert_eq!(
        (metrics.registered, metrics.begun, metrics.completed),
        (NODES as u64, NODES as u64, NODES as u64)
    );
    assert_eq!(
        metrics.cross_stream_waits, 0,
        "a device wait was queued for a dependency already seen complete"
    );
}
