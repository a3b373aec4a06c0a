//! [`StreamOrderedAllocator`]: device memory tied to a stream, from one stream-ordered pool per
//! device, freed in stream order, usable on other streams only after a recorded dependency.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cuweave_driver::graph::GraphError;
use cuweave_driver::memory::DevicePtr;
use cuweave_driver::{DriverError, OwnedPooledEvent};
use cuweave_memory::{AsyncPoolResource, DeviceBuffer, Element, MemoryResource};
use dashmap::DashMap;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{Result, StreamError, ensure_device};
use crate::stream::{OperationKind, PriorityStream};

pub mod size_class;
mod stats;

pub use stats::{AllocatorStats, SizeClassStats};

use size_class::{rounded_size, size_class};

/// Settings of a [`StreamOrderedAllocator`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct StreamOrderedAllocatorConfig {
    /// Bytes each device's pool keeps cached across synchronisations before the driver releases
    /// memory back to the OS (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`).
    pub release_threshold: u64,
}

impl Default for StreamOrderedAllocatorConfig {
    fn default() -> Self {
        Self {
            release_threshold: 256 << 20,
        }
    }
}

impl StreamOrderedAllocatorConfig {
    /// The default settings with `bytes` as the release threshold.
    pub fn with_release_threshold(bytes: u64) -> Self {
        Self {
            release_threshold: bytes,
        }
    }
}

/// One allocation of a [`StreamOrderedAllocator`], owned by the stream it was made on.
///
/// It is a receipt, not the memory: the device address comes from
/// [`StreamOrderedAllocator::device_ptr`], which checks the stream that wants it is ordered
/// after the owner. Freeing goes through the allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StreamAllocation {
    id: u64,
    ptr: DevicePtr,
    bytes: usize,
    requested: usize,
    owner: u64,
    device: usize,
}

impl StreamAllocation {
    /// The allocation's id (unique within the process).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Its size after rounding to its size class.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The size asked for.
    pub fn requested(&self) -> usize {
        self.requested
    }

    /// The id of the stream that owns it.
    pub fn owner(&self) -> u64 {
        self.owner
    }

    /// The device it is on.
    pub fn device(&self) -> usize {
        self.device
    }
}

#[derive(Debug)]
struct Entry {
    allocation: StreamAllocation,
    class: usize,
    owner: Arc<PriorityStream>,
    users: Vec<Arc<PriorityStream>>,
    /// The capture the allocation was recorded into (a graph's allocation node), or `None`
    /// for an allocation made eagerly.
    capture: Option<u64>,
}

/// The latest point-in-time wait of `dependent` on `prerequisite`: a later one on the same
/// pair finishes after it (stream order), so one per pair is all that is kept.
#[derive(Debug)]
struct Dependency {
    dependent: u64,
    prerequisite: u64,
    event: OwnedPooledEvent,
}

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

    /// Makes `dependent` wait on the device for the work queued on `prerequisite` so far, and
    /// lets it use every allocation `prerequisite` may use now (those it owns and those it was
    /// given).
    ///
    /// While `prerequisite` is capturing, the wait is recorded into the graph (an edge, which
    /// forks `dependent` into the capture) and is not one that
    /// [`dependencies_satisfied`](Self::dependencies_satisfied) tracks: nothing runs until the
    /// graph is launched.
    ///
    /// # Errors
    /// [`StreamError::WrongDevice`] for streams of different devices (the memory is one
    /// device's); [`StreamError::SelfDependency`] for a stream and itself;
    /// [`GraphError::Capturing`], before anything is queued, when `dependent` captures and
    /// `prerequisite` is not in its capture (the driver would invalidate the capture); the
    /// driver's error.
    ///
    /// [`GraphError::Capturing`]: cuweave_driver::graph::GraphError::Capturing
    pub fn add_stream_dependency(
        &self,
        dependent: &Arc<PriorityStream>,
        prerequisite: &Arc<PriorityStream>,
    ) -> Result<()> {
        const OPERATION: &str = "StreamOrderedAllocator::add_stream_dependency";
        ensure_device(
            OPERATION,
            prerequisite.device().ordinal(),
            dependent.device().ordinal(),
        )?;
        if dependent.id() == prerequisite.id() {
            return Err(StreamError::SelfDependency {
                operation: OPERATION,
                stream: dependent.id(),
            });
        }
        crate::capture::refuse_wait_across_capture(
            dependent.stream(),
            prerequisite.stream(),
            OPERATION,
        )?;
        // Recorded into a capture, the wait is a graph edge: nothing runs that could be waited
        // for, and the event answers every later query with CUDA_ERROR_CAPTURED_EVENT.
        let captured = crate::capture::is_capturing(prerequisite.stream())?;
        let event = prerequisite.event_pool().acquire_owned(false)?;
        event.record(prerequisite.stream())?;
        dependent.stream().wait_event(&event)?;
        crate::capture::note_wait_joined_capture(dependent.stream())?;
        let (pre, dep) = (prerequisite.id(), dependent.id());
        for entry in self.entries.lock().values_mut() {
            let usable = entry.owner.id() == pre || entry.users.iter().any(|user| user.id() == pre);
            if usable && entry.owner.id() != dep && !entry.users.iter().any(|user| user.id() == dep)
            {
                entry.users.push(Arc::clone(dependent));
            }
        }
        {
            let mut dependencies = self.dependencies.lock();
            // Finished waits are forgotten, as housekeeping: when a query fails (refused on a
            // capturing thread) the waits from there on are kept, for `dependencies_satisfied`
            // to report. The wait above is queued either way, so this call succeeds.
            let pruned = retain_pending(&mut dependencies, |dependency| {
                Ok(dependency.event.query()?)
            });
            if let Err(error) = pruned {
                tracing::debug!(%error, "stream-ordered allocator: finished waits not pruned");
            }
            if !captured {
                // The new wait is queued behind the earlier one of this pair (same streams, a
                // later point of `prerequisite`), so that one is forgotten (its event goes back
                // to the pool): the list holds at most one wait per pair of streams. A captured
                // wait replaces nothing: it is a graph edge, and the earlier eager wait still
                // holds `dependent` back.
                dependencies.retain(|dependency| {
                    dependency.dependent != dep || dependency.prerequisite != pre
                });
                dependencies.push(Dependency {
                    dependent: dep,
                    prerequisite: pre,
                    event,
                });
            }
        }
        self.with_stats(|stats| stats.dependencies += 1);
        Ok(())
    }

    /// Whether the GPU has passed every wait recorded for `dependent` so far, without blocking.
    /// Satisfied waits are forgotten.
    ///
    /// # Errors
    /// The driver's error from an event query ([`GraphError::Capturing`] on a thread that is
    /// capturing); every wait not known to be satisfied is then kept, so a later call still
    /// sees it.
    ///
    /// [`GraphError::Capturing`]: cuweave_driver::graph::GraphError::Capturing
    pub fn dependencies_satisfied(&self, dependent: &PriorityStream) -> Result<bool> {
        let mut dependencies = self.dependencies.lock();
        retain_pending(&mut dependencies, |dependency| {
            Ok(dependency.event.query()?)
        })?;
        Ok(!dependencies
            .iter()
            .any(|dependency| dependency.dependent == dependent.id()))
    }

    /// Frees `allocation` in its owner's stream order, after the owner has waited for every
    /// stream it was given to.
    ///
    /// While the owner captures a graph, only an allocation made in that same capture can be
    /// freed (both become nodes of the graph); an allocation made outside it is refused and
    /// stays held, to be freed once the capture has ended.
    ///
    /// # Errors
    /// [`StreamError::UnknownAllocation`] when it is not held (already freed);
    /// [`GraphError::Capturing`] while the owner captures and the allocation was not made in its
    /// capture (nothing is queued, the allocation stays held); the driver's error.
    pub fn free(&self, allocation: StreamAllocation) -> Result<()> {
        let entry =
            self.entries
                .lock()
                .remove(&allocation.id)
                .ok_or(StreamError::UnknownAllocation {
                    operation: "StreamOrderedAllocator::free",
                    allocation: allocation.id,
                })?;
        self.release_or_restore(entry)
    }

    /// Frees every allocation `stream` owns, in its stream order; returns how many.
    ///
    /// # Errors
    /// The first driver error; allocations not yet freed then stay held.
    pub fn free_for_stream(&self, stream: &PriorityStream) -> Result<usize> {
        let owned: Vec<Entry> = {
            let mut entries = self.entries.lock();
            let ids: Vec<u64> = entries
                .values()
                .filter(|entry| entry.owner.id() == stream.id())
                .map(|entry| entry.allocation.id)
                .collect();
            ids.iter().filter_map(|id| entries.remove(id)).collect()
        };
        let count = owned.len();
        let mut owned = owned.into_iter();
        while let Some(entry) = owned.next() {
            if let Err(error) = self.release_or_restore(entry) {
                let mut entries = self.entries.lock();
                for rest in owned {
                    entries.insert(rest.allocation.id, rest);
                }
                return Err(error);
            }
        }
        Ok(count)
    }

    /// Releases `entry`, or puts it back on the books when that fails before the memory was
    /// freed. When the free was queued and only the bookkeeping behind it failed, the entry
    /// stays off the books (its address is no longer the allocation's) and the error is
    /// returned.
    fn release_or_restore(&self, entry: Entry) -> Result<()> {
        match self.release(&entry) {
            Ok(()) => Ok(()),
            Err(Unreleased {
                error,
                freed: false,
            }) => {
                self.entries.lock().insert(entry.allocation.id, entry);
                Err(error)
            }
            Err(Unreleased { error, freed: true }) => Err(error),
        }
    }

    /// Makes the owner wait for the work queued so far on every stream the memory was given to.
    fn order_after_users(&self, entry: &Entry) -> Result<()> {
        for user in &entry.users {
            entry.owner.wait_for(user)?;
        }
        Ok(())
    }

    /// Queues the free of `entry` on its owner, after its users, and counts it once queued.
    fn release(&self, entry: &Entry) -> std::result::Result<(), Unreleased> {
        let before_free = |error: StreamError| Unreleased {
            error,
            freed: false,
        };
        let capture = crate::capture::capture_id(entry.owner.stream()).map_err(before_free)?;
        if capture.is_some() && capture != entry.capture {
            // Recorded into the graph, the free would not run now (the memory stays taken) and
            // would run at every launch of the graph: a double free from the second on.
            return Err(before_free(
                DriverError::from(GraphError::Capturing {
                    operation: "StreamOrderedAllocator::free",
                    reason: "the owner stream is capturing and the allocation was not made in its capture: the free would be recorded into the graph and run at every launch",
                })
                .into(),
            ));
        }
        for user in &entry.users {
            let user_capture = crate::capture::capture_id(user.stream()).map_err(before_free)?;
            if user_capture.is_some() && user_capture != entry.capture {
                // The owner's wait on a capturing user would pull the owner into that capture,
                // and the free with it (recorded, not run, and run at every launch).
                return Err(before_free(
                    DriverError::from(GraphError::Capturing {
                        operation: "StreamOrderedAllocator::free",
                        reason: "a stream the allocation was given to is capturing: the owner's wait on it would join the owner, and the free, to that capture; free once the capture has ended",
                    })
                    .into(),
                ));
            }
        }
        self.order_after_users(entry).map_err(before_free)?;
        let pool = self.pool_for(&entry.owner).map_err(before_free)?;
        let allocation = entry.allocation;
        let mut freed = false;
        let queued = entry.owner.enqueue(OperationKind::Other, 0, |s| {
            let result = pool.deallocate(allocation.ptr, allocation.bytes, s);
            freed = result.is_ok();
            result
        });
        if freed {
            self.with_stats(|stats| {
                stats.on_free(
                    entry.class,
                    allocation.bytes as u64,
                    allocation.requested as u64,
                )
            });
        }
        queued.map_err(|error| Unreleased { error, freed })
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

/// Drops, in order, the entries `finished` says are done. At the first entry it cannot tell
/// about, it stops: that entry and every one after it are kept, and its error is returned.
fn retain_pending<D>(
    list: &mut Vec<D>,
    mut finished: impl FnMut(&D) -> Result<bool>,
) -> Result<()> {
    let mut failure = None;
    // `retain` visits every entry once, in order.
    list.retain(|entry| {
        if failure.is_some() {
            return true;
        }
        match finished(entry) {
            Ok(done) => !done,
            Err(error) => {
                failure = Some(error);
                true
            }
        }
    });
    failure.map_or(Ok(()), Err)
}

/// A release that failed: the error, and whether the free itself was queued (only the
/// bookkeeping queued behind it failed), in which case the allocation is gone.
struct Unreleased {
    error: StreamError,
    freed: bool,
}

impl Drop for StreamOrderedAllocator {
    fn drop(&mut self) {
        let entries = std::mem::take(&mut *self.entries.lock());
        for (_, entry) in entries {
            // A free refused because a stream captures leaves the memory allocated (logged)
            // rather than recording it into that capture.
            if let Err(Unreleased { error, .. }) = self.release(&entry) {
                tracing::warn!(%error, "freeing a stream-ordered allocation on drop failed; it stays allocated");
            }
        }
        // `cuMemPoolDestroy` breaks a capture that forbids it: while one does, the pools are
        // left to the process (logged) rather than destroyed under it.
        if cuweave_driver::graph::refuse_while_capturing(None, "StreamOrderedAllocator::drop")
            .is_err()
        {
            let pools = std::mem::take(&mut self.pools);
            tracing::warn!(
                pools = pools.len(),
                "StreamOrderedAllocator dropped while a capture forbids destroying memory pools; they are kept for the process"
            );
            for (_, pool) in pools {
                std::mem::forget(pool);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use cuweave_driver::DriverError;
    use cuweave_driver::graph::GraphError;
    use rstest::rstest;

    use super::*;

    fn refused() -> StreamError {
        DriverError::from(GraphError::Capturing {
            operation: "Event::query",
            reason: "a test",
        })
        .into()
    }

    /// Entries are `(id, answer)`: `Some(done)` or `None` for a query that fails.
    #[rstest]
    #[case::all_answered(&[(1, Some(true)), (2, Some(false)), (3, Some(true))], &[2], false)]
    #[case::first_fails(&[(1, None), (2, Some(true)), (3, Some(false))], &[1, 2, 3], true)]
    #[case::middle_fails(&[(1, Some(true)), (2, None), (3, Some(true))], &[2, 3], true)]
    #[case::last_fails(&[(1, Some(false)), (2, Some(true)), (3, None)], &[1, 3], true)]
    #[case::empty(&[], &[], false)]
    fn a_failed_query_keeps_that_entry_and_every_later_one(
        #[case] entries: &[(u32, Option<bool>)],
        #[case] kept: &[u32],
        #[case] fails: bool,
    ) {
        let mut list = entries.to_vec();
        let mut asked = Vec::new();
        let result = retain_pending(&mut list, |&(id, answer)| {
            asked.push(id);
            answer.ok_or_else(refused)
        });
        assert_eq!(result.is_err(), fails);
        if fails {
            assert_eq!(result.unwrap_err(), refused());
            // Nothing after the failing entry was queried.
            let failed = entries.iter().position(|(_, a)| a.is_none()).unwrap();
            assert_eq!(asked.len(), failed + 1);
        }
        let ids: Vec<u32> = list.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, kept);
    }
}
