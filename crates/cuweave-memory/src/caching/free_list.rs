//! [`FreeLists`]: where free blocks wait, and best fit among them for one stream.
//!
//! Small-pool blocks are at most one 2 MiB segment, so their sizes fall into 4096 exact classes
//! of 512 B. Each stream has a list per class and a two-level bitmap of the non-empty ones: best
//! fit (the smallest class at or above the request that has a block) is two bit scans, and
//! inserting or removing a block is a few pointer updates on links kept in the blocks themselves.
//! That keeps the hot path (small allocations, freed and reused on one stream) free of tree
//! rebalancing and heap allocation. Among blocks of one size the most recently freed comes first.
//!
//! Large-pool sizes are unbounded, so large blocks sit in one ordered map keyed by
//! `(stream, size, address)`, as in PyTorch: best fit is the first key at or after
//! `(stream, size, 0)` still on that stream, ties going to the lowest address.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use super::block::{Arena, BlockId, NIL};
use super::size_class::{LARGE_SEGMENT, MIN_BLOCK_SIZE, PoolKind, SMALL_SEGMENT};
use super::stream_uses::StreamKey;

/// Exact size classes of the small pool: one per 512 B up to a whole segment.
const CLASSES: usize = SMALL_SEGMENT / MIN_BLOCK_SIZE;
const WORDS: usize = CLASSES / 64;
const _: () = assert!(WORDS <= 64, "the summary word must cover every bitmap word");

/// The class of a small block or request of `size` bytes (a multiple of 512, at most 2 MiB).
fn class_of(size: usize) -> usize {
    size / MIN_BLOCK_SIZE - 1
}

/// One stream's small-pool lists.
#[derive(Debug)]
struct Buckets {
    /// First block of each class's list, or [`NIL`].
    heads: Box<[BlockId]>,
    /// Bit `c % 64` of word `c / 64` is set when class `c` has a block.
    words: [u64; WORDS],
    /// Bit `w` is set when `words[w]` is not zero.
    summary: u64,
}

impl Buckets {
    fn new() -> Self {
        Self {
            heads: vec![NIL; CLASSES].into_boxed_slice(),
            words: [0; WORDS],
            summary: 0,
        }
    }

    /// The smallest non-empty class at or above `start`.
    fn first_at_or_above(&self, start: usize) -> Option<usize> {
        let word = start / 64;
        let bits = self.words[word] & (!0u64 << (start % 64));
        if bits != 0 {
            return Some(word * 64 + bits.trailing_zeros() as usize);
        }
        let higher = self.summary & (!0u64).checked_shl(word as u32 + 1).unwrap_or(0);
        if higher == 0 {
            return None;
        }
        let word = higher.trailing_zeros() as usize;
        Some(word * 64 + self.words[word].trailing_zeros() as usize)
    }

    fn mark(&mut self, class: usize, non_empty: bool) {
        let (word, bit) = (class / 64, 1u64 << (class % 64));
        if non_empty {
            self.words[word] |= bit;
            self.summary |= 1 << word;
        } else {
            self.words[word] &= !bit;
            if self.words[word] == 0 {
                self.summary &= !(1 << word);
            }
        }
    }
}

/// A multiplicative hash for stream handles (pointers): one multiply instead of SipHash on the
/// hot path; the map only ever holds the program's own streams.
#[derive(Debug, Default)]
pub(crate) struct StreamHasher(u64);

impl Hasher for StreamHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_usize(&mut self, value: usize) {
        self.0 = (self.0 ^ value as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type LargeKey = (StreamKey, usize, u64);

/// Every free block, small and large, of every stream.
#[derive(Debug)]
pub(crate) struct FreeLists {
    /// Index into `small` of each stream's lists.
    slots: HashMap<StreamKey, u32, BuildHasherDefault<StreamHasher>>,
    small: Vec<Buckets>,
    /// Small segments per slot: a slot without segments has no blocks and can be reused.
    segments: Vec<u32>,
    /// Slots no stream uses.
    vacant: Vec<u32>,
    /// The last stream looked up and its slot: programs mostly allocate on one stream at a time.
    last: Option<(StreamKey, u32)>,
    large: BTreeMap<LargeKey, BlockId>,
    len: usize,
    /// [`AllocatorConfig::max_split_size`](super::AllocatorConfig::max_split_size), or
    /// `usize::MAX` for none.
    max_split: usize,
}

impl Default for FreeLists {
    fn default() -> Self {
        Self {
            slots: HashMap::default(),
            small: Vec::new(),
            segments: Vec::new(),
            vacant: Vec::new(),
            last: None,
            large: BTreeMap::new(),
            len: 0,
            max_split: usize::MAX,
        }
    }
}

impl FreeLists {
    /// Sets the size from which large blocks are never split (PyTorch's `max_split_size`):
    /// a request below it never takes such a block, and a request at or above it takes one only
    /// when at most [`LARGE_SEGMENT`] larger.
    pub fn set_max_split(&mut self, bytes: usize) {
        self.max_split = bytes;
    }

    /// The size from which large blocks are never split (`usize::MAX` for none).
    #[inline]
    pub fn max_split(&self) -> usize {
        self.max_split
    }

    /// The index of `stream`'s small-pool lists, for a new small segment of that stream (whose
    /// blocks carry it); made on first use.
    pub fn acquire_slot(&mut self, stream: StreamKey) -> u32 {
        let slot = match self.slots.get(&stream) {
            Some(&slot) => slot,
            None => {
                let slot = self.vacant.pop().unwrap_or_else(|| {
                    self.small.push(Buckets::new());
                    self.segments.push(0);
                    u32::try_from(self.small.len() - 1).expect("fewer than 2^32 streams")
                });
                self.slots.insert(stream, slot);
                slot
            }
        };
        self.segments[slot as usize] += 1;
        slot
    }

    /// Notes that a small segment of `stream` in `slot` was released; the slot is recycled with
    /// its last segment, so streams that come and go do not leave lists behind.
    pub fn release_slot(&mut self, stream: StreamKey, slot: u32) {
        let count = &mut self.segments[slot as usize];
        *count -= 1;
        if *count == 0 {
            debug_assert!(
                self.small[slot as usize].summary == 0,
                "no blocks, none free"
            );
            self.slots.remove(&stream);
            self.vacant.push(slot);
            // The cached lookup must not outlive the slot: the next stream to take it would
            // otherwise have its free blocks handed out on this stream.
            if self.last == Some((stream, slot)) {
                self.last = None;
            }
        }
    }

    /// Lists the free block `id`.
    pub fn insert(&mut self, arena: &mut Arena, id: BlockId) {
        self.len += 1;
        let block = arena.block(id);
        match block.pool {
            PoolKind::Large => {
                self.large.insert((block.stream, block.size, block.ptr), id);
            }
            PoolKind::Small => {
                let (slot, class) = (block.slot as usize, class_of(block.size));
                let buckets = &mut self.small[slot];
                let head = buckets.heads[class];
                buckets.heads[class] = id;
                if head == NIL {
                    buckets.mark(class, true);
                } else {
                    arena.block_mut(head).free_prev = id;
                }
                let block = arena.block_mut(id);
                block.free_prev = NIL;
                block.free_next = head;
            }
        }
    }

    /// Takes the listed block `id` off its list.
    pub fn remove(&mut self, arena: &mut Arena, id: BlockId) {
        self.len -= 1;
        let block = arena.block(id);
        match block.pool {
            PoolKind::Large => {
                let removed = self.large.remove(&(block.stream, block.size, block.ptr));
                debug_assert_eq!(removed, Some(id), "a free block is in its free list");
            }
            PoolKind::Small => {
                let (prev, next) = (block.free_prev, block.free_next);
                let (slot, class) = (block.slot as usize, class_of(block.size));
                if next != NIL {
                    arena.block_mut(next).free_prev = prev;
                }
                let buckets = &mut self.small[slot];
                if prev != NIL {
                    arena.block_mut(prev).free_next = next;
                } else {
                    debug_assert_eq!(buckets.heads[class], id);
                    buckets.heads[class] = next;
                    if next == NIL {
                        buckets.mark(class, false);
                    }
                }
            }
        }
    }

    /// Takes the best-fitting free block of `stream` for `rounded` bytes off its list.
    pub fn take_best_fit(
        &mut self,
        arena: &mut Arena,
        stream: StreamKey,
        rounded: usize,
    ) -> Option<BlockId> {
        let id = match PoolKind::for_size(rounded) {
            PoolKind::Large => {
                let (&key, &id) = self.large.range((stream, rounded, 0)..).next()?;
                if key.0 != stream {
                    return None;
                }
                // Best fit is the smallest block that fits, so when it is refused every larger
                // one would be too (PyTorch's `get_free_block`).
                let size = key.1;
                if size >= self.max_split
                    && (rounded < self.max_split || size >= rounded.saturating_add(LARGE_SEGMENT))
                {
                    return None;
                }
                id
            }
            PoolKind::Small => {
                let slot = match self.last {
                    Some((last, slot)) if last == stream => slot,
                    _ => {
                        let slot = *self.slots.get(&stream)?;
                        self.last = Some((stream, slot));
                        slot
                    }
                };
                let buckets = &self.small[slot as usize];
                let class = buckets.first_at_or_above(class_of(rounded))?;
                buckets.heads[class]
            }
        };
        self.remove(arena, id);
        Some(id)
    }

    /// How many blocks are listed.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block `id` is listed where its size and stream say it should be.
    #[cfg(test)]
    pub fn contains(&self, arena: &Arena, id: BlockId) -> bool {
        let block = arena.block(id);
        match block.pool {
            PoolKind::Large => self.large.get(&(block.stream, block.size, block.ptr)) == Some(&id),
            PoolKind::Small => {
                let buckets = &self.small[block.slot as usize];
                let mut cursor = buckets.heads[class_of(block.size)];
                while cursor != NIL {
                    if cursor == id {
                        return self.slots.get(&block.stream) == Some(&block.slot);
                    }
                    cursor = arena.block(cursor).free_next;
                }
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caching::block::Block;
    use rstest::rstest;

    #[rstest]
    #[case(&[], 0, None)]
    #[case(&[5], 0, Some(5))]
    #[case(&[5], 5, Some(5))]
    #[case(&[5], 6, None)]
    #[case(&[3, 64, 700], 4, Some(64))]
    #[case(&[3, 64, 700], 65, Some(700))]
    #[case(&[63, 4095], 64, Some(4095))]
    #[case(&[4095], 4095, Some(4095))]
    fn finds_the_smallest_class_at_or_above(
        #[case] classes: &[usize],
        #[case] start: usize,
        #[case] found: Option<usize>,
    ) {
        let mut buckets = Buckets::new();
        for &class in classes {
            buckets.mark(class, true);
        }
        assert_eq!(buckets.first_at_or_above(start), found);
    }

    #[test]
    fn clearing_the_last_class_of_a_word_clears_its_summary_bit() {
        let mut buckets = Buckets::new();
        buckets.mark(70, true);
        buckets.mark(71, true);
        buckets.mark(70, false);
        assert_eq!(buckets.first_at_or_above(0), Some(71));
        buckets.mark(71, false);
        assert_eq!((buckets.summary, buckets.first_at_or_above(0)), (0, None));
    }

    #[test]
    fn small_lists_insert_and_remove_anywhere() {
        let mut arena = Arena::default();
        let mut lists = FreeLists::default();
        let stream = StreamKey::from_raw(9);
        let slot = lists.acquire_slot(stream);
        assert_eq!(lists.acquire_slot(stream), slot, "one slot per stream");
        let ids: Vec<BlockId> = (0..3)
            .map(|i| {
                let mut block = Block::segment(0x1000 * (i + 1), 4096, stream, PoolKind::Small);
                block.slot = slot;
                arena.insert(block)
            })
            .collect();
        for &id in &ids {
            lists.insert(&mut arena, id);
        }
        assert!(ids.iter().all(|&id| lists.contains(&arena, id)));
        lists.remove(&mut arena, ids[1]);
        assert!(!lists.contains(&arena, ids[1]));
        assert_eq!(lists.len(), 2);
        assert_eq!(
            lists.take_best_fit(&mut arena, stream, 512),
            Some(ids[2]),
            "LIFO"
        );
        assert_eq!(lists.take_best_fit(&mut arena, stream, 4096), Some(ids[0]));
        assert_eq!(lists.take_best_fit(&mut arena, stream, 512), None);
        assert_eq!(
            lists.take_best_fit(&mut arena, StreamKey::from_raw(1), 512),
            None
        );
    }

    /// A free small block of `stream` in `slot`, listed.
    fn listed_block(
        arena: &mut Arena,
        lists: &mut FreeLists,
        stream: StreamKey,
        slot: u32,
        ptr: u64,
    ) -> BlockId {
        let mut block = Block::segment(ptr, 4096, stream, PoolKind::Small);
        block.slot = slot;
        let id = arena.insert(block);
        lists.insert(arena, id);
        id
    }

    #[test]
    fn a_recycled_slot_is_never_reached_through_its_old_streams_cached_lookup() {
        let mut arena = Arena::default();
        let mut lists = FreeLists::default();
        let (a, b) = (StreamKey::from_raw(1), StreamKey::from_raw(2));
        let slot = lists.acquire_slot(a);
        let id = listed_block(&mut arena, &mut lists, a, slot, 0x1000);
        // A's lookup is cached here.
        assert_eq!(lists.take_best_fit(&mut arena, a, 512), Some(id));
        lists.release_slot(a, slot);
        // B takes the recycled slot and lists a block in it.
        let b_slot = lists.acquire_slot(b);
        assert_eq!(b_slot, slot, "the vacant slot is reused");
        let b_id = listed_block(&mut arena, &mut lists, b, b_slot, 0x9000);
        assert_eq!(
            lists.take_best_fit(&mut arena, a, 512),
            None,
            "A has no slot: B's block must not be handed out on A"
        );
        assert!(lists.contains(&arena, b_id));
        // A coming back gets a slot of its own, reached through the cache correctly.
        let a_slot = lists.acquire_slot(a);
        assert_ne!(a_slot, b_slot);
        let a_id = listed_block(&mut arena, &mut lists, a, a_slot, 0x2000);
        assert_eq!(lists.take_best_fit(&mut arena, a, 512), Some(a_id));
        assert_eq!(lists.take_best_fit(&mut arena, b, 512), Some(b_id));
    }
}
