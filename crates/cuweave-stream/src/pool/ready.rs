//! Waiting for the first of several streams to finish its work, without spinning a core.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::stream::PriorityStream;

/// First sleep between polls.
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_micros(20);
/// Longest sleep between polls: bounds how late a finished stream is noticed.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_micros(500);

/// The first of `streams` whose queued work has all finished (`cuStreamQuery`), or `None` once
/// `timeout` has passed. `Duration::MAX` (any timeout too long to be a deadline) waits as long
/// as it takes; with no streams it returns `None` at once.
///
/// A stream that is capturing a graph (on any thread) is never ready: its work is recorded, not
/// run, and querying it would be refused. It is skipped, and the others are still looked at.
///
/// # How it waits
/// It polls: one `cuStreamQuery` per stream (well under a microsecond each), then a sleep that
/// starts at 20 µs and doubles up to 500 µs. The thread sleeps in between, so a long wait costs
/// a few hundred queries a second (well under 1 % of a core) and notices a finished stream at
/// most 500 µs late. A host function per stream would wake it sooner, but it would add a host
/// node to every stream's queue on every call (and later work on those streams would wait behind
/// it); a blocking-sync event wait can watch only one stream per thread. Polling is the only way
/// that watches any number of streams without changing their queues.
///
/// # Why the GPU does not wake it
/// The waiter that the GPU wakes (a completion word behind each stream's work, relayed by one
/// reactor thread that sleeps in the driver when nothing is close) is `cuweave-event`'s
/// `AsyncEventWaiter`, a layer above this crate, which depends on this one; the stream layer
/// cannot call up into it. A program that has the event layer waits for the first of several
/// streams there: one `AsyncEventWaiter::stream_idle` future per stream, raced with any
/// executor's `select`, woken by the GPU without polling.
///
/// # Errors
/// The driver's error from a query (e.g. a kernel that faulted).
pub fn wait_for_any_ready(
    streams: &[Arc<PriorityStream>],
    timeout: Duration,
) -> Result<Option<Arc<PriorityStream>>> {
    // A timeout past what `Instant` can hold (`Duration::MAX`: "wait as long as it takes") has
    // no deadline; with no stream to wait for that would be forever, so it is `None` at once.
    let deadline = Instant::now().checked_add(timeout);
    if deadline.is_none() && streams.is_empty() {
        return Ok(None);
    }
    let mut backoff = FIRST_BACKOFF;
    loop {
        for stream in streams {
            if ready_for_work(stream)? {
                return Ok(Some(Arc::clone(stream)));
            }
        }
        let now = Instant::now();
        let sleep = match deadline {
            Some(deadline) if now >= deadline => return Ok(None),
            Some(deadline) => backoff.min(deadline - now),
            None => backoff,
        };
        std::thread::sleep(sleep);
        backoff = next_backoff(backoff);
    }
}

/// Whether `stream` has finished its queued work and is not capturing: a capturing stream is
/// neither (its work is recorded into a graph, and `cuStreamQuery` on it is refused). One atomic
/// load more than the query while no capture is active.
///
/// # Errors
/// The driver's error from the status query or `cuStreamQuery`.
pub(crate) fn ready_for_work(stream: &PriorityStream) -> Result<bool> {
    if crate::capture::is_capturing(stream.stream())? {
        return Ok(false);
    }
    // While a capture is active or beginning the stream, which is not capturing, is asked in
    // relaxed capture mode: another thread's global capture would refuse a plain query, and a
    // relaxed one breaks no capture, so the scheduler still finds its idle streams. A refusal
    // then (the stream began capturing meanwhile) reads as not ready.
    match cuweave_driver::graph::outside_captures_or_relaxed(|| stream.is_ready())? {
        Err(error) if error.is_capture_refusal() => Ok(false),
        answer => answer,
    }
}

/// The sleep after `current`: doubled, at most [`MAX_BACKOFF`].
pub(crate) fn next_backoff(current: Duration) -> Duration {
    (current * 2).min(MAX_BACKOFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let mut backoff = FIRST_BACKOFF;
        let mut steps = vec![backoff];
        for _ in 0..8 {
            backoff = next_backoff(backoff);
            steps.push(backoff);
        }
        assert_eq!(steps[1], Duration::from_micros(40));
        assert_eq!(*steps.last().unwrap(), MAX_BACKOFF);
        assert!(steps.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn an_endless_timeout_is_no_overflow_and_no_streams_end_it_at_once() {
        let started = Instant::now();
        let found = wait_for_any_ready(&[], Duration::MAX).unwrap();
        assert!(found.is_none());
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn no_streams_times_out_with_none() {
        let started = Instant::now();
        let found = wait_for_any_ready(&[], Duration::from_millis(5)).unwrap();
        assert!(found.is_none());
        assert!(started.elapsed() >= Duration::from_millis(5));
    }
}
