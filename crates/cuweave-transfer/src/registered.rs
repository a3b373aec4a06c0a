//! [`RegisteredHost`]: a caller's own host slice page-locked in place (`cuMemHostRegister`), so
//! that transfers from and to it run at pinned speed, straight from its pages, without staging.
//!
//! Registering costs milliseconds (see
//! [`TransferManager::registration_advice`](crate::TransferManager::registration_advice) for
//! when that pays); a registration is released by [`RegisteredHost::unregister`], which hands the
//! slice back, or on drop. [`RegisteredSlice`] and [`RegisteredSliceMut`] are the borrowed views
//! that [`Source::Registered`](crate::Source::Registered) and
//! [`Destination::Registered`](crate::Destination::Registered) carry.

use std::fmt;
use std::marker::PhantomData;
use std::time::Instant;

use cuweave_driver::Context;
use cuweave_driver::memory::HostRegistration;
use cuweave_memory::Element;

use crate::error::{Result, TransferError};
use crate::location::Location;

/// A host slice page-locked in place for as long as this value lives: the copy engine reads and
/// writes it directly, at the speed of pinned memory.
///
/// It holds the exclusive borrow of the caller's `&'a mut [T]`, so in safe code the memory can
/// neither be freed nor reallocated while it is registered; the elements stay readable and
/// writable through [`as_slice`](Self::as_slice) and [`as_mut_slice`](Self::as_mut_slice).
/// Made by [`TransferManager::register_host`](crate::TransferManager::register_host) in a
/// device's context; the registration is portable, so every device's copies DMA it directly.
/// Dropping it unregisters (`cuMemHostUnregister`; an error there goes to `tracing`);
/// [`unregister`](Self::unregister) does so now, reports the driver's error and returns the slice.
///
/// ```no_run
/// use cuweave_driver::{Context, Device};
/// use cuweave_memory::DeviceBuffer;
/// use cuweave_transfer::{Destination, Source, TransferManager};
///
/// # fn main() -> Result<(), cuweave_transfer::TransferError> {
/// let manager = TransferManager::new()?;
/// let context = Context::primary(Device::get(0)?)?;
/// let mut frames = vec![0u8; 64 << 20];
/// let mut device = DeviceBuffer::<u8>::new(&context, frames.len())?;
/// let mut registered = manager.register_host(0, &mut frames)?; // once
/// for frame in 0..100u8 {
///     registered.as_mut_slice().fill(frame);
///     manager.transfer(&registered, &mut device)?; // a direct DMA each time
/// }
/// manager.transfer(Source::device(&device, 0, 16), Destination::registered(&mut registered, 0))?;
/// let frames = registered.unregister()?; // the slice again, no longer page-locked
/// assert_eq!(frames[0], 99);
/// # Ok(())
/// # }
/// ```
///
/// The memory cannot be freed (or the `Vec` grown) while it is registered; this does not
/// compile:
///
/// ```compile_fail
/// use cuweave_transfer::TransferManager;
///
/// fn register_then_free(manager: &TransferManager) -> cuweave_transfer::Result<()> {
///     let mut data = vec![0u8; 1 << 20];
///     let registered = manager.register_host(0, &mut data)?;
///     drop(data); // error: `data` is still borrowed by the registration
///     drop(registered);
///     Ok(())
/// }
/// ```
#[must_use = "dropping a registration unregisters the memory at once"]
pub struct RegisteredHost<'a, T: Element> {
    registration: HostRegistration<'a>,
    device: usize,
    _elements: PhantomData<&'a mut [T]>,
}

/// `EmptyRegistration` for memory without bytes: zero-sized elements give zero bytes too,
/// which also keeps the casts of a registration from failing.
pub(crate) fn refuse_empty<T: Element>(memory: &[T]) -> Result<()> {
    if size_of_val(memory) == 0 {
        return Err(TransferError::EmptyRegistration {
            len: memory.len(),
            element_bytes: size_of::<T>(),
        });
    }
    Ok(())
}

impl<'a, T: Element> RegisteredHost<'a, T> {
    /// Registers `memory` in `context` (device ordinal `device`).
    pub(crate) fn new(
        context: &std::sync::Arc<Context>,
        device: usize,
        memory: &'a mut [T],
    ) -> Result<Self> {
        refuse_empty(memory)?;
        let bytes: &'a mut [u8] = bytemuck::cast_slice_mut(memory);
        let start = Instant::now();
        let registration = HostRegistration::new(context, bytes)?;
        tracing::debug!(
            device,
            bytes = registration.len(),
            micros = start.elapsed().as_micros() as u64,
            "host memory registered"
        );
        Ok(Self {
            registration,
            device,
            _elements: PhantomData,
        })
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.registration.len() / size_of::<T>()
    }

    /// Always `false`: empty slices are refused at registration.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The registered size in bytes.
    pub fn bytes(&self) -> usize {
        self.registration.len()
    }

    /// The ordinal of the device whose context registered the memory.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Where the memory is, for [`plan`](crate::TransferManager::plan).
    pub fn location(&self) -> Location {
        Location::RegisteredHost(self.device)
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        // The bytes came from a `[T]` (aligned for `T`, a whole number of elements, not empty),
        // so the cast back cannot fail.
        bytemuck::cast_slice(self.registration.as_bytes())
    }

    /// The elements, writable. Every transfer is blocking, so no copy is still reading or
    /// writing them when this can be called.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.registration.as_bytes_mut())
    }

    /// Unregisters now (`cuMemHostUnregister`) and hands the slice back.
    ///
    /// # Errors
    /// The driver's error. The borrow of the slice ends either way.
    pub fn unregister(self) -> Result<&'a mut [T]> {
        let (device, bytes) = (self.device, self.bytes());
        let start = Instant::now();
        let memory = self.registration.unregister()?;
        tracing::debug!(
            device,
            bytes,
            micros = start.elapsed().as_micros() as u64,
            "host memory unregistered"
        );
        Ok(bytemuck::cast_slice_mut(memory))
    }

    /// A read view for [`Source::Registered`](crate::Source::Registered).
    pub(crate) fn view(&self) -> RegisteredSlice<'_, T> {
        RegisteredSlice {
            slice: self.as_slice(),
            device: self.device,
        }
    }

    /// A write view for [`Destination::Registered`](crate::Destination::Registered).
    pub(crate) fn view_mut(&mut self) -> RegisteredSliceMut<'_, T> {
        RegisteredSliceMut {
            device: self.device,
            slice: self.as_mut_slice(),
        }
    }
}

impl<T: Element> fmt::Debug for RegisteredHost<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredHost")
            .field("device", &self.device)
            .field("len", &self.len())
            .field("bytes", &self.bytes())
            .field("ptr", &self.registration.as_ptr())
            .finish()
    }
}

/// The elements of a [`RegisteredHost`], borrowed for reading by a transfer
/// ([`Source::Registered`](crate::Source::Registered)); made by
/// [`Source::registered`](crate::Source::registered) or `From<&RegisteredHost>`.
///
/// Only a live registration hands these out, so the memory is page-locked while a view exists.
pub struct RegisteredSlice<'a, T: Element> {
    slice: &'a [T],
    device: usize,
}

impl<'a, T: Element> RegisteredSlice<'a, T> {
    /// The registered elements (all of them; the transfer's range is beside the view).
    pub fn as_slice(&self) -> &'a [T] {
        self.slice
    }

    /// The number of registered elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Always `false`: registrations are never empty.
    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }

    /// The ordinal of the device whose context registered the memory.
    pub fn device(&self) -> usize {
        self.device
    }
}

impl<T: Element> fmt::Debug for RegisteredSlice<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredSlice")
            .field("device", &self.device)
            .field("len", &self.slice.len())
            .finish()
    }
}

/// The elements of a [`RegisteredHost`], borrowed for writing by a transfer
/// ([`Destination::Registered`](crate::Destination::Registered)); made by
/// [`Destination::registered`](crate::Destination::registered) or `From<&mut RegisteredHost>`.
pub struct RegisteredSliceMut<'a, T: Element> {
    slice: &'a mut [T],
    device: usize,
}

impl<T: Element> RegisteredSliceMut<'_, T> {
    /// The same elements, borrowed for reading.
    pub fn as_view(&self) -> RegisteredSlice<'_, T> {
        RegisteredSlice {
            slice: self.slice,
            device: self.device,
        }
    }

    /// The registered elements (all of them; the transfer's offset is beside the view).
    pub fn as_slice(&self) -> &[T] {
        self.slice
    }

    /// The registered elements, writable.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        self.slice
    }

    /// The number of registered elements.
    pub fn len(&self) -> usize {
        self.as_view().len()
    }

    /// Always `false`: registrations are never empty.
    pub fn is_empty(&self) -> bool {
        self.as_view().is_empty()
    }

    /// The ordinal of the device whose context registered the memory.
    pub fn device(&self) -> usize {
        self.device
    }
}

impl<T: Element> fmt::Debug for RegisteredSliceMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let view = self.as_view();
        f.debug_struct("RegisteredSliceMut")
            .field("device", &view.device())
            .field("len", &view.len())
            .finish()
    }
}
