//! [`Inbox`]: hands new work to a reactor thread that parks when it has none.

use crate::sync::{AtomicBool, Ordering, fence, thread};

#[cfg(not(loom))]
type Queue<T> = crossbeam::queue::SegQueue<T>;

/// Under loom the queue is a mutex-guarded deque, which loom can model; the park protocol
/// around it, which is what can lose wake-ups, is the same code.
#[cfg(loom)]
#[derive(Debug)]
struct Queue<T>(crate::sync::Mutex<std::collections::VecDeque<T>>);

#[cfg(loom)]
impl<T> Queue<T> {
    fn new() -> Self {
        Self(crate::sync::Mutex::new(std::collections::VecDeque::new()))
    }
    fn push(&self, value: T) {
        crate::sync::lock(&self.0).push_back(value);
    }
    fn pop(&self) -> Option<T> {
        crate::sync::lock(&self.0).pop_front()
    }
    fn is_empty(&self) -> bool {
        crate::sync::lock(&self.0).is_empty()
    }
}

/// A many-producer, one-consumer queue whose consumer thread parks while it is empty.
///
/// Producers [`push`](Self::push) from any thread; the consumer (the reactor) drains with
/// [`pop`](Self::pop) and, when it has nothing else to do, calls
/// [`park_until_nonempty`](Self::park_until_nonempty). The protocol is Dekker's: the consumer
/// announces it is going to sleep, then looks at the queue once more; a producer pushes, then
/// looks at the announcement and unparks the consumer if it was set. Both sides put a
/// sequentially consistent fence between their write and their read, so at least one of them
/// sees the other: either the consumer finds the item, or the producer finds the announcement
/// and unparks it (park tokens make an unpark before the park count). Loom-checked.
///
/// While parked, the consumer costs no CPU.
#[derive(Debug)]
pub struct Inbox<T> {
    queue: Queue<T>,
    sleeping: AtomicBool,
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
            sleeping: AtomicBool::new(false),
        }
    }

    /// Queues `item` and wakes `consumer` if it is parked (or about to park) on this inbox.
    pub fn push(&self, item: T, consumer: &thread::Thread) {
        self.queue.push(item);
        self.ring(consumer);
    }

    /// Wakes `consumer` if it announced it would park, without queueing anything (used to make
    /// it notice a shutdown flag or a cancelled wait).
    pub fn ring(&self, consumer: &thread::Thread) {
        fence(Ordering::SeqCst);
        if self.sleeping.swap(false, Ordering::SeqCst) {
            consumer.unpark();
        }
    }

    /// Takes the oldest queued item.
    pub fn pop(&self) -> Option<T> {
        self.queue.pop()
    }

    /// Announces that the calling (consumer) thread parks, then parks unless an item arrived
    /// or `keep_awake` says there is other work. Returns after a ring, a spurious wake-up, or
    /// at once when something was queued meanwhile; the caller loops.
    pub fn park_until_nonempty(&self, keep_awake: impl Fn() -> bool) {
        self.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !self.queue.is_empty() || keep_awake() {
            self.sleeping.store(false, Ordering::SeqCst);
            return;
        }
        thread::park();
        self.sleeping.store(false, Ordering::SeqCst);
    }

    /// As [`park_until_nonempty`](Self::park_until_nonempty), but wakes by itself after
    /// `timeout` (used while a wait carries a deadline, or to back off while work is pending).
    #[cfg(not(loom))]
    pub fn park_timeout(&self, timeout: std::time::Duration, keep_awake: impl Fn() -> bool) {
        self.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !self.queue.is_empty() || keep_awake() {
            self.sleeping.store(false, Ordering::SeqCst);
            return;
        }
        thread::park_timeout(timeout);
        self.sleeping.store(false, Ordering::SeqCst);
    }
}
