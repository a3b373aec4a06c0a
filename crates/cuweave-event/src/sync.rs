//! The synchronisation primitives of the lock-free core: `std`'s normally, `loom`'s under
//! `--cfg loom`, so the same code is model-checked.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(loom)]
pub(crate) use loom::thread;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::thread;

/// Locks `mutex`, ignoring poisoning: the data guarded here (a waker, an error) stays valid
/// even when a holder panicked.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
