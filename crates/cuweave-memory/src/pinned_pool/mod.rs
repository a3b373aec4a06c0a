//! pinned_pool (in progress).
