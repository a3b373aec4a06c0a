//! [`EventPool`]: reusable CUDA events of one context, timing and non-timing, handed out as RAII handles.
//!
//! The pool's lock-free core is CUDA-free: an append-only `arena` of items addressed by
//! index, a free list of indices with a per-thread fast path (`recycler`), and the per-thread
//! slot protocol it rests on (`owner_slot`, model-checked with loom).

#[cfg(not(loom))]
mod arena;
#[cfg(all(test, loom))]
mod loom_tests;
#[cfg_attr(loom, allow(dead_code))]
mod owner_slot;
#[cfg(not(loom))]
mod pool;
#[cfg(not(loom))]
mod recycler;

#[cfg(not(loom))]
pub use pool::{EventPool, OwnedPooledEvent, PoolCounters, PoolUtilization, PooledEvent};
