//! Kernels for the event layer's tests and benches, with typed launchers.
//!
//! Written in `kernels/event_kernels.cu`, compiled to the committed `kernels/event_kernels.ptx`
//! by `cargo xtask ptx`.

use std::sync::Arc;

use cuweave_driver::{Context, DriverError, Kernel, KernelArgs, LaunchConfig, Module, Stream};

/// The PTX of the event kernels, generated from `kernels/event_kernels.cu`.
pub const PTX: &str = include_str!("kernels/event_kernels.ptx");

/// The name of every kernel in [`PTX`].
pub const KERNEL_NAMES: &[&str] = &[
    "noop",
    "trap_now",
    "transform_checked_u32",
    "count_flags_u32",
];

/// The event kernels loaded into one context.
#[derive(Debug)]
pub struct EventKernels {
    module: Arc<Module>,
    noop: Kernel,
    trap_now: Kernel,
    transform_checked_u32: Kernel,
    count_flags_u32: Kernel,
}

impl EventKernels {
    /// JIT-compiles [`PTX`] in `ctx` and looks up every kernel.
    ///
    /// # Errors
    /// The driver's error when the PTX does not load or a kernel is missing.
    pub fn load(ctx: &Arc<Context>) -> Result<Self, DriverError> {
        let module = Module::from_ptx(ctx, PTX)?;
        Ok(Self {
            noop: module.function("noop")?,
            trap_now: module.function("trap_now")?,
            transform_checked_u32: module.function("transform_checked_u32")?,
            count_flags_u32: module.function("count_flags_u32")?,
            module,
        })
    }

    /// The loaded module.
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// Queues an empty one-thread kernel (the smallest unit of GPU work).
    ///
    /// # Errors
    /// The launch's error.
    pub fn noop(&self, stream: &Stream) -> Result<(), DriverError> {
        // SAFETY: noop() takes no arguments and touches no memory.
        unsafe {
            self.noop
                .launch(stream, LaunchConfig::single(), &KernelArgs::new())
        }
    }

    /// Queues a kernel that executes `__trap()`, killing the context: every later driver call
    /// in this process's use of it fails with the driver's sticky error. Run tests that use it
    /// last, in a process of their own.
    ///
    /// # Errors
    /// The launch's error.
    pub fn trap_now(&self, stream: &Stream) -> Result<(), DriverError> {
        // SAFETY: trap_now() takes no arguments and touches no memory; killing the context is
        // its documented purpose and corrupts no host state.
        unsafe {
            self.trap_now
                .launch(stream, LaunchConfig::single(), &KernelArgs::new())
        }
    }

    /// Queues `dst[i] = src[i] * mul + add` for `i < n`, adding to `*unfinished` how many
    /// `src[i]` still held `sentinel` (input read before its producer wrote it).
    ///
    /// # Safety
    /// `src`, `dst` (each `n` `u32`s) and `unfinished` (one `u32`) are device-accessible memory
    /// of the stream's context, valid until the kernel finishes; `dst` does not overlap `src`.
    ///
    /// # Errors
    /// The launch's error.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn transform_checked_u32(
        &self,
        stream: &Stream,
        src: u64,
        dst: u64,
        n: usize,
        mul: u32,
        add: u32,
        sentinel: u32,
        unfinished: u64,
    ) -> Result<(), DriverError> {
        let n = n as u64;
        let args = KernelArgs::new()
            .arg(&src)
            .arg(&dst)
            .arg(&n)
            .arg(&mul)
            .arg(&add)
            .arg(&sentinel)
            .arg(&unfinished);
        let config = LaunchConfig::for_elements(usize::try_from(n).unwrap_or(usize::MAX), 256)?;
        // SAFETY: the signature matches; the caller guarantees the ranges.
        unsafe { self.transform_checked_u32.launch(stream, config, &args) }
    }

    /// Queues one thread that stores into `*out` how many of `flags[0..n)` equal `expected`
    /// (volatile reads, so it sees other streams' stores).
    ///
    /// # Safety
    /// `flags` (`n` `u32`s) and `out` (one `u32`) are device-accessible memory of the stream's
    /// context (mapped pinned memory is fine), valid until the kernel finishes.
    ///
    /// # Errors
    /// The launch's error.
    pub unsafe fn count_flags_u32(
        &self,
        stream: &Stream,
        flags: u64,
        n: usize,
        expected: u32,
        out: u64,
    ) -> Result<(), DriverError> {
        let n = n as u64;
        let args = KernelArgs::new()
            .arg(&flags)
            .arg(&n)
            .arg(&expected)
            .arg(&out);
        // SAFETY: the signature matches; the caller guarantees the ranges.
        unsafe {
            self.count_flags_u32
                .launch(stream, LaunchConfig::single(), &args)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_defines_every_kernel_of_the_source() {
        let source = include_str!("kernels/event_kernels.cu");
        assert_eq!(
            source.matches("__global__ void ").count(),
            PTX.matches(".visible .entry ").count(),
            "stale PTX; run `cargo xtask ptx`"
        );
        for name in KERNEL_NAMES {
            assert!(PTX.contains(&format!(".visible .entry {name}(")));
            assert!(source.contains(&format!("__global__ void {name}(")));
        }
    }
}
