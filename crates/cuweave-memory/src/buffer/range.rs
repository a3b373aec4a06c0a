//! Checked element ranges and the byte spans they turn into.
//!
//! Every offset and length a caller gives is checked here, before any driver call: zero lengths
//! are [`MemoryError::ZeroLength`], ranges past the end (or overflowing) are
//! [`MemoryError::OutOfRange`], and sizes that overflow `usize` when turned into bytes are
//! [`MemoryError::Misaligned`].

use std::ops::Range;

use cuweave_driver::memory::DevicePtr;

use crate::element::byte_len;
use crate::error::{MemoryError, Result};

/// `offset..offset + len` if it is nonempty and lies inside `0..capacity`.
pub(crate) fn check_range(
    operation: &'static str,
    offset: usize,
    len: usize,
    capacity: usize,
) -> Result<Range<usize>> {
    if len == 0 {
        return Err(MemoryError::ZeroLength { operation });
    }
    offset
        .checked_add(len)
        .filter(|&end| end <= capacity)
        .map(|end| offset..end)
        .ok_or(MemoryError::OutOfRange {
            operation,
            offset,
            len,
            capacity,
        })
}

/// An error unless two sides of a copy have the same length.
pub(crate) fn check_same_len(
    operation: &'static str,
    expected: usize,
    actual: usize,
) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(MemoryError::SizeMismatch {
            operation,
            expected,
            actual,
        })
    }
}

/// The bytes of an allocation of `len` elements of `T`: nonzero and without overflow.
pub(crate) fn allocation_bytes<T>(operation: &'static str, len: usize) -> Result<usize> {
    let bytes = byte_len::<T>(len).ok_or(MemoryError::Misaligned {
        operation,
        bytes: len.saturating_mul(size_of::<T>()),
        element_size: size_of::<T>(),
    })?;
    if bytes == 0 {
        return Err(MemoryError::ZeroLength { operation });
    }
    Ok(bytes)
}

/// A byte range of device-accessible memory inside one live allocation.
///
/// Crate invariant: a span is made only by [`DeviceSpan::of_elements`] (or by the unified
/// module from a checked managed range) from a buffer that the caller borrows, and work on it
/// is queued only inside [`crate::buffer::tracker::run`], which records the stream on the
/// buffer's tracker; every buffer either synchronizes its tracker before it frees its memory or
/// (a device buffer) hands the tracker's events to its allocator, which reuses or frees the block
/// only once they have completed. So the memory a span names outlives every queued operation on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceSpan {
    ptr: DevicePtr,
    bytes: usize,
}

impl DeviceSpan {
    /// The span of elements `offset..offset + len` (each `element_size` bytes) of a buffer of
    /// `capacity` elements starting at `base`.
    pub(crate) fn of_elements(
        operation: &'static str,
        base: DevicePtr,
        capacity: usize,
        element_size: usize,
        offset: usize,
        len: usize,
    ) -> Result<Self> {
        let range = check_range(operation, offset, len, capacity)?;
        // The allocation's byte size did not overflow and the range lies inside it.
        Ok(Self {
            ptr: base + (range.start * element_size) as DevicePtr,
            bytes: len * element_size,
        })
    }

    /// A span the caller has already checked (the unified module's managed ranges).
    pub(crate) fn checked(ptr: DevicePtr, bytes: usize) -> Self {
        Self { ptr, bytes }
    }

    /// The start address.
    pub(crate) fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The length in bytes (never zero).
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The first `bytes` bytes after `skip` bytes, both within the span.
    pub(crate) fn sub(&self, skip: usize, bytes: usize) -> Self {
        debug_assert!(skip + bytes <= self.bytes);
        Self {
            ptr: self.ptr + skip as DevicePtr,
            bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case::whole(0, 10, 10, Ok(0..10))]
    #[case::tail(9, 1, 10, Ok(9..10))]
    #[case::middle(3, 4, 10, Ok(3..7))]
    #[case::zero_length(0, 0, 10, Err("zero"))]
    #[case::zero_length_past_end(20, 0, 10, Err("zero"))]
    #[case::one_past(5, 6, 10, Err("range"))]
    #[case::offset_past(11, 1, 10, Err("range"))]
    #[case::offset_at_end(10, 1, 10, Err("range"))]
    #[case::overflow(usize::MAX, 2, 10, Err("range"))]
    fn ranges_are_checked(
        #[case] offset: usize,
        #[case] len: usize,
        #[case] capacity: usize,
        #[case] expected: std::result::Result<Range<usize>, &str>,
    ) {
        let got = check_range("test", offset, len, capacity);
        match expected {
            Ok(range) => assert_eq!(got.unwrap(), range),
            Err("zero") => assert_eq!(got, Err(MemoryError::ZeroLength { operation: "test" })),
            Err(_) => assert_eq!(
                got,
                Err(MemoryError::OutOfRange {
                    operation: "test",
                    offset,
                    len,
                    capacity
                })
            ),
        }
    }

    #[test]
    fn allocation_sizes_refuse_zero_and_overflow() {
        assert_eq!(allocation_bytes::<u32>("a", 3), Ok(12));
        assert!(matches!(
            allocation_bytes::<u32>("a", 0),
            Err(MemoryError::ZeroLength { .. })
        ));
        assert!(matches!(
            allocation_bytes::<()>("a", 5),
            Err(MemoryError::ZeroLength { .. })
        ));
        assert!(matches!(
            allocation_bytes::<u64>("a", usize::MAX / 4),
            Err(MemoryError::Misaligned {
                element_size: 8,
                ..
            })
        ));
    }

    #[test]
    fn lengths_must_match() {
        assert!(check_same_len("c", 4, 4).is_ok());
        assert_eq!(
            check_same_len("c", 4, 3),
            Err(MemoryError::SizeMismatch {
                operation: "c",
                expected: 4,
                actual: 3
            })
        );
    }

    #[test]
    fn spans_are_element_scaled() {
        let span = DeviceSpan::of_elements("s", 0x1000, 16, 4, 2, 3).unwrap();
        assert_eq!((span.ptr(), span.bytes()), (0x1008, 12));
        assert_eq!(span.sub(4, 8), DeviceSpan::checked(0x100c, 8));
        assert!(DeviceSpan::of_elements("s", 0x1000, 16, 4, 15, 2).is_err());
    }

    mod props {
        //! Argument checking fuzzed with proptest: offsets, lengths and capacities anywhere in
        //! `usize`, near its end most of all. Every call returns a range inside the buffer or a
        //! typed error, never panics, and never a span shorter than asked for.

        use proptest::prelude::*;

        use super::*;
        use crate::caching::size_class::{round_size, segment_size};
        use crate::pinned_pool::block_size;
        use crate::proptest_config::config;

        /// Mostly values near the ends of `usize`, where overflow hides.
        fn edgy() -> impl Strategy<Value = usize> {
            prop_oneof![
                2 => 0usize..=64,
                2 => (usize::MAX - 64)..=usize::MAX,
                1 => (isize::MAX as usize - 64)..=(isize::MAX as usize + 64),
                1 => any::<usize>(),
            ]
        }

        proptest! {
            #![proptest_config(config(2000))]

            #[test]
            fn ranges_are_inside_or_typed_errors(offset in edgy(), len in edgy(), capacity in edgy()) {
                match check_range("fuzz", offset, len, capacity) {
                    Ok(range) => {
                        prop_assert_eq!(range.start, offset);
                        prop_assert_eq!(range.len(), len);
                        prop_assert!(len > 0 && range.end <= capacity);
                    }
                    Err(MemoryError::ZeroLength { .. }) => prop_assert_eq!(len, 0),
                    Err(MemoryError::OutOfRange { .. }) => {
                        prop_assert!(offset.checked_add(len).is_none_or(|end| end > capacity));
                    }
                    Err(error) => prop_assert!(false, "unexpected {error}"),
                }
            }

            #[test]
            fn spans_cover_exactly_the_elements_asked_for(
                offset in edgy(),
                len in edgy(),
                capacity in edgy(),
                element_size in prop::sample::select(vec![1usize, 2, 4, 8, 16, 1024]),
            ) {
                // A buffer exists only when its byte size is at most isize::MAX
                // (allocation_bytes), and the driver placed it where it fits the address space.
                let fits = capacity
                    .checked_mul(element_size)
                    .is_some_and(|bytes| bytes <= isize::MAX as usize);
                if !fits {
                    return Ok(());
                }
                let base = 0x1000u64;
                match DeviceSpan::of_elements("fuzz", base, capacity, element_size, offset, len) {
                    Ok(span) => {
                        prop_assert_eq!(span.bytes(), len * element_size);
                        prop_assert_eq!(span.ptr(), base + (offset * element_size) as u64);
                        prop_assert!((offset + len) * element_size <= capacity * element_size);
                    }
                    Err(MemoryError::ZeroLength { .. } | MemoryError::OutOfRange { .. }) => {}
                    Err(error) => prop_assert!(false, "unexpected {error}"),
                }
            }

            #[test]
            fn allocation_sizes_never_overflow(len in edgy()) {
                for (size, bytes) in [
                    (1usize, allocation_bytes::<u8>("fuzz", len)),
                    (4, allocation_bytes::<u32>("fuzz", len)),
                    (8, allocation_bytes::<u64>("fuzz", len)),
                    (16, allocation_bytes::<[u64; 2]>("fuzz", len)),
                ] {
                    match bytes {
                        Ok(bytes) => prop_assert_eq!(Some(bytes), len.checked_mul(size)),
                        Err(MemoryError::ZeroLength { .. }) => prop_assert_eq!(len, 0),
                        Err(MemoryError::Misaligned { .. }) => {
                            prop_assert!(len.checked_mul(size).is_none_or(|b| b > isize::MAX as usize));
                        }
                        Err(error) => prop_assert!(false, "unexpected {error}"),
                    }
                }
            }

            #[test]
            fn size_classes_never_round_down(bytes in edgy()) {
                match round_size(bytes) {
                    Ok(rounded) => {
                        prop_assert!(rounded >= bytes && rounded % 512 == 0);
                        if let Some(segment) = segment_size(rounded) {
                            prop_assert!(segment >= rounded);
                        }
                    }
                    Err(MemoryError::ZeroLength { .. }) => prop_assert_eq!(bytes, 0),
                    Err(MemoryError::OutOfMemory { requested, .. }) => prop_assert_eq!(requested, bytes),
                    Err(error) => prop_assert!(false, "unexpected {error}"),
                }
                match block_size(bytes) {
                    Some(block) => prop_assert!(block >= bytes && block <= isize::MAX as usize),
                    None => prop_assert!(bytes == 0 || bytes > isize::MAX as usize - (2 << 20)),
                }
            }
        }
    }
}
