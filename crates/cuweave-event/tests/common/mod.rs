//! Helpers shared by the event layer's GPU tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cuweave_driver::memory::DeviceAllocation;
use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_event::{
    AsyncEventWaiter, EventError, EventPool, EventPriority, OperationCoordinator, OperationId,
    OperationType,
};
use cuweave_stream::PriorityStream;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::poll_until;
use cuweave_test_support::stream_kernels::StreamKernels;

/// `u32` flags in mapped pinned memory that kernels write and the host reads (and opens on
/// drop).
#[allow(unused_imports)] // not every test binary uses it
pub use cuweave_test_support::host_flags::HostFlags as Flags;

pub fn stream(context: &Arc<Context>) -> Arc<Stream> {
    Arc::new(Stream::new(context, StreamFlags::NON_BLOCKING).unwrap())
}

/// `count` non-blocking streams of `context`.
pub fn streams(context: &Arc<Context>, count: usize) -> Vec<Arc<Stream>> {
    (0..count).map(|_| stream(context)).collect()
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
pub const US: u64 = 1_000;

/// How long a gate holds its stream at most, should a failing test never open it.
pub const GATE_TIMEOUT_NS: u64 = 10_000 * MS;

/// Holds `stream` until the host writes 1 into the mapped word at `flag`.
pub fn gate(kernels: &TestKernels, stream: &Stream, flag: u64) {
    // SAFETY: `flag` is a word of mapped pinned memory (`Flags`) that outlives the kernel: the
    // flags open every gate when dropped, and their memory is freed only after that.
    unsafe { kernels.wait_u32(stream, flag, 1, GATE_TIMEOUT_NS).unwrap() };
}

/// Queues a spin of `ns` on `stream`, then a store of `value` into the word at `dst`.
pub fn store_after(kernels: &TestKernels, stream: &Stream, ns: u64, dst: u64, value: u32) {
    // SAFETY: `dst` is a word of mapped pinned memory or of a device allocation that outlives
    // the kernel (every test synchronises its streams before dropping either).
    unsafe { kernels.spin_then_store_u32(stream, ns, dst, value).unwrap() };
}

/// Queues `*out = *flag` on `stream`: what the kernel saw when it ran.
pub fn copy_flag(kernels: &StreamKernels, stream: &Stream, flag: u64, out: u64) {
    // SAFETY: both are words of mapped pinned memory or of device allocations that outlive the
    // kernel (every test synchronises its streams before dropping either).
    unsafe { kernels.copy_flag_u32(stream, flag, out).unwrap() };
}

/// A device allocation of `count` `u32`s, each set to `value`.
pub fn filled(context: &Arc<Context>, count: usize, value: u32) -> DeviceAllocation {
    let allocation = DeviceAllocation::new(context, count * 4).unwrap();
    // SAFETY: `count` 4-byte words of the fresh allocation.
    unsafe { cuweave_driver::memory::memset_d32(context, allocation.ptr(), value, count).unwrap() };
    allocation
}

/// Waits until `waiter` watches nothing (every callback it ran has returned).
pub fn settle(waiter: &AsyncEventWaiter, what: &str) {
    assert!(
        poll_until(Duration::from_secs(5), || waiter.pending() == 0),
        "{what}: the waiter still has {} waits pending after 5 s",
        waiter.pending()
    );
}

/// Registers a normal-priority kernel operation described as `what`, after `dependencies`.
pub fn register_kernel(
    coordinator: &OperationCoordinator,
    dependencies: &[OperationId],
    what: &str,
) -> OperationId {
    register(coordinator, EventPriority::Normal, dependencies, what)
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

/// A coordinator with its own waiter and event pool (so its counters are this test's alone).
pub fn coordinator(
    context: &Arc<Context>,
) -> (OperationCoordinator, Arc<AsyncEventWaiter>, EventPool) {
    let pool = EventPool::new(context, 0, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(pool.clone(), Arc::clone(&waiter));
    (coordinator, waiter, pool)
}

/// Registers a kernel operation of `priority` after `dependencies`.
pub fn register(
    coordinator: &OperationCoordinator,
    priority: EventPriority,
    dependencies: &[OperationId],
    what: &str,
) -> OperationId {
    coordinator
        .register_operation(OperationType::Kernel, priority, None, dependencies, what)
        .unwrap()
}

/// Queues on the pool stream `stream` (counted as one launch) a gate on the mapped word `flag`.
pub fn hold(kernels: &TestKernels, stream: &PriorityStream, flag: u64) {
    stream
        .launch(|s| {
            // SAFETY: `flag` is a word of `Flags` that outlives the kernel (the flags open every
            // gate when dropped, and each test synchronises its streams before that).
            unsafe { kernels.wait_u32(s, flag, 1, GATE_TIMEOUT_NS) }
        })
        .unwrap();
}

/// Whether `result` is `Err(UnknownOperation)` for `id`.
pub fn unknown<T: std::fmt::Debug>(result: &cuweave_event::Result<T>, id: OperationId) -> bool {
    matches!(result, Err(EventError::UnknownOperation { id: got, .. }) if *got == id)
}
