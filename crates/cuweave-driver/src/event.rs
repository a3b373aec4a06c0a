//! [`Event`]: a marker in a stream's work, for ordering, polling and timing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::context::Context;
use crate::device::Device;
use crate::error::{DriverError, Result};
use crate::loader::{cu, driver};
use crate::stream::Stream;
use crate::sys;

/// Creation flags for an [`Event`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventFlags {
    timing: bool,
    blocking_sync: bool,
}

impl Default for EventFlags {
    fn default() -> Self {
        Self::TIMING
    }
}

impl EventFlags {
    /// Records timestamps, so [`Event::elapsed_ms`] works.
    pub const TIMING: Self = Self {
        timing: true,
        blocking_sync: false,
    };
    /// No timestamps: cheaper to record and to wait on (what pools and synchronisation use).
    pub const DISABLE_TIMING: Self = Self {
        timing: false,
        blocking_sync: false,
    };

    /// The same flags, with `synchronize` blocking the thread instead of spinning.
    #[must_use]
    pub fn with_blocking_sync(mut self) -> Self {
        self.blocking_sync = true;
        self
    }

    /// Whether the event records timestamps.
    pub fn is_timing(&self) -> bool {
        self.timing
    }

    /// Whether waiting on the event yields the thread.
    pub fn is_blocking_sync(&self) -> bool {
        self.blocking_sync
    }

    fn bits(self) -> u32 {
        let mut bits = sys::CUevent_flags::CU_EVENT_DEFAULT.0;
        if !self.timing {
            bits |= sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        }
        if self.blocking_sync {
            bits |= sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC.0;
        }
        bits
    }
}

/// A CUDA event of one context. Destroyed on drop.
#[derive(Debug)]
pub struct Event {
    context: Arc<Context>,
    raw: sys::CUevent,
    flags: EventFlags,
    owned: bool,
    /// Where its last record through [`record`](Self::record) was queued, so that a capturing
    /// stream's wait on it is refused before it breaks the capture: [`RECORDED_UNKNOWN`],
    /// [`RECORDED_EAGER`], or a capture id plus [`RECORDED_CAPTURE_BASE`].
    recorded_in: AtomicU64,
}

/// Not recorded through cuweave (or its capture status unreadable): the driver decides.
const RECORDED_UNKNOWN: u64 = 0;
/// Recorded on a stream that was not capturing.
const RECORDED_EAGER: u64 = 1;
/// Recorded into capture `id`: stored as `id + RECORDED_CAPTURE_BASE`.
const RECORDED_CAPTURE_BASE: u64 = 2;

// SAFETY: a CUevent may be recorded, queried and waited on from any thread once its context is
// current, which every method ensures.
unsafe impl Send for Event {}
// SAFETY: as above; no method mutates `self`.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event in `context`.
    pub fn new(context: &Arc<Context>, flags: EventFlags) -> Result<Self> {
        context.bind_to_thread()?;
        let api = driver()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        unsafe { cu!(api.event_create(&mut raw, flags.bits())) }?;
        Ok(Self {
            context: Arc::clone(context),
            raw,
            flags,
            owned: true,
            recorded_in: AtomicU64::new(RECORDED_UNKNOWN),
        })
    }

    /// Wraps an event another library created.
    ///
    /// # Safety
    /// `raw` must be a live event of `context` created with `flags`. With `owned`, the handle
    /// destroys it on drop and nobody else may; without, it must outlive the handle.
    pub unsafe fn from_raw(
        context: &Arc<Context>,
        raw: sys::CUevent,
        flags: EventFlags,
        owned: bool,
    ) -> Self {
        Self {
            context: Arc::clone(context),
            raw,
            flags,
            owned,
            recorded_in: AtomicU64::new(RECORDED_UNKNOWN),
        }
    }

    /// The raw `CUevent`.
    pub fn as_raw(&self) -> sys::CUevent {
        self.raw
    }

    /// The flags the event was created with.
    pub fn flags(&self) -> EventFlags {
        self.flags
    }

    /// The context the event belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// The device the event belongs to.
    pub fn device(&self) -> Device {
        self.context.device()
    }

    /// Captures the work queued on `stream` so far: the event completes when that work has.
    ///
    /// # Errors
    /// `InvalidArgument` when the stream belongs to another device, or is the default stream
    /// of another context (see [`Stream::ensure_context`]);
    /// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing recorded, for the legacy
    /// default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the driver's error.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        stream.ensure_context(&self.context, "Event::record")?;
        crate::graph::refuse_on_legacy_stream(stream, "Event::record")?;
        self.context.bind_to_thread()?;
        let api = driver()?;
        // SAFETY: live event and stream of the same context.
        unsafe { cu!(api.event_record(self.raw, stream.as_raw())) }?;
        let recorded_in = if crate::graph::active_captures() == 0 {
            RECORDED_EAGER
        } else {
            match stream.capture_status() {
                Ok(status) => status
                    .id()
                    .map_or(RECORDED_EAGER, |id| id.wrapping_add(RECORDED_CAPTURE_BASE)),
                Err(_) => RECORDED_UNKNOWN,
            }
        };
        self.recorded_in.store(recorded_in, Ordering::Relaxed);
        Ok(())
    }

    /// Where the last [`record`](Self::record) was queued.
    pub(crate) fn recorded_in(&self) -> crate::graph::RecordedIn {
        use crate::graph::RecordedIn;
        match self.recorded_in.load(Ordering::Relaxed) {
            RECORDED_UNKNOWN => RecordedIn::Unknown,
            RECORDED_EAGER => RecordedIn::Eager,
            stored => RecordedIn::Capture(stored.wrapping_sub(RECORDED_CAPTURE_BASE)),
        }
    }

    /// Whether the captured work has finished (`true` also for a never-recorded event).
    ///
    /// One driver call (`cuEventQuery`) and no allocation, whether the work has finished or
    /// not: the event names its own context, so the query does not make the context current
    /// first (the calling thread's current context is left as it is). Only when the driver
    /// answers with another error does it make the context current and ask again, and that
    /// answer stands.
    ///
    /// No capture begun through cuweave begins between the refusal's check and the query, which
    /// would break a global-mode capture begun on another thread meanwhile: a query made while
    /// one begins waits for it (microseconds), then is refused or made.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing asked, while this
    /// thread's capture mode forbids a query (its own capture, or another thread's global one)
    /// and for an event last recorded into a capture that is still active (the driver would
    /// invalidate that capture); the driver's error otherwise.
    pub fn query(&self) -> Result<bool> {
        crate::graph::between_capture_begins(|| self.query_between_capture_begins())
    }

    fn query_between_capture_begins(&self) -> Result<bool> {
        crate::graph::refuse_while_capturing(None, "Event::query")?;
        self.refuse_if_recorded_in_active_capture("Event::query")?;
        let api = driver()?;
        // SAFETY: live event.
        match unsafe { cu!(api.event_query(self.raw)) } {
            Ok(()) => return Ok(true),
            Err(error) if error.is_not_ready() => return Ok(false),
            Err(_) => {}
        }
        self.context.bind_to_thread()?;
        // SAFETY: live event; its context is current.
        match unsafe { cu!(api.event_query(self.raw)) } {
            Ok(()) => Ok(true),
            Err(error) if error.is_not_ready() => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// Refuses a query or synchronisation of an event last recorded into a capture that is
    /// still active: its "work" is an edge of the capture's graph, not work that runs, and the
    /// driver answers such a call with `CUDA_ERROR_CAPTURED_EVENT` and invalidates the capture
    /// (a monitoring thread polling a fork point would break the model thread's capture).
    /// One relaxed load for an event recorded eagerly.
    fn refuse_if_recorded_in_active_capture(&self, operation: &'static str) -> Result<()> {
        match self.recorded_in() {
            crate::graph::RecordedIn::Capture(capture)
                if crate::graph::capture_is_active(capture) =>
            {
                Err(crate::graph::GraphError::Capturing {
                    operation,
                    reason: "the event was last recorded into a stream capture that is still active: it marks a point of the capture's graph, not work that runs",
                }
                .into())
            }
            _ => Ok(()),
        }
    }

    /// Blocks until the captured work has finished.
    ///
    /// The wait is made in relaxed capture mode once the refusals below have passed, so a
    /// global-mode capture another thread begins meanwhile is neither broken nor raced by the
    /// driver's own check (which, under that race, was seen to crash inside the driver).
    ///
    /// # Errors
    /// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing waited for, while this
    /// thread's capture mode forbids a synchronisation (its own capture, or another thread's
    /// global one) and for an event last recorded into a capture that is still active; the
    /// driver's error otherwise.
    pub fn synchronize(&self) -> Result<()> {
        crate::graph::refuse_while_capturing(None, "Event::synchronize")?;
        self.refuse_if_recorded_in_active_capture("Event::synchronize")?;
        self.context.bind_to_thread()?;
        let api = driver()?;
        let _relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: live event.
        unsafe { cu!(api.event_synchronize(self.raw)) }
    }

    /// Milliseconds of GPU time between this event (the start) and `end`, both completed.
    ///
    /// # Errors
    /// `InvalidArgument` when either event was created without timing; the driver's
    /// `CUDA_ERROR_NOT_READY` while either is pending.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        if !self.flags.timing || !end.flags.timing {
            return Err(DriverError::invalid(
                "Event::elapsed_ms",
                "both events must be created with EventFlags::TIMING",
            ));
        }
        self.context.bind_to_thread()?;
        let api = driver()?;
        let mut ms = 0.0f32;
        // SAFETY: valid out-pointer; live events.
        unsafe { cu!(api.event_elapsed_time(&mut ms, self.raw, end.raw)) }?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let Ok(api) = driver() else { return };
        if let Err(error) = self.context.bind_to_thread() {
            tracing::warn!(%error, "binding context to destroy an event failed");
            return;
        }
        // SAFETY: we created this event and destroy it once; pending work keeps its own reference.
        if let Err(error) = unsafe { cu!(api.event_destroy(self.raw)) } {
            tracing::warn!(%error, "destroying an event failed");
        }
    }
}
