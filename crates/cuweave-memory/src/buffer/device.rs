//! [`DeviceBuffer`]: typed device memory from `cuMemAlloc`.

use std::marker::PhantomData;
use std::sync::Arc;

use cuweave_driver::Context;
use cuweave_driver::memory::DeviceAllocation;

use super::common::{Buffer, BufferCore, sealed::Sealed};
use super::range::allocation_bytes;
use crate::element::Element;
use crate::error::Result;

/// `len` elements of `T` in device memory, freed when dropped (after every queued use of it
/// has finished).
///
/// All operations come from the [`Buffer`] trait.
///
/// ```no_run
/// use cuweave_driver::{Context, Device};
/// use cuweave_memory::buffer::{Buffer, DeviceBuffer};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let buffer = DeviceBuffer::from_slice(&context, &[1.0f32, 2.0, 3.0])?;
/// assert_eq!(buffer.to_vec()?, [1.0, 2.0, 3.0]);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct DeviceBuffer<T: Element> {
    core: BufferCore,
    allocation: DeviceAllocation,
    _element: PhantomData<T>,
}

impl<T: Element> DeviceBuffer<T> {
    /// Allocates `len` elements without initializing them.
    ///
    /// The contents are whatever the memory last held. That is sound because `T` is plain data
    /// (every bit pattern is a valid value) and device memory reaches the host only through
    /// copies; use [`zeroed`](Self::zeroed) or [`fill`](Buffer::fill) for defined contents.
    ///
    /// # Errors
    /// `ZeroLength` for `len == 0` (or a zero-sized `T`), `Misaligned` when the byte size
    /// overflows, the driver's out-of-memory error when the device is full.
    pub fn new(context: &Arc<Context>, len: usize) -> Result<Self> {
        let bytes = allocation_bytes::<T>("DeviceBuffer::new", len)?;
        let allocation = DeviceAllocation::new(context, bytes)?;
        Ok(Self {
            core: BufferCore::new(context, allocation.ptr(), len, size_of::<T>()),
            allocation,
            _element: PhantomData,
        })
    }

    /// Allocates `len` elements set to zero.
    pub fn zeroed(context: &Arc<Context>, len: usize) -> Result<Self> {
        let mut buffer = Self::new(context, len)?;
        buffer.fill(T::zeroed())?;
        Ok(buffer)
    }

    /// Allocates a buffer holding a copy of `data`.
    ///
    /// # Errors
    /// `ZeroLength` for an empty slice.
    pub fn from_slice(context: &Arc<Context>, data: &[T]) -> Result<Self> {
        let mut buffer = Self::new(context, data.len())?;
        buffer.copy_from_host(data)?;
        Ok(buffer)
    }

    /// The driver allocation, for interop.
    pub fn allocation(&self) -> &DeviceAllocation {
        &self.allocation
    }
}

impl<T: Element> Sealed for DeviceBuffer<T> {
    fn core(&self) -> &BufferCore {
        &self.core
    }
}

impl<T: Element> Buffer<T> for DeviceBuffer<T> {}

impl<T: Element> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // The allocation field is freed after this returns, once queued uses have finished.
        self.core.tracker().synchronize_for_drop("DeviceBuffer");
    }
}
