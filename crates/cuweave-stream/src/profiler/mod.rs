//! [`StreamProfiler`]: named operations on any streams, timed on the GPU by the one
//! [`GpuTimer`]; per-stream and combined reports and a Chrome trace.

use std::sync::Arc;
use std::time::Duration;

use cuweave_driver::{Context, Event, EventFlags, EventPool, Stream, StreamFlags};
use parking_lot::Mutex;

use crate::error::{Result, StreamError, ensure_device};
use crate::priority::StreamPriority;
use crate::stream::{OperationKind, PriorityStream};
use crate::timing::GpuTimer;

mod kept;
mod report;
mod trace;

pub use kept::DEFAULT_KEPT_OPERATIONS;
use kept::KeptOperations;
pub use report::{CombinedReport, NamedTotal, ProfileReport, ProfiledOperation, StreamReport};

/// What a span of the profiler's timer is.
#[derive(Debug)]
struct Pending {
    stream: u64,
    priority: StreamPriority,
    name: String,
    kind: OperationKind,
    bytes: u64,
}

/// Records operations on streams of one device with their GPU start and duration.
///
/// Each [`profile`](Self::profile)d operation is a span of a [`GpuTimer`]: two pooled timing
/// events on its stream. Its duration is `cuEventElapsedTime` between those two events, so it
/// keeps timing-event resolution (about half a microsecond) however long the program runs. Its
/// start is placed on one GPU clock shared by all streams from the profiler's base event
/// (recorded and completed when the profiler is made), so overlap between streams shows; that
/// offset is an `f32` of milliseconds, finer than a microsecond for the first 10 s and about
/// 8 µs after 100 s. Operations waiting for the GPU are bounded
/// ([`DEFAULT_PENDING_SPANS`](crate::timing::DEFAULT_PENDING_SPANS)): past that, finished ones
/// are read first, and an operation is left untimed ([`skipped`](Self::skipped)) only if none
/// has finished. Finished operations are kept up to a limit ([`DEFAULT_KEPT_OPERATIONS`],
/// or [`with_limit`](Self::with_limit)): past it the oldest are let go
/// ([`evicted`](Self::evicted)), so reports and traces cover the newest window of a long run.
///
/// ```no_run
/// use std::sync::Arc;
/// use cuweave_driver::{Context, Device};
/// use cuweave_memory::DeviceBuffer;
/// use cuweave_stream::{OperationKind, PriorityStream, StreamPriority, StreamProfiler};
///
/// # fn main() -> cuweave_stream::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = PriorityStream::new(&context, StreamPriority::Normal)?;
/// let mut buffer = DeviceBuffer::<u32>::new(&context, 1 << 20)?;
/// let profiler = StreamProfiler::new(&context)?;
/// profiler.profile(&stream, "clear", OperationKind::Memset, 4 << 20, |s| s.fill(&mut buffer, 0))?;
/// println!("{}", profiler.report()?);
/// std::fs::write("trace.json", profiler.chrome_trace()?).unwrap();
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct StreamProfiler {
    context: Arc<Context>,
    base: Event,
    timer: GpuTimer<Pending>,
    finished: Mutex<KeptOperations>,
}

impl StreamProfiler {
    /// A profiler for streams of `context`'s device that keeps the newest
    /// [`DEFAULT_KEPT_OPERATIONS`] finished operations; its base event is recorded and completed
    /// now (on a stream of its own).
    ///
    /// # Errors
    /// The driver's error.
    pub fn new(context: &Arc<Context>) -> Result<Self> {
        Self::with_limit(context, DEFAULT_KEPT_OPERATIONS)
    }

    /// As [`new`](Self::new), keeping at most `kept` finished operations (at least one).
    ///
    /// # Errors
    /// The driver's error.
    pub fn with_limit(context: &Arc<Context>, kept: usize) -> Result<Self> {
        let stream = Stream::new(context, StreamFlags::NON_BLOCKING)?;
        let base = Event::new(context, EventFlags::TIMING)?;
        base.record(&stream)?;
        base.synchronize()?;
        Ok(Self {
            context: Arc::clone(context),
            base,
            timer: GpuTimer::new(EventPool::for_context(context)?),
            finished: Mutex::new(KeptOperations::new(kept)),
        })
    }

    /// Queues `f`'s work on `stream` between two timing events and records it as `name`, of
    /// `kind`, moving `bytes`.
    ///
    /// On a capturing stream `f`'s work is recorded into the graph, not run, so it is neither
    /// timed nor recorded (an event recorded there could never be read): profile the graph's
    /// launches ([`PriorityStream::launch_graph`]) instead.
    ///
    /// An operation whose `f` fails is not recorded.
    ///
    /// # Errors
    /// [`StreamError::WrongDevice`] for a stream of another device; `f`'s error; the driver's.
    pub fn profile<R>(
        &self,
        stream: &PriorityStream,
        name: impl Into<String>,
        kind: OperationKind,
        bytes: u64,
        f: impl FnOnce(&PriorityStream) -> Result<R>,
    ) -> Result<R> {
        ensure_device(
            "StreamProfiler::profile",
            self.context.device().ordinal(),
            stream.device().ordinal(),
        )?;
        if self.timer.is_full() {
            // Nothing can be read while this thread captures: the timer skips instead.
            if let Err(error) = self.collect(false)
                && !error.is_capture_refusal()
            {
                return Err(error);
            }
        }
        let span = self.timer.start(stream.stream())?;
        let result = f(stream);
        if result.is_err() {
            // Nothing (or not all of it) was queued: not an operation to report, as the
            // stream's own metrics do not count it either. The start event goes back unread.
            drop(span);
            return result;
        }
        self.timer.finish(
            span,
            stream.stream(),
            Pending {
                stream: stream.id(),
                priority: stream.priority(),
                name: name.into(),
                kind,
                bytes,
            },
        )?;
        result
    }

    /// Operations queued but not yet read back.
    pub fn pending(&self) -> usize {
        self.timer.pending()
    }

    /// Finished operations let go, oldest first, because more than the limit were kept.
    pub fn evicted(&self) -> u64 {
        self.finished.lock().evicted()
    }

    /// Operations left untimed because too many were waiting for the GPU.
    pub fn skipped(&self) -> u64 {
        self.timer.skipped()
    }

    /// Moves finished operations (all of them, waiting, when `wait`) into `finished`.
    fn collect(&self, wait: bool) -> Result<()> {
        let mut resolved = Vec::new();
        let mut failure = None;
        // An operation that cannot be placed is dropped; the others are still collected and
        // the first failure is returned after them.
        let sink =
            |op: Pending, duration: Duration, start: &Event| match self.base.elapsed_ms(start) {
                Ok(start_ms) if start_ms >= 0.0 => resolved.push(ProfiledOperation {
                    stream: op.stream,
                    priority: op.priority,
                    name: op.name,
                    kind: op.kind,
                    bytes: op.bytes,
                    start_ns: (f64::from(start_ms) * 1e6).round() as u64,
                    duration_ns: u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX),
                }),
                Ok(_) => {
                    failure.get_or_insert(StreamError::NotReady {
                        operation: "StreamProfiler::operations",
                    });
                }
                Err(error) => {
                    failure.get_or_insert(error.into());
                }
            };
        let harvested = if wait {
            self.timer.harvest_all(sink)
        } else {
            self.timer.harvest(sink)
        };
        // What was read is kept even when a span failed: the timer has already let it go.
        self.finished.lock().extend(resolved);
        harvested?;
        failure.map_or(Ok(()), Err)
    }

    /// Waits for every profiled operation to finish and returns those kept (the newest, up to
    /// the limit), by start time.
    ///
    /// # Errors
    /// The driver's error from waiting or reading the events.
    pub fn operations(&self) -> Result<Vec<ProfiledOperation>> {
        self.collect(true)?;
        Ok(self.finished.lock().sorted())
    }

    /// Per-stream and combined report of everything profiled (waits for pending operations).
    ///
    /// # Errors
    /// As [`operations`](Self::operations).
    pub fn report(&self) -> Result<ProfileReport> {
        Ok(ProfileReport::from_operations(&self.operations()?))
    }

    /// The Chrome trace JSON of everything profiled (waits for pending operations): load it in
    /// `chrome://tracing` or <https://ui.perfetto.dev>.
    ///
    /// # Errors
    /// As [`operations`](Self::operations).
    pub fn chrome_trace(&self) -> Result<String> {
        let operations = self.operations()?;
        Ok(trace::chrome_trace(self.context.device().ordinal(), &operations).to_string())
    }

    /// Forgets every kept finished operation (pending ones stay).
    pub fn clear(&self) {
        self.finished.lock().clear();
    }
}
