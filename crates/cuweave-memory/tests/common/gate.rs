//! [`Gate`]: holds a stream behind a kernel until the host opens it, so that work queued behind
//! it is provably still pending, without timing anything. Included by the test binaries that
//! use it (`#[path = "common/gate.rs"] mod gate;`).

use std::sync::Arc;

use cuweave_driver::memory::{HostAllocFlags, HostAllocation};
use cuweave_driver::{Context, Stream};
use cuweave_test_support::kernels::TestKernels;

/// How long the gate kernel waits at most before giving up on its own: 10 s, in nanoseconds.
const LONGEST_HOLD_NS: u64 = 10_000_000_000;

/// A gate on mapped pinned memory that a `wait_u32` kernel holds a stream behind until the host
/// opens it. Dropping it opens it, so a failing test never leaves the kernel spinning (and never
/// frees the flag under it: the struct's drop runs before its field's).
pub struct Gate {
    flag: HostAllocation,
}

impl Gate {
    pub fn new(context: &Arc<Context>) -> Self {
        let mut flag = HostAllocation::new(context, 4, HostAllocFlags::PORTABLE_MAPPED)
            .expect("pin the gate's flag");
        flag.as_bytes_mut().fill(0);
        Self { flag }
    }

    /// Queues the kernel that holds `stream` until [`open`](Self::open).
    pub fn hold(&self, kernels: &TestKernels, stream: &Stream) {
        let flag = self.flag.device_ptr().expect("mapped flag");
        // SAFETY: `flag` maps the 4 bytes of `self.flag`, which outlive the kernel (the gate is
        // opened before it is freed, and freeing pinned memory waits for the device); the host
        // writes it only with a volatile store.
        unsafe { kernels.wait_u32(stream, flag, 1, LONGEST_HOLD_NS) }.expect("gate kernel");
    }

    /// Lets every kernel held by this gate finish.
    pub fn open(&self) {
        let flag = self.flag.as_ptr().cast::<u32>().cast_mut();
        // SAFETY: 4 aligned bytes of live pinned memory that kernels only read.
        unsafe { flag.write_volatile(1) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
    }
}
