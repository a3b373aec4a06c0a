//! [`OwnerSlot`]: one thread's cached free item, which other threads may steal.
//!
//! The protocol that makes the pool's fast path a single read-modify-write per round trip:
//!
//! - only the slot's **owner** (the one thread whose thread-local cache holds it) ever stores
//!   an index into it, and only when it is empty ([`put`](OwnerSlot::put): a plain load and a
//!   plain store, no read-modify-write);
//! - **anyone** empties it with one atomic swap ([`take`](OwnerSlot::take)): the owner to reuse
//!   its cached item, another thread to steal it before the pool would grow.
//!
//! Since nobody else can make an empty slot full, the owner's load-then-store cannot overwrite
//! an index; since every removal is a swap, an index is taken by exactly one thread. The loom
//! models in `loom_tests` check both under every interleaving.

// loom's atomics only in the driver's own test build under `--cfg loom` (loom is a
// dev-dependency); every other build, including a `--cfg loom` build of the crates above, uses
// std's.
#[cfg(all(loom, test))]
use loom::sync::atomic::{AtomicU32, Ordering};
#[cfg(not(all(loom, test)))]
use std::sync::atomic::{AtomicU32, Ordering};

/// The value of an empty slot.
pub(crate) const EMPTY: u32 = u32::MAX;

/// A cached item's index, owned by one thread, stealable by all.
#[derive(Debug)]
pub(crate) struct OwnerSlot {
    index: AtomicU32,
}

impl OwnerSlot {
    pub(crate) fn new() -> Self {
        Self {
            index: AtomicU32::new(EMPTY),
        }
    }

    /// Caches `index` if the slot is empty; `false` (nothing stored) if it is full.
    ///
    /// Only the owning thread may call this.
    #[inline]
    pub(crate) fn put(&self, index: u32) -> bool {
        debug_assert_ne!(index, EMPTY);
        if self.index.load(Ordering::Relaxed) != EMPTY {
            return false;
        }
        // Nobody but the owner stores a non-empty value, so the slot is still empty here.
        #[cfg(not(all(loom, test)))]
        self.index.store(index, Ordering::Release);
        // loom 0.7 lets a plain store slip between the read and the write of a concurrent swap
        // (tokio-rs/loom#254, a modelling bug: C++'s RMW atomicity forbids it), so the models
        // write with a swap, which returns the `EMPTY` just checked and is otherwise the same.
        #[cfg(all(loom, test))]
        self.index.swap(index, Ordering::Release);
        true
    }

    /// Empties the slot, returning the index it held.
    #[inline]
    pub(crate) fn take(&self) -> Option<u32> {
        match self.index.swap(EMPTY, Ordering::Acquire) {
            EMPTY => None,
            index => Some(index),
        }
    }

    /// Whether an index is cached (a snapshot).
    pub(crate) fn is_full(&self) -> bool {
        self.index.load(Ordering::Relaxed) != EMPTY
    }
}
