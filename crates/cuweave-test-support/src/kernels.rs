//! PTX test kernels and typed launchers for them.
//!
//! The kernels are written in `kernels/test_kernels.cu` and compiled to the committed
//! `kernels/test_kernels.ptx` by `cargo xtask ptx` (`compute_75`, so the driver JIT-compiles them
//! for any newer GPU). Array kernels loop grid-stride, so each launcher picks a modest grid and
//! still covers every element. Pointers are raw device addresses (`u64`, a
//! [`CUdeviceptr`](cuweave_driver::sys::CUdeviceptr)) so every crate can use them, whatever buffer
//! type it owns.

use std::sync::Arc;

use cuweave_driver::{Context, DriverError, Kernel, KernelArgs, LaunchConfig, Module, Stream};

/// The PTX of every test kernel, generated from `kernels/test_kernels.cu`.
pub const PTX: &str = include_str!("kernels/test_kernels.ptx");

/// The name of every kernel in [`PTX`].
pub const KERNEL_NAMES: &[&str] = &[
    "fill_u32",
    "add_f32",
    "saxpy_f32",
    "increment_u32",
    "spin_ns",
    "spin_then_store_u32",
    "wait_u32",
    "checksum_u32",
    "watch_u32",
];

/// Threads per block for the element-wise kernels.
const BLOCK: u32 = 256;

/// Most blocks `checksum_u32` uses: each thread does one atomic add, so fewer threads contend less.
const CHECKSUM_MAX_BLOCKS: u32 = 1024;

/// Blocks `watch_u32` uses at most. Its blocks all run for the whole watch, so it must stay small
/// enough to be resident at once (or later waves would stretch the watch) and to leave SMs free for
/// the work whose writes it is there to catch.
const WATCH_MAX_BLOCKS: u32 = 64;

/// The test kernels loaded into one context.
#[derive(Debug)]
pub struct TestKernels {
    module: Arc<Module>,
    fill_u32: Kernel,
    add_f32: Kernel,
    saxpy_f32: Kernel,
    increment_u32: Kernel,
    spin_ns: Kernel,
    spin_then_store_u32: Kernel,
    wait_u32: Kernel,
    checksum_u32: Kernel,
    watch_u32: Kernel,
}

impl TestKernels {
    /// JIT-compiles [`PTX`] in `ctx` and looks up every kernel.
    ///
    /// # Errors
    /// The driver's error when the PTX does not load (a driver older than the nvcc that wrote it)
    /// or a kernel is missing.
    pub fn load(ctx: &Arc<Context>) -> Result<Self, DriverError> {
        let module = Module::from_ptx(ctx, PTX)?;
        Ok(Self {
            fill_u32: module.function("fill_u32")?,
            add_f32: module.function("add_f32")?,
            saxpy_f32: module.function("saxpy_f32")?,
            increment_u32: module.function("increment_u32")?,
            spin_ns: module.function("spin_ns")?,
            spin_then_store_u32: module.function("spin_then_store_u32")?,
            wait_u32: module.function("wait_u32")?,
            checksum_u32: module.function("checksum_u32")?,
            watch_u32: module.function("watch_u32")?,
            module,
        })
    }

    /// The loaded module.
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// Queues `dst[i] = value` for `i < n`.
    ///
    /// # Safety
    /// `dst` must be device-accessible memory of the stream's context, valid for `n` `u32`s until
    /// the kernel finishes on `stream`, and not read or written by the host meanwhile.
    ///
    /// # Errors
    /// The launch's error (a stream of another device, a refused launch).
    pub unsafe fn fill_u32(
        &self,
        stream: &Stream,
        dst: u64,
        value: u32,
        n: usize,
    ) -> Result<(), DriverError> {
        let n = n as u64;
        let args = KernelArgs::new().arg(&dst).arg(&value).arg(&n);
        // SAFETY: fill_u32(unsigned*, unsigned, size_t) matches the arguments; the caller
        // guarantees `dst` is valid for `n` elements until the kernel finishes.
        unsafe { self.fill_u32.launch(stream, elements(n), &args) }
    }

    /// Queues `out[i] = a[i] + b[i]` for `i < n`.
    ///
    /// # Safety
    /// `a`, `b` and `out` must be device-accessible memory of the stream's context, each valid for
    /// `n` `f32`s until the kernel finishes on `stream`; the host must not write `a` or `b` nor
    /// touch `out` meanwhile. `out` may equal `a` or `b` but must not partly overlap them.
    ///
    /// # Errors
    /// The launch's error.
    pub unsafe fn add_f32(
        &self,
        stream: &Stream,
        a: u64,
        b: u64,
        out: u64,
        n: usize,
    ) -> Result<(), DriverError> {
        let n = n as u64;
        let args = KernelArgs::new().arg(&a).arg(&b).arg(&out).arg(&n);
        // SAFETY: add_f32(const float*, const float*, float*, size_t) matches the arguments; the
        // caller guarantees the three ranges are valid for `n` elements.
        unsafe { self.add_f32.launch(stream, elements(n), &args) }
    }

    /// Queues `y[i] = a * x[i] + y[i]` for `i < n`.
    ///
    /// # Safety
    /// `x` and `y` must be device-accessible memory of the stream's context, each valid for `n`
    /// `f32`s until the kernel finishes on `stream`; the host must not write `x` nor touch `y`
    /// meanwhile, and the ranges must not partly overlap.
    ///
    /// # Errors
    /// The launch's error.
    pub unsafe fn saxpy_f32(
        &self,
        stream: &Stream,
        a: f32,
        x: u64,
        y: u64,
        n: usize,
    ) -> Result<(), DriverError> {
        let n = n as u64;
        let args = KernelArgs::new().arg(&a).arg(&x).arg(&y).arg(&n);
        // SAFETY: saxpy_f32(float, const float*, float*, size_t) matches the arguments; the
        // caller guarantees both ranges are valid for `n` elements.
        unsafe { self.saxpy_f32.launch(stream, elements(n), &args) }
    }

    /// Queues `data[i] += 1` for `i < n` (wrapping). Handy to prove ordering: launched twice on
    /// racing streams without a dependency, some elements may end up incremented once.
    ///
    /// # Safety
    /// `data` must be device-accessible memory of the stream's context, valid for `n` `u32`s until
    /// the kernel finishes on `stream`, and not touched by the host meanwhile.
    ///
    /// # Errors
    /// The launch's error.
    pub unsafe fn increment_u32(
        &self,
        stream: &Stream,
        data: u64,
        n: usize,
    ) -> Result<(), DriverError> {
        let n = n as u64;
        let args = KernelArgs::new().arg(&data).arg(&n);
        // SAFETY: increment_u32(unsigned*, size_t) matches the arguments; the caller guarantees
        // `data` is valid for `n` elements.
        unsafe { self.increment_u32.launch(stream, elements(n), &args) }
    }

    /// Queues a single thread that busy-waits `ns` nanoseconds on the GPU's global timer, keeping
    /// `stream` busy for at least that long. Touches no memory, hence safe.
    ///
    /// # Errors
    /// The launch's error.
    pub fn spin_ns(&self, stream: &Stream, ns: u64) -> Result<(), DriverError> {
        let args = KernelArgs::new().arg(&ns);
        // SAFETY: spin_ns(unsigned long long) matches the argument and dereferences no pointer.
        unsafe { self.spin_ns.launch(stream, LaunchConfig::single(), &args) }
    }

    /// Queues a single thread that busy-waits `ns` nanoseconds, then stores `value` to `*dst`
    /// with a volatile write followed by a system-wide fence, so a host polling mapped pinned
    /// memory sees it without synchronizing.
    ///
    /// # Safety
    /// `dst` must be a device-accessible address (device memory, or the device pointer of mapped
    /// pinned host memory) of the stream's context, valid for one `u32` until the kernel finishes.
    /// The host may read it meanwhile only with volatile or atomic reads.
    ///
    /// # Errors
    /// The launch's error.
    pub unsafe fn spin_then_store_u32(
        &self,
        stream: &Stream,
        ns: u64,
        dst: u64,
        value: u32,
    ) -> Result<(), DriverError> {
        let args = KernelArgs::new().arg(&ns).arg(&dst).arg(&value);
        // SAFETY: spin_then_store_u32(unsigned long long, unsigned*, unsigned) matches the
        // arguments; the caller guarantees `dst` is valid for one element.
        unsafe {
            self.spin_then_store_u32
                .launch(stream, LaunchConfig::single(), &args)
        }
    }

    /// Queues a single thread that busy-waits until `*flag == value` or `timeout_ns` has passed,
    /// holding back everything queued after it on `stream`: a gate the host opens.
    ///
    /// Queue the gate, queue the work to be timed (on any streams, each behind its own gate on
    /// the same flag), then write `value` to the flag (mapped pinned memory, volatile write): the
    /// work then starts together on the GPU however slowly the host enqueued it. The timeout
    /// keeps a test that panics before opening the gate from hanging the GPU; keep it to seconds.
    ///
    /// While a gate is closed, a driver call that synchronizes the context (`cuMemFree`,
    /// `cuMemFreeHost`, module unload, synchronous copies) blocks until it opens or times out,
    /// on every thread: open it promptly, make no such call in between, and run such tests under
    /// [`serial`](crate::serial).
    ///
    /// # Safety
    /// `flag` must be a device-accessible address (typically the device pointer of mapped pinned
    /// host memory) of the stream's context, valid for one `u32` until the kernel finishes. The
    /// host may write it meanwhile only with volatile or atomic writes.
    ///
    /// # Errors
    /// The launch's error.
    pub unsafe fn wait_u32(
        &self,
        stream: &Stream,
        flag: u64,
        value: u32,
        timeout_ns: u64,
    ) -> Result<(), DriverError> {
        let args = KernelArgs::new().arg(&flag).arg(&value).arg(&timeout_ns);
        // SAFETY: wait_u32(const unsigned*, unsigned, unsigned long long) matches the arguments;
        // the caller guarantees `flag` is valid for one element.
        unsafe { self.wait_u32.launch(stream, LaunchConfig::single(), &args) }
    }

    /// Queues `*out += data[0] + … + data[n-1]` (as `u64`, so it does not wrap). Zero `*out`
    /// first for a plain sum.
    ///
    /// # Safety
    /// `data` must be device-accessible memory of the stream's context valid for `n` `u32`s, and
    /// `out` valid for one 8-byte-aligned `u64`, both until the kernel finishes on `stream`; the
    /// host must not write `data` nor touch `out` meanwhile.
    ///
    /// # Errors
    /// The launch's error.
    pub unsafe fn checksum_u32(
        &self,
        stream: &Stream,
        data: u64,
        n: usize,
        out: u64,
    ) -> Result<(), DriverError> {
        let n = n as u64;
        let args = KernelArgs::new().arg(&data).arg(&n).arg(&out);
        let config = capped(elements(n), CHECKSUM_MAX_BLOCKS);
        // SAFETY: checksum_u32(const unsigned*, size_t, unsigned long long*) matches the
        // arguments; the caller guarantees both ranges are valid.
        unsafe { self.checksum_u32.launch(stream, config, &args) }
    }

    /// Queues a watcher that, for at least `ns` nanoseconds, rescans `data[0..n)` with volatile
    /// reads and adds to `*mismatches` the number of elements (over all scans) that differ from
    /// `expected`. Every element is read at least once.
    ///
    /// Fill `data` with `expected`, zero `*mismatches`, start the watch, then let the code under
    /// test free `data` and allocate on another stream: a non-zero count afterwards proves the
    /// memory was reused while this kernel still read it. A zero count proves something only if
    /// the other stream's work really overlapped the watch: the hardware serializes streams that
    /// share one of its few work queues (see [`serial`](crate::serial)), and the
    /// [`wait_u32`](Self::wait_u32) gate removes the host's enqueue speed from the timing.
    ///
    /// # Safety
    /// `data` must be device-accessible memory of the stream's context valid for `n` `u32`s and
    /// `mismatches` valid for one `u32`, both until the kernel finishes on `stream`. `data` may
    /// be written by other work meanwhile (catching that is the point) but must stay mapped;
    /// `mismatches` must not be touched by the host meanwhile.
    ///
    /// # Errors
    /// The launch's error.
    pub unsafe fn watch_u32(
        &self,
        stream: &Stream,
        data: u64,
        n: usize,
        expected: u32,
        ns: u64,
        mismatches: u64,
    ) -> Result<(), DriverError> {
        let n = n as u64;
        let args = KernelArgs::new()
            .arg(&data)
            .arg(&n)
            .arg(&expected)
            .arg(&ns)
            .arg(&mismatches);
        let config = capped(elements(n), WATCH_MAX_BLOCKS);
        // SAFETY: watch_u32(const unsigned*, size_t, unsigned, unsigned long long, unsigned*)
        // matches the arguments; the caller guarantees both ranges stay valid.
        unsafe { self.watch_u32.launch(stream, config, &args) }
    }
}

/// Most blocks an element-wise launch uses: the kernels loop grid-stride over the rest, so
/// tests with more elements exercise those loops.
const ELEMENT_MAX_BLOCKS: u32 = 65_535;

/// A 1-D launch giving each of `n` elements a thread, up to [`ELEMENT_MAX_BLOCKS`] blocks.
fn elements(n: u64) -> LaunchConfig {
    let blocks = n
        .div_ceil(u64::from(BLOCK))
        .clamp(1, u64::from(ELEMENT_MAX_BLOCKS));
    LaunchConfig {
        grid: (u32::try_from(blocks).unwrap_or(ELEMENT_MAX_BLOCKS), 1, 1),
        block: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `config` with at most `max_blocks` blocks (the kernel loops grid-stride over the rest).
fn capped(mut config: LaunchConfig, max_blocks: u32) -> LaunchConfig {
    config.grid.0 = config.grid.0.min(max_blocks);
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_defines_every_kernel() {
        for name in KERNEL_NAMES {
            assert!(
                PTX.contains(&format!(".visible .entry {name}(")),
                "test_kernels.ptx lacks `{name}`; run `cargo xtask ptx`"
            );
        }
    }

    #[test]
    fn ptx_is_generated_from_every_cu_kernel() {
        let source = include_str!("kernels/test_kernels.cu");
        let in_source = source.matches("__global__ void ").count();
        let in_ptx = PTX.matches(".visible .entry ").count();
        assert_eq!(in_source, in_ptx, "stale PTX; run `cargo xtask ptx`");
        assert_eq!(in_ptx, KERNEL_NAMES.len());
        for name in KERNEL_NAMES {
            assert!(source.contains(&format!("__global__ void {name}(")));
        }
    }

    #[test]
    fn launch_shapes_cover_the_elements_within_their_caps() {
        assert_eq!(elements(1000).grid.0, 4);
        assert_eq!(elements(0).grid.0, 1);
        assert_eq!(elements(u64::MAX).grid.0, ELEMENT_MAX_BLOCKS);
        assert_eq!(
            capped(elements(1 << 30), WATCH_MAX_BLOCKS).grid.0,
            WATCH_MAX_BLOCKS
        );
        assert_eq!(capped(elements(100), CHECKSUM_MAX_BLOCKS).grid.0, 1);
    }
}
