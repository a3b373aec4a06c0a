//! The event layer against the raw driver calls and wake-up paths it competes with.
//!
//! | group | timed, per iteration |
//! |---|---|
//! | `event_pool` | `EventPool::acquire_event` + drop (borrowed handle; regular, timing) and `acquire_owned` + drop beside raw `cuEventCreate` + `cuEventDestroy_v2` (`DISABLE_TIMING`) |
//! | `wake_round_trip` | launch an empty kernel, then wait until the waiting code runs: `spin_sync` (`cuStreamSynchronize`), `blocking_sync_event` (`cuEventRecord` + `cuEventSynchronize` on a `BLOCKING_SYNC` event), and a `WaitFuture` awaited with `futures::executor::block_on` for each `WakeMechanism` (`host_func`, `event_query`, `completion_word`), plus `completion_word_busy_poll` (the same future polled in a loop: the reactor's latency without the executor's park/unpark) |
//! | `pending_waits_10k` | 10 000 `stream_idle` futures behind a GPU gate, the gate opened, all awaited (one reactor thread serves them) |
//! | `coordinator_per_op` | `OperationCoordinator` register + begin + complete of one operation depending on the one before (one stream; finished work retires), untimed (the default) and `_timed`, beside the raw calls they make: `raw/cuEventRecord` (one plain completion event) and `raw/cuEventRecord_x2` (two timing events) |
//!
//! `completion_word_spin_20us` is the same `block_on` with `WaitFuture::spin_before_park(20 µs)`.
//!
//! `wake_round_trip` also prints p50 / p99 per case over every iteration it timed, and the run
//! ends with the CPU time an idle waiter used over one second, and the CPU time of the whole
//! process while one `stream_idle` wait of one second is pending (the reactor parks). Run with
//! `cargo bench -p cuweave-benches --bench event`.

use std::hint::black_box;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use criterion::Criterion;
use cuweave_benches::{Gpu, slow_group};
use cuweave_driver::memory::MappedWords;
use cuweave_driver::{Event, EventFlags, Stream, StreamFlags, driver, sys};
use cuweave_event::{
    AsyncEventWaiter, EventPool, EventPriority, OperationCoordinator, OperationType, WaitFuture,
    WaitOptions, WakeMechanism,
};
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;

fn main() {
    cuweave_benches::run("event", |c, gpu| {
        pool(c, gpu);
        wake_round_trip(c, gpu);
        pending_waits(c, gpu);
        coordinator_per_op(c, gpu);
        idle_waiter_cpu();
        one_second_wait_cpu(gpu);
    });
}

fn coordinator_per_op(c: &mut Criterion, gpu: &Gpu) {
    let stream = Arc::new(Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("stream"));
    let pool = EventPool::new(&gpu.context, 0, 0).expect("pool");
    let coordinator = OperationCoordinator::new(pool.clone()).expect("coordinator");
    let mut previous = None;
    let mut group = c.benchmark_group("coordinator_per_op");
    // Untimed (the default) first, then with GPU timing on.
    for (name, timing) in [
        ("cuweave/register_begin_complete", false),
        ("cuweave/register_begin_complete_timed", true),
    ] {
        coordinator.set_timing(timing);
        group.bench_function(name, |b| {
            b.iter(|| {
                let deps: Vec<_> = previous.into_iter().collect();
                let id = coordinator
                    .register_operation(
                        OperationType::Kernel,
                        EventPriority::Normal,
                        None,
                        &deps,
                        "op",
                    )
                    .expect("register");
                coordinator.begin_operation(id, &stream).expect("begin");
                coordinator.complete_operation(id).expect("complete");
                previous = Some(id);
            });
        });
    }
    let api = driver().expect("driver loaded");
    let record = api.event_record.get().expect("cuEventRecord");
    let (start, done) = (
        Event::new(&gpu.context, EventFlags::TIMING).expect("event"),
        Event::new(&gpu.context, EventFlags::TIMING).expect("event"),
    );
    let plain = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).expect("event");
    group.bench_function("raw/cuEventRecord", |b| {
        gpu.context.bind_to_thread().expect("bind the context");
        b.iter(|| {
            // SAFETY: live event and stream of the current context.
            let code = unsafe { record(plain.as_raw(), stream.as_raw()) };
            assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
        });
    });
    group.bench_function("raw/cuEventRecord_x2", |b| {
        gpu.context.bind_to_thread().expect("bind the context");
        b.iter(|| {
            for event in [&start, &done] {
                // SAFETY: live event and stream of the current context.
                let code = unsafe { record(event.as_raw(), stream.as_raw()) };
                assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
            }
        });
    });
    group.finish();
    stream.synchronize().expect("synchronize");
    coordinator.retire_finished();
    let counters = pool.counters();
    let metrics = coordinator.metrics();
    println!(
        "coordinator_per_op: {} operations, {} live after the run, events created: {} regular + {} timing",
        metrics.completed,
        coordinator.live_operations(),
        counters.created_regular,
        counters.created_timing
    );
}

/// The process's CPU time while one `stream_idle` wait of one second is pending: the reactor
/// spins for tens of microseconds, then sleeps until the GPU gets there.
fn one_second_wait_cpu(gpu: &Gpu) {
    let kernels = TestKernels::load(&gpu.context).expect("load kernels");
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("stream");
    let waiter = AsyncEventWaiter::new().expect("waiter");
    kernels.spin_ns(&stream, 5_000_000).expect("warm-up spin");
    futures::executor::block_on(waiter.stream_idle(&stream).expect("stream_idle")).expect("wait");
    kernels.spin_ns(&stream, 1_000_000_000).expect("spin");
    let started = Instant::now();
    let before = process_cpu_ticks();
    futures::executor::block_on(waiter.stream_idle(&stream).expect("stream_idle")).expect("wait");
    let after = process_cpu_ticks();
    if let (Some(before), Some(after)) = (before, after) {
        let waited = started.elapsed();
        println!(
            "one pending 1 s wait: {} CPU ticks (1 tick = 10 ms) used by the whole process over {waited:?}: {:.1} % of a core (target <= 5 %)",
            after - before,
            (after - before) as f64 * 10.0 / waited.as_secs_f64() / 10.0
        );
    }
}

fn pool(c: &mut Criterion, gpu: &Gpu) {
    let api = driver().expect("driver loaded");
    let create = api.event_create.get().expect("cuEventCreate");
    let destroy = api.event_destroy.get().expect("cuEventDestroy_v2");
    let pool = EventPool::new(&gpu.context, 16, 16).expect("EventPool::new");
    let mut group = c.benchmark_group("event_pool");
    for (name, timing) in [("regular", false), ("timing", true)] {
        group.bench_function(format!("cuweave/acquire_release_{name}"), |b| {
            b.iter(|| drop(black_box(pool.acquire_event(timing).expect("acquire"))));
        });
    }
    group.bench_function("cuweave/acquire_owned_regular", |b| {
        b.iter(|| drop(black_box(pool.acquire_owned(false).expect("acquire"))));
    });
    group.bench_function("raw/cuEventCreate+cuEventDestroy", |b| {
        gpu.context.bind_to_thread().expect("bind the context");
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        b.iter(|| {
            let mut event = std::ptr::null_mut();
            // SAFETY: valid out-pointer and flags; the context is current on this thread.
            let code = unsafe { create(&mut event, flags) };
            assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
            // SAFETY: created just above, unused, destroyed once.
            let code = unsafe { destroy(black_box(event)) };
            assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
        });
    });
    group.finish();
}

/// Polls `future` in a loop with a no-op waker until it resolves (no park, no unpark).
fn busy_poll(mut future: WaitFuture) {
    let waker = futures::task::noop_waker();
    let mut cx = TaskContext::from_waker(&waker);
    loop {
        if let Poll::Ready(result) = std::pin::Pin::new(&mut future).poll(&mut cx) {
            result.expect("wait");
            return;
        }
        std::hint::spin_loop();
    }
}

use std::future::Future;

fn percentiles(samples: &mut [Duration]) -> (Duration, Duration) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    (at(0.50), at(0.99))
}

fn wake_round_trip(c: &mut Criterion, gpu: &Gpu) {
    let kernels = EventKernels::load(&gpu.context).expect("load kernels");
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("stream");
    let waiter = AsyncEventWaiter::new().expect("waiter");
    let blocking = Event::new(
        &gpu.context,
        EventFlags::DISABLE_TIMING.with_blocking_sync(),
    )
    .expect("blocking-sync event");
    let mut group = c.benchmark_group("wake_round_trip");
    let mut report = Vec::new();
    type Case<'a> = (&'a str, Box<dyn Fn() + 'a>);
    let future_case = |mechanism| {
        let (stream, waiter, kernels) = (&stream, &waiter, &kernels);
        Box::new(move || {
            kernels.noop(stream).expect("launch");
            let future = waiter
                .stream_idle_with(stream, WaitOptions::new(mechanism))
                .expect("stream_idle");
            futures::executor::block_on(future).expect("wait");
        }) as Box<dyn Fn()>
    };
    let cases: Vec<Case<'_>> = vec![
        (
            "spin_sync",
            Box::new(|| {
                kernels.noop(&stream).expect("launch");
                stream.synchronize().expect("sync");
            }),
        ),
        (
            "blocking_sync_event",
            Box::new(|| {
                kernels.noop(&stream).expect("launch");
                blocking.record(&stream).expect("record");
                blocking.synchronize().expect("sync");
            }),
        ),
        ("host_func", future_case(WakeMechanism::HostFunction)),
        ("event_query", future_case(WakeMechanism::EventQuery)),
        (
            "completion_word",
            future_case(WakeMechanism::CompletionWord),
        ),
        (
            "completion_word_spin_20us",
            Box::new(|| {
                kernels.noop(&stream).expect("launch");
                let future = waiter.stream_idle(&stream).expect("stream_idle");
                futures::executor::block_on(future.spin_before_park(Duration::from_micros(20)))
                    .expect("wait");
            }),
        ),
        (
            "completion_word_busy_poll",
            Box::new(|| {
                kernels.noop(&stream).expect("launch");
                busy_poll(waiter.stream_idle(&stream).expect("stream_idle"));
            }),
        ),
    ];
    for (name, case) in &cases {
        let mut samples: Vec<Duration> = Vec::new();
        group.bench_function(*name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let started = Instant::now();
                    case();
                    let took = started.elapsed();
                    samples.push(took);
                    total += took;
                }
                total
            });
        });
        if samples.is_empty() {
            // Filtered out (`--bench <filter>`): criterion ran no iteration of it.
            continue;
        }
        let (p50, p99) = percentiles(&mut samples);
        report.push(format!(
            "wake_round_trip/{name}: p50 {:.1} us, p99 {:.1} us over {} round trips",
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            samples.len()
        ));
    }
    group.finish();
    for line in report {
        println!("{line}");
    }
}

fn pending_waits(c: &mut Criterion, gpu: &Gpu) {
    // A stream's queue holds about a thousand operations before the driver blocks the host, so
    // the completion-word waits are spread over 20 streams; half the waits are futures on one
    // event.
    const STREAMS: usize = 20;
    const PER_STREAM: usize = 250;
    const ON_EVENT: usize = 5_000;
    let kernels = TestKernels::load(&gpu.context).expect("load kernels");
    let streams: Vec<Stream> = (0..STREAMS)
        .map(|_| Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("stream"))
        .collect();
    let pool = EventPool::new(&gpu.context, 1, 0).expect("pool");
    let waiter = AsyncEventWaiter::new().expect("waiter");
    let gate = Arc::new(MappedWords::new(&gpu.context, 1).expect("gate word"));
    let gate_address = gate.device_address(0).expect("word 0");
    let mut group = c.benchmark_group("pending_waits_10k");
    slow_group(&mut group, Duration::from_secs(3));
    let mut round = 0u32;
    group.bench_function("5k_words_5k_event/open_gate_to_all_woken", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                round += 1;
                let mut futures = Vec::with_capacity(STREAMS * PER_STREAM + ON_EVENT);
                for stream in &streams {
                    // SAFETY: the gate word is mapped pinned memory of this context that
                    // outlives the stream's work (awaited below); the host writes it only
                    // with atomic stores, and the kernel reads its low 32 bits.
                    unsafe {
                        kernels
                            .wait_u32(stream, gate_address, round, 2_000_000_000)
                            .expect("gate")
                    };
                    for _ in 0..PER_STREAM {
                        futures.push(waiter.stream_idle(stream).expect("stream_idle"));
                    }
                }
                let event = Arc::new(pool.acquire_owned(false).expect("event"));
                event.record(&streams[0]).expect("record");
                for _ in 0..ON_EVENT {
                    futures.push(waiter.event_done(Arc::clone(&event)));
                }
                assert_eq!(waiter.pending(), STREAMS * PER_STREAM + ON_EVENT);
                let started = Instant::now();
                gate.store(0, u64::from(round));
                let results = futures::executor::block_on(futures::future::join_all(futures));
                total += started.elapsed();
                assert!(results.iter().all(Result::is_ok), "a wait failed");
                assert_eq!(waiter.pending(), 0, "a wait was lost");
            }
            total
        });
    });
    group.finish();
    let stats = waiter.stats();
    println!(
        "pending_waits_10k: {} registered, {} completed, {} failed, {} pending",
        stats.registered, stats.completed, stats.failed, stats.pending
    );
}

/// User + system CPU ticks of this process, from /proc (Linux).
fn process_cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

fn idle_waiter_cpu() {
    let waiter = AsyncEventWaiter::new().expect("waiter");
    std::thread::sleep(Duration::from_millis(100));
    let before = process_cpu_ticks();
    std::thread::sleep(Duration::from_secs(1));
    let after = process_cpu_ticks();
    if let (Some(before), Some(after)) = (before, after) {
        println!(
            "idle waiter: {} CPU ticks (1 tick = 10 ms) used by the whole process over 1 s",
            after - before
        );
    }
    drop(waiter);
}
