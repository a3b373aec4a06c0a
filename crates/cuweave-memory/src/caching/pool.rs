//! [`Pools`]: the free lists of the small and large pools, best fit per stream, splitting on
//! allocation and merging with free neighbours on free; and the statistics that go with them.
//!
//! Pure bookkeeping on addresses: no driver calls, so it is tested without a GPU and runs under
//! the allocator's one short lock.

use super::block::{Arena, Block, BlockId, BlockState};
use super::free_list::FreeLists;
use super::graph_pool::graph_pool_of_key;
use super::size_class::PoolKind;
use super::snapshot::{BlockSnapshot, BlockStatus, SegmentSnapshot};
use super::stash::Stash;
use super::stats::MemoryStats;
use super::stream_uses::StreamKey;
use crate::error::{MemoryError, Result};

/// A block handed to a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    /// The block, to give back on free.
    pub id: BlockId,
    /// Its device address.
    pub ptr: u64,
    /// Its size in bytes (at least the rounded request).
    pub size: usize,
    /// The stream it was allocated for (which also names its shard).
    pub stream: StreamKey,
}

/// A whole segment taken out of the pools, to be returned to the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    /// The address the upstream returned.
    pub ptr: u64,
    /// The size it was asked for.
    pub size: usize,
    /// The stream the segment was allocated for.
    pub stream: StreamKey,
}

/// Every block of every segment, the free lists, and the statistics.
#[derive(Debug, Default)]
pub(crate) struct Pools {
    arena: Arena,
    free: FreeLists,
    stash: Stash,
    stats: MemoryStats,
}

impl Pools {
    /// Sets the size from which large blocks are never split ([`FreeLists::set_max_split`]).
    pub fn set_max_split(&mut self, bytes: usize) {
        self.free.set_max_split(bytes);
    }

    /// The statistics.
    pub fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    /// The statistics, mutably (for the counters the pools do not keep themselves).
    pub fn stats_mut(&mut self) -> &mut MemoryStats {
        &mut self.stats
    }

    fn insert_free(&mut self, id: BlockId) {
        self.free.insert(&mut self.arena, id);
    }

    fn remove_free(&mut self, id: BlockId) {
        self.free.remove(&mut self.arena, id);
    }

    /// Hands out a cached block of `stream` for `rounded` bytes, if there is one: a parked
    /// block of exactly that size first, else the best-fitting free block. When neither fits,
    /// the parked blocks are merged back into the free lists and best fit is tried once more,
    /// so parking never sends a request to the upstream that merged blocks could have served.
    #[inline]
    pub fn take_free(
        &mut self,
        stream: StreamKey,
        rounded: usize,
        requested: usize,
    ) -> Option<Grant> {
        if let Some(id) = self.stash.take(stream, rounded) {
            self.stats.cache_hits += 1;
            return Some(self.hand_out(id, requested));
        }
        let id = match self.free.take_best_fit(&mut self.arena, stream, rounded) {
            Some(id) => id,
            None if self.stash.len() != 0 => {
                self.flush_stash();
                self.free.take_best_fit(&mut self.arena, stream, rounded)?
            }
            None => return None,
        };
        self.stats.cache_hits += 1;
        Some(self.carve(id, rounded, requested))
    }

    /// Merges every parked block back into the free lists.
    pub fn flush_stash(&mut self) {
        for id in self.stash.drain() {
            self.merge_and_insert(id);
        }
    }

    /// Adds a segment just obtained from the upstream for `stream` and hands out its first
    /// `rounded` bytes.
    pub fn add_segment(
        &mut self,
        stream: StreamKey,
        ptr: u64,
        segment_size: usize,
        rounded: usize,
        requested: usize,
    ) -> Grant {
        let id = self.insert_segment(stream, ptr, segment_size, PoolKind::for_size(rounded));
        self.stats.cache_misses += 1;
        self.carve(id, rounded, requested)
    }

    /// Books a whole segment of `pool` for `stream` (allocated until carved).
    fn insert_segment(
        &mut self,
        stream: StreamKey,
        ptr: u64,
        segment_size: usize,
        pool: PoolKind,
    ) -> BlockId {
        let mut block = Block::segment(ptr, segment_size, stream, pool);
        if pool == PoolKind::Small {
            block.slot = self.free.acquire_slot(stream);
        }
        let id = self.arena.insert(block);
        self.stats.reserved_bytes.add(segment_size);
        self.stats.segments.add(1);
        id
    }

    /// Adopts for `stream` a whole segment of the pool kind `rounded` needs that was taken off
    /// another key ([`take_segment_to_move`](Self::take_segment_to_move)), and hands out its
    /// first `rounded` bytes: served from the cache, so counted as a hit, not a miss.
    pub fn adopt_segment(
        &mut self,
        stream: StreamKey,
        segment: Segment,
        rounded: usize,
        requested: usize,
    ) -> Grant {
        let id = self.insert_segment(
            stream,
            segment.ptr,
            segment.size,
            PoolKind::for_size(rounded),
        );
        self.stats.cache_hits += 1;
        self.carve(id, rounded, requested)
    }

    /// Adopts for `stream`, as a free block of its `pool` lists, a whole segment taken off
    /// another key ([`take_segments_to_move`](Self::take_segments_to_move)): for when every use
    /// of it is known finished, so any stream may carve it.
    pub fn adopt_free_segment(&mut self, stream: StreamKey, segment: Segment, pool: PoolKind) {
        let id = self.insert_segment(stream, segment.ptr, segment.size, pool);
        self.insert_free(id);
    }

    /// Which of the streams `pick` accepts have any block here (one pass over the blocks).
    pub fn streams_with_segments(
        &self,
        pick: impl Fn(StreamKey) -> bool,
    ) -> std::collections::HashSet<StreamKey> {
        self.arena
            .iter()
            .map(|(_, block)| block.stream)
            .filter(|&stream| pick(stream))
            .collect()
    }

    /// The free whole segments (parked blocks merged first) of the stream keys `pick` accepts,
    /// left in place, with their pool kinds.
    pub fn whole_free_segments(
        &mut self,
        pick: impl Fn(StreamKey) -> bool,
    ) -> Vec<(Segment, PoolKind)> {
        self.flush_stash();
        self.arena
            .iter()
            .filter(|(_, block)| {
                block.state == BlockState::Free && block.is_whole_segment() && pick(block.stream)
            })
            .map(|(_, block)| {
                let segment = Segment {
                    ptr: block.ptr,
                    size: block.size,
                    stream: block.stream,
                };
                (segment, block.pool)
            })
            .collect()
    }

    /// Takes `segment` out of the pools, to be adopted by another key, if it is still a free
    /// whole segment of the same key and size (not counted as released: it stays reserved).
    pub fn take_segment_to_move(&mut self, segment: Segment) -> Option<Segment> {
        self.flush_stash();
        let id = self
            .arena
            .iter()
            .find(|(_, block)| {
                block.ptr == segment.ptr
                    && block.size == segment.size
                    && block.stream == segment.stream
                    && block.state == BlockState::Free
                    && block.is_whole_segment()
            })
            .map(|(id, _)| id)?;
        self.remove_free(id);
        let block = self.arena.remove(id);
        if block.pool == PoolKind::Small {
            self.free.release_slot(block.stream, block.slot);
        }
        self.stats.reserved_bytes.sub(block.size);
        self.stats.segments.sub(1);
        Some(segment)
    }

    /// Marks block `id` (out of its free list) allocated for `rounded` bytes, splitting the
    /// remainder off into a free block when it is worth keeping.
    fn carve(&mut self, id: BlockId, rounded: usize, requested: usize) -> Grant {
        let block = self.arena.block(id);
        let remaining = block.size - rounded;
        // A request of at least `max_split` takes its block whole (PyTorch's oversize blocks).
        if block.pool.should_split(remaining)
            && (block.pool == PoolKind::Small || rounded < self.free.max_split())
        {
            let rest = Block {
                prev: Some(id),
                next: block.next,
                slot: block.slot,
                ..Block::segment(
                    block.ptr + rounded as u64,
                    remaining,
                    block.stream,
                    block.pool,
                )
            };
            let rest_id = self.arena.insert(rest);
            if let Some(next) = self.arena.block(rest_id).next {
                self.arena.block_mut(next).prev = Some(rest_id);
            }
            let block = self.arena.block_mut(id);
            block.next = Some(rest_id);
            block.size = rounded;
            self.insert_free(rest_id);
        }
        self.hand_out(id, requested)
    }

    /// Marks block `id` (out of every free list and the stash) allocated to a caller.
    #[inline]
    fn hand_out(&mut self, id: BlockId, requested: usize) -> Grant {
        let block = self.arena.block_mut(id);
        block.state = BlockState::Allocated;
        block.requested = requested;
        let grant = Grant {
            id,
            ptr: block.ptr,
            size: block.size,
            stream: block.stream,
        };
        self.stats.allocations += 1;
        self.stats.allocated_bytes.add(grant.size);
        self.stats.requested_bytes.add(requested);
        self.stats.active_bytes.add(grant.size);
        grant
    }

    /// The allocated block `id`, checked against the address its holder knows it by.
    #[inline]
    fn allocated(&self, id: BlockId, ptr: u64, operation: &'static str) -> Result<&Block> {
        match self.arena.get(id) {
            Some(block) if block.ptr == ptr && block.state == BlockState::Allocated => Ok(block),
            _ => Err(MemoryError::UnknownAllocation { operation, ptr }),
        }
    }

    #[inline]
    fn count_free(&mut self, id: BlockId) {
        let block = self.arena.block(id);
        let (size, requested) = (block.size, block.requested);
        self.stats.frees += 1;
        self.stats.allocated_bytes.sub(size);
        self.stats.requested_bytes.sub(requested);
    }

    /// Returns the allocated block `id` to its stream's cache: parked whole for the next request
    /// of its size (the block it evicts, if any, is merged into the free lists).
    #[inline]
    pub fn free(&mut self, id: BlockId, ptr: u64) -> Result<()> {
        let size = self.allocated(id, ptr, "CachingAllocator::free")?.size;
        self.count_free(id);
        self.stats.active_bytes.sub(size);
        let block = self.arena.block_mut(id);
        block.state = BlockState::Parked;
        block.requested = 0;
        let stream = block.stream;
        if let Some(evicted) = self.stash.park(stream, size, id) {
            self.merge_and_insert(evicted);
        }
        Ok(())
    }

    /// Marks the allocated block `id` freed by its holder but still in use on other streams.
    pub fn free_to_pending(&mut self, id: BlockId, ptr: u64) -> Result<()> {
        self.allocated(id, ptr, "CachingAllocator::free")?;
        self.count_free(id);
        let block = self.arena.block_mut(id);
        block.state = BlockState::Pending;
        block.requested = 0;
        Ok(())
    }

    /// Returns a pending block, whose other-stream uses have all passed, to its free list.
    pub fn release_pending(&mut self, id: BlockId) {
        let block = self.arena.block(id);
        debug_assert_eq!(block.state, BlockState::Pending);
        self.stats.active_bytes.sub(block.size);
        self.merge_and_insert(id);
    }

    fn merge_and_insert(&mut self, id: BlockId) {
        let block = self.arena.block_mut(id);
        block.state = BlockState::Free;
        block.requested = 0;
        let (prev, next) = (block.prev, block.next);
        if let Some(prev) = prev {
            self.try_merge(id, prev);
        }
        if let Some(next) = next {
            self.try_merge(id, next);
        }
        self.insert_free(id);
    }

    /// Absorbs the neighbour `other` of `id` into `id` if it is free.
    fn try_merge(&mut self, id: BlockId, other: BlockId) {
        if self.arena.block(other).state != BlockState::Free {
            return;
        }
        self.remove_free(other);
        let other_block = self.arena.remove(other);
        let block = self.arena.block_mut(id);
        block.size += other_block.size;
        if block.prev == Some(other) {
            block.ptr = other_block.ptr;
            block.prev = other_block.prev;
            if let Some(before) = other_block.prev {
                self.arena.block_mut(before).next = Some(id);
            }
        } else {
            block.next = other_block.next;
            if let Some(after) = other_block.next {
                self.arena.block_mut(after).prev = Some(id);
            }
        }
    }

    /// Takes every free whole segment out of the pools, for return to the upstream, except those
    /// of graph pools that are still alive.
    pub fn take_free_segments(&mut self) -> Vec<Segment> {
        self.take_whole_segments(|stream| !super::graph_pool::is_retained(stream))
    }

    /// Takes every free whole segment of a stream key `take` accepts out of the pools, to be
    /// returned to the upstream (counted as released).
    pub fn take_whole_segments(&mut self, take: impl Fn(StreamKey) -> bool) -> Vec<Segment> {
        let taken = self.take_whole(take);
        self.stats.segments_released += taken.len() as u64;
        taken.into_iter().map(|(segment, _)| segment).collect()
    }

    /// Takes every free whole segment of the streams `streams` accepts out of the pools, with
    /// its pool kind, to be
    /// adopted by another key ([`adopt_free_segment`](Self::adopt_free_segment)); not counted
    /// as released: they stay reserved.
    pub fn take_segments_to_move(
        &mut self,
        streams: impl Fn(StreamKey) -> bool,
    ) -> Vec<(Segment, PoolKind)> {
        self.take_whole(streams)
    }

    fn take_whole(&mut self, take: impl Fn(StreamKey) -> bool) -> Vec<(Segment, PoolKind)> {
        self.flush_stash();
        let whole: Vec<BlockId> = self
            .arena
            .iter()
            .filter(|(_, block)| {
                block.state == BlockState::Free && block.is_whole_segment() && take(block.stream)
            })
            .map(|(id, _)| id)
            .collect();
        let mut segments = Vec::with_capacity(whole.len());
        for id in whole {
            self.remove_free(id);
            let block = self.arena.remove(id);
            if block.pool == PoolKind::Small {
                self.free.release_slot(block.stream, block.slot);
            }
            self.stats.reserved_bytes.sub(block.size);
            self.stats.segments.sub(1);
            let segment = Segment {
                ptr: block.ptr,
                size: block.size,
                stream: block.stream,
            };
            segments.push((segment, block.pool));
        }
        segments
    }

    /// Each segment with its blocks in address order, appended to `out` (in no order).
    pub fn snapshot_segments(&self, out: &mut Vec<SegmentSnapshot>) {
        for (first, block) in self.arena.iter() {
            if block.prev.is_some() {
                continue;
            }
            let mut blocks = Vec::new();
            let mut next = Some(first);
            while let Some(id) = next {
                let block = self.arena.block(id);
                let status = match block.state {
                    BlockState::Allocated => BlockStatus::Allocated,
                    BlockState::Pending => BlockStatus::PendingFree,
                    BlockState::Free | BlockState::Parked => BlockStatus::Free,
                };
                blocks.push(BlockSnapshot {
                    address: block.ptr,
                    size: block.size,
                    requested_size: if status == BlockStatus::Allocated {
                        block.requested
                    } else {
                        0
                    },
                    status,
                });
                next = block.next;
            }
            out.push(SegmentSnapshot {
                address: block.ptr,
                total_size: blocks.iter().map(|block| block.size).sum(),
                stream: block.stream,
                pool: block.pool,
                graph_pool: graph_pool_of_key(block.stream),
                blocks,
            });
        }
    }

    /// How many blocks are in free lists.
    #[cfg(test)]
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Checks every structural invariant; the randomized tests call it after each step.
    #[cfg(test)]
    pub fn check_invariants(&self) {
        let mut reserved = 0;
        let mut segments = 0;
        let mut allocated = 0;
        let mut active = 0;
        for (id, block) in self.arena.iter() {
            assert_eq!(block.size % super::size_class::MIN_BLOCK_SIZE, 0);
            if let Some(next) = block.next {
                let next_block = self.arena.block(next);
                assert_eq!(next_block.prev, Some(id), "links are symmetric");
                assert_eq!(block.ptr + block.size as u64, next_block.ptr, "contiguous");
                assert_eq!(block.stream, next_block.stream);
                assert!(
                    !(block.state == BlockState::Free && next_block.state == BlockState::Free),
                    "free neighbours are merged (parked blocks wait in the stash)"
                );
            }
            if block.prev.is_none() {
                segments += 1;
                let mut cursor = Some(id);
                while let Some(current) = cursor {
                    reserved += self.arena.block(current).size;
                    cursor = self.arena.block(current).next;
                }
            }
            let listed = block.state == BlockState::Free && self.free.contains(&self.arena, id);
            match block.state {
                BlockState::Free => assert!(listed, "free blocks are listed"),
                BlockState::Allocated => {
                    allocated += block.size;
                    active += block.size;
                }
                BlockState::Pending => {
                    active += block.size;
                }
                BlockState::Parked => {
                    assert!(self.stash.contains(id), "parked blocks are in the stash");
                }
            }
        }
        assert_eq!(
            self.free_blocks(),
            self.arena
                .iter()
                .filter(|(_, b)| b.state == BlockState::Free)
                .count()
        );
        assert_eq!(
            self.stash.len(),
            self.arena
                .iter()
                .filter(|(_, b)| b.state == BlockState::Parked)
                .count()
        );
        assert_eq!(self.stats.reserved_bytes.current, reserved);
        assert_eq!(self.stats.segments.current, segments);
        assert_eq!(self.stats.allocated_bytes.current, allocated);
        assert_eq!(self.stats.active_bytes.current, active);
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
