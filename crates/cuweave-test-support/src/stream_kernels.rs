//! PTX kernels for the stream layer's GPU tests, and typed launchers for them.
//!
//! Written in `kernels/stream_kernels.cu`, compiled to the committed `kernels/stream_kernels.ptx`
//! by `cargo xtask ptx`. [`StreamKernels::spin_stamped`] leaves `%globaltimer` stamps of when
//! work really ran on the GPU (overlap and priority tests); [`StreamKernels::copy_flag_u32`]
//! reads a flag another stream writes (ordering tests).

use std::sync::Arc;

use cuweave_driver::{Context, DriverError, Kernel, KernelArgs, LaunchConfig, Module, Stream};

/// The PTX of the stream kernels, generated from `kernels/stream_kernels.cu`.
pub const PTX: &str = include_str!("kernels/stream_kernels.ptx");

/// The name of every kernel in [`PTX`].
pub const KERNEL_NAMES: &[&str] = &["spin_stamped", "copy_flag_u32"];

/// The stream kernels loaded into one context.
#[derive(Debug)]
pub struct StreamKernels {
    module: Arc<Module>,
    spin_stamped: Kernel,
    copy_flag_u32: Kernel,
}

impl StreamKernels {
    /// JIT-compiles [`PTX`] in `ctx` and looks up every kernel.
    ///
    /// # Errors
    /// The driver's error when the PTX does not load or a kernel is missing.
    pub fn load(ctx: &Arc<Context>) -> Result<Self, DriverError> {
        let module = Module::from_ptx(ctx, PTX)?;
        Ok(Self {
            spin_stamped: module.function("spin_stamped")?,
            copy_flag_u32: module.function("copy_flag_u32")?,
            module,
        })
    }

    /// The loaded module.
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// Queues `blocks` blocks whose first thread each busy-waits `ns` nanoseconds; `stamps[0]`
    /// becomes the earliest block start (`atomicMin`) and `stamps[1]` the latest block end
    /// (`atomicMax`), in `%globaltimer` nanoseconds. Set `stamps` to `[u64::MAX, 0]` first.
    ///
    /// # Safety
    /// `stamps` must be device-accessible memory of the stream's context valid for two 8-byte
    /// aligned `u64`s until the kernel finishes, not touched by the host meanwhile.
    ///
    /// # Errors
    /// The launch's error.
    pub unsafe fn spin_stamped(
        &self,
        stream: &Stream,
        ns: u64,
        blocks: u32,
        stamps: u64,
    ) -> Result<(), DriverError> {
        let args = KernelArgs::new().arg(&ns).arg(&stamps);
        let config = LaunchConfig {
            grid: (blocks.max(1), 1, 1),
            block: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: spin_stamped(unsigned long long, unsigned long long*) matches the arguments;
        // the caller guarantees `stamps` is valid for two elements.
        unsafe { self.spin_stamped.launch(stream, config, &args) }
    }

    /// Queues `*out = *flag` (a volatile read of `flag`).
    ///
    /// # Safety
    /// `flag` and `out` must be device-accessible memory of the stream's context, each valid for
    /// one `u32` until the kernel finishes; the host must not touch `out` meanwhile.
    ///
    /// # Errors
    /// The launch's error.
    pub unsafe fn copy_flag_u32(
        &self,
        stream: &Stream,
        flag: u64,
        out: u64,
    ) -> Result<(), DriverError> {
        let args = KernelArgs::new().arg(&flag).arg(&out);
        // SAFETY: copy_flag_u32(const unsigned*, unsigned*) matches the arguments; the caller
        // guarantees both are valid.
        unsafe {
            self.copy_flag_u32
                .launch(stream, LaunchConfig::single(), &args)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_is_generated_from_every_stream_kernel() {
        let source = include_str!("kernels/stream_kernels.cu");
        assert_eq!(
            source.matches("__global__ void ").count(),
            PTX.matches(".visible .entry ").count(),
            "stale PTX; run `cargo xtask ptx`"
        );
        for name in KERNEL_NAMES {
            assert!(source.contains(&format!("__global__ void {name}(")));
            assert!(PTX.contains(&format!(".visible .entry {name}(")));
        }
    }
}
