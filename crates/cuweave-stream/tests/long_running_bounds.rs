//! Long-running bounds of the stream layer's per-stream state under a new stream per request,
//! the loop a server that runs for days makes: the callback worker thread each stream starts on
//! its first callback, and the GPU timer's per-stream queues of pending spans.
//!
//! Each test runs its loop thousands of times and asserts what is public: the process's thread
//! count (`/proc/self/task`, Linux only) and `GpuTimer::pending` / `skipped`. The timer's map of
//! per-stream queues itself has no public size; its bound follows from `pending() == 0` only
//! because `harvest` drops empty queues (`timing.rs`). Each test takes a few seconds at most on
//! an H200.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cuweave_driver::EventPool;
use cuweave_stream::{GpuTimer, PriorityStream, StreamPriority};
use cuweave_test_support::{require_gpu, serial};

const REQUESTS: usize = 2000;

/// Structure: one callback worker thread per `PriorityStream` (`stream/callback.rs`,
/// `CallbackWorker`), started by the stream's first callback and ended once the stream and its
/// queued relays are gone. Loop: a request makes its own stream, queues one callback, waits for
/// it and drops the stream, 2000 times. Expected bound: the live workers are those of live
/// streams, so the process's thread count comes back to where it started.
#[test]
#[cfg(target_os = "linux")]
fn a_callback_on_a_new_stream_per_request_leaves_no_worker_thread_behind() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ran = Arc::new(AtomicUsize::new(0));
    // One stream with a callback first, so that lazily started process threads (the driver's)
    // are counted in the baseline.
    let warm = PriorityStream::new(&gpu.context, StreamPriority::Normal).expect("stream");
    warm.add_callback(|| {}).expect("callback");
    warm.synchronize().expect("sync");
    drop(warm);
    std::thread::sleep(Duration::from_millis(50));
    let before = cuweave_test_support::process_threads();
    let mut most = before;
    for request in 0..REQUESTS {
        let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).expect("stream");
        let ran = Arc::clone(&ran);
        stream
            .add_callback(move || {
                ran.fetch_add(1, Ordering::SeqCst);
            })
            .expect("callback");
        stream.synchronize().expect("sync");
        drop(stream);
        if request % 100 == 0 {
            most = most.max(cuweave_test_support::process_threads());
        }
    }
    // The worker ends on its own thread once its channel closes: give the last ones a moment.
    cuweave_test_support::poll_until(Duration::from_secs(10), || {
        cuweave_test_support::process_threads() <= before + 4
    });
    cuweave_test_support::poll_until(Duration::from_secs(10), || {
        ran.load(Ordering::SeqCst) >= REQUESTS
    });
    assert_eq!(
        ran.load(Ordering::SeqCst),
        REQUESTS,
        "every callback ran once"
    );
    let after = cuweave_test_support::process_threads();
    assert!(
        after <= before + 4,
        "{before} threads before {REQUESTS} requests, {after} after (most seen {most}): \
         callback workers of dropped streams are still alive"
    );
    assert!(
        most <= before + 64,
        "{most} threads at once during the loop ({before} before)"
    );
}

/// Structure: `GpuTimer`'s pending spans, one queue per stream id (`timing.rs`, `Pending::streams`),
/// removed by `harvest` once empty. Loop: one shared timer times a span of work on each request's
/// own new stream, harvested every 16 requests, 4000 requests. Expected bound: after the work has
/// finished and a harvest ran, nothing is pending; no span was skipped; every span was read once.
#[test]
fn a_timer_shared_by_a_new_stream_per_request_holds_nothing_after_harvest() {
    let gpu = require_gpu!();
    let _serial = serial();
    const TIMED: usize = 4000;
    let pool = EventPool::for_context(&gpu.context).expect("pool");
    let timer: GpuTimer<usize> = GpuTimer::with_capacity(pool, 256);
    let mut read = vec![0u32; TIMED];
    let mut most_pending = 0;
    for request in 0..TIMED {
        let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).expect("stream");
        let start = timer.start(stream.stream()).expect("start");
        assert!(start.is_some(), "request {request}: the timer was full");
        timer
            .finish(start, stream.stream(), request)
            .expect("finish");
        stream.synchronize().expect("sync");
        drop(stream);
        most_pending = most_pending.max(timer.pending());
        if request % 16 == 15 {
            timer.harvest(|tag, _, _| read[tag] += 1).expect("harvest");
            assert_eq!(
                timer.pending(),
                0,
                "request {request}: finished spans of dropped streams are still pending"
            );
        }
    }
    timer.harvest(|tag, _, _| read[tag] += 1).expect("harvest");
    assert_eq!(timer.pending(), 0);
    assert_eq!(timer.skipped(), 0);
    assert!(most_pending <= 16, "{most_pending} spans pending at once");
    assert!(
        read.iter().all(|&count| count == 1),
        "a span was read {} times, another {} times",
        read.iter().max().unwrap(),
        read.iter().min().unwrap()
    );
}
