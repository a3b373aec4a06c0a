//! Programs shaped like the event layer's users: an async inference server (tokio tasks each
//! awaiting GPU work on its own stream, with timeouts and cancellation by dropping the future),
//! a pipeline scheduler (a diamond DAG across streams, a cycle closed by mistake, 10^5
//! operations in a long run), a barrier across streams, callback-driven completion, and
//! `torch.cuda.Event` habits (record, query, synchronize, elapsed time, wait on another
//! stream). Every outcome is the GPU's: bytes written by kernels, flags in mapped memory.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once, mpsc};
use std::time::{Duration, Instant};

use common::{Flags, MS, within};
use cuweave_driver::DriverError;
use cuweave_driver::memory::{self, DeviceAllocation};
use cuweave_event::{
    AsyncEventWaiter, CrossStreamBarrier, EventError, EventPool, EventPriority,
    OperationCoordinator, OperationId, OperationType, WaitOptions, WakeMechanism,
};
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

const SENTINEL: u32 = 0xFFFF_FFFF;

/// The calling thread's kernel id (`/proc/thread-self` links to `<pid>/task/<tid>`).
fn current_tid() -> Option<u64> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

/// User + system CPU ticks of thread `tid` of this process, or `None` once it has exited.
fn thread_cpu_ticks(tid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// Reads `count` `u32`s of device memory (the streams writing it are idle).
fn read_u32s(gpu: &cuweave_test_support::Gpu, ptr: u64, count: usize) -> Vec<u32> {
    let mut bytes = vec![0u8; count * 4];
    // SAFETY: `count * 4` bytes of a live allocation; the caller's streams are idle.
    unsafe { memory::copy_dtoh(&gpu.context, bytes.as_mut_ptr(), ptr, count * 4).unwrap() };
    bytes
        .chunks_exact(4)
        .map(|chunk| u32::from_le_bytes(chunk.try_into().unwrap()))
        .collect()
}

fn read_u64(gpu: &cuweave_test_support::Gpu, ptr: u64) -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: 8 bytes of a live allocation; the caller's streams are idle.
    unsafe { memory::copy_dtoh(&gpu.context, bytes.as_mut_ptr(), ptr, 8).unwrap() };
    u64::from_le_bytes(bytes)
}

/// An inference server: 64 tokio tasks, each launching a spinning kernel on its own stream that
/// then stores a flag, and awaiting the stream (completion word) or an event recorded behind
/// the kernel. Every task sees its kernel's flag when its await returns (none resolves early),
/// all complete, and once they have, the reactor thread uses no measurable CPU.
#[test]
fn sixty_four_tokio_tasks_await_their_own_streams_and_none_resolves_early() {
    const TASKS: usize = 64;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = Arc::new(TestKernels::load(&gpu.context).unwrap());
    let pool = EventPool::new(&gpu.context, 0, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let flags = Arc::new(Flags::new(&gpu.context, TASKS));
    let streams: Vec<_> = (0..TASKS).map(|_| common::stream(&gpu.context)).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let seen: Vec<u32> = runtime.block_on(async {
        let mut tasks = Vec::new();
        for (i, stream) in streams.iter().enumerate() {
            let (kernels, waiter, flags, stream, pool) = (
                Arc::clone(&kernels),
                Arc::clone(&waiter),
                Arc::clone(&flags),
                Arc::clone(stream),
                pool.clone(),
            );
            tasks.push(tokio::spawn(async move {
                // 5 to 20 ms of GPU work, then the task's flag.
                let spin = (5 + (i as u64 % 16)) * MS;
                // SAFETY: mapped flag of this context, alive past the stream's last use.
                unsafe {
                    kernels
                        .spin_then_store_u32(&stream, spin, flags.device(i), i as u32 + 1)
                        .unwrap()
                };
                if i % 2 == 0 {
                    waiter.stream_idle(&stream).unwrap().await.unwrap();
                } else {
                    let event = pool.acquire_owned(false).unwrap();
                    event.record(&stream).unwrap();
                    waiter.event_done(event).await.unwrap();
                }
                flags.read(i)
            }));
        }
        let mut seen = Vec::new();
        for task in tasks {
            seen.push(task.await.unwrap());
        }
        seen
    });
    let took = started.elapsed();
    let expected: Vec<u32> = (1..=TASKS as u32).collect();
    assert_eq!(
        seen, expected,
        "a task's await returned before its kernel's store"
    );
    assert!(took < Duration::from_secs(5), "64 waits took {took:?}");
    // The reactor counts a wait after waking its task: wait for the count to settle.
    let deadline = Instant::now() + Duration::from_secs(2);
    while waiter.pending() > 0 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let stats = waiter.stats();
    assert_eq!((stats.completed, stats.failed), (TASKS as u64, 0));

    // The reactor, idle now, parks: find its thread through a callback it runs.
    let (tx, rx) = mpsc::channel();
    let event = pool.acquire_owned(false).unwrap();
    event.record(&streams[0]).unwrap();
    waiter.wait_async(event, move |result| {
        tx.send((result, current_tid())).unwrap();
    });
    let (result, tid) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(result, Ok(()));
    let Some(tid) = tid else {
        return; // No procfs: nothing to measure.
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    while waiter.pending() > 0 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let before = thread_cpu_ticks(tid).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let used = thread_cpu_ticks(tid).unwrap() - before;
    // A spinning reactor burns ~50 ticks (10 ms each) in 500 ms; a parked one none.
    assert!(used <= 2, "the idle reactor used {used} ticks in 500 ms");
}

/// A request handler gives up on slow GPU work (`tokio::time::timeout` drops the future; a
/// wait with its own timeout gets a typed error) while the kernel still runs; a later await of
/// the same work succeeds and sees its bytes, and the abandoned waits leave nothing pending.
#[test]
fn timed_out_and_dropped_waits_leave_the_same_work_awaitable_again() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 1, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let stream = common::stream(&gpu.context);
    let flags = Arc::new(Flags::new(&gpu.context, 1));
    // SAFETY: mapped flag of this context, alive past the stream's last use.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, 150 * MS, flags.device(0), 42)
            .unwrap()
    };
    let event = Arc::new(pool.acquire_owned(false).unwrap());
    event.record(&stream).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (waiter2, stream2, event2, flags2) = (
        Arc::clone(&waiter),
        Arc::clone(&stream),
        Arc::clone(&event),
        Arc::clone(&flags),
    );
    let outcome = runtime.block_on(async move {
        // Cancelled by dropping (tokio's timeout).
        let dropped = tokio::time::timeout(
            Duration::from_millis(10),
            waiter2.stream_idle(&stream2).unwrap(),
        )
        .await;
        assert!(dropped.is_err(), "the 150 ms kernel finished within 10 ms");
        // A typed timeout, on a word and on an event.
        let timeout = Duration::from_millis(10);
        let word = waiter2
            .stream_idle_with(
                &stream2,
                WaitOptions::new(WakeMechanism::CompletionWord).with_timeout(timeout),
            )
            .unwrap()
            .await;
        assert_eq!(word, Err(EventError::TimedOut { timeout }));
        let on_event = waiter2
            .event_done_with(Arc::clone(&event2), Some(timeout))
            .await;
        assert_eq!(on_event, Err(EventError::TimedOut { timeout }));
        let still_running = flags2.read(0);
        // The same work, awaited again, without a timeout: both ways succeed.
        waiter2.event_done(Arc::clone(&event2)).await.unwrap();
        waiter2.stream_idle(&stream2).unwrap().await.unwrap();
        (still_running, flags2.read(0))
    });
    assert_eq!(
        outcome,
        (0, 42),
        "(flag after the timeouts, flag after the awaits)"
    );
    let deadline = Instant::now() + Duration::from_secs(2);
    while waiter.pending() > 0 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let stats = waiter.stats();
    assert_eq!(stats.pending, 0);
    assert_eq!((stats.timed_out, stats.cancelled), (2, 1), "{stats:?}");
    assert_eq!(stats.completed, 2);
    // Waits keep working after the abandoned ones.
    // SAFETY: as above.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, MS, flags.device(0), 43)
            .unwrap()
    };
    futures::executor::block_on(waiter.stream_idle(&stream).unwrap()).unwrap();
    assert_eq!(flags.read(0), 43);
}

/// A micro-batch pipeline's diamond across three streams: A (stream 0) writes the input late,
/// B (stream 1) and C (stream 2) each transform it, D (stream 0 again) reads both. Kernels
/// count any input they read before its producer wrote it; the reduction is exact. Each
/// completion callback runs once; the metrics add up; everything retires.
#[test]
fn a_diamond_across_three_streams_orders_by_bytes_runs_each_callback_once_and_retires() {
    const N: usize = 1 << 16;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let streams: Vec<_> = (0..3).map(|_| common::stream(&gpu.context)).collect();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 4, 0).unwrap()).unwrap();
    let (x, y, z) = (
        DeviceAllocation::new(&gpu.context, N * 4).unwrap(),
        DeviceAllocation::new(&gpu.context, N * 4).unwrap(),
        DeviceAllocation::new(&gpu.context, N * 4).unwrap(),
    );
    let (w, counters) = (
        DeviceAllocation::new(&gpu.context, N * 4).unwrap(),
        DeviceAllocation::new(&gpu.context, 32).unwrap(),
    );
    // SAFETY: fresh allocations of this context, sized as written.
    unsafe {
        for buffer in [&x, &y, &z] {
            memory::memset_d32(&gpu.context, buffer.ptr(), SENTINEL, N).unwrap();
        }
        memory::memset_d32(&gpu.context, counters.ptr(), 0, 8).unwrap();
    }
    let unfinished = |i: u64| counters.ptr() + 4 * i;
    let sum = counters.ptr() + 16;

    let register = |kind, deps: &[OperationId], name: &str| {
        coordinator
            .register_operation(kind, EventPriority::Normal, None, deps, name)
            .unwrap()
    };
    let a = register(OperationType::MemoryTransfer, &[], "A: produce");
    let b = register(OperationType::Kernel, &[a], "B: 2x");
    let c = register(OperationType::Kernel, &[a], "C: 3x+1");
    let d = register(OperationType::Reduction, &[b, c], "D: reduce");
    assert!(
        coordinator.detect_deadlocks().is_empty(),
        "a diamond is no cycle"
    );
    let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..4).map(|_| AtomicUsize::new(0)).collect());
    for (i, op) in [a, b, c, d].into_iter().enumerate() {
        let runs = Arc::clone(&runs);
        coordinator
            .on_complete(op, move |id, result| {
                assert_eq!((id, result), (op, Ok(())));
                runs[i].fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
    }

    coordinator.begin_operation(a, &streams[0]).unwrap();
    kernels.spin_ns(&streams[0], 20 * MS).unwrap();
    // SAFETY: every pointer is a live allocation of this context, sized for N (or the
    // counters); the host touches none until the streams are idle.
    unsafe { kernels.fill_u32(&streams[0], x.ptr(), 5, N).unwrap() };
    coordinator.complete_operation(a).unwrap();
    for (op, stream, (mul, add), out, counter) in [
        (b, &streams[1], (2, 0), &y, 0),
        (c, &streams[2], (3, 1), &z, 1),
    ] {
        coordinator.begin_operation(op, stream).unwrap();
        kernels.spin_ns(stream, 5 * MS).unwrap();
        // SAFETY: as above.
        unsafe {
            event_kernels
                .transform_checked_u32(
                    stream,
                    x.ptr(),
                    out.ptr(),
                    N,
                    mul,
                    add,
                    SENTINEL,
                    unfinished(counter),
                )
                .unwrap()
        };
        coordinator.complete_operation(op).unwrap();
    }
    coordinator.begin_operation(d, &streams[0]).unwrap();
    // SAFETY: as above.
    unsafe {
        for input in [&y, &z] {
            event_kernels
                .transform_checked_u32(
                    &streams[0],
                    input.ptr(),
                    w.ptr(),
                    N,
                    1,
                    0,
                    SENTINEL,
                    unfinished(2),
                )
                .unwrap();
            kernels
                .checksum_u32(&streams[0], input.ptr(), N, sum)
                .unwrap();
        }
    }
    coordinator.complete_operation(d).unwrap();
    coordinator.synchronize(d).unwrap();
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_eq!(
        read_u32s(&gpu, counters.ptr(), 3),
        vec![0, 0, 0],
        "a stage read input before its producer wrote it"
    );
    assert_eq!(read_u64(&gpu, sum), N as u64 * (10 + 16));

    let deadline = Instant::now() + Duration::from_secs(5);
    while runs.iter().any(|n| n.load(Ordering::SeqCst) == 0) && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let metrics = coordinator.metrics();
    while coordinator.live_operations() > 0 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let counts: Vec<usize> = runs.iter().map(|n| n.load(Ordering::SeqCst)).collect();
    assert_eq!(counts, vec![1; 4], "each callback runs exactly once");
    assert_eq!(
        (
            metrics.registered,
            metrics.begun,
            metrics.completed,
            metrics.failed
        ),
        (4, 4, 4, 0)
    );
    assert_eq!(
        (
            metrics.cross_stream_waits,
            metrics.same_stream_waits_skipped
        ),
        (4, 0),
        "B and C wait for A, D for B and C"
    );
    assert_eq!(coordinator.live_operations(), 0);
    for op in [a, b, c, d] {
        assert_eq!(
            coordinator.metadata(op),
            Err(EventError::Retired { id: op })
        );
    }
}

/// A long-running scheduler: 25 000 diamonds (10^5 operations) chained across three streams,
/// synchronising every 50 diamonds as a training loop does to log. Live records, events and
/// resident memory stay bounded by what is in flight; every operation completes.
#[test]
fn a_hundred_thousand_diamond_operations_retire_and_stay_bounded() {
    const DIAMONDS: u64 = 25_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let streams: Vec<_> = (0..3).map(|_| common::stream(&gpu.context)).collect();
    let pool = EventPool::new(&gpu.context, 0, 0).unwrap();
    let coordinator = OperationCoordinator::new(pool.clone()).unwrap();
    let run = |kind, deps: &[OperationId], stream: usize| {
        let id = coordinator
            .register_operation(kind, EventPriority::Normal, None, deps, "")
            .unwrap();
        coordinator.begin_operation(id, &streams[stream]).unwrap();
        coordinator.complete_operation(id).unwrap();
        id
    };
    let mut last: Option<OperationId> = None;
    let (mut live_peak, mut rss_warm) = (0, 0);
    for i in 0..DIAMONDS {
        let head: Vec<_> = last.into_iter().collect();
        let a = run(OperationType::MemoryTransfer, &head, 0);
        let b = run(OperationType::Kernel, &[a], 1);
        let c = run(OperationType::Kernel, &[a], 2);
        let d = run(OperationType::Reduction, &[b, c], 0);
        last = Some(d);
        if i % 50 == 49 {
            coordinator.synchronize(d).unwrap();
        }
        if i % 1_000 == 0 {
            live_peak = live_peak.max(coordinator.live_operations());
        }
        if i == 2_500 {
            rss_warm = cuweave_test_support::resident_bytes();
        }
    }
    coordinator.synchronize(last.unwrap()).unwrap();
    coordinator.retire_finished();
    let rss_end = cuweave_test_support::resident_bytes();
    let counters = pool.counters();
    let created = counters.created_regular + counters.created_timing;
    let metrics = coordinator.metrics();
    eprintln!(
        "{} operations: live peak {live_peak}, {created} events created, rss {rss_warm} -> \
         {rss_end}, {} cross-stream waits",
        DIAMONDS * 4,
        metrics.cross_stream_waits
    );
    assert_eq!(metrics.registered, DIAMONDS * 4);
    assert_eq!(metrics.completed, DIAMONDS * 4);
    assert_eq!(coordinator.live_operations(), 0);
    assert!(live_peak <= 512, "{live_peak} operations live at once");
    assert!(created <= 512, "{created} events created");
    assert!(
        rss_end <= rss_warm + (8 << 20),
        "resident memory grew from {rss_warm} to {rss_end} bytes"
    );
}

/// A scheduler that closes a cycle by mistake (`add_dependency`) is told which cycle when it
/// tries to begin an operation of it, and `wait_until_ready` says so at once, even when the
/// cycle is closed while it waits, instead of sleeping out its timeout. An operation that only
/// waits on the cycle gets the plain not-queued error.
#[test]
fn a_real_cycle_is_refused_with_the_cycle_named() {
    let gpu = require_gpu!();
    let stream = common::stream(&gpu.context);
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 0, 0).unwrap()).unwrap();
    let register = |deps: &[OperationId]| {
        coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                None,
                deps,
                "op",
            )
            .unwrap()
    };
    let a = register(&[]);
    let b = register(&[a]);
    let c = register(&[b]);
    let outside = register(&[c]);
    // A thread waits for `b` to become ready; the cycle is closed meanwhile.
    let waiting = coordinator.clone();
    let waited = std::thread::spawn(move || {
        let started = Instant::now();
        (
            waiting.wait_until_ready(b, Duration::from_secs(20)),
            started.elapsed(),
        )
    });
    std::thread::sleep(Duration::from_millis(20));
    coordinator.add_dependency(a, c).unwrap();
    let (result, took) = waited.join().unwrap();
    let cycle = vec![a, c, b];
    assert_eq!(
        result,
        Err(EventError::DependencyCycle {
            id: b,
            cycle: cycle.clone()
        })
    );
    assert!(
        took < Duration::from_secs(5),
        "wait_until_ready slept {took:?}"
    );
    assert_eq!(coordinator.detect_deadlocks(), vec![cycle.clone()]);
    for member in [a, b, c] {
        let refused = coordinator.begin_operation(member, &stream);
        assert_eq!(
            refused,
            Err(EventError::DependencyCycle {
                id: member,
                cycle: cycle.clone()
            })
        );
    }
    assert_eq!(
        coordinator.wait_until_ready(c, Duration::from_secs(20)),
        Err(EventError::DependencyCycle {
            id: c,
            cycle: cycle.clone()
        })
    );
    assert_eq!(
        coordinator.begin_operation(outside, &stream),
        Err(EventError::DependencyNotQueued {
            id: outside,
            dependency: c
        })
    );
    // Nothing was begun, nothing queued on the stream.
    assert_eq!(coordinator.metrics().begun, 0);
    assert!(stream.query().unwrap());
}

/// A barrier over four streams: each stream spins a different time, then writes its own
/// region; after `wait_on_device`, a kernel on every stream reads all four regions and finds
/// none unwritten; the barrier is reused for a second round. The control round without the
/// barrier shows the check can fail.
#[test]
fn after_a_barrier_every_stream_sees_every_other_streams_bytes_round_after_round() {
    const STREAMS: usize = 4;
    const REGION: usize = 1 << 14;
    let gpu = require_gpu!();
    let _serial = serial();
    if cuweave_test_support::skip_under_sanitizer(
        "after_a_barrier_every_stream_sees_every_other_streams_bytes_round_after_round",
        "the control round needs streams to run at once",
    ) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let streams: Vec<_> = (0..STREAMS).map(|_| common::stream(&gpu.context)).collect();
    let barrier =
        CrossStreamBarrier::new(streams.clone(), EventPool::new(&gpu.context, 8, 0).unwrap())
            .unwrap();
    let data = DeviceAllocation::new(&gpu.context, STREAMS * REGION * 4).unwrap();
    let copies = DeviceAllocation::new(&gpu.context, STREAMS * STREAMS * REGION * 4).unwrap();
    let counts = DeviceAllocation::new(&gpu.context, STREAMS * 4).unwrap();
    let sums = DeviceAllocation::new(&gpu.context, STREAMS * 8).unwrap();
    let round = |value_base: u32, with_barrier: bool| -> (Vec<u32>, Vec<u64>) {
        // SAFETY: live allocations of this context, sized as written; no stream uses them now.
        unsafe {
            memory::memset_d32(&gpu.context, data.ptr(), SENTINEL, STREAMS * REGION).unwrap();
            memory::memset_d32(&gpu.context, counts.ptr(), 0, STREAMS).unwrap();
            memory::memset_d32(&gpu.context, sums.ptr(), 0, STREAMS * 2).unwrap();
        }
        for (i, stream) in streams.iter().enumerate() {
            kernels
                .spin_ns(stream, (STREAMS - i) as u64 * 5 * MS)
                .unwrap();
            let region = data.ptr() + (i * REGION * 4) as u64;
            // SAFETY: stream i's region of `data`.
            unsafe {
                kernels
                    .fill_u32(stream, region, value_base + i as u32, REGION)
                    .unwrap()
            };
        }
        if with_barrier {
            let info = barrier.queue().unwrap();
            assert_eq!((info.streams, info.waits), (STREAMS, 2 * (STREAMS - 1)));
        }
        for (j, stream) in streams.iter().enumerate() {
            let out = copies.ptr() + (j * STREAMS * REGION * 4) as u64;
            // SAFETY: all of `data`, stream j's slice of `copies`, its counter and sum.
            unsafe {
                event_kernels
                    .transform_checked_u32(
                        stream,
                        data.ptr(),
                        out,
                        STREAMS * REGION,
                        1,
                        0,
                        SENTINEL,
                        counts.ptr() + 4 * j as u64,
                    )
                    .unwrap();
                kernels
                    .checksum_u32(stream, out, STREAMS * REGION, sums.ptr() + 8 * j as u64)
                    .unwrap();
            }
        }
        barrier.synchronize().unwrap();
        let sums = (0..STREAMS)
            .map(|j| read_u64(&gpu, sums.ptr() + 8 * j as u64))
            .collect();
        (read_u32s(&gpu, counts.ptr(), STREAMS), sums)
    };
    for base in [1, 101] {
        let (unwritten, sums) = round(base, true);
        assert_eq!(
            unwritten,
            vec![0; STREAMS],
            "round {base}: a stream ran ahead"
        );
        let expected = (0..STREAMS as u64)
            .map(|i| (u64::from(base) + i) * REGION as u64)
            .sum::<u64>();
        assert_eq!(sums, vec![expected; STREAMS], "round {base}");
    }
    let (unwritten, _) = round(1, false);
    assert!(
        unwritten[STREAMS - 1] > 0,
        "without the barrier the shortest stream still saw every region: {unwritten:?}"
    );
}

/// Callback users: many events on several streams behind a closed gate, half cancelled before
/// the gate opens (those never run), the rest run exactly once; events recorded on a stream
/// that is dropped before they complete still complete, after the work.
#[test]
fn callbacks_on_many_events_cancel_cleanly_and_events_outlive_their_stream() {
    const STREAMS: usize = 8;
    const PER_STREAM: usize = 32;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 0, 0).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let gate = Flags::new(&gpu.context, 1);
    let streams: Vec<_> = (0..STREAMS).map(|_| common::stream(&gpu.context)).collect();
    let runs: Arc<Vec<AtomicUsize>> = Arc::new(
        (0..STREAMS * PER_STREAM)
            .map(|_| AtomicUsize::new(0))
            .collect(),
    );
    let mut ids = Vec::new();
    for (s, stream) in streams.iter().enumerate() {
        // SAFETY: mapped gate of this context, opened below (a 5 s timeout as a safety net).
        unsafe {
            kernels
                .wait_u32(stream, gate.device(0), 1, 5_000 * MS)
                .unwrap()
        };
        for k in 0..PER_STREAM {
            let slot = s * PER_STREAM + k;
            let event = pool.acquire_owned(false).unwrap();
            event.record(stream).unwrap();
            let runs = Arc::clone(&runs);
            ids.push(waiter.wait_async(event, move |result| {
                assert_eq!(result, Ok(()));
                runs[slot].fetch_add(1, Ordering::SeqCst);
            }));
        }
    }
    for id in ids.iter().step_by(2) {
        assert!(
            waiter.cancel_wait(*id),
            "{id} was not pending behind the gate"
        );
    }
    // Events of a stream dropped before its work finishes.
    let flags = Arc::new(Flags::new(&gpu.context, 1));
    let (tx, rx) = mpsc::channel();
    {
        let doomed = common::stream(&gpu.context);
        // SAFETY: mapped flag of this context, alive for the test.
        unsafe {
            kernels
                .spin_then_store_u32(&doomed, 20 * MS, flags.device(0), 9)
                .unwrap()
        };
        let event = pool.acquire_owned(false).unwrap();
        event.record(&doomed).unwrap();
        let seen = Arc::clone(&flags);
        waiter.wait_async(event, move |result| {
            tx.send((result, seen.read(0))).unwrap();
        });
    }
    gate.write(0, 1);
    let (result, flag) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(
        (result, flag),
        (Ok(()), 9),
        "the callback ran before the dropped stream's work"
    );
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while waiter.pending() > 0 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(waiter.pending(), 0);
    for (i, id) in ids.iter().enumerate() {
        let expected = usize::from(i % 2 == 1);
        assert_eq!(runs[i].load(Ordering::SeqCst), expected, "{id}");
        assert!(!waiter.cancel_wait(*id), "{id} cancelled after it ended");
    }
    let stats = waiter.stats();
    let half = (STREAMS * PER_STREAM / 2) as u64;
    assert_eq!((stats.cancelled, stats.completed), (half, half + 1));
}

/// `torch.cuda.Event` habits on pooled events: record, query while pending, wait on another
/// stream (a kernel there sees the first stream's bytes), synchronize, elapsed time; elapsed
/// time before completion or without timing is a typed error; an event is awaitable too.
#[test]
fn pooled_events_behave_like_torch_cuda_events() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 2, 2).unwrap();
    let (producer, consumer) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let flags = Flags::new(&gpu.context, 2);
    let start = pool.acquire_event(true).unwrap();
    let end = pool.acquire_event(true).unwrap();
    start.record(&producer).unwrap();
    // SAFETY: mapped flags of this context, alive until both streams are synchronized.
    unsafe {
        kernels
            .spin_then_store_u32(&producer, 30 * MS, flags.device(0), 1)
            .unwrap()
    };
    end.record(&producer).unwrap();
    assert!(!end.query().unwrap(), "a 30 ms kernel finished at once");
    assert!(matches!(
        start.elapsed_ms(&end),
        Err(DriverError::Cuda { .. })
    ));
    consumer.wait_event(&end).unwrap();
    // SAFETY: as above.
    unsafe {
        event_kernels
            .count_flags_u32(&consumer, flags.device(0), 1, 1, flags.device(1))
            .unwrap()
    };
    end.synchronize().unwrap();
    assert!(end.query().unwrap());
    assert_eq!(flags.read(0), 1);
    let ms = start.elapsed_ms(&end).unwrap();
    assert!(
        (29.0..2_000.0).contains(&ms),
        "elapsed {ms} ms for a 30 ms kernel"
    );
    consumer.synchronize().unwrap();
    assert_eq!(
        flags.read(1),
        1,
        "the consumer ran before the producer's store"
    );

    let (plain_a, plain_b) = (
        pool.acquire_event(false).unwrap(),
        pool.acquire_event(false).unwrap(),
    );
    plain_a.record(&producer).unwrap();
    plain_b.record(&producer).unwrap();
    assert!(matches!(
        plain_a.elapsed_ms(&plain_b),
        Err(DriverError::InvalidArgument { .. })
    ));
    // Awaited like `torch.cuda.Event` in an async program.
    kernels.spin_ns(&producer, 5 * MS).unwrap();
    let awaited = pool.acquire_owned(true).unwrap();
    awaited.record(&producer).unwrap();
    smol::block_on(cuweave_event::event_done(awaited).unwrap()).unwrap();
    assert!(producer.query().unwrap());
}

/// The same coordinator completion awaited under `futures::executor::block_on`, smol and
/// tokio: each resolves only after its kernel's store.
#[test]
fn completion_futures_resolve_after_the_work_under_every_executor() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 2, 0).unwrap()).unwrap();
    let stream = common::stream(&gpu.context);
    let flags = Arc::new(Flags::new(&gpu.context, 3));
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for executor in 0..3usize {
        let op = coordinator
            .register_operation(OperationType::Kernel, EventPriority::High, None, &[], "x")
            .unwrap();
        coordinator.begin_operation(op, &stream).unwrap();
        // SAFETY: mapped flag of this context, alive for the test.
        unsafe {
            kernels
                .spin_then_store_u32(&stream, 20 * MS, flags.device(executor), 1)
                .unwrap()
        };
        coordinator.complete_operation(op).unwrap();
        let future = coordinator.completion(op).unwrap();
        let seen = Arc::clone(&flags);
        let check = async move {
            future.await.unwrap();
            seen.read(executor)
        };
        let flag = match executor {
            0 => futures::executor::block_on(check),
            1 => smol::block_on(check),
            _ => tokio.block_on(check),
        };
        assert_eq!(
            flag, 1,
            "executor {executor}: resolved before the kernel's store"
        );
    }
}

/// Counts panics on reactor threads (the hook is process-wide, installed once, and hands every
/// panic on to the previous hook).
static REACTOR_PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_reactor_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some("cuweave-event-reactor") {
                REACTOR_PANICS.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    });
}

/// The calling thread's id when it is a reactor thread (callbacks can also run on a thread
/// that observed the completion itself).
fn reactor_tid() -> Option<u64> {
    (std::thread::current().name() == Some("cuweave-event-reactor"))
        .then(current_tid)
        .flatten()
}

/// Waits until thread `tid` of this process has exited, at most `limit`.
fn thread_exits(tid: u64, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if !std::path::Path::new(&format!("/proc/self/task/{tid}")).exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// A completion callback that owns a clone of the coordinator (to schedule the next stage),
/// or of the waiter (to chain a wait), holds the last handle once the caller drops its own:
/// the coordinator, and its waiter, are then dropped on the reactor thread. That must stop the
/// reactor cleanly, not make it join itself (a panic, or an abort under `panic = "abort"`);
/// a future still pending on that waiter resolves with `WaiterShutDown` instead of hanging.
#[test]
fn a_callback_owning_the_last_handle_stops_the_reactor_without_a_panic() {
    let gpu = require_gpu!();
    let _serial = serial();
    count_reactor_panics();
    let panics_before = REACTOR_PANICS.load(Ordering::SeqCst);
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 2, 0).unwrap();
    let flags = Arc::new(Flags::new(&gpu.context, 2));
    let (stream, slow) = (common::stream(&gpu.context), common::stream(&gpu.context));

    // The coordinator's callback keeps a clone of it.
    let coordinator = OperationCoordinator::new(pool.clone()).unwrap();
    let op = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            None,
            &[],
            "stage",
        )
        .unwrap();
    coordinator.begin_operation(op, &stream).unwrap();
    // SAFETY: mapped flags of this context, alive past both streams' last use.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, 20 * MS, flags.device(0), 1)
            .unwrap()
    };
    coordinator.complete_operation(op).unwrap();
    let (tx, rx) = mpsc::channel();
    let next_stage = coordinator.clone();
    let seen = Arc::clone(&flags);
    coordinator
        .on_complete(op, move |id, result| {
            // Scheduling the next stage would use `next_stage` here.
            let _ = next_stage.pool().utilization();
            tx.send((id, result, seen.read(0), reactor_tid())).unwrap();
        })
        .unwrap();
    drop(coordinator);
    let (id, result, flag, tid) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!((id, result, flag), (op, Ok(()), 1));
    if let Some(tid) = tid {
        assert!(
            thread_exits(tid, Duration::from_secs(5)),
            "the reactor kept running after its coordinator was dropped"
        );
    }
    assert_eq!(
        REACTOR_PANICS.load(Ordering::SeqCst),
        panics_before,
        "dropping the coordinator on its reactor thread panicked"
    );

    // The waiter's callback keeps an `Arc` of it; another future waits on slower work.
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    kernels.spin_ns(&slow, 300 * MS).unwrap();
    let pending = waiter.stream_idle(&slow).unwrap();
    // SAFETY: as above.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, 10 * MS, flags.device(1), 1)
            .unwrap()
    };
    let event = pool.acquire_owned(false).unwrap();
    event.record(&stream).unwrap();
    let (tx, rx) = mpsc::channel();
    let chained = Arc::clone(&waiter);
    waiter.wait_async(event, move |result| {
        let _ = chained.pending();
        tx.send((result, reactor_tid())).unwrap();
    });
    drop(waiter);
    let (result, tid) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(result, Ok(()));
    let outcome = within(Duration::from_secs(5), move || {
        futures::executor::block_on(pending)
    });
    assert_eq!(outcome, Err(EventError::WaiterShutDown));
    if let Some(tid) = tid {
        assert!(thread_exits(tid, Duration::from_secs(5)));
    }
    assert_eq!(
        REACTOR_PANICS.load(Ordering::SeqCst),
        panics_before,
        "dropping the waiter on its reactor thread panicked"
    );
    slow.synchronize().unwrap();
    stream.synchronize().unwrap();
}

/// A pipeline scheduler takes its streams from a `StreamPool` (as `begin_on_pool` does) and
/// needs a barrier across them: the barrier takes pool streams as they come, and after it a
/// kernel on each sees every other stream's flag.
#[test]
fn a_barrier_spans_the_streams_a_stream_pool_hands_out() {
    use cuweave_stream::{StreamPool, StreamPoolConfig};
    const STREAMS: usize = 3;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let streams_pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let streams: Vec<_> = streams_pool.streams().take(STREAMS).cloned().collect();
    let barrier = CrossStreamBarrier::from_streams(
        streams.clone(),
        EventPool::new(&gpu.context, 4, 0).unwrap(),
    )
    .unwrap();
    assert_eq!(barrier.streams().len(), STREAMS);
    let flags = Flags::new(&gpu.context, 2 * STREAMS);
    for (i, stream) in streams.iter().enumerate() {
        // SAFETY: mapped flags of this context, alive until the barrier's synchronize.
        unsafe {
            kernels
                .spin_then_store_u32(
                    stream.stream(),
                    (STREAMS - i) as u64 * 5 * MS,
                    flags.device(i),
                    1,
                )
                .unwrap()
        };
    }
    barrier.wait_on_device().unwrap();
    for (j, stream) in streams.iter().enumerate() {
        // SAFETY: as above.
        unsafe {
            event_kernels
                .count_flags_u32(
                    stream.stream(),
                    flags.device(0),
                    STREAMS,
                    1,
                    flags.device(STREAMS + j),
                )
                .unwrap()
        };
    }
    barrier.synchronize().unwrap();
    let counts: Vec<u32> = (0..STREAMS).map(|j| flags.read(STREAMS + j)).collect();
    assert_eq!(
        counts,
        vec![STREAMS as u32; STREAMS],
        "a pool stream ran ahead of the barrier"
    );
}
