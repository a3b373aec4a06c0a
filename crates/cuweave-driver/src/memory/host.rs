//! Page-locked host memory: allocated ([`HostAllocation`]) or registered ([`HostRegistration`]).

use std::ptr::NonNull;
use std::sync::Arc;

use super::{DevicePtr, nonzero};
use crate::context::Context;
use crate::error::{DriverError, Result};
use crate::loader::{cu, driver};
use crate::sys;

/// Flags for [`HostAllocation::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostAllocFlags {
    /// Pinned for every context, not only the allocating one (`CU_MEMHOSTALLOC_PORTABLE`).
    pub portable: bool,
    /// Mapped into the device address space for zero-copy access (`CU_MEMHOSTALLOC_DEVICEMAP`).
    pub device_map: bool,
    /// Write-combined: fast host writes and device reads, very slow host reads.
    pub write_combined: bool,
}

impl HostAllocFlags {
    /// Portable and mapped: usable by every context, and by kernels directly.
    pub const PORTABLE_MAPPED: Self = Self {
        portable: true,
        device_map: true,
        write_combined: false,
    };

    fn bits(self) -> u32 {
        let mut bits = 0;
        if self.portable {
            bits |= sys::CU_MEMHOSTALLOC_PORTABLE;
        }
        if self.device_map {
            bits |= sys::CU_MEMHOSTALLOC_DEVICEMAP;
        }
        if self.write_combined {
            bits |= sys::CU_MEMHOSTALLOC_WRITECOMBINED;
        }
        bits
    }
}

/// Page-locked (pinned) host memory from `cuMemHostAlloc`, freed on drop.
///
/// Pinned memory lets copies run asynchronously at full bus speed. Pinning is slow (tens of
/// milliseconds for 64 MiB): pool it rather than allocating per transfer.
#[derive(Debug)]
pub struct HostAllocation {
    context: Arc<Context>,
    ptr: NonNull<u8>,
    bytes: usize,
    flags: HostAllocFlags,
}

// SAFETY: the allocation is plain host memory owned by this value; the pointer is not shared
// except through borrows of `self`.
unsafe impl Send for HostAllocation {}
// SAFETY: `&self` only hands out shared reads (as_ptr); writes need `&mut self` or `unsafe`.
unsafe impl Sync for HostAllocation {}

impl HostAllocation {
    /// Allocates `bytes` of pinned host memory.
    ///
    /// Works while a capture begun through cuweave is active, on the capturing thread too: a
    /// capture does not record pinning, so the call is made in relaxed capture mode, where the
    /// driver would otherwise refuse it (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`) under a
    /// global or thread-local capture.
    pub fn new(context: &Arc<Context>, bytes: usize, flags: HostAllocFlags) -> Result<Self> {
        nonzero(bytes, "HostAllocation::new")?;
        context.bind_to_thread()?;
        let api = driver()?;
        let mut ptr = std::ptr::null_mut();
        let relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: valid out-pointer; nonzero size; the context is current.
        let pinned = unsafe { cu!(api.mem_host_alloc(&mut ptr, bytes, flags.bits())) };
        drop(relaxed);
        pinned?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| {
            DriverError::invalid("HostAllocation::new", "driver returned a null pointer")
        })?;
        tracing::debug!(bytes, "pinned host memory allocated");
        Ok(Self {
            context: Arc::clone(context),
            ptr,
            bytes,
            flags,
        })
    }

    /// The start of the allocation.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The start of the allocation, writable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Always `false`: allocations are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The flags it was allocated with.
    pub fn flags(&self) -> HostAllocFlags {
        self.flags
    }

    /// The context it was allocated in.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// The memory as bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the allocation is `bytes` long, initialised by the driver (pinned pages are
        // zero-filled by the OS), and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes) }
    }

    /// The memory as mutable bytes.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `as_bytes`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.bytes) }
    }

    /// The device address of mapped memory (allocated with `device_map`), for zero-copy kernels.
    ///
    /// # Errors
    /// `InvalidArgument` when the allocation is not mapped.
    pub fn device_ptr(&self) -> Result<DevicePtr> {
        if !self.flags.device_map {
            return Err(DriverError::invalid(
                "HostAllocation::device_ptr",
                "allocation was not made with HostAllocFlags::device_map",
            ));
        }
        self.context.bind_to_thread()?;
        let api = driver()?;
        let mut dptr = 0;
        // SAFETY: valid out-pointer; a live mapped host allocation; flags must be 0.
        unsafe { cu!(api.mem_host_get_device_pointer(&mut dptr, self.ptr.as_ptr().cast(), 0)) }?;
        Ok(dptr)
    }
}

impl Drop for HostAllocation {
    /// Gives the memory back with `cuMemFreeHost`, which waits for the whole device (work on
    /// every stream) and meanwhile holds the driver's lock, so launches on other threads wait
    /// too (measured on the H200: a 300 ms kernel on another stream held both the free and a
    /// launch on a third stream 300 ms). Pool pinned memory that is freed often: the memory
    /// layer's `PinnedBuffer::new` and `PinnedPool` do.
    fn drop(&mut self) {
        let Ok(api) = driver() else { return };
        if let Err(error) = self.context.bind_to_thread() {
            tracing::warn!(%error, "binding context to free pinned memory failed");
            return;
        }
        // Relaxed while capturing, as `new` is: a capture records no free.
        let _relaxed = match crate::graph::relaxed_for_unrecorded_call() {
            Ok(relaxed) => relaxed,
            Err(error) => {
                tracing::warn!(%error, bytes = self.bytes, "cannot enter relaxed capture mode; leaking pinned memory");
                return;
            }
        };
        // SAFETY: we own this allocation from cuMemHostAlloc and free it once.
        if let Err(error) = unsafe { cu!(api.mem_free_host(self.ptr.as_ptr().cast())) } {
            tracing::warn!(%error, bytes = self.bytes, "cuMemFreeHost failed");
        }
    }
}

/// Existing host memory page-locked in place with `cuMemHostRegister`, unregistered on drop
/// (or by [`unregister`](Self::unregister), which hands the memory back).
///
/// Holds the exclusive borrow of the slice for as long as it is registered, so nothing else can
/// free or move it meanwhile; the memory stays readable and writable through
/// [`as_bytes`](Self::as_bytes) and [`as_bytes_mut`](Self::as_bytes_mut).
pub struct HostRegistration<'a> {
    context: Arc<Context>,
    /// The registered memory; empty only after `unregister` took it back.
    memory: &'a mut [u8],
}

impl<'a> HostRegistration<'a> {
    /// Page-locks `memory` for the life of the returned value (portable to all contexts).
    pub fn new(context: &Arc<Context>, memory: &'a mut [u8]) -> Result<Self> {
        nonzero(memory.len(), "HostRegistration::new")?;
        context.bind_to_thread()?;
        let api = driver()?;
        // A capture records no pinning: relaxed while capturing, as `HostAllocation::new` is.
        let relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: the slice is valid for its length and exclusively borrowed for `'a`.
        let registered = unsafe {
            cu!(api.mem_host_register(
                memory.as_mut_ptr().cast(),
                memory.len(),
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            ))
        };
        drop(relaxed);
        registered?;
        Ok(Self {
            context: Arc::clone(context),
            memory,
        })
    }

    /// The start of the registered range.
    pub fn as_ptr(&self) -> *const u8 {
        self.memory.as_ptr()
    }

    /// The start of the registered range, writable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.memory.as_mut_ptr()
    }

    /// The registered length in bytes.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Always `false`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The registered memory.
    pub fn as_bytes(&self) -> &[u8] {
        self.memory
    }

    /// The registered memory, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.memory
    }

    /// The context it was registered in.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Unregisters now (`cuMemHostUnregister`) and hands the memory back.
    ///
    /// # Errors
    /// The driver's error; the borrow of the memory ends either way.
    pub fn unregister(mut self) -> Result<&'a mut [u8]> {
        // Taking the memory leaves an empty slice, which `Drop` skips.
        let memory = std::mem::take(&mut self.memory);
        unregister(&self.context, memory)?;
        Ok(memory)
    }
}

// By hand: a derived `Debug` would print every registered byte.
impl std::fmt::Debug for HostRegistration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration")
            .field("context", &self.context)
            .field("ptr", &self.memory.as_ptr())
            .field("bytes", &self.memory.len())
            .finish()
    }
}

/// `cuMemHostUnregister` of memory registered by [`HostRegistration::new`].
fn unregister(context: &Context, memory: &mut [u8]) -> Result<()> {
    context.bind_to_thread()?;
    let api = driver()?;
    let _relaxed = crate::graph::relaxed_for_unrecorded_call()?;
    // SAFETY: `memory` is exactly the range a `HostRegistration` registered; its owner gives it
    // up here, so it is unregistered once.
    unsafe { cu!(api.mem_host_unregister(memory.as_mut_ptr().cast())) }?;
    Ok(())
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        if self.memory.is_empty() || driver().is_err() {
            return;
        }
        if let Err(error) = unregister(&self.context, self.memory) {
            tracing::warn!(%error, bytes = self.memory.len(), "cuMemHostUnregister failed");
        }
    }
}
