//! Blocks: the pieces segments are split into, kept in an arena and linked to their address
//! neighbours so that freeing one can merge it with the free blocks around it.

use super::size_class::PoolKind;
use super::stream_uses::StreamKey;

/// Index of a block in the [`Arena`]; stable while the block exists.
pub(crate) type BlockId = u32;

/// "No block", in the free-list links.
pub(crate) const NIL: BlockId = BlockId::MAX;

/// Where a block is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// In its pool's free list, ready to be handed out on its stream.
    Free,
    /// Held by a caller.
    Allocated,
    /// Freed by its caller but recorded on other streams whose events have not all completed;
    /// neither handed out nor merged until they have.
    Pending,
    /// Freed and parked whole in the [`super::stash::Stash`] for its stream's next request of
    /// its exact size; not merged or listed until it is evicted or the stash is flushed.
    Parked,
}

/// A contiguous piece of one upstream segment.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    /// Device address of the first byte.
    pub ptr: u64,
    /// Bytes in the block (a multiple of the minimum block size).
    pub size: usize,
    /// Bytes the caller asked for, while allocated.
    pub requested: usize,
    /// The stream whose free list the block belongs to: the stream of the segment's allocation.
    pub stream: StreamKey,
    /// The pool the block's segment belongs to.
    pub pool: PoolKind,
    /// Where the block is in its life.
    pub state: BlockState,
    /// The block just below in the same segment.
    pub prev: Option<BlockId>,
    /// The block just above in the same segment.
    pub next: Option<BlockId>,
    /// Small pool: the index of its stream's free lists (see [`super::free_list`]).
    pub slot: u32,
    /// Small pool, while free: the neighbours in its size class's list, or [`NIL`].
    pub free_prev: BlockId,
    /// See `free_prev`.
    pub free_next: BlockId,
}

impl Block {
    /// A new free block covering a whole segment.
    pub fn segment(ptr: u64, size: usize, stream: StreamKey, pool: PoolKind) -> Self {
        Self {
            ptr,
            size,
            requested: 0,
            stream,
            pool,
            state: BlockState::Free,
            prev: None,
            next: None,
            slot: 0,
            free_prev: NIL,
            free_next: NIL,
        }
    }

    /// Whether the block covers its whole segment (it was never split, or has merged back).
    pub fn is_whole_segment(&self) -> bool {
        self.prev.is_none() && self.next.is_none()
    }
}

/// The blocks of every segment, indexed by [`BlockId`]; freed slots are reused, so steady-state
/// splitting and merging allocates no heap memory.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    slots: Vec<Option<Block>>,
    vacant: Vec<BlockId>,
}

impl Arena {
    /// Stores `block` and returns its id.
    pub fn insert(&mut self, block: Block) -> BlockId {
        if let Some(id) = self.vacant.pop() {
            self.slots[id as usize] = Some(block);
            id
        } else {
            let id = BlockId::try_from(self.slots.len())
                .ok()
                .filter(|&id| id != NIL)
                .expect("fewer than 2^32 - 1 live blocks");
            self.slots.push(Some(block));
            id
        }
    }

    /// Removes the block `id` and returns it.
    pub fn remove(&mut self, id: BlockId) -> Block {
        let block = self.slots[id as usize]
            .take()
            .expect("removing a live block");
        self.vacant.push(id);
        block
    }

    /// The block `id`, if it exists.
    pub fn get(&self, id: BlockId) -> Option<&Block> {
        self.slots.get(id as usize).and_then(Option::as_ref)
    }

    /// The live block `id`; ids handed around internally always name live blocks.
    pub fn block(&self, id: BlockId) -> &Block {
        self.get(id).expect("internal block id names a live block")
    }

    /// The live block `id`, mutably.
    pub fn block_mut(&mut self, id: BlockId) -> &mut Block {
        self.slots[id as usize]
            .as_mut()
            .expect("internal block id names a live block")
    }

    /// Every live block with its id.
    pub fn iter(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(id, slot)| slot.as_ref().map(|block| (id as BlockId, block)))
    }

    /// How many blocks are live.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.slots.len() - self.vacant.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_reuses_vacant_slots() {
        let mut arena = Arena::default();
        let key = StreamKey::from_raw(1);
        let a = arena.insert(Block::segment(0x1000, 512, key, PoolKind::Small));
        let b = arena.insert(Block::segment(0x2000, 512, key, PoolKind::Small));
        assert_eq!(arena.len(), 2);
        assert_eq!(arena.remove(a).ptr, 0x1000);
        assert!(arena.get(a).is_none());
        let c = arena.insert(Block::segment(0x3000, 1024, key, PoolKind::Small));
        assert_eq!(c, a, "the vacant slot is reused");
        assert_eq!(arena.block(c).size, 1024);
        assert_eq!(arena.block(b).ptr, 0x2000);
        assert!(arena.block(b).is_whole_segment());
        assert_eq!(arena.iter().count(), 2);
    }
}
