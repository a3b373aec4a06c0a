//! [`StreamOrderedAllocator`]: device memory tied to a stream, from one stream-ordered pool per
//! device, freed in stream order, usable on other streams only after a recorded dependency.
//!
//! Allocating is here; the settings are in `config` ([`StreamOrderedAllocatorConfig`]), the
//! receipts in `allocation` ([`StreamAllocation`]), the waits between streams in `dependencies`,
//! freeing (and what a drop frees) in `free`, the size classes in `size_class` and the counts in
//! `stats` ([`AllocatorStats`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cuweave_driver::memory::DevicePtr;
use cuweave_memory::{AsyncPoolResource, DeviceBuffer, Element, MemoryResource};
use dashmap::DashMap;
use parking_lot::Mutex;

use crate::error::{Result, StreamError};
use crate::stream::{OperationKind, PriorityStream};

mod allocation;
mod config;
mod dependencies;
mod free;
pub mod size_class;
mod stats;

pub use allocation::StreamAllocation;
pub use config::StreamOrderedAllocatorConfig;
pub use stats::{AllocatorStats, SizeClassStats};

use allocation::Entry;
use dependencies::Dependency;
use size_class::{rounded_size, size_class};

static NEXT_ALLOCATION_ID: AtomicU64 = AtomicU64::new(1);

/// Stream-ordered device memory tied to streams (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync`).
///
/// - One private memory pool per device (made on first use, release threshold from the config).
/// - [`allocate_for_stream`](Self::allocate_for_stream) rounds the request to a size class
///   (powers of two from 512 B to 1 MiB, then multiples of 2 MiB) and allocates on the stream:
///   work queued on it afterwards may use the memory.
/// - [`free_for_stream`](Self::free_for_stream) frees everything a stream owns, queued on that
///   stream, after first making it wait for every other stream that was given the memory; the
///   pool reuses the memory only for work ordered after the free.
/// - Another stream uses the memory after [`add_stream_dependency`](Self::add_stream_dependency):
///   it then waits on the device for the owner's work so far, and the owner's free waits for
///   it. [`dependencies_satisfied`](Self::dependencies_satisfied) tells, without blocking,
///   whether the GPU is past those waits; the allocator keeps one wait per stream pair (the
///   latest), so its list is bounded by the pairs of streams, and forgets finished ones.
/// - [`device_ptr`](Self::device_ptr) is a raw address for `unsafe` kernel launches: the
///   launch's contract, not the allocator, says on which streams it may be used. (An earlier
///   `NotOrdered` check per stream went stale as soon as the owner queued more work, so it
///   protected nothing and was removed.)
///
/// ```no_run
/// use std::sync::Arc;
/// use cuweave_driver::{Context, Device};
/// use cuweave_stream::{PriorityStream, StreamOrderedAllocator, StreamPriority};
///
/// # fn main() -> cuweave_stream::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let a = Arc::new(PriorityStream::new(&context, StreamPriority::Normal)?);
/// let b = Arc::new(PriorityStream::new(&context, StreamPriority::Normal)?);
/// let allocator = StreamOrderedAllocator::new(Default::default());
/// let block = allocator.allocate_for_stream(&a, 3000)?; // rounded to 4 KiB
/// allocator.add_stream_dependency(&b, &a)?; // b waits for a's work so far
/// let ptr = allocator.device_ptr(&block)?;
/// # let _ = ptr;
/// allocator.free_for_stream(&a)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct StreamOrderedAllocator {
    config: StreamOrderedAllocatorConfig,
    pools: DashMap<usize, Arc<AsyncPoolResource>>,
    entries: Mutex<BTreeMap<u64, Entry>>,
    dependencies: Mutex<Vec<Dependency>>,
    stats: Mutex<Option<AllocatorStats>>,
}

impl Default for StreamOrderedAllocator {
    fn default() -> Self {
        Self::new(StreamOrderedAllocatorConfig::default())
    }
}

impl StreamOrderedAllocator {
    /// An allocator; pools are made per device on first use.
    pub fn new(config: StreamOrderedAllocatorConfig) -> Self {
        Self {
            config,
            pools: DashMap::new(),
            entries: Mutex::new(BTreeMap::new()),
            dependencies: Mutex::new(Vec::new()),
            stats: Mutex::new(None),
        }
    }

    /// The configuration.
    pub fn config(&self) -> StreamOrderedAllocatorConfig {
        self.config
    }

    fn pool_for(&self, stream: &PriorityStream) -> Result<Arc<AsyncPoolResource>> {
        let device = stream.device().ordinal();
        if let Some(pool) = self.pools.get(&device) {
            return Ok(Arc::clone(&pool));
        }
        let pool = AsyncPoolResource::new(stream.context())?;
        pool.pool()
            .set_release_threshold(self.config.release_threshold)?;
        tracing::debug!(
            device,
            threshold = self.config.release_threshold,
            "stream-ordered pool made"
        );
        Ok(Arc::clone(
            &self.pools.entry(device).or_insert_with(|| Arc::new(pool)),
        ))
    }

    /// Allocates `bytes` (rounded to a size class) for `stream`, in its order.
    ///
    /// # Errors
    /// [`StreamError::InvalidArgument`] for zero or overflowing sizes and for the per-thread
    /// default stream (its one handle names a different stream on each thread, so a free from
    /// another thread would not be ordered after the owner's work); the driver's error on a
    /// device without memory pools or out of memory.
    pub fn allocate_for_stream(
        &self,
        stream: &Arc<PriorityStream>,
        bytes: usize,
    ) -> Result<StreamAllocation> {
        const OPERATION: &str = "StreamOrderedAllocator::allocate_for_stream";
        if bytes == 0 {
            return Err(StreamError::invalid(OPERATION, "zero-byte allocation"));
        }
        if stream.stream().is_per_thread_default() {
            // Its free is queued on the owner from whichever thread frees: on another thread
            // the handle names another stream, not ordered after the owner's work.
            return Err(StreamError::invalid(
                OPERATION,
                "the per-thread default stream (CU_STREAM_PER_THREAD) names a different stream \
                 on each thread, so the allocation's free could not be ordered after its uses; \
                 use a created stream",
            ));
        }
        let rounded = rounded_size(bytes).ok_or_else(|| {
            StreamError::invalid(
                OPERATION,
                format!("{bytes} bytes overflows the size classes"),
            )
        })?;
        let pool = self.pool_for(stream)?;
        let capture = crate::capture::capture_id(stream.stream())?;
        let mut allocated = None;
        let queued = stream.enqueue(OperationKind::Other, 0, |s| {
            let result = pool.allocate(rounded, s);
            allocated = result.as_ref().ok().copied();
            result
        });
        let ptr = match (queued, allocated) {
            (Ok(ptr), _) => ptr,
            (Err(error), Some(ptr)) => {
                // Allocated, but the bookkeeping behind it failed: give the memory back in the
                // stream's order rather than lose it.
                if let Err(free_error) = pool.deallocate(ptr, rounded, stream.stream()) {
                    tracing::warn!(%free_error, "freeing an allocation whose bookkeeping failed");
                }
                return Err(error);
            }
            (Err(error), None) => return Err(error),
        };
        let allocation = StreamAllocation {
            id: NEXT_ALLOCATION_ID.fetch_add(1, Ordering::Relaxed),
            ptr,
            bytes: rounded,
            requested: bytes,
            owner: stream.id(),
            device: stream.device().ordinal(),
        };
        let class = size_class(rounded);
        // Counted before it is listed: once listed, another thread's `free_for_stream` may take
        // it and count its free, which must never come before its allocation.
        self.with_stats(|stats| stats.on_allocate(class, rounded as u64, bytes as u64));
        self.entries.lock().insert(
            allocation.id,
            Entry {
                allocation,
                class,
                owner: Arc::clone(stream),
                users: Vec::new(),
                capture,
            },
        );
        Ok(allocation)
    }

    /// A typed buffer of `len` elements from this allocator's stream-ordered pool of `stream`'s
    /// device, allocated in `stream`'s order: the memory layer's [`DeviceBuffer`] over the pool
    /// as a [`MemoryResource`]
    /// ([`DeviceBuffer::with_resource`](cuweave_memory::DeviceBuffer::with_resource)), so it
    /// gets the memory layer's safe typed API and use tracking: copies, fills and launches on
    /// any stream are ordered after the buffer's conflicting uses, and dropping it frees the
    /// memory in stream order once every recorded use has finished. It is the safe form of
    /// [`allocate_for_stream`](Self::allocate_for_stream), whose receipts hand out raw
    /// addresses; such buffers are not counted in [`stats`](Self::stats) or
    /// [`outstanding`](Self::outstanding) (the buffer owns its memory).
    ///
    /// # Errors
    /// The memory layer's errors (`ZeroLength`, `Misaligned`, a stream of another context, out
    /// of memory); the driver's error on a device without memory pools.
    pub fn buffer<T: Element>(
        &self,
        stream: &Arc<PriorityStream>,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        let pool: Arc<dyn MemoryResource> = self.pool_for(stream)?;
        Ok(DeviceBuffer::with_resource(pool, len, stream.stream())?)
    }

    /// The device address of `allocation`, for (`unsafe`) kernel launches on its owner or on
    /// a stream ordered after the owner with
    /// [`add_stream_dependency`](Self::add_stream_dependency).
    ///
    /// # Errors
    /// [`StreamError::UnknownAllocation`] once it is freed.
    pub fn device_ptr(&self, allocation: &StreamAllocation) -> Result<DevicePtr> {
        const OPERATION: &str = "StreamOrderedAllocator::device_ptr";
        let entries = self.entries.lock();
        let entry = entries
            .get(&allocation.id)
            .ok_or(StreamError::UnknownAllocation {
                operation: OPERATION,
                allocation: allocation.id,
            })?;
        Ok(entry.allocation.ptr)
    }

    /// Allocations outstanding.
    pub fn outstanding(&self) -> usize {
        self.entries.lock().len()
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> AllocatorStats {
        self.stats
            .lock()
            .clone()
            .unwrap_or_else(AllocatorStats::empty)
    }

    /// Bytes the pool of `device` holds from the driver (in use and cached); 0 before its first
    /// allocation.
    ///
    /// # Errors
    /// The driver's error from the pool query.
    pub fn reserved_bytes(&self, device: usize) -> Result<u64> {
        match self.pools.get(&device) {
            Some(pool) => Ok(pool.pool().reserved_bytes()?),
            None => Ok(0),
        }
    }

    /// Returns cached memory of every pool to the driver, keeping what is in use.
    ///
    /// # Errors
    /// The driver's error.
    pub fn trim(&self) -> Result<()> {
        for pool in self.pools.iter() {
            pool.pool().trim_to(0)?;
        }
        Ok(())
    }

    fn with_stats(&self, f: impl FnOnce(&mut AllocatorStats)) {
        let mut stats = self.stats.lock();
        f(stats.get_or_insert_with(AllocatorStats::empty));
    }
}
