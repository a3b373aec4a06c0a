//! PTX kernels for cuweave-memory's tests of overlapping readers and ordered writers.
//!
//! Written in `kernels/memory_kernels.cu`, compiled to the committed `kernels/memory_kernels.ptx`
//! by `cargo xtask ptx`. The kernels are handed out as [`Kernel`]s rather than wrapped in typed
//! launchers: the tests launch them through `cuweave_memory::TrackedLaunch`, whose buffer
//! tracking is what they check.
//!
//! - `timed_read_u32(const unsigned* data, size_t n, unsigned long long ns,
//!   unsigned long long* stamps, unsigned* done, unsigned long long* sum)`: adds the sum of
//!   `data[0..n)` to `*sum`; thread 0 writes its start time (`%globaltimer`, ns) to `stamps[0]`,
//!   busy-waits `ns`, writes its end time to `stamps[1]` and then sets `*done = 1`.
//! - `checked_write_u32(unsigned* data, size_t n, unsigned value, const unsigned* flags,
//!   unsigned nflags, unsigned* seen, unsigned long long* started)`: thread 0 writes how many of
//!   `flags[0..nflags)` are set to `*seen` and its start time to `*started`; then `data[0..n)`
//!   is set to `value`.

use std::sync::Arc;

use cuweave_driver::{Context, DriverError, Kernel, LaunchConfig, Module};

/// The PTX of the memory kernels, generated from `kernels/memory_kernels.cu`.
pub const PTX: &str = include_str!("kernels/memory_kernels.ptx");

/// The memory kernels loaded into one context.
#[derive(Debug)]
pub struct MemoryKernels {
    module: Arc<Module>,
    timed_read_u32: Kernel,
    checked_write_u32: Kernel,
}

impl MemoryKernels {
    /// JIT-compiles [`PTX`] in `ctx` and looks up both kernels.
    ///
    /// # Errors
    /// The driver's error when the PTX does not load or a kernel is missing.
    pub fn load(ctx: &Arc<Context>) -> Result<Self, DriverError> {
        let module = Module::from_ptx(ctx, PTX)?;
        Ok(Self {
            timed_read_u32: module.function("timed_read_u32")?,
            checked_write_u32: module.function("checked_write_u32")?,
            module,
        })
    }

    /// The loaded module.
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// `timed_read_u32` (see the module documentation for its parameters).
    pub fn timed_read_u32(&self) -> &Kernel {
        &self.timed_read_u32
    }

    /// `checked_write_u32` (see the module documentation for its parameters).
    pub fn checked_write_u32(&self) -> &Kernel {
        &self.checked_write_u32
    }

    /// A launch shape for `n` elements: small enough that a long-running reader leaves most
    /// of the GPU to another stream's reader.
    pub fn config(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid: (n.div_ceil(256).clamp(1, 16) as u32, 1, 1),
            block: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}
