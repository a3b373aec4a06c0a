//! PTX kernels for tests of launch shapes: 3-D grids and blocks, dynamic shared memory, and
//! arguments of every size.
//!
//! Written in `kernels/launch_kernels.cu`, compiled to the committed `kernels/launch_kernels.ptx`
//! by `cargo xtask ptx`. The kernels are handed out as [`Kernel`]s: the tests launch them with
//! shapes of their own, which is what they check.
//!
//! - `count_threads_3d(unsigned* counts)`: `counts[id] += 1` (atomically) for the global linear
//!   id of every thread of the launch (block-major: `block * threads_per_block + thread`, x
//!   fastest in both), so after one launch on zeroed memory each of the `grid * block` elements
//!   is 1.
//! - `shared_sum_u32(unsigned words, unsigned long long* sums)`: each block writes
//!   `0..words` into its dynamic shared memory (which must hold `words` `u32`s), then
//!   `sums[blockIdx.x] = words * (words - 1) / 2`.
//! - `echo_args(unsigned long long* out, unsigned char, unsigned short, unsigned,
//!   unsigned long long, float, double, Pair)`: writes each argument widened to 64 bits
//!   (floats as their bits) to `out[0..8)`, the [`Pair`] as two words.
//! - `scale_by_table_u32(unsigned* data, size_t n)`: `data[i] *= scale_table[i % 4]`, where
//!   `scale_table` is a module global (`__constant__ unsigned scale_table[4]`, [`SCALE_TABLE`])
//!   the host fills through its address; one thread adds 1 to the global
//!   `__device__ unsigned long long scale_launches` ([`SCALE_LAUNCHES`]).

use std::sync::Arc;

use cuweave_driver::{Context, DriverError, Kernel, Module};

/// The PTX of the launch kernels, generated from `kernels/launch_kernels.cu`.
pub const PTX: &str = include_str!("kernels/launch_kernels.ptx");

/// The name of every kernel in [`PTX`].
pub const KERNEL_NAMES: &[&str] = &[
    "count_threads_3d",
    "shared_sum_u32",
    "echo_args",
    "scale_by_table_u32",
];

/// The name of the `__constant__ unsigned[4]` global `scale_by_table_u32` reads.
pub const SCALE_TABLE: &str = "scale_table";

/// The name of the `__device__ unsigned long long` global `scale_by_table_u32` counts in.
pub const SCALE_LAUNCHES: &str = "scale_launches";

/// The by-value struct `echo_args` takes last (`struct Pair` in the source): 16 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pair {
    /// Echoed to `out[6]`.
    pub first: u64,
    /// Echoed to `out[7]` as its bits.
    pub second: f32,
}

/// The launch kernels loaded into one context.
#[derive(Debug)]
pub struct LaunchKernels {
    module: Arc<Module>,
    count_threads_3d: Kernel,
    shared_sum_u32: Kernel,
    echo_args: Kernel,
    scale_by_table_u32: Kernel,
}

impl LaunchKernels {
    /// JIT-compiles [`PTX`] in `ctx` and looks up every kernel.
    ///
    /// # Errors
    /// The driver's error when the PTX does not load or a kernel is missing.
    pub fn load(ctx: &Arc<Context>) -> Result<Self, DriverError> {
        let module = Module::from_ptx(ctx, PTX)?;
        Ok(Self {
            count_threads_3d: module.function("count_threads_3d")?,
            shared_sum_u32: module.function("shared_sum_u32")?,
            echo_args: module.function("echo_args")?,
            scale_by_table_u32: module.function("scale_by_table_u32")?,
            module,
        })
    }

    /// The loaded module.
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// `count_threads_3d` (see the module documentation).
    pub fn count_threads_3d(&self) -> &Kernel {
        &self.count_threads_3d
    }

    /// `shared_sum_u32` (see the module documentation).
    pub fn shared_sum_u32(&self) -> &Kernel {
        &self.shared_sum_u32
    }

    /// `echo_args` (see the module documentation).
    pub fn echo_args(&self) -> &Kernel {
        &self.echo_args
    }

    /// `scale_by_table_u32` (see the module documentation).
    pub fn scale_by_table_u32(&self) -> &Kernel {
        &self.scale_by_table_u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_is_generated_from_every_cu_kernel() {
        let source = include_str!("kernels/launch_kernels.cu");
        assert_eq!(
            source.matches("__global__ void ").count(),
            PTX.matches(".visible .entry ").count(),
            "stale PTX; run `cargo xtask ptx`"
        );
        for name in KERNEL_NAMES {
            assert!(source.contains(&format!("__global__ void {name}(")));
            assert!(PTX.contains(&format!(".visible .entry {name}(")));
        }
        for global in [SCALE_TABLE, SCALE_LAUNCHES] {
            assert!(PTX.contains(&format!(" {global}")), "{global}");
        }
    }

    #[test]
    fn pair_has_the_c_layout_of_the_kernel_parameter() {
        assert_eq!(std::mem::size_of::<Pair>(), 16);
        assert_eq!(std::mem::align_of::<Pair>(), 8);
    }
}
