//! [`StreamProfiler`]: named operations on any streams, timed on the GPU with timing events
//! relative to one base event; per-stream and combined reports and a Chrome trace.

use std::sync::Arc;

use cuweave_driver::{Context, Event, EventFlags, Stream, StreamFlags};
use parking_lot::Mutex;

use crate::error::{Result, StreamError, ensure_device};
use crate::priority::StreamPriority;
use crate::stream::{OperationKind, PriorityStream};

mod report;
mod trace;

pub use report::{CombinedReport, NamedTotal, ProfileReport, ProfiledOperation, StreamReport};

#[derive(Debug)]
struct Pending {
    stream: u64,
    priority: StreamPriority,
    name: String,
    kind: OperationKind,
    bytes: u64,
    start: Event,
    end: Event,
}

/// Records operations on streams of one device with their GPU start and duration.
///
/// Each [`profile`](Self::profile)d operation is bracketed by two timing events on its stream.
/// Times are `cuEventElapsedTime` from the profiler's base event (recorded and completed when
/// the profiler is made) to those events, so operations on different streams share one GPU
/// clock and their overlap shows. Resolution is that of timing events, about half a microsecond.
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
    pending: Mutex<Vec<Pending>>,
    finished: Mutex<Vec<ProfiledOperation>>,
}

impl StreamProfiler {
    /// A profiler for streams of `context`'s device; its base event is recorded and completed
    /// now (on a stream of its own).
    ///
    /// # Errors
    /// The driver's error.
    pub fn new(context: &Arc<Context>) -> Result<Self> {
        let stream = Stream::new(context, StreamFlags::NON_BLOCKING)?;
        let base = Event::new(context, EventFlags::TIMING)?;
        base.record(&stream)?;
        base.synchronize()?;
        Ok(Self {
            context: Arc::clone(context),
            base,
            pending: Mutex::new(Vec::new()),
            finished: Mutex::new(Vec::new()),
        })
    }

    /// Queues `f`'s work on `stream` between two timing events and records it as `name`, of
    /// `kind`, moving `bytes`.
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
        let start = Event::new(&self.context, EventFlags::TIMING)?;
        let end = Event::new(&self.context, EventFlags::TIMING)?;
        start.record(stream.stream())?;
        let result = f(stream);
        end.record(stream.stream())?;
        let value = result?;
        self.pending.lock().push(Pending {
            stream: stream.id(),
            priority: stream.priority(),
            name: name.into(),
            kind,
            bytes,
            start,
            end,
        });
        Ok(value)
    }

    /// Operations queued but not yet finished on the GPU.
    pub fn pending(&self) -> usize {
        self.pending.lock().len()
    }

    /// Waits for every profiled operation to finish and returns all of them, by start time.
    ///
    /// # Errors
    /// The driver's error from waiting or reading the events.
    pub fn operations(&self) -> Result<Vec<ProfiledOperation>> {
        let pending = std::mem::take(&mut *self.pending.lock());
        let mut resolved = Vec::with_capacity(pending.len());
        for op in pending {
            op.end.synchronize()?;
            let start_ms = self.base.elapsed_ms(&op.start)?;
            let end_ms = self.base.elapsed_ms(&op.end)?;
            if start_ms < 0.0 {
                return Err(StreamError::NotReady {
                    operation: "StreamProfiler::operations",
                });
            }
            let start_ns = (f64::from(start_ms) * 1e6).round() as u64;
            let end_ns = (f64::from(end_ms) * 1e6).round() as u64;
            resolved.push(ProfiledOperation {
                stream: op.stream,
                priority: op.priority,
                name: op.name,
                kind: op.kind,
                bytes: op.bytes,
                start_ns,
                duration_ns: end_ns.saturating_sub(start_ns),
            });
        }
        let mut finished = self.finished.lock();
        finished.extend(resolved);
        finished.sort_by_key(|op| (op.start_ns, op.stream));
        Ok(finished.clone())
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

    /// Forgets every finished operation (pending ones stay).
    pub fn clear(&self) {
        self.finished.lock().clear();
    }
}
