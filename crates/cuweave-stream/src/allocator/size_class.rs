//! Size classes of the [`StreamOrderedAllocator`](super::StreamOrderedAllocator): requests are
//! rounded up so that freed blocks fit later requests of the same class.

/// Smallest block handed out.
pub const MIN_BLOCK: usize = 512;
/// Up to this size, blocks are powers of two.
pub const SMALL_LIMIT: usize = 1 << 20;
/// Above [`SMALL_LIMIT`], blocks are multiples of this.
pub const LARGE_GRANULE: usize = 2 << 20;

/// Number of size classes: one per power of two from 512 B to 1 MiB, and one for all large blocks.
pub const CLASS_COUNT: usize = 13;

/// The size `bytes` is rounded to: at least 512 B, the next power of two up to 1 MiB, else the
/// next multiple of 2 MiB. `None` on overflow.
pub fn rounded_size(bytes: usize) -> Option<usize> {
    if bytes <= SMALL_LIMIT {
        Some(bytes.max(MIN_BLOCK).next_power_of_two())
    } else {
        bytes.checked_next_multiple_of(LARGE_GRANULE)
    }
}

/// The class of a rounded size: 0 for 512 B, 1 for 1 KiB, ... 11 for 1 MiB, 12 for larger.
pub fn size_class(rounded: usize) -> usize {
    if rounded > SMALL_LIMIT {
        CLASS_COUNT - 1
    } else {
        (rounded.max(MIN_BLOCK).trailing_zeros() - MIN_BLOCK.trailing_zeros()) as usize
    }
}

/// The largest size of class `class` (for reports); `None` for the unbounded large class.
pub fn class_limit(class: usize) -> Option<usize> {
    (class < CLASS_COUNT - 1).then(|| MIN_BLOCK << class)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(1, 512, 0)]
    #[case(512, 512, 0)]
    #[case(513, 1024, 1)]
    #[case(4000, 4096, 3)]
    #[case(1 << 20, 1 << 20, 11)]
    #[case((1 << 20) + 1, 2 << 20, 12)]
    #[case(5 << 20, 6 << 20, 12)]
    fn requests_round_into_classes(
        #[case] bytes: usize,
        #[case] rounded: usize,
        #[case] class: usize,
    ) {
        assert_eq!(rounded_size(bytes), Some(rounded));
        assert_eq!(size_class(rounded), class);
    }

    #[test]
    fn huge_requests_overflow_to_none() {
        assert_eq!(rounded_size(usize::MAX - 5), None);
    }

    #[test]
    fn class_limits_bound_their_class() {
        for class in 0..CLASS_COUNT - 1 {
            let limit = class_limit(class).unwrap();
            assert_eq!(size_class(limit), class);
        }
        assert_eq!(class_limit(CLASS_COUNT - 1), None);
    }
}
