//! [`WaitFuture`]: a runtime-agnostic `Future` for a point in GPU work.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::error::EventError;
use crate::wake::{Outcome, WaitCell};

/// Resolves when the GPU reaches the point it was made for: a stream's work queued so far
/// ([`AsyncEventWaiter::stream_idle`](crate::AsyncEventWaiter::stream_idle)) or an event
/// ([`AsyncEventWaiter::event_done`](crate::AsyncEventWaiter::event_done)).
///
/// It works under any executor (tokio, smol, `futures::executor::block_on`, …): the waiter's
/// reactor thread calls the task's `Waker` when the GPU gets there, and nothing here depends on
/// a runtime. Polling it early, often, or with a different waker each time is fine.
///
/// Resolves to `Ok(())`, or to an error: the driver's (a context killed by a kernel fault
/// resolves every future on it with the driver's sticky error instead of hanging),
/// [`EventError::TimedOut`] when made with a timeout that expired first, or
/// [`EventError::WaiterShutDown`].
///
/// Dropping it before it resolves cancels the wait; forgetting it (`mem::forget`) leaks only
/// a small shared cell. Neither can free memory the GPU still writes: the completion word
/// behind the wait belongs to the reactor, which takes it back only after the GPU wrote it.
#[derive(Debug)]
#[must_use = "futures do nothing unless awaited"]
pub struct WaitFuture {
    cell: Arc<WaitCell<EventError>>,
    timeout: Option<Duration>,
    finished: bool,
}

impl WaitFuture {
    pub(crate) fn new(cell: Arc<WaitCell<EventError>>, timeout: Option<Duration>) -> Self {
        Self {
            cell,
            timeout,
            finished: false,
        }
    }

    /// The wait's outcome so far, without registering a waker.
    pub fn outcome(&self) -> Outcome {
        self.cell.outcome()
    }

    /// Whether the GPU has reached the point (without registering a waker).
    pub fn is_complete(&self) -> bool {
        self.cell.outcome() == Outcome::Completed
    }
}

impl Future for WaitFuture {
    type Output = Result<(), EventError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let outcome = match self.cell.poll_outcome(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(outcome) => outcome,
        };
        self.finished = true;
        Poll::Ready(match outcome {
            Outcome::Completed => Ok(()),
            Outcome::TimedOut => Err(EventError::TimedOut {
                timeout: self.timeout.unwrap_or_default(),
            }),
            Outcome::Failed => Err(self.cell.take_error().unwrap_or(EventError::WaiterShutDown)),
            // Only this future's drop cancels its cell.
            Outcome::Cancelled | Outcome::Pending => Err(EventError::WaiterShutDown),
        })
    }
}

impl Drop for WaitFuture {
    fn drop(&mut self) {
        if !self.finished {
            self.cell.cancel();
        }
    }
}
