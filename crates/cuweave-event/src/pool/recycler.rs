//! [`Recycler`]: the CUDA-free core of the event pool, a lock-free free list.

use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam::queue::{ArrayQueue, SegQueue};

/// Items the bounded fast list holds before the rest spill into the unbounded one.
const FAST_CAPACITY: usize = 1024;

/// A free list of reusable `T`s: `take` pops one or makes one, `give` pushes it back.
///
/// Lock-free throughout, and cheap on the path that matters: a bounded `ArrayQueue` (one
/// compare-and-swap and one store per push or pop, no allocation) holds the first
/// [`FAST_CAPACITY`] free items, an unbounded `SegQueue` the rest, so the list grows without
/// limit. Nothing is counted per take or give (a shared counter would be two more contended
/// read-modify-writes per round trip); what is in use is what was made minus what is free.
///
/// An item is always either in a list or held by exactly one caller, so a miss (both lists were
/// empty when looked at) means every item made so far was held at that moment.
#[derive(Debug)]
pub(crate) struct Recycler<T> {
    fast: ArrayQueue<T>,
    overflow: SegQueue<T>,
    created: AtomicU64,
    grown: AtomicU64,
}

impl<T> Recycler<T> {
    pub(crate) fn new() -> Self {
        Self {
            fast: ArrayQueue::new(FAST_CAPACITY),
            overflow: SegQueue::new(),
            created: AtomicU64::new(0),
            grown: AtomicU64::new(0),
        }
    }

    /// Adds a freshly made item to the free list (pre-creation).
    pub(crate) fn stock(&self, item: T) {
        self.created.fetch_add(1, Ordering::Relaxed);
        self.push(item);
    }

    fn push(&self, item: T) {
        if let Err(item) = self.fast.push(item) {
            self.overflow.push(item);
        }
    }

    /// A free item, or a new one from `make` when none is free.
    pub(crate) fn take<E>(&self, make: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        if let Some(item) = self.fast.pop().or_else(|| self.overflow.pop()) {
            return Ok(item);
        }
        let item = make()?;
        self.created.fetch_add(1, Ordering::Relaxed);
        self.grown.fetch_add(1, Ordering::Relaxed);
        Ok(item)
    }

    /// Returns an item to the free list.
    pub(crate) fn give(&self, item: T) {
        self.push(item);
    }

    /// Items free right now.
    pub(crate) fn available(&self) -> usize {
        self.fast.len() + self.overflow.len()
    }

    /// Items made (pre-created and grown).
    pub(crate) fn created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    /// Items made because the list was empty.
    pub(crate) fn grown(&self) -> u64 {
        self.grown.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    fn drain(&self) -> Vec<T> {
        std::iter::from_fn(|| self.fast.pop().or_else(|| self.overflow.pop())).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;
    use std::thread;

    use super::*;

    #[test]
    fn sixteen_threads_lose_nothing_and_make_no_more_than_they_hold_at_once() {
        const THREADS: usize = 16;
        const HELD: usize = 4;
        let recycler = Arc::new(Recycler::<usize>::new());
        let next_id = Arc::new(AtomicUsize::new(0));
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                let (recycler, next_id) = (recycler.clone(), next_id.clone());
                thread::spawn(move || {
                    for _ in 0..2_000 {
                        let held: Vec<usize> = (0..HELD)
                            .map(|_| {
                                recycler
                                    .take(|| Ok::<_, ()>(next_id.fetch_add(1, Ordering::Relaxed)))
                                    .unwrap()
                            })
                            .collect();
                        for item in held {
                            recycler.give(item);
                        }
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        let created = recycler.created() as usize;
        assert!(
            created <= THREADS * HELD,
            "made {created} for {} held",
            THREADS * HELD
        );
        assert_eq!(recycler.available(), created, "an item was lost");
        let mut ids = recycler.drain();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), created, "an item was returned twice");
    }

    #[test]
    fn the_list_grows_past_its_fast_capacity_and_loses_nothing() {
        let recycler = Recycler::<usize>::new();
        let n = FAST_CAPACITY + 100;
        let held: Vec<usize> = (0..n)
            .map(|i| recycler.take(|| Ok::<_, ()>(i)).unwrap())
            .collect();
        assert_eq!((recycler.created(), recycler.grown()), (n as u64, n as u64));
        for item in held {
            recycler.give(item);
        }
        assert_eq!(recycler.available(), n);
        let mut ids = recycler.drain();
        ids.sort_unstable();
        assert_eq!(ids, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn a_failed_make_counts_nothing() {
        let recycler = Recycler::<u8>::new();
        assert_eq!(recycler.take(|| Err::<u8, _>("driver")), Err("driver"));
        assert_eq!(recycler.created(), 0);
        recycler.stock(1);
        assert_eq!(recycler.take(|| Err::<u8, _>("unused")), Ok(1));
        assert_eq!((recycler.created(), recycler.grown()), (1, 0));
    }
}
