//! Aborting communicators: one at once or in the background, and several together.

use cuweave_driver::Context;

use crate::handle::{ABORT_GRACE, Requested};
use crate::loader::NcclApi;
use crate::raw::{self, RawComm};
use crate::sys::ncclResult_t;

use super::Communicator;

pub(crate) fn abort_raw(api: &NcclApi, context: &Context, raw: RawComm) {
    let _ = context.bind_to_thread();
    match raw::abort(api, raw) {
        Ok(code) if code == ncclResult_t::ncclSuccess => {
            tracing::warn!("NCCL communicator aborted");
        }
        Ok(code) => tracing::error!(code = code.0, "ncclCommAbort failed"),
        Err(error) => tracing::error!(%error, "ncclCommAbort unavailable"),
    }
}

impl Communicator {
    /// Aborts the communicator now (`ncclCommAbort`): queued collectives on it stop, and it
    /// refuses further work. Every clone sees it.
    ///
    /// Callable from any thread while another is inside a call on this communicator (the
    /// watchdog pattern): it does not wait for that call's deadline. The other thread's settle
    /// loop stops at its next poll (with [`CollectiveError::Aborted`]); a blocking call hung
    /// inside NCCL is cut short by `ncclCommAbort` itself, after a grace of 100 ms for calls
    /// that are about to return. A thread between two NCCL calls is never cut short: the abort
    /// waits for it to reach its next call, which it refuses.
    ///
    /// When it returns, the communicator has been aborted, also when another thread's abort
    /// got there first (this one then waits for it).
    ///
    /// [`CollectiveError::Aborted`]: crate::error::CollectiveError::Aborted
    pub fn abort(&self) {
        let (api, context) = (self.inner.api, &self.inner.context);
        self.inner
            .handle
            .abort_with(ABORT_GRACE, |raw| abort_raw(api, context, raw));
    }

    /// Aborts without making the caller wait for `ncclCommAbort`: the communicator is marked
    /// aborted before this returns (it refuses every further call, and [`is_aborted`] is
    /// true), and `ncclCommAbort` runs on a thread of its own, which holds a clone of the
    /// communicator until it has returned. [`abort`](Self::abort) from any thread waits for it.
    ///
    /// For deadlines: `ncclCommAbort` frees the communicator's device and pinned memory, which
    /// waits for work queued on the device (also work that is not NCCL's, ahead of a
    /// collective on its stream), so an inline abort would hold a timed-out caller for as long
    /// as that work runs. Inline when no thread can be started.
    ///
    /// [`is_aborted`]: Self::is_aborted
    pub(crate) fn abort_in_background(&self) {
        abort_all_in_background(&[self]);
    }

    /// Runs the abort this caller requested (see [`HandleCell::run_requested_abort`]).
    ///
    /// [`HandleCell::run_requested_abort`]: crate::handle::HandleCell::run_requested_abort
    fn run_requested_abort(&self) {
        let (api, context) = (self.inner.api, &self.inner.context);
        self.inner
            .handle
            .run_requested_abort(ABORT_GRACE, |raw| abort_raw(api, context, raw));
    }
}

/// Runs every one of `aborts` at once, each on a thread of its own (inline when there is one, or
/// when a thread cannot be started), and returns once all have returned.
///
/// Communicators whose non-blocking work NCCL runs as one group job (those of one group call,
/// or of one `init_all`) must be aborted together: `ncclCommAbort` joins the group's job, and
/// that job may be stuck connecting *another* communicator of the group, which only that
/// communicator's abort flag stops. Aborted one after the other, the first abort can wait for
/// ever (seen on two H200s with NCCL 2.28.3: a group of two lonely rank-0 all-reduces never
/// returned from its launch's abort).
pub(crate) fn abort_together<F: Fn() + Sync>(aborts: &[F]) {
    if let [abort] = aborts {
        abort();
        return;
    }
    std::thread::scope(|scope| {
        let mut inline = Vec::new();
        for abort in aborts {
            let spawned = std::thread::Builder::new()
                .name("cuweave-nccl-abort".into())
                .spawn_scoped(scope, abort);
            if let Err(error) = spawned {
                tracing::warn!(%error, "no thread for a concurrent NCCL abort; aborting inline after the others start");
                inline.push(abort);
            }
        }
        inline.into_iter().for_each(|abort| abort());
    });
}

/// Aborts `comms` together (see [`abort_together`]) without making the caller wait, as
/// [`Communicator::abort_in_background`] does for one: each is marked aborted before this
/// returns, and the aborts this caller requested run at once on a thread of their own, which
/// holds clones of the communicators until every abort has returned (inline when no thread can
/// be started).
pub(crate) fn abort_all_in_background(comms: &[&Communicator]) {
    let requested: Vec<Communicator> = comms
        .iter()
        .filter(|comm| comm.inner.handle.request_abort() == Requested::ByThisCaller)
        .map(|comm| (*comm).clone())
        .collect();
    if requested.is_empty() {
        return;
    }
    let requested = std::sync::Arc::new(requested);
    let background = std::sync::Arc::clone(&requested);
    let spawned = std::thread::Builder::new()
        .name("cuweave-nccl-abort".into())
        .spawn(move || run_requested_aborts(&background));
    if let Err(error) = spawned {
        tracing::warn!(%error, "no thread for a background NCCL abort; aborting inline");
        run_requested_aborts(&requested);
    }
}

/// Runs, together, the aborts requested of `comms` (see [`abort_all_in_background`]).
fn run_requested_aborts(comms: &[Communicator]) {
    abort_together(
        &comms
            .iter()
            .map(|comm| move || comm.run_requested_abort())
            .collect::<Vec<_>>(),
    );
}

/// Aborts together (see [`abort_together`]) every non-null handle of `handles`, each in its
/// context: for handles no `Communicator` holds yet (initialisation, a split's children).
pub(crate) fn abort_raw_together<'c>(
    api: &NcclApi,
    handles: impl IntoIterator<Item = (&'c Context, RawComm)>,
) {
    abort_together(
        &handles
            .into_iter()
            .filter(|(_, raw)| !raw.is_null())
            .map(|(context, raw)| move || abort_raw(api, context, raw))
            .collect::<Vec<_>>(),
    );
}

/// Aborts `comms` together (see [`abort_together`]).
pub(crate) fn abort_all(comms: &[&Communicator]) {
    abort_together(
        &comms
            .iter()
            .map(|comm| move || comm.abort())
            .collect::<Vec<_>>(),
    );
}
