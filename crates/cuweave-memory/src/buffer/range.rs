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
/// buffer's tracker; every buffer synchronizes its tracker before it frees its memory. So the
/// memory a span names outlives every queued operation on it.
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
}
