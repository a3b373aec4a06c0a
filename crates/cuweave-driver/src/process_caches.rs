//! One call that empties every process-wide cache of driver memory.
//!
//! Layers above keep process-wide caches that hold driver memory on purpose, for the life of the
//! process (the memory layer's default caching allocator of each device, like PyTorch's
//! `CUDACachingAllocator`). Each registers here a function that returns its cached, unused
//! memory to the driver; [`empty_process_caches`] calls them all. A program calls it before it
//! hands the GPU's memory to other code; a leak checker needs it at exit, since memory a cache
//! still holds when the process ends is reported as leaked (compute-sanitizer's
//! `--leak-check full`): set `CUWEAVE_EMPTY_CACHES_AT_EXIT=1` (the GPU test bundle's `--sanitize`
//! mode does), and the caches are emptied when the process exits, as
//! `PYTORCH_NO_CUDA_MEMORY_CACHING` lets compute-sanitizer see PyTorch's frees.
//!
//! Memory still in use (a live buffer, a block whose queued work has not finished and whose
//! wait fails) is never released by this.

use std::sync::Once;

use parking_lot::Mutex;

/// A cache's emptier: returns the bytes it gave back to the driver (errors are its to log).
pub type EmptyCache = fn() -> usize;

/// The environment variable that empties the process-wide caches at exit.
pub const EMPTY_AT_EXIT_VAR: &str = "CUWEAVE_EMPTY_CACHES_AT_EXIT";

/// Registered caches by name: a few, one per kind of process-wide cache.
static CACHES: Mutex<Vec<(&'static str, EmptyCache)>> = Mutex::new(Vec::new());

/// Registers a process-wide cache under `name`; a name registered before keeps its first
/// emptier. With `CUWEAVE_EMPTY_CACHES_AT_EXIT` set (to anything but `0`), the first
/// registration also arranges [`empty_process_caches`] to run at exit.
pub fn register_process_cache(name: &'static str, empty: EmptyCache) {
    {
        let mut caches = CACHES.lock();
        if caches.iter().any(|(known, _)| *known == name) {
            return;
        }
        caches.push((name, empty));
    }
    if std::env::var_os(EMPTY_AT_EXIT_VAR).is_some_and(|value| value != "0") {
        empty_process_caches_at_exit();
    }
}

/// The names of the caches registered so far.
pub fn process_cache_names() -> Vec<&'static str> {
    CACHES.lock().iter().map(|(name, _)| *name).collect()
}

/// Empties every registered process-wide cache; returns the bytes given back to the driver.
/// Each cache waits for the queued work of the blocks it frees, as its own `empty_cache` does.
///
/// While any stream capture is running in the process this empties nothing and returns 0:
/// freeing waits for the device, which would break the capture.
pub fn empty_process_caches() -> usize {
    if crate::graph::active_captures() > 0 {
        tracing::debug!("a stream capture is running: the process caches are not emptied");
        return 0;
    }
    // Copied out, so an emptier may register another cache without deadlocking.
    let caches: Vec<EmptyCache> = CACHES.lock().iter().map(|(_, empty)| *empty).collect();
    caches.into_iter().map(|empty| empty()).sum()
}

/// Arranges [`empty_process_caches`] to run when the process exits normally (`exit`, or
/// returning from `main`), once however often this is called. An emptier that panics there is
/// contained: the process exits as it would have.
pub fn empty_process_caches_at_exit() {
    static REGISTERED: Once = Once::new();
    REGISTERED.call_once(|| {
        // SAFETY: `atexit` takes a plain C function with no arguments, which `at_exit` is; it
        // never unwinds (every panic is caught inside it).
        let status = unsafe { atexit(at_exit) };
        if status != 0 {
            tracing::warn!(
                status,
                "atexit refused: the process caches are not emptied at exit"
            );
        }
    });
}

extern "C" fn at_exit() {
    let released = std::panic::catch_unwind(empty_process_caches);
    if let Ok(bytes) = released {
        tracing::debug!(bytes, "process caches emptied at exit");
    }
}

unsafe extern "C" {
    /// The C library's `atexit` (glibc, musl, macOS libSystem, the Windows CRT).
    fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static EMPTIED: AtomicUsize = AtomicUsize::new(0);

    fn test_cache() -> usize {
        EMPTIED.fetch_add(1, Ordering::SeqCst);
        4096
    }

    fn other_cache() -> usize {
        EMPTIED.fetch_add(100, Ordering::SeqCst);
        0
    }

    #[test]
    fn registered_caches_are_emptied_once_per_call_and_names_are_unique() {
        // The capture tests raise the process's capture count by hand, which makes this empty
        // nothing: hold them off.
        let _count = crate::graph::CAPTURE_COUNT_TEST_LOCK.lock();
        register_process_cache("process_caches test", test_cache);
        register_process_cache("process_caches test", other_cache);
        let names = process_cache_names();
        assert_eq!(
            names
                .iter()
                .filter(|name| **name == "process_caches test")
                .count(),
            1
        );
        let before = EMPTIED.load(Ordering::SeqCst);
        assert!(empty_process_caches() >= 4096);
        assert_eq!(EMPTIED.load(Ordering::SeqCst) - before, 1);
    }
}
