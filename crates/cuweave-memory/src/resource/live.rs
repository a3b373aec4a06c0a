//! [`LiveAllocations`]: a resource's books of what it handed out and has not taken back, by
//! address: the one place every base resource checks a free against.

use cuweave_driver::memory::DevicePtr;
use dashmap::DashMap;

use crate::error::{MemoryError, Result};

/// One live allocation: the bytes asked for, whether it was allocated owned
/// ([`MemoryResource::allocate_owned`](super::MemoryResource::allocate_owned): only its owner
/// frees it), and what the resource keeps with it (what frees it).
#[derive(Debug)]
struct Live<V> {
    bytes: usize,
    owned: bool,
    value: V,
}

/// The live allocations of a resource, by address: an entry goes in at `allocate` and out at
/// the `deallocate` that frees it, so the map holds exactly what is live (a bounded registry).
/// A free is taken only when the address is live with the size it was allocated with, and by
/// the kind of caller (owner or not) it was allocated for; anything else is a typed error that
/// leaves the entry as it was, so nothing is freed twice or under its owner.
#[derive(Debug)]
pub(crate) struct LiveAllocations<V> {
    live: DashMap<DevicePtr, Live<V>>,
}

impl<V> LiveAllocations<V> {
    pub(crate) fn new() -> Self {
        Self {
            live: DashMap::new(),
        }
    }

    /// Books `ptr` as live with `bytes`, allocated `owned` or not, keeping `value` with it.
    pub(crate) fn insert(&self, ptr: DevicePtr, bytes: usize, owned: bool, value: V) {
        let previous = self.live.insert(
            ptr,
            Live {
                bytes,
                owned,
                value,
            },
        );
        // A resource never hands out a live address twice.
        debug_assert!(previous.is_none(), "address {ptr:#x} handed out twice");
    }

    /// `read` of what is kept with `ptr`, when a free of it (`bytes`, by an owner or not as
    /// `owned` says) would be taken; otherwise the error that free gets.
    ///
    /// # Errors
    /// As [`take`](Self::take).
    pub(crate) fn check<R>(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        owned: bool,
        operation: &'static str,
        read: impl FnOnce(&V) -> R,
    ) -> Result<R> {
        match self.live.get(&ptr) {
            Some(live) if live.bytes == bytes && live.owned == owned => Ok(read(&live.value)),
            Some(live) => Err(refused_free(
                ptr,
                bytes,
                Some((live.bytes, live.owned)),
                owned,
                operation,
            )),
            None => Err(refused_free(ptr, bytes, None, owned, operation)),
        }
    }

    /// Takes `ptr` off the books, when it is live with `bytes` and `owned` as it was allocated;
    /// otherwise leaves everything as it is.
    ///
    /// # Errors
    /// `UnknownAllocation` for an address not live (or freed by an owner though allocated
    /// plainly), `OwnedAllocation` for a plain free of owned memory, `SizeMismatch` for another
    /// size.
    pub(crate) fn take(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        owned: bool,
        operation: &'static str,
    ) -> Result<V> {
        let taken = self
            .live
            .remove_if(&ptr, |_, live| live.bytes == bytes && live.owned == owned);
        if let Some((_, live)) = taken {
            return Ok(live.value);
        }
        let recorded = self.live.get(&ptr).map(|live| (live.bytes, live.owned));
        Err(refused_free(ptr, bytes, recorded, owned, operation))
    }

    /// `read` of each live allocation (address, bytes asked for, owned, what is kept), in no
    /// particular order. Each shard of the map is locked while it is read, never two at once.
    pub(crate) fn collect<R>(&self, read: impl Fn(DevicePtr, usize, bool, &V) -> R) -> Vec<R> {
        self.live
            .iter()
            .map(|entry| {
                let live = entry.value();
                read(*entry.key(), live.bytes, live.owned, &live.value)
            })
            .collect()
    }

    /// How many allocations are live.
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether none is.
    pub(crate) fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Takes every live allocation off the books.
    pub(crate) fn drain(&mut self) -> Vec<V> {
        std::mem::take(&mut self.live)
            .into_iter()
            .map(|(_, live)| live.value)
            .collect()
    }
}

/// The error for a free (`owned`: by its owner, through
/// [`MemoryResource::deallocate_owned`](super::MemoryResource::deallocate_owned)) that did not
/// take `ptr` off a resource's books: `recorded` is the size it is known by and whether it was
/// allocated owned, if it is there at all. Memory allocated owned is only ever freed by its
/// owner, and the other way round.
fn refused_free(
    ptr: DevicePtr,
    bytes: usize,
    recorded: Option<(usize, bool)>,
    owned: bool,
    operation: &'static str,
) -> MemoryError {
    match recorded {
        Some((_, true)) if !owned => MemoryError::OwnedAllocation { operation, ptr },
        Some((_, false)) if owned => MemoryError::UnknownAllocation { operation, ptr },
        Some((expected, _)) => MemoryError::SizeMismatch {
            operation,
            expected,
            actual: bytes,
        },
        None => MemoryError::UnknownAllocation { operation, ptr },
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use rstest::rstest;

    use super::*;

    const OP: &str = "test";

    /// Counts its drops: an entry freed exactly once.
    #[derive(Debug)]
    struct Probe(Arc<AtomicUsize>);

    impl Drop for Probe {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[rstest]
    #[case::right(0x1000, 256, false, Ok(7))]
    #[case::wrong_size(0x1000, 255, false, Err(MemoryError::SizeMismatch { operation: OP, expected: 256, actual: 255 }))]
    #[case::unknown(0x2000, 256, false, Err(MemoryError::UnknownAllocation { operation: OP, ptr: 0x2000 }))]
    #[case::interior(0x1001, 256, false, Err(MemoryError::UnknownAllocation { operation: OP, ptr: 0x1001 }))]
    #[case::owned_freed_by_address(0x3000, 256, false, Err(MemoryError::OwnedAllocation { operation: OP, ptr: 0x3000 }))]
    #[case::owner_freeing_a_plain_one(0x1000, 256, true, Err(MemoryError::UnknownAllocation { operation: OP, ptr: 0x1000 }))]
    #[case::owner_freeing_its_own(0x3000, 256, true, Ok(9))]
    fn a_bad_free_is_typed_and_leaves_the_allocation_live(
        #[case] ptr: DevicePtr,
        #[case] bytes: usize,
        #[case] owned: bool,
        #[case] outcome: Result<u32>,
    ) {
        let books = LiveAllocations::new();
        books.insert(0x1000, 256, false, 7u32);
        books.insert(0x3000, 256, true, 9u32);
        assert_eq!(books.check(ptr, bytes, owned, OP, |&v| v), outcome);
        let taken = books.take(ptr, bytes, owned, OP);
        assert_eq!(taken, outcome);
        if taken.is_err() {
            assert_eq!(books.len(), 2, "a refused free leaves it live");
            books.take(0x1000, 256, false, OP).unwrap();
            books.take(0x3000, 256, true, OP).unwrap();
        } else if ptr == 0x1000 {
            books.take(0x3000, 256, true, OP).unwrap();
        } else {
            books.take(0x1000, 256, false, OP).unwrap();
        }
        assert_eq!(
            books.take(0x1000, 256, false, OP),
            Err(MemoryError::UnknownAllocation {
                operation: OP,
                ptr: 0x1000
            }),
            "a second free is refused"
        );
        assert!(books.is_empty());
    }

    #[test]
    fn holds_exactly_the_live_allocations_over_100k_cycles() {
        const SHARDS: usize = 4;
        const WINDOW: u64 = 8;
        // Four shards, so that the bound on the tables does not depend on this machine's cores.
        let books = LiveAllocations {
            live: DashMap::with_shard_amount(SHARDS),
        };
        let freed = Arc::new(AtomicUsize::new(0));
        let mut most = 0;
        for i in 0..100_000u64 {
            // Fresh addresses every time, as a cache handing out blocks of many segments does.
            books.insert(i * 512, 512, false, Probe(Arc::clone(&freed)));
            if i >= WINDOW {
                drop(books.take((i - WINDOW) * 512, 512, false, OP).unwrap());
            }
            assert_eq!(books.len() as u64, (i + 1).min(WINDOW));
            most = most.max(books.live.capacity());
        }
        assert_eq!(freed.load(Ordering::SeqCst), 100_000 - WINDOW as usize);
        // A shard never holds more than WINDOW entries, so its table never passes 32 buckets
        // (28 slots): removed entries' slots are reclaimed by rehashing in place, not growth.
        assert!(
            most <= SHARDS * 28,
            "the map grew with the cycles, not with what is live: {most} slots"
        );
        let mut books = books;
        assert_eq!(books.drain().len(), WINDOW as usize);
        assert_eq!(
            freed.load(Ordering::SeqCst),
            100_000,
            "draining the books hands back what was live"
        );
    }

    #[test]
    fn concurrent_frees_of_one_address_free_it_once() {
        let books = Arc::new(LiveAllocations::new());
        let freed = Arc::new(AtomicUsize::new(0));
        for round in 0..200u64 {
            books.insert(round, 64, false, Probe(Arc::clone(&freed)));
            let winners: usize = (0..4)
                .map(|_| {
                    let books = Arc::clone(&books);
                    std::thread::spawn(move || {
                        usize::from(books.take(round, 64, false, OP).is_ok())
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|thread| thread.join().unwrap())
                .sum();
            assert_eq!(winners, 1, "exactly one free succeeds");
        }
        assert_eq!(freed.load(Ordering::SeqCst), 200);
        assert!(books.is_empty());
    }
}
