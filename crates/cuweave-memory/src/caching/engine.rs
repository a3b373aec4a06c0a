//! [`Engine`]: the caching allocator's algorithm, independent of CUDA: look in the cache, else
//! ask the upstream for a segment; on out-of-memory, empty the cache and retry once; park blocks
//! used on other streams until their markers complete.
//!
//! The upstream and the stream-use markers are traits, so the whole algorithm, out-of-memory
//! retry and pending blocks included, is tested here with fakes; [`super::allocator`] plugs in
//! the real [`MemoryResource`](crate::resource::MemoryResource) and CUDA events.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::block::BlockId;
use super::pool::{Grant, Pools, Segment};
use super::size_class::{round_size, segment_size};
use super::stats::MemoryStats;
use super::stream_uses::{Marker, Pending, StreamKey};
use crate::error::{MemoryError, Result};

/// Gives whole segments back to where they came from.
pub(crate) trait Release {
    /// Returns `segments` to the upstream once no queued work can still use them. On an error
    /// some may not have been returned; the engine has already dropped them from its books.
    fn release_segments(&self, segments: &[Segment]) -> Result<()>;
}

/// Where new segments come from, for one request.
pub(crate) trait Upstream: Release {
    /// A new segment of `bytes` for the requesting stream.
    fn allocate_segment(&self, bytes: usize) -> Result<u64>;
}

/// The allocator's shared state: the pools under one short lock, and the pending blocks.
#[derive(Debug)]
pub(crate) struct Engine<E> {
    pools: Mutex<Pools>,
    /// Blocks freed while recorded on other streams, with the markers they wait for.
    pending: Mutex<Vec<Pending<E>>>,
    /// `pending.len()`, readable without the lock: the hot path skips all polling while it is 0.
    pending_count: AtomicUsize,
    /// Completed markers, for reuse.
    spare: Mutex<Vec<E>>,
}

impl<E> Default for Engine<E> {
    fn default() -> Self {
        Self {
            pools: Mutex::default(),
            pending: Mutex::new(Vec::new()),
            pending_count: AtomicUsize::new(0),
            spare: Mutex::new(Vec::new()),
        }
    }
}

/// The cap a limiting adaptor reported in an out-of-memory error, if any.
fn limit_of(error: &MemoryError) -> Option<usize> {
    match error {
        MemoryError::OutOfMemory { limit, .. } => *limit,
        _ => None,
    }
}

impl<E: Marker> Engine<E> {
    /// Hands out a block of at least `bytes` for `stream`: from the cache when a free block of
    /// that stream fits, else from a new upstream segment; on out-of-memory the cache is emptied
    /// and the upstream asked once more before failing with [`MemoryError::OutOfMemory`].
    #[inline]
    pub fn allocate(
        &self,
        stream: StreamKey,
        bytes: usize,
        upstream: &impl Upstream,
    ) -> Result<Grant> {
        let rounded = round_size(bytes).map_err(|error| match error {
            MemoryError::OutOfMemory { .. } => self.out_of_memory(bytes, None),
            other => other,
        })?;
        if self.pending_count.load(Ordering::Acquire) != 0 {
            self.process_pending();
        }
        if let Some(grant) = self.pools.lock().take_free(stream, rounded, bytes) {
            return Ok(grant);
        }
        self.allocate_from_upstream(stream, rounded, bytes, upstream)
    }

    /// The miss path of [`Self::allocate`]: a new segment, with the out-of-memory retry.
    #[cold]
    #[inline(never)]
    fn allocate_from_upstream(
        &self,
        stream: StreamKey,
        rounded: usize,
        bytes: usize,
        upstream: &impl Upstream,
    ) -> Result<Grant> {
        let Some(segment) = segment_size(rounded) else {
            return Err(self.out_of_memory(rounded, None));
        };
        let first = match upstream.allocate_segment(segment) {
            Ok(ptr) => return Ok(self.add_segment(stream, ptr, segment, rounded, bytes)),
            Err(error) if error.is_out_of_memory() => error,
            Err(error) => return Err(error),
        };
        tracing::info!(
            requested = rounded,
            segment,
            error = %first,
            "caching allocator: upstream out of memory; releasing cached blocks and retrying"
        );
        self.pools.lock().stats_mut().oom_retries += 1;
        self.release_cached(upstream)?;
        if let Some(grant) = self.pools.lock().take_free(stream, rounded, bytes) {
            return Ok(grant);
        }
        match upstream.allocate_segment(segment) {
            Ok(ptr) => Ok(self.add_segment(stream, ptr, segment, rounded, bytes)),
            Err(error) if error.is_out_of_memory() => {
                let limit = limit_of(&error).or(limit_of(&first));
                let error = self.out_of_memory(rounded, limit);
                tracing::warn!(%error, "caching allocator: out of memory after retry");
                Err(error)
            }
            Err(error) => Err(error),
        }
    }

    fn add_segment(
        &self,
        stream: StreamKey,
        ptr: u64,
        segment: usize,
        rounded: usize,
        bytes: usize,
    ) -> Grant {
        tracing::debug!(
            segment,
            requested = bytes,
            "caching allocator: new segment from upstream"
        );
        self.pools
            .lock()
            .add_segment(stream, ptr, segment, rounded, bytes)
    }

    /// Counts an out-of-memory failure and describes it with the current totals.
    #[cold]
    fn out_of_memory(&self, requested: usize, limit: Option<usize>) -> MemoryError {
        let mut pools = self.pools.lock();
        let stats = pools.stats_mut();
        stats.ooms += 1;
        MemoryError::OutOfMemory {
            requested,
            allocated: stats.allocated_bytes.current,
            reserved: stats.reserved_bytes.current,
            limit,
        }
    }

    /// Returns an allocated block, not used on any other stream, to its stream's free list.
    #[inline]
    pub fn free(&self, id: BlockId, ptr: u64) -> Result<()> {
        self.pools.lock().free(id, ptr)
    }

    /// Frees an allocated block that waits for `markers` (recorded on the other streams it was
    /// used on) before it can be handed out again.
    pub fn free_after(&self, id: BlockId, ptr: u64, markers: Vec<E>) -> Result<()> {
        let mut pools = self.pools.lock();
        pools.free_to_pending(id, ptr)?;
        if markers.is_empty() {
            pools.release_pending(id);
            return Ok(());
        }
        drop(pools);
        let mut pending = self.pending.lock();
        pending.push(Pending { block: id, markers });
        self.pending_count.store(pending.len(), Ordering::Release);
        Ok(())
    }

    /// Frees an allocated block that must never be handed out again (its other-stream uses could
    /// not be tracked): it stays pending, and its segment is never released.
    pub fn free_never_reuse(&self, id: BlockId, ptr: u64) -> Result<()> {
        self.pools.lock().free_to_pending(id, ptr)
    }

    /// Returns to their free lists the pending blocks whose markers have all completed, without
    /// blocking; skipped when another thread is already doing it.
    pub fn process_pending(&self) {
        let Some(mut pending) = self.pending.try_lock() else {
            return;
        };
        let mut spare = Vec::new();
        let mut ready = Vec::new();
        let mut index = 0;
        while index < pending.len() {
            if pending[index].poll(&mut spare) {
                ready.push(pending.swap_remove(index).block);
            } else {
                index += 1;
            }
        }
        self.pending_count.store(pending.len(), Ordering::Release);
        drop(pending);
        self.recycle(spare);
        if !ready.is_empty() {
            let mut pools = self.pools.lock();
            for id in ready {
                pools.release_pending(id);
            }
        }
    }

    /// Waits for every pending block's markers and returns the blocks to their free lists.
    ///
    /// A block whose marker cannot be waited for stays pending for good (never reused).
    fn wait_pending(&self) -> Result<()> {
        let taken = {
            let mut pending = self.pending.lock();
            self.pending_count.store(0, Ordering::Release);
            std::mem::take(&mut *pending)
        };
        if taken.is_empty() {
            return Ok(());
        }
        let mut first_error = None;
        let mut spare = Vec::new();
        let mut ready = Vec::new();
        for entry in taken {
            match entry.markers.iter().try_for_each(Marker::wait) {
                Ok(()) => {
                    spare.extend(entry.markers);
                    ready.push(entry.block);
                }
                Err(error) => {
                    tracing::error!(%error, "waiting for a block's stream use failed; the block is never reused");
                    first_error.get_or_insert(error);
                }
            }
        }
        self.recycle(spare);
        let mut pools = self.pools.lock();
        for id in ready {
            pools.release_pending(id);
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Waits for pending blocks, then gives every free whole segment back through `release`;
    /// returns the bytes given back.
    pub fn release_cached(&self, release: &impl Release) -> Result<usize> {
        let waited = self.wait_pending();
        let segments = self.pools.lock().take_free_segments();
        let bytes = segments.iter().map(|segment| segment.size).sum();
        let released = if segments.is_empty() {
            Ok(())
        } else {
            tracing::info!(
                segments = segments.len(),
                bytes,
                "caching allocator: releasing cached segments"
            );
            release.release_segments(&segments)
        };
        waited.and(released).map(|()| bytes)
    }

    /// Up to `count` spare markers, for recording new stream uses.
    pub fn take_spare(&self, count: usize) -> Vec<E> {
        let mut spare = self.spare.lock();
        let keep = spare.len().saturating_sub(count);
        spare.split_off(keep)
    }

    /// Keeps `markers` (completed, or not used) for reuse.
    pub fn recycle(&self, markers: Vec<E>) {
        if !markers.is_empty() {
            self.spare.lock().extend(markers);
        }
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> MemoryStats {
        *self.pools.lock().stats()
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak(&self) {
        self.pools.lock().stats_mut().reset_peak();
    }

    /// Blocks that were freed but wait for other streams.
    pub fn pending_blocks(&self) -> usize {
        self.pending_count.load(Ordering::Acquire)
    }

    #[cfg(test)]
    pub fn check_invariants(&self) {
        self.pools.lock().check_invariants();
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
