//! [`AsyncPoolResource`]: stream-ordered memory from a private CUDA memory pool that keeps what
//! is freed.
// The driver's stream-ordered calls are `unsafe fn`s whose contract is "free each pointer from
// this pool exactly once"; this module upholds it with the `live` map, and is the only place in
// the resources that needs `unsafe`.
#![allow(unsafe_code)]

use std::sync::Arc;

use cuweave_driver::memory::{self, DevicePtr, MemoryPool};
use cuweave_driver::{Context, Stream};

use super::{LiveAllocations, MemoryResource, check_request, check_stream};
use crate::error::Result;

/// Stream-ordered device memory (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync`) from a private
/// [`MemoryPool`] whose release threshold is `u64::MAX`, so freed memory stays in the pool for
/// the next allocation instead of going back to the driver at each synchronisation.
///
/// Allocation and free are queued on the stream: the memory is usable by work queued on the
/// allocating stream afterwards, and returns to the pool when the freeing stream reaches the free.
/// Free on the stream of the last use, or order that stream after every other stream that used
/// the memory. Memory cached by the pool is released by
/// [`release_unused`](MemoryResource::release_unused) (which a caching allocator's `empty_cache`
/// calls) or with [`MemoryPool::trim_to`] on [`pool`](Self::pool); outstanding allocations are forgotten (not freed) when the resource
/// drops, and the pool is destroyed once they are freed elsewhere.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::resource::{AsyncPoolResource, MemoryResource};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let resource = AsyncPoolResource::new(&context)?;
/// let ptr = resource.allocate(1 << 20, &stream)?;
/// resource.deallocate(ptr, 1 << 20, &stream)?;
/// stream.synchronize()?;
/// assert!(resource.pool().reserved_bytes()? > 0, "the pool keeps the freed megabyte");
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct AsyncPoolResource {
    pool: MemoryPool,
    /// The live allocations, by address.
    live: LiveAllocations<()>,
}

impl AsyncPoolResource {
    /// A resource on a new private pool of `context`'s device, keeping all freed memory.
    ///
    /// # Errors
    /// [`DriverError::CapabilityMissing`](cuweave_driver::DriverError::CapabilityMissing) on a
    /// device without memory pools; the driver's error if the pool cannot be made.
    pub fn new(context: &Arc<Context>) -> Result<Self> {
        let pool = MemoryPool::new(context)?;
        pool.set_release_threshold(u64::MAX)?;
        Ok(Self {
            pool,
            live: LiveAllocations::new(),
        })
    }

    /// The pool the memory comes from (its reserved and used bytes, trimming).
    pub fn pool(&self) -> &MemoryPool {
        &self.pool
    }

    /// How many allocations are outstanding.
    pub fn outstanding(&self) -> usize {
        self.live.len()
    }
}

impl AsyncPoolResource {
    fn allocate_marked(&self, bytes: usize, stream: &Stream, owned: bool) -> Result<DevicePtr> {
        // Frees a capture deferred (this resource's among them) come back first, so a program
        // allocating straight from the resource after a capture sees its memory again.
        crate::caching::return_frees_deferred_by_captures();
        check_request(self.device(), bytes, stream, "AsyncPoolResource::allocate")?;
        // SAFETY: the pointer is recorded in `live` and freed only by `deallocate_marked`,
        // which takes it out of `live` first, so it is freed exactly once. Ordering other
        // streams' uses after `stream` is the caller's part of the stream-ordered contract every
        // resource has.
        let ptr = unsafe { self.pool.alloc_async(bytes, stream) }?;
        self.live.insert(ptr, bytes, owned, ());
        Ok(ptr)
    }

    fn deallocate_marked(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
        owned: bool,
    ) -> Result<()> {
        const OPERATION: &str = "AsyncPoolResource::deallocate";
        check_stream(self.device(), stream, OPERATION)?;
        self.live.take(ptr, bytes, owned, OPERATION)?;
        // SAFETY: `ptr` was allocated from this pool by `allocate_marked` and was still in
        // `live`, which we just took it out of: no other call can free it again.
        match unsafe { memory::free_async(ptr, stream) } {
            Ok(()) => Ok(()),
            Err(error) => {
                // Not freed: keep it on the books so that a later deallocate can still free it.
                self.live.insert(ptr, bytes, owned, ());
                Err(error.into())
            }
        }
    }
}

// SAFETY: memory comes from the driver's pool, one allocation per address while live; `live`
// takes each address off its books once, at its free, which `cuMemFreeAsync` orders after the
// stream's queued work; any other free is refused.
unsafe impl MemoryResource for AsyncPoolResource {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.allocate_marked(bytes, stream, false)
    }

    fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.deallocate_marked(ptr, bytes, stream, false)
    }

    fn allocate_owned(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.allocate_marked(bytes, stream, true)
    }

    fn deallocate_owned(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.deallocate_marked(ptr, bytes, stream, true)
    }

    fn context(&self) -> &Arc<Context> {
        self.pool.context()
    }

    fn name(&self) -> &str {
        "async-pool"
    }

    /// `true`: `cuMemAllocFromPoolAsync` on a capturing stream is recorded as an allocation
    /// node of the graph.
    fn allocates_in_graphs(&self) -> bool {
        true
    }

    /// Trims the pool to nothing: every byte no allocation holds, and whose free has completed
    /// on its stream, goes back to the driver.
    fn release_unused(&self) -> Result<()> {
        Ok(self.pool.trim_to(0)?)
    }
}

impl Drop for AsyncPoolResource {
    fn drop(&mut self) {
        if !self.live.is_empty() {
            tracing::warn!(
                outstanding = self.live.len(),
                "AsyncPoolResource dropped with allocations outstanding; the pool lives until they are freed"
            );
        }
    }
}
