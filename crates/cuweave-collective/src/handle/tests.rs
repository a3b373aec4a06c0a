//! The handle protocol's invariants, without NCCL.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use rstest::rstest;

use super::*;

#[derive(Debug, PartialEq)]
enum Stop {
    Aborted,
    TimedOut,
}

/// Long enough that a test never reaches it by accident.
const FOREVER: Duration = Duration::from_secs(600);
/// How long a test gives a thread to do what it must not do.
const SETTLE: Duration = Duration::from_millis(100);

/// Runs `abort_with` on another thread; the handle it aborts comes back on the receiver,
/// after `on_abort` ran (the stand-in for `ncclCommAbort` in these NCCL-free tests).
fn abort_in_background<H: Copy + Send + Sync + 'static>(
    cell: &Arc<HandleCell<H>>,
    grace: Duration,
    on_abort: impl FnOnce() + Send + 'static,
) -> (mpsc::Receiver<H>, std::thread::JoinHandle<bool>) {
    let (taken_tx, taken) = mpsc::channel();
    let cell = Arc::clone(cell);
    let aborting = std::thread::spawn(move || {
        cell.abort_with(grace, |raw| {
            on_abort();
            taken_tx.send(raw).expect("send");
        })
    });
    (taken, aborting)
}

fn wait_for_abort_request<H: Copy>(cell: &HandleCell<H>) {
    while !cell.is_aborted() {
        std::thread::yield_now();
    }
}

/// The watchdog pattern: thread A settles a call whose peer never arrives (120 s deadline)
/// with a fresh guard per poll; thread B aborts. A stops at its next poll (invariant 5).
#[test]
fn an_abort_from_another_thread_stops_a_settle_loop_long_before_its_deadline() {
    let cell = Arc::new(HandleCell::new(7u32));
    let (polling, polled) = mpsc::channel();
    let settling = {
        let cell = Arc::clone(&cell);
        std::thread::spawn(move || {
            let started = Instant::now();
            let result = poll_until(
                started,
                Duration::from_secs(120),
                || {
                    let guard = cell.enter().ok_or(Stop::Aborted)?;
                    let raw = guard.call(|raw| raw).ok_or(Stop::Aborted)?;
                    assert_eq!(raw, 7);
                    let _ = polling.send(());
                    Ok(Polled::Pending)
                },
                |_| Stop::TimedOut,
            );
            (result, started.elapsed())
        })
    };
    polled.recv().expect("the settle loop polls");
    assert!(!cell.is_aborted());
    let started = Instant::now();
    let mut taken = None;
    assert!(cell.abort_with(FOREVER, |raw| taken = Some(raw)));
    assert_eq!(taken, Some(7));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the abort waited only for one poll, not for the grace"
    );
    let (result, waited) = settling.join().expect("thread");
    assert_eq!(result, Err(Stop::Aborted));
    assert!(waited < Duration::from_secs(60), "{waited:?}");
    assert!(cell.enter().is_none(), "no call after an abort");
}

/// Invariant 2: a thread between calls (preparing buffers behind a contended lock, between
/// the calls of an open group) holds its guard past the grace; the handle is not handed
/// over until the guard is gone, and the guard's next call is refused.
#[test]
fn a_guard_between_calls_pins_the_handle_past_the_grace() {
    let cell = Arc::new(HandleCell::new(5u8));
    let guard = cell.enter().expect("a call starts");
    let grace = Duration::from_millis(5);
    let (taken, aborting) = abort_in_background(&cell, grace, || {});
    wait_for_abort_request(&cell);
    assert!(
        cell.enter().is_none(),
        "no new guard once the abort started"
    );
    assert!(
        taken.recv_timeout(SETTLE).is_err(),
        "the handle is not freed under a guard outside a call, even {SETTLE:?} after a \
         {grace:?} grace"
    );
    assert_eq!(guard.call(|_| unreachable!("refused")), None);
    assert_eq!(cell.peek(), None);
    drop(guard);
    assert_eq!(taken.recv_timeout(FOREVER).expect("taken"), 5);
    assert!(aborting.join().expect("thread"));
}

/// Invariants 3 and 4: a blocking call hung inside NCCL is cut short after the grace (the
/// abort runs while it is inside, and unblocks it, as `ncclCommAbort` does); when it returns
/// it learns it was cut short, and its guard is gone.
#[test]
fn a_blocking_call_hung_inside_nccl_is_cut_short_and_never_reaches_the_handle_again() {
    let cell = Arc::new(HandleCell::new(3u64));
    let (inside_tx, inside) = mpsc::channel();
    let (release_tx, release) = mpsc::channel::<()>();
    let calling = {
        let cell = Arc::clone(&cell);
        std::thread::spawn(move || {
            let guard = cell.enter().expect("a call starts");
            let outcome = guard.blocking_call(|raw| {
                inside_tx.send(()).expect("send");
                // Hung until the abort cuts it short.
                release.recv().expect("released by the abort");
                raw
            });
            (outcome, cell.enter().is_none())
        })
    };
    inside.recv().expect("the call is inside NCCL");
    let grace = Duration::from_millis(20);
    let started = Instant::now();
    let mut taken = None;
    assert!(cell.abort_with(grace, |raw| {
        taken = Some(raw);
        release_tx.send(()).expect("unblock");
    }));
    assert!(
        started.elapsed() >= grace,
        "the abort gave the call its grace"
    );
    assert_eq!(taken, Some(3));
    let (outcome, refused) = calling.join().expect("thread");
    assert_eq!(outcome, Blocking::CutShort);
    assert!(refused, "no call after being cut short");
    assert!(cell.is_aborted());
}

/// A blocking call that returns within the grace is not cut short: its result stands and the
/// abort takes the handle after it.
#[test]
fn a_blocking_call_returning_within_the_grace_keeps_its_result() {
    let cell = Arc::new(HandleCell::new(9u16));
    let (inside_tx, inside) = mpsc::channel();
    let (release_tx, release) = mpsc::channel::<()>();
    let calling = {
        let cell = Arc::clone(&cell);
        std::thread::spawn(move || {
            let guard = cell.enter().expect("a call starts");
            guard.blocking_call(|raw| {
                inside_tx.send(()).expect("send");
                release.recv().expect("release");
                raw
            })
        })
    };
    inside.recv().expect("the call is inside NCCL");
    let (taken, aborting) = abort_in_background(&cell, FOREVER, || {});
    wait_for_abort_request(&cell);
    release_tx.send(()).expect("release");
    assert_eq!(calling.join().expect("thread"), Blocking::Returned(9));
    assert_eq!(taken.recv_timeout(FOREVER).expect("taken"), 9);
    assert!(aborting.join().expect("thread"));
}

/// Invariant 5: once an abort was requested, a live guard's calls are refused without
/// calling.
#[rstest]
#[case::call(false)]
#[case::blocking_call(true)]
fn calls_are_refused_once_an_abort_was_requested(#[case] blocking: bool) {
    let cell = Arc::new(HandleCell::new(1i64));
    let guard = cell.enter().expect("a call starts");
    let (taken, aborting) = abort_in_background(&cell, FOREVER, || {});
    wait_for_abort_request(&cell);
    if blocking {
        assert_eq!(
            guard.blocking_call(|_| unreachable!("refused")),
            Blocking::<()>::Refused
        );
    } else {
        assert_eq!(guard.call(|_| unreachable!("refused")), None::<()>);
        drop(guard);
    }
    assert_eq!(taken.recv_timeout(FOREVER).expect("taken"), 1);
    assert!(aborting.join().expect("thread"));
}

/// Invariants 2 and 3 for a group: the guards of an open group pin the handle while its
/// calls are queued; `ncclGroupEnd` is made even after the abort was requested (the thread
/// must leave group mode), and only it can be cut short. Two guards of one cell (two calls
/// on one communicator) and a guard of another cell, which the abort leaves alone.
#[test]
fn a_group_end_is_made_after_an_abort_request_and_only_it_is_cut_short() {
    let aborted = Arc::new(HandleCell::new(11u32));
    let other = Arc::new(HandleCell::new(12u32));
    let (queued_tx, queued) = mpsc::channel();
    let (go_tx, go) = mpsc::channel::<()>();
    let (inside_tx, inside) = mpsc::channel();
    let (release_tx, release) = mpsc::channel::<()>();
    let grouping = {
        let (aborted, other) = (Arc::clone(&aborted), Arc::clone(&other));
        std::thread::spawn(move || {
            let guards = vec![
                aborted.enter().expect("first call"),
                other.enter().expect("other communicator"),
                aborted.enter().expect("second call"),
            ];
            for guard in &guards {
                assert!(guard.call(|_| ()).is_some());
            }
            queued_tx.send(()).expect("send");
            go.recv().expect("go");
            end_group(guards, || {
                inside_tx.send(()).expect("send");
                release.recv().expect("released by the abort");
                "ended"
            })
        })
    };
    queued.recv().expect("the group's calls are queued");
    let grace = Duration::from_millis(5);
    let (taken, aborting) = abort_in_background(&aborted, grace, move || {
        release_tx.send(()).expect("unblock")
    });
    wait_for_abort_request(&aborted);
    assert!(
        taken.recv_timeout(SETTLE).is_err(),
        "not taken between the group's calls"
    );
    go_tx.send(()).expect("go");
    inside
        .recv()
        .expect("ncclGroupEnd is made although an abort was requested");
    assert_eq!(taken.recv_timeout(FOREVER).expect("taken"), 11);
    assert_eq!(grouping.join().expect("thread"), ("ended", true));
    assert!(aborting.join().expect("thread"));
    assert!(!other.is_aborted());
    assert_eq!(other.peek(), Some(12));
}

/// A group whose end returns within the grace is not cut short, though an abort was
/// requested while it was open: the abort runs after it.
#[test]
fn a_group_end_returning_within_the_grace_is_not_cut_short() {
    let cell = Arc::new(HandleCell::new(4u8));
    let guard = cell.enter().expect("a call");
    let (taken, aborting) = abort_in_background(&cell, FOREVER, || {});
    wait_for_abort_request(&cell);
    let mut ended = false;
    let ((), cut_short) = end_group(vec![guard], || ended = true);
    assert!(ended);
    assert!(!cut_short);
    assert_eq!(taken.recv_timeout(FOREVER).expect("taken"), 4);
    assert!(aborting.join().expect("thread"));
}

/// Invariant 6: callers that lose the race return only once the winner's abort has run.
#[rstest]
#[case(1)]
#[case(4)]
fn concurrent_aborts_return_only_after_the_winner_aborted(#[case] losers: usize) {
    let cell = Arc::new(HandleCell::new(2u32));
    let done = Arc::new(AtomicBool::new(false));
    let (inside_tx, inside) = mpsc::channel();
    let (release_tx, release) = mpsc::channel::<()>();
    let winner = {
        let (cell, done) = (Arc::clone(&cell), Arc::clone(&done));
        std::thread::spawn(move || {
            cell.abort_with(FOREVER, |_| {
                inside_tx.send(()).expect("send");
                release.recv().expect("release");
                done.store(true, Ordering::SeqCst);
            })
        })
    };
    inside.recv().expect("the winner is inside ncclCommAbort");
    let (returned_tx, returned) = mpsc::channel();
    let losers: Vec<_> = (0..losers)
        .map(|_| {
            let (cell, done, returned_tx) =
                (Arc::clone(&cell), Arc::clone(&done), returned_tx.clone());
            std::thread::spawn(move || {
                let ran = cell.abort_with(FOREVER, |_| unreachable!("one abort"));
                // What the caller of `Communicator::abort` relies on.
                let aborted_by_then = done.load(Ordering::SeqCst);
                returned_tx.send(()).expect("send");
                (ran, aborted_by_then)
            })
        })
        .collect();
    assert!(
        returned.recv_timeout(SETTLE).is_err(),
        "a loser returned while the winner was still aborting"
    );
    release_tx.send(()).expect("release");
    assert!(winner.join().expect("thread"));
    for loser in losers {
        assert_eq!(loser.join().expect("thread"), (false, true));
    }
    assert!(!cell.abort_with(FOREVER, |_| unreachable!("done")));
}

/// The deadline's abort: requesting it marks the cell aborted at once (no call is
/// accepted), without waiting for anything; a second request and every `abort_with` wait
/// for the one run elsewhere (here, on another thread), and the handle is taken once.
#[test]
fn a_requested_abort_refuses_at_once_and_others_wait_for_its_run_elsewhere() {
    let cell = Arc::new(HandleCell::new(6u32));
    let guard = cell.enter().expect("a call between polls");
    assert_eq!(cell.request_abort(), Requested::ByThisCaller);
    assert!(cell.is_aborted(), "aborted as soon as it is requested");
    assert!(cell.enter().is_none());
    assert_eq!(cell.peek(), None);
    assert_eq!(cell.request_abort(), Requested::Already);
    let (returned_tx, returned) = mpsc::channel();
    let waiting = {
        let (cell, returned_tx) = (Arc::clone(&cell), returned_tx.clone());
        std::thread::spawn(move || {
            let ran = cell.abort_with(FOREVER, |_| unreachable!("one abort"));
            returned_tx.send(()).expect("send");
            ran
        })
    };
    let running = {
        let cell = Arc::clone(&cell);
        std::thread::spawn(move || {
            let mut taken = None;
            let ran = cell.run_requested_abort(FOREVER, |raw| taken = Some(raw));
            (ran, taken)
        })
    };
    assert!(
        returned.recv_timeout(SETTLE).is_err(),
        "an abort returned while a guard still pinned the handle"
    );
    assert_eq!(guard.call(|_| unreachable!("refused")), None::<()>);
    drop(guard);
    assert_eq!(running.join().expect("thread"), (true, Some(6)));
    returned
        .recv_timeout(FOREVER)
        .expect("the waiting abort returns");
    assert!(!waiting.join().expect("thread"));
    assert_eq!(cell.request_abort(), Requested::Already);
}

#[test]
fn an_abort_requested_after_the_handle_is_gone_is_nothing_to_run() {
    let mut cell = HandleCell::new(8u8);
    assert_eq!(cell.take(), Some(8));
    assert_eq!(cell.request_abort(), Requested::Gone);
    assert!(!cell.is_aborted());
}

#[rstest]
#[case(2)]
#[case(8)]
fn exactly_one_of_several_aborts_runs(#[case] threads: usize) {
    let cell = Arc::new(HandleCell::new(1i32));
    let start = Arc::new(Barrier::new(threads));
    let ran: Vec<bool> = (0..threads)
        .map(|_| {
            let (cell, start) = (Arc::clone(&cell), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                cell.abort_with(ABORT_GRACE, |raw| assert_eq!(raw, 1))
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    assert_eq!(ran.iter().filter(|ran| **ran).count(), 1, "{ran:?}");
    assert!(cell.is_aborted());
}

#[rstest]
#[case::done_at_once(0)]
#[case::done_after_polls(50)]
fn poll_until_returns_when_done(#[case] pending: u32) {
    let mut left = pending;
    let result: Result<(), Stop> = poll_until(
        Instant::now(),
        Duration::from_secs(60),
        || {
            if left == 0 {
                Ok(Polled::Done)
            } else {
                left -= 1;
                Ok(Polled::Pending)
            }
        },
        |_| Stop::TimedOut,
    );
    assert_eq!(result, Ok(()));
    assert_eq!(left, 0);
}

#[test]
fn poll_until_times_out_and_reports_the_wait() {
    let timeout = Duration::from_millis(5);
    let result: Result<(), Duration> = poll_until(
        Instant::now(),
        timeout,
        || Ok(Polled::Pending),
        |waited| waited,
    );
    assert!(result.expect_err("times out") >= timeout);
}
