//! [`PriorityStream`]: a driver [`Stream`] with a [`StreamPriority`], per-stream metrics,
//! GPU-timed operations, outstanding-work tracking and host callbacks that may call CUDA.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cuweave_driver::graph::{StatusCheck, refuse_recording};
use cuweave_driver::{
    Context, Device, DriverError, EventPool, OwnedPooledEvent, Stream, StreamFlags,
};

use crate::error::{Result, StreamError};
use crate::priority::StreamPriority;

mod callback;
mod metrics;
mod operations;
mod outstanding;

pub use callback::CallbackFailure;
pub use metrics::{OperationKind, StreamMetrics};

use crate::timing::GpuTimer;
use callback::CallbackWorker;
use metrics::MetricsCounters;
use outstanding::OutstandingWork;

/// A non-blocking CUDA stream of this layer: the driver's [`Stream`] (reached through
/// [`stream`](Self::stream) or `Deref`) plus what the stream layer keeps about it.
///
/// - Its [`StreamPriority`] and the driver priority it got, read back with
///   `cuStreamGetPriority` when it is made ([`driver_priority`](Self::driver_priority)).
/// - Typed operations that count themselves in [`metrics`](Self::metrics): async copies and
///   fills of `cuweave-memory` buffers (ordered with each buffer's other uses by the buffer's own
///   tracking), unified-memory prefetch, kernel launches ([`launch`](Self::launch)) and any
///   other work ([`enqueue`](Self::enqueue)). With [`set_timing`](Self::set_timing) on, each is
///   bracketed by timing events and its GPU time is summed.
/// - How much of that work the GPU has not finished ([`outstanding_work`](Self::outstanding_work)),
///   from a disable-timing event recorded behind each operation: what
///   [`AllocationStrategy::LoadBalanced`](crate::AllocationStrategy::LoadBalanced) compares.
/// - Host callbacks ([`add_callback`](Self::add_callback)) queued with `cuLaunchHostFunc` that
///   may themselves call CUDA.
///
/// Work queued on the driver stream directly (through `Deref`) runs in the same order but is
/// not counted; wrap it in [`enqueue`](Self::enqueue) to count it.
#[derive(Debug)]
pub struct PriorityStream {
    inner: Stream,
    priority: StreamPriority,
    driver_priority: i32,
    metrics: MetricsCounters,
    events: EventPool,
    outstanding: OutstandingWork<OwnedPooledEvent>,
    /// Device waits queued on the stream (on other streams' work), which count no operation
    /// but hold back whatever is queued after them ([`has_pending_waits`](Self::has_pending_waits)):
    /// how many were queued, and how many a query has since found passed.
    waits_queued: AtomicU64,
    waits_passed: AtomicU64,
    timer: GpuTimer<()>,
    callbacks: CallbackWorker,
}

impl PriorityStream {
    /// Creates a non-blocking stream in `context` at `priority`, mapped onto the device's range.
    ///
    /// # Errors
    /// The driver's error when the stream cannot be made or its priority cannot be read back.
    pub fn new(context: &Arc<Context>, priority: StreamPriority) -> Result<Self> {
        let range = context.stream_priority_range()?;
        let inner = Stream::with_priority(
            context,
            StreamFlags::NON_BLOCKING,
            priority.to_driver(range),
        )?;
        Self::wrap(inner, priority)
    }

    /// Wraps a driver stream made elsewhere; its level is the one nearest its driver priority.
    ///
    /// # Errors
    /// The driver's error when the priority cannot be read.
    pub fn from_stream(stream: Stream) -> Result<Self> {
        let range = stream.context().stream_priority_range()?;
        let level = StreamPriority::from_driver(stream.priority()?, range);
        Self::wrap(stream, level)
    }

    fn wrap(inner: Stream, priority: StreamPriority) -> Result<Self> {
        let driver_priority = inner.priority()?;
        let id = inner.id();
        let events = EventPool::for_context(inner.context())?;
        let timer = GpuTimer::new(events.clone());
        timer.set_enabled(false);
        Ok(Self {
            inner,
            priority,
            driver_priority,
            metrics: MetricsCounters::default(),
            outstanding: OutstandingWork::default(),
            waits_queued: AtomicU64::new(0),
            waits_passed: AtomicU64::new(0),
            timer,
            events,
            callbacks: CallbackWorker::new(id),
        })
    }

    /// The driver stream, for calls of other layers (`Event::record`, buffer methods, kernels).
    pub fn stream(&self) -> &Stream {
        &self.inner
    }

    /// The driver stream's process-unique id ([`Stream::id`]).
    pub fn id(&self) -> u64 {
        self.inner.id()
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        self.inner.context()
    }

    /// The event pool of the stream's context, which the stream's markers and timers use
    /// ([`EventPool::for_context`]).
    pub fn event_pool(&self) -> &EventPool {
        &self.events
    }

    /// The device the stream runs on.
    pub fn device(&self) -> Device {
        self.inner.device()
    }

    /// The level it was made at.
    pub fn priority(&self) -> StreamPriority {
        self.priority
    }

    /// Adds the GPU time of the timed operations that finished to the counters.
    fn harvest_gpu_time(&self) -> Result<()> {
        self.timer
            .harvest(|(), time, _| self.metrics.add_gpu_time(1, duration_ns(time)))
    }

    /// The driver priority the stream really has, read back with `cuStreamGetPriority` when it
    /// was made (lower is more urgent).
    pub fn driver_priority(&self) -> i32 {
        self.driver_priority
    }

    /// A snapshot of the counters, after adding the GPU time of timed operations that finished.
    ///
    /// # Errors
    /// The driver's error when reading a finished timing pair fails.
    pub fn metrics(&self) -> Result<StreamMetrics> {
        self.harvest_gpu_time()?;
        let mut metrics = self.metrics.snapshot();
        metrics.callback_panics = self.callbacks.panics();
        Ok(metrics)
    }

    /// Turns GPU timing of later operations on or off (off by default: two event records per
    /// operation are not free). At most [`DEFAULT_PENDING_SPANS`](crate::timing::DEFAULT_PENDING_SPANS)
    /// timed operations wait for the GPU at once; past that, operations are not timed until
    /// [`metrics`](Self::metrics) has read finished ones.
    pub fn set_timing(&self, enabled: bool) {
        self.timer.set_enabled(enabled);
    }

    /// Whether operations are being timed.
    pub fn is_timing(&self) -> bool {
        self.timer.is_enabled()
    }

    /// Operations queued through this stream that the GPU has not finished, without blocking.
    ///
    /// # Errors
    /// The driver's error from an event query.
    pub fn outstanding_work(&self) -> Result<u64> {
        Ok(self.outstanding.outstanding(|event| event.query())?)
    }

    /// Whether device waits queued on this stream (by [`wait_for`](Self::wait_for), a
    /// coordinator's dependencies and barriers) may still hold back work queued now, behind
    /// other streams' work: not operations, so not in [`outstanding_work`](Self::outstanding_work),
    /// but the pool's strategies count a stream held so as busy. Costs nothing until a wait is
    /// queued; then one `cuStreamQuery` per call until one finds the stream idle.
    ///
    /// # Errors
    /// The driver's error from the query.
    pub fn has_pending_waits(&self) -> Result<bool> {
        let queued = self.waits_queued.load(Ordering::Acquire);
        if self.waits_passed.load(Ordering::Acquire) >= queued {
            return Ok(false);
        }
        if self.inner.query()? {
            // Idle: every wait queued before the query has passed.
            self.waits_passed.fetch_max(queued, Ordering::AcqRel);
            return Ok(false);
        }
        Ok(true)
    }

    /// Notes a device wait, or other work not queued through this type, just queued on this
    /// stream (one atomic add), so that [`has_pending_waits`](Self::has_pending_waits) and the
    /// pool's `Priority` and `LoadBalanced` strategies see the stream as held until the GPU
    /// passes it. This crate's own waits ([`wait_for`](Self::wait_for), the
    /// [`MultiStreamCoordinator`](crate::MultiStreamCoordinator)'s dependencies, the
    /// [`StreamOrderedAllocator`](crate::StreamOrderedAllocator)'s stream dependencies) note
    /// theirs; a layer above that queues on [`stream`](Self::stream) directly (the event
    /// layer's coordinator and barriers, the collective layer's coordinated collectives) calls
    /// this after it.
    pub fn note_queued_wait(&self) {
        self.waits_queued.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether everything queued on the stream (counted or not) has finished (`cuStreamQuery`).
    ///
    /// # Errors
    /// The driver's error, e.g. from a failed kernel.
    pub fn is_ready(&self) -> Result<bool> {
        Ok(self.inner.query()?)
    }

    /// Blocks until everything queued on the stream has finished.
    ///
    /// # Errors
    /// The driver's error, e.g. from a failed kernel.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.inner.synchronize()?)
    }

    /// Makes later work on this stream wait, on the device, for the work queued on `other` so
    /// far (an event of `other`'s pool recorded on `other`, then `cuStreamWaitEvent`; the event
    /// goes back to the pool at once, since the wait is fixed when it is queued).
    ///
    /// While this stream captures a graph, `other` must be in the same capture (a stream forked
    /// into it): a capturing stream cannot wait on eager work. `other` may capture while this
    /// stream does not: this stream then joins `other`'s capture (a fork; join it back before
    /// the capture ends).
    ///
    /// # Errors
    /// [`GraphError::Capturing`](cuweave_driver::graph::GraphError::Capturing), before anything
    /// is queued, when this stream captures and `other` is not in its capture (the driver would
    /// invalidate the capture). [`StreamError::WrongDevice`] is not raised here: CUDA lets
    /// streams wait on events of other devices. The driver's error otherwise.
    pub fn wait_for(&self, other: &PriorityStream) -> Result<()> {
        // The driver's join: refused across a capture's boundary before anything is queued,
        // an event of the context's shared pool otherwise.
        self.inner.wait_stream(&other.inner)?;
        // Noted before the capture bookkeeping, which may fail with the wait already queued.
        self.note_queued_wait();
        crate::capture::note_wait_joined_capture(&self.inner)?;
        Ok(())
    }

    /// Queues work through `f` on this stream, counting it as one operation of `kind` moving
    /// `bytes`, timing it when timing is on, and tracking it as outstanding until the GPU is
    /// past it.
    ///
    /// The stream's capture status is asked once, before `f` runs (one atomic load while no
    /// capture begun through cuweave is active, one driver query while one is); `f` must not make
    /// the stream itself start capturing.
    ///
    /// # Errors
    /// `f`'s error, or the driver's error from recording the markers.
    pub fn enqueue<R, E>(
        &self,
        kind: OperationKind,
        bytes: u64,
        f: impl FnOnce(&Stream) -> std::result::Result<R, E>,
    ) -> Result<R>
    where
        StreamError: From<E>,
    {
        if crate::capture::is_capturing(&self.inner)? {
            // Recorded into a graph, not run: no timing or outstanding-work events (they could
            // never be queried), and not counted (the graph's launches are).
            return Ok(f(&self.inner)?);
        }
        self.enqueue_not_capturing(kind, bytes, f)
    }

    /// [`enqueue`](Self::enqueue) on a stream the caller has just found not capturing: its
    /// markers are recorded with no further capture-status query.
    fn enqueue_not_capturing<R, E>(
        &self,
        kind: OperationKind,
        bytes: u64,
        f: impl FnOnce(&Stream) -> std::result::Result<R, E>,
    ) -> Result<R>
    where
        StreamError: From<E>,
    {
        if self.timer.is_enabled() && self.timer.is_full() {
            // Full: read the spans the GPU has finished first, as `metrics` would, so a stream
            // whose owner rarely asks for metrics keeps timing while the GPU keeps up. Nothing
            // can be read while this thread captures another stream: the timer skips instead.
            if let Err(error) = self.harvest_gpu_time()
                && !error.is_capture_refusal()
            {
                return Err(error);
            }
        }
        let span = self.timer.start_not_capturing(&self.inner)?;
        let result = f(&self.inner);
        let Ok(value) = result else {
            // Nothing (or not all of it) was queued: not an operation, as `metrics` does not
            // count it, so not timed either (the profiler drops such a span too). The start
            // event goes back to the pool unread.
            drop(span);
            return result.map_err(StreamError::from);
        };
        self.timer.finish_not_capturing(span, &self.inner, ())?;
        self.metrics.count(kind, bytes);
        // Finished markers are looked for only outside captures, and no capture begins during
        // a query: one could break another thread's global capture. Each query is a section of
        // its own, taken under the markers' lock: a section must never wait for a lock, which
        // `outstanding_work` holds across queries that wait out a capture begin (which waits
        // for the sections). A query skipped ends the search (`None`), a failed one reads as
        // unfinished.
        self.outstanding.submitted(
            1,
            || self.events.acquire_owned(false),
            |event| event.record(&self.inner),
            |event: &cuweave_driver::OwnedPooledEvent| {
                cuweave_driver::graph::outside_captures(|| matches!(event.query(), Ok(true)))
            },
        )?;
        Ok(value)
    }

    /// Queues a kernel launch: `launch` gets the driver stream and calls
    /// [`Kernel::launch`](cuweave_driver::Kernel::launch) (whose `unsafe` contract stays the
    /// caller's); the launch is counted and tracked like any operation.
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use cuweave_driver::{Context, Kernel, KernelArgs, LaunchConfig};
    /// # use cuweave_stream::{PriorityStream, StreamPriority};
    /// # fn demo(context: &Arc<Context>, kernel: &Kernel) -> cuweave_stream::Result<()> {
    /// let stream = PriorityStream::new(context, StreamPriority::High)?;
    /// let ns = 1_000u64;
    /// stream.launch(|s| {
    ///     // SAFETY (for the reader): the kernel takes one u64 and touches no memory.
    ///     unsafe { kernel.launch(s, LaunchConfig::single(), &KernelArgs::new().arg(&ns)) }
    /// })?;
    /// assert_eq!(stream.metrics()?.kernel_launches, 1);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// The launch's error.
    pub fn launch<R>(
        &self,
        launch: impl FnOnce(&Stream) -> std::result::Result<R, DriverError>,
    ) -> Result<R> {
        self.enqueue(OperationKind::KernelLaunch, 0, launch)
    }

    /// Queues `callback` to run once the GPU has finished everything queued on this stream
    /// before it (`cuLaunchHostFunc`), in order with the stream's other callbacks.
    ///
    /// The driver's callback thread only hands `callback` to this stream's worker thread (started
    /// on first use), so `callback` may call CUDA, block, or take locks. Later GPU work on the
    /// stream does not wait for `callback` to return. A panic in it is caught and reported in
    /// [`callback_failures`](Self::callback_failures) and the metrics; later callbacks still run.
    ///
    /// Refused on a capturing stream: captured, the host function would become a graph node
    /// that runs (and frees its closure) on every replay. The driver is asked
    /// (`cuStreamIsCapturing`) before anything is made, so captures begun outside cuweave are
    /// refused as early as cuweave's own.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](cuweave_driver::graph::GraphError::Capturing) while the stream
    /// is capturing (nothing is queued, no worker started, and `callback` is dropped); the
    /// driver's error when the host function cannot be queued, or a failure to start the worker
    /// thread.
    pub fn add_callback(&self, callback: impl FnOnce() + Send + 'static) -> Result<()> {
        self.refuse_callbacks_while_capturing("PriorityStream::add_callback")?;
        self.queue_callback(Box::new(callback))
    }

    /// Queues `callback` as [`add_callback`](Self::add_callback) does, on a stream the caller
    /// has just found not capturing with
    /// [`refuse_callbacks_while_capturing`](Self::refuse_callbacks_while_capturing): no further
    /// capture-status query but `launch_host_fn`'s own, which still refuses a capture begun
    /// since.
    pub(crate) fn queue_callback(
        &self,
        callback: Box<dyn FnOnce() + Send + 'static>,
    ) -> Result<()> {
        let relay = self.callbacks.relay(callback)?;
        self.enqueue_not_capturing(OperationKind::Callback, 0, |stream| {
            stream.launch_host_fn(relay)
        })
    }

    /// [`GraphError::Capturing`](cuweave_driver::graph::GraphError::Capturing) naming
    /// `operation` while the stream is capturing: a host function cannot be queued on it. The
    /// driver's rule ([`refuse_recording`]), asking the driver every time
    /// ([`StatusCheck::Always`]), so a capture begun outside cuweave is seen too.
    pub(crate) fn refuse_callbacks_while_capturing(&self, operation: &'static str) -> Result<()> {
        Ok(refuse_recording(
            &self.inner,
            StatusCheck::Always,
            operation,
            "the stream is capturing: a host function captured into a graph runs, and frees its closure, on every replay",
        )?)
    }

    /// The latest callbacks that panicked, oldest first: at most 256, so a program whose
    /// callbacks keep failing holds a bounded list; [`metrics`](Self::metrics)
    /// (`callback_panics`) counts every panic.
    pub fn callback_failures(&self) -> Vec<CallbackFailure> {
        self.callbacks.failures()
    }
}

/// Whole nanoseconds of `time`, saturating.
fn duration_ns(time: std::time::Duration) -> u64 {
    u64::try_from(time.as_nanos()).unwrap_or(u64::MAX)
}

impl std::ops::Deref for PriorityStream {
    type Target = Stream;

    fn deref(&self) -> &Stream {
        &self.inner
    }
}

impl AsRef<Stream> for PriorityStream {
    fn as_ref(&self) -> &Stream {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use cuweave_driver::graph::CaptureMode;
    use cuweave_driver::{DriverError, Stream, StreamFlags};

    use super::*;
    use crate::capture::STATUS_QUERIES;

    fn status_queries() -> u64 {
        STATUS_QUERIES.with(std::cell::Cell::get)
    }

    #[test]
    fn a_timed_operation_beside_a_capture_asks_the_capture_status_once() {
        let gpu = cuweave_test_support::require_gpu!();
        let _serial = cuweave_test_support::serial();
        let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
        stream.set_timing(true);
        let capturing = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
        // Relaxed: the event records below, on another stream, cannot break it.
        capturing.begin_capture(CaptureMode::Relaxed).unwrap();
        let before = status_queries();
        stream
            .enqueue(OperationKind::Other, 0, |_| Ok::<(), DriverError>(()))
            .unwrap();
        let enqueue_queries = status_queries() - before;
        let before = status_queries();
        let (sender, receiver) = std::sync::mpsc::channel();
        stream
            .add_callback(move || sender.send(()).unwrap())
            .unwrap();
        let callback_queries = status_queries() - before;
        drop(capturing.end_capture().unwrap());

        assert_eq!(enqueue_queries, 1, "enqueue asks once, its timer never");
        assert_eq!(
            callback_queries, 0,
            "add_callback asks the driver directly (refuse_recording), never again through enqueue"
        );
        receiver
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the callback ran");
        stream.synchronize().unwrap();
        let metrics = stream.metrics().unwrap();
        assert_eq!(metrics.operations, 2, "both counted");
        assert_eq!(metrics.callbacks, 1);
        assert_eq!(
            metrics.timed_operations, 2,
            "both timed, with no check of their own"
        );
    }
}
