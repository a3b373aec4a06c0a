//! [`Inbox`]: hands new work to a reactor thread that parks when it has none.

use crate::sync::{AtomicUsize, Ordering, thread};

#[cfg(not(loom))]
type Queue<T> = crossbeam::queue::SegQueue<T>;

/// Under loom the items sit in a deque behind a `std` mutex: loom switches threads only at its
/// own primitives, so that lock is never contended and each push or pop is one step. What loom
/// explores is the state word below, which alone decides whether the consumer may sleep.
#[cfg(loom)]
#[derive(Debug)]
struct Queue<T>(std::sync::Mutex<std::collections::VecDeque<T>>);

#[cfg(loom)]
impl<T> Queue<T> {
    fn new() -> Self {
        Self(std::sync::Mutex::new(std::collections::VecDeque::new()))
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::VecDeque<T>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    fn push(&self, value: T) {
        self.lock().push_back(value);
    }
    fn pop(&self) -> Option<T> {
        self.lock().pop_front()
    }
}

/// Bit 0 of the state word: the consumer is parked, or about to park.
const SLEEPING: usize = 1;
/// The state word counts queued items in steps of this.
const ITEM: usize = 2;

/// A many-producer, one-consumer queue whose consumer thread parks while it is empty.
///
/// Producers [`push`](Self::push) from any thread; the consumer (the reactor) drains with
/// [`pop`](Self::pop) and, when it has nothing else to do, calls
/// [`park_until_nonempty`](Self::park_until_nonempty). One atomic state word holds the number
/// of queued items and a "sleeping" bit, and every access to it is a read-modify-write, so all
/// of them fall into one total order: the consumer may only set the bit by a compare-and-swap
/// from "no items, awake", and a producer counts its item with a `fetch_add` that returns the
/// previous state. Either the item is counted first (the consumer's CAS fails and it does not
/// park) or the bit is set first (the producer sees it and unparks the consumer; park tokens
/// make an unpark before the park count). No fence subtleties, and loom-checked.
///
/// While parked, the consumer costs no CPU.
#[derive(Debug)]
pub struct Inbox<T> {
    queue: Queue<T>,
    state: AtomicUsize,
}

impl<T> Default for Inbox<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Inbox<T> {
    /// An empty inbox.
    pub fn new() -> Self {
        Self {
            queue: Queue::new(),
            state: AtomicUsize::new(0),
        }
    }

    /// Queues `item` and wakes `consumer` if it is parked (or about to park) on this inbox.
    pub fn push(&self, item: T, consumer: &thread::Thread) {
        self.queue.push(item);
        if self.state.fetch_add(ITEM, Ordering::AcqRel) & SLEEPING != 0 {
            consumer.unpark();
        }
    }

    /// Wakes `consumer` if it is parked, without queueing anything, so it re-checks the
    /// `keep_awake` condition it parked with (a shutdown flag the caller set just before).
    pub fn ring(&self, consumer: &thread::Thread) {
        // An RMW (AcqRel): if the consumer's CAS comes later in the state's order, it acquires
        // this release and so sees the flag the caller set before ringing.
        if self.state.fetch_and(!SLEEPING, Ordering::AcqRel) & SLEEPING != 0 {
            consumer.unpark();
        }
    }

    /// Takes the oldest queued item.
    pub fn pop(&self) -> Option<T> {
        let item = self.queue.pop()?;
        self.state.fetch_sub(ITEM, Ordering::AcqRel);
        Some(item)
    }

    /// Marks the consumer asleep unless items are counted; `false` when it must not park.
    fn announce_sleep(&self, keep_awake: impl Fn() -> bool) -> bool {
        if self
            .state
            .compare_exchange(0, SLEEPING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // Items are counted, or one was popped before its producer counted it (the count
            // dips below zero for a moment): let the producer finish.
            thread::yield_now();
            return false;
        }
        if keep_awake() {
            self.state.fetch_and(!SLEEPING, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Parks the calling (consumer) thread unless an item is queued or `keep_awake` says there
    /// is other work. Returns after a push, a ring, a spurious wake-up, or at once; the caller
    /// loops.
    pub fn park_until_nonempty(&self, keep_awake: impl Fn() -> bool) {
        if self.announce_sleep(keep_awake) {
            thread::park();
            self.state.fetch_and(!SLEEPING, Ordering::AcqRel);
        }
    }

    /// As [`park_until_nonempty`](Self::park_until_nonempty), but wakes by itself after
    /// `timeout` (used while a wait carries a deadline, or to back off while work is pending).
    #[cfg(not(loom))]
    pub fn park_timeout(&self, timeout: std::time::Duration, keep_awake: impl Fn() -> bool) {
        if self.announce_sleep(keep_awake) {
            thread::park_timeout(timeout);
            self.state.fetch_and(!SLEEPING, Ordering::AcqRel);
        }
    }
}
