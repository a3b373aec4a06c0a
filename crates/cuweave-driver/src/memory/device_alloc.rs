//! Device memory from `cuMemAlloc`, and stream-ordered `cuMemAllocAsync` / `cuMemFreeAsync`.

use std::sync::Arc;

use super::{DevicePtr, nonzero};
use crate::context::Context;
use crate::error::Result;
use crate::loader::{cu, driver};
use crate::stream::Stream;

/// Device memory allocated with `cuMemAlloc`, freed with `cuMemFree` on drop.
///
/// Dropping synchronises with the device (that is what `cuMemFree` does), so memory is never
/// freed under queued work; allocators that must not block use stream-ordered frees instead.
#[derive(Debug)]
pub struct DeviceAllocation {
    context: Arc<Context>,
    ptr: DevicePtr,
    bytes: usize,
}

impl DeviceAllocation {
    /// Allocates `bytes` of device memory in `context`.
    ///
    /// Works while a capture begun through cuweave is active, on the capturing thread too: a
    /// capture records no `cuMemAlloc`, so the call (and the `cuMemFree` at drop) is made in
    /// relaxed capture mode, where the driver would otherwise refuse it and break the capture.
    /// Work queued into the capture that uses the memory is the caller's to keep within its
    /// life, as for any raw launch.
    ///
    /// # Errors
    /// `InvalidArgument` for zero bytes; the driver's `CUDA_ERROR_OUT_OF_MEMORY`
    /// ([`crate::DriverError::is_out_of_memory`]) when the device is full.
    pub fn new(context: &Arc<Context>, bytes: usize) -> Result<Self> {
        nonzero(bytes, "DeviceAllocation::new")?;
        context.bind_to_thread()?;
        let api = driver()?;
        let mut ptr = 0;
        // A capture records no allocation: made in relaxed mode, it leaves an active capture
        // intact (as PyTorch's relaxed captures allow `cudaMalloc`).
        let relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: valid out-pointer; nonzero size; the context is current.
        let allocated = unsafe { cu!(api.mem_alloc(&mut ptr, bytes)) };
        drop(relaxed);
        allocated?;
        Ok(Self {
            context: Arc::clone(context),
            ptr,
            bytes,
        })
    }

    /// Allocates `bytes` of device memory in `context`, every byte zero: cudarc's
    /// `alloc_zeros`, PyTorch's `torch.zeros`. `cuMemAlloc` hands back whatever a previous
    /// owner left there (a freed block is reused as it is), so the memory is cleared and the
    /// call returns once the clearing has finished: work queued on any stream afterwards reads
    /// zeros. The memset runs on a stream of its own, non-blocking: the legacy stream's
    /// `cuMemsetD8` would also wait for all work on the context's blocking streams (an
    /// unrelated kernel would delay the allocation).
    ///
    /// # Errors
    /// As [`new`](Self::new); [`GraphError::Capturing`](crate::GraphError::Capturing) while a
    /// capture forbids the wait, before anything is allocated; the memset's error (the memory
    /// is freed again then).
    pub fn zeroed(context: &Arc<Context>, bytes: usize) -> Result<Self> {
        nonzero(bytes, "DeviceAllocation::zeroed")?;
        crate::graph::refuse_while_capturing(None, "DeviceAllocation::zeroed")?;
        let allocation = Self::new(context, bytes)?;
        let stream = Stream::new(context, crate::stream::StreamFlags::NON_BLOCKING)?;
        // SAFETY: the allocation is ours and `bytes` long; it outlives the memset, which the
        // stream's synchronisation waits for before the allocation is handed out or dropped.
        unsafe { super::memset_d8_async(allocation.ptr, 0, bytes, &stream) }?;
        stream.synchronize()?;
        Ok(allocation)
    }

    /// Takes ownership of memory from `cuMemAlloc`.
    ///
    /// # Safety
    /// `ptr` must come from `cuMemAlloc` in `context`, be `bytes` long, and be owned by nobody else.
    pub unsafe fn from_raw(context: &Arc<Context>, ptr: DevicePtr, bytes: usize) -> Self {
        Self {
            context: Arc::clone(context),
            ptr,
            bytes,
        }
    }

    /// Gives up ownership: the caller must `cuMemFree` the returned pointer.
    pub fn into_raw(self) -> (DevicePtr, usize) {
        let this = std::mem::ManuallyDrop::new(self);
        (this.ptr, this.bytes)
    }

    /// The device address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Always `false`: allocations are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The context the memory belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        // SAFETY: we own this allocation from cuMemAlloc and free it once.
        if let Err(error) = unsafe { super::free_device_memory(&self.context, self.ptr) } {
            tracing::warn!(%error, bytes = self.bytes, "freeing device memory failed");
        }
    }
}

/// Allocates `bytes` from the device's current memory pool, ordered on `stream`
/// (`cuMemAllocAsync`): the memory may be used by work queued on `stream` after this call.
///
/// # Errors
/// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing queued, when `stream` is
/// the legacy default stream while a blocking stream of its context captures
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// The caller owns the returned pointer and must release it exactly once with [`free_async`]
/// (or `cuMemFree`), and must not use it on another stream without ordering that stream after
/// this one.
pub unsafe fn alloc_async(stream: &Stream, bytes: usize) -> Result<DevicePtr> {
    nonzero(bytes, "alloc_async")?;
    crate::graph::refuse_on_legacy_stream(stream, "alloc_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    let mut ptr = 0;
    crate::graph::relaxed_beside_captures(|| {
        // SAFETY: valid out-pointer; live stream whose context is current.
        unsafe { cu!(api.mem_alloc_async(&mut ptr, bytes, stream.as_raw())) }
    })?;
    Ok(ptr)
}

/// Frees stream-ordered memory once the work queued on `stream` so far has finished
/// (`cuMemFreeAsync`).
///
/// # Errors
/// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing queued, when `stream` is
/// the legacy default stream while a blocking stream of its context captures
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)). The memory stays allocated.
///
/// # Safety
/// `ptr` must come from a stream-ordered allocation that has not been freed, and no work
/// ordered after this free on any stream may touch it.
pub unsafe fn free_async(ptr: DevicePtr, stream: &Stream) -> Result<()> {
    crate::graph::refuse_on_legacy_stream(stream, "free_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    crate::graph::relaxed_beside_captures(|| {
        // SAFETY: the caller guarantees `ptr` is a live stream-ordered allocation.
        unsafe { cu!(api.mem_free_async(ptr, stream.as_raw())) }
    })
}
