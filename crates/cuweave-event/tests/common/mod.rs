//! Helpers shared by the event layer's GPU tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cuweave_driver::{Context, Stream, StreamFlags};

/// `u32` flags in mapped pinned memory that kernels write and the host reads (and opens on
/// drop).
#[allow(unused_imports)] // not every test binary uses it
pub use cuweave_test_support::host_flags::HostFlags as Flags;

pub fn stream(context: &Arc<Context>) -> Arc<Stream> {
    Arc::new(Stream::new(context, StreamFlags::NON_BLOCKING).unwrap())
}

/// Runs `f` on a thread and returns its result, or panics after `limit` (so a hang fails the
/// test instead of stalling the run).
pub fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("did not finish within {limit:?}: hung"))
}

pub const MS: u64 = 1_000_000;

/// Registers a normal-priority kernel operation described as `what`, after `dependencies`.
pub fn register_kernel(
    coordinator: &cuweave_event::OperationCoordinator,
    dependencies: &[cuweave_event::OperationId],
    what: &str,
) -> cuweave_event::OperationId {
    coordinator
        .register_operation(
            cuweave_event::OperationType::Kernel,
            cuweave_event::EventPriority::Normal,
            None,
            dependencies,
            what,
        )
        .unwrap()
}

/// Reads `count` `u32`s of device memory (the streams writing it are idle).
pub fn read_u32s(context: &Arc<Context>, ptr: u64, count: usize) -> Vec<u32> {
    let mut bytes = vec![0u8; count * 4];
    // SAFETY: `count * 4` bytes of a live allocation; the caller's streams are idle.
    unsafe {
        cuweave_driver::memory::copy_dtoh(context, bytes.as_mut_ptr(), ptr, count * 4).unwrap()
    };
    bytes
        .chunks_exact(4)
        .map(|chunk| u32::from_le_bytes(chunk.try_into().unwrap()))
        .collect()
}
