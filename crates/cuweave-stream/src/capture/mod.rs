//! Graph capture on streams: record a step once, replay it as one CUDA graph launch.
//!
//! [`StreamCapture::begin`] starts capturing a stream (never the legacy default stream) in a
//! [`CaptureMode`] and binds the capture to a private [`GraphPool`] of the caching allocator,
//! so allocations made on the capture's streams come from memory that belongs to the graph.
//! Other streams join the capture with [`fork`](StreamCapture::fork) (or any event wait on an
//! event recorded in it, such as a [`MultiStreamCoordinator`](crate::MultiStreamCoordinator)
//! dependency) and leave it with [`join`](StreamCapture::join); a fork never joined is
//! [`GraphError::UnjoinedFork`] when the capture ends. [`finish`](StreamCapture::finish) ends it
//! and returns the [`Graph`], which keeps the pool alive; [`Graph::instantiate`] gives the
//! [`GraphExec`] that [`PriorityStream::launch_graph`] launches and counts.
//!
//! While a capture is active, calls that would break it are refused with
//! [`GraphError::Capturing`] (synchronising or querying the capturing stream, event queries and
//! waits from the capturing thread, `empty_cache`), and a capture that broke anyway is reported
//! once, by `finish`, as [`GraphError::CaptureInvalidated`] naming the first failing call.
//! Guide: `docs/graphs.md`.
//!
//! ```no_run
//! use std::sync::Arc;
//! use cuweave_driver::{Context, Device, InstantiateOptions};
//! use cuweave_memory::caching::CachingAllocator;
//! use cuweave_stream::capture::{CaptureOptions, StreamCapture};
//! use cuweave_stream::{PriorityStream, StreamPriority};
//!
//! # fn main() -> cuweave_stream::Result<()> {
//! let context = Context::primary(Device::get(0)?)?;
//! let stream = PriorityStream::new(&context, StreamPriority::Normal)?;
//! let allocator = CachingAllocator::with_driver(&context);
//! let capture = StreamCapture::begin(&stream, CaptureOptions::default())?;
//! let scratch = allocator.allocate(1 << 20, &stream)?; // from the capture's private pool
//! // ... queue kernels and copies on `stream` that use scratch.ptr() ...
//! drop(scratch); // back to the private pool, never to eager work
//! let graph = capture.finish()?;
//! let exec = graph.instantiate(&InstantiateOptions::default())?;
//! for _ in 0..1000 {
//!     stream.launch_graph(&exec)?;
//! }
//! stream.synchronize()?;
//! # Ok(())
//! # }
//! ```

use cuweave_driver::graph::{CaptureMode, GraphError, active_captures};
use cuweave_driver::{DriverError, Event, EventFlags, Graph, GraphExec, Stream};
use cuweave_memory::MemoryError;
use cuweave_memory::caching::{
    AllocateToPool, GraphPool, MissPolicy, begin_allocate_to_pool, note_capture_stream,
};

use crate::error::{Result, StreamError};
use crate::stream::{OperationKind, PriorityStream};

/// How a capture is made.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CaptureOptions {
    /// The capture mode. Default [`CaptureMode::ThreadLocal`]: only the capturing thread's
    /// unsafe calls can break it, so event pollers and allocators on other threads keep working
    /// (with `Global`, any thread's event query or `cuMemAlloc` invalidates it).
    pub mode: CaptureMode,
    /// The private pool the capture allocates from; a new one when `None`. Give several
    /// captures the same pool to share memory between graphs that never replay concurrently.
    pub pool: Option<GraphPool>,
    /// What a miss in the pool does (default: take memory with the thread in relaxed mode).
    pub misses: MissPolicy,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        Self {
            mode: CaptureMode::ThreadLocal,
            pool: None,
            misses: MissPolicy::default(),
        }
    }
}

impl CaptureOptions {
    /// Sets the capture mode.
    pub fn with_mode(mut self, mode: CaptureMode) -> Self {
        self.mode = mode;
        self
    }

    /// Allocates from `pool` (shared with other captures given it).
    pub fn with_pool(mut self, pool: &GraphPool) -> Self {
        self.pool = Some(pool.clone());
        self
    }

    /// Sets what a miss in the pool does.
    pub fn with_misses(mut self, misses: MissPolicy) -> Self {
        self.misses = misses;
        self
    }
}

/// An active capture on a stream: ends (and its recording is discarded) when dropped without
/// [`finish`](Self::finish).
///
/// It stays on the thread that began it (the driver ends a global or thread-local capture only
/// there), so it is not `Send`:
///
/// ```compile_fail
/// fn sendable<T: Send>() {}
/// sendable::<cuweave_stream::StreamCapture<'static>>();
/// ```
#[must_use = "dropping the capture ends it and discards what it recorded"]
#[derive(Debug)]
pub struct StreamCapture<'s> {
    origin: &'s Stream,
    pool: GraphPool,
    binding: Option<AllocateToPool>,
    /// Streams forked into the capture and not joined back, with the fork's event.
    forks: Vec<(u64, Event)>,
    /// Events recorded for joins, alive until the capture ends.
    joins: Vec<Event>,
    ended: bool,
    /// Ended on the thread that began it: the driver refuses to end a global or thread-local
    /// capture from another thread (`CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`), and the capture
    /// would then stay active for good, refusing `Context::synchronize` process-wide. So a
    /// capture cannot be sent (an async task resumed on another worker cannot carry it).
    _begun_on_this_thread: std::marker::PhantomData<*const ()>,
}

impl<'s> StreamCapture<'s> {
    /// Begins capturing `stream` (`cuStreamBeginCapture_v2`), its allocations bound to the
    /// options' pool (or a new one).
    ///
    /// Like PyTorch's `torch.cuda.graph`, it first waits for the work already queued in the
    /// stream's context to finish (`cuCtxSynchronize`, through
    /// [`Stream::begin_capture_synchronized`]): buffers used eagerly before the capture can then
    /// be used inside it without the capturing stream waiting on events recorded outside it
    /// (which the driver refuses). When another capture is already active that synchronisation
    /// is impossible and is skipped; see `docs/graphs.md`.
    ///
    /// # Errors
    /// [`GraphError::LegacyDefaultStream`] for the legacy default stream,
    /// [`GraphError::AlreadyCapturing`] for a stream that is already in a capture (one begun on
    /// it, or one it was forked into: the driver would refuse with an untyped
    /// `CUDA_ERROR_ILLEGAL_STATE`), or the driver's error (of the synchronisation too: a fault
    /// of earlier work); the stream, and any capture it is in, are left as they were.
    pub fn begin(stream: &'s Stream, options: CaptureOptions) -> Result<Self> {
        // A stream forked into a running capture is not that capture's origin, so the driver
        // layer's own check does not see it: refuse before the driver is asked.
        if capture_id(stream)?.is_some() {
            return Err(DriverError::from(GraphError::AlreadyCapturing {
                stream: stream.id(),
            })
            .into());
        }
        stream.begin_capture_synchronized(options.mode)?;
        let pool = options.pool.unwrap_or_default();
        match begin_allocate_to_pool(stream, &pool, options.misses) {
            Ok(binding) => Ok(Self {
                origin: stream,
                pool,
                binding: Some(binding),
                forks: Vec::new(),
                joins: Vec::new(),
                ended: false,
                _begun_on_this_thread: std::marker::PhantomData,
            }),
            Err(error) => {
                if let Err(end) = stream.end_capture() {
                    tracing::warn!(%end, "ending a capture whose pool binding failed");
                }
                Err(error.into())
            }
        }
    }

    /// The capturing stream.
    pub fn stream(&self) -> &Stream {
        self.origin
    }

    /// The capture's private pool.
    pub fn pool(&self) -> &GraphPool {
        &self.pool
    }

    /// The streams forked into the capture and not yet joined, by id.
    pub fn unjoined(&self) -> Vec<u64> {
        self.forks.iter().map(|(id, _)| *id).collect()
    }

    /// Brings `stream` into the capture: its later work depends on the capture's work so far
    /// and is recorded into the same graph (an event recorded on the origin, waited on by
    /// `stream`: a graph edge). Its allocations come from the capture's pool from now on.
    ///
    /// # Errors
    /// `InvalidArgument` for the origin itself; [`GraphError::Capturing`], before anything is
    /// queued, for a stream capturing into another capture (the driver would merge or
    /// invalidate the two); the driver's error.
    pub fn fork(&mut self, stream: &Stream) -> Result<()> {
        if stream.id() == self.origin.id() {
            return Err(StreamError::invalid(
                "StreamCapture::fork",
                "the origin stream is already in its capture",
            ));
        }
        refuse_wait_across_capture(stream, self.origin, "StreamCapture::fork")?;
        let event = Event::new(self.origin.context(), EventFlags::DISABLE_TIMING)?;
        event.record(self.origin)?;
        stream.wait_event(&event)?;
        note_capture_stream(stream)?;
        self.forks.retain(|(id, _)| *id != stream.id());
        self.forks.push((stream.id(), event));
        Ok(())
    }

    /// Joins `stream` back: the origin's later work depends on everything `stream` recorded.
    /// Blocks used on `stream` during the capture stay with the graph.
    ///
    /// # Errors
    /// [`GraphError::Capturing`], before anything is queued, for a stream that is not in this
    /// capture (never forked, or in another capture): the origin would wait on an event recorded
    /// outside its capture, which the driver answers by invalidating the capture. The driver's
    /// error otherwise.
    pub fn join(&mut self, stream: &Stream) -> Result<()> {
        refuse_wait_across_capture(self.origin, stream, "StreamCapture::join")?;
        let event = Event::new(stream.context(), EventFlags::DISABLE_TIMING)?;
        event.record(stream)?;
        self.origin.wait_event(&event)?;
        self.forks.retain(|(id, _)| *id != stream.id());
        self.joins.push(event);
        Ok(())
    }

    /// Ends the capture and returns its graph, which keeps the capture's pool alive.
    ///
    /// # Errors
    /// [`GraphError::UnjoinedFork`] when work queued on a forked stream was not joined back
    /// (the driver's check: a fork that queued nothing after [`fork`](Self::fork) leaves no
    /// node outside the origin's graph, and ends with it, although [`unjoined`](Self::unjoined)
    /// still lists it); [`GraphError::CaptureInvalidated`] naming the first call that broke the
    /// capture. The capture is over either way and every stream usable.
    pub fn finish(mut self) -> Result<Graph> {
        self.ended = true;
        let ended = self.origin.end_capture();
        // After the driver's capture is over: frees deferred during it run now.
        drop(self.binding.take());
        let mut graph = ended?;
        // The pool's memory goes back only after its context synchronised: no launch fence.
        graph.keep_alive_synchronizing(self.pool.synchronizing_keep_alive());
        Ok(graph)
    }
}

impl Drop for StreamCapture<'_> {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        match self.origin.end_capture() {
            Ok(graph) => drop(graph),
            Err(error) => tracing::warn!(%error, "ending an abandoned capture"),
        }
        drop(self.binding.take());
    }
}

/// Whether `stream` is capturing; one atomic load while no capture is active anywhere.
pub(crate) fn is_capturing(stream: &Stream) -> Result<bool> {
    if active_captures() == 0 {
        return Ok(false);
    }
    #[cfg(test)]
    STATUS_QUERIES.with(|queries| queries.set(queries.get() + 1));
    Ok(stream.capture_status()?.is_capturing())
}

/// The id of the capture `stream` records into, or `None` when it is not capturing; one atomic
/// load while no capture begun through cuweave is active.
pub(crate) fn capture_id(stream: &Stream) -> Result<Option<u64>> {
    if active_captures() == 0 {
        return Ok(None);
    }
    Ok(stream.capture_status()?.id())
}

/// Notes that `stream`, just made to wait on another stream's work, may have joined that
/// stream's capture: a stream that waits on an event recorded in a capture joins the capture
/// (as [`StreamCapture::fork`] makes it). Listed among the capture's streams, the blocks of
/// the general cache it frees during the capture stay graph memory, held for the graph, rather
/// than going back to eager work that the graph's replays would overwrite.
///
/// Every wait cuweave queues between streams calls it ([`PriorityStream::wait_for`], barriers,
/// the stream-ordered allocator's dependencies, the operation coordinator's begin); a program
/// that queues `cuStreamWaitEvent` itself calls it after. One atomic load while no capture is
/// active anywhere; nothing for a stream that is not capturing.
///
/// # Errors
/// The driver's error when the stream's capture status cannot be read.
pub fn note_wait_joined_capture(stream: &Stream) -> Result<()> {
    if active_captures() == 0 {
        return Ok(());
    }
    note_capture_stream(stream)?;
    Ok(())
}

/// Refuses, before anything is queued, a device-side wait of `dependent` on work of
/// `prerequisite` that would cross a capture's boundary (PyTorch's `wait_stream` from a
/// capturing stream on an eager one fails the same way in the driver, which invalidates the
/// capture); the driver layer's rule,
/// [`refuse_wait_across_capture`](cuweave_driver::graph::refuse_wait_across_capture), which its
/// own `Stream::wait_stream` applies too.
///
/// # Errors
/// [`GraphError::Capturing`] or [`GraphError::LegacyDefaultStream`] naming `operation`; the
/// driver's error from a status query.
pub(crate) fn refuse_wait_across_capture(
    dependent: &Stream,
    prerequisite: &Stream,
    operation: &'static str,
) -> Result<()> {
    Ok(cuweave_driver::graph::refuse_wait_across_capture(
        dependent,
        prerequisite,
        operation,
    )?)
}

#[cfg(test)]
thread_local! {
    /// Capture-status queries [`is_capturing`] asked the driver on this thread, for tests that
    /// count them.
    pub(crate) static STATUS_QUERIES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

impl PriorityStream {
    /// Queues one launch of `exec` (`cuGraphLaunch`) and counts it in the metrics
    /// (`graph_launches`) and, through [`enqueue`](Self::enqueue), in timing and outstanding work.
    ///
    /// # Errors
    /// As [`GraphExec::launch`].
    pub fn launch_graph(&self, exec: &GraphExec) -> Result<()> {
        self.enqueue(OperationKind::GraphLaunch, 0, |stream| exec.launch(stream))
    }

    /// Begins a capture on this stream; see [`StreamCapture::begin`].
    ///
    /// # Errors
    /// As [`StreamCapture::begin`].
    pub fn begin_capture(&self, options: CaptureOptions) -> Result<StreamCapture<'_>> {
        StreamCapture::begin(self.stream(), options)
    }
}

impl StreamError {
    /// Whether this is a capture refusal ([`DriverError::is_capture_refusal`], from the driver
    /// or through the memory layer): the call would have broken an active capture, or recorded
    /// into it what must run once, and was not made. "Not now", not a failure of the work.
    pub fn is_capture_refusal(&self) -> bool {
        match self {
            Self::Driver(error) => error.is_capture_refusal(),
            Self::Memory(error) => error.is_capture_refusal(),
            _ => false,
        }
    }

    /// The graph or capture error inside this error, if it is one (from the driver or from
    /// the memory layer).
    pub fn graph_error(&self) -> Option<&GraphError> {
        match self {
            Self::Driver(DriverError::Graph(error))
            | Self::Memory(MemoryError::Driver(DriverError::Graph(error))) => Some(error),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_options_are_thread_local_with_a_fresh_pool() {
        let options = CaptureOptions::default();
        assert_eq!(options.mode, CaptureMode::ThreadLocal);
        assert!(options.pool.is_none());
        let pool = GraphPool::new();
        let shared = CaptureOptions::default()
            .with_pool(&pool)
            .with_mode(CaptureMode::Global)
            .with_misses(MissPolicy::Fail);
        assert_eq!(shared.pool.map(|p| p.id()), Some(pool.id()));
        assert_eq!(shared.misses, MissPolicy::Fail);
    }

    #[test]
    fn graph_errors_are_found_through_both_layers() {
        let driver: StreamError = DriverError::from(GraphError::UnjoinedFork).into();
        assert_eq!(driver.graph_error(), Some(&GraphError::UnjoinedFork));
        let memory: StreamError =
            MemoryError::Driver(DriverError::from(GraphError::UnjoinedFork)).into();
        assert_eq!(memory.graph_error(), Some(&GraphError::UnjoinedFork));
        assert!(StreamError::invalid("op", "x").graph_error().is_none());
    }

    #[test]
    fn capture_refusals_are_recognised_through_both_layers_and_nothing_else() {
        let refusal = || {
            DriverError::from(GraphError::Capturing {
                operation: "op",
                reason: "capturing",
            })
        };
        assert!(StreamError::from(refusal()).is_capture_refusal());
        assert!(StreamError::from(MemoryError::Driver(refusal())).is_capture_refusal());
        // The memory layer's own refusal (a pageable copy, a staged fill) counts too.
        let not_capturable = MemoryError::NotCapturable {
            operation: "DeviceBuffer::copy_from_host_async",
            reason: "pageable host memory",
        };
        assert!(StreamError::from(not_capturable).is_capture_refusal());
        let unjoined: StreamError = DriverError::from(GraphError::UnjoinedFork).into();
        assert!(!unjoined.is_capture_refusal());
        assert!(!StreamError::invalid("op", "x").is_capture_refusal());
    }
}
