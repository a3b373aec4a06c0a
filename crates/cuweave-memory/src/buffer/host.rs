//! [`HostSource`] and [`HostSink`]: host memory an asynchronous copy may own until it finishes.
//!
//! An async copy hands the host side to the copy engine, which reads or writes it later. So the
//! copy takes the host side by value (a `Vec<T>`, a `Box<[T]>`, a [`PinnedBuffer`]) or by a
//! borrow of a [`PinnedBuffer`] (whose own tracker then remembers the copy), and the returned
//! [`PendingCopy`](super::PendingCopy) gives it back only once the stream has passed the copy.
//!
//! | host side | source | sink | how the copy runs | on a capturing stream |
//! |---|---|---|---|---|
//! | `PinnedBuffer<T>`, `&mut PinnedBuffer<T>` | yes | yes | truly asynchronous (DMA from page-locked memory) | captured |
//! | `&PinnedBuffer<T>` | yes | no | truly asynchronous | captured |
//! | `Vec<T>`, `Box<[T]>` | yes | yes | pageable: the driver stages it; a device-to-host copy returns only when done | refused: `MemoryError::NotCapturable` |
//!
//! A captured copy runs at every launch of the graph, reading or writing the pinned buffer's
//! memory then; the buffer's tracker records the captured use, so dropping the buffer keeps the
//! memory for the capture's graphs (until their graph pool dies; for a capture with no graph
//! pool, for ever). A pageable copy cannot be captured (the driver would invalidate the whole
//! capture), and nothing would keep a `Vec`'s memory alive for the graph: it is refused before
//! anything is queued, and the capture goes on.
//!
//! The traits are sealed: their soundness rests on each implementation keeping its memory at
//! the same address when the value is moved, which holds for exactly these types.

use super::common::Buffer;
use super::pinned::PinnedBuffer;
use super::tracker::StreamTracker;
use crate::element::Element;
use crate::error::MemoryError;

pub(crate) mod sealed {
    use super::StreamTracker;

    /// Raw access for the copy functions. Implementations keep their memory at the same
    /// address when moved, and valid for `host_len` elements for as long as they live.
    pub trait HostSide<T> {
        /// Number of elements.
        fn host_len(&self) -> usize;
        /// The first element's address.
        fn host_ptr(&self) -> *const u8;
        /// The tracker of a buffer that remembers its own device uses, if any.
        fn host_tracker(&self) -> Option<&StreamTracker>;

        /// The error of a refused or failed copy of this host side, over the layer's error
        /// `E`: [`HostCopyError<Self, E>`](crate::HostCopyError) for an owned host side, which
        /// it hands back; `E` itself for a borrowed one (the borrow is still the caller's).
        type Refusal<E>;

        /// The refusal of `error`, handing back `host` where it is owned.
        fn refusal<E>(error: E, host: Option<Self>) -> Self::Refusal<E>
        where
            Self: Sized;

        /// The error and the handed-back host side of a refusal.
        fn split_refusal<E>(refusal: Self::Refusal<E>) -> (E, Option<Self>)
        where
            Self: Sized;
    }

    /// Writable raw access for device-to-host copies.
    pub trait HostSideMut<T>: HostSide<T> {
        /// The first element's address, writable.
        fn host_mut_ptr(&mut self) -> *mut u8;
    }
}

/// Host memory an asynchronous host-to-device copy can read from while it owns it.
///
/// | host side | source | sink | how the copy runs | on a capturing stream |
/// |---|---|---|---|---|
/// | `PinnedBuffer<T>`, `&mut PinnedBuffer<T>` | yes | yes | truly asynchronous (DMA from page-locked memory) | captured |
/// | `&PinnedBuffer<T>` | yes | no | truly asynchronous | captured |
/// | `Vec<T>`, `Box<[T]>` | yes | yes | pageable: the driver stages it; a device-to-host copy returns only when done | refused: [`crate::MemoryError::NotCapturable`] |
///
/// A borrowed [`PinnedBuffer`] also records the copy in its own tracker, so its host slices
/// wait for the copy even if the [`PendingCopy`](super::PendingCopy) is forgotten.
pub trait HostSource<T: Element>: sealed::HostSide<T> + Send {}

/// Host memory an asynchronous device-to-host copy can write into while it owns it.
///
/// Implemented for `Vec<T>`, `Box<[T]>`, [`PinnedBuffer<T>`] and `&mut PinnedBuffer<T>` (see
/// [`HostSource`] for how each copy runs).
pub trait HostSink<T: Element>: sealed::HostSideMut<T> + Send {}

/// The refusal items of an owned host side: it comes back in a [`HostCopyError`](crate::HostCopyError).
macro_rules! owned_refusal {
    () => {
        type Refusal<E> = $crate::error::HostCopyError<Self, E>;
        fn refusal<E>(error: E, host: Option<Self>) -> Self::Refusal<E> {
            $crate::error::HostCopyError::new(error, host)
        }
        fn split_refusal<E>(refusal: Self::Refusal<E>) -> (E, Option<Self>) {
            refusal.into_parts()
        }
    };
}

pub(crate) use owned_refusal;

/// The refusal items of a borrowed host side: the layer's error alone.
macro_rules! borrowed_refusal {
    () => {
        type Refusal<E> = E;
        fn refusal<E>(error: E, _host: Option<Self>) -> Self::Refusal<E> {
            error
        }
        fn split_refusal<E>(refusal: Self::Refusal<E>) -> (E, Option<Self>) {
            (refusal, None)
        }
    };
}

/// The error of an async copy with host side `H` (elements `T`) over the layer's error `E`:
/// [`HostCopyError<H, E>`](crate::HostCopyError), which hands the host side back, for an owned host
/// side (`Vec<T>`, `Box<[T]>`, [`PinnedBuffer<T>`]); `E` itself for a borrowed
/// `&PinnedBuffer<T>` / `&mut PinnedBuffer<T>`, whose borrow is still the caller's.
///
/// Either converts with `?` into this crate's [`MemoryError`], and into a
/// `Box<dyn Error + Send + Sync>` (or `anyhow::Error`) whenever `E` does:
///
/// ```no_run
/// # use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer};
/// # use cuweave_driver::Stream;
/// fn upload(
///     device: &mut DeviceBuffer<f32>,
///     staging: &PinnedBuffer<f32>,
///     data: Vec<f32>,
///     stream: &Stream,
/// ) -> Result<Vec<f32>, Box<dyn std::error::Error + Send + Sync>> {
///     device.copy_from_host_async(staging, stream)?.wait()?; // borrowed: a MemoryError
///     Ok(device.copy_from_host_async(data, stream)?.wait()?) // owned: a HostCopyError
/// }
/// ```
pub type HostRefusal<H, T, E = MemoryError> = <H as sealed::HostSide<T>>::Refusal<E>;

/// The [`HostRefusal`] of `error` for host side `H`, handing `host` back where `H` is owned: for
/// layers above that refuse a copy (or wrap the memory layer's refusal in their own error).
pub fn host_refusal<T, H: sealed::HostSide<T>, E>(
    error: E,
    host: Option<H>,
) -> HostRefusal<H, T, E> {
    H::refusal(error, host)
}

/// The error of a [`HostRefusal`] and the host side it hands back (`None` for a borrowed host
/// side, or an owned one that was leaked because its copy may still run).
pub fn split_host_refusal<T, H: sealed::HostSide<T>, E>(
    refusal: HostRefusal<H, T, E>,
) -> (E, Option<H>) {
    H::split_refusal(refusal)
}

impl<T: Element> sealed::HostSide<T> for Vec<T> {
    owned_refusal!();
    fn host_len(&self) -> usize {
        self.len()
    }
    fn host_ptr(&self) -> *const u8 {
        self.as_ptr().cast()
    }
    fn host_tracker(&self) -> Option<&StreamTracker> {
        None
    }
}

impl<T: Element> sealed::HostSideMut<T> for Vec<T> {
    fn host_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr().cast()
    }
}

impl<T: Element> HostSource<T> for Vec<T> {}
impl<T: Element> HostSink<T> for Vec<T> {}

impl<T: Element> sealed::HostSide<T> for Box<[T]> {
    owned_refusal!();
    fn host_len(&self) -> usize {
        self.len()
    }
    fn host_ptr(&self) -> *const u8 {
        self.as_ptr().cast()
    }
    fn host_tracker(&self) -> Option<&StreamTracker> {
        None
    }
}

impl<T: Element> sealed::HostSideMut<T> for Box<[T]> {
    fn host_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr().cast()
    }
}

impl<T: Element> HostSource<T> for Box<[T]> {}
impl<T: Element> HostSink<T> for Box<[T]> {}

impl<T: Element> sealed::HostSide<T> for PinnedBuffer<T> {
    owned_refusal!();
    fn host_len(&self) -> usize {
        Buffer::len(self)
    }
    fn host_ptr(&self) -> *const u8 {
        self.host_ptr()
    }
    fn host_tracker(&self) -> Option<&StreamTracker> {
        Some(self.tracker())
    }
}

impl<T: Element> sealed::HostSideMut<T> for PinnedBuffer<T> {
    fn host_mut_ptr(&mut self) -> *mut u8 {
        self.host_mut_ptr()
    }
}

impl<T: Element> HostSource<T> for PinnedBuffer<T> {}
impl<T: Element> HostSink<T> for PinnedBuffer<T> {}

impl<T: Element> sealed::HostSide<T> for &PinnedBuffer<T> {
    borrowed_refusal!();
    fn host_len(&self) -> usize {
        Buffer::len(&**self)
    }
    fn host_ptr(&self) -> *const u8 {
        (**self).host_ptr()
    }
    fn host_tracker(&self) -> Option<&StreamTracker> {
        Some(self.tracker())
    }
}

impl<T: Element> HostSource<T> for &PinnedBuffer<T> {}

impl<T: Element> sealed::HostSide<T> for &mut PinnedBuffer<T> {
    borrowed_refusal!();
    fn host_len(&self) -> usize {
        Buffer::len(&**self)
    }
    fn host_ptr(&self) -> *const u8 {
        (**self).host_ptr()
    }
    fn host_tracker(&self) -> Option<&StreamTracker> {
        Some(self.tracker())
    }
}

impl<T: Element> sealed::HostSideMut<T> for &mut PinnedBuffer<T> {
    fn host_mut_ptr(&mut self) -> *mut u8 {
        (**self).host_mut_ptr()
    }
}

impl<T: Element> HostSource<T> for &mut PinnedBuffer<T> {}
impl<T: Element> HostSink<T> for &mut PinnedBuffer<T> {}
