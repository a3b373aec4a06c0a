//! Helpers shared by the facade's whole-program tests (`user_programs`, `whole_programs`): the
//! test kernels launched on typed buffers through pool streams, the programs' exact data and
//! the NCCL check.
#![allow(dead_code)]

use std::sync::Arc;

use cuweave::driver::{Kernel, LaunchConfig};
use cuweave::memory::TrackedLaunch;
use cuweave::prelude::*;
use cuweave::stream::OperationKind;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{gpu_required, skip};

/// Elements of the programs' tensors (256 KiB of `f32`).
pub const N: usize = 1 << 16;
/// One millisecond, in the nanoseconds the spin kernel takes.
pub const MS: u64 = 1_000_000;

/// The test kernels as `Kernel`s launched through `TrackedLaunch` on typed buffers, each queued
/// through a pool stream (so its metrics count it) and ordered by the buffers' own tracking.
pub struct Ops {
    pub test: TestKernels,
    pub add: Kernel,
    pub saxpy: Kernel,
    pub increment: Kernel,
}

impl Ops {
    pub fn load(context: &Arc<Context>) -> Self {
        let test = TestKernels::load(context).unwrap();
        Self {
            add: test.module().function("add_f32").unwrap(),
            saxpy: test.module().function("saxpy_f32").unwrap(),
            increment: test.module().function("increment_u32").unwrap(),
            test,
        }
    }

    /// `y[i] += a * x[i]`: a read of `x`, a write of `y`.
    pub fn saxpy(
        &self,
        stream: &PriorityStream,
        a: f32,
        x: &DeviceBuffer<f32>,
        y: &mut DeviceBuffer<f32>,
    ) -> Result<(), StreamError> {
        assert_eq!(x.len(), y.len());
        let n = y.len() as u64;
        let config = LaunchConfig::for_elements(y.len(), 256)?;
        stream.enqueue(OperationKind::KernelLaunch, 0, |raw| {
            // SAFETY: saxpy_f32(float, const float*, float*, size_t) reads n elements of `x` and
            // writes n of `y`, both n f32s long and declared so.
            unsafe {
                TrackedLaunch::new(&self.saxpy, raw, config)
                    .arg(&a)
                    .read(x)
                    .write(&mut *y)
                    .arg(&n)
                    .launch()
            }
        })
    }

    /// `out[i] = a[i] + b[i]`: reads of `a` and `b`, a write of `out`.
    pub fn add(
        &self,
        stream: &PriorityStream,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<(), StreamError> {
        assert!(a.len() == out.len() && b.len() == out.len());
        let n = out.len() as u64;
        let config = LaunchConfig::for_elements(out.len(), 256)?;
        stream.enqueue(OperationKind::KernelLaunch, 0, |raw| {
            // SAFETY: add_f32(const float*, const float*, float*, size_t) reads n elements of
            // `a` and `b` and writes n of `out`, all n f32s long and declared so; `out` is a
            // buffer of its own, so it does not overlap the inputs.
            unsafe {
                TrackedLaunch::new(&self.add, raw, config)
                    .read(a)
                    .read(b)
                    .write(&mut *out)
                    .arg(&n)
                    .launch()
            }
        })
    }

    /// `data[i] += 1` (wrapping): a write of `data`, any kind of buffer.
    pub fn increment<B: Buffer<u32>>(
        &self,
        stream: &PriorityStream,
        data: &mut B,
    ) -> Result<(), StreamError> {
        let n = data.len() as u64;
        let config = LaunchConfig::for_elements(data.len(), 256)?;
        stream.enqueue(OperationKind::KernelLaunch, 0, |raw| {
            // SAFETY: increment_u32(unsigned*, size_t) reads and writes n elements of `data`,
            // which holds n u32s; declared written.
            unsafe {
                TrackedLaunch::new(&self.increment, raw, config)
                    .write(&mut *data)
                    .arg(&n)
                    .launch()
            }
        })
    }

    /// Keeps `stream` busy for `ns` nanoseconds, so that work that fails to wait for what
    /// follows it would read or write stale bytes.
    pub fn spin(&self, stream: &PriorityStream, ns: u64) {
        stream.launch(|raw| self.test.spin_ns(raw, ns)).unwrap();
    }

    /// The training step every program here runs: `w += x; out = (2x + 1) + w`, with the
    /// hidden activation `h` a buffer of the caller's (so a captured step allocates nothing).
    pub fn step(
        &self,
        stream: &PriorityStream,
        x: &DeviceBuffer<f32>,
        w: &mut DeviceBuffer<f32>,
        h: &mut DeviceBuffer<f32>,
        out: &mut DeviceBuffer<f32>,
    ) {
        self.saxpy(stream, 1.0, x, w).unwrap();
        stream.fill(h, 1.0).unwrap();
        self.saxpy(stream, 2.0, x, h).unwrap();
        self.add(stream, h, w, out).unwrap();
    }
}

/// Small integers (in `-1000..=1000`), different for each `seed`: every sum the programs make
/// of a few hundred of them is exact in `f32`, so results compare bit for bit.
pub fn value(seed: usize, i: usize) -> f32 {
    (i.wrapping_mul(7919)
        .wrapping_add(seed.wrapping_mul(104_729))
        % 2001) as f32
        - 1000.0
}

/// `len` pattern words with no short period, different for each `seed`.
pub fn words(len: usize, seed: u64) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 16) as u32
        })
        .collect()
}

/// Asserts `actual` equals `expected(i)` bit for bit, naming the first difference.
pub fn assert_exact(actual: &[f32], expected: impl Fn(usize) -> f32, what: &str) {
    if let Some((i, value)) = actual
        .iter()
        .enumerate()
        .find(|(i, value)| value.to_bits() != expected(*i).to_bits())
    {
        panic!("{what}: element {i} is {value}, expected {}", expected(i));
    }
}

/// Whether NCCL loads; prints `SKIPPED <test>: <reason>` when it does not (under
/// `CUWEAVE_REQUIRE_GPU=1`, its absence fails, as in the collective crate's tests).
pub fn nccl_or_skip(test: &str) -> bool {
    match cuweave::collective::nccl() {
        Ok(nccl) => {
            eprintln!("{test}: NCCL {} from {}", nccl.version(), nccl.path());
            true
        }
        Err(error) => {
            assert!(
                !gpu_required(),
                "{test}: CUWEAVE_REQUIRE_GPU=1 but NCCL is not loadable: {error}"
            );
            skip(test, &format!("NCCL is not loadable: {error}"));
            false
        }
    }
}
