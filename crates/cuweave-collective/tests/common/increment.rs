//! A tracked `data[i] += 1` kernel, for programs that change a buffer between collectives.

use std::sync::Arc;

use cuweave_driver::{Context, Kernel, LaunchConfig, Stream};
use cuweave_memory::{Buffer, TrackedLaunch};
use cuweave_test_support::kernels::TestKernels;

/// The test kernels of `context` and their `increment_u32` (the module kept alive beside it).
pub fn incrementer(context: &Arc<Context>) -> (TestKernels, Kernel) {
    let kernels = TestKernels::load(context).expect("kernels");
    let increment = kernels
        .module()
        .function("increment_u32")
        .expect("increment_u32");
    (kernels, increment)
}

/// Queues `data[i] += 1` on `stream`, declared a write of `data`.
pub fn increment<B: Buffer<u32> + ?Sized>(kernel: &Kernel, stream: &Stream, data: &mut B) {
    let n = data.len() as u64;
    let config = LaunchConfig {
        grid: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
        block: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: increment_u32(unsigned* data, size_t n) gets the buffer's address and its length
    // (a grid-stride loop over exactly `n` elements); it writes only `data`, declared a write,
    // so the tracker orders it with every other use.
    unsafe {
        TrackedLaunch::new(kernel, stream, config)
            .write(data)
            .arg(&n)
            .launch()
    }
    .expect("increment");
}

/// `values`, each plus `k` (wrapping): what `k` increments leave.
pub fn plus(values: &[u32], k: u32) -> Vec<u32> {
    values.iter().map(|v| v.wrapping_add(k)).collect()
}
