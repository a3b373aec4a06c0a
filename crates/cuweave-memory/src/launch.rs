//! [`TrackedLaunch`]: a kernel launch that orders itself with the buffers it reads and writes.
//!
//! Launching a kernel by hand on buffers means calling `prepare_*` on each before the launch and
//! `record_*` after, on the right stream, with the right access. The builder takes the buffers
//! as arguments, each declared read or written, and does that itself around one launch, under
//! the same protocol as the buffers' own operations:
//!
//! - a buffer declared **read** makes the stream wait only for its last write; reads on other
//!   streams are not waited for, so kernels that share an input run at once;
//! - a buffer declared **written** makes the stream wait for its last write *and* every read
//!   since, on every stream (cudarc's launch builder keeps one read event per buffer, so a
//!   writer there waits only for the latest reader; here each reading stream has its own);
//! - after the launch, each buffer records the access.
//!
//! A buffer that is both read and written by a kernel is declared written. Uses on the stream
//! that used a buffer last skip the wait and re-record that stream's event.

use cuweave_driver::{Kernel, KernelArgs, LaunchConfig, Stream};

use crate::buffer::Buffer;
use crate::buffer::tracker::{self, Access, Part};
use crate::element::Element;
use crate::error::Result;

/// A kernel launch on one stream whose buffer arguments are declared read or written, so that
/// the launch waits for, and is recorded on, exactly the uses it conflicts with.
///
/// Arguments are passed in the kernel's parameter order: [`read`](Self::read) and
/// [`write`](Self::write) pass the buffer's device address (a `T*` parameter); [`arg`](Self::arg)
/// passes a plain value.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, LaunchConfig, Module, Stream, StreamFlags};
/// use cuweave_memory::{Buffer, DeviceBuffer, TrackedLaunch};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// # let ptx = "";
/// let context = Context::primary(Device::get(0)?)?;
/// let kernel = Module::from_ptx(&context, ptx)?.function("scale")?;
/// let (a, b) = (
///     Stream::new(&context, StreamFlags::NON_BLOCKING)?,
///     Stream::new(&context, StreamFlags::NON_BLOCKING)?,
/// );
/// let weights = DeviceBuffer::<f32>::from_slice(&context, &[1.0; 1024])?;
/// let (mut out_a, mut out_b) = (DeviceBuffer::<f32>::new_on(&a, 1024)?, DeviceBuffer::<f32>::new_on(&b, 1024)?);
/// let n = 1024u32;
/// let config = LaunchConfig::for_elements(1024, 256)?;
/// // Both launches read `weights`: they run at once on `a` and `b`.
/// // SAFETY: `scale(const float* in, float* out, unsigned n)` reads and writes n elements.
/// unsafe {
///     TrackedLaunch::new(&kernel, &a, config).read(&weights).write(&mut out_a).arg(&n).launch()?;
///     TrackedLaunch::new(&kernel, &b, config).read(&weights).write(&mut out_b).arg(&n).launch()?;
/// }
/// assert_eq!(weights.concurrent_readers(), 2);
/// # Ok(())
/// # }
/// ```
#[must_use = "a launch does nothing until `launch` is called"]
pub struct TrackedLaunch<'a> {
    kernel: &'a Kernel,
    stream: &'a Stream,
    config: LaunchConfig,
    args: KernelArgs<'a>,
    uses: Vec<(Part<'a>, Access)>,
}

impl<'a> TrackedLaunch<'a> {
    /// A launch of `kernel` on `stream` with `config`, with no arguments yet.
    pub fn new(kernel: &'a Kernel, stream: &'a Stream, config: LaunchConfig) -> Self {
        Self {
            kernel,
            stream,
            config,
            args: KernelArgs::new(),
            uses: Vec::new(),
        }
    }

    /// Passes `buffer`'s device address as the next argument, declared read-only.
    pub fn read<T: Element, B: Buffer<T> + ?Sized>(mut self, buffer: &'a B) -> Self {
        let core = buffer.core();
        self.args = self.args.arg(core.ptr_ref());
        self.uses.push((core.part(), Access::Read));
        self
    }

    /// Passes `buffer`'s device address as the next argument, declared written (or read and
    /// written).
    ///
    /// Takes the buffer mutably (as cudarc's launch builder does for outputs): no host slice
    /// of it, nor any other borrow, can live while the launch is being built. This does not
    /// compile (a regression test of the hole `&B` left open):
    ///
    /// ```compile_fail
    /// use std::sync::Arc;
    /// use cuweave_driver::{Context, Kernel, LaunchConfig, Stream};
    /// use cuweave_memory::{PinnedBuffer, TrackedLaunch};
    ///
    /// fn race(kernel: &Kernel, stream: &Stream, config: LaunchConfig, context: &Arc<Context>)
    ///     -> cuweave_memory::Result<()> {
    ///     let mut pinned = PinnedBuffer::<u32>::new(context, 4)?;
    ///     let host = pinned.as_slice()?; // a live host slice...
    ///     let launch = TrackedLaunch::new(kernel, stream, config).write(&mut pinned); // ...refused
    ///     assert_eq!(host[0], 0);
    ///     drop(launch);
    ///     Ok(())
    /// }
    /// ```
    pub fn write<T: Element, B: Buffer<T> + ?Sized>(mut self, buffer: &'a mut B) -> Self {
        let buffer: &'a B = buffer;
        let core = buffer.core();
        self.args = self.args.arg(core.ptr_ref());
        self.uses.push((core.part(), Access::Write));
        self
    }

    /// Orders the launch after `buffer`'s conflicting uses as a read, and records it, without
    /// passing the buffer as an argument (for a kernel that reaches it another way, e.g.
    /// through a pointer table).
    pub fn reads<T: Element, B: Buffer<T> + ?Sized>(mut self, buffer: &'a B) -> Self {
        self.uses.push((buffer.core().part(), Access::Read));
        self
    }

    /// Orders the launch after `buffer`'s conflicting uses as `access` says, and records it,
    /// without passing the buffer as an argument. Takes the buffer mutably, as
    /// [`write`](Self::write) does, whatever the access.
    pub fn uses<T: Element, B: Buffer<T> + ?Sized>(
        mut self,
        buffer: &'a mut B,
        access: Access,
    ) -> Self {
        let buffer: &'a B = buffer;
        self.uses.push((buffer.core().part(), access));
        self
    }

    /// Passes a plain value as the next argument.
    pub fn arg<V: Copy>(mut self, value: &'a V) -> Self {
        self.args = self.args.arg(value);
        self
    }

    /// The buffers declared so far, with their access.
    pub fn declared(&self) -> impl Iterator<Item = Access> + '_ {
        self.uses.iter().map(|(_, access)| *access)
    }

    /// Makes the stream wait for the declared buffers' conflicting uses, queues the kernel,
    /// and records each buffer's access.
    ///
    /// # Safety
    /// As [`Kernel::launch`]: the arguments must match the kernel's parameters in number,
    /// order, size and layout, and the kernel must touch each buffer only within its length and
    /// only as declared (a buffer declared read must not be written: readers on other streams
    /// run at the same time). Other memory it dereferences is the caller's to keep valid.
    ///
    /// # Errors
    /// `WrongDevice` for a buffer of another device than the stream; the driver's error when a
    /// wait, the launch or a record fails (after which the stream has been synchronized).
    pub unsafe fn launch(self) -> Result<()> {
        let Self {
            kernel,
            stream,
            config,
            args,
            uses,
        } = self;
        tracker::run_uses("TrackedLaunch::launch", stream, &uses, || {
            // SAFETY: the caller upholds the kernel's contract (see above); the buffers'
            // addresses are live for the borrow `'a`, and `run_uses` ordered this stream after
            // the uses the declared accesses conflict with.
            unsafe { kernel.launch(stream, config, &args) }?;
            Ok(())
        })?;
        Ok(())
    }
}

impl std::fmt::Debug for TrackedLaunch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackedLaunch")
            .field("kernel", &self.kernel.name())
            .field("stream", &self.stream.id())
            .field("config", &self.config)
            .field("arguments", &self.args.len())
            .field(
                "buffers",
                &self.uses.iter().map(|(_, a)| *a).collect::<Vec<_>>(),
            )
            .finish()
    }
}
