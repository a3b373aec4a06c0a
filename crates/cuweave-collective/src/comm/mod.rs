//! [`Communicator`]: one rank of an NCCL communicator, and how communicators are made, split,
//! finalised and aborted.

mod abort;
mod finalize;
mod init;
mod settle;
mod world;

use std::sync::Arc;

use cuweave_driver::{Context, Device};
use parking_lot::{Mutex, MutexGuard};

pub use crate::config::CommConfig;
use crate::error::{CollectiveError, NcclCode, Result};
use crate::handle::{CallGuard, HandleCell};
use crate::loader::NcclApi;
use crate::raw::{HandleSlot, RawComm};
use crate::sys::{self, ncclResult_t};

pub(crate) use abort::{abort_all, abort_all_in_background, abort_raw, abort_raw_together};
pub(crate) use init::{refuse_beside_global_captures, to_int};
pub(crate) use settle::settle_raw;
pub(crate) use world::World;

pub(crate) struct CommInner {
    /// Serialises issuing work on the communicator (NCCL's rule: one thread at a time issues
    /// on a communicator). Held by a call until its work has settled; never needed to abort,
    /// to check for an asynchronous error, or to ask whether it was aborted.
    issue: Mutex<()>,
    /// The handle: every NCCL call on it runs under a guard of this cell; an abort from any
    /// thread takes it away once no guard pins it, without waiting for the issuing thread's
    /// settling (see [`crate::handle`] for the invariants).
    handle: HandleCell<RawComm>,
    /// Where NCCL wrote the handle; kept while NCCL may write it (see [`HandleSlot`]).
    pub(crate) slot: Option<HandleSlot>,
    pub(crate) api: &'static NcclApi,
    context: Arc<Context>,
    rank: usize,
    nranks: usize,
    config: CommConfig,
    /// Which NCCL communicator this rank belongs to, when this process can tell (see
    /// [`World`]): lets a group pair one rank's sends with another's receives.
    world: Option<World>,
}

/// One rank of an NCCL communicator, on one device.
///
/// Cheap to clone (the clones share the rank). Made by [`init_all`](Self::init_all) (one
/// process driving several GPUs), [`init_rank`](Self::init_rank) (one process per GPU, across
/// processes and hosts) or [`split`](Self::split). Collectives are its methods (see
/// [`crate::collective`]); [`synchronize`](Self::synchronize) and
/// [`completion`](Self::completion) wait for them with the configured deadline.
///
/// Dropping the last clone runs `ncclCommFinalize` (waiting for the rank's queued work, within
/// the deadline) and then `ncclCommDestroy`; when finalising fails or times out it runs
/// `ncclCommAbort` instead. A communicator that timed out or saw an asynchronous error is
/// aborted at once and refuses further work ([`CollectiveError::Aborted`]).
///
/// Beside stream captures: every NCCL call cuweave makes runs in relaxed capture mode, so a
/// global-mode capture on another thread is not broken by the calling thread's driver calls.
/// NCCL's setup and teardown also work on threads it starts itself, out of that reach: making
/// a communicator ([`init_all`](Self::init_all), [`init_rank`](Self::init_rank),
/// [`split`](Self::split)) while a global capture is active is refused
/// (`GraphError::Capturing`, through [`CollectiveError::is_capture_refusal`]), and the last
/// clone dropped then is finalised on a thread of its own once no global capture is active.
#[derive(Clone)]
pub struct Communicator {
    pub(crate) inner: Arc<CommInner>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.inner.rank)
            .field("nranks", &self.inner.nranks)
            .field("device", &self.inner.context.device().ordinal())
            .field("aborted", &self.is_aborted())
            .finish()
    }
}

impl Communicator {
    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.inner.nranks
    }

    /// The device this rank runs on.
    pub fn device(&self) -> Device {
        self.inner.context.device()
    }

    /// The device's primary context.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner.context
    }

    /// The configuration it was made with.
    pub fn config(&self) -> &CommConfig {
        &self.inner.config
    }

    /// The NCCL communicator this rank belongs to, when this process can tell.
    pub(crate) fn world(&self) -> Option<World> {
        self.inner.world
    }

    /// Whether it was aborted (after a timeout, an asynchronous error or [`abort`](Self::abort)).
    /// One atomic load: it never waits for a call in progress on another thread.
    pub fn is_aborted(&self) -> bool {
        self.inner.handle.is_aborted()
    }

    /// The NCCL handle, for interop (`None` once aborted). It stays owned by this value: do not
    /// destroy or abort it, and do not use it after the communicator is dropped.
    pub fn as_raw(&self) -> Option<sys::ncclComm_t> {
        self.inner.handle.peek().map(|raw| raw.0)
    }

    /// The lock that serialises issuing work on this communicator.
    pub(crate) fn issue_lock(&self) -> MutexGuard<'_, ()> {
        self.inner.issue.lock()
    }

    /// Permission to make one NCCL call (or the calls of one open group) on the handle;
    /// `Aborted` once an abort was requested. Take it after any work that may wait outside NCCL
    /// (preparing buffers): while it is held outside a blocking call, an abort waits for it.
    pub(crate) fn enter(&self, operation: &'static str) -> Result<CallGuard<'_, RawComm>> {
        self.inner
            .handle
            .enter()
            .ok_or(CollectiveError::Aborted { operation })
    }

    pub(crate) fn api(&self) -> &'static NcclApi {
        self.inner.api
    }

    /// The typed error for `code`, which NCCL returned from a call on this communicator, with
    /// the communicator's last warning; the thread's last warning once it was aborted (the
    /// handle may be gone).
    pub(crate) fn nccl_error(
        &self,
        kind: NcclCode,
        code: ncclResult_t,
        operation: &'static str,
    ) -> CollectiveError {
        let api = self.inner.api;
        self.inner
            .handle
            .enter()
            .and_then(|guard| guard.call(|raw| api.error(kind, code, operation, raw.0)))
            .unwrap_or_else(|| api.error(kind, code, operation, std::ptr::null_mut()))
    }
}

#[cfg(test)]
mod abort_tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use super::abort::abort_together;

    /// The shape of NCCL's group job: the first abort returns only once the second has set its
    /// flag. One after the other this never ends; together it does.
    #[test]
    fn an_abort_that_waits_for_another_communicators_abort_finishes_when_both_run_together() {
        let second_flag = AtomicBool::new(false);
        let ran = AtomicUsize::new(0);
        let first = || {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !second_flag.load(Ordering::Acquire) {
                assert!(Instant::now() < deadline, "the other abort never ran");
                std::thread::yield_now();
            }
            ran.fetch_add(1, Ordering::SeqCst);
        };
        let second = || {
            second_flag.store(true, Ordering::Release);
            ran.fetch_add(1, Ordering::SeqCst);
        };
        let aborts: [&(dyn Fn() + Sync); 2] = [&first, &second];
        abort_together(&aborts);
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }

    /// Ranks joined with one id are one world on every thread; other ids, and each fresh
    /// world, are others.
    #[test]
    fn worlds_are_equal_for_one_id_and_distinct_otherwise() {
        use super::World;
        use crate::id::{UNIQUE_ID_BYTES, UniqueId};
        let id = UniqueId::from_bytes([7; UNIQUE_ID_BYTES]);
        let on_thread = std::thread::spawn(move || World::of_id(&id))
            .join()
            .expect("thread");
        assert_eq!(World::of_id(&id), on_thread);
        assert_ne!(
            World::of_id(&id),
            World::of_id(&UniqueId::from_bytes([8; UNIQUE_ID_BYTES]))
        );
        assert_ne!(World::fresh(), World::fresh());
    }

    #[test]
    fn one_abort_runs_inline_and_none_is_nothing() {
        let caller = std::thread::current().id();
        let on = Mutex::new(None);
        abort_together(&[|| *on.lock().unwrap() = Some(std::thread::current().id())]);
        assert_eq!(*on.lock().unwrap(), Some(caller));
        abort_together::<fn()>(&[]);
    }
}
