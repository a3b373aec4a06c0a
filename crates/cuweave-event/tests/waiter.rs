//! GPU tests of async waiting: futures under three executors and every wake mechanism,
//! callbacks, cancellation races, timeouts, drop and forget mid-flight.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Flags, MS, within};
use cuweave_event::{AsyncEventWaiter, EventError, EventPool, WaitOptions, WakeMechanism};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};
use rstest::rstest;

const MECHANISMS: [WakeMechanism; 3] = [
    WakeMechanism::CompletionWord,
    WakeMechanism::EventQuery,
    WakeMechanism::HostFunction,
];

#[derive(Debug, Clone, Copy)]
enum Executor {
    BlockOn,
    Tokio,
    Smol,
}

fn run_on<F: std::future::Future + Send + 'static>(executor: Executor, future: F) -> F::Output
where
    F::Output: Send + 'static,
{
    match executor {
        Executor::BlockOn => futures::executor::block_on(future),
        Executor::Tokio => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .build()
                .unwrap();
            runtime.block_on(async move { runtime_spawned(future).await })
        }
        Executor::Smol => smol::block_on(smol::spawn(future)),
    }
}

async fn runtime_spawned<F: std::future::Future + Send + 'static>(future: F) -> F::Output
where
    F::Output: Send + 'static,
{
    tokio::spawn(future).await.unwrap()
}

#[rstest]
fn a_future_completes_only_after_the_spin_kernel_before_it_ends(
    #[values(Executor::BlockOn, Executor::Tokio, Executor::Smol)] executor: Executor,
    #[values(
        WakeMechanism::CompletionWord,
        WakeMechanism::EventQuery,
        WakeMechanism::HostFunction
    )]
    mechanism: WakeMechanism,
) {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let stream = common::stream(&gpu.context);
    let flags = Arc::new(Flags::new(&gpu.context, 1));
    // SAFETY: the flag is mapped pinned memory of this context, alive until the stream is done.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, 30 * MS, flags.device(0), 7)
            .unwrap()
    };
    let options = WaitOptions::new(mechanism);
    let future = waiter.stream_idle_with(&stream, options).unwrap();
    assert_eq!(
        flags.read(0),
        0,
        "the spin ended before the test could check"
    );
    let seen = Arc::clone(&flags);
    let observed = run_on(executor, async move {
        future.await.unwrap();
        seen.read(0)
    });
    assert_eq!(
        observed, 7,
        "the future resolved before the kernel stored its flag"
    );
}

#[test]
fn an_event_future_resolves_when_the_gpu_reaches_the_event() {
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 1, 0).unwrap();
    let stream = common::stream(&gpu.context);
    let flags = Arc::new(Flags::new(&gpu.context, 1));
    // SAFETY: as above.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, 20 * MS, flags.device(0), 1)
            .unwrap()
    };
    let event = pool.acquire_owned(false).unwrap();
    event.record(&stream).unwrap();
    let future = cuweave_event::event_done(event).unwrap();
    futures::executor::block_on(future).unwrap();
    assert_eq!(flags.read(0), 1);
}

#[test]
fn a_future_polled_before_the_gpu_is_done_stays_pending_then_wakes() {
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let stream = common::stream(&gpu.context);
    let flags = Flags::new(&gpu.context, 1);
    // SAFETY: `flags` is mapped pinned memory of this context, alive until the stream is idle
    // (the test waits for that below), and read on the host with volatile reads.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, 20 * MS, flags.device(0), 1)
            .unwrap()
    };
    let mut future = waiter.stream_idle(&stream).unwrap();
    // Spurious polls with a no-op waker, then with a real task: the real one is woken.
    let noop = futures::task::noop_waker();
    for _ in 0..3 {
        let polled =
            std::pin::Pin::new(&mut future).poll(&mut std::task::Context::from_waker(&noop));
        assert!(polled.is_pending());
    }
    futures::executor::block_on(future).unwrap();
    // The work queued before the wait has finished. (Not `stream.query()`: the marker behind it,
    // a word write or a host function, may still be retiring when the future resolves.)
    assert_eq!(flags.read(0), 1);
}

use std::future::Future;

#[test]
fn a_timeout_is_reported_to_the_future_and_to_the_callback() {
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let pool = EventPool::new(&gpu.context, 1, 0).unwrap();
    let stream = common::stream(&gpu.context);
    kernels.spin_ns(&stream, 200 * MS).unwrap();
    let future = waiter
        .stream_idle_with(
            &stream,
            WaitOptions::new(WakeMechanism::CompletionWord).with_timeout(Duration::from_millis(20)),
        )
        .unwrap();
    let event = pool.acquire_owned(false).unwrap();
    event.record(&stream).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    waiter.wait_async_timeout(event, Duration::from_millis(20), move |result| {
        tx.send(result).unwrap();
    });
    let started = Instant::now();
    let result = futures::executor::block_on(future);
    assert!(
        matches!(result, Err(EventError::TimedOut { .. })),
        "{result:?}"
    );
    assert!(started.elapsed() < Duration::from_millis(150));
    let told = rx.recv_timeout(Duration::from_secs(1)).unwrap();
    assert!(matches!(told, Err(EventError::TimedOut { .. })), "{told:?}");
    assert!(!stream.query().unwrap(), "the spin should still be running");
    stream.synchronize().unwrap();
    assert_eq!(waiter.stats().timed_out, 2);
}

#[test]
fn cancellation_races_never_run_a_cancelled_callback_nor_lose_a_live_one() {
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let pool = EventPool::new(&gpu.context, 4, 0).unwrap();
    let stream = common::stream(&gpu.context);
    let (mut cancelled, mut ran) = (0, 0);
    for i in 0..3_000u64 {
        let runs = Arc::new(AtomicUsize::new(0));
        // A GPU delay of 0-15 µs and a host delay of 0-15 µs, so completion and cancellation
        // land in either order.
        kernels.spin_ns(&stream, (i * 7_919) % 15_000).unwrap();
        let event = pool.acquire_owned(false).unwrap();
        event.record(&stream).unwrap();
        let counter = Arc::clone(&runs);
        let id = waiter.wait_async(event, move |result| {
            result.unwrap();
            counter.fetch_add(1, Ordering::SeqCst);
        });
        let until = Instant::now() + Duration::from_nanos((i * 104_729) % 15_000);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
        let was_cancelled = waiter.cancel_wait(id);
        assert!(!waiter.cancel_wait(id), "cancelled twice");
        stream.synchronize().unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        while waiter.pending() > 0 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(waiter.pending(), 0);
        let runs = runs.load(Ordering::SeqCst);
        if was_cancelled {
            assert_eq!(runs, 0, "iteration {i}: a cancelled callback ran");
            cancelled += 1;
        } else {
            assert_eq!(runs, 1, "iteration {i}: a live callback was lost");
            ran += 1;
        }
    }
    eprintln!("cancellation race: {cancelled} cancelled, {ran} ran");
    assert!(cancelled > 0 && ran > 0, "the race never went both ways");
}

/// Queues 10 000 waits behind closed GPU gates: 5 000 completion-word waits spread over 20
/// streams (a stream's queue holds about a thousand operations before the driver blocks the
/// host, so one stream cannot take them all) and 5 000 futures on one gated event.
#[test]
fn ten_thousand_pending_waits_are_all_woken() {
    const STREAMS: usize = 20;
    const PER_STREAM: usize = 250;
    const ON_EVENT: usize = 5_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 1, 0).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let streams: Vec<_> = (0..STREAMS).map(|_| common::stream(&gpu.context)).collect();
    let gate = Flags::new(&gpu.context, 1);
    for stream in &streams {
        // SAFETY: mapped flag of this context; opened below, with a timeout as a safety net.
        unsafe {
            kernels
                .wait_u32(stream, gate.device(0), 1, 5_000 * MS)
                .unwrap()
        };
    }
    let mut futures = Vec::with_capacity(STREAMS * PER_STREAM + ON_EVENT);
    for stream in &streams {
        for _ in 0..PER_STREAM {
            futures.push(waiter.stream_idle(stream).unwrap());
        }
    }
    let event = Arc::new(pool.acquire_owned(false).unwrap());
    event.record(&streams[0]).unwrap();
    for _ in 0..ON_EVENT {
        futures.push(waiter.event_done(Arc::clone(&event)));
    }
    assert_eq!(waiter.pending(), 10_000);
    assert!(futures.iter().all(|future| !future.is_complete()));
    gate.write(0, 1);
    let started = Instant::now();
    let results = within(Duration::from_secs(10), move || {
        futures::executor::block_on(futures::future::join_all(futures))
    });
    eprintln!(
        "10 000 waits woken {:?} after the gate opened",
        started.elapsed()
    );
    assert!(results.iter().all(Result::is_ok));
    assert_eq!(waiter.stats().completed, 10_000);
    assert_eq!(waiter.pending(), 0);
}

#[rstest]
fn dropping_or_forgetting_a_future_mid_flight_keeps_the_gpu_write_safe(
    #[values(false, true)] forget: bool,
) {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = common::stream(&gpu.context);
    let waiter = AsyncEventWaiter::new().unwrap();
    kernels.spin_ns(&stream, 50 * MS).unwrap();
    let future = waiter.stream_idle(&stream).unwrap();
    if forget {
        std::mem::forget(future);
    } else {
        drop(future);
    }
    // Stopping the waiter drops its completion words while the stream's write is queued: the
    // memory must outlive the write (a freed target would fault the context).
    drop(waiter);
    stream.synchronize().unwrap();
    kernels.spin_ns(&stream, 1_000).unwrap();
    stream.synchronize().unwrap();
}

#[test]
fn reused_completion_words_never_complete_a_wait_early() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let stream = common::stream(&gpu.context);
    let flags = Flags::new(&gpu.context, 1);
    for round in 1..=200u32 {
        // Drop half the futures mid-flight so their words return through the zombie path.
        let dropped = waiter.stream_idle(&stream).unwrap();
        // SAFETY: mapped flag of this context, alive for the test.
        unsafe {
            kernels
                .spin_then_store_u32(&stream, 200_000, flags.device(0), round)
                .unwrap()
        };
        let kept = waiter.stream_idle(&stream).unwrap();
        drop(dropped);
        futures::executor::block_on(kept).unwrap();
        assert_eq!(
            flags.read(0),
            round,
            "round {round} completed before its kernel"
        );
    }
}

// An inference server makes a waiter per connection and drops it when the client leaves, while
// other requests' kernels keep the GPU busy: the drop (and freeing idle completion words) must
// not wait for that unrelated work, as a temporary buffer's drop must not.
#[test]
fn dropping_a_waiter_or_its_free_words_never_waits_for_an_unrelated_long_kernel() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let mine = common::stream(&gpu.context);
    let busy = common::stream(&gpu.context);
    for release_words_first in [true, false] {
        let waiter = AsyncEventWaiter::new().unwrap();
        // Completion words written and reached: the waiter's own work is over.
        for _ in 0..8 {
            kernels.spin_ns(&mine, 10_000).unwrap();
            futures::executor::block_on(waiter.stream_idle(&mine).unwrap()).unwrap();
        }
        kernels.spin_ns(&busy, 400 * MS).unwrap();
        let dropping = Instant::now();
        if release_words_first {
            waiter.release_free_words();
        }
        drop(waiter);
        assert!(
            dropping.elapsed() < Duration::from_millis(100),
            "release_words_first={release_words_first}: the drop waited {:?} for an unrelated kernel",
            dropping.elapsed()
        );
        assert_eq!(
            busy.query(),
            Ok(false),
            "the unrelated kernel ended already"
        );
        busy.synchronize().unwrap();
    }
    // What the drops left waits for the context only, and goes once it is idle.
    assert!(
        cuweave_test_support::poll_until(Duration::from_secs(10), || {
            cuweave_driver::memory::host_allocations_awaiting_free() == 0
        }),
        "the waiters' completion words were never freed"
    );
}

#[test]
fn dropping_the_waiter_cancels_callbacks_and_fails_futures() {
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 1, 0).unwrap();
    let stream = common::stream(&gpu.context);
    let waiter = AsyncEventWaiter::new().unwrap();
    kernels.spin_ns(&stream, 100 * MS).unwrap();
    let event = pool.acquire_owned(false).unwrap();
    event.record(&stream).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&runs);
    waiter.wait_async(event, move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    });
    let future = waiter.stream_idle(&stream).unwrap();
    drop(waiter);
    let result = futures::executor::block_on(future);
    assert_eq!(result, Err(EventError::WaiterShutDown));
    stream.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[test]
fn every_mechanism_serves_many_sequential_waits() {
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let stream = common::stream(&gpu.context);
    let flags = Flags::new(&gpu.context, 1);
    let mut round = 0u32;
    for mechanism in MECHANISMS {
        for _ in 0..200 {
            round += 1;
            // SAFETY: `flags` is mapped pinned memory of this context, alive past the stream's
            // last use (the loop waits for each store), and read on the host with volatile reads.
            unsafe {
                kernels
                    .spin_then_store_u32(&stream, 0, flags.device(0), round)
                    .unwrap()
            };
            let future = waiter
                .stream_idle_with(&stream, WaitOptions::new(mechanism))
                .unwrap();
            futures::executor::block_on(future).unwrap();
            // The store queued before the wait has landed. (Not `stream.query()`: the marker
            // behind it, a word write or a host function, may still be retiring; a host
            // function wakes the task from inside itself.)
            assert_eq!(flags.read(0), round, "{mechanism:?}, wait {round}");
        }
    }
}

/// Waits until `release` frees something (the reactor recycles a word just after its future
/// resolves), at most a second; returns what it freed.
fn released_within_a_second(mut release: impl FnMut() -> usize) -> usize {
    let start = Instant::now();
    loop {
        let bytes = release();
        if bytes > 0 || start.elapsed() > Duration::from_secs(1) {
            return bytes;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn unused_completion_words_are_freed_on_request_and_made_again_on_demand() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = common::stream(&gpu.context);
    let flags = Flags::new(&gpu.context, 1);
    let wait = |waiter: &AsyncEventWaiter, round: u32| {
        // SAFETY: `flags` is mapped pinned memory of this context, alive past the stream's last
        // use (each round waits for its store), and read on the host with volatile reads.
        unsafe {
            kernels
                .spin_then_store_u32(&stream, 0, flags.device(0), round)
                .unwrap()
        };
        let future = waiter
            .stream_idle_with(&stream, WaitOptions::new(WakeMechanism::CompletionWord))
            .unwrap();
        futures::executor::block_on(future).unwrap();
        assert_eq!(flags.read(0), round);
    };
    let waiter = AsyncEventWaiter::new().unwrap();
    assert_eq!(
        waiter.release_free_words(),
        0,
        "no chunk before the first wait"
    );
    for round in 1..=3 {
        wait(&waiter, round);
        // One 4 KiB page of words, lent once and returned, then freed; the next wait makes one
        // again.
        assert_eq!(
            released_within_a_second(|| waiter.release_free_words()),
            4096
        );
        assert_eq!(waiter.release_free_words(), 0);
    }
    // The global waiter's words are one of the process caches the driver empties.
    let global = AsyncEventWaiter::global().unwrap();
    wait(global, 4);
    assert!(released_within_a_second(cuweave_driver::empty_process_caches) >= 4096);
    wait(global, 5);
}
