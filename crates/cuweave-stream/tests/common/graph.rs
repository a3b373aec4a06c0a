//! The fixture and raw-memory helpers of the CUDA-graph program tests (`graph_programs`,
//! `torch_graph_programs`).

use cuweave_driver::Context;
use cuweave_driver::graph::GraphError;
use cuweave_driver::memory::{copy_dtoh, copy_htod};
use cuweave_memory::caching::{CachingAllocator, MemoryStats};
use cuweave_stream::{PriorityStream, StreamError, StreamPriority};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{Gpu, gpu, serial};

/// One millisecond, in the nanoseconds the spin kernels take.
pub const MS: u64 = 1_000_000;

/// The GPU, the test kernels, a caching allocator of its own, and the binary's serial guard
/// (an active capture changes what the whole process may do).
pub struct Fixture {
    pub gpu: Gpu,
    pub kernels: TestKernels,
    pub allocator: CachingAllocator,
    pub _serial: std::sync::MutexGuard<'static, ()>,
}

/// The fixture, or `None` (the test reports itself skipped) without a GPU.
pub fn fixture(test: &str) -> Option<Fixture> {
    let gpu = gpu(test)?;
    let serial = serial();
    Some(Fixture {
        kernels: TestKernels::load(&gpu.context).unwrap(),
        allocator: CachingAllocator::with_driver(&gpu.context),
        gpu,
        _serial: serial,
    })
}

/// A normal-priority stream of `gpu`'s context.
pub fn priority_stream(gpu: &Gpu) -> PriorityStream {
    PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap()
}

/// `n` u32s read back from device memory.
pub fn read_u32(context: &Context, ptr: u64, n: usize) -> Vec<u32> {
    let mut host = vec![0u32; n];
    // SAFETY: `ptr` is device memory of at least `n` u32s whose writers the caller synchronised.
    unsafe { copy_dtoh(context, host.as_mut_ptr().cast(), ptr, n * 4) }.unwrap();
    host
}

/// Writes `data` to device memory.
pub fn write_u32(context: &Context, ptr: u64, data: &[u32]) {
    // SAFETY: `ptr` is device memory of at least `data.len()` u32s, idle.
    unsafe { copy_htod(context, ptr, data.as_ptr().cast(), data.len() * 4) }.unwrap();
}

/// The bits of `values`, as the u32 kernels and reads see them.
pub fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The graph error inside `error`.
pub fn graph_error(error: &StreamError) -> &GraphError {
    error
        .graph_error()
        .unwrap_or_else(|| panic!("expected a graph error, got {error}"))
}

/// Integers small enough that every affine map of the tests is exact in `f32`.
pub fn input_value(k: usize) -> f32 {
    ((k * 7919) % 60_001) as f32 - 30_000.0
}

/// Asserts `actual` (f32 bits) equals `expected` bit for bit, naming the first difference.
pub fn assert_exact(actual: &[u32], expected: impl Fn(usize) -> f32, what: &str) {
    if let Some((i, &value)) = actual
        .iter()
        .enumerate()
        .find(|(i, value)| **value != expected(*i).to_bits())
    {
        panic!(
            "{what}: element {i} is {}, expected {}",
            f32::from_bits(value),
            expected(i)
        );
    }
}

/// Reserved bytes and segments after `empty_cache`: what the live allocations hold.
pub fn settled(allocator: &CachingAllocator) -> MemoryStats {
    allocator.empty_cache().unwrap();
    allocator.stats()
}
