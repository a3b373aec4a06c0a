//! Long-running bounds of the event layer under what a server that runs for days makes per
//! request: an `OperationCoordinator` (each with its own `AsyncEventWaiter` and reactor thread)
//! made and dropped per request, some of them dropped last by their own completion callback; and
//! waits of the global waiter on a new stream per request (its per-stream wake events and
//! completion words).
//!
//! Each test runs its loop hundreds to thousands of times and asserts what is public: the
//! process's thread count (`/proc/self/task`, Linux only), the event pool's `utilization` and
//! `counters`, and `AsyncEventWaiter::stats` / `pending`. The waiter's per-stream map of wake
//! events (`waiter/words.rs`, `WordSlab::wakes`, pruned past 256 entries) has no public size.
//! Each test takes a few seconds at most on an H200.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use cuweave_event::{
    AsyncEventWaiter, EventPool, EventPriority, OperationCoordinator, OperationType,
};
use cuweave_test_support::{require_gpu, serial};

/// Waits up to `limit` for the thread count to come back to `at_most`; the count then.
#[cfg(target_os = "linux")]
fn threads_settle(at_most: usize, limit: Duration) -> usize {
    cuweave_test_support::poll_until(limit, || cuweave_test_support::process_threads() <= at_most);
    cuweave_test_support::process_threads()
}

/// Structure: each `OperationCoordinator::new` makes an `AsyncEventWaiter` whose reactor thread
/// lives as long as the waiter, and the reactor's callback registry (`waiter/reactor.rs`,
/// `Shared::callbacks`). Loop: 600 requests each make a coordinator, run one operation on a new
/// stream, wait for it (half through a completion callback that owns a clone of the coordinator,
/// so the last handle drops on the reactor thread), and drop it. Expected bound: no reactor
/// thread outlives its coordinator, and the shared event pool ends with nothing in use and
/// only a handful of events ever made.
#[test]
#[cfg(target_os = "linux")]
fn a_coordinator_per_request_leaves_no_reactor_thread_and_no_event_behind() {
    let gpu = require_gpu!();
    let _serial = serial();
    const REQUESTS: usize = 600;
    let pool = EventPool::new(&gpu.context, 4, 0).expect("pool");
    let before = cuweave_test_support::process_threads();
    let mut most = before;
    for request in 0..REQUESTS {
        let coordinator = OperationCoordinator::new(pool.clone()).expect("coordinator");
        let stream = common::stream(&gpu.context);
        let op = coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                Some(&stream),
                &[],
                "request",
            )
            .expect("register");
        coordinator.begin_operation(op, &stream).expect("begin");
        coordinator.complete_operation(op).expect("complete");
        if request % 2 == 0 {
            let (tx, rx) = mpsc::channel();
            let owned = coordinator.clone();
            coordinator
                .on_complete(op, move |id, result| {
                    let live = owned.live_operations();
                    tx.send((id, result.is_ok(), live)).expect("send");
                })
                .expect("callback");
            drop(coordinator);
            let (id, ok, _) = rx
                .recv_timeout(Duration::from_secs(10))
                .expect("the completion callback ran");
            assert_eq!(id, op);
            assert!(ok, "request {request}: the operation failed");
        } else {
            coordinator.synchronize(op).expect("synchronize");
            assert_eq!(coordinator.live_operations(), 0, "request {request}");
            drop(coordinator);
        }
        if request % 50 == 0 {
            most = most.max(cuweave_test_support::process_threads());
        }
    }
    let after = threads_settle(before + 4, Duration::from_secs(10));
    assert!(
        after <= before + 4,
        "{before} threads before {REQUESTS} coordinators, {after} after (most seen {most}): \
         reactor threads of dropped coordinators are still alive"
    );
    assert!(
        most <= before + 64,
        "{most} threads at once ({before} before)"
    );
    cuweave_test_support::poll_until(Duration::from_secs(5), || pool.utilization().in_use == 0);
    assert_eq!(
        pool.utilization().in_use,
        0,
        "events of dropped coordinators are still out of the pool"
    );
    let counters = pool.counters();
    let made = counters.created_regular + counters.created_timing + counters.created_blocking;
    assert!(
        made <= 64,
        "{made} events made for {REQUESTS} sequential requests: {counters:?}"
    );
}

/// Structure: the global waiter's per-context completion-word slab, its per-stream wake events
/// (`waiter/words.rs`, `WordSlab::wakes`, keyed by stream id) and the reactor's registrations.
/// Loop: 3000 requests each await `stream_idle` on their own new stream (eight streams in flight
/// at a time), then drop the streams. Expected bound: every wait completes, nothing stays
/// registered, and the process's resident memory does not grow with the requests.
#[test]
fn global_waits_on_a_new_stream_per_request_all_complete_and_leave_nothing_registered() {
    let gpu = require_gpu!();
    let _serial = serial();
    const IN_FLIGHT: usize = 8;
    const BATCHES: usize = 3000 / IN_FLIGHT;
    let waiter = AsyncEventWaiter::global().expect("global waiter");
    let start = waiter.stats();
    let mut resident_after_warmup = 0;
    for batch in 0..BATCHES {
        let streams: Vec<_> = (0..IN_FLIGHT)
            .map(|_| common::stream(&gpu.context))
            .collect();
        let futures: Vec<_> = streams
            .iter()
            .map(|stream| waiter.stream_idle(stream).expect("wait"))
            .collect();
        for future in futures {
            futures::executor::block_on(future).expect("the stream went idle");
        }
        drop(streams);
        if batch == 20 {
            resident_after_warmup = cuweave_test_support::resident_bytes();
        }
    }
    cuweave_test_support::poll_until(Duration::from_secs(5), || waiter.pending() == 0);
    let end = waiter.stats();
    let waits = (BATCHES * IN_FLIGHT) as u64;
    assert_eq!(waiter.pending(), 0, "waits still registered: {end:?}");
    assert_eq!(
        end.registered - start.registered,
        waits,
        "registrations: {start:?} -> {end:?}"
    );
    assert_eq!(
        end.completed - start.completed,
        waits,
        "completions: {start:?} -> {end:?}"
    );
    let resident = cuweave_test_support::resident_bytes();
    if resident_after_warmup > 0 {
        assert!(
            resident <= resident_after_warmup + (64 << 20),
            "resident memory grew from {resident_after_warmup} to {resident} bytes over \
             {waits} waits"
        );
    }
}
