//! [`WaitCell`]: the one-shot outcome of a wait, decided by a single compare-and-swap.

use std::task::{Context, Poll, Waker};

use crate::sync::{AtomicU8, Mutex, Ordering, lock};

const PENDING: u8 = 0;
const COMPLETED: u8 = 1;
const FAILED: u8 = 2;
const TIMED_OUT: u8 = 3;
const CANCELLED: u8 = 4;

/// How a wait ended, or that it has not yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Nobody has decided the wait yet.
    Pending,
    /// The GPU reached the point waited for.
    Completed,
    /// Watching failed (the driver reported an error, e.g. a context killed by a kernel fault,
    /// or the waiter shut down); the cell holds the error.
    Failed,
    /// The wait's timeout expired first.
    TimedOut,
    /// The owner cancelled the wait first.
    Cancelled,
}

impl Outcome {
    fn from_bits(bits: u8) -> Self {
        match bits {
            PENDING => Self::Pending,
            COMPLETED => Self::Completed,
            FAILED => Self::Failed,
            TIMED_OUT => Self::TimedOut,
            _ => Self::Cancelled,
        }
    }

    /// Whether the wait has been decided.
    pub fn is_decided(self) -> bool {
        self != Self::Pending
    }
}

/// The waker to call and the error to report, touched only when polling and when deciding.
#[derive(Debug)]
struct Slot<E> {
    waker: Option<Waker>,
    error: Option<E>,
}

/// The outcome of one wait, shared by whoever waits (a future, a callback's owner) and whoever
/// watches (the reactor thread).
///
/// The outcome is decided exactly once, by the first successful compare-and-swap out of
/// [`Outcome::Pending`]: [`complete`](Self::complete), [`fail`](Self::fail),
/// [`time_out`](Self::time_out) or [`cancel`](Self::cancel). Each returns whether it won, so
/// whoever won alone acts on it: the reactor runs a callback only when its `complete` won, and
/// once `cancel` has returned `true` nothing else can win, so a cancelled callback never runs.
///
/// The waker follows the contract of tokio's `AtomicWaker`: the latest waker given to
/// [`poll_outcome`](Self::poll_outcome) is the one woken, a decision made while nobody polls is
/// seen by the next poll, and no wake-up is lost between a poll's check and its registration
/// (both happen under the slot's lock, which the decider takes after its compare-and-swap).
/// The slot lock is held only to swap a waker or an error, never while waking or calling out.
///
/// No CUDA in here: `E` is whatever error the watcher reports, and the whole protocol is
/// model-checked with `loom` (`RUSTFLAGS="--cfg loom" cargo test -p cuweave-event --release loom`).
#[derive(Debug)]
pub struct WaitCell<E> {
    state: AtomicU8,
    slot: Mutex<Slot<E>>,
}

impl<E> Default for WaitCell<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> WaitCell<E> {
    /// A pending wait.
    pub fn new() -> Self {
        Self {
            state: AtomicU8::new(PENDING),
            slot: Mutex::new(Slot {
                waker: None,
                error: None,
            }),
        }
    }

    /// The outcome so far.
    pub fn outcome(&self) -> Outcome {
        Outcome::from_bits(self.state.load(Ordering::Acquire))
    }

    fn decide(&self, to: u8) -> bool {
        self.state
            .compare_exchange(PENDING, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn wake(&self) {
        let waker = lock(&self.slot).waker.take();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Marks the wait completed and wakes the waiter; `false` (and nothing done) when it was
    /// already decided.
    pub fn complete(&self) -> bool {
        let won = self.decide(COMPLETED);
        if won {
            self.wake();
        }
        won
    }

    /// Marks the wait timed out and wakes the waiter; `false` when it was already decided.
    pub fn time_out(&self) -> bool {
        let won = self.decide(TIMED_OUT);
        if won {
            self.wake();
        }
        won
    }

    /// Marks the wait failed with `error` and wakes the waiter; `false` (and `error` dropped)
    /// when it was already decided.
    pub fn fail(&self, error: E) -> bool {
        let waker = {
            let mut slot = lock(&self.slot);
            // Decided under the lock, so a poller that sees FAILED (it checks under the same
            // lock) also finds the error.
            if !self.decide(FAILED) {
                return false;
            }
            slot.error = Some(error);
            slot.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        true
    }

    /// Cancels the wait; `true` when this call decided it. Once it has returned `true` the wait
    /// can no longer complete, fail or time out. Wakes nobody: the canceller is the owner.
    pub fn cancel(&self) -> bool {
        let won = self.decide(CANCELLED);
        if won {
            // Drop a registered waker now rather than when the last reference goes.
            drop(lock(&self.slot).waker.take());
        }
        won
    }

    /// Takes the error a failed wait carries (once).
    pub fn take_error(&self) -> Option<E> {
        lock(&self.slot).error.take()
    }

    /// The outcome when decided; otherwise registers `cx`'s waker (replacing an earlier one
    /// unless it would wake the same task) and returns `Pending`.
    pub fn poll_outcome(&self, cx: &mut Context<'_>) -> Poll<Outcome> {
        let outcome = self.outcome();
        if outcome.is_decided() {
            return Poll::Ready(outcome);
        }
        let mut slot = lock(&self.slot);
        // Checked again under the lock: a decider takes the waker under it after its CAS, so
        // either it finds the waker stored here or this load sees its decision.
        let outcome = self.outcome();
        if outcome.is_decided() {
            return Poll::Ready(outcome);
        }
        match &mut slot.waker {
            Some(existing) if existing.will_wake(cx.waker()) => {}
            other => *other = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}
