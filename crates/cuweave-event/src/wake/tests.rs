//! Plain (non-loom) tests of the wait protocol: the same code as the loom models, under real
//! threads and many iterations.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::Duration;

use rstest::rstest;

use super::{Inbox, Outcome, WaitCell};

struct CountingWaker(AtomicUsize);

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting_waker() -> (Arc<CountingWaker>, Waker) {
    let counter = Arc::new(CountingWaker(AtomicUsize::new(0)));
    (counter.clone(), Waker::from(counter))
}

#[rstest]
#[case::complete(Outcome::Completed)]
#[case::time_out(Outcome::TimedOut)]
#[case::fail(Outcome::Failed)]
#[case::cancel(Outcome::Cancelled)]
fn the_first_decision_wins_and_later_ones_are_refused(#[case] first: Outcome) {
    let cell = WaitCell::<&str>::new();
    let decide = |cell: &WaitCell<&str>, outcome| match outcome {
        Outcome::Completed => cell.complete(),
        Outcome::TimedOut => cell.time_out(),
        Outcome::Failed => cell.fail("driver"),
        Outcome::Cancelled => cell.cancel(),
        Outcome::Pending => unreachable!(),
    };
    assert_eq!(cell.outcome(), Outcome::Pending);
    assert!(decide(&cell, first));
    for other in [
        Outcome::Completed,
        Outcome::TimedOut,
        Outcome::Failed,
        Outcome::Cancelled,
    ] {
        assert!(!decide(&cell, other), "{other:?} overrode {first:?}");
    }
    assert_eq!(cell.outcome(), first);
    assert_eq!(
        cell.take_error(),
        (first == Outcome::Failed).then_some("driver")
    );
}

#[test]
fn spurious_polls_stay_pending_and_wake_once_on_completion() {
    let cell = WaitCell::<()>::new();
    let (count, waker) = counting_waker();
    for _ in 0..5 {
        assert!(
            cell.poll_outcome(&mut Context::from_waker(&waker))
                .is_pending()
        );
    }
    assert_eq!(count.0.load(Ordering::SeqCst), 0, "woken before completion");
    assert!(cell.complete());
    assert_eq!(count.0.load(Ordering::SeqCst), 1);
    assert_eq!(
        cell.poll_outcome(&mut Context::from_waker(&waker)),
        Poll::Ready(Outcome::Completed)
    );
}

#[test]
fn a_waker_replaced_between_polls_is_the_one_woken() {
    let cell = WaitCell::<()>::new();
    let (first_count, first) = counting_waker();
    let (second_count, second) = counting_waker();
    assert!(
        cell.poll_outcome(&mut Context::from_waker(&first))
            .is_pending()
    );
    assert!(
        cell.poll_outcome(&mut Context::from_waker(&second))
            .is_pending()
    );
    assert!(cell.complete());
    assert_eq!(first_count.0.load(Ordering::SeqCst), 0);
    assert_eq!(second_count.0.load(Ordering::SeqCst), 1);
}

#[test]
fn cancellation_drops_the_waker_and_wakes_nobody() {
    let cell = WaitCell::<()>::new();
    let (count, waker) = counting_waker();
    assert!(
        cell.poll_outcome(&mut Context::from_waker(&waker))
            .is_pending()
    );
    assert!(cell.cancel());
    assert!(!cell.complete());
    assert_eq!(count.0.load(Ordering::SeqCst), 0);
    assert_eq!(
        Arc::strong_count(&count),
        2,
        "the cancelled cell kept its waker"
    );
}

#[test]
fn completion_racing_cancellation_never_runs_a_cancelled_callback_nor_loses_a_live_one() {
    for _ in 0..20_000 {
        let cell = Arc::new(WaitCell::<()>::new());
        let runs = Arc::new(AtomicUsize::new(0));
        let reactor = {
            let (cell, runs) = (cell.clone(), runs.clone());
            thread::spawn(move || {
                if cell.complete() {
                    runs.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let cancelled = cell.cancel();
        reactor.join().unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), usize::from(!cancelled));
    }
}

#[test]
fn a_pending_poll_racing_completion_is_always_woken() {
    for _ in 0..20_000 {
        let cell = Arc::new(WaitCell::<()>::new());
        let (count, waker) = counting_waker();
        let completer = {
            let cell = cell.clone();
            thread::spawn(move || cell.complete())
        };
        let polled = cell.poll_outcome(&mut Context::from_waker(&waker));
        completer.join().unwrap();
        if polled.is_pending() {
            assert_eq!(count.0.load(Ordering::SeqCst), 1, "wake-up lost");
        }
    }
}

#[test]
fn an_inbox_consumer_parks_and_every_item_arrives() {
    let inbox = Arc::new(Inbox::<usize>::new());
    const ITEMS: usize = 10_000;
    let consumer = {
        let inbox = inbox.clone();
        thread::spawn(move || {
            let mut sum = 0;
            let mut got = 0;
            while got < ITEMS * 4 {
                match inbox.pop() {
                    Some(item) => {
                        sum += item;
                        got += 1;
                    }
                    None => inbox.park_until_nonempty(|| false),
                }
            }
            sum
        })
    };
    let target = consumer.thread().clone();
    let producers: Vec<_> = (0..4)
        .map(|_| {
            let (inbox, target) = (inbox.clone(), target.clone());
            thread::spawn(move || {
                for item in 0..ITEMS {
                    inbox.push(item, &target);
                    if item % 1000 == 0 {
                        thread::sleep(Duration::from_micros(50));
                    }
                }
            })
        })
        .collect();
    for producer in producers {
        producer.join().unwrap();
    }
    assert_eq!(consumer.join().unwrap(), 4 * (ITEMS * (ITEMS - 1) / 2));
}
