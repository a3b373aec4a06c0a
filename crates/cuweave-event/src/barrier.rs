//! [`CrossStreamBarrier`]: every stream waits for every other stream's queued work, through
//! the stream layer's one barrier ([`queue_barrier`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuweave_driver::graph::{StatusCheck, refuse_recording};
use cuweave_driver::{EventPool, PooledEvent, Stream};
use cuweave_stream::{BarrierInfo, queue_barrier};

use crate::coordinator::AsStream;
use crate::error::{EventError, Result};

/// A barrier across a set of streams of one context: driver [`Stream`]s, or any [`AsStream`]
/// such as the [`PriorityStream`](cuweave_stream::PriorityStream)s a
/// [`StreamPool`](cuweave_stream::StreamPool) hands out (and
/// [`OperationCoordinator::begin_on_pool`](crate::OperationCoordinator::begin_on_pool) returns).
///
/// [`wait_on_device`](Self::wait_on_device) makes every stream wait (on the GPU,
/// `cuStreamWaitEvent`) for all the others' queued work, fanned in to the first stream and out
/// again ([`queue_barrier`], `2 (n - 1)` waits): work queued on any of them afterwards starts
/// only once the work queued on all of them before has finished. The host does not block. [`synchronize`](Self::synchronize) instead blocks the host until all
/// streams have finished their queued work, and says how long that took.
///
/// ```no_run
/// use std::sync::Arc;
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_event::{CrossStreamBarrier, EventPool};
///
/// # fn main() -> Result<(), cuweave_event::EventError> {
/// let context = Context::primary(Device::get(0)?)?;
/// let streams: Vec<Arc<Stream>> = (0..4)
///     .map(|_| Stream::new(&context, StreamFlags::NON_BLOCKING).map(Arc::new))
///     .collect::<Result<_, _>>()?;
/// let barrier = CrossStreamBarrier::new(streams, EventPool::new(&context, 8, 0)?)?;
/// // ... queue work on each stream ...
/// barrier.wait_on_device()?; // later work on any stream waits for all of it
/// let waited = barrier.synchronize()?;
/// println!("host waited {waited:?}");
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct CrossStreamBarrier<S: AsStream = Stream> {
    streams: Vec<Arc<S>>,
    pool: EventPool,
}

impl CrossStreamBarrier {
    /// A barrier over `streams`, taking its events from `pool`.
    ///
    /// # Errors
    /// `InvalidArgument` for no streams, or a stream of another context than the pool's.
    pub fn new(streams: Vec<Arc<Stream>>, pool: EventPool) -> Result<Self> {
        CrossStreamBarrier::checked(streams, pool, "CrossStreamBarrier::new")
    }
}

impl<S: AsStream> CrossStreamBarrier<S> {
    /// A barrier over any kind of stream ([`AsStream`]): the
    /// [`PriorityStream`](cuweave_stream::PriorityStream)s of a
    /// [`StreamPool`](cuweave_stream::StreamPool), or driver streams as with
    /// [`new`](CrossStreamBarrier::new).
    ///
    /// ```no_run
    /// use cuweave_driver::{Context, Device};
    /// use cuweave_event::{CrossStreamBarrier, EventPool};
    /// use cuweave_stream::{StreamPool, StreamPoolConfig};
    ///
    /// # fn main() -> Result<(), cuweave_event::EventError> {
    /// let context = Context::primary(Device::get(0)?)?;
    /// let streams = StreamPool::new(&context, StreamPoolConfig::default())?;
    /// let barrier = CrossStreamBarrier::from_streams(
    ///     streams.streams().cloned().collect(),
    ///     EventPool::new(&context, 8, 0)?,
    /// )?;
    /// barrier.wait_on_device()?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// `InvalidArgument` for no streams, or a stream of another context than the pool's.
    pub fn from_streams(streams: Vec<Arc<S>>, pool: EventPool) -> Result<Self> {
        Self::checked(streams, pool, "CrossStreamBarrier::from_streams")
    }

    fn checked(streams: Vec<Arc<S>>, pool: EventPool, operation: &'static str) -> Result<Self> {
        if streams.is_empty() {
            return Err(EventError::invalid(
                operation,
                "a barrier needs at least one stream",
            ));
        }
        if let Some(stream) = streams
            .iter()
            .map(|stream| stream.as_stream())
            .find(|stream| stream.context().as_raw() != pool.context().as_raw())
        {
            return Err(EventError::invalid(
                operation,
                format!(
                    "stream {} belongs to another context than the event pool",
                    stream.id()
                ),
            ));
        }
        Ok(Self { streams, pool })
    }

    /// The streams the barrier spans.
    pub fn streams(&self) -> &[Arc<S>] {
        &self.streams
    }

    fn record_all(&self) -> Result<Vec<PooledEvent<'_>>> {
        self.streams
            .iter()
            .map(|stream| {
                let event = self.pool.acquire_event(false)?;
                event.record(stream.as_stream())?;
                Ok(event)
            })
            .collect()
    }

    /// Makes every stream wait on the device for the work queued so far on every other stream;
    /// returns at once (host time spent queueing the `2 (n - 1)` waits).
    ///
    /// # Errors
    /// The driver's error.
    pub fn wait_on_device(&self) -> Result<Duration> {
        let started = Instant::now();
        self.queue()?;
        Ok(started.elapsed())
    }

    /// [`wait_on_device`](Self::wait_on_device), returning what was queued instead of the time.
    ///
    /// # Errors
    /// The driver's error.
    pub fn queue(&self) -> Result<BarrierInfo> {
        let pairs: Vec<(&Stream, &EventPool)> = self
            .streams
            .iter()
            .map(|stream| (stream.as_stream(), &self.pool))
            .collect();
        let queued = queue_barrier(&pairs);
        if self.streams.len() > 1 {
            // Every stream waits (the hub for the others, the others for the hub); noted after
            // a failure part way too, since the waits queued before it still hold their
            // streams (a note too many costs one stream query).
            for stream in &self.streams {
                stream.note_queued_wait();
            }
        }
        Ok(queued?)
    }

    /// Blocks the host until the work queued so far on every stream has finished; returns how
    /// long it waited.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](cuweave_driver::GraphError::Capturing) (a
    /// [capture refusal](EventError::is_capture_refusal), as `Stream::synchronize` on that
    /// stream gives) when any of the streams is capturing, in any mode, through cuweave or not:
    /// refused before anything is recorded, so the capture stays valid (an event recorded into
    /// a capture cannot be waited for, and its work runs only at the graph's launches); the
    /// driver's error (e.g. a fault in queued work).
    pub fn synchronize(&self) -> Result<Duration> {
        let started = Instant::now();
        // One status query per stream: nothing next to the wait that follows.
        for stream in &self.streams {
            refuse_recording(
                stream.as_stream(),
                StatusCheck::Always,
                "CrossStreamBarrier::synchronize",
                "one of the barrier's streams is capturing: its queued work runs only when the capture's graph is launched, so no host wait can see it finish (and the wait would break the capture)",
            )?;
        }
        for event in self.record_all()? {
            event.synchronize()?;
        }
        Ok(started.elapsed())
    }
}
