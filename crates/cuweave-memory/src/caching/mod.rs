//! The caching allocator: PyTorch's c10 CUDA caching allocator, over any
//! [`MemoryResource`](crate::resource::MemoryResource).
//!
//! Asking the driver for memory costs microseconds and `cuMemFree` waits for the device, so a
//! program that allocates in its inner loop keeps what it frees and hands it out again. The
//! [`CachingAllocator`] does that with PyTorch's semantics:
//!
//! - **Rounding.** Requests are rounded up to 512 B ([`size_class::round_size`]).
//! - **Two pools.** Requests of at most 1 MiB are carved from 2 MiB segments (the small pool);
//!   larger ones from segments of 20 MiB (requests under 10 MiB) or of their own size rounded up
//!   to 2 MiB (the large pool). A block never moves between pools.
//! - **Best fit, splitting, merging.** A request takes the smallest free block of its stream and
//!   pool that fits; the remainder is split off into a free block when it is worth keeping (small
//!   pool: at least 512 B; large pool: more than 1 MiB). A freed block merges with the free
//!   blocks next to it in its segment. Ties between blocks of one size go to the lowest address
//!   in the large pool (as in PyTorch) and to the most recently freed in the small pool, whose
//!   exact 512 B size classes make best fit two bit scans.
//! - **A stash in front.** A freed block is first parked whole, keyed by (stream, size), for the
//!   next request of exactly its size on its stream, which then skips best fit, the split and the
//!   merge. Parked blocks are merged back when evicted from their bucket, before any request goes
//!   to the upstream, and before segments are released, so parking never costs reserved memory.
//! - **Free lists per stream.** A block is allocated for a stream ([`StreamKey`]) and returns to
//!   that stream's free lists; it is handed out again only on that stream, where new work is
//!   queued after the old. No event is recorded on this path: allocation and free stay a
//!   lock-protected lookup (about 0.1 µs).
//! - **Other streams.** Memory used on another stream must be recorded there with
//!   [`CachedAllocation::record_stream`]. When it is freed, a `DISABLE_TIMING` event of the
//!   context's [`EventPool`](cuweave_driver::EventPool) is recorded on each such stream and the
//!   block waits in a pending list; it is handed out again only once every one of those events
//!   has completed (polled with `cuEventQuery`, without blocking, at the next allocation; never
//!   while none are pending; a poll stops at each stream's first unfinished event, so it costs
//!   one query per stream with frees waiting, not one per block), and the events then go back to
//!   the pool. A typed buffer's drop
//!   hands the events of its tracked uses to its block the same way. Recording a new stream
//!   first lets go of the recorded streams that nobody else holds and whose work has finished,
//!   so a long-lived block recorded on a new stream per request keeps a bounded list.
//! - **Out of memory.** When the upstream runs out, the allocator waits for its pending blocks,
//!   returns every wholly free cached segment to the upstream, and retries once; then it fails
//!   with [`MemoryError::OutOfMemory`](crate::MemoryError::OutOfMemory) carrying the request,
//!   the allocated and reserved bytes, and the cap of a [`LimitAdaptor`] if one refused.
//! - **Emptying.** [`CachingAllocator::empty_cache`] returns every wholly free segment (after
//!   waiting for pending blocks and for the device); segments with blocks in use stay.
//! - **Statistics.** [`MemoryStats`]: allocated, requested, reserved and active bytes and
//!   segments (current and peak), allocation and free counts, cache hits and misses, released
//!   segments, OOM retries and failures.
//!
//! The allocator is `Send + Sync` and scales across threads on different streams: its state is
//! sharded by stream (32 shards by default, see [`CachingAllocator::with_shards`]), each shard
//! under its own short `parking_lot` mutex, cache-line aligned, and allocations hold a handle of
//! their shard rather than one shared `Arc`; a thread on its own stream writes nothing another
//! thread touches. No lock is held across a driver call; upstream allocations, event recording
//! and waiting, and the release of segments all happen outside them. The out-of-memory retry and
//! [`CachingAllocator::empty_cache`] cover every shard; [`CachingAllocator::stats`] locks every
//! shard and sums them (peaks of allocated, requested and active bytes are the shards' peaks
//! summed: exact for one stream, an upper bound across streams; reserved bytes and segments are
//! exact, peaks included).
//!
//! A stream key is the [`Stream`](cuweave_driver::Stream) handle's process-unique id, not the raw
//! `CUstream` value: the driver recycles raw handles after a stream is destroyed, and the
//! per-thread default stream's one handle names a different stream on each thread, so neither
//! may key a free list. Borrowed handles of one raw stream share a key made from the raw value
//! (as PyTorch keys an external stream), and their frees wait for an event instead of relying
//! on stream order, which a recycled raw value would not give (see [`StreamKey`]). A dropped stream's wholly free segments are adopted by the next miss of
//! a live stream, but only once an event recorded at the handle's drop (behind all the work
//! queued through it) has completed; see `engine_ends.rs`. A server that makes a stream per
//! request so keeps the reserve one request needs.
//!
//! - **Graph capture.** Allocations on a capturing stream come from a private [`GraphPool`]
//!   bound to the capture, and nothing that would break a capture (driver allocation or free,
//!   event query, synchronisation) happens while one is active; the queries the allocator
//!   makes of its own accord (polling pending frees, a dropped stream's end, `record_stream`'s
//!   retirement) also run only while no capture can begin
//!   ([`outside_captures`](cuweave_driver::graph::outside_captures)), since one begun on
//!   another thread between a check and a query would break in global mode: see [`GraphPool`]
//!   and `docs/graphs.md`.
//!
//! - **As a memory resource.** [`CachingResource`] wraps the allocator in the
//!   [`MemoryResource`](crate::resource::MemoryResource) trait, so that adaptors can sit over
//!   the cache (RMM's `statistics(limit(pool))`) and typed buffers can be made on such a stack.
//!
//! Rules for callers: do not drop allocations
//! in a stream host callback: freeing a block recorded on other streams records events, and
//! dropping the last handle of an allocator returns its memory, both CUDA calls.
//!
//! [`LimitAdaptor`]: crate::resource::LimitAdaptor
//!
//! ```no_run
//! use std::sync::Arc;
//! use cuweave_driver::{Context, Device, Stream, StreamFlags};
//! use cuweave_memory::caching::CachingAllocator;
//! use cuweave_memory::resource::{DriverResource, LimitAdaptor, StatisticsAdaptor};
//!
//! # fn main() -> cuweave_memory::Result<()> {
//! let context = Context::primary(Device::get(0)?)?;
//! let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
//! // At most 4 GiB from the driver, counted.
//! let upstream = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
//!     DriverResource::new(&context),
//!     4 << 30,
//! )));
//! let allocator = CachingAllocator::new(upstream.clone());
//! for _ in 0..1000 {
//!     let scratch = allocator.allocate(3 << 20, &stream)?;
//!     // ... queue kernels on `stream` that use scratch.ptr() ...
//! #   let _ = scratch.ptr();
//! }
//! assert_eq!(upstream.stats().total_allocations, 1);
//! assert_eq!(allocator.stats().cache_hits, 999);
//! allocator.empty_cache()?;
//! # Ok(())
//! # }
//! ```

mod allocation;
mod allocator;
mod block;
mod config;
pub(crate) mod default;
mod engine;
mod free_list;
mod graph_pool;
mod pending;
mod pool;
mod resource;
pub mod size_class;
mod snapshot;
mod stash;
mod stats;
mod stream_uses;

pub use allocation::CachedAllocation;
pub(crate) use allocation::CachedBlock;
pub use allocator::CachingAllocator;
pub(crate) use allocator::ShardHandle;
pub use config::{ALLOC_CONF_VAR, AllocatorConfig};
#[cfg(test)]
pub(crate) use graph_pool::test_support as graph_pool_test_support;
pub use graph_pool::{
    AllocateToPool, GraphPool, GraphPoolId, MissPolicy, begin_allocate_to_pool, graph_pool_handle,
    note_capture_stream, stranded_graph_memory,
};
pub(crate) use graph_pool::{
    GraphHeld, NO_POOL, defer_until_no_capture, hold_for_graphs, pool_tag_is_live,
    pool_tag_of_capture, release_resource_during_capture, return_frees_deferred_by_captures,
    synchronize_once,
};
pub(crate) use pool::Grant;
pub use resource::CachingResource;
pub use size_class::PoolKind;
pub use snapshot::{BlockSnapshot, BlockStatus, MemorySnapshot, SegmentSnapshot};
pub use stats::{MemoryStats, Stat};
pub use stream_uses::StreamKey;
