//! [`HandleCell`]: the shared handle, and how exactly one abort takes it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::guard::CallGuard;

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
pub(super) enum AbortState {
    NotRequested,
    /// Requested: no guard is handed out; one caller waits for the guards, then aborts.
    InProgress,
    /// The aborting caller has run its abort.
    Done,
}

/// What the cell's lock protects.
#[derive(Debug)]
pub(super) struct Shared<H> {
    /// `None` once taken by an abort or by the owner's drop.
    pub(super) raw: Option<H>,
    /// Guards alive.
    pub(super) guards: usize,
    /// Of those, guards inside a blocking call (invariant 3: the only ones an abort may cut
    /// short).
    pub(super) blocked: usize,
    pub(super) abort: AbortState,
}

/// A handle shared by threads that call NCCL with it and threads that may abort it.
#[derive(Debug)]
pub(crate) struct HandleCell<H> {
    /// Locked briefly, never across a call.
    pub(super) shared: Mutex<Shared<H>>,
    /// Notified when a guard leaves or enters a blocking call while an abort waits, and when an
    /// abort is done.
    pub(super) changed: Condvar,
    /// Set (under `shared`'s lock) when an abort is requested; read without any lock.
    aborted: AtomicBool,
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
