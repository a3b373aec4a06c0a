//! [`Stream`]: an ordered queue of device work, with priorities and host callbacks.
//!
//! The creation and write/wait flags are in `flags` ([`StreamFlags`], [`WriteOrdering`],
//! [`WaitCondition`]); what a dropped handle leaves behind in `end` ([`StreamEnd`],
//! [`ended_watched_streams`]); the handle that does not keep its stream in `weak`
//! ([`WeakStream`]).

use std::ffi::c_void;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::context::Context;
use crate::device::Device;
use crate::error::{DriverError, Result};
use crate::event::Event;
use crate::loader::{cu, driver};
use crate::sys;

mod end;
mod flags;
#[cfg(test)]
mod tests;
mod weak;

pub use end::{StreamEnd, ended_watched_streams};
pub use flags::{StreamFlags, WaitCondition, WriteOrdering};
pub use weak::WeakStream;

/// A CUDA stream of one context. Work queued on it runs in order; streams run concurrently.
///
/// Destroyed on drop: the driver lets queued work finish first and frees the stream after.
#[derive(Debug)]
pub struct Stream {
    context: Arc<Context>,
    raw: sys::CUstream,
    owned: bool,
    id: u64,
    /// The context's shared event pool, held once [`wait_stream`](Self::wait_stream) recorded
    /// on this stream: a join loop then reuses its events instead of making a pool and an
    /// event per call when nothing else holds the pool.
    join_events: std::sync::OnceLock<crate::EventPool>,
    /// What the handle leaves behind when dropped, made only once someone asked
    /// ([`end_watch`](Self::end_watch)): otherwise a drop records nothing.
    end: OnceLock<Arc<StreamEnd>>,
    /// What its weak handles share ([`downgrade`](Self::downgrade)), made by the first one; or,
    /// for the twin those handles lend out, the way back to it.
    weak: OnceLock<weak::Slot>,
}

/// Source of [`Stream::id`]s: never reused within a process, unlike raw handles.
static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

fn next_stream_id() -> u64 {
    NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed)
}

// SAFETY: a CUstream may be used from any thread once its context is current, which every method
// ensures; the driver serialises concurrent submissions to one stream.
unsafe impl Send for Stream {}
// SAFETY: as above; no method mutates `self`.
unsafe impl Sync for Stream {}

type HostCallback = Box<dyn FnOnce() + Send + 'static>;

unsafe extern "C" fn host_callback_trampoline(data: *mut c_void) {
    // SAFETY: `data` is the `Box<HostCallback>` leaked by `launch_host_fn`, which the driver hands
    // back exactly once: `launch_host_fn` refuses capturing streams, so the call is never
    // recorded into a graph whose every launch would hand it back again.
    let callback = unsafe { Box::from_raw(data.cast::<HostCallback>()) };
    // A panic must not unwind into the driver's thread.
    if std::panic::catch_unwind(AssertUnwindSafe(callback)).is_err() {
        tracing::error!("a stream host callback panicked; the panic was contained");
    }
}

impl Stream {
    /// Creates a stream in `context` with default priority.
    pub fn new(context: &Arc<Context>, flags: StreamFlags) -> Result<Self> {
        context.bind_to_thread()?;
        let api = driver()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        unsafe { cu!(api.stream_create(&mut raw, flags.bits())) }?;
        Ok(Self {
            context: Arc::clone(context),
            raw,
            owned: true,
            id: next_stream_id(),
            join_events: std::sync::OnceLock::new(),
            end: OnceLock::new(),
            weak: OnceLock::new(),
        })
    }

    /// Creates a stream with a priority from [`Context::stream_priority_range`] (lower is higher).
    ///
    /// # Errors
    /// `InvalidArgument` when `priority` lies outside the context's range.
    pub fn with_priority(
        context: &Arc<Context>,
        flags: StreamFlags,
        priority: i32,
    ) -> Result<Self> {
        let range = context.stream_priority_range()?;
        if !range.contains(priority) {
            return Err(DriverError::invalid(
                "Stream::with_priority",
                format!(
                    "priority {priority} outside the device's range {}..={}",
                    range.greatest, range.least
                ),
            ));
        }
        let api = driver()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current (bound by the range query).
        unsafe { cu!(api.stream_create_with_priority(&mut raw, flags.bits(), priority)) }?;
        Ok(Self {
            context: Arc::clone(context),
            raw,
            owned: true,
            id: next_stream_id(),
            join_events: std::sync::OnceLock::new(),
            end: OnceLock::new(),
            weak: OnceLock::new(),
        })
    }

    /// Wraps a stream another library created.
    ///
    /// # Safety
    /// `raw` must be a live stream of `context` (or null, the legacy default stream). With
    /// `owned`, the returned handle destroys it on drop and nobody else may; without, the stream
    /// must outlive the handle.
    pub unsafe fn from_raw(context: &Arc<Context>, raw: sys::CUstream, owned: bool) -> Self {
        Self {
            context: Arc::clone(context),
            raw,
            owned,
            id: next_stream_id(),
            join_events: std::sync::OnceLock::new(),
            end: OnceLock::new(),
            weak: OnceLock::new(),
        }
    }

    /// The legacy default stream of `context` (CUDA's "stream 0", the null `CUstream`): what
    /// cudarc's `default_stream()` and CUDA C++'s `0` stream are. Work on it waits for all
    /// earlier work on the context's blocking streams ([`StreamFlags::DEFAULT`]) and they wait
    /// for it; [`StreamFlags::NON_BLOCKING`] streams run beside it. It cannot be captured
    /// ([`GraphError::LegacyDefaultStream`](crate::GraphError::LegacyDefaultStream)).
    ///
    /// The handle owns nothing (dropping it destroys nothing) and is safe: the null stream
    /// exists as long as its context, which the handle keeps alive, and every method makes
    /// `context` current before using it, so the null handle always names this context's stream.
    pub fn legacy_default(context: &Arc<Context>) -> Self {
        Self {
            context: Arc::clone(context),
            raw: std::ptr::null_mut(),
            owned: false,
            id: next_stream_id(),
            join_events: std::sync::OnceLock::new(),
            end: OnceLock::new(),
            weak: OnceLock::new(),
        }
    }

    /// The raw `CUstream`.
    pub fn as_raw(&self) -> sys::CUstream {
        self.raw
    }

    /// A process-unique identity for this handle, never reused (raw `CUstream` values are
    /// recycled by the driver once a stream is destroyed, so they cannot key caches safely).
    /// Two handles made from the same raw stream with [`Stream::from_raw`] get different ids.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The [`StreamEnd`] of this handle, shared by everyone who asks: it says when the handle
    /// has been dropped and when the work queued through it before has finished.
    ///
    /// Once asked for, dropping the handle costs one pooled event record more; a handle nobody
    /// watched records nothing. `None` for a handle whose drop says nothing of its stream's
    /// end: one that does not own its stream ([`from_raw`](Self::from_raw) with `owned:
    /// false`: the stream lives on and takes more work through other handles) and a
    /// context-relative handle ([`is_special_handle`](Self::is_special_handle)).
    pub fn end_watch(&self) -> Option<Arc<StreamEnd>> {
        self.owns_its_stream()
            .then(|| Arc::clone(self.end.get_or_init(Arc::default)))
    }

    /// Whether this handle owns its stream: made by [`new`](Self::new) or
    /// [`with_priority`](Self::with_priority), or taken over with [`from_raw`](Self::from_raw)
    /// and `owned: true`, and not a context-relative name
    /// ([`is_special_handle`](Self::is_special_handle)). Dropping such a handle destroys the
    /// stream, so no work can be queued on it afterwards.
    pub fn owns_its_stream(&self) -> bool {
        self.owned && !self.is_special_handle()
    }

    /// The context this stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// The device this stream runs on.
    pub fn device(&self) -> Device {
        self.context.device()
    }

    /// The stream's priority (lower is higher).
    pub fn priority(&self) -> Result<i32> {
        self.context.bind_to_thread()?;
        let api = driver()?;
        let mut priority = 0;
        // SAFETY: valid out-pointer; live stream.
        unsafe { cu!(api.stream_get_priority(self.raw, &mut priority)) }?;
        Ok(priority)
    }

    /// The flags the stream was created with.
    pub fn flags(&self) -> Result<StreamFlags> {
        self.context.bind_to_thread()?;
        let api = driver()?;
        let mut bits = 0;
        // SAFETY: valid out-pointer; live stream.
        unsafe { cu!(api.stream_get_flags(self.raw, &mut bits)) }?;
        Ok(StreamFlags {
            non_blocking: bits & sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0 != 0,
        })
    }

    /// Whether all work queued so far has finished (`false` while some is pending).
    ///
    /// One driver call (`cuStreamQuery`) and no allocation for a stream this crate created: it
    /// names its own context, so the query leaves the calling thread's current context as it is.
    /// The special handles (null, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) mean "the current
    /// context's stream", so for them the context is made current first. When the driver
    /// answers with another error, the context is made current and the query asked again; that
    /// answer stands.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing) for a capturing stream, from a
    /// thread whose capture mode forbids queries, and for the legacy default stream while a
    /// blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the driver's error.
    ///
    /// No capture begun through cuweave begins between the refusal's check and the query, which
    /// would break a global-mode capture begun on another thread meanwhile: a query made while
    /// one begins waits for it (microseconds), then is refused or made.
    pub fn query(&self) -> Result<bool> {
        crate::graph::between_capture_begins(|| self.query_between_capture_begins())
    }

    fn query_between_capture_begins(&self) -> Result<bool> {
        crate::graph::refuse_on_legacy_stream(self, "Stream::query")?;
        crate::graph::refuse_while_capturing(Some(self), "Stream::query")?;
        let api = driver()?;
        if !self.is_special_handle() {
            // SAFETY: live stream.
            match unsafe { cu!(api.stream_query(self.raw)) } {
                Ok(()) => return Ok(true),
                Err(error) if error.is_not_ready() => return Ok(false),
                Err(_) => {}
            }
        }
        self.context.bind_to_thread()?;
        // SAFETY: live stream; its context is current.
        match unsafe { cu!(api.stream_query(self.raw)) } {
            Ok(()) => Ok(true),
            Err(error) if error.is_not_ready() => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// Whether the handle is one of the driver's context-relative stream names (`NULL`,
    /// `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`): one handle that can name several streams,
    /// so its [`id`](Self::id) does not identify the stream work goes to.
    pub fn is_special_handle(&self) -> bool {
        (self.raw as usize) <= 2
    }

    /// Whether the handle is `CU_STREAM_PER_THREAD`, which names a different stream on each
    /// thread.
    pub fn is_per_thread_default(&self) -> bool {
        self.raw as usize == 2
    }

    /// Blocks until all work queued so far has finished.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing) for a capturing stream, from a
    /// thread whose capture mode forbids synchronisations, and for the legacy default stream
    /// while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the driver's error.
    pub fn synchronize(&self) -> Result<()> {
        crate::graph::refuse_on_legacy_stream(self, "Stream::synchronize")?;
        crate::graph::refuse_while_capturing(Some(self), "Stream::synchronize")?;
        self.context.bind_to_thread()?;
        let api = driver()?;
        // Relaxed once the refusals passed: a global-mode capture another thread begins after
        // the check is then neither broken by the wait nor raced by the driver's own check of
        // it (that race was seen to crash inside the driver).
        let _relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: live stream.
        unsafe { cu!(api.stream_synchronize(self.raw)) }
    }

    /// Makes later work on this stream wait for all work queued on `other` so far (device-side;
    /// the host does not block): cudarc's `stream.join(&other)`, CUDA C++'s record-then-wait.
    /// An event from the context's shared [`EventPool`](crate::EventPool) is recorded on
    /// `other` and waited on here, then returned to the pool (the queued wait is unaffected).
    /// `other` may belong to another device.
    ///
    /// A capturing stream may wait only on streams of its own capture, and the legacy default
    /// stream not on a capturing one: other waits would break the capture, and are refused
    /// before anything is queued (see
    /// [`refuse_wait_across_capture`](crate::graph::refuse_wait_across_capture)). An eager
    /// stream that waits on a capturing one joins its capture (a fork).
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing) or
    /// [`GraphError::LegacyDefaultStream`](crate::GraphError::LegacyDefaultStream) for a wait
    /// across a capture's boundary; [`GraphError::Capturing`](crate::GraphError::Capturing)
    /// when either stream is the legacy default stream while a blocking stream of its context
    /// captures ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the
    /// driver's error from recording or waiting. Nothing is queued when refused.
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        crate::graph::refuse_on_legacy_stream(self, "Stream::wait_stream")?;
        crate::graph::refuse_on_legacy_stream(other, "Stream::wait_stream")?;
        crate::graph::refuse_wait_across_capture(self, other, "Stream::wait_stream")?;
        let pool = match other.join_events.get() {
            Some(pool) => pool,
            None => {
                let pool = crate::EventPool::for_context(other.context())?;
                other.join_events.get_or_init(|| pool)
            }
        };
        let event = pool.acquire_event(false)?;
        event.record(other)?;
        // Checked above, from `other` itself: the event's record says the same.
        self.queue_wait(&event)
    }

    /// A new [`StreamFlags::NON_BLOCKING`] stream of the same context whose work runs after
    /// everything queued on this one so far: cudarc's `stream.fork()`. Join it back with
    /// [`wait_stream`](Self::wait_stream) on this stream.
    ///
    /// # Errors
    /// The driver's error from creating the stream, recording or waiting.
    pub fn fork(&self) -> Result<Stream> {
        let child = Stream::new(&self.context, StreamFlags::NON_BLOCKING)?;
        child.wait_stream(self)?;
        Ok(child)
    }

    /// Makes later work on this stream wait until `event` has completed (device-side; the host
    /// does not block). The event may belong to another stream or device.
    ///
    /// While this stream captures, an event last recorded (through [`Event::record`]) outside
    /// its capture is refused before the wait is queued, as [`wait_stream`](Self::wait_stream)
    /// refuses: the driver would invalidate the capture. An event never recorded through
    /// cuweave is left to the driver. Where an event went is looked up at the record only while
    /// a capture begun through cuweave is active: an event recorded into another library's
    /// capture before then counts as eager, and one re-recorded through its raw handle keeps
    /// what `record` last saw.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing) or
    /// [`GraphError::LegacyDefaultStream`](crate::GraphError::LegacyDefaultStream) for a wait
    /// across a capture's boundary; [`GraphError::Capturing`](crate::GraphError::Capturing)
    /// for the legacy default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the driver's error.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        crate::graph::refuse_on_legacy_stream(self, "Stream::wait_event")?;
        if crate::graph::active_captures() != 0 {
            crate::graph::refuse_dependency_across_capture(
                self,
                event.recorded_in(),
                "Stream::wait_event",
            )?;
        }
        self.queue_wait(event)
    }

    /// `cuStreamWaitEvent`, the capture rule already checked.
    fn queue_wait(&self, event: &Event) -> Result<()> {
        self.context.bind_to_thread()?;
        let api = driver()?;
        // SAFETY: live stream and event; flags must be 0.
        unsafe { cu!(api.stream_wait_event(self.raw, event.as_raw(), 0)) }
    }

    /// Queues `callback` to run on a driver thread once all earlier work on the stream is done;
    /// later work waits for it to return.
    ///
    /// The callback must not call CUDA (the driver forbids it and may deadlock): hand work to
    /// your own threads or wake a future instead. A panic in it is caught and logged.
    ///
    /// Refused on a capturing stream: the driver would record a host node into the graph, run
    /// it at every launch of the graph with the same pointer, and a `FnOnce` can run (and be
    /// freed) only once. The check asks the driver every time (`cuStreamIsCapturing`, small
    /// beside `cuLaunchHostFunc`), so captures begun outside cuweave are refused too.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing) when the stream is capturing, or
    /// is the legacy default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the driver's error
    /// when the launch fails. Either way `callback` is dropped without running.
    pub fn launch_host_fn<F>(&self, callback: F) -> Result<()>
    where
        F: FnOnce() + Send + 'static,
    {
        crate::graph::refuse_on_legacy_stream(self, "Stream::launch_host_fn")?;
        // On refusal `callback` is dropped here, before it is boxed: nothing leaks. The check
        // (`Always`) also makes the stream's context current, which the launch needs too.
        crate::graph::refuse_recording(
            self,
            crate::graph::StatusCheck::Always,
            "Stream::launch_host_fn",
            "a host function recorded into a graph would run at every launch, but its FnOnce can run only once",
        )?;
        let api = driver()?;
        let boxed: Box<HostCallback> = Box::new(Box::new(callback));
        let data = Box::into_raw(boxed).cast::<c_void>();
        // SAFETY: the trampoline matches CUhostFn and takes ownership of `data` when it runs.
        let outcome =
            unsafe { cu!(api.launch_host_func(self.raw, Some(host_callback_trampoline), data)) };
        if outcome.is_err() {
            // SAFETY: the driver rejected the launch, so it will never call the trampoline: we
            // still own `data` and reclaim it exactly once.
            drop(unsafe { Box::from_raw(data.cast::<HostCallback>()) });
        }
        outcome
    }

    /// Queues a write of `value` to the 32-bit word at `address`: it lands once all earlier work
    /// on the stream has finished (with [`WriteOrdering::AfterPriorWrites`], after that work's
    /// memory writes are visible too). `cuStreamWriteValue32`.
    ///
    /// The word may be device memory or mapped pinned host memory (its device address from
    /// `cuMemHostGetDevicePointer`), which lets the host observe the stream's progress with plain
    /// loads.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing queued, for the legacy
    /// default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the driver's error.
    ///
    /// # Safety
    /// `address` is 4-byte aligned memory that this stream's device can write, valid until the
    /// stream has passed the write, and nothing else reads or writes it non-atomically meanwhile.
    pub unsafe fn write_value_u32(
        &self,
        address: sys::CUdeviceptr,
        value: u32,
        ordering: WriteOrdering,
    ) -> Result<()> {
        crate::graph::refuse_on_legacy_stream(self, "Stream::write_value_u32")?;
        self.context.bind_to_thread()?;
        let api = driver()?;
        // SAFETY: live stream; the caller's contract covers `address`.
        unsafe { cu!(api.stream_write_value32(self.raw, address, value, ordering.bits())) }
    }

    /// Queues a write of `value` to the 64-bit word at `address`; see [`Stream::write_value_u32`].
    /// `cuStreamWriteValue64`.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing queued, for the legacy
    /// default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the driver's error.
    ///
    /// # Safety
    /// As [`Stream::write_value_u32`], with 8-byte alignment.
    pub unsafe fn write_value_u64(
        &self,
        address: sys::CUdeviceptr,
        value: u64,
        ordering: WriteOrdering,
    ) -> Result<()> {
        crate::graph::refuse_on_legacy_stream(self, "Stream::write_value_u64")?;
        self.context.bind_to_thread()?;
        let api = driver()?;
        // SAFETY: live stream; the caller's contract covers `address`.
        unsafe { cu!(api.stream_write_value64(self.raw, address, value, ordering.bits())) }
    }

    /// Makes later work on this stream wait (on the device) until the 32-bit word at `address`
    /// meets `condition` against `value`. `cuStreamWaitValue32`.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing queued, for the legacy
    /// default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the driver's error.
    ///
    /// The driver does not see this wait as a dependency, so it can deadlock the device when
    /// the work meant to satisfy it is queued *after* the wait on another stream that shares
    /// this one's hardware queue (streams alias once there are more than
    /// `CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default): queue the producer's work first, or
    /// satisfy the word from the host.
    ///
    /// # Safety
    /// `address` is 4-byte aligned memory this stream's device can read, valid until the wait
    /// has been satisfied. A condition nothing ever meets stalls the stream forever.
    pub unsafe fn wait_value_u32(
        &self,
        address: sys::CUdeviceptr,
        value: u32,
        condition: WaitCondition,
    ) -> Result<()> {
        crate::graph::refuse_on_legacy_stream(self, "Stream::wait_value_u32")?;
        self.context.bind_to_thread()?;
        let api = driver()?;
        // SAFETY: live stream; the caller's contract covers `address`.
        unsafe { cu!(api.stream_wait_value32(self.raw, address, value, condition.bits())) }
    }

    /// Makes later work on this stream wait until the 64-bit word at `address` meets
    /// `condition`; see [`Stream::wait_value_u32`]. `cuStreamWaitValue64`.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing queued, for the legacy
    /// default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the driver's error.
    ///
    /// # Safety
    /// As [`Stream::wait_value_u32`], with 8-byte alignment.
    pub unsafe fn wait_value_u64(
        &self,
        address: sys::CUdeviceptr,
        value: u64,
        condition: WaitCondition,
    ) -> Result<()> {
        crate::graph::refuse_on_legacy_stream(self, "Stream::wait_value_u64")?;
        self.context.bind_to_thread()?;
        let api = driver()?;
        // SAFETY: live stream; the caller's contract covers `address`.
        unsafe { cu!(api.stream_wait_value64(self.raw, address, value, condition.bits())) }
    }

    /// An error unless work that `context` queues lands on this stream, for calls that make
    /// `context` current and pass this stream's handle: the stream must belong to `context`'s
    /// device, and a special handle ([`legacy_default`](Self::legacy_default), the per-thread
    /// default), which names the stream of whatever context is current, must belong to
    /// `context` itself. Without that, the legacy stream of another context on the same device
    /// (one made by another library, wrapped with [`Context::from_raw_borrowed`]) would be
    /// read as `context`'s own, and the work would be ordered on the wrong stream.
    pub fn ensure_context(&self, context: &Context, operation: &'static str) -> Result<()> {
        self.ensure_device(context.device(), operation)?;
        if self.is_special_handle() && self.context.as_raw() != context.as_raw() {
            return Err(DriverError::invalid(
                operation,
                "the stream is the default stream of another context on this device; its handle would name the current context's default stream instead",
            ));
        }
        Ok(())
    }

    /// An error unless this stream belongs to `device`: a stream is usable only on its own device.
    pub fn ensure_device(&self, device: Device, operation: &'static str) -> Result<()> {
        if self.device() == device {
            Ok(())
        } else {
            Err(DriverError::invalid(
                operation,
                format!(
                    "stream belongs to device {}, not device {}",
                    self.device().ordinal(),
                    device.ordinal()
                ),
            ))
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Weak handles' closures finish first; those after find the handle gone, with its end
        // recorded (when the guard drops, at the end of this function).
        let retiring = self.retire_weak();
        // A handle that does not own its stream destroys nothing, and is never watched
        // (`end_watch` takes only owning handles); a downgraded borrowed one records its end.
        if !self.owned || self.raw.is_null() {
            if let Some(retiring) = &retiring {
                retiring.end().record(self);
            }
            return;
        }
        let Ok(api) = driver() else { return };
        if let Err(error) = self.context.bind_to_thread() {
            tracing::warn!(%error, "binding context to destroy a stream failed");
            if let Some(end) = self.end.get() {
                end.set(None);
            }
            return;
        }
        self.abandon_capture();
        if let Some(end) = self.end.get() {
            end.record(self);
        }
        // Relaxed: a stream may be dropped while another thread captures in global mode.
        let _relaxed = crate::graph::relaxed_for_unrecorded_call();
        // SAFETY: we created this stream and destroy it once; queued work still completes.
        if let Err(error) = unsafe { cu!(api.stream_destroy(self.raw)) } {
            tracing::warn!(%error, "destroying a stream failed");
        }
    }
}
