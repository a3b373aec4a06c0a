//! [`CachingResource`]: the caching allocator as a [`MemoryResource`], so that adaptors can sit
//! over the cache (RMM's `statistics_resource_adaptor<limiting_resource_adaptor<pool>>`).

use std::fmt;
use std::sync::Arc;

use cuweave_driver::graph::{GraphError, active_captures};
use cuweave_driver::memory::DevicePtr;
use cuweave_driver::{Context, Device, Stream};

use super::allocation::CachedAllocation;
use super::allocator::CachingAllocator;
use super::graph_pool::{GraphHeld, defer_until_no_capture, synchronize_once};
use super::stream_uses::StreamKey;
use crate::error::{MemoryError, Result};
use crate::resource::{LiveAllocations, MemoryResource, check_stream};

/// What the books keep with a live allocation: the stream it was asked on, and what frees it.
#[derive(Debug)]
struct Held {
    stream: StreamKey,
    allocation: CachedAllocation,
}

/// Allocations still live when their resource was dropped: nobody can free them by address any
/// more, and work on any stream may still use them, so they go back to the cache only once no
/// capture is active and the device has finished.
struct LeftOver {
    context: Arc<Context>,
    allocations: Vec<CachedAllocation>,
}

impl GraphHeld for LeftOver {
    fn give_back(
        self: Box<Self>,
        synced: &mut Vec<Arc<Context>>,
    ) -> Result<Option<Box<dyn GraphHeld>>> {
        match synchronize_once(&self.context, synced) {
            Ok(()) => {
                drop(self.allocations);
                Ok(None)
            }
            Err(error) if error.is_capture_refusal() => Ok(Some(self)),
            Err(error) => {
                self.strand();
                Err(error)
            }
        }
    }

    fn strand(self: Box<Self>) {
        // Never freed: the blocks stay allocated, out of every free list.
        std::mem::forget(self.allocations);
    }
}

/// A [`CachingAllocator`] as a [`MemoryResource`]: adaptors can then wrap the cache, as RMM
/// programs wrap their pool (`statistics(limit(caching(driver)))`), and typed buffers can be
/// made on such a stack with [`DeviceBuffer::with_resource`](crate::DeviceBuffer::with_resource).
///
/// The trait frees by address, so the resource keeps each live [`CachedAllocation`] in a
/// concurrent map until its `deallocate`; the map holds exactly the live allocations.
///
/// - `allocate(bytes, stream)` is [`CachingAllocator::allocate`]: from `stream`'s cache, or a new
///   upstream segment, with the out-of-memory retry. On a capturing stream it comes from the
///   capture's [graph pool](super::GraphPool), or fails with
///   [`cuweave_driver::GraphError::Capturing`] when none is bound.
/// - `deallocate(ptr, bytes, stream)` records an event on `stream` and the block, back on its
///   allocating stream's free list, is handed out again only once that event has completed (as
///   after [`CachedAllocation::record_stream`]), on the allocating stream too: the allocator
///   hands its blocks to typed buffers as well, which use them on any stream without waiting
///   for the allocating one. While a capture is active a free on the allocating stream is the
///   plain free (the capture's pool defers it), and a cross-stream free is refused with
///   `GraphError::Capturing` (recording the event could break the capture, and
///   the resource cannot keep the borrowed stream to record it later); the allocation stays
///   live, and a free on its own stream, or one after the capture, works.
/// - A wrong address or one already freed is [`MemoryError::UnknownAllocation`], a wrong size
///   [`MemoryError::SizeMismatch`]; both leave the allocation live.
/// - `release_unused` is [`CachingAllocator::empty_cache`].
///
/// Dropping the resource with allocations still live in it (nobody can free those by address
/// any more) waits for the device, since work on any stream may still use them, and then
/// returns them to the cache; while a capture is active that waits until none is. Work queued
/// after the drop must not use their addresses (RMM's pool resources free everything when
/// destroyed too). A typed buffer holds its resource, so this never happens to a buffer's
/// memory.
///
/// ```no_run
/// use std::sync::Arc;
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::DeviceBuffer;
/// use cuweave_memory::caching::{CachingAllocator, CachingResource};
/// use cuweave_memory::resource::{LimitAdaptor, MemoryResource, StatisticsAdaptor};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let cache = CachingResource::new(CachingAllocator::with_driver(&context));
/// let stack = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(cache, 1 << 30)));
/// assert_eq!(stack.name(), "statistics(limit(caching(driver)))");
/// let buffer = DeviceBuffer::<f32>::with_resource(stack.clone(), 1 << 20, &stream)?;
/// assert_eq!(stack.stats().current_bytes, 4 << 20, "what the program holds");
/// drop(buffer);
/// # Ok(())
/// # }
/// ```
pub struct CachingResource {
    allocator: CachingAllocator,
    name: String,
    live: LiveAllocations<Held>,
}

impl CachingResource {
    /// Wraps `allocator` (a clone shares its cache with every other user of it).
    pub fn new(allocator: CachingAllocator) -> Self {
        let name = format!("caching({})", allocator.upstream().name());
        Self {
            allocator,
            name,
            live: LiveAllocations::new(),
        }
    }

    /// The wrapped allocator (its statistics, `empty_cache`, pending frees).
    pub fn allocator(&self) -> &CachingAllocator {
        &self.allocator
    }

    /// Allocations made through the resource and not yet deallocated.
    pub fn live_allocations(&self) -> usize {
        self.live.len()
    }
}

/// Refuses a free that must record an event while a capture is active.
fn refuse_cross_stream_during_capture() -> Result<()> {
    if active_captures() == 0 {
        return Ok(());
    }
    Err(MemoryError::Driver(
        GraphError::Capturing {
            operation: "CachingResource::deallocate",
            reason: "a free on another stream than the allocating one records an event there, \
                     which could break the capture; free on the allocating stream or after the \
                     capture",
        }
        .into(),
    ))
}

impl CachingResource {
    fn allocate_marked(&self, bytes: usize, stream: &Stream, owned: bool) -> Result<DevicePtr> {
        let (grant, shard) =
            self.allocator
                .allocate_grant(bytes, stream, "CachingResource::allocate")?;
        let ptr = grant.ptr;
        let allocation = CachedAllocation::new(shard, grant, bytes, stream);
        let stream = StreamKey::of(stream);
        self.live
            .insert(ptr, bytes, owned, Held { stream, allocation });
        Ok(ptr)
    }

    fn deallocate_marked(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
        owned: bool,
    ) -> Result<()> {
        const OPERATION: &str = "CachingResource::deallocate";
        check_stream(self.allocator.device(), stream, OPERATION)?;
        // During a capture a free on the allocating stream is the plain one, which the capture's
        // pool defers; outside one even that free records an event (below). The block goes
        // back to its stream's free list, and the allocator hands such blocks to typed buffers
        // too, which may use them on any stream at once: it must not come back before the
        // work queued on the stream so far has run (a typed buffer freed by the legacy stream,
        // its allocating one, was otherwise written on another stream under its last reader).
        let allocated_on = self
            .live
            .check(ptr, bytes, owned, OPERATION, |held| held.stream)?;
        if allocated_on == StreamKey::of(stream) && active_captures() != 0 {
            return self
                .live
                .take(ptr, bytes, owned, OPERATION)?
                .allocation
                .free();
        }
        refuse_cross_stream_during_capture()?;
        self.live
            .take(ptr, bytes, owned, OPERATION)?
            .allocation
            .free_after_stream(stream)
    }
}

// SAFETY: blocks come from the caching allocator, which hands a block to one owner at a time and
// takes it back only after the uses recorded on its free have finished; `live` takes each
// address off its books once, and any other free is refused.
#[allow(unsafe_code)]
unsafe impl MemoryResource for CachingResource {
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
        self.allocator.upstream().context()
    }

    fn device(&self) -> Device {
        self.allocator.device()
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn release_unused(&self) -> Result<()> {
        self.allocator.empty_cache().map(drop)
    }
}

impl Drop for CachingResource {
    fn drop(&mut self) {
        let allocations: Vec<CachedAllocation> = self
            .live
            .drain()
            .into_iter()
            .map(|held| held.allocation)
            .collect();
        if allocations.is_empty() {
            return;
        }
        tracing::warn!(
            live = allocations.len(),
            resource = %self.name,
            "caching resource dropped with live allocations; they go back to the cache once the device has finished"
        );
        defer_until_no_capture(Box::new(LeftOver {
            context: Arc::clone(self.context()),
            allocations,
        }));
    }
}

impl fmt::Debug for CachingResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachingResource")
            .field("name", &self.name)
            .field("live_allocations", &self.live.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_a_send_sync_resource() {
        fn resource<R: MemoryResource>() {}
        resource::<CachingResource>();
    }
}
