//! [`Recycler`]: the CUDA-free core of the event pool, a lock-free free list with counters.

use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam::queue::SegQueue;

/// A free list of reusable `T`s: `take` pops one or makes one, `give` pushes it back.
///
/// One `SegQueue` (lock-free) and relaxed counters: no lock anywhere, so threads that take and
/// give concurrently never convoy. An item is always either in the queue or held by exactly one
/// caller, so a miss (the queue was empty) means every item made so far is held: the number made
/// never exceeds the most ever held at once.
#[derive(Debug)]
pub(crate) struct Recycler<T> {
    free: SegQueue<T>,
    created: AtomicU64,
    taken: AtomicU64,
    given: AtomicU64,
}

impl<T> Recycler<T> {
    pub(crate) fn new() -> Self {
        Self {
            free: SegQueue::new(),
            created: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            given: AtomicU64::new(0),
        }
    }

    /// Adds a freshly made item to the free list (pre-creation).
    pub(crate) fn stock(&self, item: T) {
        self.created.fetch_add(1, Ordering::Relaxed);
        self.free.push(item);
    }

    /// A free item, or a new one from `make` when none is free.
    pub(crate) fn take<E>(&self, make: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let item = match self.free.pop() {
            Some(item) => item,
            None => {
                let item = make()?;
                self.created.fetch_add(1, Ordering::Relaxed);
                item
            }
        };
        self.taken.fetch_add(1, Ordering::Relaxed);
        Ok(item)
    }

    /// Returns an item to the free list.
    pub(crate) fn give(&self, item: T) {
        self.given.fetch_add(1, Ordering::Relaxed);
        self.free.push(item);
    }

    pub(crate) fn available(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    pub(crate) fn taken(&self) -> u64 {
        self.taken.load(Ordering::Relaxed)
    }

    pub(crate) fn given(&self) -> u64 {
        self.given.load(Ordering::Relaxed)
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
        let mut ids: Vec<usize> = std::iter::from_fn(|| recycler.free.pop()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), created, "an item was returned twice");
        assert_eq!(recycler.taken(), recycler.given());
    }

    #[test]
    fn a_failed_make_counts_nothing() {
        let recycler = Recycler::<u8>::new();
        assert_eq!(recycler.take(|| Err::<u8, _>("driver")), Err("driver"));
        assert_eq!((recycler.created(), recycler.taken()), (0, 0));
        recycler.stock(1);
        assert_eq!(recycler.take(|| Err::<u8, _>("unused")), Ok(1));
        assert_eq!((recycler.created(), recycler.taken()), (1, 1));
    }
}
