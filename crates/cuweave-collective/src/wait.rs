//! Waiting for collectives with a deadline: [`Communicator::synchronize`] and the
//! [`CollectiveFuture`] of [`Communicator::completion`].
//!
//! A collective whose peer never arrives never finishes on the GPU: its kernel spins, waiting.
//! So a wait here watches two things, the stream reaching an event recorded behind the work
//! (through the event layer's [`AsyncEventWaiter`], which wakes the future) and the
//! communicator's `ncclCommGetAsyncError`, checked at every tick of the waiter's timeout. An
//! asynchronous error, or the deadline, aborts the communicator (NCCL's kernels then exit, so
//! the stream drains and the buffers' recorded uses complete) and resolves to a typed error.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use cuweave_driver::{Event, EventFlags, Stream};
use cuweave_event::{AsyncEventWaiter, EventError, WaitFuture};

use crate::comm::Communicator;
use crate::error::{CollectiveError, Result};

/// How often a pending wait checks `ncclCommGetAsyncError`.
pub const ASYNC_ERROR_TICK: Duration = Duration::from_millis(10);

/// Resolves when the work queued on a stream before [`Communicator::completion`] has finished,
/// or to an error: NCCL's asynchronous error, or [`CollectiveError::Timeout`] after the
/// communicator's deadline (the communicator is then aborted), or
/// [`CollectiveError::Aborted`] when the communicator was aborted (by any thread) before the
/// wait saw the work finish: an abort makes NCCL's kernels exit early, so the stream drains
/// with the collectives cut short and their outputs undefined.
///
/// Runtime-agnostic, like the event layer's [`WaitFuture`] it is built on.
#[must_use = "futures do nothing unless awaited"]
pub struct CollectiveFuture {
    comm: Communicator,
    event: Arc<Event>,
    waiter: &'static AsyncEventWaiter,
    current: WaitFuture,
    started: Instant,
    timeout: Duration,
    operation: &'static str,
}

impl std::fmt::Debug for CollectiveFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollectiveFuture")
            .field("comm", &self.comm)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl CollectiveFuture {
    fn tick(&self) -> Duration {
        first_tick(self.timeout.saturating_sub(self.started.elapsed()))
    }
}

fn first_tick(left: Duration) -> Duration {
    left.min(ASYNC_ERROR_TICK).max(Duration::from_micros(100))
}

impl Future for CollectiveFuture {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        loop {
            match Pin::new(&mut self.current).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) => {
                    // An abort makes NCCL's kernels exit early, so the stream drains and the
                    // event completes with the collectives cut short: not a success.
                    if self.comm.is_aborted() {
                        return Poll::Ready(Err(CollectiveError::Aborted {
                            operation: self.operation,
                        }));
                    }
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Err(EventError::TimedOut { .. })) => {
                    // A tick: has NCCL reported an error, or has the deadline passed?
                    if let Err(error) = self.comm.check_async_error() {
                        return Poll::Ready(Err(error));
                    }
                    if self.started.elapsed() >= self.timeout {
                        self.comm.abort();
                        return Poll::Ready(Err(CollectiveError::Timeout {
                            operation: self.operation,
                            waited: self.started.elapsed(),
                        }));
                    }
                    let tick = self.tick();
                    let next = self
                        .waiter
                        .event_done_with(Arc::clone(&self.event), Some(tick));
                    self.current = next;
                }
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error.into())),
            }
        }
    }
}

struct ThreadWaker(std::thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `future` on this thread, parking between wakes.
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = TaskContext::from_waker(&waker);
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::thread::park();
    }
}

impl Communicator {
    /// A future for the work queued on `stream` so far (collectives and anything else),
    /// resolving within the communicator's deadline ([`CommConfig::timeout`]).
    ///
    /// [`CommConfig::timeout`]: crate::CommConfig::timeout
    ///
    /// # Errors
    /// `InvalidArgument` for a stream on another device; `Aborted`; the driver's error when the
    /// event cannot be recorded; the waiter's when it cannot start.
    pub fn completion(&self, stream: &Stream) -> Result<CollectiveFuture> {
        self.completion_within(stream, self.config().timeout)
    }

    /// [`completion`](Self::completion) with its own deadline.
    ///
    /// # Errors
    /// As [`completion`](Self::completion).
    pub fn completion_within(
        &self,
        stream: &Stream,
        timeout: Duration,
    ) -> Result<CollectiveFuture> {
        const OP: &str = "Communicator::completion";
        if stream.device() != self.device() {
            return Err(CollectiveError::invalid(
                OP,
                format!(
                    "the stream is on device {}, the rank on {}",
                    stream.device().ordinal(),
                    self.device().ordinal()
                ),
            ));
        }
        if self.is_aborted() {
            return Err(CollectiveError::Aborted { operation: OP });
        }
        let event = Arc::new(Event::new(stream.context(), EventFlags::DISABLE_TIMING)?);
        event.record(stream)?;
        let waiter = AsyncEventWaiter::global()?;
        let tick = first_tick(timeout);
        Ok(CollectiveFuture {
            comm: self.clone(),
            current: waiter.event_done_with(Arc::clone(&event), Some(tick)),
            event,
            waiter,
            started: Instant::now(),
            timeout,
            operation: "collective",
        })
    }

    /// Blocks until the work queued on `stream` so far has finished, within the deadline.
    ///
    /// # Errors
    /// As [`completion`](Self::completion); NCCL's asynchronous error; `Timeout` (the
    /// communicator is then aborted and the process carries on).
    pub fn synchronize(&self, stream: &Stream) -> Result<()> {
        block_on(self.completion(stream)?)
    }

    /// [`synchronize`](Self::synchronize) with its own deadline.
    ///
    /// # Errors
    /// As [`synchronize`](Self::synchronize).
    pub fn synchronize_within(&self, stream: &Stream, timeout: Duration) -> Result<()> {
        block_on(self.completion_within(stream, timeout)?)
    }
}
