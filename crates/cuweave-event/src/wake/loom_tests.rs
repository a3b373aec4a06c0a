//! Loom models of the wait protocol: every interleaving of the racing threads is explored.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p cuweave-event --release loom`.

use std::task::{Context, Poll, Wake, Waker};

use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;

use super::{Inbox, Outcome, WaitCell};

/// A waker that counts its wake-ups.
struct CountingWaker(AtomicUsize);

impl Wake for CountingWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting_waker() -> (std::sync::Arc<CountingWaker>, Waker) {
    let counter = std::sync::Arc::new(CountingWaker(AtomicUsize::new(0)));
    (counter.clone(), Waker::from(counter))
}

#[test]
fn loom_cancel_and_complete_decide_once_and_a_cancelled_callback_never_runs() {
    loom::model(|| {
        let cell = Arc::new(WaitCell::<()>::new());
        let callback_runs = Arc::new(AtomicUsize::new(0));
        let reactor = {
            let (cell, runs) = (cell.clone(), callback_runs.clone());
            thread::spawn(move || {
                // The reactor runs the callback only when its completion won.
                if cell.complete() {
                    runs.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let cancelled = cell.cancel();
        reactor.join().unwrap();
        let runs = callback_runs.load(Ordering::SeqCst);
        if cancelled {
            assert_eq!(runs, 0, "a cancelled callback ran");
            assert_eq!(cell.outcome(), Outcome::Cancelled);
        } else {
            assert_eq!(runs, 1, "a live callback was lost");
            assert_eq!(cell.outcome(), Outcome::Completed);
        }
    });
}

#[test]
fn loom_a_pending_poll_is_always_woken_by_completion() {
    loom::model(|| {
        let cell = Arc::new(WaitCell::<()>::new());
        let (count, waker) = counting_waker();
        let completer = {
            let cell = cell.clone();
            thread::spawn(move || assert!(cell.complete()))
        };
        let polled = cell.poll_outcome(&mut Context::from_waker(&waker));
        completer.join().unwrap();
        match polled {
            Poll::Ready(outcome) => assert_eq!(outcome, Outcome::Completed),
            Poll::Pending => assert_eq!(count.0.load(Ordering::SeqCst), 1, "wake-up lost"),
        }
        assert_eq!(
            cell.poll_outcome(&mut Context::from_waker(&waker)),
            Poll::Ready(Outcome::Completed)
        );
    });
}

#[test]
fn loom_the_latest_waker_is_woken_when_replaced_between_polls() {
    loom::model(|| {
        let cell = Arc::new(WaitCell::<()>::new());
        let (_first_count, first) = counting_waker();
        let (second_count, second) = counting_waker();
        let completer = {
            let cell = cell.clone();
            thread::spawn(move || cell.complete())
        };
        let first_poll = cell.poll_outcome(&mut Context::from_waker(&first));
        let second_poll = cell.poll_outcome(&mut Context::from_waker(&second));
        completer.join().unwrap();
        if first_poll.is_ready() {
            assert!(second_poll.is_ready());
        }
        if second_poll.is_pending() {
            assert_eq!(
                second_count.0.load(Ordering::SeqCst),
                1,
                "new waker not woken"
            );
        }
    });
}

#[test]
fn loom_a_failure_is_seen_with_its_error() {
    loom::model(|| {
        let cell = Arc::new(WaitCell::<u32>::new());
        let (count, waker) = counting_waker();
        let failer = {
            let cell = cell.clone();
            thread::spawn(move || cell.fail(7))
        };
        let canceller = {
            let cell = cell.clone();
            thread::spawn(move || cell.cancel())
        };
        let polled = cell.poll_outcome(&mut Context::from_waker(&waker));
        let failed = failer.join().unwrap();
        let cancelled = canceller.join().unwrap();
        assert!(failed ^ cancelled, "exactly one decides");
        if let Poll::Ready(Outcome::Failed) = polled {
            assert_eq!(cell.take_error(), Some(7));
        }
        if failed {
            assert_eq!(cell.outcome(), Outcome::Failed);
            if polled.is_pending() {
                assert_eq!(count.0.load(Ordering::SeqCst), 1);
            }
        }
    });
}

#[test]
fn loom_a_ring_after_a_flag_is_never_missed_by_a_parking_consumer() {
    loom::model(|| {
        let inbox = Arc::new(Inbox::<u32>::new());
        let stop = Arc::new(loom::sync::atomic::AtomicBool::new(false));
        let consumer = {
            let (inbox, stop) = (inbox.clone(), stop.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    inbox.park_until_nonempty(|| stop.load(Ordering::SeqCst));
                }
            })
        };
        stop.store(true, Ordering::SeqCst);
        inbox.ring(consumer.thread());
        consumer.join().unwrap();
    });
}

#[test]
fn loom_the_inbox_never_leaves_an_item_with_a_parked_consumer() {
    loom::model(|| {
        let inbox = Arc::new(Inbox::<u32>::new());
        let consumer = {
            let inbox = inbox.clone();
            thread::spawn(move || {
                let mut got = Vec::new();
                while got.len() < 2 {
                    match inbox.pop() {
                        Some(item) => got.push(item),
                        None => inbox.park_until_nonempty(|| false),
                    }
                }
                got
            })
        };
        let consumer_thread = consumer.thread().clone();
        let producer = {
            let inbox = inbox.clone();
            let consumer_thread = consumer_thread.clone();
            thread::spawn(move || inbox.push(1, &consumer_thread))
        };
        inbox.push(2, &consumer_thread);
        producer.join().unwrap();
        let mut got = consumer.join().unwrap();
        got.sort_unstable();
        assert_eq!(got, vec![1, 2]);
    });
}
