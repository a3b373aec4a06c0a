//! [`CallGuard`]: permission to call NCCL with the handle, and blocking calls an abort may
//! cut short.

use super::cell::{AbortState, HandleCell};

/// Permission to call NCCL with the handle (invariants 1 and 2): while it lives outside a
/// blocking call, the handle is not freed.
#[must_use]
#[derive(Debug)]
pub(crate) struct CallGuard<'a, H> {
    pub(super) cell: &'a HandleCell<H>,
    pub(super) raw: H,
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
