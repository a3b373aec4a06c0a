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

mod cell;
mod guard;
mod poll;
#[cfg(test)]
mod tests;

pub(crate) use cell::{ABORT_GRACE, HandleCell, Requested};
pub(crate) use guard::{Blocking, CallGuard, end_group};
pub(crate) use poll::{Polled, poll_until};
