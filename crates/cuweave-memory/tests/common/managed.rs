//! Helpers of the managed and pinned memory tests: a stream, the managed-memory skip gate, the
//! `DeviceBusy` check and a tracked checksum kernel. Included by the test binaries that use it
//! (`#[path = "common/managed.rs"] mod managed;`).

use std::sync::Arc;

use cuweave_driver::{Context, Device, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer, ManagedCapabilities, MemoryError};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::skip;

pub fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// Whether device 0 has managed memory with concurrent access (every test of managed memory
/// that takes host slices needs it); prints a skip line otherwise.
pub fn managed_usable(device: Device, test: &str) -> bool {
    let capabilities = ManagedCapabilities::of(device).expect("capabilities");
    if capabilities.managed_memory && capabilities.concurrent_managed_access {
        true
    } else {
        skip(test, "no managed memory with concurrent access on device 0");
        false
    }
}

pub fn assert_busy<T>(result: cuweave_memory::Result<T>, what: &str) {
    match result {
        Err(MemoryError::DeviceBusy { .. }) => {}
        Err(other) => panic!("{what}: expected DeviceBusy, got {other:?}"),
        Ok(_) => panic!("{what}: host access granted while queued GPU work uses the buffer"),
    }
}

/// Adds the `slot`'s `u32`s into `total` by a `checksum_u32` kernel on `s`, with the slot's
/// read and the total's write recorded (later uploads into the slot and the download of
/// `total` wait for them).
pub fn tracked_checksum(
    kernels: &TestKernels,
    s: &Stream,
    slot: &DeviceBuffer<u32>,
    total: &DeviceBuffer<u64>,
) {
    slot.prepare_read(s).expect("prepare read");
    total.prepare_write(s).expect("prepare checksum");
    // SAFETY: the slot holds `slot.len()` u32s and `total` one u64 (8-byte aligned); both
    // outlive the kernel, whose read and write are recorded right below.
    unsafe { kernels.checksum_u32(s, slot.device_ptr(), slot.len(), total.device_ptr()) }
        .expect("checksum kernel");
    slot.record_read(s).expect("record read");
    total.record_write(s).expect("record checksum");
}
