//! The process-wide pinned pool of each context (PyTorch's `CachingHostAllocator`): where
//! [`PinnedBuffer::new`](crate::PinnedBuffer::new) takes its memory.
//!
//! Pinning is slow (tens of milliseconds for 64 MiB), and giving pinned memory back
//! (`cuMemFreeHost`) waits for the whole device while holding the driver's lock, so a temporary
//! pinned buffer freed by the driver would make its drop, and launches on every other thread,
//! wait for whatever the GPU is running. Blocks of this pool go back to it instead, reused once
//! their queued uses have finished. One pool per context, made on first use, with mapped blocks
//! (kernels can reach a `PinnedBuffer` at its device address) and the default cache cap
//! ([`PinnedPoolConfig::DEFAULT_MAX_CACHED_BYTES`]); [`cuweave_driver::empty_process_caches`]
//! trims them all.

use std::sync::Arc;

use cuweave_driver::Context;
use parking_lot::Mutex;

use super::{PinnedPool, PinnedPoolConfig};

/// The pools, by context handle (one per context: a few).
static DEFAULTS: Mutex<Vec<(usize, PinnedPool)>> = Mutex::new(Vec::new());

/// The default pinned pool of `context`, made on first use. It holds the context (so its raw
/// handle, the key, cannot be reused by another context meanwhile); a borrowed context
/// ([`Context::is_borrowed`]) gets a pool of its own instead, kept by nobody but the caller.
pub(crate) fn for_context(context: &Arc<Context>) -> PinnedPool {
    let config = PinnedPoolConfig {
        mapped: true,
        ..PinnedPoolConfig::default()
    };
    if context.is_borrowed() {
        // Not kept: the pool lives only as long as its caller holds it.
        return PinnedPool::with_config(context, config);
    }
    let key = context.as_raw() as usize;
    let mut defaults = DEFAULTS.lock();
    if let Some((_, pool)) = defaults.iter().find(|(known, _)| *known == key) {
        return pool.clone();
    }
    let pool = PinnedPool::with_config(context, config);
    defaults.push((key, pool.clone()));
    drop(defaults);
    cuweave_driver::process_caches::register_process_cache(
        "cuweave-memory: the default pinned pools",
        trim_defaults,
    );
    pool
}

/// Trims every context's default pool; the bytes unpinned.
fn trim_defaults() -> usize {
    let pools: Vec<PinnedPool> = DEFAULTS
        .lock()
        .iter()
        .map(|(_, pool)| pool.clone())
        .collect();
    pools.iter().map(PinnedPool::trim).sum()
}
