//! Programs shaped like async inference servers and pipeline schedulers, written against the
//! public API of this crate: waits "as long as it takes", GPU time per operation beside a slow
//! stream, hundreds of tokio tasks awaiting one operation (half giving up), racing streams for
//! the first free one with a timeout, a double-buffered upload/compute pipeline with
//! write-after-read dependencies, request chains from server threads on pool streams, 10^5
//! operations with completion callbacks, workers blocked in `wait_until_ready`, the waiter's
//! books under cancellation races, timeouts racing completion, long cycles, and ids of another
//! coordinator.
//!
//! Every outcome is the GPU's: kernels that spin before they store, order-sensitive transforms
//! whose exact result the host recomputes, flags in mapped memory.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Flags, MS, filled, read_u32s, within};
use cuweave_driver::memory;
use cuweave_driver::{Context, Stream};
use cuweave_event::{
    AsyncEventWaiter, EventError, EventPool, EventPriority, OperationCoordinator, OperationId,
    OperationState, OperationType, WaitOptions, WakeMechanism,
};
use cuweave_stream::{StreamPool, StreamPoolConfig};
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip_under_sanitizer};

const US: u64 = 1_000;

/// Reads `count` `u64`s of device memory (the streams writing it are idle).
fn read_u64s(context: &Arc<Context>, ptr: u64, count: usize) -> Vec<u64> {
    let mut bytes = vec![0u8; count * 8];
    // SAFETY: `count * 8` bytes of a live allocation; the caller's streams are idle.
    unsafe { memory::copy_dtoh(context, bytes.as_mut_ptr(), ptr, count * 8).unwrap() };
    bytes
        .chunks_exact(8)
        .map(|chunk| u64::from_le_bytes(chunk.try_into().unwrap()))
        .collect()
}

/// What `transform_checked_u32` computes for one element.
fn affine(x: u32, mul: u32, add: u32) -> u32 {
    x.wrapping_mul(mul).wrapping_add(add)
}

/// Waits, at most `limit`, until `waiter` watches nothing.
fn settle(waiter: &AsyncEventWaiter, limit: Duration) {
    let deadline = Instant::now() + limit;
    while waiter.pending() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn register(
    coordinator: &OperationCoordinator,
    kind: OperationType,
    priority: EventPriority,
    dependencies: &[OperationId],
) -> OperationId {
    coordinator
        .register_operation(kind, priority, None, dependencies, "")
        .unwrap()
}

fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap()
}

/// A server waits "as long as it takes" the way the stream layer documents it
/// (`Duration::MAX`, which `wait_for_any_ready` accepts): a stream wait and an event wait with
/// that timeout, a callback with it, and `wait_until_ready` on an operation whose dependency
/// another thread completes. Each must resolve normally; none may panic on the deadline.
#[test]
fn waits_as_long_as_it_takes_accept_duration_max_without_panicking() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 2, 0).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let stream = common::stream(&gpu.context);
    let mut panicked: Vec<&str> = Vec::new();
    let mut attempt = |name: &'static str, f: &mut dyn FnMut()| {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
            panicked.push(name);
        }
    };

    attempt(
        "AsyncEventWaiter::stream_idle_with(.. Duration::MAX)",
        &mut || {
            kernels.spin_ns(&stream, 5 * MS).unwrap();
            let options =
                WaitOptions::new(WakeMechanism::CompletionWord).with_timeout(Duration::MAX);
            let future = waiter.stream_idle_with(&stream, options).unwrap();
            assert_eq!(futures::executor::block_on(future), Ok(()));
        },
    );
    attempt(
        "AsyncEventWaiter::event_done_with(.., Some(Duration::MAX))",
        &mut || {
            kernels.spin_ns(&stream, 5 * MS).unwrap();
            let event = pool.acquire_owned(false).unwrap();
            event.record(&stream).unwrap();
            let future = waiter.event_done_with(event, Some(Duration::MAX));
            assert_eq!(futures::executor::block_on(future), Ok(()));
        },
    );
    attempt(
        "AsyncEventWaiter::wait_async_timeout(.., Duration::MAX, ..)",
        &mut || {
            kernels.spin_ns(&stream, 5 * MS).unwrap();
            let event = pool.acquire_owned(false).unwrap();
            event.record(&stream).unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            waiter.wait_async_timeout(event, Duration::MAX, move |result| {
                tx.send(result).unwrap();
            });
            assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), Ok(()));
        },
    );
    attempt(
        "OperationCoordinator::wait_until_ready(.., Duration::MAX)",
        &mut || {
            let coordinator =
                OperationCoordinator::new(EventPool::new(&gpu.context, 1, 0).unwrap()).unwrap();
            let a = register(
                &coordinator,
                OperationType::Kernel,
                EventPriority::Normal,
                &[],
            );
            let b = register(
                &coordinator,
                OperationType::Kernel,
                EventPriority::Normal,
                &[a],
            );
            let producer = coordinator.clone();
            let producer_stream = Arc::clone(&stream);
            let thread = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                producer.begin_operation(a, &producer_stream).unwrap();
                producer.complete_operation(a).unwrap();
            });
            let result = coordinator.wait_until_ready(b, Duration::MAX);
            thread.join().unwrap();
            assert_eq!(result, Ok(()));
        },
    );
    stream.synchronize().unwrap();
    assert!(
        panicked.is_empty(),
        "these waits panicked on a Duration::MAX timeout: {panicked:?}"
    );
}

/// A scheduler with GPU timing on, one operation on a slow stream (a 1.5 s batch job) and
/// 5000 short operations on a fast one, synchronised as they go. Every operation was begun
/// with timing on and the GPU finished every fast one long before the batch job: once all
/// have completed, each must have its GPU time (the timer's rule is to skip only when none of
/// the pending spans has finished).
#[test]
fn gpu_time_of_a_fast_stream_is_not_lost_behind_a_slow_stream() {
    const FAST: u64 = 5000;
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "gpu_time_of_a_fast_stream_is_not_lost_behind_a_slow_stream",
        "the fast stream must run beside the slow one",
    ) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let (slow_stream, fast_stream) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 0, 0).unwrap()).unwrap();
    coordinator.set_timing(true);
    let slow = register(
        &coordinator,
        OperationType::Reduction,
        EventPriority::Low,
        &[],
    );
    coordinator.begin_operation(slow, &slow_stream).unwrap();
    kernels.spin_ns(&slow_stream, 1_500 * MS).unwrap();
    coordinator.complete_operation(slow).unwrap();
    for i in 0..FAST {
        let id = register(
            &coordinator,
            OperationType::Kernel,
            EventPriority::High,
            &[],
        );
        coordinator.begin_operation(id, &fast_stream).unwrap();
        kernels.spin_ns(&fast_stream, US).unwrap();
        coordinator.complete_operation(id).unwrap();
        if i % 500 == 499 {
            coordinator.synchronize(id).unwrap();
        }
    }
    fast_stream.synchronize().unwrap();
    let slow_still_running = !slow_stream.query().unwrap();
    coordinator.synchronize(slow).unwrap();
    coordinator.retire_finished();
    let metrics = coordinator.metrics();
    assert!(
        slow_still_running,
        "premise: the batch job still runs when the fast operations are done"
    );
    assert_eq!(metrics.completed, FAST + 1);
    let timed_kernels = metrics
        .timed_by_type
        .get(&OperationType::Kernel)
        .copied()
        .unwrap_or(0);
    assert_eq!(
        timed_kernels, FAST,
        "only {timed_kernels} of {FAST} fast operations got a GPU time: the slow stream's \
         pending span held back the harvest, the timer filled up and later operations went \
         untimed"
    );
    assert_eq!(
        metrics.timed_by_type.get(&OperationType::Reduction),
        Some(&1)
    );
}

/// 500 request tasks on a tokio runtime await the completion of one operation (a 150 ms
/// kernel that then stores a flag); every other task gives up after 10-14 ms (`timeout` drops
/// its future). The patient ones all see the flag, the impatient ones all time out, the
/// waiter counts 250 completed and 250 cancelled, and a late `completion` of the finished
/// operation is ready at once.
#[test]
fn five_hundred_tasks_await_one_operation_and_half_give_up() {
    const TASKS: usize = 500;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = Arc::new(TestKernels::load(&gpu.context).unwrap());
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(
        EventPool::new(&gpu.context, 2, 0).unwrap(),
        Arc::clone(&waiter),
    );
    let stream = common::stream(&gpu.context);
    let flags = Arc::new(Flags::new(&gpu.context, 1));
    let op = register(
        &coordinator,
        OperationType::Kernel,
        EventPriority::High,
        &[],
    );
    coordinator.begin_operation(op, &stream).unwrap();
    // SAFETY: a mapped flag of this context, alive past the stream's last use.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, 150 * MS, flags.device(0), 7)
            .unwrap()
    };
    coordinator.complete_operation(op).unwrap();
    let before = waiter.stats();
    let rt = runtime(4);
    let outcomes: Vec<(bool, Option<u32>)> = rt.block_on(async {
        let tasks: Vec<_> = (0..TASKS)
            .map(|i| {
                let future = coordinator.completion(op).unwrap();
                let flags = Arc::clone(&flags);
                tokio::spawn(async move {
                    if i % 2 == 0 {
                        let limit = Duration::from_millis(10 + (i % 5) as u64);
                        match tokio::time::timeout(limit, future).await {
                            Err(_) => (false, None),
                            Ok(result) => panic!("task {i} resolved in {limit:?}: {result:?}"),
                        }
                    } else {
                        future.await.unwrap();
                        (true, Some(flags.read(0)))
                    }
                })
            })
            .collect();
        let mut outcomes = Vec::new();
        for task in tasks {
            outcomes.push(task.await.unwrap());
        }
        outcomes
    });
    for (i, (patient, seen)) in outcomes.iter().enumerate() {
        assert_eq!(*patient, i % 2 == 1);
        if *patient {
            assert_eq!(
                *seen,
                Some(7),
                "task {i} resolved before the kernel's store"
            );
        }
    }
    stream.synchronize().unwrap();
    settle(&waiter, Duration::from_secs(5));
    let after = waiter.stats();
    assert_eq!(after.pending, 0);
    assert_eq!(
        (
            after.completed - before.completed,
            after.cancelled - before.cancelled
        ),
        ((TASKS / 2) as u64, (TASKS / 2) as u64),
        "{after:?}"
    );
    // Late arrivals: the operation is done (and may have retired); ready at once.
    let late: Vec<_> = (0..16)
        .map(|_| coordinator.completion(op).unwrap())
        .collect();
    let results = within(Duration::from_secs(2), move || {
        futures::executor::block_on(futures::future::join_all(late))
    });
    assert!(results.iter().all(Result::is_ok));
}

/// "Give me the first free stream, or time out": one `stream_idle` future per stream raced
/// with `select_all` (the stream layer's docs point async users here). The stream whose work
/// ends first wins while the others still run; the losers are dropped. A second race, every
/// stream busy for 200 ms more, loses to a 20 ms timer. Dropped waits are counted cancelled,
/// nothing stays pending, and the same streams are awaitable again.
#[test]
fn racing_streams_for_the_first_free_one_with_a_timeout() {
    const STREAMS: usize = 4;
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "racing_streams_for_the_first_free_one_with_a_timeout",
        "the streams' spins must run at once",
    ) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let streams: Vec<_> = (0..STREAMS).map(|_| common::stream(&gpu.context)).collect();
    let flags = Arc::new(Flags::new(&gpu.context, STREAMS));
    for (k, ms) in [300u64, 60, 200, 400].into_iter().enumerate() {
        // SAFETY: mapped flags of this context, alive past the streams' last use.
        unsafe {
            kernels
                .spin_then_store_u32(&streams[k], ms * MS, flags.device(k), 1)
                .unwrap()
        };
    }
    let rt = runtime(2);
    let first: Vec<_> = streams
        .iter()
        .map(|stream| waiter.stream_idle(stream).unwrap())
        .collect();
    let (winner, seen) = rt.block_on(async {
        let (result, index, rest) = futures::future::select_all(first).await;
        result.unwrap();
        let seen: Vec<u32> = (0..STREAMS).map(|k| flags.read(k)).collect();
        drop(rest);
        (index, seen)
    });
    assert_eq!(winner, 1, "not the stream that finished first");
    assert_eq!(seen, vec![0, 1, 0, 0], "the race resolved early or late");

    for stream in &streams {
        kernels.spin_ns(stream, 200 * MS).unwrap();
    }
    let second: Vec<_> = streams
        .iter()
        .map(|stream| waiter.stream_idle(stream).unwrap())
        .collect();
    let timed_out = rt.block_on(async {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(20)) => true,
            (result, index, _) = futures::future::select_all(second) => {
                panic!("stream {index} finished 200 ms of work in 20 ms: {result:?}")
            }
        }
    });
    assert!(timed_out);
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    settle(&waiter, Duration::from_secs(5));
    let stats = waiter.stats();
    assert_eq!(stats.pending, 0);
    assert_eq!(
        (stats.completed, stats.cancelled),
        (1, 7),
        "1 winner, 3 losers and 4 timed-out waits: {stats:?}"
    );
    let again: Vec<_> = streams
        .iter()
        .map(|stream| waiter.stream_idle(stream).unwrap())
        .collect();
    let results = rt.block_on(futures::future::join_all(again));
    assert!(results.iter().all(Result::is_ok));
}

/// The double-buffered pipeline of every data loader: upload i fills slot i % 2 on a copy
/// stream, compute i sums that slot on a compute stream. Compute i depends on upload i
/// (read after write) and upload i depends on compute i - 2 (write after read: the slot is
/// reused). The whole epoch (6000 operations) is registered up front: a legal program with no
/// cycle, so nothing may be refused. Spins on either stream would let an unordered stage
/// overtake; every sum is exact.
#[test]
fn a_double_buffered_pipeline_with_write_after_read_dependencies_is_accepted_and_exact() {
    const ITERATIONS: usize = 3000;
    const N: usize = 1 << 14;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let (copy_stream, compute_stream) =
        (common::stream(&gpu.context), common::stream(&gpu.context));
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 4, 0).unwrap()).unwrap();
    let slots = [filled(&gpu.context, N, 0), filled(&gpu.context, N, 0)];
    let sums = filled(&gpu.context, ITERATIONS * 2, 0);
    let mut uploads: Vec<OperationId> = Vec::with_capacity(ITERATIONS);
    let mut computes: Vec<OperationId> = Vec::with_capacity(ITERATIONS);
    for i in 0..ITERATIONS {
        let reuse: Vec<OperationId> = (i >= 2).then(|| computes[i - 2]).into_iter().collect();
        let upload = coordinator
            .register_operation(
                OperationType::MemoryTransfer,
                EventPriority::High,
                Some(&copy_stream),
                &reuse,
                format!("upload {i}"),
            )
            .unwrap();
        let compute = coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                Some(&compute_stream),
                &[upload],
                format!("compute {i}"),
            )
            .unwrap();
        uploads.push(upload);
        computes.push(compute);
    }
    assert!(
        coordinator.detect_deadlocks().is_empty(),
        "a double-buffered pipeline has no cycle"
    );
    assert_eq!(coordinator.ready_operations(), vec![uploads[0], uploads[1]]);

    for i in 0..ITERATIONS {
        let slot = slots[i % 2].ptr();
        coordinator
            .begin_operation(uploads[i], &copy_stream)
            .unwrap();
        if i % 64 == 0 {
            kernels.spin_ns(&copy_stream, 500 * US).unwrap();
        }
        // SAFETY: the slot holds N u32s; the coordinator orders it after the compute that
        // last read it; alive past the final synchronisation.
        unsafe {
            kernels
                .fill_u32(&copy_stream, slot, i as u32 + 1, N)
                .unwrap()
        };
        coordinator.complete_operation(uploads[i]).unwrap();

        coordinator
            .begin_operation(computes[i], &compute_stream)
            .unwrap();
        if i % 64 == 32 {
            kernels.spin_ns(&compute_stream, 500 * US).unwrap();
        }
        let out = sums.ptr() + 8 * i as u64;
        // SAFETY: the slot holds N u32s, ordered after its upload; `out` is this iteration's
        // u64 of `sums`.
        unsafe { kernels.checksum_u32(&compute_stream, slot, N, out).unwrap() };
        coordinator.complete_operation(computes[i]).unwrap();
    }
    coordinator.synchronize(computes[ITERATIONS - 1]).unwrap();
    copy_stream.synchronize().unwrap();
    compute_stream.synchronize().unwrap();
    let sums = read_u64s(&gpu.context, sums.ptr(), ITERATIONS);
    for (i, sum) in sums.iter().enumerate() {
        assert_eq!(
            *sum,
            N as u64 * (i as u64 + 1),
            "iteration {i}: the slot was read before its upload or overwritten before its read"
        );
    }
    coordinator.retire_finished();
    let metrics = coordinator.metrics();
    assert_eq!(
        (metrics.registered, metrics.begun, metrics.completed),
        (
            2 * ITERATIONS as u64,
            2 * ITERATIONS as u64,
            2 * ITERATIONS as u64
        )
    );
    assert_eq!(coordinator.live_operations(), 0);
}

/// Eight server threads share one coordinator and one stream pool. Each request is a chain of
/// 300 operations, each begun on a pool stream of its priority (`begin_on_pool`, so a chain
/// hops between streams) and applying an order-sensitive transform between two buffers. Every
/// chain's result is exact, the counts add up, and everything retires.
#[test]
fn request_chains_from_eight_threads_on_pool_streams_are_exact_and_retire() {
    const THREADS: usize = 8;
    const CHAIN: usize = 300;
    const N: usize = 1024;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let streams = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let events = EventPool::new(&gpu.context, 0, 0).unwrap();
    let coordinator = OperationCoordinator::new(events.clone()).unwrap();
    let priorities = [
        EventPriority::Critical,
        EventPriority::High,
        EventPriority::Normal,
        EventPriority::Low,
        EventPriority::Cleanup,
    ];
    let results: Vec<(u32, Vec<u32>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (coordinator, streams, kernels, event_kernels, gpu) =
                    (&coordinator, &streams, &kernels, &event_kernels, &gpu);
                scope.spawn(move || {
                    let start = t as u32 + 1;
                    let buffers = [filled(&gpu.context, N, start), filled(&gpu.context, N, 0)];
                    let unfinished = filled(&gpu.context, 1, 0);
                    let mut expected = start;
                    let mut last: Option<OperationId> = None;
                    for k in 0..CHAIN {
                        let id = coordinator
                            .register_operation(
                                OperationType::Kernel,
                                priorities[(t + k) % priorities.len()],
                                None,
                                &last.into_iter().collect::<Vec<_>>(),
                                format!("thread {t} step {k}"),
                            )
                            .unwrap();
                        let stream = coordinator.begin_on_pool(id, streams).unwrap();
                        if k % 37 == t {
                            kernels.spin_ns(stream.stream(), 200 * US).unwrap();
                        }
                        let (mul, add) = (3 + 2 * (k as u32 % 4), (t * 31 + k) as u32);
                        let (src, dst) = (buffers[k % 2].ptr(), buffers[(k + 1) % 2].ptr());
                        // SAFETY: both buffers hold N u32s and `unfinished` one, alive until
                        // the chain's last operation is synchronised below; the chain's
                        // dependencies order every use of them.
                        unsafe {
                            event_kernels
                                .transform_checked_u32(
                                    stream.stream(),
                                    src,
                                    dst,
                                    N,
                                    mul,
                                    add,
                                    0,
                                    unfinished.ptr(),
                                )
                                .unwrap()
                        };
                        coordinator.complete_operation(id).unwrap();
                        expected = affine(expected, mul, add);
                        last = Some(id);
                    }
                    coordinator.synchronize(last.unwrap()).unwrap();
                    let result = read_u32s(&gpu.context, buffers[CHAIN % 2].ptr(), N);
                    (expected, result)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap())
            .collect()
    });
    for (t, (expected, result)) in results.iter().enumerate() {
        assert!(
            result.iter().all(|v| v == expected),
            "thread {t}: a step ran out of order ({:#x} != {expected:#x})",
            result[0]
        );
    }
    for stream in streams.streams() {
        stream.synchronize().unwrap();
    }
    coordinator.retire_finished();
    let total = (THREADS * CHAIN) as u64;
    let metrics = coordinator.metrics();
    assert_eq!(
        (
            metrics.registered,
            metrics.begun,
            metrics.completed,
            metrics.failed
        ),
        (total, total, total, 0)
    );
    assert_eq!(coordinator.live_operations(), 0);
    let counters = events.counters();
    let created = counters.created_regular + counters.created_timing;
    assert!(created <= 1024, "{created} events for {total} operations");
}

/// A scheduler that hangs a completion callback on every one of 10^5 operations (a chain
/// alternating two streams every 100 operations, synchronised every 1000). Every callback runs
/// exactly once with `Ok`; the waiter ends with nothing pending; operations, events and
/// resident memory stay bounded by what is in flight.
#[test]
fn a_hundred_thousand_operations_with_callbacks_run_each_once_and_stay_bounded() {
    const OPS: usize = 100_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let streams = [common::stream(&gpu.context), common::stream(&gpu.context)];
    let events = EventPool::new(&gpu.context, 0, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(events.clone(), Arc::clone(&waiter));
    let runs: Arc<Vec<AtomicU32>> = Arc::new((0..OPS).map(|_| AtomicU32::new(0)).collect());
    let failures = Arc::new(AtomicUsize::new(0));
    let mut last: Option<OperationId> = None;
    let (mut live_peak, mut rss_warm) = (0, 0);
    for i in 0..OPS {
        let deps: Vec<OperationId> = last.into_iter().collect();
        let id = register(
            &coordinator,
            OperationType::Kernel,
            EventPriority::Normal,
            &deps,
        );
        let (runs, failures) = (Arc::clone(&runs), Arc::clone(&failures));
        coordinator
            .on_complete(id, move |done, result| {
                if done != id || result.is_err() {
                    failures.fetch_add(1, Ordering::SeqCst);
                }
                runs[i].fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        coordinator
            .begin_operation(id, &streams[(i / 100) % 2])
            .unwrap();
        coordinator.complete_operation(id).unwrap();
        last = Some(id);
        if i % 1000 == 999 {
            coordinator.synchronize(id).unwrap();
        }
        if i % 5000 == 0 {
            live_peak = live_peak.max(coordinator.live_operations());
        }
        if i == OPS / 10 {
            rss_warm = cuweave_test_support::resident_bytes();
        }
    }
    coordinator.synchronize(last.unwrap()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while runs.iter().any(|n| n.load(Ordering::SeqCst) == 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        coordinator.retire_finished();
    }
    settle(&waiter, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(20));
    coordinator.retire_finished();
    let rss_end = cuweave_test_support::resident_bytes();
    let never: Vec<usize> = (0..OPS)
        .filter(|&i| runs[i].load(Ordering::SeqCst) == 0)
        .take(5)
        .collect();
    let twice: Vec<usize> = (0..OPS)
        .filter(|&i| runs[i].load(Ordering::SeqCst) > 1)
        .take(5)
        .collect();
    assert!(never.is_empty(), "callbacks never ran, e.g. {never:?}");
    assert!(twice.is_empty(), "callbacks ran twice, e.g. {twice:?}");
    assert_eq!(failures.load(Ordering::SeqCst), 0);
    assert_eq!(waiter.pending(), 0);
    assert_eq!(coordinator.live_operations(), 0);
    assert!(live_peak <= 2048, "{live_peak} operations live at once");
    let counters = events.counters();
    let created = counters.created_regular + counters.created_timing;
    assert!(
        created <= 4096,
        "{created} events created for {OPS} operations"
    );
    assert!(
        rss_end <= rss_warm + (16 << 20),
        "resident memory grew from {rss_warm} to {rss_end} bytes"
    );
    let metrics = coordinator.metrics();
    assert_eq!((metrics.completed, metrics.failed), (OPS as u64, 0));
}

/// The same callbacks while the waiter's reactor is stuck for the whole run (one of its own
/// callbacks blocks it; another coordinator shares the waiter). The coordinator's own polls
/// decide the operations and run their callbacks; each decided operation's event goes back to
/// the pool at once, although the stuck reactor still has its watch queued: 20 000 operations
/// take no more events than are in flight. Once the reactor moves again, every watch ends
/// without running anything twice, and nothing is left pending.
#[test]
fn a_stuck_reactor_does_not_keep_decided_operations_events_out_of_the_pool() {
    const OPS: usize = 20_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let stream = common::stream(&gpu.context);
    let events = EventPool::new(&gpu.context, 0, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    // Block the reactor thread inside a callback of an already-finished event.
    let (stuck_tx, stuck_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let blocker = events.acquire_owned(false).unwrap();
    blocker.record(&stream).unwrap();
    stream.synchronize().unwrap();
    waiter.wait_async(blocker, move |result| {
        result.unwrap();
        stuck_tx.send(()).unwrap();
        release_rx.recv().unwrap();
    });
    stuck_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the reactor ran the blocking callback");
    let coordinator = OperationCoordinator::with_waiter(events.clone(), Arc::clone(&waiter));
    let created_before = {
        let counters = events.counters();
        counters.created_regular + counters.created_timing
    };
    let runs: Arc<Vec<AtomicU32>> = Arc::new((0..OPS).map(|_| AtomicU32::new(0)).collect());
    let mut last = None;
    for i in 0..OPS {
        let deps: Vec<OperationId> = last.into_iter().collect();
        let id = register(
            &coordinator,
            OperationType::Kernel,
            EventPriority::Normal,
            &deps,
        );
        let runs = Arc::clone(&runs);
        coordinator
            .on_complete(id, move |done, result| {
                assert_eq!((done, result), (id, Ok(())));
                runs[i].fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        coordinator.begin_operation(id, &stream).unwrap();
        coordinator.complete_operation(id).unwrap();
        last = Some(id);
        if i % 1000 == 999 {
            coordinator.synchronize(id).unwrap();
            coordinator.retire_finished();
        }
    }
    coordinator.synchronize(last.unwrap()).unwrap();
    coordinator.retire_finished();
    let counters = events.counters();
    let created = counters.created_regular + counters.created_timing - created_before;
    let ran = runs
        .iter()
        .filter(|n| n.load(Ordering::SeqCst) == 1)
        .count();
    assert_eq!(
        ran, OPS,
        "the polls ran every callback while the reactor was stuck"
    );
    assert_eq!(coordinator.live_operations(), 0);
    assert!(
        created <= 2048,
        "{created} events created for {OPS} operations while the reactor was stuck"
    );
    assert!(waiter.pending() >= OPS, "the watches are still queued");
    release_tx.send(()).unwrap();
    settle(&waiter, Duration::from_secs(10));
    assert_eq!(waiter.pending(), 0);
    let stats = waiter.stats();
    assert_eq!(
        stats.cancelled, OPS as u64,
        "every watch let go, none ran: {stats:?}"
    );
    assert_eq!(
        stats.completed, 1,
        "only the blocking wait completed: {stats:?}"
    );
    assert!(
        runs.iter().all(|n| n.load(Ordering::SeqCst) == 1),
        "no callback ran twice"
    );
}

/// A pool of worker threads, each blocked in `wait_until_ready` on its next operation of one
/// chain whose consecutive operations belong to different workers (and streams): worker
/// `i % 4` runs operation `i`, which depends on `i - 1`. Each wakes when the previous worker
/// completes, begins on its own stream, and applies an order-sensitive transform. The result
/// is exact.
#[test]
fn workers_blocked_in_wait_until_ready_run_a_chain_across_threads_in_order() {
    const WORKERS: usize = 4;
    const OPS: usize = 800;
    const N: usize = 4096;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let streams: Vec<Arc<Stream>> = (0..WORKERS).map(|_| common::stream(&gpu.context)).collect();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 8, 0).unwrap()).unwrap();
    let mut ids: Vec<OperationId> = Vec::with_capacity(OPS);
    for _ in 0..OPS {
        let deps: Vec<OperationId> = ids.last().copied().into_iter().collect();
        ids.push(register(
            &coordinator,
            OperationType::Kernel,
            EventPriority::Normal,
            &deps,
        ));
    }
    let buffers = [filled(&gpu.context, N, 1), filled(&gpu.context, N, 0)];
    let unfinished = filled(&gpu.context, 1, 0);
    let step = |i: usize| (5 + 2 * (i as u32 % 3), i as u32 % 11 + 1);
    std::thread::scope(|scope| {
        for (w, stream) in streams.iter().enumerate() {
            let (coordinator, ids, kernels, event_kernels, buffers, unfinished) = (
                &coordinator,
                &ids,
                &kernels,
                &event_kernels,
                &buffers,
                &unfinished,
            );
            scope.spawn(move || {
                for i in (w..OPS).step_by(WORKERS) {
                    coordinator
                        .wait_until_ready(ids[i], Duration::from_secs(10))
                        .unwrap();
                    coordinator.begin_operation(ids[i], stream).unwrap();
                    if i % 50 == 0 {
                        kernels.spin_ns(stream, 300 * US).unwrap();
                    }
                    let (mul, add) = step(i);
                    let (src, dst) = (buffers[i % 2].ptr(), buffers[(i + 1) % 2].ptr());
                    // SAFETY: both buffers hold N u32s and `unfinished` one, alive past the
                    // final synchronisation; the chain orders every use of them.
                    unsafe {
                        event_kernels
                            .transform_checked_u32(
                                stream,
                                src,
                                dst,
                                N,
                                mul,
                                add,
                                0,
                                unfinished.ptr(),
                            )
                            .unwrap()
                    };
                    coordinator.complete_operation(ids[i]).unwrap();
                }
            });
        }
    });
    coordinator.synchronize(ids[OPS - 1]).unwrap();
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    let expected = (0..OPS).fold(1u32, |x, i| {
        let (mul, add) = step(i);
        affine(x, mul, add)
    });
    let result = read_u32s(&gpu.context, buffers[OPS % 2].ptr(), N);
    assert!(
        result.iter().all(|&v| v == expected),
        "the chain ran out of order: {:#x} != {expected:#x}",
        result[0]
    );
    assert_eq!(coordinator.metrics().completed, OPS as u64);
}

/// The waiter's counters under the races a server produces: 3000 callback waits cancelled
/// with `cancel_wait` at varying times around their GPU completion (the test knows exactly how
/// many cancellations succeeded), and 3000 futures dropped or timed out around theirs. Once
/// nothing is pending, every cancellation that succeeded is counted as cancelled, and every
/// registered wait is counted exactly once as completed, cancelled, timed out or failed.
#[test]
fn the_waiters_books_balance_under_cancellation_and_timeout_races() {
    const ROUNDS: u64 = 3000;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 8, 0).unwrap();
    let streams: Vec<_> = (0..4).map(|_| common::stream(&gpu.context)).collect();

    // Callbacks, cancelled with `cancel_wait`.
    let callbacks = AsyncEventWaiter::new().unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let mut cancelled = 0u64;
    for i in 0..ROUNDS {
        let stream = &streams[(i % 4) as usize];
        kernels.spin_ns(stream, (i * 7_919) % 20_000).unwrap();
        let event = pool.acquire_owned(false).unwrap();
        event.record(stream).unwrap();
        let counter = Arc::clone(&ran);
        let id = callbacks.wait_async(event, move |result| {
            result.unwrap();
            counter.fetch_add(1, Ordering::SeqCst);
        });
        let until = Instant::now() + Duration::from_nanos((i * 104_729) % 20_000);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
        if callbacks.cancel_wait(id) {
            cancelled += 1;
        }
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    settle(&callbacks, Duration::from_secs(5));
    let stats = callbacks.stats();
    assert_eq!(stats.pending, 0);
    assert_eq!(ran.load(Ordering::SeqCst) as u64 + cancelled, ROUNDS);
    assert_eq!(
        (stats.completed, stats.cancelled),
        (ROUNDS - cancelled, cancelled),
        "{cancelled} cancel_wait calls returned true; {stats:?}"
    );

    // Futures, dropped or given a timeout.
    let futures_waiter = AsyncEventWaiter::new().unwrap();
    for i in 0..ROUNDS {
        let stream = &streams[(i % 4) as usize];
        kernels.spin_ns(stream, (i * 7_919) % 20_000).unwrap();
        let delay = Duration::from_nanos((i * 104_729) % 20_000);
        match i % 4 {
            0 => {
                let future = futures_waiter.stream_idle(stream).unwrap();
                let until = Instant::now() + delay;
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
                drop(future);
            }
            1 => {
                let event = pool.acquire_owned(false).unwrap();
                event.record(stream).unwrap();
                let future = futures_waiter.event_done(event);
                let until = Instant::now() + delay;
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
                drop(future);
            }
            2 => {
                let options = WaitOptions::new(WakeMechanism::CompletionWord).with_timeout(delay);
                let future = futures_waiter.stream_idle_with(stream, options).unwrap();
                let result = futures::executor::block_on(future);
                assert!(
                    matches!(result, Ok(()) | Err(EventError::TimedOut { .. })),
                    "{result:?}"
                );
            }
            _ => {
                let event = pool.acquire_owned(false).unwrap();
                event.record(stream).unwrap();
                let future = futures_waiter.event_done_with(event, Some(delay));
                let result = futures::executor::block_on(future);
                assert!(
                    matches!(result, Ok(()) | Err(EventError::TimedOut { .. })),
                    "{result:?}"
                );
            }
        }
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    settle(&futures_waiter, Duration::from_secs(5));
    let stats = futures_waiter.stats();
    assert_eq!(stats.pending, 0);
    assert_eq!(stats.registered, ROUNDS);
    assert_eq!(
        stats.completed + stats.cancelled + stats.timed_out + stats.failed,
        stats.registered,
        "a wait ended without being counted: {stats:?}"
    );
}

/// Timeouts set right around the GPU's completion, 2000 times, on completion words and on
/// event queries: a wait that reports success never does so before the kernel's store, a
/// timed-out wait's word is not lent to the next wait before the GPU wrote it, and a wait
/// without a timeout on the same stream right after always succeeds after the store.
#[test]
fn timeouts_racing_completion_never_resolve_a_wait_early() {
    const ROUNDS: u32 = 2000;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let stream = common::stream(&gpu.context);
    let flags = Flags::new(&gpu.context, 1);
    let (mut completed, mut timed_out) = (0, 0);
    for round in 1..=ROUNDS {
        let spin = 20 * US + u64::from(round % 7) * 5 * US;
        // SAFETY: a mapped flag of this context, alive past the stream's last use.
        unsafe {
            kernels
                .spin_then_store_u32(&stream, spin, flags.device(0), round)
                .unwrap()
        };
        let mechanism = if round % 2 == 0 {
            WakeMechanism::CompletionWord
        } else {
            WakeMechanism::EventQuery
        };
        let timeout = Duration::from_micros(u64::from(round % 11) * 6);
        let options = WaitOptions::new(mechanism).with_timeout(timeout);
        let raced = futures::executor::block_on(waiter.stream_idle_with(&stream, options).unwrap());
        match raced {
            Ok(()) => {
                assert_eq!(
                    flags.read(0),
                    round,
                    "round {round}: resolved before the kernel's store"
                );
                completed += 1;
            }
            Err(EventError::TimedOut { .. }) => timed_out += 1,
            Err(error) => panic!("round {round}: {error}"),
        }
        futures::executor::block_on(waiter.stream_idle(&stream).unwrap()).unwrap();
        assert_eq!(
            flags.read(0),
            round,
            "round {round}: the follow-up wait resolved before the store"
        );
    }
    eprintln!("{completed} completed, {timed_out} timed out");
    assert!(timed_out > 0, "no timeout ever won the race");
    settle(&waiter, Duration::from_secs(5));
    assert_eq!(waiter.pending(), 0);
}

/// A scheduler registers a whole epoch ahead: a chain of 20 000 operations is no cycle and is
/// checked quickly; one `add_dependency` by mistake closes a cycle through 10 000 of them,
/// which `detect_deadlocks` names (once, from its lowest id), `begin_operation` of a member
/// refuses with that cycle, and an operation behind the cycle is reported not queued and
/// stalled, not in a cycle. Two small cycles added elsewhere are found beside it.
#[test]
fn a_long_cycle_closed_in_a_registered_epoch_is_named_quickly() {
    const OPS: usize = 20_000;
    const CYCLE: usize = 10_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let stream = common::stream(&gpu.context);
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 0, 0).unwrap()).unwrap();
    let mut ids: Vec<OperationId> = Vec::with_capacity(OPS);
    for _ in 0..OPS {
        let deps: Vec<OperationId> = ids.last().copied().into_iter().collect();
        ids.push(register(
            &coordinator,
            OperationType::Kernel,
            EventPriority::Normal,
            &deps,
        ));
    }
    let started = Instant::now();
    assert!(coordinator.detect_deadlocks().is_empty());
    let acyclic = started.elapsed();

    coordinator.add_dependency(ids[0], ids[CYCLE - 1]).unwrap();
    let started = Instant::now();
    let cycles = coordinator.detect_deadlocks();
    let cyclic = started.elapsed();
    let expected: Vec<OperationId> = std::iter::once(ids[0])
        .chain((1..CYCLE).rev().map(|i| ids[i]))
        .collect();
    assert_eq!(cycles.len(), 1);
    assert_eq!(cycles[0], expected, "the cycle from its lowest id");
    assert_eq!(
        coordinator.begin_operation(ids[CYCLE / 2], &stream),
        Err(EventError::DependencyCycle {
            id: ids[CYCLE / 2],
            cycle: expected.clone()
        })
    );
    assert_eq!(
        coordinator.begin_operation(ids[CYCLE], &stream),
        Err(EventError::DependencyNotQueued {
            id: ids[CYCLE],
            dependency: ids[CYCLE - 1]
        })
    );
    match coordinator.wait_until_ready(ids[CYCLE], Duration::from_millis(30)) {
        Err(EventError::Stalled { id, blocked_on, .. }) => {
            assert_eq!((id, blocked_on), (ids[CYCLE], vec![ids[CYCLE - 1]]));
        }
        other => panic!("an operation behind the cycle: {other:?}"),
    }
    assert!(
        coordinator
            .stalled_operations(Duration::ZERO)
            .iter()
            .any(|(id, _)| *id == ids[CYCLE])
    );

    // Two small cycles among new operations.
    let a = register(
        &coordinator,
        OperationType::Kernel,
        EventPriority::Normal,
        &[],
    );
    let b = register(
        &coordinator,
        OperationType::Kernel,
        EventPriority::Normal,
        &[a],
    );
    coordinator.add_dependency(a, b).unwrap();
    let c = register(
        &coordinator,
        OperationType::Kernel,
        EventPriority::Normal,
        &[],
    );
    let d = register(
        &coordinator,
        OperationType::Kernel,
        EventPriority::Normal,
        &[c],
    );
    let e = register(
        &coordinator,
        OperationType::Kernel,
        EventPriority::Normal,
        &[d],
    );
    coordinator.add_dependency(c, e).unwrap();
    let cycles = coordinator.detect_deadlocks();
    assert_eq!(
        cycles.len(),
        3,
        "{:?}",
        cycles.iter().map(Vec::len).collect::<Vec<_>>()
    );
    assert!(cycles.contains(&vec![a, b]));
    assert!(cycles.contains(&vec![c, e, d]));
    assert_eq!(
        coordinator.state(ids[0]).unwrap(),
        OperationState::Registered
    );
    let metrics = coordinator.metrics();
    assert_eq!(metrics.begun, 0, "nothing in or behind a cycle began");
    assert!(metrics.deadlock_detections >= 2);
    assert!(stream.query().unwrap(), "nothing was queued");
    eprintln!("detect_deadlocks: {acyclic:?} acyclic, {cyclic:?} with the long cycle");
    assert!(
        acyclic < Duration::from_secs(5) && cyclic < Duration::from_secs(5),
        "cycle detection over {OPS} operations took {acyclic:?} / {cyclic:?}"
    );
}

/// A server with one coordinator per model passes, by mistake, an operation of model A's
/// coordinator as a dependency to model B's. The id means nothing to B: B must refuse it
/// (`UnknownOperation`) or, if it takes it, order the dependant after A's work. Taking it for
/// one of B's own finished operations would let B's kernel read A's output before A wrote it.
#[test]
fn an_operation_id_of_another_coordinator_is_never_a_satisfied_dependency() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let (stream_a, stream_b) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let model_a = OperationCoordinator::new(EventPool::new(&gpu.context, 2, 0).unwrap()).unwrap();
    let model_b = OperationCoordinator::new(EventPool::new(&gpu.context, 2, 0).unwrap()).unwrap();
    // Model B has served a few requests already; they are done and retired.
    for _ in 0..3 {
        let id = register(&model_b, OperationType::Kernel, EventPriority::Normal, &[]);
        model_b.begin_operation(id, &stream_b).unwrap();
        model_b.complete_operation(id).unwrap();
        model_b.synchronize(id).unwrap();
    }
    let flags = Flags::new(&gpu.context, 2);
    let produce = register(&model_a, OperationType::Kernel, EventPriority::Normal, &[]);
    model_a.begin_operation(produce, &stream_a).unwrap();
    // SAFETY: mapped flags of this context, alive past both streams' last use.
    unsafe {
        kernels
            .spin_then_store_u32(&stream_a, 100 * MS, flags.device(0), 1)
            .unwrap()
    };
    model_a.complete_operation(produce).unwrap();

    match model_b.register_operation(
        OperationType::Kernel,
        EventPriority::Normal,
        None,
        &[produce],
        "consumer of model A's output",
    ) {
        Err(EventError::UnknownOperation { .. }) => {}
        Err(other) => panic!("refused, but not as an unknown operation: {other}"),
        Ok(consume) => {
            let begun = model_b.begin_operation(consume, &stream_b);
            if begun.is_ok() {
                // SAFETY: as above.
                unsafe {
                    event_kernels
                        .count_flags_u32(&stream_b, flags.device(0), 1, 1, flags.device(1))
                        .unwrap()
                };
                model_b.complete_operation(consume).unwrap();
                model_b.synchronize(consume).unwrap();
            }
            stream_a.synchronize().unwrap();
            stream_b.synchronize().unwrap();
            assert!(
                begun.is_err() || flags.read(1) == 1,
                "model B took model A's {produce} for its own finished operation and ran the \
                 consumer before A's producer stored its output ({begun:?})"
            );
        }
    }
    stream_a.synchronize().unwrap();
    stream_b.synchronize().unwrap();
}
