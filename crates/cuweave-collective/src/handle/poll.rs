//! Settle loops: polling until done, failed or past the deadline.

use std::time::{Duration, Instant};

/// Spins for the first polls (a short non-blocking call), then yields, then sleeps briefly
/// (initialisation takes hundreds of milliseconds).
pub(crate) fn back_off(polls: u32) {
    if polls < 64 {
        std::hint::spin_loop();
    } else if polls < 1024 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// What one poll of a settle loop found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Polled {
    /// Finished.
    Done,
    /// Still in progress: poll again.
    Pending,
}

/// Polls `step` until it is [`Done`](Polled::Done) or fails, or until `timeout` has passed since
/// `started` (then `timed_out(waited)` is the error). Nothing is held between polls, so a step
/// that takes a fresh [`CallGuard`] each time sees an abort requested from another thread at its
/// next poll instead of at the deadline.
///
/// [`CallGuard`]: super::CallGuard
pub(crate) fn poll_until<E>(
    started: Instant,
    timeout: Duration,
    mut step: impl FnMut() -> Result<Polled, E>,
    timed_out: impl FnOnce(Duration) -> E,
) -> Result<(), E> {
    let mut polls = 0u32;
    loop {
        if step()? == Polled::Done {
            return Ok(());
        }
        let waited = started.elapsed();
        if waited >= timeout {
            return Err(timed_out(waited));
        }
        polls += 1;
        back_off(polls);
    }
}
