//! [`HostSlice`] and [`HostSliceMut`]: the host's view of a pinned or unified buffer's elements,
//! held as a guard. The model is on [`HostSlice`].

use std::fmt;
use std::ops::{Deref, DerefMut};

use cuweave_driver::graph::HostBorrow;

/// The elements of a pinned or unified buffer, readable on the host (from
/// [`PinnedBuffer::as_slice`](super::PinnedBuffer::as_slice),
/// [`UnifiedBuffer::as_slice`](super::UnifiedBuffer::as_slice) and their `try_` forms).
/// Dereferences to `[T]`; while it lives, graphs whose captures wrote the buffer are not
/// launched.
///
/// A host slice is handed out once the buffer's queued device uses have finished. Eager work
/// cannot use the buffer while it lives: borrowing rules keep a `&mut` buffer (needed to write
/// it) away from a shared slice, and every use from a mutable one. A graph launch takes no
/// borrow of the memory its capture used, though, so the guard also keeps the launches of the
/// graphs that conflict with the host's access from starting while it lives: for a shared
/// slice, the graphs whose captures wrote the buffer; for a mutable one, those whose captures
/// used it. Such a launch is refused with
/// [`GraphError::HostBorrowed`](cuweave_driver::GraphError::HostBorrowed) until the guard is
/// dropped. Other graphs, and buffers no capture used, cost nothing more.
///
/// Everything borrowed from a guard borrows the guard: elements, subslices and iterators come
/// through `Deref` or `&guard` / `&mut guard`, so none outlives it. (A guard does not iterate by
/// value: the items would outlive the guard, and with it the hold on the launches.)
///
/// ```compile_fail
/// # fn leak(buffer: &cuweave_memory::PinnedBuffer<u32>) -> cuweave_memory::Result<()> {
/// let items: Vec<&u32> = buffer.as_slice()?.into_iter().collect();
/// assert_eq!(*items[0], 7); // the guard is gone by here
/// # Ok(()) }
/// ```
#[must_use = "the slice is the reason to take the guard"]
pub struct HostSlice<'a, T> {
    elements: &'a [T],
    _launches_held: Option<HostBorrow>,
}

/// The elements of a pinned or unified buffer, readable and writable on the host (from the
/// buffers' `as_mut_slice` and `try_as_mut_slice`). Dereferences to `[T]`; while it lives,
/// graphs whose captures used the buffer are not launched (see [`HostSlice`]).
#[must_use = "the slice is the reason to take the guard"]
pub struct HostSliceMut<'a, T> {
    elements: &'a mut [T],
    _launches_held: Option<HostBorrow>,
}

impl<'a, T> HostSlice<'a, T> {
    pub(crate) fn new(elements: &'a [T], launches_held: Option<HostBorrow>) -> Self {
        Self {
            elements,
            _launches_held: launches_held,
        }
    }

    /// Whether the guard holds back graph launches (a capture wrote the buffer).
    pub fn holds_launches(&self) -> bool {
        self._launches_held.is_some()
    }
}

impl<'a, T> HostSliceMut<'a, T> {
    pub(crate) fn new(elements: &'a mut [T], launches_held: Option<HostBorrow>) -> Self {
        Self {
            elements,
            _launches_held: launches_held,
        }
    }

    /// Whether the guard holds back graph launches (a capture used the buffer).
    pub fn holds_launches(&self) -> bool {
        self._launches_held.is_some()
    }
}

impl<T> Deref for HostSlice<'_, T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        self.elements
    }
}

impl<T> Deref for HostSliceMut<'_, T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        self.elements
    }
}

impl<T> DerefMut for HostSliceMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.elements
    }
}

impl<T> AsRef<[T]> for HostSlice<'_, T> {
    fn as_ref(&self) -> &[T] {
        self.elements
    }
}

impl<T> AsRef<[T]> for HostSliceMut<'_, T> {
    fn as_ref(&self) -> &[T] {
        self.elements
    }
}

impl<T> AsMut<[T]> for HostSliceMut<'_, T> {
    fn as_mut(&mut self) -> &mut [T] {
        self.elements
    }
}

impl<T: fmt::Debug> fmt::Debug for HostSlice<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.elements.fmt(f)
    }
}

impl<T: fmt::Debug> fmt::Debug for HostSliceMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.elements.fmt(f)
    }
}

impl<'b, T> IntoIterator for &'b HostSlice<'_, T> {
    type Item = &'b T;
    type IntoIter = std::slice::Iter<'b, T>;

    fn into_iter(self) -> std::slice::Iter<'b, T> {
        self.elements.iter()
    }
}

impl<'b, T> IntoIterator for &'b HostSliceMut<'_, T> {
    type Item = &'b T;
    type IntoIter = std::slice::Iter<'b, T>;

    fn into_iter(self) -> std::slice::Iter<'b, T> {
        self.elements.iter()
    }
}

impl<'b, T> IntoIterator for &'b mut HostSliceMut<'_, T> {
    type Item = &'b mut T;
    type IntoIter = std::slice::IterMut<'b, T>;

    fn into_iter(self) -> std::slice::IterMut<'b, T> {
        self.elements.iter_mut()
    }
}

/// Comparisons as for the slice itself, both ways round, so `assert_eq!(buffer.as_slice()?,
/// expected)` reads as it would with `&[T]`.
macro_rules! compare_as_slices {
    ($guard:ident) => {
        impl<T: PartialEq<U>, U> PartialEq<[U]> for $guard<'_, T> {
            fn eq(&self, other: &[U]) -> bool {
                self.elements[..] == *other
            }
        }

        impl<T: PartialEq<U>, U> PartialEq<&[U]> for $guard<'_, T> {
            fn eq(&self, other: &&[U]) -> bool {
                self.elements[..] == **other
            }
        }

        impl<T: PartialEq<U>, U, const N: usize> PartialEq<[U; N]> for $guard<'_, T> {
            fn eq(&self, other: &[U; N]) -> bool {
                self.elements[..] == other[..]
            }
        }

        impl<T: PartialEq<U>, U, const N: usize> PartialEq<&[U; N]> for $guard<'_, T> {
            fn eq(&self, other: &&[U; N]) -> bool {
                self.elements[..] == other[..]
            }
        }

        impl<T: PartialEq<U>, U> PartialEq<Vec<U>> for $guard<'_, T> {
            fn eq(&self, other: &Vec<U>) -> bool {
                self.elements[..] == other[..]
            }
        }

        impl<T: PartialEq<U>, U> PartialEq<&Vec<U>> for $guard<'_, T> {
            fn eq(&self, other: &&Vec<U>) -> bool {
                self.elements[..] == other[..]
            }
        }

        impl<T: PartialEq<U>, U> PartialEq<&mut [U]> for $guard<'_, T> {
            fn eq(&self, other: &&mut [U]) -> bool {
                self.elements[..] == **other
            }
        }

        impl<T: PartialEq<U>, U> PartialEq<$guard<'_, U>> for $guard<'_, T> {
            fn eq(&self, other: &$guard<'_, U>) -> bool {
                self.elements[..] == other.elements[..]
            }
        }

        impl<T, U: PartialEq<T>> PartialEq<$guard<'_, T>> for Vec<U> {
            fn eq(&self, other: &$guard<'_, T>) -> bool {
                self[..] == other.elements[..]
            }
        }

        impl<T, U: PartialEq<T>> PartialEq<$guard<'_, T>> for [U] {
            fn eq(&self, other: &$guard<'_, T>) -> bool {
                *self == other.elements[..]
            }
        }

        impl<T, U: PartialEq<T>> PartialEq<$guard<'_, T>> for &[U] {
            fn eq(&self, other: &$guard<'_, T>) -> bool {
                **self == other.elements[..]
            }
        }

        impl<T, U: PartialEq<T>, const N: usize> PartialEq<$guard<'_, T>> for [U; N] {
            fn eq(&self, other: &$guard<'_, T>) -> bool {
                self[..] == other.elements[..]
            }
        }
    };
}

compare_as_slices!(HostSlice);
compare_as_slices!(HostSliceMut);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guard_reads_and_compares_as_its_slice() {
        let data = [1u32, 2, 3];
        let slice = HostSlice::new(&data, None);
        assert_eq!(slice.len(), 3);
        assert_eq!(slice, [1, 2, 3]);
        assert_eq!(slice, &[1, 2, 3]);
        assert_eq!(slice, vec![1, 2, 3]);
        assert_eq!(vec![1, 2, 3], slice);
        assert_eq!(slice, &vec![1, 2, 3]);
        assert_eq!(slice, HostSlice::new(&[1u32, 2, 3], None));
        assert_eq!(&data[..], slice);
        assert_ne!(slice, [1, 2, 4]);
        assert_eq!(format!("{slice:?}"), "[1, 2, 3]");
        assert!(!slice.holds_launches());
    }

    #[test]
    fn a_mutable_guard_writes_through() {
        let mut data = [0u8; 4];
        {
            let mut slice = HostSliceMut::new(&mut data, None);
            slice.copy_from_slice(&[9, 8, 7, 6]);
            slice[0] = 1;
            assert_eq!(slice, [1, 8, 7, 6]);
        }
        assert_eq!(data, [1, 8, 7, 6]);
        let mut slice = HostSliceMut::new(&mut data, None);
        for x in &mut slice {
            *x += 1;
        }
        let sum: u8 = (&slice).into_iter().sum();
        assert_eq!(sum, 2 + 9 + 8 + 7);
    }

    #[test]
    fn guards_cross_threads_as_slices_do() {
        fn send_sync<X: Send + Sync>() {}
        send_sync::<HostSlice<'static, u64>>();
        send_sync::<HostSliceMut<'static, u64>>();
    }
}
