//! [`Context`]: a device's primary context, retained while any handle needs it.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::device::Device;
use crate::error::Result;
use crate::loader::{cu, driver};
use crate::sys;

/// A device's primary context (the one the CUDA runtime and PyTorch also use).
///
/// Created retained with [`Context::primary`] and released on drop. Every safe handle holds an
/// `Arc<Context>` and makes it current on the calling thread before a driver call
/// ([`Context::bind_to_thread`]), so handles can be used from any thread.
///
/// # The thread's current context
/// `cuCtxSetCurrent` state is per thread and shared with every other CUDA user in the process
/// (a library linking the CUDA runtime reads it as "the current device"). What cuweave does to
/// it:
/// - [`bind_to_thread`](Self::bind_to_thread), and so every method of a safe handle that calls
///   it (allocation, copies, launches, recording, synchronising, …), leaves the handle's context
///   current on the calling thread after it returns, and does not restore the previous one.
/// - [`Event::query`](crate::Event::query) and [`Stream::query`](crate::Stream::query) on a
///   stream it created leave the current context alone on their fast path.
/// - [`make_current_scoped`](Self::make_current_scoped) makes the context current and gives a
///   guard that puts the previous current context (or none) back when dropped: wrap cuweave
///   calls in it where code on the same thread relies on its own current context.
#[derive(Debug)]
pub struct Context {
    device: Device,
    raw: sys::CUcontext,
    owned: bool,
}

// SAFETY: a CUcontext may be made current on, and used from, any thread; the driver synchronises
// its own state. The handle itself is an immutable pointer value.
unsafe impl Send for Context {}
// SAFETY: as above; no method mutates `self`.
unsafe impl Sync for Context {}

/// The range of stream priorities a context offers. Lower numbers are higher priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPriorityRange {
    /// The lowest priority (numerically greatest, usually 0).
    pub least: i32,
    /// The highest priority (numerically least, e.g. -5).
    pub greatest: i32,
}

impl StreamPriorityRange {
    /// Whether `priority` lies inside the range (either way round: a range built by hand with
    /// its ends swapped means the same integers).
    pub fn contains(&self, priority: i32) -> bool {
        let (low, high) = self.bounds();
        (low..=high).contains(&priority)
    }

    /// Clamps `priority` into the range, as the driver itself does (either way round).
    pub fn clamp(&self, priority: i32) -> i32 {
        let (low, high) = self.bounds();
        priority.clamp(low, high)
    }

    /// The range's ends, numerically least first.
    fn bounds(&self) -> (i32, i32) {
        (self.greatest.min(self.least), self.greatest.max(self.least))
    }
}

/// Free and total device memory, as `cuMemGetInfo` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes free on the device.
    pub free: usize,
    /// Bytes the device has in all.
    pub total: usize,
}

impl Context {
    /// Retains `device`'s primary context.
    pub fn primary(device: Device) -> Result<Arc<Self>> {
        let api = driver()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the device handle came from cuDeviceGet.
        unsafe { cu!(api.device_primary_ctx_retain(&mut raw, device.as_raw())) }?;
        Ok(Arc::new(Self {
            device,
            raw,
            owned: true,
        }))
    }

    /// Wraps a context another library created, without taking ownership: dropping the
    /// returned handle does not release it.
    ///
    /// # Safety
    /// `raw` must be a live context of `device`, and must outlive every handle made from it.
    pub unsafe fn from_raw_borrowed(raw: sys::CUcontext, device: Device) -> Arc<Self> {
        Arc::new(Self {
            device,
            raw,
            owned: false,
        })
    }

    /// Whether this handle wraps a context another library owns
    /// ([`from_raw_borrowed`](Self::from_raw_borrowed)): it holds no reference of its own, so
    /// nothing may keep it beyond the owner's lifetime (process-wide caches do not take such
    /// contexts).
    pub fn is_borrowed(&self) -> bool {
        !self.owned
    }

    /// The device this context belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw `CUcontext`.
    pub fn as_raw(&self) -> sys::CUcontext {
        self.raw
    }

    /// The calling thread's current context (`cuCtxGetCurrent`): null when none is current.
    pub fn current_raw() -> Result<sys::CUcontext> {
        let api = driver()?;
        let mut current = std::ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer.
        unsafe { cu!(api.ctx_get_current(&mut current)) }?;
        Ok(current)
    }

    /// Makes this context current on the calling thread and returns a guard that makes the
    /// previously current context (or none) current again when dropped, on this thread.
    ///
    /// Calls made while the guard lives may bind other contexts (each cuweave handle binds its
    /// own); the guard restores the context that was current when it was made, whatever
    /// happened in between. Guards nest: drop them in reverse order of creation (the normal
    /// scope order). The previous context must still be alive when the guard drops (the guard
    /// does not retain it); a failure to restore goes to `tracing`.
    ///
    /// # Errors
    /// The driver's error from `cuCtxGetCurrent` or `cuCtxSetCurrent`; the thread's current
    /// context is unchanged then.
    pub fn make_current_scoped(&self) -> Result<CurrentContextGuard<'_>> {
        let previous = Self::current_raw()?;
        self.bind_to_thread()?;
        Ok(CurrentContextGuard {
            previous,
            _context: PhantomData,
        })
    }

    /// Makes this context current on the calling thread; cheap when it already is
    /// (`cuCtxGetCurrent`, then `cuCtxSetCurrent` only if another context, or none, was
    /// current).
    ///
    /// The context stays current after this returns: the previous current context is not
    /// restored. Use [`make_current_scoped`](Self::make_current_scoped) for that.
    pub fn bind_to_thread(&self) -> Result<()> {
        let api = driver()?;
        let mut current = std::ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer.
        unsafe { cu!(api.ctx_get_current(&mut current)) }?;
        if current != self.raw {
            // SAFETY: `self.raw` is a live context (retained by us, or guaranteed by from_raw's caller).
            unsafe { cu!(api.ctx_set_current(self.raw)) }?;
        }
        Ok(())
    }

    /// Blocks until all work queued in this context has finished.
    pub fn synchronize(&self) -> Result<()> {
        // No capture may begin between the check and the synchronisation: one begun on another
        // thread in that gap would be broken by it (a capture begin waits for this to return).
        crate::graph::while_no_capture_begins(|| {
            if crate::graph::active_captures() != 0 {
                return Err(crate::graph::GraphError::Capturing {
                    operation: "Context::synchronize",
                    reason: "a context synchronisation waits on the capturing streams too",
                }
                .into());
            }
            self.synchronize_beside_captures()
        })
    }

    /// [`synchronize`](Self::synchronize) while captures of other contexts may be active: for a
    /// synchronised capture begin that has checked, with no capture able to begin, that none is
    /// active in this context (the caller's part), in relaxed capture mode.
    pub(crate) fn synchronize_beside_captures(&self) -> Result<()> {
        self.bind_to_thread()?;
        let api = driver()?;
        // SAFETY: the context is current on this thread.
        unsafe { cu!(api.ctx_synchronize()) }
    }

    /// The stream priorities this context offers.
    pub fn stream_priority_range(&self) -> Result<StreamPriorityRange> {
        self.bind_to_thread()?;
        let api = driver()?;
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: both are valid out-pointers; the context is current.
        unsafe { cu!(api.ctx_get_stream_priority_range(&mut least, &mut greatest)) }?;
        Ok(StreamPriorityRange { least, greatest })
    }

    /// Free and total memory of this context's device.
    pub fn memory_info(&self) -> Result<MemoryInfo> {
        self.bind_to_thread()?;
        let api = driver()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: both are valid out-pointers; the context is current.
        unsafe { cu!(api.mem_get_info(&mut free, &mut total)) }?;
        Ok(MemoryInfo { free, total })
    }

    /// Lets kernels and copies in this context access memory of `peer`'s device directly.
    ///
    /// Idempotent: enabling an already-enabled pair is `Ok`. Fails with `InvalidArgument` for
    /// the same device, and with the driver's `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED` where the
    /// hardware cannot (check [`Device::can_access_peer`] first).
    pub fn enable_peer_access(&self, peer: &Context) -> Result<()> {
        if peer.device == self.device {
            return Err(crate::DriverError::invalid(
                "Context::enable_peer_access",
                format!("device {} cannot be its own peer", self.device.ordinal()),
            ));
        }
        self.bind_to_thread()?;
        let api = driver()?;
        // SAFETY: this context is current and `peer.raw` is a live context; flags must be 0.
        let outcome = unsafe { cu!(api.ctx_enable_peer_access(peer.raw, 0)) };
        match outcome {
            Err(error)
                if error.code() == Some(sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) =>
            {
                Ok(())
            }
            Err(error) => Err(error),
            Ok(()) => {
                tracing::info!(
                    from = self.device.ordinal(),
                    to = peer.device.ordinal(),
                    "peer access enabled"
                );
                Ok(())
            }
        }
    }
}

/// Restores the thread's previous current context when dropped; made by
/// [`Context::make_current_scoped`]. Not `Send`: it must drop on the thread that made it.
#[must_use = "dropping the guard at once restores the previous context immediately"]
#[derive(Debug)]
pub struct CurrentContextGuard<'a> {
    previous: sys::CUcontext,
    // Borrows the context made current, and ties the guard to its thread (`*const` is !Send).
    _context: PhantomData<(&'a Context, *const ())>,
}

impl CurrentContextGuard<'_> {
    /// The context that was current when the guard was made, and will be again after it
    /// (null: none).
    pub fn previous_raw(&self) -> sys::CUcontext {
        self.previous
    }
}

impl Drop for CurrentContextGuard<'_> {
    fn drop(&mut self) {
        let Ok(api) = driver() else { return };
        // SAFETY: `previous` was current on this thread when the guard was made (null means
        // none, which cuCtxSetCurrent accepts); that it is still alive is the documented
        // contract of `make_current_scoped` (whoever made it current owns it).
        if let Err(error) = unsafe { cu!(api.ctx_set_current(self.previous)) } {
            tracing::warn!(%error, "restoring the previous current context failed");
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let Ok(api) = driver() else { return };
        // SAFETY: we retained this device's primary context in `primary` and release it once.
        if let Err(error) = unsafe { cu!(api.device_primary_ctx_release(self.device.as_raw())) } {
            tracing::warn!(%error, device = self.device.ordinal(), "releasing primary context failed");
        }
    }
}
