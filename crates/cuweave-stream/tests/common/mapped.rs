//! [`Mapped`]: words of mapped pinned memory that kernels store into and gate on while the host
//! reads and opens them (the test-support crate's `HostFlags`).

#[allow(unused_imports)] // not every test binary uses it
pub use cuweave_test_support::host_flags::HostFlags as Mapped;

use cuweave_stream::PriorityStream;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;

const MS: u64 = 1_000_000;

/// `false` (after saying why) when the device cannot map pinned host memory for the gates.
pub fn maps_host_memory(gpu: &cuweave_test_support::Gpu, test: &str) -> bool {
    if gpu.device.can_map_host_memory().unwrap() {
        return true;
    }
    cuweave_test_support::skip(test, "the device cannot map host memory");
    false
}

/// Queues on `stream` a `wait_u32` gate holding it until word `word` of `gate` is 1 (or 10 s).
pub fn hold(kernels: &TestKernels, stream: &PriorityStream, gate: &Mapped, word: usize) {
    let flag = gate.device(word);
    // SAFETY: `flag` is a mapped word of `gate`, which outlives the kernel (every test opens
    // the gate and synchronizes before dropping it).
    stream
        .launch(|s| unsafe { kernels.wait_u32(s, flag, 1, 10_000 * MS) })
        .unwrap();
}

/// Queues on `stream` a copy of the `u32` at `flag` into the `u32` at `out`.
pub fn copy_flag(kernels: &StreamKernels, stream: &PriorityStream, flag: u64, out: u64) {
    // SAFETY: callers pass device-accessible words (device buffers or mapped words) that live
    // until the stream is synchronized.
    stream
        .launch(|s| unsafe { kernels.copy_flag_u32(s, flag, out) })
        .unwrap();
}

/// Queues on `stream` `*word += 1` for one `u32`.
pub fn increment(kernels: &TestKernels, stream: &PriorityStream, word: u64) {
    // SAFETY: callers pass one device-accessible `u32` that lives until the stream is
    // synchronized and that only work ordered with this launch touches.
    stream
        .launch(|s| unsafe { kernels.increment_u32(s, word, 1) })
        .unwrap();
}
