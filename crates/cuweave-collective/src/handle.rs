//! The concurrency protocol of one communicator handle, with no NCCL in it: who may call into
//! NCCL with the handle, and how an abort from another thread takes it away.
//!
//! Issuing work on a communicator is serialised by the communicator's issue lock (NCCL's rule);
//! that lock may be held for as long as a call takes to settle. Everything here is separate from
//! it, so [`HandleCell::is_aborted`] is one atomic load, and an abort (a watchdog thread, a
//! deadline in a future) never waits for the issuing thread's deadline.
//!
//! The invariants (each tested below):
//!
//! 1. **The handle is reached only through a [`CallGuard`], inside a call.** A guard comes from
//!    [`HandleCell::enter`], which refuses once an abort was requested; the raw handle is only
//!    lent to the closure of [`CallGuard::call`] or [`CallGuard::blocking_call`], never
//!    returned, so nothing can keep it past the call.
//! 2. **A live guard pins the handle**, however long it is held, unless it is inside a blocking
//!    call (3): an abort waits for it. So a thread between calls (preparing buffers, between
//!    the calls of an open group, building an error) never finds the handle freed under it.
//!    Guards are taken per NCCL call (or per open group), never across work that can block
//!    outside NCCL.
//! 3. **The one exception is a blocking call hung inside NCCL** (a peer that never arrives, a
//!    blocking `ncclGroupEnd` initialising children). Once every live guard is inside a blocking
//!    call ([`CallGuard::blocking_call`], [`end_group`]) and the abort's grace has passed, the
//!    abort takes the handle and runs `ncclCommAbort` while they are still inside: that is how
//!    NCCL cuts such a call short (PyTorch's watchdog pattern).
//! 4. **A call cut short never touches the handle again.** Its guard is consumed by the blocking
//!    call; it reports [`Blocking::CutShort`], and the caller gets no handle to pass to
//!    `ncclGetLastError` or any other call.
//! 5. **Between calls the abort is seen:** [`CallGuard::call`] and [`CallGuard::blocking_call`]
//!    refuse (without calling) once an abort was requested; settle loops take a fresh guard for
//!    each poll, so they stop at their next poll.
//! 6. **Exactly one abort runs `ncclCommAbort`, and every concurrent abort returns only after it
//!    has** ([`HandleCell::abort_with`]): a caller that returns from `abort` may rely on the
//!    communicator being aborted.
//!
//! An abort must not be requested by a thread that holds a guard of the same cell (it would
//! wait for itself); the crate requests aborts only between calls.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How long an abort waits for blocking calls in flight before aborting under them (a call hung
/// inside NCCL). Calls on a non-blocking communicator return within microseconds.
pub(crate) const ABORT_GRACE: Duration = Duration::from_millis(100);

/// What [`HandleCell::request_abort`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Requested {
    /// This caller requested the abort and must run it
    /// ([`HandleCell::run_requested_abort`]).
    ByThisCaller,
    /// Another caller requested it earlier (it may still be running).
    Already,
    /// The handle is gone (taken by the owner's drop): nothing to abort.
    Gone,
}

/// Where a cell's abort stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AbortState {
    NotRequested,
    /// Requested: no guard is handed out; one caller waits for the guards, then aborts.
    InProgress,
    /// The aborting caller has run its abort.
    Done,
}

/// What the cell's lock protects.
#[derive(Debug)]
struct Shared<H> {
    /// `None` once taken by an abort or by the owner's drop.
    raw: Option<H>,
    /// Guards alive.
    guards: usize,
    /// Of those, guards inside a blocking call (invariant 3: the only ones an abort may cut
    /// short).
    blocked: usize,
    abort: AbortState,
}

/// A handle shared by threads that call NCCL with it and threads that may abort it.
#[derive(Debug)]
pub(crate) struct HandleCell<H> {
    /// Locked briefly, never across a call.
    shared: Mutex<Shared<H>>,
    /// Notified when a guard leaves or enters a blocking call while an abort waits, and when an
    /// abort is done.
    changed: Condvar,
    /// Set (under `shared`'s lock) when an abort is requested; read without any lock.
    aborted: AtomicBool,
}

/// Permission to call NCCL with the handle (invariants 1 and 2): while it lives outside a
/// blocking call, the handle is not freed.
#[must_use]
#[derive(Debug)]
pub(crate) struct CallGuard<'a, H> {
    cell: &'a HandleCell<H>,
    raw: H,
}

/// How a blocking call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Blocking<R> {
    /// An abort had been requested: the call was not made.
    Refused,
    /// The call returned with the handle still owned: its result may be read, and the handle
    /// used again through a new guard.
    Returned(R),
    /// An abort took the handle while the call was inside NCCL (it cut the call short). Its
    /// result means nothing, and the handle must not be touched again.
    CutShort,
}

impl<H: Copy> CallGuard<'_, H> {
    /// Makes one call that cannot block (a call inside an open group, an error query, a poll
    /// of a non-blocking communicator): `None`, without calling, once an abort was requested.
    /// An abort waits for it to return.
    pub(crate) fn call<R>(&self, f: impl FnOnce(H) -> R) -> Option<R> {
        // Safe without the lock: if the abort is requested right after this load, it still
        // waits for this guard, which is not inside a blocking call (invariant 2).
        if self.cell.is_aborted() {
            return None;
        }
        Some(f(self.raw))
    }

    /// Makes one call that may block inside NCCL (a collective on a blocking communicator):
    /// refused once an abort was requested; an abort whose grace has passed may take the handle
    /// while it runs. The guard is consumed, so a call cut short cannot reach the handle again.
    pub(crate) fn blocking_call<R>(self, f: impl FnOnce(H) -> R) -> Blocking<R> {
        let raw = self.raw;
        let Some(inside) = Inside::enter(self, true) else {
            return Blocking::Refused;
        };
        let result = f(raw);
        if inside.leave() {
            Blocking::CutShort
        } else {
            Blocking::Returned(result)
        }
    }
}

/// Closes an open group with `f` (`ncclGroupEnd`) under every guard taken for the group's calls:
/// a blocking call on each of their handles, made even once an abort was requested (the thread
/// must leave group mode, and the guards kept the handles alive until now). Returns `f`'s
/// result and whether an abort cut it short (a handle was taken while it ran: the result then
/// means nothing, and no handle of the group may be read from it).
pub(crate) fn end_group<H, R>(guards: Vec<CallGuard<'_, H>>, f: impl FnOnce() -> R) -> (R, bool) {
    let inside: Vec<Inside<'_, H>> = guards
        .into_iter()
        .filter_map(|guard| Inside::enter(guard, false))
        .collect();
    let result = f();
    let mut cut_short = false;
    for inside in inside {
        cut_short |= inside.leave();
    }
    (result, cut_short)
}

/// A guard inside a blocking call. Leaving (or unwinding) drops the guard.
struct Inside<'a, H> {
    cell: &'a HandleCell<H>,
}

impl<'a, H> Inside<'a, H> {
    /// Marks `guard` as inside a blocking call; `None` (the guard dropped) when `refuse` and an
    /// abort was requested.
    fn enter(guard: CallGuard<'a, H>, refuse: bool) -> Option<Self> {
        let cell = guard.cell;
        let mut shared = cell.shared.lock();
        if refuse && shared.abort != AbortState::NotRequested {
            drop(shared);
            drop(guard);
            return None;
        }
        shared.blocked += 1;
        if shared.abort == AbortState::InProgress {
            cell.changed.notify_all();
        }
        drop(shared);
        // Its count now belongs to `Inside`, which gives it back when it leaves.
        std::mem::forget(guard);
        Some(Self { cell })
    }

    /// Leaves the call and drops the guard; whether the handle was taken meanwhile.
    fn leave(self) -> bool {
        let taken = self.release();
        std::mem::forget(self);
        taken
    }

    fn release(&self) -> bool {
        let mut shared = self.cell.shared.lock();
        shared.blocked -= 1;
        shared.guards -= 1;
        if shared.abort == AbortState::InProgress {
            self.cell.changed.notify_all();
        }
        shared.raw.is_none()
    }
}

impl<H> Drop for Inside<'_, H> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<H> Drop for CallGuard<'_, H> {
    fn drop(&mut self) {
        let mut shared = self.cell.shared.lock();
        shared.guards -= 1;
        if shared.abort == AbortState::InProgress {
            self.cell.changed.notify_all();
        }
    }
}

/// Marks the abort done, and wakes the callers waiting for it, even if the abort panicked.
struct AbortDone<'a, H>(&'a HandleCell<H>);

impl<H> Drop for AbortDone<'_, H> {
    fn drop(&mut self) {
        self.0.shared.lock().abort = AbortState::Done;
        self.0.changed.notify_all();
    }
}

impl<H: Copy> HandleCell<H> {
    pub(crate) fn new(raw: H) -> Self {
        Self {
            shared: Mutex::new(Shared {
                raw: Some(raw),
                guards: 0,
                blocked: 0,
                abort: AbortState::NotRequested,
            }),
            changed: Condvar::new(),
            aborted: AtomicBool::new(false),
        }
    }

    /// A guard for one call (or one open group), or `None` once an abort was requested (or the
    /// handle is gone).
    pub(crate) fn enter(&self) -> Option<CallGuard<'_, H>> {
        let mut shared = self.shared.lock();
        if shared.abort != AbortState::NotRequested {
            return None;
        }
        let raw = shared.raw?;
        shared.guards += 1;
        Some(CallGuard { cell: self, raw })
    }

    /// Whether an abort was requested: one atomic load, never waits for a call.
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// The handle, unless aborted or gone (for interop; no call is made with it here).
    pub(crate) fn peek(&self) -> Option<H> {
        let shared = self.shared.lock();
        match shared.abort {
            AbortState::NotRequested => shared.raw,
            _ => None,
        }
    }

    /// Aborts: from now on [`enter`](Self::enter) and the calls of live guards refuse; once no
    /// guard pins the handle (every guard gone, or, after `grace`, every guard left inside a
    /// blocking call: invariants 2 and 3), exactly one caller takes the handle and runs
    /// `abort` with it. Every other caller returns only after that `abort` has returned
    /// (invariant 6). Returns whether this caller ran it (`false` too when the handle is
    /// already gone).
    ///
    /// The caller must not hold a guard of this cell itself (it would wait for itself).
    pub(crate) fn abort_with(&self, grace: Duration, abort: impl FnOnce(H)) -> bool {
        match self.request_abort() {
            Requested::ByThisCaller => self.run_requested_abort(grace, abort),
            Requested::Already => {
                self.wait_for_abort();
                false
            }
            Requested::Gone => false,
        }
    }

    /// The first half of [`abort_with`](Self::abort_with), which never waits: marks the abort
    /// requested (from now on [`is_aborted`](Self::is_aborted) is true, [`enter`](Self::enter)
    /// and the calls of live guards refuse, and every other abort waits for this one), and says
    /// whether this caller must run it. A caller told [`Requested::ByThisCaller`] must call
    /// [`run_requested_abort`](Self::run_requested_abort) exactly once (on any thread):
    /// until then every other `abort_with` waits.
    pub(crate) fn request_abort(&self) -> Requested {
        let mut shared = self.shared.lock();
        match shared.abort {
            AbortState::Done | AbortState::InProgress => return Requested::Already,
            AbortState::NotRequested => {}
        }
        if shared.raw.is_none() {
            return Requested::Gone;
        }
        shared.abort = AbortState::InProgress;
        self.aborted.store(true, Ordering::Release);
        Requested::ByThisCaller
    }

    /// The second half of [`abort_with`](Self::abort_with), for the caller that
    /// [`request_abort`](Self::request_abort) chose: waits until no guard pins the handle
    /// (invariants 2 and 3), takes it, runs `abort` with it and wakes every caller waiting for
    /// the abort. Returns whether `abort` ran.
    pub(crate) fn run_requested_abort(&self, grace: Duration, abort: impl FnOnce(H)) -> bool {
        let mut shared = self.shared.lock();
        debug_assert_eq!(shared.abort, AbortState::InProgress);
        let done = AbortDone(self);
        let deadline = Instant::now() + grace;
        while shared.guards > 0 {
            if shared.guards > shared.blocked {
                // A guard outside a blocking call pins the handle: its holder sees the abort at
                // its next call and drops it.
                self.changed.wait(&mut shared);
            } else if self.changed.wait_until(&mut shared, deadline).timed_out()
                && shared.guards == shared.blocked
            {
                // Every guard left is hung inside a blocking call: cut it short.
                break;
            }
        }
        let raw = shared.raw.take();
        drop(shared);
        if let Some(raw) = raw {
            abort(raw);
        }
        drop(done);
        raw.is_some()
    }

    /// Waits until a requested abort has run.
    fn wait_for_abort(&self) {
        let mut shared = self.shared.lock();
        while shared.abort != AbortState::Done {
            self.changed.wait(&mut shared);
        }
    }

    /// Takes the handle for the owner's drop (no other reference exists then).
    pub(crate) fn take(&mut self) -> Option<H> {
        self.shared.get_mut().raw.take()
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
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc;
    use std::sync::{Arc, Barrier};

    use rstest::rstest;

    use super::*;

    #[derive(Debug, PartialEq)]
    enum Stop {
        Aborted,
        TimedOut,
    }

    /// Long enough that a test never reaches it by accident.
    const FOREVER: Duration = Duration::from_secs(600);
    /// How long a test gives a thread to do what it must not do.
    const SETTLE: Duration = Duration::from_millis(100);

    /// Runs `abort_with` on another thread; the handle it aborts comes back on the receiver,
    /// after `on_abort` ran (the stand-in for `ncclCommAbort` in these NCCL-free tests).
    fn abort_in_background<H: Copy + Send + Sync + 'static>(
        cell: &Arc<HandleCell<H>>,
        grace: Duration,
        on_abort: impl FnOnce() + Send + 'static,
    ) -> (mpsc::Receiver<H>, std::thread::JoinHandle<bool>) {
        let (taken_tx, taken) = mpsc::channel();
        let cell = Arc::clone(cell);
        let aborting = std::thread::spawn(move || {
            cell.abort_with(grace, |raw| {
                on_abort();
                taken_tx.send(raw).expect("send");
            })
        });
        (taken, aborting)
    }

    fn wait_for_abort_request<H: Copy>(cell: &HandleCell<H>) {
        while !cell.is_aborted() {
            std::thread::yield_now();
        }
    }

    /// The watchdog pattern: thread A settles a call whose peer never arrives (120 s deadline)
    /// with a fresh guard per poll; thread B aborts. A stops at its next poll (invariant 5).
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
                        let raw = guard.call(|raw| raw).ok_or(Stop::Aborted)?;
                        assert_eq!(raw, 7);
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
        let mut taken = None;
        assert!(cell.abort_with(FOREVER, |raw| taken = Some(raw)));
        assert_eq!(taken, Some(7));
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the abort waited only for one poll, not for the grace"
        );
        let (result, waited) = settling.join().expect("thread");
        assert_eq!(result, Err(Stop::Aborted));
        assert!(waited < Duration::from_secs(60), "{waited:?}");
        assert!(cell.enter().is_none(), "no call after an abort");
    }

    /// Invariant 2: a thread between calls (preparing buffers behind a contended lock, between
    /// the calls of an open group) holds its guard past the grace; the handle is not handed
    /// over until the guard is gone, and the guard's next call is refused.
    #[test]
    fn a_guard_between_calls_pins_the_handle_past_the_grace() {
        let cell = Arc::new(HandleCell::new(5u8));
        let guard = cell.enter().expect("a call starts");
        let grace = Duration::from_millis(5);
        let (taken, aborting) = abort_in_background(&cell, grace, || {});
        wait_for_abort_request(&cell);
        assert!(
            cell.enter().is_none(),
            "no new guard once the abort started"
        );
        assert!(
            taken.recv_timeout(SETTLE).is_err(),
            "the handle is not freed under a guard outside a call, even {SETTLE:?} after a \
             {grace:?} grace"
        );
        assert_eq!(guard.call(|_| unreachable!("refused")), None);
        assert_eq!(cell.peek(), None);
        drop(guard);
        assert_eq!(taken.recv_timeout(FOREVER).expect("taken"), 5);
        assert!(aborting.join().expect("thread"));
    }

    /// Invariants 3 and 4: a blocking call hung inside NCCL is cut short after the grace (the
    /// abort runs while it is inside, and unblocks it, as `ncclCommAbort` does); when it returns
    /// it learns it was cut short, and its guard is gone.
    #[test]
    fn a_blocking_call_hung_inside_nccl_is_cut_short_and_never_reaches_the_handle_again() {
        let cell = Arc::new(HandleCell::new(3u64));
        let (inside_tx, inside) = mpsc::channel();
        let (release_tx, release) = mpsc::channel::<()>();
        let calling = {
            let cell = Arc::clone(&cell);
            std::thread::spawn(move || {
                let guard = cell.enter().expect("a call starts");
                let outcome = guard.blocking_call(|raw| {
                    inside_tx.send(()).expect("send");
                    // Hung until the abort cuts it short.
                    release.recv().expect("released by the abort");
                    raw
                });
                (outcome, cell.enter().is_none())
            })
        };
        inside.recv().expect("the call is inside NCCL");
        let grace = Duration::from_millis(20);
        let started = Instant::now();
        let mut taken = None;
        assert!(cell.abort_with(grace, |raw| {
            taken = Some(raw);
            release_tx.send(()).expect("unblock");
        }));
        assert!(
            started.elapsed() >= grace,
            "the abort gave the call its grace"
        );
        assert_eq!(taken, Some(3));
        let (outcome, refused) = calling.join().expect("thread");
        assert_eq!(outcome, Blocking::CutShort);
        assert!(refused, "no call after being cut short");
        assert!(cell.is_aborted());
    }

    /// A blocking call that returns within the grace is not cut short: its result stands and the
    /// abort takes the handle after it.
    #[test]
    fn a_blocking_call_returning_within_the_grace_keeps_its_result() {
        let cell = Arc::new(HandleCell::new(9u16));
        let (inside_tx, inside) = mpsc::channel();
        let (release_tx, release) = mpsc::channel::<()>();
        let calling = {
            let cell = Arc::clone(&cell);
            std::thread::spawn(move || {
                let guard = cell.enter().expect("a call starts");
                guard.blocking_call(|raw| {
                    inside_tx.send(()).expect("send");
                    release.recv().expect("release");
                    raw
                })
            })
        };
        inside.recv().expect("the call is inside NCCL");
        let (taken, aborting) = abort_in_background(&cell, FOREVER, || {});
        wait_for_abort_request(&cell);
        release_tx.send(()).expect("release");
        assert_eq!(calling.join().expect("thread"), Blocking::Returned(9));
        assert_eq!(taken.recv_timeout(FOREVER).expect("taken"), 9);
        assert!(aborting.join().expect("thread"));
    }

    /// Invariant 5: once an abort was requested, a live guard's calls are refused without
    /// calling.
    #[rstest]
    #[case::call(false)]
    #[case::blocking_call(true)]
    fn calls_are_refused_once_an_abort_was_requested(#[case] blocking: bool) {
        let cell = Arc::new(HandleCell::new(1i64));
        let guard = cell.enter().expect("a call starts");
        let (taken, aborting) = abort_in_background(&cell, FOREVER, || {});
        wait_for_abort_request(&cell);
        if blocking {
            assert_eq!(
                guard.blocking_call(|_| unreachable!("refused")),
                Blocking::<()>::Refused
            );
        } else {
            assert_eq!(guard.call(|_| unreachable!("refused")), None::<()>);
            drop(guard);
        }
        assert_eq!(taken.recv_timeout(FOREVER).expect("taken"), 1);
        assert!(aborting.join().expect("thread"));
    }

    /// Invariants 2 and 3 for a group: the guards of an open group pin the handle while its
    /// calls are queued; `ncclGroupEnd` is made even after the abort was requested (the thread
    /// must leave group mode), and only it can be cut short. Two guards of one cell (two calls
    /// on one communicator) and a guard of another cell, which the abort leaves alone.
    #[test]
    fn a_group_end_is_made_after_an_abort_request_and_only_it_is_cut_short() {
        let aborted = Arc::new(HandleCell::new(11u32));
        let other = Arc::new(HandleCell::new(12u32));
        let (queued_tx, queued) = mpsc::channel();
        let (go_tx, go) = mpsc::channel::<()>();
        let (inside_tx, inside) = mpsc::channel();
        let (release_tx, release) = mpsc::channel::<()>();
        let grouping = {
            let (aborted, other) = (Arc::clone(&aborted), Arc::clone(&other));
            std::thread::spawn(move || {
                let guards = vec![
                    aborted.enter().expect("first call"),
                    other.enter().expect("other communicator"),
                    aborted.enter().expect("second call"),
                ];
                for guard in &guards {
                    assert!(guard.call(|_| ()).is_some());
                }
                queued_tx.send(()).expect("send");
                go.recv().expect("go");
                end_group(guards, || {
                    inside_tx.send(()).expect("send");
                    release.recv().expect("released by the abort");
                    "ended"
                })
            })
        };
        queued.recv().expect("the group's calls are queued");
        let grace = Duration::from_millis(5);
        let (taken, aborting) = abort_in_background(&aborted, grace, move || {
            release_tx.send(()).expect("unblock")
        });
        wait_for_abort_request(&aborted);
        assert!(
            taken.recv_timeout(SETTLE).is_err(),
            "not taken between the group's calls"
        );
        go_tx.send(()).expect("go");
        inside
            .recv()
            .expect("ncclGroupEnd is made although an abort was requested");
        assert_eq!(taken.recv_timeout(FOREVER).expect("taken"), 11);
        assert_eq!(grouping.join().expect("thread"), ("ended", true));
        assert!(aborting.join().expect("thread"));
        assert!(!other.is_aborted());
        assert_eq!(other.peek(), Some(12));
    }

    /// A group whose end returns within the grace is not cut short, though an abort was
    /// requested while it was open: the abort runs after it.
    #[test]
    fn a_group_end_returning_within_the_grace_is_not_cut_short() {
        let cell = Arc::new(HandleCell::new(4u8));
        let guard = cell.enter().expect("a call");
        let (taken, aborting) = abort_in_background(&cell, FOREVER, || {});
        wait_for_abort_request(&cell);
        let mut ended = false;
        let ((), cut_short) = end_group(vec![guard], || ended = true);
        assert!(ended);
        assert!(!cut_short);
        assert_eq!(taken.recv_timeout(FOREVER).expect("taken"), 4);
        assert!(aborting.join().expect("thread"));
    }

    /// Invariant 6: callers that lose the race return only once the winner's abort has run.
    #[rstest]
    #[case(1)]
    #[case(4)]
    fn concurrent_aborts_return_only_after_the_winner_aborted(#[case] losers: usize) {
        let cell = Arc::new(HandleCell::new(2u32));
        let done = Arc::new(AtomicBool::new(false));
        let (inside_tx, inside) = mpsc::channel();
        let (release_tx, release) = mpsc::channel::<()>();
        let winner = {
            let (cell, done) = (Arc::clone(&cell), Arc::clone(&done));
            std::thread::spawn(move || {
                cell.abort_with(FOREVER, |_| {
                    inside_tx.send(()).expect("send");
                    release.recv().expect("release");
                    done.store(true, Ordering::SeqCst);
                })
            })
        };
        inside.recv().expect("the winner is inside ncclCommAbort");
        let (returned_tx, returned) = mpsc::channel();
        let losers: Vec<_> = (0..losers)
            .map(|_| {
                let (cell, done, returned_tx) =
                    (Arc::clone(&cell), Arc::clone(&done), returned_tx.clone());
                std::thread::spawn(move || {
                    let ran = cell.abort_with(FOREVER, |_| unreachable!("one abort"));
                    // What the caller of `Communicator::abort` relies on.
                    let aborted_by_then = done.load(Ordering::SeqCst);
                    returned_tx.send(()).expect("send");
                    (ran, aborted_by_then)
                })
            })
            .collect();
        assert!(
            returned.recv_timeout(SETTLE).is_err(),
            "a loser returned while the winner was still aborting"
        );
        release_tx.send(()).expect("release");
        assert!(winner.join().expect("thread"));
        for loser in losers {
            assert_eq!(loser.join().expect("thread"), (false, true));
        }
        assert!(!cell.abort_with(FOREVER, |_| unreachable!("done")));
    }

    /// The deadline's abort: requesting it marks the cell aborted at once (no call is
    /// accepted), without waiting for anything; a second request and every `abort_with` wait
    /// for the one run elsewhere (here, on another thread), and the handle is taken once.
    #[test]
    fn a_requested_abort_refuses_at_once_and_others_wait_for_its_run_elsewhere() {
        let cell = Arc::new(HandleCell::new(6u32));
        let guard = cell.enter().expect("a call between polls");
        assert_eq!(cell.request_abort(), Requested::ByThisCaller);
        assert!(cell.is_aborted(), "aborted as soon as it is requested");
        assert!(cell.enter().is_none());
        assert_eq!(cell.peek(), None);
        assert_eq!(cell.request_abort(), Requested::Already);
        let (returned_tx, returned) = mpsc::channel();
        let waiting = {
            let (cell, returned_tx) = (Arc::clone(&cell), returned_tx.clone());
            std::thread::spawn(move || {
                let ran = cell.abort_with(FOREVER, |_| unreachable!("one abort"));
                returned_tx.send(()).expect("send");
                ran
            })
        };
        let running = {
            let cell = Arc::clone(&cell);
            std::thread::spawn(move || {
                let mut taken = None;
                let ran = cell.run_requested_abort(FOREVER, |raw| taken = Some(raw));
                (ran, taken)
            })
        };
        assert!(
            returned.recv_timeout(SETTLE).is_err(),
            "an abort returned while a guard still pinned the handle"
        );
        assert_eq!(guard.call(|_| unreachable!("refused")), None::<()>);
        drop(guard);
        assert_eq!(running.join().expect("thread"), (true, Some(6)));
        returned
            .recv_timeout(FOREVER)
            .expect("the waiting abort returns");
        assert!(!waiting.join().expect("thread"));
        assert_eq!(cell.request_abort(), Requested::Already);
    }

    #[test]
    fn an_abort_requested_after_the_handle_is_gone_is_nothing_to_run() {
        let mut cell = HandleCell::new(8u8);
        assert_eq!(cell.take(), Some(8));
        assert_eq!(cell.request_abort(), Requested::Gone);
        assert!(!cell.is_aborted());
    }

    #[rstest]
    #[case(2)]
    #[case(8)]
    fn exactly_one_of_several_aborts_runs(#[case] threads: usize) {
        let cell = Arc::new(HandleCell::new(1i32));
        let start = Arc::new(Barrier::new(threads));
        let ran: Vec<bool> = (0..threads)
            .map(|_| {
                let (cell, start) = (Arc::clone(&cell), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    cell.abort_with(ABORT_GRACE, |raw| assert_eq!(raw, 1))
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("thread"))
            .collect();
        assert_eq!(ran.iter().filter(|ran| **ran).count(), 1, "{ran:?}");
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
