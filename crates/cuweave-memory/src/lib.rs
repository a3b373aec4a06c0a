//! Typed GPU memory for cuweave: buffers, unified-memory hints, a caching allocator, a pinned pool.
//!
//! This layer sits on [`cuweave_driver`] and turns its raw allocations into memory you can use
//! from safe Rust without racing the GPU:
//!
//! | item | what it is for |
//! |---|---|
//! | [`DeviceBuffer`], [`PinnedBuffer`], [`UnifiedBuffer`] | typed device, page-locked host and managed memory, sharing the [`Buffer`] trait |
//! | [`Access`], [`TrackedLaunch`] | reads apart from writes: readers on different streams overlap; a kernel launch that orders itself with the buffers it reads and writes |
//! | [`PendingCopy`] | an async host copy that owns its host side until the GPU is past it |
//! | [`MemAdvice`], [`MigrationPolicy`], [`ManagedMemoryHints`], [`PrefetchPlan`] | unified-memory placement: advice, policies, checked prefetch, batched prefetch |
//! | [`CachingAllocator`], [`CachedAllocation`], [`MemoryStats`] | PyTorch-grade caching of device memory: size-rounded blocks, per-stream free lists, `record_stream`, OOM retry |
//! | [`MemoryResource`], [`DriverResource`], [`AsyncPoolResource`], [`StatisticsAdaptor`], [`LimitAdaptor`] | RMM-style upstream resources and adaptors the allocator draws from |
//! | [`PinnedPool`], [`PinnedBlock`] | reuse of page-locked host blocks, gated on the event of their last use |
//!
//! # The rules it keeps
//! - Memory is never freed or reused while queued GPU work can still touch it: buffers remember
//!   the event of their last use and order every later use (and their drop) after it; the
//!   allocator and the pinned pool hand a block out again only once events on every stream that
//!   used it have passed.
//! - Async copies own (or exclusively borrow) their host side until the stream has passed them.
//! - Host views of pinned and unified memory wait for the device first, or refuse with
//!   [`MemoryError::DeviceBusy`].
//! - Bad input (zero lengths, ranges past the end, mismatched sizes, another device's stream)
//!   is a typed [`MemoryError`], never a panic.
//!
//! Guides: `docs/unified-memory.md` and `docs/allocators.md` in the repository.
//!
//! ```no_run
//! use std::sync::Arc;
//! use cuweave_driver::{Context, Device, Stream, StreamFlags};
//! use cuweave_memory::{Buffer, CachingAllocator, DeviceBuffer};
//!
//! # fn main() -> Result<(), cuweave_memory::MemoryError> {
//! let context = Context::primary(Device::get(0)?)?;
//! let mut buffer = DeviceBuffer::<f32>::from_slice(&context, &[1.0, 2.0, 3.0])?;
//! buffer.fill(7.0)?;
//! assert_eq!(buffer.to_vec()?, vec![7.0; 3]);
//!
//! let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
//! let allocator = CachingAllocator::with_driver(&context);
//! let block = allocator.allocate(1 << 20, &stream)?; // a driver allocation (cache miss)
//! drop(block);
//! let again = allocator.allocate(1 << 20, &stream)?; // served from the cache
//! assert_eq!(allocator.stats().cache_hits, 1);
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
pub mod host_copy;
// Unsafe is allowed here: the launch is the driver's unsafe kernel launch, with its contract.
#[allow(unsafe_code)]
pub mod launch;
pub mod pinned_pool;
#[cfg(test)]
mod proptest_config;
pub mod resource;
pub mod unified;

pub use buffer::{
    Access, Buffer, BufferSlice, BufferSliceMut, DeviceBuffer, HostSink, HostSource, PendingCopy,
    PinnedBuffer, UnifiedBuffer,
};
pub use caching::{CachedAllocation, CachingAllocator, MemoryStats, PoolKind, Stat, StreamKey};
pub use element::Element;
pub use error::{MemoryError, Result};
pub use host_copy::copy_streaming;
pub use launch::TrackedLaunch;
pub use pinned_pool::{
    PinnedBlock, PinnedPool, PinnedPoolConfig, PinnedPoolStats, TypedPinnedBlock,
};
pub use resource::{
    AsyncPoolResource, DriverResource, LimitAdaptor, MemoryResource, ResourceStats,
    StatisticsAdaptor,
};
pub use unified::{
    ManagedCapabilities, ManagedMemoryHints, ManagedRange, MemAdvice, MemLocation, MigrationPolicy,
    PrefetchPath, PrefetchPlan,
};
