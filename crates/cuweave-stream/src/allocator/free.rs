//! Freeing: [`StreamOrderedAllocator::free`] and [`StreamOrderedAllocator::free_for_stream`]
//! queue each free on its owner after the streams it was given to, refuse one a capture would
//! record, and put an allocation back on the books when its free was not queued; a dropped
//! allocator frees what is still held.

use cuweave_driver::DriverError;
use cuweave_driver::graph::GraphError;
use cuweave_memory::MemoryResource;

use super::{Entry, StreamAllocation, StreamOrderedAllocator};
use crate::error::{Result, StreamError};
use crate::stream::{OperationKind, PriorityStream};

impl StreamOrderedAllocator {
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
