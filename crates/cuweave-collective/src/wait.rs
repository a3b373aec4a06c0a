//! Waiting for collectives with a deadline: [`Communicator::synchronize`] and the
//! [`CollectiveFuture`] of [`Communicator::completion`].
//!
//! A collective whose peer never arrives never finishes on the GPU: its kernel spins, waiting.
//! So a wait here watches two things, the stream reaching an event recorded behind the work
//! (through the event layer's [`AsyncEventWaiter`], which wakes the future) and the
//! communicator's `ncclCommGetAsyncError`, checked at every tick of the waiter's timeout. An
//! asynchronous error, or the deadline, aborts the communicator (NCCL's kernels then exit, so
//! the stream drains and the buffers' recorded uses complete) and resolves to a typed error.
//!
//! - **Finished work is never a timeout.** At each tick the event is asked first: work the
//!   stream has passed resolves `Ok` (also when the future is first polled long after its
//!   deadline), and nothing is aborted.
//! - **The deadline bounds the wait.** `ncclCommAbort` frees the communicator's device and
//!   pinned memory, which can wait for the device: for as long as other work queued ahead of
//!   the collective runs, however short the deadline. So the
//!   communicator is marked aborted at once (it refuses every further call; `is_aborted` is
//!   true) and `ncclCommAbort` runs on a thread of its own; the wait resolves at the deadline.
//!   [`Communicator::abort`] called afterwards returns once that abort has run.
//! - **No wait on a capturing stream.** The event would be recorded into the capture and never
//!   complete, so [`Communicator::completion`] refuses with a capture refusal
//!   (`GraphError::Capturing`) before recording anything; the capture stays intact.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use cuweave_driver::graph::{StatusCheck, outside_captures_or_relaxed, refuse_recording};
use cuweave_driver::{EventPool, OwnedPooledEvent, Stream};
use cuweave_event::{AsyncEventWaiter, EventError, WaitFuture};

use crate::comm::Communicator;
use crate::error::{CollectiveError, Result};

/// How often a pending wait checks `ncclCommGetAsyncError`.
pub const ASYNC_ERROR_TICK: Duration = Duration::from_millis(10);

/// Resolves when the work queued on a stream before [`Communicator::completion`] has finished
/// (whenever it is polled: work already finished is `Ok`), or to an error: NCCL's asynchronous
/// error, or [`CollectiveError::Timeout`] after the communicator's deadline (the communicator
/// is then marked aborted at once, and `ncclCommAbort` runs in the background; see the
/// [module docs](self)), or
/// [`CollectiveError::Aborted`] when the communicator was aborted (by any thread) before the
/// wait saw the work finish: an abort makes NCCL's kernels exit early, so the stream drains
/// with the collectives cut short and their outputs undefined.
///
/// Runtime-agnostic, like the event layer's [`WaitFuture`] it is built on.
#[must_use = "futures do nothing unless awaited"]
pub struct CollectiveFuture {
    comm: Communicator,
    event: Arc<OwnedPooledEvent>,
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
    /// The outcome once the stream has passed the event: an abort makes NCCL's kernels exit
    /// early, so the stream drains and the event completes with the collectives cut short:
    /// not a success.
    fn finished(&self) -> Result<()> {
        if self.comm.is_aborted() {
            return Err(CollectiveError::Aborted {
                operation: self.operation,
            });
        }
        Ok(())
    }

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
                Poll::Ready(Ok(())) => return Poll::Ready(self.finished()),
                Poll::Ready(Err(EventError::TimedOut { .. })) => {
                    // A tick. A future first polled late finds a tick decided long ago, while
                    // the work may have finished since (in time): ask the event first, so that
                    // finished work is never reported as a timeout nor aborts a healthy
                    // communicator. The event was recorded eagerly (`completion_within` refuses a
                    // capturing stream), so a capture this thread is subject to need not forbid
                    // the query: made in relaxed mode, it neither breaks nor is refused.
                    //
                    // The query is cuweave's own (`outside_captures_or_relaxed`): asked plainly
                    // only where no capture is active and none begins (a check of the capture
                    // count and then a plain query would break a global-mode capture another
                    // thread began in between); with a capture active or beginning, asked in
                    // relaxed mode.
                    let done = outside_captures_or_relaxed(|| self.event.query()).ok();
                    match done {
                        Some(Ok(true)) => return Poll::Ready(self.finished()),
                        Some(Ok(false)) => {}
                        // Not asked, or still refused (relaxed mode unavailable): the tick
                        // decides.
                        None => {}
                        Some(Err(error)) if error.is_capture_refusal() => {}
                        Some(Err(error)) => return Poll::Ready(Err(error.into())),
                    }
                    // Has NCCL reported an error, or has the deadline passed? Either aborts
                    // in the background, so the caller is not held (see `abort_in_background`).
                    match self.comm.poll("ncclCommGetAsyncError") {
                        Ok(_) => {}
                        Err(error @ CollectiveError::Aborted { .. }) => {
                            return Poll::Ready(Err(error));
                        }
                        Err(error) => {
                            self.comm.abort_in_background();
                            return Poll::Ready(Err(error));
                        }
                    }
                    if self.started.elapsed() >= self.timeout {
                        self.comm.abort_in_background();
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
    /// `InvalidArgument` for a stream on another device; `Aborted`; a capture refusal
    /// (`GraphError::Capturing`, see [`DriverError::is_capture_refusal`]) for a capturing stream
    /// (nothing is recorded; wait after launching the graph); the driver's error when the
    /// event cannot be recorded; the waiter's when it cannot start.
    ///
    /// [`DriverError::is_capture_refusal`]: cuweave_driver::DriverError::is_capture_refusal
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
        // The event would be recorded into the capture, not run: the wait could never see the
        // work finish (and would time out and abort a healthy communicator). Refused as the
        // event layer refuses its own stream waits, before anything is recorded.
        refuse_recording(
            stream,
            StatusCheck::Always,
            OP,
            "the stream is capturing: nothing queued on it now runs until the capture's graph is launched, so no wait can see it finish; wait after launching the graph",
        )?;
        // From the context's event pool, as every layer takes its events: a wait per collective
        // must not create and destroy a CUDA event each time.
        let event = Arc::new(EventPool::for_context(stream.context())?.acquire_owned(false)?);
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
    /// As [`completion`](Self::completion); NCCL's asynchronous error; `Timeout` at the
    /// deadline (the communicator is then marked aborted and `ncclCommAbort` runs in the
    /// background; the process carries on).
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
