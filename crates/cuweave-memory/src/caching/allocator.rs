//! [`CachingAllocator`]: the public face of the cache, over any [`MemoryResource`].

use std::fmt;
use std::sync::{Arc, OnceLock};

use cuweave_driver::graph::active_captures;
use cuweave_driver::{Context, Device, EventPool, Stream, StreamFlags};

use super::allocation::CachedAllocation;
use super::config::AllocatorConfig;
use super::engine::{Engine, Release, SHARDS, StreamEnd, Upstream};
use super::graph_pool::{SegmentHome, retire_engine};
use super::pool::{Grant, Segment};
use super::stats::MemoryStats;
use super::stream_uses::StreamKey;
use crate::error::Result;
use crate::events::{ContextEvents, StreamEvent};
use crate::resource::{DriverResource, MemoryResource, check_stream};

/// Where the allocator's segments come from and go back to: the upstream, and the stream
/// segments are handed back on.
///
/// Shared by the allocator and by every graph pool that holds segments of it after the
/// allocator is gone: the upstream (a [`DriverResource`] frees whatever it still has when it
/// drops) lives until the last of those segments has gone back to it.
pub(crate) struct Source {
    upstream: Arc<dyn MemoryResource>,
    /// The stream cached segments are handed back on, made on first use.
    release_stream: OnceLock<Stream>,
}

impl Source {
    fn release_stream(&self) -> Result<&Stream> {
        if let Some(stream) = self.release_stream.get() {
            return Ok(stream);
        }
        let stream = Stream::new(self.upstream.context(), StreamFlags::NON_BLOCKING)?;
        // Another thread may have won the race; its stream is as good, and ours is destroyed.
        Ok(self.release_stream.get_or_init(|| stream))
    }
}

impl Release for Source {
    /// Waits for the device, frees every segment on the release stream, waits for those frees
    /// and asks the upstream to release what it keeps unused
    /// ([`MemoryResource::release_unused`]).
    ///
    /// A cached block is free in its own stream's order: work queued there before its free may
    /// still be running. The context synchronisation makes that work finish, so the segments can
    /// be handed back on any stream; `cuMemFree` would wait for the device anyway.
    fn release_segments(&self, segments: &[Segment]) -> Result<()> {
        self.upstream.context().synchronize()?;
        let stream = self.release_stream()?;
        let mut first_error = None;
        for segment in segments {
            if let Err(error) = self
                .upstream
                .deallocate_owned(segment.ptr, segment.size, stream)
            {
                tracing::warn!(%error, ptr = segment.ptr, bytes = segment.size, "returning a cached segment failed");
                first_error.get_or_insert(error);
            }
        }
        // A pooling upstream (the async pool) keeps what it is given back: once the frees have
        // run, ask it to hand that memory to the driver, or emptying the cache frees nothing.
        let trimmed = stream
            .synchronize()
            .map_err(Into::into)
            .and_then(|()| self.upstream.release_unused());
        if let Err(error) = trimmed {
            tracing::warn!(%error, "releasing the upstream's unused memory failed");
            first_error.get_or_insert(error);
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl SegmentHome for Source {
    fn context(&self) -> Option<&Arc<Context>> {
        Some(self.upstream.context())
    }
}

/// What the allocator and every allocation it handed out share.
pub(crate) struct Shared {
    /// The cache; a pending block's markers are events of the context's pool, which go back
    /// there once they complete.
    pub(crate) engine: Engine<StreamEvent>,
    /// The upstream, which graph pools holding segments keep alive past the allocator.
    source: Arc<Source>,
    pub(crate) device: Device,
    /// The context's event pool: events recorded behind uses of the memory (by `record_stream`
    /// frees and typed buffers' trackers) come from it. Held here so that it lives as long as
    /// the allocator, and a pending marker's return is never the pool's last reference.
    pub(crate) events: ContextEvents,
}

impl Shared {
    /// The context the memory belongs to.
    pub(crate) fn context(&self) -> &Arc<Context> {
        self.source.upstream.context()
    }

    /// The upstream resource.
    pub(super) fn upstream(&self) -> &Arc<dyn MemoryResource> {
        &self.source.upstream
    }

    /// The context's event pool (looked up on first use).
    #[inline]
    pub(crate) fn event_pool(&self) -> Result<&EventPool> {
        self.events.pool(self.context())
    }

    /// The stream segments are allocated on during a capture and handed back on.
    pub(super) fn release_stream(&self) -> Result<&Stream> {
        self.source.release_stream()
    }
}

impl Release for Shared {
    fn release_segments(&self, segments: &[Segment]) -> Result<()> {
        self.source.release_segments(segments)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // No allocation is left (each holds an Arc of this), so after the pending blocks are
        // waited for, every segment is whole and free. Those of graph pools still alive go to
        // the pools, with the upstream: a graph replays into them after the allocator is gone.
        if let Err(error) = retire_engine(&self.engine, &self.source) {
            tracing::warn!(%error, "releasing the caching allocator's segments on drop failed");
        }
        let stats = self.engine.stats();
        if stats.reserved_bytes.current != 0 {
            tracing::warn!(
                bytes = stats.reserved_bytes.current,
                segments = stats.segments.current,
                "caching allocator dropped with segments it could not release"
            );
        }
    }
}

/// One shard's handle on the shared state: what every allocation of a stream of that shard holds.
///
/// Allocations hold this rather than the allocator's own `Arc`, so that handing out and freeing
/// blocks on different shards never writes one shared reference count (a cache line that 16
/// threads would otherwise pass around on every allocation and free). Aligned so that two
/// handles' counts never share a line.
#[repr(align(128))]
pub(crate) struct ShardHandle {
    pub(crate) shared: Arc<Shared>,
}

/// What the allocator's clones share: the state, and one handle per shard.
struct Handles {
    shared: Arc<Shared>,
    shards: Box<[Arc<ShardHandle>]>,
}

/// One request's view of the upstream: segments for it are allocated on its stream.
struct RequestUpstream<'a> {
    shared: &'a Shared,
    stream: &'a Stream,
}

impl Release for RequestUpstream<'_> {
    fn release_segments(&self, segments: &[Segment]) -> Result<()> {
        self.shared.release_segments(segments)
    }
}

impl Upstream for RequestUpstream<'_> {
    fn allocate_segment(&self, bytes: usize) -> Result<u64> {
        self.shared.upstream().allocate_owned(bytes, self.stream)
    }

    fn stream_end(&self) -> Option<Arc<dyn StreamEnd>> {
        // Only a handle that owns its stream says, by its drop, that no more work will come:
        // a borrowed handle's stream lives on, and a context-relative handle's key is shared by
        // all its handles.
        self.stream.end_watch().map(|end| end as Arc<dyn StreamEnd>)
    }

    fn ended_streams(&self) -> u64 {
        cuweave_driver::stream::ended_watched_streams()
    }
}

impl StreamEnd for cuweave_driver::stream::StreamEnd {
    fn dropped(&self) -> bool {
        self.is_dropped()
    }

    fn finished(&self) -> bool {
        // Asked at a miss, of cuweave's own accord: only while no capture is active or
        // beginning, since a query would break another thread's global-mode capture begun
        // after the allocation's check. Skipped, or an error, counts as not yet: asked again at
        // a later miss.
        cuweave_driver::graph::outside_captures(|| matches!(self.is_finished(), Ok(true)))
            .unwrap_or(false)
    }
}

/// A PyTorch-style caching allocator of device memory: blocks freed by the program are kept
/// and handed out again without a driver call.
///
/// See the [module documentation](super) for the model: size rounding, the small and large
/// pools, best fit, splitting and merging, per-stream free lists, [`record_stream`], the
/// out-of-memory retry and [`empty_cache`](Self::empty_cache).
///
/// Cheap to clone (an `Arc`); `Send + Sync`. Every [`CachedAllocation`] keeps the allocator's
/// state alive, so the allocator may be dropped before its allocations; the cached memory goes
/// back to the upstream when the last of them is freed, except the segments of
/// [graph pools](super::GraphPool) whose graphs still live: those pools keep them (and the
/// upstream) until their last graph dies.
///
/// [`record_stream`]: CachedAllocation::record_stream
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::caching::CachingAllocator;
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let allocator = CachingAllocator::with_driver(&context);
/// let block = allocator.allocate(1 << 20, &stream)?;
/// let ptr = block.ptr();
/// drop(block); // back to the cache, not to the driver
/// let again = allocator.allocate(1 << 20, &stream)?;
/// assert_eq!(again.ptr(), ptr);
/// assert_eq!(allocator.stats().cache_hits, 1);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct CachingAllocator {
    handles: Arc<Handles>,
}

impl CachingAllocator {
    /// A caching allocator that takes its segments from `upstream`.
    ///
    /// Makes no driver call; the first allocation does.
    pub fn new(upstream: Arc<dyn MemoryResource>) -> Self {
        Self::with_shards(upstream, SHARDS)
    }

    /// A caching allocator over `upstream` whose free lists are split into `shards` shards
    /// (rounded up to a power of two; at least 1), each under its own lock.
    ///
    /// A stream's blocks live in shard `stream id % shards`, and stream ids are handed out in
    /// sequence, so threads on up to `shards` streams made one after another never share a lock.
    /// [`new`](Self::new) uses 32. One shard puts every stream under one lock, as the allocator
    /// was before it was sharded (the benchmarks compare the two).
    pub fn with_shards(upstream: Arc<dyn MemoryResource>, shards: usize) -> Self {
        Self::build(upstream, shards, None)
    }

    /// A caching allocator over `upstream` with PyTorch's allocator settings
    /// (`PYTORCH_CUDA_ALLOC_CONF`'s `max_split_size_mb`, `set_per_process_memory_fraction`; see
    /// [`AllocatorConfig`]).
    ///
    /// A memory fraction reads the device's total memory (one driver call) and caps the upstream
    /// with a [`LimitAdaptor`](crate::LimitAdaptor) of that share.
    ///
    /// ```no_run
    /// use cuweave_driver::{Context, Device, Stream, StreamFlags};
    /// use cuweave_memory::caching::{AllocatorConfig, CachingAllocator};
    /// use cuweave_memory::DriverResource;
    /// use std::sync::Arc;
    ///
    /// # fn main() -> cuweave_memory::Result<()> {
    /// let context = Context::primary(Device::get(0)?)?;
    /// let config: AllocatorConfig = "max_split_size_mb:256,memory_fraction:0.5".parse()?;
    /// let allocator =
    ///     CachingAllocator::with_config(Arc::new(DriverResource::new(&context)), config)?;
    /// // Buffers that `DeviceBuffer::new_on` makes come from it from now on.
    /// CachingAllocator::set_default_for_device(allocator);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`MemoryError::InvalidConfig`](crate::MemoryError::InvalidConfig) for a setting out of
    /// range; the driver's error when the device's memory cannot be read.
    pub fn with_config(upstream: Arc<dyn MemoryResource>, config: AllocatorConfig) -> Result<Self> {
        config.validate()?;
        let upstream: Arc<dyn MemoryResource> = match config.memory_fraction {
            Some(fraction) => {
                let total = upstream.device().total_memory()?;
                let cap = AllocatorConfig::cap_of(fraction, total);
                Arc::new(crate::LimitAdaptor::new(upstream, cap))
            }
            None => upstream,
        };
        Ok(Self::build(upstream, SHARDS, config.max_split_size))
    }

    fn build(upstream: Arc<dyn MemoryResource>, shards: usize, max_split: Option<usize>) -> Self {
        let shards = shards.max(1).checked_next_power_of_two().unwrap_or(SHARDS);
        let device = upstream.device();
        let shared = Arc::new(Shared {
            engine: Engine::with_max_split(shards, max_split),
            source: Arc::new(Source {
                upstream,
                release_stream: OnceLock::new(),
            }),
            device,
            events: ContextEvents::default(),
        });
        let shards = (0..shards)
            .map(|_| {
                Arc::new(ShardHandle {
                    shared: Arc::clone(&shared),
                })
            })
            .collect();
        Self {
            handles: Arc::new(Handles { shared, shards }),
        }
    }

    /// The process-wide caching allocator of `device`, over `cuMemAlloc` in its primary context
    /// unless replaced with [`set_default_for_device`](Self::set_default_for_device): what
    /// [`DeviceBuffer::new_on`](crate::DeviceBuffer::new_on) and
    /// [`DeviceBuffer::new`](crate::DeviceBuffer::new) allocate from (PyTorch's
    /// `CUDACachingAllocator`). Made on first use (retaining the primary context); cheap after.
    ///
    /// # Errors
    /// The driver's error when the primary context cannot be retained.
    pub fn for_device(device: Device) -> Result<Self> {
        super::default::for_device(device)
    }

    /// Makes `allocator` the default of its device (for example one over a
    /// [`LimitAdaptor`](crate::LimitAdaptor)), returning the one it replaces.
    ///
    /// Buffers already allocated keep their allocator; new ones come from `allocator`. The
    /// replaced allocator gives its cached memory back once its last buffer, and the last
    /// thread's clone of it (dropped at that thread's next default allocation), is gone.
    pub fn set_default_for_device(allocator: Self) -> Option<Self> {
        super::default::set_for_device(allocator)
    }

    /// A typed buffer of `len` elements of `T` from this allocator, for use on `stream` (RMM's
    /// `device_buffer(size, stream, mr)`); see [`DeviceBuffer::new_on`](crate::DeviceBuffer::new_on).
    ///
    /// # Errors
    /// As [`DeviceBuffer::with_allocator`](crate::DeviceBuffer::with_allocator).
    #[inline]
    pub fn buffer<T: crate::Element>(
        &self,
        len: usize,
        stream: &Stream,
    ) -> Result<crate::DeviceBuffer<T>> {
        crate::DeviceBuffer::with_allocator(self, len, stream)
    }

    /// The context the memory is allocated in.
    pub fn context(&self) -> &Arc<Context> {
        self.handles.shared.context()
    }

    /// A caching allocator over `cuMemAlloc` in `context` (a [`DriverResource`]).
    pub fn with_driver(context: &Arc<Context>) -> Self {
        Self::new(Arc::new(DriverResource::new(context)))
    }

    /// Allocates at least `bytes` of device memory for use on `stream`.
    ///
    /// The memory comes from a cached block of `stream` when one fits (no driver call, no
    /// synchronisation), else from a new upstream segment. It may be used right away by work
    /// queued on `stream`; to use it on another stream, order that stream after `stream` and
    /// call [`CachedAllocation::record_stream`].
    ///
    /// # Errors
    /// [`MemoryError::ZeroLength`](crate::MemoryError::ZeroLength) for zero bytes;
    /// [`MemoryError::WrongDevice`](crate::MemoryError::WrongDevice) for a stream of another
    /// device; [`MemoryError::OutOfMemory`](crate::MemoryError::OutOfMemory) when the upstream
    /// has no memory even after the cache was released and the request retried; other upstream
    /// errors as they are.
    #[must_use = "dropping the allocation frees it at once"]
    #[inline]
    pub fn allocate(&self, bytes: usize, stream: &Stream) -> Result<CachedAllocation> {
        let (grant, shard) = self.allocate_grant(bytes, stream, "CachingAllocator::allocate")?;
        Ok(CachedAllocation::new(shard, grant, bytes, stream))
    }

    /// The block behind [`allocate`](Self::allocate), with one handle of its shard (what a
    /// typed buffer holds instead of a [`CachedAllocation`], so that it touches one reference
    /// count, not two).
    #[inline]
    pub(crate) fn allocate_grant(
        &self,
        bytes: usize,
        stream: &Stream,
        operation: &'static str,
    ) -> Result<(Grant, Arc<ShardHandle>)> {
        let shared = &self.handles.shared;
        check_stream(shared.device, stream, operation)?;
        let key = StreamKey::checked(stream, operation)?;
        if active_captures() != 0 {
            return self.allocate_during_capture(bytes, stream, key);
        }
        super::return_frees_deferred_by_captures();
        let upstream = RequestUpstream { shared, stream };
        let grant = shared.engine.allocate(key, bytes, &upstream)?;
        let shard = &self.handles.shards[shared.engine.shard_index(key)];
        Ok((grant, Arc::clone(shard)))
    }

    /// Returns every cached segment that is wholly free to the upstream, and reports how many
    /// bytes went back.
    ///
    /// Blocks freed while recorded on other streams are waited for first (their events are
    /// synchronised), so they are returned too; then the device is synchronised, so no work
    /// queued before a block's free can still use it. Segments with a block still allocated stay.
    /// Slow (it waits for the device): for handing memory to other programs, not for the loop.
    ///
    /// # Errors
    /// The driver's error when waiting or freeing fails; what could be released is released.
    /// [`GraphError::Capturing`](cuweave_driver::GraphError::Capturing) while a capture is
    /// active anywhere in the process (waiting and freeing would break it); segments of live
    /// [graph pools](super::GraphPool) are never released.
    pub fn empty_cache(&self) -> Result<usize> {
        super::graph_pool::refuse_during_capture("CachingAllocator::empty_cache")?;
        // Frees deferred by captures that have ended come back first, so their segments can go.
        super::graph_pool::flush_frees_deferred_by_captures();
        self.handles
            .shared
            .engine
            .release_cached(&*self.handles.shared)
    }

    /// The shared state.
    pub(super) fn shared(&self) -> &Arc<Shared> {
        &self.handles.shared
    }

    /// The handle of the shard that holds `key`'s blocks.
    pub(super) fn shard_handle(&self, key: StreamKey) -> Arc<ShardHandle> {
        Arc::clone(&self.handles.shards[self.handles.shared.engine.shard_index(key)])
    }

    /// A snapshot of the allocator's statistics, consistent across shards (every shard is
    /// locked while it is read).
    ///
    /// Counters and current values are exact; reserved-bytes and segment peaks are exact; the
    /// peaks of allocated, requested and active bytes are the shards' peaks summed (exact for
    /// one stream, an upper bound of the simultaneous peak across streams of different shards).
    pub fn stats(&self) -> MemoryStats {
        self.handles.shared.engine.stats()
    }

    /// Every segment the allocator holds and the blocks it is split into, in address order, at
    /// one instant (every shard is locked while it is read): PyTorch's
    /// `torch.cuda.memory_snapshot()`, with `Display` as a short `memory_summary()`. For
    /// finding fragmentation (segments partly free, which `empty_cache` cannot return) and
    /// what holds memory; it allocates a list, so it is for diagnostics, not the loop.
    ///
    /// ```no_run
    /// use cuweave_driver::{Context, Device, Stream, StreamFlags};
    /// use cuweave_memory::caching::{BlockStatus, CachingAllocator};
    ///
    /// # fn main() -> cuweave_memory::Result<()> {
    /// let context = Context::primary(Device::get(0)?)?;
    /// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
    /// let allocator = CachingAllocator::with_driver(&context);
    /// let kept = allocator.allocate(300 << 10, &stream)?;
    /// drop(allocator.allocate(600 << 10, &stream)?);
    /// let snapshot = allocator.snapshot();
    /// assert_eq!(snapshot.segments.len(), 1, "both came from one 2 MiB small-pool segment");
    /// assert_eq!(snapshot.bytes(BlockStatus::Allocated), kept.block_size());
    /// println!("{snapshot}");
    /// # Ok(())
    /// # }
    /// ```
    pub fn snapshot(&self) -> super::MemorySnapshot {
        self.handles.shared.engine.snapshot()
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak(&self) {
        self.handles.shared.engine.reset_peak();
    }

    /// Freed blocks that wait for other streams' recorded uses before they can be reused.
    pub fn pending_frees(&self) -> usize {
        self.handles.shared.engine.pending_blocks()
    }

    /// The resource the segments come from.
    pub fn upstream(&self) -> &Arc<dyn MemoryResource> {
        self.handles.shared.upstream()
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.handles.shared.device
    }

    /// How many shards the free lists are split into (see [`with_shards`](Self::with_shards)).
    pub fn shards(&self) -> usize {
        self.handles.shards.len()
    }
}

impl fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("upstream", &self.handles.shared.upstream().name())
            .field("device", &self.handles.shared.device.ordinal())
            .field("stats", &self.stats())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_and_allocations_can_be_shared_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<CachingAllocator>();
        send_sync::<CachedAllocation>();
        send_sync::<Arc<dyn MemoryResource>>();
    }
}
