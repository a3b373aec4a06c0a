//! Size classes: the capacity a pinned block is pinned with for a requested byte count.
//!
//! Requests are rounded up so that blocks of nearby sizes are interchangeable: a power of two from
//! [`MIN_BLOCK_BYTES`] up to [`LARGE_THRESHOLD`], and above it a multiple of
//! [`LARGE_GRANULARITY`] (doubling a 300 MiB request would pin 212 MiB for nothing).

/// The smallest block the pool pins: one page on every host CUDA supports.
pub const MIN_BLOCK_BYTES: usize = 4 << 10;

/// The largest request rounded to a power of two; larger ones round to [`LARGE_GRANULARITY`].
pub const LARGE_THRESHOLD: usize = 256 << 20;

/// The granularity of requests above [`LARGE_THRESHOLD`]: one huge page.
pub const LARGE_GRANULARITY: usize = 2 << 20;

/// The capacity of the block that serves a request of `bytes`: its size class.
///
/// `None` when `bytes` is zero or the rounded size does not fit in `usize`.
///
/// ```
/// use cuweave_memory::pinned_pool::block_size;
///
/// assert_eq!(block_size(1), Some(4096));
/// assert_eq!(block_size(5000), Some(8192));
/// assert_eq!(block_size((256 << 20) + 1), Some(258 << 20));
/// assert_eq!(block_size(0), None);
/// ```
pub fn block_size(bytes: usize) -> Option<usize> {
    if bytes == 0 {
        None
    } else if bytes <= LARGE_THRESHOLD {
        Some(bytes.next_power_of_two().max(MIN_BLOCK_BYTES))
    } else {
        bytes
            .checked_next_multiple_of(LARGE_GRANULARITY)
            .filter(|&rounded| rounded <= isize::MAX as usize)
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;

    #[rstest]
    #[case::one_byte(1, 4 * KIB)]
    #[case::just_under_a_page(4 * KIB - 1, 4 * KIB)]
    #[case::one_page(4 * KIB, 4 * KIB)]
    #[case::just_over_a_page(4 * KIB + 1, 8 * KIB)]
    #[case::not_a_power(5000, 8 * KIB)]
    #[case::one_mebibyte(MIB, MIB)]
    #[case::just_over_one_mebibyte(MIB + 1, 2 * MIB)]
    #[case::sixteen_mebibytes(16 * MIB, 16 * MIB)]
    #[case::just_under_sixteen(16 * MIB - 1, 16 * MIB)]
    #[case::just_over_128(128 * MIB + 1, 256 * MIB)]
    #[case::threshold(LARGE_THRESHOLD, LARGE_THRESHOLD)]
    #[case::just_over_threshold(LARGE_THRESHOLD + 1, 258 * MIB)]
    #[case::large_exact_multiple(300 * MIB, 300 * MIB)]
    #[case::large_odd(300 * MIB + 7, 302 * MIB)]
    #[case::one_gibibyte_plus(1024 * MIB + 1, 1026 * MIB)]
    fn rounds_requests_to_their_class(#[case] bytes: usize, #[case] class: usize) {
        assert_eq!(block_size(bytes), Some(class));
    }

    #[rstest]
    #[case::zero(0)]
    #[case::max(usize::MAX)]
    #[case::past_isize_max(isize::MAX as usize)]
    fn refuses_zero_and_overflowing_requests(#[case] bytes: usize) {
        assert_eq!(block_size(bytes), None);
    }

    #[test]
    fn every_class_holds_its_request_and_is_page_or_huge_page_aligned() {
        let mut bytes = 1usize;
        while bytes < 4 << 30 {
            for request in [bytes - 1, bytes, bytes + 1].into_iter().filter(|&b| b > 0) {
                let class = block_size(request).expect("in range");
                assert!(class >= request, "{class} < {request}");
                assert_eq!(class % MIN_BLOCK_BYTES, 0);
                if class > LARGE_THRESHOLD {
                    assert_eq!(class % LARGE_GRANULARITY, 0);
                    assert!(class - request < LARGE_GRANULARITY);
                } else {
                    assert!(class.is_power_of_two());
                }
            }
            bytes = bytes * 3 / 2 + 1;
        }
    }
}
