//! [`EventPool`]: reusable CUDA events of one context (timing, non-timing and blocking-sync),
//! handed out as RAII handles; every layer of cuweave takes its events from it.
//!
//! The pool's lock-free core is CUDA-free: an append-only `arena` of items addressed by
//! index, a free list of indices with a per-thread fast path (`recycler`), and the per-thread
//! slot protocol it rests on (`owner_slot`, model-checked with loom).

mod arena;
#[cfg(all(test, loom))]
mod loom_tests;
mod owner_slot;
mod pool;
mod recycler;

pub use pool::{EventPool, OwnedPooledEvent, PoolCounters, PoolUtilization, PooledEvent};
