//! [`Stash`]: the most recently freed blocks, parked whole by (stream, size).
//!
//! The steady state of a training or inference loop frees and re-requests the same sizes on the
//! same stream over and over. Going through best fit for each would split a block off its free
//! neighbour on allocation and merge it back on free: four free-list edits and an arena insert
//! and removal per round trip. Parking the freed block here instead, unmerged, lets the next
//! request of exactly its size on its stream take it back with one lookup.
//!
//! A parked block is free (not allocated, not active) but neither merged nor listed. Parking
//! never costs memory for long: a bucket holds one block, a new block evicts the old one into
//! the free lists, and the pools flush the whole stash before going to the upstream for a new
//! segment and before releasing segments, so fragmentation never turns into extra reservation.
//! Stream-order safety is unchanged: a parked block is handed out only on its own stream.

use super::block::BlockId;
use super::stream_uses::StreamKey;

/// Buckets in the stash: enough for the hot sizes of a few streams, small enough to flush fast.
const BUCKETS: usize = 64;

#[derive(Debug, Clone, Copy)]
struct Parked {
    stream: StreamKey,
    size: usize,
    id: BlockId,
}

/// A direct-mapped cache of freed blocks keyed by (stream, block size), one block per bucket.
#[derive(Debug)]
pub(crate) struct Stash {
    buckets: Box<[Option<Parked>; BUCKETS]>,
    len: usize,
}

impl Default for Stash {
    fn default() -> Self {
        Self {
            buckets: Box::new([None; BUCKETS]),
            len: 0,
        }
    }
}

fn bucket(stream: StreamKey, size: usize) -> usize {
    // Fibonacci hashing of both keys; sizes are multiples of 512, so drop those zero bits first.
    let mixed = (stream.as_usize() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ ((size >> 9) as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    (mixed >> (64 - BUCKETS.trailing_zeros())) as usize
}

impl Stash {
    /// Parks block `id` of `size` bytes on `stream`; returns the block it evicted, if any, which
    /// the caller must return to the free lists.
    #[inline]
    pub fn park(&mut self, stream: StreamKey, size: usize, id: BlockId) -> Option<BlockId> {
        let slot = &mut self.buckets[bucket(stream, size)];
        let evicted = slot.replace(Parked { stream, size, id }).map(|old| old.id);
        if evicted.is_none() {
            self.len += 1;
        }
        evicted
    }

    /// Takes the parked block of exactly `size` bytes on `stream`, if there is one.
    #[inline]
    pub fn take(&mut self, stream: StreamKey, size: usize) -> Option<BlockId> {
        if self.len == 0 {
            return None;
        }
        let slot = &mut self.buckets[bucket(stream, size)];
        match *slot {
            Some(parked) if parked.stream == stream && parked.size == size => {
                *slot = None;
                self.len -= 1;
                Some(parked.id)
            }
            _ => None,
        }
    }

    /// Empties the stash, returning every parked block.
    pub fn drain(&mut self) -> Vec<BlockId> {
        self.len = 0;
        self.buckets
            .iter_mut()
            .filter_map(|slot| slot.take().map(|parked| parked.id))
            .collect()
    }

    /// How many blocks are parked.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether block `id` is parked.
    #[cfg(test)]
    pub fn contains(&self, id: BlockId) -> bool {
        self.buckets.iter().flatten().any(|parked| parked.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_back_only_the_same_stream_and_size() {
        let mut stash = Stash::default();
        let (a, b) = (StreamKey::from_raw(1), StreamKey::from_raw(2));
        assert_eq!(stash.park(a, 1 << 20, 7), None);
        assert_eq!(stash.take(b, 1 << 20), None, "another stream never gets it");
        assert_eq!(stash.take(a, 2 << 20), None, "another size never gets it");
        assert_eq!(stash.take(a, 1 << 20), Some(7));
        assert_eq!(stash.take(a, 1 << 20), None, "taken once");
        assert_eq!(stash.len(), 0);
    }

    #[test]
    fn a_bucket_holds_one_block_and_evicts_the_older() {
        let mut stash = Stash::default();
        let a = StreamKey::from_raw(1);
        assert_eq!(stash.park(a, 4096, 1), None);
        assert_eq!(stash.park(a, 4096, 2), Some(1), "same key, same bucket");
        assert_eq!(stash.len(), 1);
        assert!(stash.contains(2) && !stash.contains(1));
    }

    #[test]
    fn drain_returns_everything() {
        let mut stash = Stash::default();
        let a = StreamKey::from_raw(3);
        let mut parked = 0;
        for (i, size) in (1..=40usize).map(|k| k * 512).enumerate() {
            if stash.park(a, size, i as BlockId).is_none() {
                parked += 1;
            }
        }
        assert_eq!(stash.len(), parked);
        let drained = stash.drain();
        assert_eq!(drained.len(), parked);
        assert_eq!(stash.len(), 0);
        assert_eq!(stash.take(a, 512), None);
    }
}
