//! [`MemorySnapshot`]: every segment a [`CachingAllocator`](super::CachingAllocator) holds and
//! the blocks it is split into, at one instant (PyTorch's `torch.cuda.memory_snapshot()`), for
//! finding fragmentation and what holds memory.

use std::fmt;

use super::graph_pool::GraphPoolId;
use super::size_class::PoolKind;
use super::stream_uses::StreamKey;

/// Where a block of a segment is in its life (PyTorch's block states).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockStatus {
    /// Held by a buffer or allocation (`active_allocated`).
    Allocated,
    /// Freed, but recorded on other streams whose work has not all finished: neither handed out
    /// nor merged until it has (`active_pending_free`).
    PendingFree,
    /// Cached, free for the next request on its stream (`inactive`), including a block kept
    /// whole for its stream's next request of exactly its size.
    Free,
}

/// One block of a [`SegmentSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockSnapshot {
    /// The device address of its first byte.
    pub address: u64,
    /// Its bytes (the request rounded up, or what is left of a split).
    pub size: usize,
    /// The bytes its holder asked for, while [`Allocated`](BlockStatus::Allocated); 0 otherwise.
    pub requested_size: usize,
    /// Where it is in its life.
    pub status: BlockStatus,
}

/// One segment (one allocation from the upstream resource) and its blocks, in address order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentSnapshot {
    /// The address the upstream returned.
    pub address: u64,
    /// Its bytes.
    pub total_size: usize,
    /// The stream whose free lists it belongs to.
    pub stream: StreamKey,
    /// The small or the large pool.
    pub pool: PoolKind,
    /// The private pool it belongs to, for a segment of a capture's graph pool.
    pub graph_pool: Option<GraphPoolId>,
    /// Its blocks, in address order; their sizes add up to `total_size`.
    pub blocks: Vec<BlockSnapshot>,
}

impl SegmentSnapshot {
    /// The bytes of its blocks in `status`.
    pub fn bytes(&self, status: BlockStatus) -> usize {
        self.blocks
            .iter()
            .filter(|block| block.status == status)
            .map(|block| block.size)
            .sum()
    }

    /// The bytes of its allocated blocks.
    pub fn allocated_size(&self) -> usize {
        self.bytes(BlockStatus::Allocated)
    }
}

/// Every segment of a caching allocator and the blocks each is split into, taken with every
/// shard locked, so it is one consistent instant; from
/// [`CachingAllocator::snapshot`](super::CachingAllocator::snapshot). Segments are in address
/// order. Its `Display` is a summary in the manner of `torch.cuda.memory_summary()`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// The segments, in address order.
    pub segments: Vec<SegmentSnapshot>,
}

impl MemorySnapshot {
    /// The bytes of all segments (the allocator's reserved bytes at that instant).
    pub fn reserved_bytes(&self) -> usize {
        self.segments.iter().map(|segment| segment.total_size).sum()
    }

    /// The bytes of blocks in `status`, over all segments.
    pub fn bytes(&self, status: BlockStatus) -> usize {
        self.segments
            .iter()
            .map(|segment| segment.bytes(status))
            .sum()
    }

    /// The largest free block: the biggest request served without a new segment (on that
    /// block's stream).
    pub fn largest_free_block(&self) -> usize {
        self.segments
            .iter()
            .flat_map(|segment| &segment.blocks)
            .filter(|block| block.status == BlockStatus::Free)
            .map(|block| block.size)
            .max()
            .unwrap_or(0)
    }

    /// How many segments are partly allocated and partly free: the fragmentation that keeps
    /// `empty_cache` from returning them.
    pub fn split_segments(&self) -> usize {
        self.segments
            .iter()
            .filter(|segment| {
                let free = segment.bytes(BlockStatus::Free);
                free != 0 && free != segment.total_size
            })
            .count()
    }
}

impl fmt::Display for MemorySnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let blocks: usize = self
            .segments
            .iter()
            .map(|segment| segment.blocks.len())
            .sum();
        writeln!(
            f,
            "{} segments, {blocks} blocks: reserved {} bytes, allocated {}, pending free {}, free {} (largest free block {}, {} split segments)",
            self.segments.len(),
            self.reserved_bytes(),
            self.bytes(BlockStatus::Allocated),
            self.bytes(BlockStatus::PendingFree),
            self.bytes(BlockStatus::Free),
            self.largest_free_block(),
            self.split_segments(),
        )?;
        for segment in &self.segments {
            write!(
                f,
                "{:#x} {:?} {} bytes, stream key {:#x}",
                segment.address,
                segment.pool,
                segment.total_size,
                segment.stream.as_usize(),
            )?;
            if let Some(pool) = segment.graph_pool {
                write!(f, ", {pool}")?;
            }
            write!(f, ":")?;
            for block in &segment.blocks {
                let status = match block.status {
                    BlockStatus::Allocated => "allocated",
                    BlockStatus::PendingFree => "pending",
                    BlockStatus::Free => "free",
                };
                write!(f, " [{} {status}]", block.size)?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
