//! [`UnifiedBuffer`]: typed managed (unified) memory, usable from the host and every device.

use std::marker::PhantomData;
use std::sync::Arc;

use cuweave_driver::Context;
use cuweave_driver::graph::HostBorrow;
use cuweave_driver::memory::ManagedAllocation;

use super::common::{Buffer, BufferCore, CoreRef, sealed::Sealed};
use super::host_slice::{HostSlice, HostSliceMut};
use super::range::allocation_bytes;
use super::raw;
use super::tracker::{Access, StreamTracker};
use crate::element::Element;
use crate::error::Result;
use crate::unified::ManagedCapabilities;

/// `len` elements of `T` in managed memory (`cuMemAllocManaged`): one address valid on the
/// host and on every device, migrated on demand by the driver, freed when dropped (after every
/// queued use of it has finished).
///
/// Host slices are handed out only when no queued device work can touch the buffer: the buffer
/// remembers the last stream that used it (copies, fills, prefetches, and kernels you report
/// with [`record_use`](Buffer::record_use)); [`as_slice`](Self::as_slice) waits for it,
/// [`try_as_slice`](Self::try_as_slice) refuses with
/// [`MemoryError::DeviceBusy`](crate::MemoryError::DeviceBusy). Migration hints and prefetches
/// are in [`crate::unified`] ([`hints`](Self::hints), [`prefetch_to`](Self::prefetch_to), …).
///
/// Host slices need a device with concurrent managed access (every recent data-centre GPU on
/// Linux); elsewhere they are refused with a typed error and the [`Buffer`] copies remain.
///
/// Keep managed allocations within the device's free memory: oversubscribing managed memory
/// can stall the whole GPU.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::buffer::UnifiedBuffer;
/// use cuweave_memory::unified::MemLocation;
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let mut data = UnifiedBuffer::<u32>::new(&context, 1 << 20)?;
/// data.as_mut_slice()?.fill(1);
/// data.prefetch_to(MemLocation::Device(0), &stream)?;
/// // … kernels on `stream`, then `data.record_use(&stream)` …
/// data.prefetch_to(MemLocation::Host, &stream)?;
/// let sum: u64 = data.as_slice()?.iter().map(|&x| u64::from(x)).sum(); // waits for the stream
/// # let _ = sum;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct UnifiedBuffer<T: Element> {
    core: BufferCore,
    /// `Some` until the drop hands it to [`free_own_allocation`](super::graph_held).
    allocation: Option<ManagedAllocation>,
    concurrent_managed_access: bool,
    _element: PhantomData<T>,
}

impl<T: Element> UnifiedBuffer<T> {
    /// Allocates `len` elements of managed memory, set to zero (by a device memset: the host
    /// may read the memory as a slice, so it is never handed out uninitialized).
    ///
    /// # Errors
    /// `ZeroLength` for `len == 0`, `Misaligned` on overflow, `CapabilityMissing` on a device
    /// without managed memory, the driver's out-of-memory error.
    pub fn new(context: &Arc<Context>, len: usize) -> Result<Self> {
        let mut buffer = Self::allocate(context, len)?;
        buffer.fill(T::zeroed())?;
        Ok(buffer)
    }

    /// Allocates `len` zeroed elements (the same as [`new`](Self::new)).
    pub fn zeroed(context: &Arc<Context>, len: usize) -> Result<Self> {
        Self::new(context, len)
    }

    /// Allocates managed memory holding a copy of `data`.
    ///
    /// # Errors
    /// `ZeroLength` for an empty slice.
    pub fn from_slice(context: &Arc<Context>, data: &[T]) -> Result<Self> {
        let mut buffer = Self::allocate(context, data.len())?;
        buffer.copy_from_host(data)?;
        Ok(buffer)
    }

    // Uninitialized: every constructor writes the whole buffer before handing it out.
    fn allocate(context: &Arc<Context>, len: usize) -> Result<Self> {
        let bytes = allocation_bytes::<T>("UnifiedBuffer::new", len)?;
        let capabilities = ManagedCapabilities::of(context.device())?;
        capabilities.require_managed_memory("UnifiedBuffer::new")?;
        let allocation = ManagedAllocation::new(context, bytes)?;
        Ok(Self {
            core: BufferCore::new(context, allocation.ptr(), len, size_of::<T>())?,
            allocation: Some(allocation),
            concurrent_managed_access: capabilities.concurrent_managed_access,
            _element: PhantomData,
        })
    }

    /// The elements, after waiting for every queued device write of the buffer (blocks; device
    /// reads of it may go on while the host reads too). While the slice lives, graphs whose
    /// captures wrote the buffer are not launched (see [`HostSlice`]).
    ///
    /// # Errors
    /// `CapabilityMissing` on devices without concurrent managed access: there any GPU work
    /// queued later in the context (by any thread) would fault the host's reads, which a slice
    /// cannot prevent; use the [`Buffer`] copies there.
    pub fn as_slice(&self) -> Result<HostSlice<'_, T>> {
        let held = self.wait_for_host("UnifiedBuffer::as_slice", Access::Read)?;
        Ok(HostSlice::new(
            raw::managed_slice(self.managed(), self.core.len())?,
            held,
        ))
    }

    /// The elements, or `DeviceBusy` while queued device work may still write the buffer
    /// (queued reads do not stand in the way).
    ///
    /// # Errors
    /// `CapabilityMissing` on devices without concurrent managed access, as for
    /// [`as_slice`](Self::as_slice).
    pub fn try_as_slice(&self) -> Result<HostSlice<'_, T>> {
        let held = self.ensure_host_ready("UnifiedBuffer::try_as_slice", Access::Read)?;
        Ok(HostSlice::new(
            raw::managed_slice(self.managed(), self.core.len())?,
            held,
        ))
    }

    /// The elements, writable, after waiting for every queued device use (blocks). While the
    /// slice lives, graphs whose captures used the buffer are not launched (see
    /// [`HostSliceMut`]).
    pub fn as_mut_slice(&mut self) -> Result<HostSliceMut<'_, T>> {
        let held = self.wait_for_host("UnifiedBuffer::as_mut_slice", Access::Write)?;
        let len = self.core.len();
        Ok(HostSliceMut::new(
            raw::managed_slice_mut(self.managed_mut(), len)?,
            held,
        ))
    }

    /// The elements, writable, or `DeviceBusy` while queued device work may use the buffer.
    pub fn try_as_mut_slice(&mut self) -> Result<HostSliceMut<'_, T>> {
        let held = self.ensure_host_ready("UnifiedBuffer::try_as_mut_slice", Access::Write)?;
        let len = self.core.len();
        Ok(HostSliceMut::new(
            raw::managed_slice_mut(self.managed_mut(), len)?,
            held,
        ))
    }

    /// The driver allocation, for interop.
    pub fn allocation(&self) -> &ManagedAllocation {
        self.managed()
    }

    fn managed(&self) -> &ManagedAllocation {
        self.allocation
            .as_ref()
            .expect("a UnifiedBuffer holds its allocation until it is dropped")
    }

    fn managed_mut(&mut self) -> &mut ManagedAllocation {
        self.allocation
            .as_mut()
            .expect("a UnifiedBuffer holds its allocation until it is dropped")
    }

    fn wait_for_host(&self, operation: &'static str, access: Access) -> Result<Option<HostBorrow>> {
        self.require_concurrent_access(operation)?;
        self.core.tracker().synchronize_for_host(access)
    }

    fn ensure_host_ready(
        &self,
        operation: &'static str,
        access: Access,
    ) -> Result<Option<HostBorrow>> {
        self.require_concurrent_access(operation)?;
        self.core.tracker().ensure_idle_for_host(access, operation)
    }

    /// Host slices need concurrent managed access: without it, any GPU work queued later in the
    /// context, by any thread, makes the host's access to managed memory fault, and a slice
    /// cannot stop that. Such devices reach the memory through copies instead.
    fn require_concurrent_access(&self, operation: &'static str) -> Result<()> {
        if self.concurrent_managed_access {
            Ok(())
        } else {
            Err(cuweave_driver::DriverError::CapabilityMissing {
                capability: "concurrent managed access",
                device: self.core.context().device().ordinal(),
                operation,
            }
            .into())
        }
    }

    /// The buffer's last-use tracker.
    pub(crate) fn tracker(&self) -> &StreamTracker {
        self.core.tracker()
    }
}

impl<T: Element> Sealed for UnifiedBuffer<T> {
    fn core(&self) -> CoreRef<'_> {
        self.core.as_ref()
    }
}

impl<T: Element> Buffer<T> for UnifiedBuffer<T> {}

impl<T: Element> Drop for UnifiedBuffer<T> {
    /// Frees the managed memory once nothing can use it: after the events of its uses have
    /// completed; when stream captures used it, once the graph pools of those captures have
    /// died (a graph may replay with the memory until then; leaked for a capture with no pool);
    /// freed while a capture is active, once none is (nothing may wait for the device, nor free
    /// memory, during a capture). See `free_own_allocation`.
    fn drop(&mut self) {
        let markers = self.core.tracker_mut().take_for_free();
        let Some(allocation) = self.allocation.take() else {
            return;
        };
        let bytes = allocation.len();
        super::graph_held::free_own_allocation(
            self.core.context(),
            allocation,
            bytes,
            markers,
            "UnifiedBuffer",
        );
    }
}
