//! [`SharedParts`]: owned host memory lent to several threads at once, each writing its own
//! disjoint part, then handed back whole.
//!
//! An ordered pipelined upload (`cuweave-transfer`'s staging) fills one large pinned block with
//! several host threads at once, a piece each, and then queues the whole block as one copy: one
//! large copy on one stream keeps the copy engine busy with no per-copy gap, and several threads
//! filling it keep the first copy from waiting for one thread's `memcpy`. Safe Rust can split a
//! `&mut [T]` among threads only within one scope; here the block must move on (into the copy)
//! once its last piece is written, at a time no scope knows. `SharedParts` holds the memory,
//! hands each part out at most once as `&mut [T]` tied to a shared borrow of itself, and gives
//! the memory back only by value ([`into_inner`](SharedParts::into_inner)), which the borrow
//! checker allows only after every part's borrow has ended.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::element::Element;
use crate::pinned_pool::TypedPinnedBlock;

mod sealed {
    pub trait Sealed {}
}

/// Host memory whose elements stay at one address while the value that owns them moves: a
/// `Vec`'s heap buffer, a pinned pool block. [`SharedParts`] relies on it (sealed: the
/// guarantee is this crate's to give).
pub trait StableSlice<T>: sealed::Sealed {
    /// The elements, writable.
    fn stable_mut(&mut self) -> &mut [T];
}

impl<T> sealed::Sealed for Vec<T> {}
impl<T> StableSlice<T> for Vec<T> {
    fn stable_mut(&mut self) -> &mut [T] {
        self
    }
}

impl<T: Element> sealed::Sealed for TypedPinnedBlock<T> {}
impl<T: Element> StableSlice<T> for TypedPinnedBlock<T> {
    fn stable_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
}

/// Owned host memory (`H`: a [`TypedPinnedBlock`] or a `Vec`) cut into parts of
/// `part` elements (the last may be shorter), each lent out at most once, to any thread, as
/// `&mut [T]`; [`into_inner`](Self::into_inner) gives the memory back once no part is borrowed.
///
/// ```
/// use cuweave_memory::parts::SharedParts;
///
/// let parts = SharedParts::new(vec![0u32; 10], 4);
/// assert_eq!(parts.count(), 3);
/// std::thread::scope(|scope| {
///     for i in 0..parts.count() {
///         let parts = &parts;
///         scope.spawn(move || parts.take(i).unwrap().fill(i as u32 + 1));
///     }
/// });
/// assert!(parts.take(0).is_none()); // each part is lent once
/// assert_eq!(parts.into_inner(), [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]);
/// ```
pub struct SharedParts<H, T> {
    /// The owner of the memory: only moved, never touched, until `into_inner`.
    inner: H,
    /// Its elements' start, taken once from `inner` (which is never reborrowed while parts are
    /// out, so every part is derived from this one pointer).
    start: *mut T,
    len: usize,
    part: usize,
    taken: Box<[AtomicBool]>,
}

// SAFETY: the value hands out `&mut [T]` to disjoint ranges, each at most once (an atomic swap
// decides who gets it), so sharing it between threads gives each part one writer: what
// `slice::split_at_mut` would give if the threads were scoped. `T: Send` lets a part be written
// from another thread; `H: Send` lets the owner go back to whichever thread calls `into_inner`.
unsafe impl<H: Send, T: Send> Sync for SharedParts<H, T> {}
// SAFETY: moving it moves `inner` (which keeps its elements where they are: `StableSlice`) and
// the pointer to them; nothing is tied to the creating thread.
unsafe impl<H: Send, T: Send> Send for SharedParts<H, T> {}

impl<H: StableSlice<T>, T> SharedParts<H, T> {
    /// Lends `inner`'s elements in parts of `part` elements (at least one).
    pub fn new(mut inner: H, part: usize) -> Self {
        let part = part.max(1);
        let elements = inner.stable_mut();
        let (start, len) = (elements.as_mut_ptr(), elements.len());
        let count = len.div_ceil(part);
        Self {
            inner,
            start,
            len,
            part,
            taken: (0..count).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    /// How many parts there are.
    pub fn count(&self) -> usize {
        self.taken.len()
    }

    /// The element range of part `index`, if there is one.
    pub fn range(&self, index: usize) -> Option<std::ops::Range<usize>> {
        (index < self.count()).then(|| {
            let start = index * self.part;
            start..(start + self.part).min(self.len)
        })
    }

    /// Part `index`, writable; `None` when there is no such part or it was lent already.
    #[allow(clippy::mut_from_ref)]
    pub fn take(&self, index: usize) -> Option<&mut [T]> {
        let range = self.range(index)?;
        if self.taken[index].swap(true, Ordering::AcqRel) {
            return None;
        }
        // SAFETY: `start` points at `len` initialised elements owned by `inner`, which stays
        // alive and in place (it is not touched, and `StableSlice` memory does not move with
        // it) for as long as `self` is borrowed; `range` lies within `0..len`; the swap above
        // lends this range once, and ranges of different indices do not overlap, so no other
        // reference to these elements exists until the borrow of `self` ends.
        Some(unsafe { std::slice::from_raw_parts_mut(self.start.add(range.start), range.len()) })
    }

    /// The memory back, with whatever the parts' writers left in it (every borrow of a part has
    /// ended: they borrowed `self`).
    pub fn into_inner(self) -> H {
        self.inner
    }
}

impl<H, T> std::fmt::Debug for SharedParts<H, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedParts")
            .field("len", &self.len)
            .field("part", &self.part)
            .field("parts", &self.taken.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_fill_disjoint_parts_once_and_the_memory_comes_back_whole() {
        let len = 1000;
        let parts = SharedParts::new(vec![0u64; len], 64);
        assert_eq!(parts.count(), 16);
        assert_eq!(parts.range(15), Some(960..1000));
        assert_eq!(parts.range(16), None);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                let parts = &parts;
                scope.spawn(move || {
                    for i in 0..parts.count() {
                        if let Some(part) = parts.take(i) {
                            let start = parts.range(i).unwrap().start;
                            for (j, x) in part.iter_mut().enumerate() {
                                *x = (start + j) as u64;
                            }
                        }
                    }
                });
            }
        });
        for i in 0..parts.count() {
            assert!(parts.take(i).is_none(), "part {i} lent twice");
        }
        assert!(parts.take(99).is_none());
        let back = parts.into_inner();
        assert_eq!(back, (0..len as u64).collect::<Vec<_>>());
    }

    #[test]
    fn a_part_of_zero_is_one_and_empty_memory_has_no_parts() {
        let parts = SharedParts::new(vec![7u8; 3], 0);
        assert_eq!(parts.count(), 3);
        parts.take(1).unwrap()[0] = 9;
        assert_eq!(parts.into_inner(), [7, 9, 7]);
        let empty = SharedParts::new(Vec::<u8>::new(), 8);
        assert_eq!(empty.count(), 0);
        assert!(empty.take(0).is_none());
    }

    #[test]
    fn the_memory_does_not_move_when_the_parts_move() {
        let parts = SharedParts::new(vec![1u16; 256], 100);
        let first = parts.take(0).unwrap().as_ptr();
        let moved = Box::new(parts);
        let again = std::thread::spawn(move || {
            let last = moved.take(2).unwrap();
            last.fill(5);
            *moved
        })
        .join()
        .unwrap();
        let back = again.into_inner();
        assert_eq!(back.as_ptr(), first);
        assert_eq!(&back[200..], &[5u16; 56][..]);
    }
}
