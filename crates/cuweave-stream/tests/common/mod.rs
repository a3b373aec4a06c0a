//! Helpers shared by the stream crate's GPU tests (each test binary uses some of them).

#![allow(dead_code)]

pub mod graph;
pub mod mapped;

use std::sync::Arc;

use cuweave_driver::{Context, Kernel, LaunchConfig, Stream};
use cuweave_memory::{Buffer, DeviceBuffer, MemoryError, TrackedLaunch};
use cuweave_test_support::kernels::TestKernels;

/// The test kernels, also as `Kernel`s that `TrackedLaunch` launches on typed buffers of up to
/// `elements` elements.
pub struct Kit {
    pub test: TestKernels,
    fill: Kernel,
    saxpy: Kernel,
    increment: Kernel,
    config: LaunchConfig,
}

impl Kit {
    pub fn load(context: &Arc<Context>, elements: usize) -> Self {
        let test = TestKernels::load(context).unwrap();
        Self {
            fill: test.module().function("fill_u32").unwrap(),
            saxpy: test.module().function("saxpy_f32").unwrap(),
            increment: test.module().function("increment_u32").unwrap(),
            test,
            config: LaunchConfig::for_elements(elements, 256).unwrap(),
        }
    }

    /// `buffer[i] = value`, tracked as a write.
    pub fn fill(
        &self,
        stream: &Stream,
        buffer: &mut DeviceBuffer<f32>,
        value: f32,
    ) -> Result<(), MemoryError> {
        let (bits, n) = (value.to_bits(), buffer.len() as u64);
        // SAFETY: fill_u32(unsigned*, unsigned, size_t) writes n 4-byte elements of `buffer`,
        // which holds n f32s; declared written.
        unsafe {
            TrackedLaunch::new(&self.fill, stream, self.config)
                .write(buffer)
                .arg(&bits)
                .arg(&n)
                .launch()
        }
    }

    /// `y[i] += a * x[i]`, tracked as a read of `x` and a write of `y`.
    pub fn saxpy(
        &self,
        stream: &Stream,
        a: f32,
        x: &DeviceBuffer<f32>,
        y: &mut DeviceBuffer<f32>,
    ) -> Result<(), MemoryError> {
        let n = y.len().min(x.len()) as u64;
        // SAFETY: saxpy_f32(float, const float*, float*, size_t) reads n elements of `x` and
        // writes n of `y`, both at least n f32s long, declared so.
        unsafe {
            TrackedLaunch::new(&self.saxpy, stream, self.config)
                .arg(&a)
                .read(x)
                .write(y)
                .arg(&n)
                .launch()
        }
    }

    /// `data[i] += 1`, tracked as a write.
    pub fn increment(
        &self,
        stream: &Stream,
        data: &mut DeviceBuffer<u32>,
    ) -> Result<(), MemoryError> {
        let n = data.len() as u64;
        let config = LaunchConfig::for_elements(data.len(), 256).map_err(MemoryError::from)?;
        // SAFETY: increment_u32(unsigned*, size_t) reads and writes n elements of `data`,
        // which holds n u32s; declared written.
        unsafe {
            TrackedLaunch::new(&self.increment, stream, config)
                .write(data)
                .arg(&n)
                .launch()
        }
    }
}
