//! [`BufferSlice`] and [`BufferSliceMut`]: typed views of part of a buffer.
//!
//! A view is a range of a buffer's elements that every [`Buffer`] operation accepts: copies
//! (either side), fills, [`TrackedLaunch`](crate::TrackedLaunch) arguments, and the transfer
//! layer, which takes any [`Buffer`]. Making one is a range check: no driver call, no
//! allocation.
//!
//! Uses are tracked per byte range of the buffer: work on disjoint views runs at once on
//! different streams, while views that overlap are ordered as uses of one buffer are (a read
//! after the writes it overlaps, a write after every use it overlaps). A shared view
//! ([`Buffer::slice`]) is read-only: writing through it is
//! [`MemoryError::ReadOnlyView`](crate::MemoryError::ReadOnlyView); [`Buffer::slice_mut`]
//! borrows the buffer exclusively and may write.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};

use cuweave_driver::memory::DevicePtr;

use super::common::{Buffer, CoreRef, sealed::Sealed};
use super::range::check_range;
use crate::element::Element;
use crate::error::Result;

/// `range` of a part of `len` elements as (start, length), checked.
pub(crate) fn resolve(
    operation: &'static str,
    range: impl RangeBounds<usize>,
    len: usize,
) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&start) => start,
        Bound::Excluded(&start) => start.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&end) => end.saturating_add(1),
        Bound::Excluded(&end) => end,
        Bound::Unbounded => len,
    };
    let count = end.saturating_sub(start);
    if end < start {
        return Err(crate::MemoryError::OutOfRange {
            operation,
            offset: start,
            len: 0,
            capacity: len,
        });
    }
    let range = check_range(operation, start, count, len)?;
    Ok((range.start, range.len()))
}

/// The parts of a view: its buffer's core narrowed to the view's elements.
#[derive(Debug, Clone, Copy)]
struct ViewParts<'a> {
    core: CoreRef<'a>,
    ptr: DevicePtr,
    start: usize,
    len: usize,
}

impl<'a> ViewParts<'a> {
    fn new(core: CoreRef<'a>, start: usize, len: usize) -> Self {
        Self {
            core,
            ptr: core.ptr() + (start * core.element_size()) as DevicePtr,
            start,
            len,
        }
    }

    fn core(&self, writable: bool) -> CoreRef<'_> {
        self.core.sub(&self.ptr, self.start, self.len, writable)
    }
}

/// A read-only view of elements of a buffer (from [`Buffer::slice`]).
///
/// ```no_run
/// use cuweave_driver::{Context, Device};
/// use cuweave_memory::{Buffer, DeviceBuffer};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let mut buffer = DeviceBuffer::from_slice(&context, &[1u32, 2, 3, 4])?;
/// let mut tail = DeviceBuffer::<u32>::new(&context, 2)?;
/// tail.copy_from(&buffer.slice(2..)?)?;
/// assert_eq!(tail.to_vec()?, [3, 4]);
/// buffer.slice_mut(..2)?.fill(0)?;
/// assert_eq!(buffer.to_vec()?, [0, 0, 3, 4]);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct BufferSlice<'a, T: Element> {
    parts: ViewParts<'a>,
    _element: PhantomData<&'a [T]>,
}

impl<'a, T: Element> BufferSlice<'a, T> {
    pub(crate) fn new(core: CoreRef<'a>, start: usize, len: usize) -> Self {
        Self {
            parts: ViewParts::new(core, start, len),
            _element: PhantomData,
        }
    }
}

impl<T: Element> Sealed for BufferSlice<'_, T> {
    #[inline]
    fn core(&self) -> CoreRef<'_> {
        self.parts.core(false)
    }
}

impl<T: Element> Buffer<T> for BufferSlice<'_, T> {}

/// A writable view of elements of a buffer (from [`Buffer::slice_mut`]), borrowing it
/// exclusively.
#[derive(Debug)]
pub struct BufferSliceMut<'a, T: Element> {
    parts: ViewParts<'a>,
    _element: PhantomData<&'a mut [T]>,
}

impl<'a, T: Element> BufferSliceMut<'a, T> {
    pub(crate) fn new(core: CoreRef<'a>, start: usize, len: usize) -> Self {
        Self {
            parts: ViewParts::new(core, start, len),
            _element: PhantomData,
        }
    }
}

impl<T: Element> Sealed for BufferSliceMut<'_, T> {
    #[inline]
    fn core(&self) -> CoreRef<'_> {
        self.parts.core(true)
    }
}

impl<T: Element> Buffer<T> for BufferSliceMut<'_, T> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_resolve_or_are_typed_errors() {
        assert_eq!(resolve("s", .., 10).unwrap(), (0, 10));
        assert_eq!(resolve("s", 2..5, 10).unwrap(), (2, 3));
        assert_eq!(resolve("s", 2..=5, 10).unwrap(), (2, 4));
        assert_eq!(resolve("s", 8.., 10).unwrap(), (8, 2));
        assert!(matches!(
            resolve("s", 5..5, 10),
            Err(crate::MemoryError::ZeroLength { .. })
        ));
        assert!(matches!(
            resolve("s", 5..11, 10),
            Err(crate::MemoryError::OutOfRange { .. })
        ));
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 6..2;
        assert!(matches!(
            resolve("s", backwards, 10),
            Err(crate::MemoryError::OutOfRange { .. })
        ));
        assert!(resolve("s", ..=usize::MAX, 10).is_err());
    }
}
