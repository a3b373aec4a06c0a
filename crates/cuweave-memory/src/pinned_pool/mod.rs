//! [`PinnedPool`]: page-locked host blocks reused by size class, safe against queued GPU work.
//!
//! Pinning host memory is slow (tens of milliseconds for 64 MiB), and copies between host and
//! device run asynchronously at full bus speed only from pinned memory. The transfer layer
//! therefore stages through blocks of this pool instead of pinning per transfer.
//!
//! # The model
//! - [`PinnedPool::get`] rounds a request up to its size class ([`block_size`]: powers of two
//!   from 4 KiB to 256 MiB, then multiples of 2 MiB) and returns a [`PinnedBlock`]: a cached
//!   block of that class when one is ready, else a newly pinned one. Blocks are pinned
//!   *portable*, so streams of every context and device may use them, and *mapped* for zero-copy
//!   kernels when [`PinnedPoolConfig::mapped`] says so.
//! - Before dropping a block whose memory queued GPU work uses, [`PinnedBlock::record`] each
//!   stream that uses it. Dropping returns the block to the pool, which hands it out again only
//!   after every recorded stream has passed its use, polled without blocking on later `get`s.
//! - [`PinnedPool::trim`] gives ready cached blocks back to the driver;
//!   [`PinnedPoolConfig::max_cached_bytes`] caps what the cache keeps.
//! - [`PinnedPool::stats`] reports bytes in use, cached, pending and pinned (current and peak),
//!   and the gets, returns, hits, misses and frees behind them.
//!
//! The events recorded behind blocks' uses come from the context's event pool
//! ([`EventPool::for_context`](cuweave_driver::EventPool::for_context)); a returned block keeps
//! them until they have completed, then drops them, which gives them back to the pool. The pool
//! keeps no spare events of its own.
//!
//! Pinning, freeing, and creating or destroying events never happen under the pool's lock.
//!
//! ```no_run
//! use cuweave_driver::{Context, Device, Stream, StreamFlags};
//! use cuweave_memory::pinned_pool::{PinnedPool, PinnedPoolConfig};
//!
//! # fn main() -> Result<(), cuweave_memory::MemoryError> {
//! let context = Context::primary(Device::get(0)?)?;
//! let pool = PinnedPool::with_config(
//!     &context,
//!     PinnedPoolConfig { max_cached_bytes: 256 << 20, ..PinnedPoolConfig::default() },
//! );
//! let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
//! let mut chunk = pool.get_typed::<f32>(1 << 20)?;
//! chunk.as_mut_slice().fill(1.5);
//! // ... queue an async copy from the chunk on `stream` ...
//! chunk.record(&stream)?;
//! drop(chunk);
//! println!("{:?}", pool.stats());
//! # Ok(())
//! # }
//! ```

mod block;
mod cache;
mod config;
mod default;
#[cfg(test)]
mod graph_tests;
mod pool;
mod size_class;
mod stats;

pub use block::{PinnedBlock, TypedPinnedBlock};
pub use config::PinnedPoolConfig;
pub use pool::PinnedPool;
pub use size_class::{LARGE_GRANULARITY, LARGE_THRESHOLD, MIN_BLOCK_BYTES, block_size};
pub use stats::PinnedPoolStats;
