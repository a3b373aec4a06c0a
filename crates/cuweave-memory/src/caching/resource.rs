//! [`CachingResource`]: the caching allocator as a [`MemoryResource`], so that adaptors can sit
//! over the cache (RMM's `statistics_resource_adaptor<limiting_resource_adaptor<pool>>`).

use std::fmt;
use std::sync::Arc;

use cuweave_driver::graph::{GraphError, active_captures};
use cuweave_driver::memory::DevicePtr;
use cuweave_driver::{Context, Device, Stream};
use dashmap::DashMap;

use super::allocation::CachedAllocation;
use super::allocator::CachingAllocator;
use super::graph_pool::{GraphHeld, defer_until_no_capture, synchronize_once};
use super::stream_uses::StreamKey;
use crate::error::{MemoryError, Result};
use crate::resource::{MemoryResource, check_stream, refused_free};

/// One live allocation: the bytes asked for, the stream it was asked on, and what frees it.
#[derive(Debug)]
struct Live<A> {
    bytes: usize,
    stream: StreamKey,
    /// Allocated owned ([`MemoryResource::allocate_owned`]): only its owner frees it.
    owned: bool,
    allocation: A,
}

/// The live allocations of a resource, by address: an entry goes in at `allocate` and out at the
/// `deallocate` that frees it, so the map holds exactly what is live (a bounded registry).
#[derive(Debug)]
struct Registry<A> {
    live: DashMap<DevicePtr, Live<A>>,
}

impl<A> Registry<A> {
    fn new() -> Self {
        Self {
            live: DashMap::new(),
        }
    }

    fn insert(&self, ptr: DevicePtr, bytes: usize, stream: StreamKey, owned: bool, allocation: A) {
        let previous = self.live.insert(
            ptr,
            Live {
                bytes,
                stream,
                owned,
                allocation,
            },
        );
        // The cache never hands out a live block twice.
        debug_assert!(previous.is_none(), "address {ptr:#x} handed out twice");
    }

    /// The stream `ptr` was allocated on, when it is live with `bytes` and, as `owned` says,
    /// allocated owned or not.
    fn stream_of(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        owned: bool,
        operation: &'static str,
    ) -> Result<StreamKey> {
        let recorded = self
            .live
            .get(&ptr)
            .map(|live| (live.bytes, live.owned, live.stream));
        match recorded {
            Some((size, marked, stream)) if size == bytes && marked == owned => Ok(stream),
            other => Err(refused_free(
                ptr,
                bytes,
                other.map(|(size, marked, _)| (size, marked)),
                owned,
                operation,
            )),
        }
    }

    /// Takes `ptr` out when it is live with `bytes` and `owned` as it was allocated; otherwise
    /// leaves everything as it is.
    fn take(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        owned: bool,
        operation: &'static str,
    ) -> Result<A> {
        let taken = self
            .live
            .remove_if(&ptr, |_, live| live.bytes == bytes && live.owned == owned);
        if let Some((_, live)) = taken {
            return Ok(live.allocation);
        }
        let recorded = self.live.get(&ptr).map(|live| (live.bytes, live.owned));
        Err(refused_free(ptr, bytes, recorded, owned, operation))
    }

    fn len(&self) -> usize {
        self.live.len()
    }

    /// Takes every live allocation out.
    fn drain(&mut self) -> Vec<A> {
        std::mem::take(&mut self.live)
            .into_iter()
            .map(|(_, live)| live.allocation)
            .collect()
    }
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
    live: Registry<CachedAllocation>,
}

impl CachingResource {
    /// Wraps `allocator` (a clone shares its cache with every other user of it).
    pub fn new(allocator: CachingAllocator) -> Self {
        let name = format!("caching({})", allocator.upstream().name());
        Self {
            allocator,
            name,
            live: Registry::new(),
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
        let key = grant.stream;
        let allocation = CachedAllocation::new(shard, grant, bytes, key);
        self.live
            .insert(ptr, bytes, StreamKey::of(stream), owned, allocation);
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
        if self.live.stream_of(ptr, bytes, owned, OPERATION)? == StreamKey::of(stream)
            && active_captures() != 0
        {
            return self.live.take(ptr, bytes, owned, OPERATION)?.free();
        }
        refuse_cross_stream_during_capture()?;
        self.live
            .take(ptr, bytes, owned, OPERATION)?
            .free_after_stream(stream)
    }
}

impl MemoryResource for CachingResource {
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
        let allocations = self.live.drain();
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
    use rstest::rstest;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const OP: &str = "test";

    /// Counts its drops: a registry entry freed exactly once.
    #[derive(Debug)]
    struct Probe(Arc<AtomicUsize>);

    impl Drop for Probe {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn key(raw: usize) -> StreamKey {
        StreamKey::from_raw(raw)
    }

    #[rstest]
    #[case::right(0x1000, 256, false, Ok(7))]
    #[case::wrong_size(0x1000, 255, false, Err(MemoryError::SizeMismatch { operation: OP, expected: 256, actual: 255 }))]
    #[case::unknown(0x2000, 256, false, Err(MemoryError::UnknownAllocation { operation: OP, ptr: 0x2000 }))]
    #[case::interior(0x1001, 256, false, Err(MemoryError::UnknownAllocation { operation: OP, ptr: 0x1001 }))]
    #[case::owned_freed_by_address(0x3000, 256, false, Err(MemoryError::OwnedAllocation { operation: OP, ptr: 0x3000 }))]
    #[case::owner_freeing_a_plain_one(0x1000, 256, true, Err(MemoryError::UnknownAllocation { operation: OP, ptr: 0x1000 }))]
    #[case::owner_freeing_its_own(0x3000, 256, true, Ok(9))]
    fn a_bad_free_is_typed_and_leaves_the_allocation_live(
        #[case] ptr: DevicePtr,
        #[case] bytes: usize,
        #[case] owned: bool,
        #[case] outcome: Result<usize>,
    ) {
        let registry = Registry::new();
        registry.insert(0x1000, 256, key(7), false, ());
        registry.insert(0x3000, 256, key(9), true, ());
        assert_eq!(
            registry
                .stream_of(ptr, bytes, owned, OP)
                .map(StreamKey::as_usize),
            outcome
        );
        let taken = registry.take(ptr, bytes, owned, OP);
        assert_eq!(taken.is_ok(), outcome.is_ok());
        if let Err(error) = taken {
            assert_eq!(Err(error), outcome);
            assert_eq!(registry.len(), 2, "a refused free leaves it live");
            registry.take(0x1000, 256, false, OP).unwrap();
            registry.take(0x3000, 256, true, OP).unwrap();
        } else if ptr == 0x1000 {
            registry.take(0x3000, 256, true, OP).unwrap();
        } else {
            registry.take(0x1000, 256, false, OP).unwrap();
        }
        assert_eq!(
            registry.take(0x1000, 256, false, OP),
            Err(MemoryError::UnknownAllocation {
                operation: OP,
                ptr: 0x1000
            }),
            "a second free is refused"
        );
        assert_eq!(registry.len(), 0);
    }

    #[test]
    fn holds_exactly_the_live_allocations_over_100k_cycles() {
        const SHARDS: usize = 4;
        const WINDOW: u64 = 8;
        // Four shards, so that the bound on the tables does not depend on this machine's cores.
        let registry = Registry {
            live: DashMap::with_shard_amount(SHARDS),
        };
        let freed = Arc::new(AtomicUsize::new(0));
        let mut most = 0;
        for i in 0..100_000u64 {
            // Fresh addresses every time, as a cache handing out blocks of many segments does.
            registry.insert(i * 512, 512, key(1), false, Probe(Arc::clone(&freed)));
            if i >= WINDOW {
                drop(registry.take((i - WINDOW) * 512, 512, false, OP).unwrap());
            }
            assert_eq!(registry.len() as u64, (i + 1).min(WINDOW));
            most = most.max(registry.live.capacity());
        }
        assert_eq!(freed.load(Ordering::SeqCst), 100_000 - WINDOW as usize);
        // A shard never holds more than WINDOW entries, so its table never passes 32 buckets
        // (28 slots): removed entries' slots are reclaimed by rehashing in place, not growth.
        assert!(
            most <= SHARDS * 28,
            "the map grew with the cycles, not with what is live: {most} slots"
        );
        drop(registry);
        assert_eq!(
            freed.load(Ordering::SeqCst),
            100_000,
            "dropping the registry frees what was live"
        );
    }

    #[test]
    fn concurrent_frees_of_one_address_free_it_once() {
        let registry = Arc::new(Registry::new());
        let freed = Arc::new(AtomicUsize::new(0));
        for round in 0..200u64 {
            registry.insert(round, 64, key(1), false, Probe(Arc::clone(&freed)));
            let winners: usize = (0..4)
                .map(|_| {
                    let registry = Arc::clone(&registry);
                    std::thread::spawn(move || {
                        usize::from(registry.take(round, 64, false, OP).is_ok())
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|thread| thread.join().unwrap())
                .sum();
            assert_eq!(winners, 1, "exactly one free succeeds");
        }
        assert_eq!(freed.load(Ordering::SeqCst), 200);
        assert_eq!(registry.len(), 0);
    }

    #[test]
    fn is_a_send_sync_resource() {
        fn resource<R: MemoryResource>() {}
        resource::<CachingResource>();
    }
}
