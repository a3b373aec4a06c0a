//! [`World`]: which NCCL communicator a rank belongs to, as far as this process can tell.

use crate::id::UniqueId;

/// Names the NCCL communicator (the set of ranks) a [`Communicator`] is one rank of, as far as
/// this process can tell. Two ranks with equal worlds are ranks of one communicator; unequal
/// or unknown worlds say nothing (so checks built on them only ever refuse what they know).
///
/// [`Communicator`]: super::Communicator
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum World {
    /// Made together in this process (`init_all`, or children of one color of one
    /// `split_all`): a number no other world of the process has.
    Local(u64),
    /// Joined through a [`UniqueId`] (`init_rank`): a digest of its bytes (ranks of this
    /// process that joined with the same id are ranks of one communicator).
    Id(u64),
}

impl World {
    /// A world no other of this process has.
    pub(crate) fn fresh() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self::Local(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// The world of ranks that join with `id`.
    pub(crate) fn of_id(id: &UniqueId) -> Self {
        use std::hash::{Hash, Hasher};
        // Fixed keys: equal ids give equal digests on every thread.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        id.as_bytes().hash(&mut hasher);
        Self::Id(hasher.finish())
    }
}
