//! Size classes: how a request is rounded, which pool serves it, how big a segment it gets, and
//! when a block is worth splitting. The constants are PyTorch's (`c10/cuda/CUDACachingAllocator`).

use crate::error::{MemoryError, Result};

const MIB: usize = 1 << 20;

/// Every block size is a multiple of this many bytes, and no block is smaller.
pub const MIN_BLOCK_SIZE: usize = 512;

/// Requests of at most this many bytes (after rounding) are served by the small pool.
pub const SMALL_SIZE: usize = MIB;

/// The size of every small-pool segment: small blocks are carved out of 2 MiB.
pub const SMALL_SEGMENT: usize = 2 * MIB;

/// Large requests below this size get a [`LARGE_SEGMENT`] to share with later requests.
pub const MIN_LARGE_ALLOC: usize = 10 * MIB;

/// The segment size for large requests below [`MIN_LARGE_ALLOC`].
pub const LARGE_SEGMENT: usize = 20 * MIB;

/// Larger requests get a segment of their own size rounded up to a multiple of this.
pub const ROUND_LARGE: usize = 2 * MIB;

/// Which of the two pools a block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    /// Requests of at most [`SMALL_SIZE`], carved from [`SMALL_SEGMENT`] segments.
    Small,
    /// Requests above [`SMALL_SIZE`].
    Large,
}

impl PoolKind {
    /// The pool that serves a request of `rounded` bytes (already passed through [`round_size`]).
    pub fn for_size(rounded: usize) -> Self {
        if rounded <= SMALL_SIZE {
            Self::Small
        } else {
            Self::Large
        }
    }

    /// Whether a free block of this pool is worth splitting when `remaining` bytes would be left
    /// over: any whole minimum block in the small pool, more than [`SMALL_SIZE`] in the large one
    /// (a smaller tail of a large block would only serve small requests, which have their own pool).
    pub fn should_split(self, remaining: usize) -> bool {
        match self {
            Self::Small => remaining >= MIN_BLOCK_SIZE,
            Self::Large => remaining > SMALL_SIZE,
        }
    }
}

/// Rounds a request up to the block granularity ([`MIN_BLOCK_SIZE`]).
///
/// # Errors
/// [`MemoryError::ZeroLength`] for zero bytes; [`MemoryError::OutOfMemory`] when rounding would
/// overflow (no device has that much memory).
#[inline]
pub fn round_size(bytes: usize) -> Result<usize> {
    if bytes == 0 {
        return Err(MemoryError::ZeroLength {
            operation: "CachingAllocator::allocate",
        });
    }
    round_up(bytes, MIN_BLOCK_SIZE).ok_or(MemoryError::OutOfMemory {
        requested: bytes,
        allocated: 0,
        reserved: 0,
        limit: None,
    })
}

/// The size of the segment to ask the upstream for when no cached block fits `rounded` bytes.
///
/// Small requests share a [`SMALL_SEGMENT`]; large ones below [`MIN_LARGE_ALLOC`] share a
/// [`LARGE_SEGMENT`]; larger ones get their size rounded up to [`ROUND_LARGE`]. `None` on overflow.
pub fn segment_size(rounded: usize) -> Option<usize> {
    if rounded <= SMALL_SIZE {
        Some(SMALL_SEGMENT)
    } else if rounded < MIN_LARGE_ALLOC {
        Some(LARGE_SEGMENT)
    } else {
        round_up(rounded, ROUND_LARGE)
    }
}

/// The smallest segment a large request of `rounded` bytes can live in, when that is smaller
/// than [`segment_size`]'s (requests between [`SMALL_SIZE`] and [`MIN_LARGE_ALLOC`], which
/// share a [`LARGE_SEGMENT`]): what the out-of-memory retry asks for last, since under a budget
/// the room for the request itself may be there when a shared segment's is not.
pub fn smallest_segment(rounded: usize) -> Option<usize> {
    if rounded <= SMALL_SIZE || rounded >= MIN_LARGE_ALLOC {
        return None;
    }
    round_up(rounded, ROUND_LARGE).filter(|&bytes| bytes < LARGE_SEGMENT)
}

fn round_up(bytes: usize, multiple: usize) -> Option<usize> {
    bytes.checked_next_multiple_of(multiple)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(1, 512)]
    #[case(511, 512)]
    #[case(512, 512)]
    #[case(513, 1024)]
    #[case(MIB, MIB)]
    #[case(MIB + 1, MIB + 512)]
    #[case(10 * MIB - 1, 10 * MIB)]
    fn rounds_to_512_bytes(#[case] bytes: usize, #[case] rounded: usize) {
        assert_eq!(round_size(bytes).unwrap(), rounded);
    }

    #[test]
    fn zero_and_overflowing_requests_are_typed_errors() {
        assert!(matches!(round_size(0), Err(MemoryError::ZeroLength { .. })));
        assert!(matches!(
            round_size(usize::MAX),
            Err(MemoryError::OutOfMemory {
                requested: usize::MAX,
                ..
            })
        ));
        assert_eq!(segment_size(usize::MAX - 100), None);
    }

    #[rstest]
    #[case(512, PoolKind::Small, SMALL_SEGMENT)]
    #[case(MIB, PoolKind::Small, SMALL_SEGMENT)]
    #[case(MIB + 512, PoolKind::Large, LARGE_SEGMENT)]
    #[case(5 * MIB, PoolKind::Large, LARGE_SEGMENT)]
    #[case(10 * MIB - 512, PoolKind::Large, LARGE_SEGMENT)]
    #[case(10 * MIB, PoolKind::Large, 10 * MIB)]
    #[case(11 * MIB, PoolKind::Large, 12 * MIB)]
    #[case(64 * MIB + 512, PoolKind::Large, 66 * MIB)]
    fn pool_and_segment_follow_pytorch(
        #[case] rounded: usize,
        #[case] pool: PoolKind,
        #[case] segment: usize,
    ) {
        assert_eq!(PoolKind::for_size(rounded), pool);
        assert_eq!(segment_size(rounded), Some(segment));
    }

    #[rstest]
    #[case(PoolKind::Small, 0, false)]
    #[case(PoolKind::Small, 511, false)]
    #[case(PoolKind::Small, 512, true)]
    #[case(PoolKind::Large, MIB, false)]
    #[case(PoolKind::Large, MIB + 512, true)]
    fn splits_only_worthwhile_remainders(
        #[case] pool: PoolKind,
        #[case] remaining: usize,
        #[case] split: bool,
    ) {
        assert_eq!(pool.should_split(remaining), split);
    }
}
