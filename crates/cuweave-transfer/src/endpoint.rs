//! The two sides of a transfer: [`Source`] (read) and [`Destination`] (written).
//!
//! Host memory is a slice (pageable: `&[T]` / `&mut [T]`, any `Vec` or array); device, pinned
//! and unified memory are the memory layer's buffers with an element offset, and registered
//! host memory a [`RegisteredHost`] with an element offset. Lengths come from the source; the
//! destination must hold that many elements from its offset.
//!
//! A view of a buffer ([`Buffer::slice`] / [`Buffer::slice_mut`], as a cudarc user copies into
//! `dst.slice_mut(a..b)`) is a side too: [`Source::View`] / [`Destination::View`], from
//! `From` or [`Source::view`] / [`Destination::view`]. A view is planned, moved and counted as
//! memory of its buffer's device (a view of pinned or unified memory still moves exactly, by the
//! copies every kind of buffer takes).

use cuweave_memory::{
    Buffer, BufferSlice, BufferSliceMut, DeviceBuffer, Element, PinnedBuffer, UnifiedBuffer,
};

use crate::error::{Result, TransferError};
use crate::location::Location;
use crate::registered::{RegisteredHost, RegisteredSlice, RegisteredSliceMut};

/// Where a transfer reads from: `len` elements of host memory or of a buffer.
#[derive(Debug)]
pub enum Source<'a, T: Element> {
    /// Pageable host memory.
    Host(&'a [T]),
    /// Elements `offset..offset + len` of pinned host memory.
    Pinned(&'a PinnedBuffer<T>, usize, usize),
    /// Elements `offset..offset + len` of device memory.
    Device(&'a DeviceBuffer<T>, usize, usize),
    /// Elements `offset..offset + len` of unified memory.
    Unified(&'a UnifiedBuffer<T>, usize, usize),
    /// Elements `offset..offset + len` of registered host memory
    /// ([`Source::registered`] makes it).
    Registered(RegisteredSlice<'a, T>, usize, usize),
    /// Every element of a view of a buffer (from [`Buffer::slice`]), moved as memory of its
    /// buffer's device.
    View(BufferSlice<'a, T>),
}

/// Where a transfer writes to: host memory (as long as the source), or a buffer from an
/// element offset.
#[derive(Debug)]
pub enum Destination<'a, T: Element> {
    /// Pageable host memory, exactly as long as the source.
    Host(&'a mut [T]),
    /// Pinned host memory, from this element offset.
    Pinned(&'a mut PinnedBuffer<T>, usize),
    /// Device memory, from this element offset.
    Device(&'a mut DeviceBuffer<T>, usize),
    /// Unified memory, from this element offset.
    Unified(&'a mut UnifiedBuffer<T>, usize),
    /// Registered host memory, from this element offset ([`Destination::registered`] makes it).
    Registered(RegisteredSliceMut<'a, T>, usize),
    /// A writable view of a buffer (from [`Buffer::slice_mut`]), written from its first element
    /// and moved as memory of its buffer's device; it must hold the source's elements.
    View(BufferSliceMut<'a, T>),
}

impl<'a, T: Element> Source<'a, T> {
    /// The number of elements to move.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(slice) => slice.len(),
            Self::Pinned(_, _, len)
            | Self::Device(_, _, len)
            | Self::Unified(_, _, len)
            | Self::Registered(_, _, len) => *len,
            Self::View(view) => view.len(),
        }
    }

    /// Whether there is nothing to move.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes to move.
    pub fn bytes(&self) -> usize {
        self.len() * size_of::<T>()
    }

    /// Where the memory is.
    pub fn location(&self) -> Location {
        match self {
            Self::Host(_) => Location::PageableHost,
            Self::Pinned(b, ..) => Location::PinnedHost(b.device().ordinal()),
            Self::Device(b, ..) => Location::Device(b.device().ordinal()),
            Self::Unified(b, ..) => Location::Unified(b.device().ordinal()),
            Self::Registered(r, ..) => Location::RegisteredHost(r.device()),
            Self::View(view) => Location::Device(view.device().ordinal()),
        }
    }

    /// Every element of a view of a buffer (`buffer.slice(range)?`).
    pub fn view(view: BufferSlice<'a, T>) -> Self {
        Self::View(view)
    }

    /// Elements `offset..offset + len` of a pinned buffer.
    pub fn pinned(buffer: &'a PinnedBuffer<T>, offset: usize, len: usize) -> Self {
        Self::Pinned(buffer, offset, len)
    }

    /// Elements `offset..offset + len` of a device buffer.
    pub fn device(buffer: &'a DeviceBuffer<T>, offset: usize, len: usize) -> Self {
        Self::Device(buffer, offset, len)
    }

    /// Elements `offset..offset + len` of a unified buffer.
    pub fn unified(buffer: &'a UnifiedBuffer<T>, offset: usize, len: usize) -> Self {
        Self::Unified(buffer, offset, len)
    }

    /// Elements `offset..offset + len` of registered host memory.
    pub fn registered(memory: &'a RegisteredHost<'_, T>, offset: usize, len: usize) -> Self {
        Self::Registered(memory.view(), offset, len)
    }

    /// `Err(OutOfRange)` unless the range lies inside the buffer.
    pub(crate) fn check(&self) -> Result<()> {
        let (offset, len, capacity) = match self {
            // A view's range was checked when it was made.
            Self::Host(_) | Self::View(_) => return Ok(()),
            Self::Pinned(b, o, l) => (*o, *l, b.len()),
            Self::Device(b, o, l) => (*o, *l, b.len()),
            Self::Unified(b, o, l) => (*o, *l, b.len()),
            Self::Registered(r, o, l) => (*o, *l, r.len()),
        };
        check_range("source", offset, len, capacity)
    }
}

impl<'a, T: Element> Destination<'a, T> {
    /// Where the memory is.
    pub fn location(&self) -> Location {
        match self {
            Self::Host(_) => Location::PageableHost,
            Self::Pinned(b, _) => Location::PinnedHost(b.device().ordinal()),
            Self::Device(b, _) => Location::Device(b.device().ordinal()),
            Self::Unified(b, _) => Location::Unified(b.device().ordinal()),
            Self::Registered(r, _) => Location::RegisteredHost(r.device()),
            Self::View(view) => Location::Device(view.device().ordinal()),
        }
    }

    /// A writable view of a buffer (`buffer.slice_mut(range)?`), written from its first element.
    pub fn view(view: BufferSliceMut<'a, T>) -> Self {
        Self::View(view)
    }

    /// A pinned buffer from element `offset`.
    pub fn pinned(buffer: &'a mut PinnedBuffer<T>, offset: usize) -> Self {
        Self::Pinned(buffer, offset)
    }

    /// A device buffer from element `offset`.
    pub fn device(buffer: &'a mut DeviceBuffer<T>, offset: usize) -> Self {
        Self::Device(buffer, offset)
    }

    /// A unified buffer from element `offset`.
    pub fn unified(buffer: &'a mut UnifiedBuffer<T>, offset: usize) -> Self {
        Self::Unified(buffer, offset)
    }

    /// Registered host memory from element `offset`.
    pub fn registered(memory: &'a mut RegisteredHost<'_, T>, offset: usize) -> Self {
        Self::Registered(memory.view_mut(), offset)
    }

    /// `Err(OutOfRange)` / `Err(LengthMismatch)` unless `len` elements fit from the offset.
    pub(crate) fn check(&self, len: usize) -> Result<()> {
        let (offset, capacity) = match self {
            Self::Host(slice) if slice.len() == len => return Ok(()),
            Self::Host(slice) => {
                return Err(TransferError::LengthMismatch {
                    source_len: len,
                    destination_len: slice.len(),
                });
            }
            Self::Pinned(b, o) => (*o, b.len()),
            Self::Device(b, o) => (*o, b.len()),
            Self::Unified(b, o) => (*o, b.len()),
            Self::Registered(r, o) => (*o, r.len()),
            Self::View(view) => (0, view.len()),
        };
        check_range("destination", offset, len, capacity)
    }
}

/// `offset..offset + len` inside `0..capacity` (a zero `len` is fine at any offset up to the end).
fn check_range(side: &'static str, offset: usize, len: usize, capacity: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(TransferError::OutOfRange {
            side,
            offset,
            len,
            capacity,
        }),
    }
}

impl<'a, T: Element> From<&'a [T]> for Source<'a, T> {
    fn from(slice: &'a [T]) -> Self {
        Self::Host(slice)
    }
}

impl<'a, T: Element> From<&'a Vec<T>> for Source<'a, T> {
    fn from(vec: &'a Vec<T>) -> Self {
        Self::Host(vec)
    }
}

impl<'a, T: Element> From<&'a PinnedBuffer<T>> for Source<'a, T> {
    fn from(buffer: &'a PinnedBuffer<T>) -> Self {
        Self::Pinned(buffer, 0, buffer.len())
    }
}

impl<'a, T: Element> From<&'a DeviceBuffer<T>> for Source<'a, T> {
    fn from(buffer: &'a DeviceBuffer<T>) -> Self {
        Self::Device(buffer, 0, buffer.len())
    }
}

impl<'a, T: Element> From<&'a UnifiedBuffer<T>> for Source<'a, T> {
    fn from(buffer: &'a UnifiedBuffer<T>) -> Self {
        Self::Unified(buffer, 0, buffer.len())
    }
}

impl<'a, T: Element> From<&'a RegisteredHost<'_, T>> for Source<'a, T> {
    fn from(memory: &'a RegisteredHost<'_, T>) -> Self {
        Self::Registered(memory.view(), 0, memory.len())
    }
}

impl<'a, T: Element> From<BufferSlice<'a, T>> for Source<'a, T> {
    fn from(view: BufferSlice<'a, T>) -> Self {
        Self::View(view)
    }
}

impl<'a, T: Element> From<&BufferSlice<'a, T>> for Source<'a, T> {
    fn from(view: &BufferSlice<'a, T>) -> Self {
        Self::View(*view)
    }
}

impl<'a, T: Element> From<BufferSliceMut<'a, T>> for Destination<'a, T> {
    fn from(view: BufferSliceMut<'a, T>) -> Self {
        Self::View(view)
    }
}

impl<'a, T: Element> From<&'a mut [T]> for Destination<'a, T> {
    fn from(slice: &'a mut [T]) -> Self {
        Self::Host(slice)
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for Destination<'a, T> {
    fn from(vec: &'a mut Vec<T>) -> Self {
        Self::Host(vec)
    }
}

impl<'a, T: Element> From<&'a mut PinnedBuffer<T>> for Destination<'a, T> {
    fn from(buffer: &'a mut PinnedBuffer<T>) -> Self {
        Self::Pinned(buffer, 0)
    }
}

impl<'a, T: Element> From<&'a mut DeviceBuffer<T>> for Destination<'a, T> {
    fn from(buffer: &'a mut DeviceBuffer<T>) -> Self {
        Self::Device(buffer, 0)
    }
}

impl<'a, T: Element> From<&'a mut UnifiedBuffer<T>> for Destination<'a, T> {
    fn from(buffer: &'a mut UnifiedBuffer<T>) -> Self {
        Self::Unified(buffer, 0)
    }
}

impl<'a, T: Element> From<&'a mut RegisteredHost<'_, T>> for Destination<'a, T> {
    fn from(memory: &'a mut RegisteredHost<'_, T>) -> Self {
        Self::Registered(memory.view_mut(), 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_sides_check_lengths_and_ranges_are_checked_without_overflow() {
        let src = [1u32, 2, 3];
        let s = Source::from(&src[..]);
        assert_eq!(
            (s.len(), s.bytes(), s.location()),
            (3, 12, Location::PageableHost)
        );
        let mut out = [0u32; 2];
        let d = Destination::from(&mut out[..]);
        assert!(matches!(
            d.check(3),
            Err(TransferError::LengthMismatch {
                source_len: 3,
                destination_len: 2
            })
        ));
        assert!(check_range("source", 4, 0, 4).is_ok());
        assert!(check_range("source", 5, 0, 4).is_err());
        assert!(matches!(
            check_range("destination", usize::MAX, 2, 10),
            Err(TransferError::OutOfRange {
                side: "destination",
                ..
            })
        ));
    }
}
