//! The atomics and locks of the transfer layer's lock-free and parking protocols
//! ([`staging`](crate::staging)'s in-order hand-off, the staging workers' residency): `std`'s
//! normally, `loom`'s in tests under `--cfg transfer_loom`, so the same code is model-checked. (A
//! cfg of its own: under the workspace's `--cfg loom` the event layer builds only its CUDA-free
//! core, which this crate cannot build against.)

#[cfg(all(test, transfer_loom))]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
#[cfg(all(test, transfer_loom))]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};

#[cfg(not(all(test, transfer_loom)))]
pub(crate) use std::sync::atomic::{AtomicUsize, Ordering};
#[cfg(not(all(test, transfer_loom)))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};
