//! The concurrency protocol of one communicator handle, with no NCCL in it: who may call into
//! NCCL with the handle, and how an abort from another thread takes it away.
//!
//! Issuing work on a communicator is serialised by the communicator's issue lock (NCCL's rule);
//! that lock may be held for as long as a call takes to settle. Everything here is separate from
//! it, so [`HandleCell::is_aborted`] is one atomic load, and an abort (a watchdog thread, a
//! deadline in a future) never waits for the issuing thread's deadline:
//!
//! - every NCCL call on the handle runs under a [`CallGuard`] from [`HandleCell::enter`], which
//!   is refused once an abort has been requested; settle loops take a fresh guard for each poll,
//!   so they see an abort at their next poll;
//! - [`HandleCell::begin_abort`] marks the cell aborted (no new guard is handed out), waits for
//!   the guards in flight to leave (a non-blocking communicator's calls return at once), and
//!   hands the handle to exactly one caller, who runs `ncclCommAbort`. A guard still held after
//!   `grace` is a blocking call hung inside NCCL (a peer that never arrives): the handle is then
//!   handed over anyway, because `ncclCommAbort` from another thread is how NCCL cuts such a
//!   call short.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long an abort waits for calls in flight before aborting under them (a blocking call hung
/// inside NCCL). Calls on a non-blocking communicator return within microseconds.
pub(crate) const ABORT_GRACE: Duration = Duration::from_millis(100);

/// A handle shared by threads that call NCCL with it and threads that may abort it.
#[derive(Debug)]
pub(crate) struct HandleCell<H> {
    /// `None` once taken by an abort or by the owner's drop. Locked briefly, never across a call.
    raw: Mutex<Option<H>>,
    /// Set (under `raw`'s lock) when an abort is requested; read without any lock.
    aborted: AtomicBool,
    /// Guards handed out and not yet dropped.
    in_flight: AtomicUsize,
}

/// Permission to make one NCCL call with the handle: while it lives, an abort waits (up to its
/// grace) before freeing the handle.
#[derive(Debug)]
pub(crate) struct CallGuard<'a, H> {
    cell: &'a HandleCell<H>,
    raw: H,
}

impl<H: Copy> CallGuard<'_, H> {
    /// The handle.
    pub(crate) fn raw(&self) -> H {
        self.raw
    }
}

impl<H> Drop for CallGuard<'_, H> {
    fn drop(&mut self) {
        self.cell.in_flight.fetch_sub(1, Ordering::Release);
    }
}

impl<H: Copy> HandleCell<H> {
    pub(crate) fn new(raw: H) -> Self {
        Self {
            raw: Mutex::new(Some(raw)),
            aborted: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
        }
    }

    /// A guard for one call, or `None` once an abort was requested (or the handle is gone).
    pub(crate) fn enter(&self) -> Option<CallGuard<'_, H>> {
        let raw = self.raw.lock();
        // `aborted` is only set under this lock, so no guard is handed out after an abort
        // started waiting for the guards in flight.
        if self.aborted.load(Ordering::Relaxed) {
            return None;
        }
        let raw = (*raw)?;
        self.in_flight.fetch_add(1, Ordering::Acquire);
        Some(CallGuard { cell: self, raw })
    }

    /// Whether an abort was requested: one atomic load, never waits for a call.
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// The handle, unless aborted or gone (for interop; no call is made with it here).
    pub(crate) fn peek(&self) -> Option<H> {
        let raw = self.raw.lock();
        if self.is_aborted() { None } else { *raw }
    }

    /// Requests an abort: from now on [`enter`](Self::enter) refuses; waits for the guards in
    /// flight to leave, at most `grace`; then hands the handle to the one caller that must abort
    /// it (`None` to every other caller, and when the handle is already gone).
    ///
    /// The caller must not hold a guard of this cell itself (it would wait out the grace).
    pub(crate) fn begin_abort(&self, grace: Duration) -> Option<H> {
        {
            let raw = self.raw.lock();
            raw.as_ref()?;
            self.aborted.store(true, Ordering::Release);
        }
        let started = Instant::now();
        let mut polls = 0u32;
        while self.in_flight.load(Ordering::Acquire) != 0 && started.elapsed() < grace {
            polls += 1;
            back_off(polls);
        }
        self.raw.lock().take()
    }

    /// Takes the handle for the owner's drop (no other reference exists then).
    pub(crate) fn take(&mut self) -> Option<H> {
        self.raw.get_mut().take()
    }
}

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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::mpsc;

    use rstest::rstest;

    use super::*;

    #[derive(Debug, PartialEq)]
    enum Stop {
        Aborted,
        TimedOut,
    }

    /// The watchdog pattern: thread A settles a call whose peer never arrives (120 s deadline);
    /// thread B aborts. A stops at its next poll, long before its deadline.
    #[test]
    fn an_abort_from_another_thread_stops_a_settle_loop_long_before_its_deadline() {
        let cell = Arc::new(HandleCell::new(7u32));
        let (polling, polled) = mpsc::channel();
        let settling = {
            let cell = Arc::clone(&cell);
            std::thread::spawn(move || {
                let started = Instant::now();
                let result = poll_until(
                    started,
                    Duration::from_secs(120),
                    || {
                        let guard = cell.enter().ok_or(Stop::Aborted)?;
                        assert_eq!(guard.raw(), 7);
                        let _ = polling.send(());
                        Ok(Polled::Pending)
                    },
                    |_| Stop::TimedOut,
                );
                (result, started.elapsed())
            })
        };
        polled.recv().expect("the settle loop polls");
        assert!(!cell.is_aborted());
        let started = Instant::now();
        assert_eq!(cell.begin_abort(Duration::from_secs(60)), Some(7));
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the abort waited only for one poll, not for the grace"
        );
        assert!(cell.is_aborted());
        let (result, waited) = settling.join().expect("thread");
        assert_eq!(result, Err(Stop::Aborted));
        assert!(waited < Duration::from_secs(60), "{waited:?}");
        assert!(cell.enter().is_none(), "no call after an abort");
    }

    /// A blocking call hung inside NCCL holds its guard for ever: `is_aborted` does not wait for
    /// it, and the abort hands the handle over after its grace (NCCL's abort cuts the call short).
    #[test]
    fn a_call_hung_in_flight_neither_blocks_is_aborted_nor_the_abort() {
        let cell = HandleCell::new(3u64);
        let hung = cell.enter().expect("a call starts");
        assert!(!cell.is_aborted());
        assert_eq!(cell.peek(), Some(3));
        let started = Instant::now();
        assert_eq!(cell.begin_abort(Duration::from_millis(20)), Some(3));
        assert!(started.elapsed() >= Duration::from_millis(20));
        assert!(cell.is_aborted());
        assert_eq!(cell.peek(), None);
        drop(hung);
        assert!(cell.enter().is_none());
    }

    /// An abort waits for a call in flight (which returns at once on a non-blocking
    /// communicator) before taking the handle, and hands out no new guard meanwhile.
    #[test]
    fn an_abort_waits_for_a_call_in_flight_and_refuses_new_ones() {
        let cell = Arc::new(HandleCell::new(5u8));
        let call = cell.enter().expect("a call starts");
        let (taken_tx, taken) = mpsc::channel();
        let aborting = {
            let cell = Arc::clone(&cell);
            std::thread::spawn(move || {
                let handle = cell.begin_abort(Duration::from_secs(600));
                taken_tx.send(handle).expect("send");
            })
        };
        while !cell.is_aborted() {
            std::thread::yield_now();
        }
        assert!(cell.enter().is_none(), "no new call once the abort started");
        assert!(
            taken.try_recv().is_err(),
            "the handle is not freed under a call in flight"
        );
        drop(call);
        assert_eq!(
            taken.recv_timeout(Duration::from_secs(30)).expect("taken"),
            Some(5)
        );
        aborting.join().expect("thread");
    }

    #[rstest]
    #[case(2)]
    #[case(8)]
    fn exactly_one_of_several_aborts_gets_the_handle(#[case] threads: usize) {
        let cell = Arc::new(HandleCell::new(1i32));
        let handed: Vec<Option<i32>> = (0..threads)
            .map(|_| {
                let cell = Arc::clone(&cell);
                std::thread::spawn(move || cell.begin_abort(ABORT_GRACE))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("thread"))
            .collect();
        assert_eq!(handed.iter().flatten().count(), 1, "{handed:?}");
        assert!(cell.is_aborted());
    }

    #[rstest]
    #[case::done_at_once(0)]
    #[case::done_after_polls(50)]
    fn poll_until_returns_when_done(#[case] pending: u32) {
        let mut left = pending;
        let result: Result<(), Stop> = poll_until(
            Instant::now(),
            Duration::from_secs(60),
            || {
                if left == 0 {
                    Ok(Polled::Done)
                } else {
                    left -= 1;
                    Ok(Polled::Pending)
                }
            },
            |_| Stop::TimedOut,
        );
        assert_eq!(result, Ok(()));
        assert_eq!(left, 0);
    }

    #[test]
    fn poll_until_times_out_and_reports_the_wait() {
        let timeout = Duration::from_millis(5);
        let result: Result<(), Duration> = poll_until(
            Instant::now(),
            timeout,
            || Ok(Polled::Pending),
            |waited| waited,
        );
        assert!(result.expect_err("times out") >= timeout);
    }
}
