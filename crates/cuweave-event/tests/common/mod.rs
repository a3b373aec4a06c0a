//! Helpers shared by the event layer's GPU tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cuweave_driver::memory::{HostAllocFlags, HostAllocation};
use cuweave_driver::{Context, Stream, StreamFlags};

/// `u32` flags in mapped pinned memory: kernels write them through `device(i)`, the host reads
/// them with volatile loads while kernels may still run.
pub struct Flags {
    memory: HostAllocation,
    len: usize,
    device: u64,
}

impl Flags {
    pub fn new(context: &Arc<Context>, len: usize) -> Self {
        let mut memory =
            HostAllocation::new(context, len * 4, HostAllocFlags::PORTABLE_MAPPED).unwrap();
        memory.as_bytes_mut().fill(0);
        let device = memory.device_ptr().unwrap();
        Self {
            memory,
            len,
            device,
        }
    }

    pub fn device(&self, index: usize) -> u64 {
        assert!(index < self.len);
        self.device + 4 * index as u64
    }

    pub fn read(&self, index: usize) -> u32 {
        assert!(index < self.len);
        // SAFETY: in bounds of a live, 4-byte-aligned allocation; a volatile read of a word a
        // kernel may be storing to concurrently (aligned 32-bit stores do not tear).
        unsafe { std::ptr::read_volatile(self.memory.as_ptr().cast::<u32>().add(index)) }
    }

    pub fn write(&self, index: usize, value: u32) {
        assert!(index < self.len);
        // SAFETY: as `read`; no kernel reads these words non-volatilely.
        unsafe {
            std::ptr::write_volatile(
                self.memory.as_ptr().cast::<u32>().cast_mut().add(index),
                value,
            )
        }
    }
}

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
