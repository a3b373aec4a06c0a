//! [`MemoryPool`]: a stream-ordered memory pool (`cuMemPool*`).

use std::sync::Arc;

use super::{DevicePtr, nonzero};
use crate::context::Context;
use crate::error::{DriverError, Result};
use crate::loader::{cu, driver};
use crate::stream::Stream;
use crate::sys;

/// A pool that stream-ordered allocations come from.
///
/// Either the device's default pool ([`MemoryPool::device_default`], shared with everything
/// else that calls `cuMemAllocAsync`) or a private one ([`MemoryPool::new`], destroyed on drop).
/// Set a release threshold to keep freed memory cached in the pool instead of returning it to
/// the driver at every synchronisation.
#[derive(Debug)]
pub struct MemoryPool {
    context: Arc<Context>,
    raw: sys::CUmemoryPool,
    owned: bool,
}

// SAFETY: a CUmemoryPool is a driver object usable from any thread.
unsafe impl Send for MemoryPool {}
// SAFETY: as above; no method mutates `self`.
unsafe impl Sync for MemoryPool {}

impl MemoryPool {
    fn require_pools(context: &Context, operation: &'static str) -> Result<()> {
        if context.device().supports_memory_pools()? {
            Ok(())
        } else {
            Err(DriverError::CapabilityMissing {
                capability: "memory pools",
                device: context.device().ordinal(),
                operation,
            })
        }
    }

    /// The device's default pool (what `cuMemAllocAsync` uses). Not destroyed on drop.
    pub fn device_default(context: &Arc<Context>) -> Result<Self> {
        Self::require_pools(context, "MemoryPool::device_default")?;
        let api = driver()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer, valid device.
        unsafe { cu!(api.device_get_default_mem_pool(&mut raw, context.device().as_raw())) }?;
        Ok(Self {
            context: Arc::clone(context),
            raw,
            owned: false,
        })
    }

    /// A new private pool of pinned device memory on the context's device.
    pub fn new(context: &Arc<Context>) -> Result<Self> {
        Self::require_pools(context, "MemoryPool::new")?;
        let api = driver()?;
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: context.device().ordinal() as i32,
            },
            ..Default::default()
        };
        let mut raw = std::ptr::null_mut();
        // A capture records no pool creation, and a stream-ordered allocator makes its pool on
        // first use, which may be inside a capture: relaxed while one is active, as loads are.
        let _relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: valid out-pointer and fully initialised properties.
        unsafe { cu!(api.mem_pool_create(&mut raw, &props)) }?;
        Ok(Self {
            context: Arc::clone(context),
            raw,
            owned: true,
        })
    }

    /// Wraps a pool another library created.
    ///
    /// # Safety
    /// `raw` must be a live memory pool of `context`'s device. With `owned`, the handle destroys
    /// it on drop and nobody else may; without, the pool must outlive the handle.
    pub unsafe fn from_raw(context: &Arc<Context>, raw: sys::CUmemoryPool, owned: bool) -> Self {
        Self {
            context: Arc::clone(context),
            raw,
            owned,
        }
    }

    /// The raw `CUmemoryPool`.
    pub fn as_raw(&self) -> sys::CUmemoryPool {
        self.raw
    }

    /// The context whose device the pool serves.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    fn get_u64(&self, attribute: sys::CUmemPool_attribute) -> Result<u64> {
        let api = driver()?;
        let mut value = 0u64;
        // A read a capture does not record; refused (and the capture broken) under a global or
        // thread-local capture unless relaxed.
        let _relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: the threshold and size attributes are 64-bit; `value` is a valid out-pointer.
        unsafe {
            cu!(api.mem_pool_get_attribute(self.raw, attribute, (&mut value as *mut u64).cast()))
        }?;
        Ok(value)
    }

    /// Bytes the pool keeps cached before releasing memory back to the OS at a synchronisation.
    pub fn release_threshold(&self) -> Result<u64> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
    }

    /// Sets the release threshold; `u64::MAX` keeps everything cached.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        let api = driver()?;
        let mut value = bytes;
        // Not recorded by a capture (see `new`).
        let _relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: the attribute is 64-bit and `value` outlives the call.
        unsafe {
            cu!(api.mem_pool_set_attribute(
                self.raw,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            ))
        }
    }

    /// Bytes the pool currently holds from the driver.
    pub fn reserved_bytes(&self) -> Result<u64> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    }

    /// Bytes currently handed out by the pool.
    pub fn used_bytes(&self) -> Result<u64> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// Releases cached memory until the pool holds at most `keep_bytes` (plus what is in use).
    pub fn trim_to(&self, keep_bytes: usize) -> Result<()> {
        let api = driver()?;
        // Not recorded by a capture (see `new`).
        let _relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: live pool.
        unsafe { cu!(api.mem_pool_trim_to(self.raw, keep_bytes)) }
    }

    /// Allocates `bytes` from this pool, ordered on `stream` (`cuMemAllocFromPoolAsync`).
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing allocated, when `stream`
    /// is the legacy default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
    ///
    /// # Safety
    /// As [`super::alloc_async`]: release the pointer exactly once with [`super::free_async`],
    /// and order any other stream that uses it after `stream`.
    pub unsafe fn alloc_async(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        nonzero(bytes, "MemoryPool::alloc_async")?;
        stream.ensure_device(self.context.device(), "MemoryPool::alloc_async")?;
        crate::graph::refuse_on_legacy_stream(stream, "MemoryPool::alloc_async")?;
        stream.context().bind_to_thread()?;
        let api = driver()?;
        let mut ptr = 0;
        crate::graph::relaxed_beside_captures(|| {
            // SAFETY: valid out-pointer; live pool and stream of the same device.
            unsafe {
                cu!(api.mem_alloc_from_pool_async(&mut ptr, bytes, self.raw, stream.as_raw()))
            }
        })?;
        Ok(ptr)
    }
}

impl Drop for MemoryPool {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let Ok(api) = driver() else { return };
        // Not recorded by a capture (see `new`).
        let _relaxed = match crate::graph::relaxed_for_unrecorded_call() {
            Ok(relaxed) => relaxed,
            Err(error) => {
                tracing::warn!(%error, "cannot enter relaxed capture mode; leaking a memory pool");
                return;
            }
        };
        // SAFETY: we created this pool and destroy it once; the driver defers destruction until
        // outstanding allocations are freed.
        if let Err(error) = unsafe { cu!(api.mem_pool_destroy(self.raw)) } {
            tracing::warn!(%error, "destroying a memory pool failed");
        }
    }
}
