//! How to fill a buffer with one value of any plain-data type, in as few driver calls as possible.
//!
//! The driver sets memory a byte (`cuMemsetD8`), a 16-bit half (`cuMemsetD16`) or a 32-bit word
//! (`cuMemsetD32`) at a time. A value whose bytes are all equal is a byte memset; a value whose
//! repeated bytes are 4-byte periodic (any `u32`/`f32`, a `u16` filling a whole number of words,
//! a `u64` with equal halves, …) is a word memset, but only where the range starts on a 4-byte
//! boundary and covers whole words: the driver refuses a misaligned word memset
//! (`CUDA_ERROR_INVALID_VALUE`), and a view of a buffer starts wherever its first element does
//! (`slice_mut(1..5)` of a `u16` buffer: 2 bytes in). Where the word memset does not apply, a
//! value whose repeated bytes are 2-byte periodic (any `u16`/`f16`/`bf16`, a `u32` with equal
//! halves, …) at a 2-byte-aligned start and an even length is a half memset. Words are
//! preferred to halves (fewer, wider stores), and bytes come first.
//!
//! Anything else is a [`FillPlan::Pattern`]: one chunk of copies of the value is copied from the
//! host, then doubled device-to-device until the range is full. Those copies take any byte
//! address and length, so the pattern path is correct at every alignment; but it stages the
//! value in pageable host memory and frees it from a host function, so a stream capture cannot
//! hold it (the memsets it can).

/// Bytes of host-staged pattern copied before doubling on the device.
pub(crate) const PATTERN_CHUNK_BYTES: usize = 64 * 1024;

/// The driver calls a fill takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FillPlan {
    /// `cuMemsetD8` with this byte.
    Bytes(u8),
    /// `cuMemsetD32` with this word (as the device stores it, little-endian).
    Words(u32),
    /// `cuMemsetD16` with this half (as the device stores it, little-endian).
    Halves(u16),
    /// A host-staged chunk of the value, doubled by device-to-device copies.
    Pattern,
}

impl FillPlan {
    /// The plan for filling `total_bytes` (a whole number of values) at device address `start`
    /// with repetitions of `value`'s bytes.
    pub(crate) fn for_value(value: &[u8], start: u64, total_bytes: usize) -> Self {
        let Some(&first) = value.first() else {
            return Self::Pattern;
        };
        if value.iter().all(|&byte| byte == first) {
            return Self::Bytes(first);
        }
        // The repeated value is both `len`-periodic and, for a word memset, 4-periodic: so it
        // must be gcd(len, 4)-periodic, and the word is its first four bytes (the range starts
        // at a value's first byte).
        let period = gcd(value.len(), 4);
        if periodic(value, period) && start.is_multiple_of(4) && total_bytes.is_multiple_of(4) {
            let word = [0, 1, 2, 3].map(|index| value[index % period]);
            return Self::Words(u32::from_le_bytes(word));
        }
        // Likewise gcd(len, 2)-periodic for a half memset; period 1 (an odd-sized value) would
        // be all bytes equal, handled above.
        let period = gcd(value.len(), 2);
        if period == 2
            && periodic(value, period)
            && start.is_multiple_of(2)
            && total_bytes.is_multiple_of(2)
        {
            return Self::Halves(u16::from_le_bytes([value[0], value[1]]));
        }
        Self::Pattern
    }
}

/// How many values the first, host-staged chunk of a pattern fill holds.
pub(crate) fn pattern_chunk_len(value_size: usize, len: usize) -> usize {
    (PATTERN_CHUNK_BYTES / value_size.max(1)).clamp(1, len.max(1))
}

/// The device-to-device copies that double a filled prefix of `chunk` values until `len` are
/// filled: `(destination offset, count)` in values, each copying from offset 0.
pub(crate) fn doubling_steps(chunk: usize, len: usize) -> Vec<(usize, usize)> {
    let mut steps = Vec::new();
    let mut filled = chunk.min(len);
    while filled < len {
        let count = filled.min(len - filled);
        steps.push((filled, count));
        filled += count;
    }
    steps
}

/// Whether `value`'s bytes repeat every `period` bytes.
fn periodic(value: &[u8], period: usize) -> bool {
    value
        .iter()
        .enumerate()
        .all(|(index, &byte)| byte == value[index % period])
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case::zero_u32(&0u32.to_le_bytes(), 16, FillPlan::Bytes(0))]
    #[case::all_ones_u64(&u64::MAX.to_le_bytes(), 16, FillPlan::Bytes(0xff))]
    #[case::u8(&[7], 3, FillPlan::Bytes(7))]
    #[case::u32(&0x0102_0304u32.to_le_bytes(), 8, FillPlan::Words(0x0102_0304))]
    #[case::f32(&1.5f32.to_le_bytes(), 4, FillPlan::Words(1.5f32.to_bits()))]
    #[case::u16_even(&0x0102u16.to_le_bytes(), 8, FillPlan::Words(0x0102_0102))]
    #[case::u16_odd_count(&0x0102u16.to_le_bytes(), 6, FillPlan::Halves(0x0102))]
    #[case::u64_equal_halves(&0x0a0b_0c0d_0a0b_0c0du64.to_le_bytes(), 16, FillPlan::Words(0x0a0b_0c0d))]
    #[case::u64(&0x1122_3344_5566_7788u64.to_le_bytes(), 16, FillPlan::Pattern)]
    #[case::three_bytes(&[1, 2, 3], 12, FillPlan::Pattern)]
    #[case::six_bytes_u16_pattern(&[1, 2, 1, 2, 1, 2], 12, FillPlan::Words(0x0201_0201))]
    fn plans_use_the_cheapest_memset(
        #[case] value: &[u8],
        #[case] total: usize,
        #[case] plan: FillPlan,
    ) {
        assert_eq!(FillPlan::for_value(value, ALIGNED, total), plan);
    }

    /// A device allocation's start (the driver aligns them to at least 256 bytes).
    const ALIGNED: u64 = 0x7f00_0000_0000;

    /// Views of a buffer of elements of `size` bytes at every element offset: a word memset is
    /// chosen only where the view starts on a 4-byte boundary and covers whole words, a half
    /// memset elsewhere (every such view starts on a 2-byte boundary and covers whole halves),
    /// and the word or half it sets is the value's bytes as they repeat from the view's start.
    #[rstest]
    fn word_memsets_only_start_on_word_boundaries(
        #[values(1, 2, 4, 8)] size: usize,
        #[values(0, 1, 2, 3, 4, 5)] offset: usize,
        #[values(1, 2, 3, 4, 5)] count: usize,
    ) {
        // Periodic with period 2 (never all equal): a word memset wherever alignment allows.
        let value: Vec<u8> = (0..size)
            .map(|i| if i % 2 == 0 { 0x11 } else { 0x22 })
            .collect();
        let start = ALIGNED + (offset * size) as u64;
        let bytes = count * size;
        let plan = FillPlan::for_value(&value, start, bytes);
        if size == 1 {
            assert_eq!(plan, FillPlan::Bytes(0x11));
            return;
        }
        let aligned = start.is_multiple_of(4) && bytes.is_multiple_of(4);
        if aligned {
            assert_eq!(plan, FillPlan::Words(0x2211_2211), "{start:#x} + {bytes}");
        } else {
            assert_eq!(plan, FillPlan::Halves(0x2211), "{start:#x} + {bytes}");
        }
    }

    #[rstest]
    // The reviewer's case: `DeviceBuffer::<u16>` of 10, `slice_mut(1..5)`: 8 bytes from byte 2.
    #[case::u16_view_at_element_1(&0x0102u16.to_le_bytes(), ALIGNED + 2, 8, FillPlan::Halves(0x0102))]
    #[case::u16_view_at_element_2(&0x0102u16.to_le_bytes(), ALIGNED + 4, 8, FillPlan::Words(0x0102_0102))]
    #[case::f32_view(&1.5f32.to_le_bytes(), ALIGNED + 12, 4, FillPlan::Words(1.5f32.to_bits()))]
    #[case::u8_view_odd(&[7], ALIGNED + 3, 5, FillPlan::Bytes(7))]
    #[case::zero_u16_odd_view(&0u16.to_le_bytes(), ALIGNED + 2, 6, FillPlan::Bytes(0))]
    #[case::six_bytes_at_6(&[1, 2, 1, 2, 1, 2], ALIGNED + 6, 12, FillPlan::Halves(0x0201))]
    #[case::f64_view(&2.5f64.to_le_bytes(), ALIGNED + 8, 24, FillPlan::Pattern)]
    fn views_off_word_boundaries_take_halves_or_the_pattern_path(
        #[case] value: &[u8],
        #[case] start: u64,
        #[case] total: usize,
        #[case] plan: FillPlan,
    ) {
        assert_eq!(FillPlan::for_value(value, start, total), plan);
    }

    /// Where the word memset does not apply, a 2-periodic value at a 2-byte-aligned start over
    /// whole halves is a half memset; words stay preferred where they apply, bytes first.
    #[rstest]
    // The brief's view: `DeviceBuffer::<u16>` `slice_mut(1..6)`: 10 bytes from byte 2.
    #[case::u16_view_1_to_6(&0x1234u16.to_le_bytes(), ALIGNED + 2, 10, FillPlan::Halves(0x1234))]
    #[case::f16_one_odd_count(&0x3c00u16.to_le_bytes(), ALIGNED, 6, FillPlan::Halves(0x3c00))]
    #[case::bf16_view(&0x3f80u16.to_le_bytes(), ALIGNED + 6, 4, FillPlan::Halves(0x3f80))]
    #[case::u16_single(&0xbeefu16.to_le_bytes(), ALIGNED + 2, 2, FillPlan::Halves(0xbeef))]
    #[case::u32_equal_halves_misaligned(&0xabcd_abcdu32.to_le_bytes(), ALIGNED + 2, 8, FillPlan::Halves(0xabcd))]
    #[case::u64_equal_quarters_at_2(&0x0506_0506_0506_0506u64.to_le_bytes(), ALIGNED + 2, 16, FillPlan::Halves(0x0506))]
    #[case::u16_aligned_even_count_prefers_words(&0x1234u16.to_le_bytes(), ALIGNED + 4, 8, FillPlan::Words(0x1234_1234))]
    #[case::u32_equal_halves_aligned_prefers_words(&0xabcd_abcdu32.to_le_bytes(), ALIGNED, 8, FillPlan::Words(0xabcd_abcd))]
    #[case::u16_equal_bytes_prefers_bytes(&0x7777u16.to_le_bytes(), ALIGNED + 2, 6, FillPlan::Bytes(0x77))]
    #[case::u32_unequal_halves_misaligned(&0x1234_5678u32.to_le_bytes(), ALIGNED + 2, 8, FillPlan::Pattern)]
    #[case::u16_odd_start(&0x1234u16.to_le_bytes(), ALIGNED + 1, 4, FillPlan::Pattern)]
    #[case::three_bytes_at_2(&[1, 2, 3], ALIGNED + 2, 6, FillPlan::Pattern)]
    fn two_periodic_values_take_halves_where_words_do_not_apply(
        #[case] value: &[u8],
        #[case] start: u64,
        #[case] total: usize,
        #[case] plan: FillPlan,
    ) {
        assert_eq!(FillPlan::for_value(value, start, total), plan);
    }

    /// What each plan stores, byte by byte, for `total` bytes.
    fn render(plan: FillPlan, value: &[u8], total: usize) -> Vec<u8> {
        let unit: Vec<u8> = match plan {
            FillPlan::Bytes(byte) => vec![byte],
            FillPlan::Words(word) => word.to_le_bytes().to_vec(),
            FillPlan::Halves(half) => half.to_le_bytes().to_vec(),
            FillPlan::Pattern => value.to_vec(),
        };
        unit.iter().copied().cycle().take(total).collect()
    }

    /// Every plan, for values of every small size and period at every offset and count, stores
    /// exactly the repeated value, and asks each memset only for the alignment the driver
    /// accepts.
    #[rstest]
    fn every_plan_stores_the_repeated_value_at_an_alignment_the_driver_accepts(
        #[values(1, 2, 3, 4, 6, 8, 12, 16)] size: usize,
        #[values(1, 2, 3, 4, 5)] period: usize,
        #[values(0, 1, 2, 3)] offset: usize,
        #[values(1, 2, 3, 5)] count: usize,
    ) {
        let value: Vec<u8> = (0..size).map(|i| 0x10 + (i % period) as u8).collect();
        let start = ALIGNED + (offset * size) as u64;
        let total = count * size;
        let plan = FillPlan::for_value(&value, start, total);
        let expected: Vec<u8> = value.iter().copied().cycle().take(total).collect();
        assert_eq!(render(plan, &value, total), expected, "{plan:?}");
        match plan {
            FillPlan::Words(_) => assert!(
                start.is_multiple_of(4) && total.is_multiple_of(4),
                "{plan:?}"
            ),
            FillPlan::Halves(_) => {
                assert!(
                    start.is_multiple_of(2) && total.is_multiple_of(2),
                    "{plan:?}"
                );
                assert!(
                    !(start.is_multiple_of(4) && total.is_multiple_of(4)),
                    "a half memset where a word memset applies"
                );
            }
            FillPlan::Bytes(_) | FillPlan::Pattern => {}
        }
        // Nothing 2-periodic at a 2-byte-aligned start over whole halves is left to the pattern
        // path (which a capture cannot hold).
        let two_periodic = size.is_multiple_of(2) && periodic(&value, 2);
        if two_periodic && start.is_multiple_of(2) && total.is_multiple_of(2) {
            assert_ne!(plan, FillPlan::Pattern);
        }
    }

    #[test]
    fn word_plans_reproduce_the_bytes() {
        // What the device stores for a word memset must equal the repeated value.
        for value in [[1u8, 2, 1, 2], [9, 8, 7, 6]] {
            let FillPlan::Words(word) = FillPlan::for_value(&value, ALIGNED, 8) else {
                panic!("expected a word plan")
            };
            assert_eq!(word.to_le_bytes(), value);
        }
    }

    #[rstest]
    #[case(1, 1, vec![])]
    #[case(4, 4, vec![])]
    #[case(8, 4, vec![])]
    #[case(1, 5, vec![(1, 1), (2, 2), (4, 1)])]
    #[case(3, 10, vec![(3, 3), (6, 4)])]
    fn doubling_fills_exactly(
        #[case] chunk: usize,
        #[case] len: usize,
        #[case] steps: Vec<(usize, usize)>,
    ) {
        let got = doubling_steps(chunk, len);
        assert_eq!(got, steps);
        let covered: usize = chunk.min(len) + got.iter().map(|&(_, count)| count).sum::<usize>();
        assert_eq!(covered, len);
        assert!(got.iter().all(|&(offset, count)| count <= offset));
    }

    #[test]
    fn chunks_stay_within_the_buffer_and_the_stage() {
        assert_eq!(pattern_chunk_len(8, 3), 3);
        assert_eq!(pattern_chunk_len(8, 1 << 30), PATTERN_CHUNK_BYTES / 8);
        assert_eq!(pattern_chunk_len(1 << 20, 10), 1);
    }
}
