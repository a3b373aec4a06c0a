//! Typed GPU memory for cuweave: buffers, unified-memory hints, a caching allocator, a pinned pool.
//!
//! This layer sits on [`cuweave_driver`] and turns its raw allocations into memory you can use
//! from safe Rust without racing the GPU:
//!
//! | item | what it is for |
//! |---|---|
//! | [`DeviceBuffer`], [`PinnedBuffer`], [`UnifiedBuffer`] | typed device (from the caching allocator or any resource), page-locked host (own or from the pool) and managed memory, sharing the [`Buffer`] trait |
//! | [`BufferSlice`], [`BufferSliceMut`] | typed views of part of a buffer, tracked per range |
//! | [`Access`], [`TrackedLaunch`] | reads apart from writes: readers on different streams overlap; a kernel launch that orders itself with the buffers it reads and writes |
//! | [`PendingCopy`] | an async host copy that owns its host side until the GPU is past it |
//! | [`MemAdvice`], [`MigrationPolicy`], [`ManagedMemoryHints`], [`PrefetchPlan`] | unified-memory placement: advice, policies, checked prefetch, batched prefetch |
//! | [`CachingAllocator`], [`CachedAllocation`], [`MemoryStats`] | PyTorch-grade caching of device memory: size-rounded blocks, per-stream free lists, `record_stream`, OOM retry |
//! | [`MemoryResource`], [`DriverResource`], [`AsyncPoolResource`], [`StatisticsAdaptor`], [`LimitAdaptor`], [`TrackingAdaptor`], [`LoggingAdaptor`] | RMM-style upstream resources and adaptors the allocator draws from |
//! | [`PinnedPool`], [`PinnedBlock`] | reuse of page-locked host blocks, gated on the event of their last use |
//!
//! # The rules it keeps
//! - Memory is never freed or reused while queued GPU work can still touch it: buffers remember
//!   the events of their uses (per byte range) and order every later use after them; dropping a
//!   device buffer hands those events to its allocator, which (like the pinned pool) hands the
//!   block out again only once they have all passed. A drop never blocks on the GPU.
//! - Async copies own (or exclusively borrow) their host side until the stream has passed them.
//! - Host views of pinned and unified memory wait for the device first, or refuse with
//!   [`MemoryError::DeviceBusy`].
//! - Bad input (zero lengths, ranges past the end, mismatched sizes, another device's stream)
//!   is a typed [`MemoryError`], never a panic.
//!
//! Guides: `docs/unified-memory.md` and `docs/allocators.md` in the repository.
//!
//! The first thing to write allocates from the cache: [`DeviceBuffer::new_on`] takes a block of
//! the device's default [`CachingAllocator`] for a stream (no driver call when warm), and dropping
//! the buffer gives it back in stream order, never waiting for the GPU. Views
//! ([`Buffer::slice`], [`Buffer::slice_mut`]) are tracked per range.
//!
//! ```no_run
//! use cuweave_driver::{Context, Device, Stream, StreamFlags};
//! use cuweave_memory::{Buffer, CachingAllocator, DeviceBuffer};
//!
//! # fn main() -> Result<(), cuweave_memory::MemoryError> {
//! let context = Context::primary(Device::get(0)?)?;
//! let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
//! let mut buffer = DeviceBuffer::<f32>::new_on(&stream, 3)?; // from the cache
//! buffer.copy_from_host(&[1.0, 2.0, 3.0])?;
//! buffer.slice_mut(1..)?.fill_async(7.0, &stream)?;
//! assert_eq!(buffer.to_vec()?, vec![1.0, 7.0, 7.0]);
//! drop(buffer); // back to the cache once the fill has run; no cuMemFree, no wait
//!
//! let again = DeviceBuffer::<f32>::new_on(&stream, 3)?; // the same block, no driver call
//! let allocator = CachingAllocator::for_device(context.device())?;
//! assert!(allocator.stats().cache_hits >= 1);
//! # drop(again);
//! # Ok(())
//! # }
//! ```
// Unsafe is denied crate-wide and allowed only in the few modules that must turn driver
// addresses into host slices or call the driver's raw copy functions; each says why.
#![deny(unsafe_code)]

pub mod buffer;
pub mod caching;
pub mod element;
pub mod error;
mod events;
pub mod host_copy;
// Unsafe is allowed here: the launch is the driver's unsafe kernel launch, with its contract.
#[allow(unsafe_code)]
pub mod launch;
// Unsafe is allowed here: lending disjoint parts of one owned slice to several threads.
#[allow(unsafe_code)]
pub mod parts;
pub mod pinned_pool;
#[cfg(test)]
mod proptest_config;
pub mod resource;
pub mod unified;

pub use buffer::{
    Access, Buffer, BufferSlice, BufferSliceMut, DeviceBuffer, HostRefusal, HostSink, HostSlice,
    HostSliceMut, HostSource, PendingCopy, PinnedBuffer, UnifiedBuffer, host_refusal,
    split_host_refusal,
};
pub use caching::{
    AllocatorConfig, BlockSnapshot, BlockStatus, CachedAllocation, CachingAllocator, GraphPool,
    GraphPoolId, MemorySnapshot, MemoryStats, MissPolicy, PoolKind, SegmentSnapshot, Stat,
    StreamKey,
};
pub use element::Element;
pub use error::{HostCopyError, MemoryError, Result};
pub use host_copy::copy_streaming;
pub use launch::TrackedLaunch;
pub use pinned_pool::{
    PinnedBlock, PinnedPool, PinnedPoolConfig, PinnedPoolStats, TypedPinnedBlock,
};
pub use resource::{
    AsyncPoolResource, DriverResource, LimitAdaptor, LoggingAdaptor, MemoryResource,
    OutstandingAllocation, ResourceStats, StatisticsAdaptor, TrackingAdaptor,
};
pub use unified::{
    ManagedCapabilities, ManagedMemoryHints, ManagedRange, MemAdvice, MemLocation, MigrationPolicy,
    PrefetchPath, PrefetchPlan,
};
