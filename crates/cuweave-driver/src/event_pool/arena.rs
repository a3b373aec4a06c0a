//! [`Arena`]: an append-only, lock-free store of the pool's items, addressed by a `u32` index.
//!
//! The free lists and the per-thread slots pass indices (which fit in an atomic word) instead of
//! the items themselves; a handle reads its item through the arena with two acquire loads and
//! no read-modify-write. Items stay in place until the arena is dropped.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// Entries in the first segment; segment `k` holds `FIRST_SEGMENT << k`.
const FIRST_SEGMENT: usize = 64;
/// Segments: enough for every `u32` index below [`Arena::MAX_LEN`].
const SEGMENTS: usize = 27;

/// The segment and the offset in it of entry `index`.
#[inline]
fn locate(index: usize) -> (usize, usize) {
    let scaled = index / FIRST_SEGMENT + 1;
    let segment = (usize::BITS - 1 - scaled.leading_zeros()) as usize;
    (segment, index - FIRST_SEGMENT * ((1 << segment) - 1))
}

/// Items appended once and read by index from any thread, never moved or removed.
///
/// Segments are allocated when first needed, each twice the size of the one before, so the
/// arena grows without moving what it holds (a handle's reference stays valid) and without a
/// lock (`OnceLock` initialises each segment and each entry exactly once).
#[derive(Debug)]
pub(crate) struct Arena<T> {
    segments: [OnceLock<Box<[OnceLock<T>]>>; SEGMENTS],
    len: AtomicU32,
}

impl<T> Arena<T> {
    /// The most items an arena holds (indices are `u32`, and `u32::MAX` marks "none").
    pub(crate) const MAX_LEN: u32 = u32::MAX - 1;

    pub(crate) fn new() -> Self {
        Self {
            segments: std::array::from_fn(|_| OnceLock::new()),
            len: AtomicU32::new(0),
        }
    }

    /// Appends `item` and returns its index, or gives it back when the arena is full.
    pub(crate) fn push(&self, item: T) -> Result<u32, T> {
        let Ok(index) = self
            .len
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |len| {
                (len < Self::MAX_LEN).then_some(len + 1)
            })
        else {
            return Err(item);
        };
        let (segment, offset) = locate(index as usize);
        let entries = self.segments[segment].get_or_init(|| {
            (0..FIRST_SEGMENT << segment)
                .map(|_| OnceLock::new())
                .collect()
        });
        // The index is this call's alone (reserved above), so the entry is empty.
        match entries[offset].set(item) {
            Ok(()) => Ok(index),
            Err(item) => Err(item),
        }
    }

    /// The item at `index`, if one was appended there.
    #[inline]
    pub(crate) fn get(&self, index: u32) -> Option<&T> {
        let (segment, offset) = locate(index as usize);
        self.segments.get(segment)?.get()?.get(offset)?.get()
    }

    /// Items appended so far (an entry being written may not be readable yet).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed) as usize
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::thread;

    use super::*;

    #[test]
    fn segments_tile_the_index_space_without_gaps() {
        let mut expected = (0, 0);
        for index in 0..FIRST_SEGMENT * 255 {
            assert_eq!(locate(index), expected, "index {index}");
            expected.1 += 1;
            if expected.1 == FIRST_SEGMENT << expected.0 {
                expected = (expected.0 + 1, 0);
            }
        }
        let (last_segment, _) = locate(Arena::<u8>::MAX_LEN as usize);
        assert!(last_segment < SEGMENTS);
    }

    #[test]
    fn items_keep_their_index_and_address_while_the_arena_grows() {
        let arena = Arena::new();
        let first = arena.push(String::from("0")).unwrap();
        let first_address = std::ptr::from_ref(arena.get(first).unwrap());
        for i in 1..5_000 {
            assert_eq!(arena.push(i.to_string()).unwrap(), i);
        }
        assert_eq!(arena.len(), 5_000);
        assert_eq!(std::ptr::from_ref(arena.get(first).unwrap()), first_address);
        for i in 0..5_000u32 {
            assert_eq!(arena.get(i).unwrap(), &i.to_string());
        }
        assert_eq!(arena.get(5_000), None);
        assert_eq!(arena.get(u32::MAX), None);
    }

    #[test]
    fn threads_appending_together_get_distinct_indices() {
        let arena = Arc::new(Arena::new());
        let workers: Vec<_> = (0..8u32)
            .map(|t| {
                let arena = Arc::clone(&arena);
                thread::spawn(move || {
                    (0..1_000u32)
                        .map(|i| (arena.push(t * 1_000 + i).unwrap(), t * 1_000 + i))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut indices = Vec::new();
        for worker in workers {
            for (index, value) in worker.join().unwrap() {
                assert_eq!(arena.get(index), Some(&value));
                indices.push(index);
            }
        }
        indices.sort_unstable();
        assert_eq!(indices, (0..8_000).collect::<Vec<_>>());
    }
}
