//! [`Recycler`]: the CUDA-free core of the event pool, a free list with a per-thread fast path.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crossbeam::queue::{ArrayQueue, SegQueue};
use parking_lot::Mutex;

use super::arena::Arena;
use super::owner_slot::OwnerSlot;

/// Indices the bounded shared list holds before the rest spill into the unbounded one.
const FAST_CAPACITY: usize = 1024;

/// Process-unique ids of free lists, so that a thread's cache never mistakes a new list for a
/// dropped one.
static NEXT_LIST_ID: AtomicU64 = AtomicU64::new(0);

/// The shared part of a free list: indices of free items in two lock-free queues, and the
/// registry of the per-thread slots that may each cache one more.
#[derive(Debug)]
struct FreeList {
    id: u64,
    fast: ArrayQueue<u32>,
    overflow: SegQueue<u32>,
    /// Every thread's slot in this list (locked only to register a thread, to steal before
    /// growing, and for a utilization snapshot).
    slots: Mutex<Vec<Arc<OwnerSlot>>>,
}

impl FreeList {
    fn push(&self, index: u32) {
        if let Err(index) = self.fast.push(index) {
            self.overflow.push(index);
        }
    }

    fn pop(&self) -> Option<u32> {
        self.fast.pop().or_else(|| self.overflow.pop())
    }

    /// Takes an index cached in some thread's slot (the last resort before growing).
    fn steal(&self) -> Option<u32> {
        self.slots.lock().iter().find_map(|slot| slot.take())
    }

    fn cached(&self) -> usize {
        self.slots
            .lock()
            .iter()
            .filter(|slot| slot.is_full())
            .count()
    }
}

/// One thread's slot in one free list, in that thread's cache.
struct LocalSlot {
    list: u64,
    slot: Arc<OwnerSlot>,
    home: Weak<FreeList>,
}

impl Drop for LocalSlot {
    /// The thread is exiting (or the list is gone): the cached index goes back to the shared
    /// list, and the slot leaves the registry.
    fn drop(&mut self) {
        if let Some(list) = self.home.upgrade() {
            if let Some(index) = self.slot.take() {
                list.push(index);
            }
            list.slots
                .lock()
                .retain(|slot| !Arc::ptr_eq(slot, &self.slot));
        }
    }
}

thread_local! {
    /// This thread's slots, one per free list it has released an item to.
    static LOCAL_SLOTS: RefCell<Vec<LocalSlot>> = const { RefCell::new(Vec::new()) };
}

/// Why [`Recycler::take`] made nothing.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TakeError<E> {
    /// `make` failed.
    Make(E),
    /// The arena holds [`Arena::MAX_LEN`] items already.
    Full,
}

/// A free list of reusable `T`s: `take` hands out a free item's index (or makes a new item),
/// `give` takes the index back, and [`get`](Self::get) reads an item by index.
///
/// Items live in an append-only [`Arena`]; the lists pass `u32` indices. The round trip that
/// matters (a thread taking an item and giving it back, again and again) goes through that
/// thread's [`OwnerSlot`]: `give` caches the index there with a plain store, `take` empties it
/// with one swap, and the thread's slot is found in a thread-local cache, so no shared cache
/// line is written. A second index given while the slot is full goes to the shared lists: a
/// bounded `ArrayQueue` (one compare-and-swap per push or pop) for the first
/// [`FAST_CAPACITY`], an unbounded `SegQueue` beyond.
///
/// `take` looks in order at: its thread's slot, the shared lists, every other thread's slot
/// (stealing), and only then makes an item. An item is always in exactly one of those places
/// or held by one caller, so a miss means every item made so far was held when it was looked
/// for: the list never makes more items than are held at once. When a thread exits, the index
/// its slot caches returns to the shared list.
#[derive(Debug)]
pub(crate) struct Recycler<T> {
    list: Arc<FreeList>,
    arena: Arena<T>,
    created: AtomicU64,
    grown: AtomicU64,
}

impl<T> Recycler<T> {
    pub(crate) fn new() -> Self {
        Self {
            list: Arc::new(FreeList {
                id: NEXT_LIST_ID.fetch_add(1, Ordering::Relaxed),
                fast: ArrayQueue::new(FAST_CAPACITY),
                overflow: SegQueue::new(),
                slots: Mutex::new(Vec::new()),
            }),
            arena: Arena::new(),
            created: AtomicU64::new(0),
            grown: AtomicU64::new(0),
        }
    }

    /// Adds a freshly made item to the free list (pre-creation); `Err` gives it back when the
    /// arena is full.
    pub(crate) fn stock(&self, item: T) -> Result<(), T> {
        let index = self.arena.push(item)?;
        self.created.fetch_add(1, Ordering::Relaxed);
        self.list.push(index);
        Ok(())
    }

    /// The index of a free item, or of a new one from `make` when none is free.
    #[inline]
    pub(crate) fn take<E>(&self, make: impl FnOnce() -> Result<T, E>) -> Result<u32, TakeError<E>> {
        match self.take_cached() {
            Some(index) => Ok(index),
            None => self.take_shared(make),
        }
    }

    /// [`take`](Self::take) when this thread's slot is empty: the shared lists, the other
    /// threads' slots, or a new item.
    #[cold]
    #[inline(never)]
    fn take_shared<E>(&self, make: impl FnOnce() -> Result<T, E>) -> Result<u32, TakeError<E>> {
        if let Some(index) = self.list.pop().or_else(|| self.list.steal()) {
            return Ok(index);
        }
        let item = make().map_err(TakeError::Make)?;
        let index = self.arena.push(item).map_err(|_| TakeError::Full)?;
        self.created.fetch_add(1, Ordering::Relaxed);
        self.grown.fetch_add(1, Ordering::Relaxed);
        Ok(index)
    }

    /// Empties this thread's slot in this list.
    #[inline]
    fn take_cached(&self) -> Option<u32> {
        let id = self.list.id;
        LOCAL_SLOTS
            .try_with(|slots| {
                let slots = slots.try_borrow().ok()?;
                slots.iter().find(|local| local.list == id)?.slot.take()
            })
            .ok()
            .flatten()
    }

    /// Returns an index taken from this list.
    #[inline]
    pub(crate) fn give(&self, index: u32) {
        let id = self.list.id;
        let cached = LOCAL_SLOTS
            .try_with(|slots| {
                let Ok(slots) = slots.try_borrow() else {
                    return false;
                };
                match slots.iter().find(|local| local.list == id) {
                    Some(local) => local.slot.put(index),
                    None => {
                        drop(slots);
                        self.register_and_cache(index)
                    }
                }
            })
            // While the thread's cache is being torn down the index goes to the shared list.
            .unwrap_or(false);
        if !cached {
            self.list.push(index);
        }
    }

    /// This thread's first release to this list: gives the thread a slot (forgetting its
    /// slots of lists that are gone) and caches `index` there.
    #[cold]
    #[inline(never)]
    fn register_and_cache(&self, index: u32) -> bool {
        LOCAL_SLOTS
            .try_with(|slots| {
                let Ok(mut slots) = slots.try_borrow_mut() else {
                    return false;
                };
                slots.retain(|local| local.home.strong_count() > 0);
                let slot = Arc::new(OwnerSlot::new());
                self.list.slots.lock().push(Arc::clone(&slot));
                let cached = slot.put(index);
                slots.push(LocalSlot {
                    list: self.list.id,
                    slot,
                    home: Arc::downgrade(&self.list),
                });
                cached
            })
            .unwrap_or(false)
    }

    /// The item at `index` (an index from [`take`](Self::take)).
    #[inline]
    pub(crate) fn get(&self, index: u32) -> &T {
        self.arena
            .get(index)
            .expect("an index handed out by the recycler names an item")
    }

    /// Items free right now: in the shared lists or cached in a thread's slot.
    pub(crate) fn available(&self) -> usize {
        self.list.fast.len() + self.list.overflow.len() + self.list.cached()
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
    fn drain(&self) -> Vec<u32> {
        std::iter::from_fn(|| self.list.pop().or_else(|| self.list.steal())).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;
    use std::thread;

    use super::*;

    fn make(value: usize) -> impl FnOnce() -> Result<usize, ()> {
        move || Ok(value)
    }

    #[test]
    fn sixteen_threads_lose_nothing_and_make_no_more_than_they_hold_at_once() {
        const THREADS: usize = 16;
        const HELD: usize = 4;
        let recycler = Arc::new(Recycler::<usize>::new());
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let recycler = recycler.clone();
                thread::spawn(move || {
                    for round in 0..2_000 {
                        let held: Vec<u32> = (0..HELD)
                            .map(|i| recycler.take(make(t * 1_000_000 + round * 10 + i)).unwrap())
                            .collect();
                        for index in held {
                            recycler.give(index);
                        }
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        // The workers have exited: what their slots cached is back in the shared list.
        let created = recycler.created() as usize;
        assert!(
            created <= THREADS * HELD,
            "made {created} for {} held",
            THREADS * HELD
        );
        assert_eq!(recycler.available(), created, "an item was lost");
        let mut indices = recycler.drain();
        indices.sort_unstable();
        assert_eq!(
            indices,
            (0..created as u32).collect::<Vec<_>>(),
            "an item was returned twice or lost"
        );
    }

    #[test]
    fn a_thread_reuses_its_own_cached_item() {
        let recycler = Recycler::<&str>::new();
        let first = recycler.take(|| Ok::<_, ()>("a")).unwrap();
        recycler.give(first);
        assert_eq!(recycler.available(), 1);
        for _ in 0..100 {
            let again = recycler.take(|| Err("must not grow")).unwrap();
            assert_eq!(again, first);
            assert_eq!(*recycler.get(again), "a");
            recycler.give(again);
        }
        assert_eq!((recycler.created(), recycler.grown()), (1, 1));
    }

    #[test]
    fn an_item_cached_by_an_idle_thread_is_stolen_instead_of_growing() {
        let recycler = Arc::new(Recycler::<u8>::new());
        let cached = Arc::new(Barrier::new(2));
        let done = Arc::new(Barrier::new(2));
        let idle = {
            let (recycler, cached, done) = (recycler.clone(), cached.clone(), done.clone());
            thread::spawn(move || {
                let index = recycler.take(|| Ok::<_, ()>(9)).unwrap();
                recycler.give(index); // cached in this thread's slot
                cached.wait();
                done.wait(); // stays alive (and idle) while the other thread takes
            })
        };
        cached.wait();
        assert_eq!(recycler.available(), 1);
        let index = recycler.take(|| Err("must steal, not grow")).unwrap();
        assert_eq!(*recycler.get(index), 9);
        assert_eq!(recycler.created(), 1);
        done.wait();
        idle.join().unwrap();
        recycler.give(index);
        assert_eq!(recycler.available(), 1);
    }

    #[test]
    fn an_exiting_thread_returns_what_its_slot_cached() {
        let recycler = Arc::new(Recycler::<u8>::new());
        let index = {
            let recycler = recycler.clone();
            thread::spawn(move || {
                let index = recycler.take(|| Ok::<_, ()>(1)).unwrap();
                recycler.give(index);
                index
            })
            .join()
            .unwrap()
        };
        assert!(
            recycler.list.slots.lock().is_empty(),
            "the slot left the registry"
        );
        assert_eq!(recycler.list.pop(), Some(index));
    }

    #[test]
    fn the_list_grows_past_its_fast_capacity_and_loses_nothing() {
        let recycler = Recycler::<usize>::new();
        let n = FAST_CAPACITY + 100;
        let held: Vec<u32> = (0..n).map(|i| recycler.take(make(i)).unwrap()).collect();
        assert_eq!((recycler.created(), recycler.grown()), (n as u64, n as u64));
        for index in held {
            recycler.give(index);
        }
        assert_eq!(recycler.available(), n);
        let mut values: Vec<usize> = recycler
            .drain()
            .into_iter()
            .map(|i| *recycler.get(i))
            .collect();
        values.sort_unstable();
        assert_eq!(values, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn a_failed_make_counts_nothing() {
        let recycler = Recycler::<u8>::new();
        assert_eq!(
            recycler.take(|| Err::<u8, _>("driver")),
            Err(TakeError::Make("driver"))
        );
        assert_eq!(recycler.created(), 0);
        recycler.stock(1).unwrap();
        let index = recycler.take(|| Err::<u8, _>("unused")).unwrap();
        assert_eq!(*recycler.get(index), 1);
        assert_eq!((recycler.created(), recycler.grown()), (1, 0));
    }

    #[test]
    fn a_new_list_never_takes_a_dropped_lists_cached_index() {
        let old = Recycler::<u8>::new();
        let index = old.take(|| Ok::<_, ()>(1)).unwrap();
        old.give(index);
        drop(old);
        let new = Recycler::<u8>::new();
        assert_eq!(new.take(|| Ok::<_, ()>(2)).map(|i| *new.get(i)), Ok(2));
        assert_eq!(new.grown(), 1);
    }
}
