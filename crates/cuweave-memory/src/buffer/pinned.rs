//! [`PinnedBuffer`]: typed page-locked host memory, readable as a slice and a fast copy partner.

use std::marker::PhantomData;
use std::sync::Arc;

use cuweave_driver::Context;
use cuweave_driver::memory::{DevicePtr, HostAllocFlags, HostAllocation};

use super::common::{Buffer, BufferCore, CoreRef, sealed::Sealed};
use super::host_slice::{HostSlice, HostSliceMut};
use super::range::{allocation_bytes, check_range};
use super::tracker::{Access, StreamTracker};
use crate::element::Element;
use crate::error::{MemoryError, Result};
use crate::pinned_pool::{PinnedBlock, PinnedPool};

/// `len` elements of `T` in page-locked (pinned) host memory, mapped into the device's address
/// space: a block of the context's process-wide pinned pool ([`new`](Self::new)), of another
/// pool ([`from_pool`](Self::from_pool)) or its own allocation
/// ([`new_unpooled`](Self::new_unpooled)). Dropping a pool's buffer does not wait: the block
/// goes back to its pool, which hands it out again once every queued use of the buffer has
/// finished (a block the pool's cache cap leaves no room for is given back to the driver,
/// whose free waits for the device: keep buffers of more than the cap, 1 GiB by default). An own allocation is freed after those uses, waiting for them and, in
/// `cuMemFreeHost`, for the whole device.
///
/// Copies between pinned memory and the device run at full bus speed and truly asynchronously:
/// pass a `PinnedBuffer` (owned or borrowed) as the host side of
/// [`Buffer::copy_from_host_async`] / [`Buffer::copy_to_host_async`]. It is also a [`Buffer`]
/// itself (its [`device_ptr`](Buffer::device_ptr) is the mapped address, usable by kernels).
///
/// Host access waits for queued device work: [`as_slice`](Self::as_slice) and
/// [`as_mut_slice`](Self::as_mut_slice) block until the last use on any stream has finished,
/// [`try_as_slice`](Self::try_as_slice) refuses with [`MemoryError::DeviceBusy`] instead.
/// Once a stream capture has used the buffer, host access also waits for graph launches, which
/// record no uses: it synchronises the context unless no graph was launched since its last such
/// wait (refused with `GraphError::Capturing` while a capture is active; see docs/graphs.md).
/// Pinning is slow (tens of milliseconds for 64 MiB): the pools pin a size class once and reuse it.
///
/// ```no_run
/// use cuweave_driver::{Context, Device};
/// use cuweave_memory::buffer::PinnedBuffer;
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let mut staging = PinnedBuffer::<u32>::new(&context, 4096)?;
/// staging.as_mut_slice()?.iter_mut().enumerate().for_each(|(i, x)| *x = i as u32);
/// assert_eq!(staging.as_slice()?[7], 7);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct PinnedBuffer<T: Element> {
    core: BufferCore,
    allocation: HostMemory,
    _element: PhantomData<T>,
}

/// Where a pinned buffer's memory came from.
#[derive(Debug)]
enum HostMemory {
    /// Its own `cuMemHostAlloc`, freed when the buffer drops.
    Own(HostAllocation),
    /// A block of a [`PinnedPool`], returned to it when the buffer drops.
    Pool(PinnedBlock),
    /// Given back (only while dropping).
    Gone,
}

impl HostMemory {
    fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Own(allocation) => allocation.as_bytes(),
            Self::Pool(block) => block.as_slice(),
            Self::Gone => &[],
        }
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Own(allocation) => allocation.as_bytes_mut(),
            Self::Pool(block) => block.as_mut_slice(),
            Self::Gone => &mut [],
        }
    }

    fn as_ptr(&self) -> *const u8 {
        self.as_bytes().as_ptr()
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_bytes_mut().as_mut_ptr()
    }
}

impl<T: Element> PinnedBuffer<T> {
    /// `len` elements of pinned host memory, set to zero (host memory may be read as a slice,
    /// so it is never handed out uninitialized), from the context's process-wide pinned pool
    /// ([`PinnedPool::default_for`]), as PyTorch's `pin_memory` takes its memory from its
    /// caching host allocator: no pinning when the pool has a block of the size class cached,
    /// and dropping returns the block to the pool without waiting (reused once the buffer's
    /// queued uses have finished). Giving pinned memory back to the driver would wait for the
    /// whole device and hold the driver's lock meanwhile, so a temporary buffer's drop, and
    /// launches on other threads, would wait for unrelated kernels; for memory of exactly
    /// `len` elements, pinned for this buffer alone, see [`new_unpooled`](Self::new_unpooled),
    /// which is also what a borrowed context ([`Context::is_borrowed`]) gets: a process-wide
    /// pool must not outlive a context another library owns.
    ///
    /// # Errors
    /// `ZeroLength` for `len == 0`, `Misaligned` on overflow or when `T` needs more than page
    /// alignment, the driver's error when pinning fails.
    pub fn new(context: &Arc<Context>, len: usize) -> Result<Self> {
        const OPERATION: &str = "PinnedBuffer::new";
        if context.is_borrowed() {
            // A process-wide pool must not outlive a context another library owns.
            return Self::new_unpooled(context, len);
        }
        let pool = PinnedPool::default_for(context);
        let bytes = allocation_bytes::<T>(OPERATION, len)?;
        let mut block = pool.get(bytes)?;
        block.as_mut_slice()[..bytes].fill(0);
        Self::from_block(&pool, block, len, OPERATION)
    }

    /// `len` elements of pinned host memory of this buffer's own (`cuMemHostAlloc`), set to
    /// zero, freed when the buffer drops: no pool, no rounding up to a size class. The free
    /// (`cuMemFreeHost`) waits for the whole device, work on every stream, and holds the
    /// driver's lock meanwhile: keep such a buffer for long, or use [`new`](Self::new).
    ///
    /// # Errors
    /// `ZeroLength` for `len == 0`, `Misaligned` on overflow, the driver's error when pinning
    /// fails.
    pub fn new_unpooled(context: &Arc<Context>, len: usize) -> Result<Self> {
        let bytes = allocation_bytes::<T>("PinnedBuffer::new_unpooled", len)?;
        let mut allocation = HostAllocation::new(context, bytes, HostAllocFlags::PORTABLE_MAPPED)?;
        allocation.as_bytes_mut().fill(0);
        let device_ptr = allocation.device_ptr()?;
        Ok(Self {
            core: BufferCore::new(context, device_ptr, len, size_of::<T>())?,
            allocation: HostMemory::Own(allocation),
            _element: PhantomData,
        })
    }

    /// `len` elements in a block of `pool` (no pinning when the pool has one cached): the typed
    /// way to stage copies through the pool. The block goes back to the pool when the buffer
    /// drops, without waiting: the pool hands it out again only once every use the buffer
    /// recorded has finished. A block that stream captures used is not handed out again while a
    /// graph of theirs may replay with it: until the graph pools of the captures have died (a
    /// capture with no pool: never; the pool leaks it when it goes away).
    ///
    /// The contents are whatever the block last held (plain data: any bytes are valid values);
    /// write them before reading.
    ///
    /// # Errors
    /// `ZeroLength` for `len == 0`, `Misaligned` on overflow or when `T` needs more than page
    /// alignment; as [`PinnedPool::get`] otherwise; `CapabilityMissing` when the pool's blocks
    /// are not mapped and the device lacks unified addressing (then its device-side operations
    /// would have no address).
    pub fn from_pool(pool: &PinnedPool, len: usize) -> Result<Self> {
        const OPERATION: &str = "PinnedBuffer::from_pool";
        let bytes = allocation_bytes::<T>(OPERATION, len)?;
        let block = pool.get(bytes)?;
        Self::from_block(pool, block, len, OPERATION)
    }

    /// A buffer of `len` elements over `block`, a block of `pool` at least that long.
    fn from_block(
        pool: &PinnedPool,
        block: PinnedBlock,
        len: usize,
        operation: &'static str,
    ) -> Result<Self> {
        let bytes = len * size_of::<T>();
        if !(block.as_slice().as_ptr() as usize).is_multiple_of(align_of::<T>()) {
            return Err(MemoryError::Misaligned {
                operation,
                bytes,
                element_size: size_of::<T>(),
            });
        }
        let device_ptr = if block.is_mapped() {
            block.device_ptr()?
        } else if pool.context().device().supports_unified_addressing()? {
            // Under unified addressing every pinned host allocation is device-accessible at its
            // host address (the CUDA driver API's "Unified Addressing" section), mapped or not.
            block.as_slice().as_ptr() as usize as DevicePtr
        } else {
            return Err(cuweave_driver::DriverError::CapabilityMissing {
                capability: "unified addressing (or a pool of mapped blocks)",
                device: pool.context().device().ordinal(),
                operation,
            }
            .into());
        };
        let tracker = StreamTracker::with_events(pool.event_pool()?.clone());
        Ok(Self {
            core: BufferCore::with_tracker(tracker, device_ptr, len, size_of::<T>()),
            allocation: HostMemory::Pool(block),
            _element: PhantomData,
        })
    }

    /// Allocates `len` zeroed elements (the same as [`new`](Self::new)).
    pub fn zeroed(context: &Arc<Context>, len: usize) -> Result<Self> {
        Self::new(context, len)
    }

    /// Allocates a pinned copy of `data`.
    ///
    /// # Errors
    /// `ZeroLength` for an empty slice.
    pub fn from_slice(context: &Arc<Context>, data: &[T]) -> Result<Self> {
        let mut buffer = Self::new(context, data.len())?;
        buffer.host_slice_mut()?.copy_from_slice(data);
        Ok(buffer)
    }

    /// The elements, after waiting for every queued device write of the buffer (blocks; device
    /// reads of it may go on while the host reads too). While the slice lives, graphs whose
    /// captures wrote the buffer are not launched (see [`HostSlice`]).
    ///
    /// # Errors
    /// As [`Buffer::synchronize`].
    pub fn as_slice(&self) -> Result<HostSlice<'_, T>> {
        let held = self.core.tracker().synchronize_for_host(Access::Read)?;
        Ok(HostSlice::new(self.host_slice()?, held))
    }

    /// The elements, or `DeviceBusy` while queued device work may still write the buffer
    /// (queued reads do not stand in the way).
    pub fn try_as_slice(&self) -> Result<HostSlice<'_, T>> {
        let held = self
            .core
            .tracker()
            .ensure_idle_for_host(Access::Read, "PinnedBuffer::try_as_slice")?;
        Ok(HostSlice::new(self.host_slice()?, held))
    }

    /// The elements, writable, after waiting for every queued device use (blocks). While the
    /// slice lives, graphs whose captures used the buffer are not launched (see
    /// [`HostSliceMut`]).
    ///
    /// # Errors
    /// As [`Buffer::synchronize`].
    pub fn as_mut_slice(&mut self) -> Result<HostSliceMut<'_, T>> {
        let held = self.core.tracker().synchronize_for_host(Access::Write)?;
        Ok(HostSliceMut::new(self.host_slice_mut()?, held))
    }

    /// The elements, writable, or `DeviceBusy` while queued device work may use the buffer.
    pub fn try_as_mut_slice(&mut self) -> Result<HostSliceMut<'_, T>> {
        let held = self
            .core
            .tracker()
            .ensure_idle_for_host(Access::Write, "PinnedBuffer::try_as_mut_slice")?;
        Ok(HostSliceMut::new(self.host_slice_mut()?, held))
    }

    /// The host address of element 0, for interop. Safe reads and writes go through
    /// [`as_slice`](Self::as_slice) and [`as_mut_slice`](Self::as_mut_slice), which wait for
    /// queued device work first; dereferencing this pointer is `unsafe` and leaves that to the
    /// caller. There is no way to the raw `HostAllocation`, whose safe `as_bytes` would read the
    /// memory under a queued copy (a regression test):
    ///
    /// ```compile_fail
    /// fn read_under_a_copy(pinned: &cuweave_memory::PinnedBuffer<u8>) -> u8 {
    ///     pinned.allocation().as_bytes()[0]
    /// }
    /// ```
    pub fn as_host_ptr(&self) -> *const T {
        self.allocation.as_ptr().cast()
    }

    // Callers have made sure no device work can write the memory meanwhile.
    fn host_slice(&self) -> Result<&[T]> {
        let bytes = &self.allocation.as_bytes()[..self.core.bytes()];
        bytemuck::try_cast_slice(bytes).map_err(|_| self.misaligned())
    }

    // Callers have made sure no device work can use the memory meanwhile.
    fn host_slice_mut(&mut self) -> Result<&mut [T]> {
        let bytes = self.core.bytes();
        let error = self.misaligned();
        bytemuck::try_cast_slice_mut(&mut self.allocation.as_bytes_mut()[..bytes])
            .map_err(|_| error)
    }

    fn misaligned(&self) -> MemoryError {
        MemoryError::Misaligned {
            operation: "PinnedBuffer host slice",
            bytes: self.core.bytes(),
            element_size: size_of::<T>(),
        }
    }

    /// Host address of element 0, for the async copy functions.
    pub(crate) fn host_ptr(&self) -> *const u8 {
        self.allocation.as_ptr()
    }

    /// Writable host address of element 0, for the async copy functions.
    pub(crate) fn host_mut_ptr(&mut self) -> *mut u8 {
        self.allocation.as_mut_ptr()
    }

    /// The buffer's last-use tracker.
    pub(crate) fn tracker(&self) -> &StreamTracker {
        self.core.tracker()
    }
}

impl<T: Element> Sealed for PinnedBuffer<T> {
    fn core(&self) -> CoreRef<'_> {
        self.core.as_ref()
    }
}

/// Blocking host-side operations run on the CPU (after waiting for queued device uses): the
/// memory is the host's own, so a `memcpy` beats a DMA round trip.
impl<T: Element> Buffer<T> for PinnedBuffer<T> {
    fn fill(&mut self, value: T) -> Result<()> {
        self.as_mut_slice()?.fill(value);
        Ok(())
    }

    fn copy_range_from_host(&mut self, offset: usize, src: &[T]) -> Result<()> {
        let range = check_range(
            "PinnedBuffer::copy_range_from_host",
            offset,
            src.len(),
            self.core.len(),
        )?;
        self.as_mut_slice()?[range].copy_from_slice(src);
        Ok(())
    }

    fn copy_range_to_host(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        let range = check_range(
            "PinnedBuffer::copy_range_to_host",
            offset,
            dst.len(),
            self.core.len(),
        )?;
        dst.copy_from_slice(&self.as_slice()?[range]);
        Ok(())
    }
}

impl<T: Element> Drop for PinnedBuffer<T> {
    /// Memory stream captures used (`FreeMarkers::graph_pools`, ended captures too) is not
    /// reused nor unpinned while a graph of those captures may replay with its address: no
    /// event says when it no longer will (captured events cannot be queried, and the ones
    /// `take_for_free` drops for ended captures say nothing of replays). The graph pools of the
    /// captures hold it, and it returns (a pool block to the pool's ready list, an own
    /// allocation to the driver) once the last of them has died and the context has been
    /// synchronised. Used by a capture no pool was bound to, it is never reused: a pool block
    /// stays quarantined (leaked when the pool goes away), an own allocation is leaked.
    fn drop(&mut self) {
        let markers = self.core.tracker_mut().take_for_free();
        match std::mem::replace(&mut self.allocation, HostMemory::Gone) {
            HostMemory::Pool(mut block) => {
                // The pool gates the block's reuse on the tracker's events: no wait here.
                if markers.used_in_graphs() {
                    block.hold_for_graphs(markers.graph_pools);
                }
                block.add_events(markers.events.into_iter().map(|used| used.event));
            }
            HostMemory::Own(allocation) => {
                let bytes = allocation.len();
                super::graph_held::free_own_allocation(
                    self.core.context(),
                    allocation,
                    bytes,
                    markers,
                    "PinnedBuffer",
                );
            }
            HostMemory::Gone => {}
        }
    }
}
