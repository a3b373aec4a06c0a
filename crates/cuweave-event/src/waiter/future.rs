//! [`WaitFuture`]: a runtime-agnostic `Future` for a point in GPU work.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::source::WatchedEvent;
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
/// Dropping it before it resolves cancels the wait (and lets go of the event it waits on, if
/// it owns one); forgetting it (`mem::forget`) leaks a small shared cell and that event.
/// Neither can free memory the GPU still writes: the completion word behind the wait belongs
/// to the reactor, which takes it back only after the GPU wrote it.
#[must_use = "futures do nothing unless awaited"]
pub struct WaitFuture {
    cell: Arc<WaitCell<EventError>>,
    timeout: Option<Duration>,
    finished: bool,
    /// How long the first poll may spin on the outcome before the task parks.
    spin: Duration,
    /// The event the reactor watches (through a weak reference), kept alive by this future
    /// until it resolves or is dropped.
    held: Option<Arc<dyn WatchedEvent>>,
}

impl std::fmt::Debug for WaitFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitFuture")
            .field("outcome", &self.cell.outcome())
            .field("timeout", &self.timeout)
            .field("finished", &self.finished)
            .field("holds_event", &self.held.is_some())
            .finish()
    }
}

impl WaitFuture {
    pub(crate) fn new(cell: Arc<WaitCell<EventError>>, timeout: Option<Duration>) -> Self {
        Self {
            cell,
            timeout,
            finished: false,
            spin: Duration::ZERO,
            held: None,
        }
    }

    /// This future keeps `event` (which the reactor watches weakly) until it resolves or drops.
    pub(crate) fn holding(mut self, event: Arc<dyn WatchedEvent>) -> Self {
        self.held = Some(event);
        self
    }

    /// A future that is already resolved with `Ok(())` (for a point the GPU is known to have
    /// passed).
    pub(crate) fn ready() -> Self {
        let cell = Arc::new(WaitCell::new());
        cell.complete();
        Self::new(cell, None)
    }

    /// A future that is already resolved with `error` (for a point the GPU is known never to
    /// reach, or whose watch failed).
    pub(crate) fn failed(error: EventError) -> Self {
        let cell = Arc::new(WaitCell::new());
        cell.fail(error);
        Self::new(cell, None)
    }

    /// Lets the first poll watch the outcome for up to `budget` before returning `Pending`, so
    /// that a wait which the GPU finishes within the budget resolves without the executor
    /// parking and un-parking its thread.
    ///
    /// That hand-off is the larger part of a short wait: on the H100 host, a completion word
    /// reaches a spinning poller within about a microsecond of `cuStreamSynchronize` returning,
    /// while `futures::executor::block_on` adds about 6 µs to wake its parked thread
    /// (`docs/events.md`). The spin blocks the executor thread for at most `budget`, once per
    /// future, so keep it to tens of microseconds and use it for waits expected to be short (a
    /// small kernel, a small copy). Without it (the default) the first poll registers the waker
    /// and returns at once.
    ///
    /// ```no_run
    /// # async fn example(stream: &cuweave_driver::Stream) -> Result<(), cuweave_event::EventError> {
    /// use std::time::{Duration, Instant};
    /// let waiter = cuweave_event::AsyncEventWaiter::global()?;
    /// waiter
    ///     .stream_idle(stream)?
    ///     .spin_before_park(Duration::from_micros(20))
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn spin_before_park(mut self, budget: Duration) -> Self {
        self.spin = budget;
        self
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
        if !self.spin.is_zero() {
            // Only the first poll spins; later polls come from a wake or a spurious poll.
            // A budget past what a clock can hold spins until the wait is decided.
            let deadline = Instant::now().checked_add(std::mem::take(&mut self.spin));
            while !self.cell.outcome().is_decided()
                && deadline.is_none_or(|deadline| Instant::now() < deadline)
            {
                std::hint::spin_loop();
            }
        }
        let outcome = match self.cell.poll_outcome(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(outcome) => outcome,
        };
        self.finished = true;
        self.held = None;
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

#[cfg(test)]
mod tests {
    use std::task::{Context, Poll, Waker};
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_spinning_first_poll_sees_an_outcome_decided_meanwhile_without_a_wake() {
        let cell = Arc::new(WaitCell::new());
        let decider = Arc::clone(&cell);
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            assert!(decider.complete());
        });
        let mut future =
            Box::pin(WaitFuture::new(cell, None).spin_before_park(Duration::from_secs(5)));
        // A no-op waker: if the first poll returned Pending, nothing would ever poll again.
        let mut cx = Context::from_waker(Waker::noop());
        let started = Instant::now();
        assert!(matches!(future.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "resolved well inside the budget"
        );
        thread.join().unwrap();
    }

    #[test]
    fn the_spin_ends_at_its_budget_and_later_polls_do_not_spin() {
        let cell = Arc::new(WaitCell::new());
        let mut future = Box::pin(
            WaitFuture::new(Arc::clone(&cell), None).spin_before_park(Duration::from_millis(2)),
        );
        let mut cx = Context::from_waker(Waker::noop());
        let started = Instant::now();
        assert!(future.as_mut().poll(&mut cx).is_pending());
        assert!(
            started.elapsed() >= Duration::from_millis(2),
            "spun for the budget"
        );
        let again = Instant::now();
        assert!(future.as_mut().poll(&mut cx).is_pending());
        assert!(
            again.elapsed() < Duration::from_millis(2),
            "the budget is spent once"
        );
        assert!(cell.complete());
        assert!(matches!(future.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
    }
}
