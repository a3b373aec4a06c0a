//! [`Communicator`]: one rank of an NCCL communicator, and how communicators are made, split,
//! finalised and aborted.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuweave_driver::{Context, Device};
use parking_lot::{Mutex, MutexGuard};

pub use crate::config::CommConfig;
use crate::config::NcclConfig;
use crate::error::{CollectiveError, NcclCode, Result};
use crate::handle::{ABORT_GRACE, CallGuard, HandleCell, Polled, Requested, poll_until};
use crate::id::UniqueId;
use crate::loader::{self, NcclApi};
use crate::raw::{self, HandleSlot, RawComm};
use crate::sys::{self, ncclResult_t};

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

/// Names the NCCL communicator (the set of ranks) a [`Communicator`] is one rank of, as far as
/// this process can tell. Two ranks with equal worlds are ranks of one communicator; unequal
/// or unknown worlds say nothing (so checks built on them only ever refuse what they know).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum World {
    /// Made together in this process (`init_all`, or children of one color of one
    /// `split_all`): a number no other world of the process has.
    Local(u64),
    /// Joined through a [`UniqueId`] (`init_rank`): a digest of its bytes (ranks of this
    /// process that joined with the same id are ranks of one communicator).
    Id(u64),
}

impl World {
    /// A world no other of this process has.
    pub(crate) fn fresh() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self::Local(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// The world of ranks that join with `id`.
    pub(crate) fn of_id(id: &UniqueId) -> Self {
        use std::hash::{Hash, Hasher};
        // Fixed keys: equal ids give equal digests on every thread.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        id.as_bytes().hash(&mut hasher);
        Self::Id(hasher.finish())
    }
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

/// Polls `ncclCommGetAsyncError` on every handle until none is in progress. Any failure (an
/// asynchronous error, the deadline, a failed poll) aborts every non-null handle before it is
/// returned, so a caller never aborts them again. For handles no other thread can reach yet
/// (initialisation, a split's children, finalisation on drop).
pub(crate) fn settle_raw(
    api: &NcclApi,
    contexts: &[&Arc<Context>],
    handles: &[RawComm],
    operation: &'static str,
    timeout: Duration,
) -> Result<()> {
    let polled = poll_until(
        Instant::now(),
        timeout,
        || {
            let mut state = Polled::Done;
            for (raw, context) in handles.iter().zip(contexts) {
                if !raw.is_null() && settle_once(api, context, *raw, operation)? == Polled::Pending
                {
                    state = Polled::Pending;
                }
            }
            Ok(state)
        },
        |waited| CollectiveError::Timeout { operation, waited },
    );
    if polled.is_err() {
        abort_together(
            &handles
                .iter()
                .zip(contexts)
                .filter(|(raw, _)| !raw.is_null())
                .map(|(raw, context)| move || abort_raw(api, context, *raw))
                .collect::<Vec<_>>(),
        );
    }
    polled
}

/// One poll of `ncclCommGetAsyncError` on a handle the caller may use: idle, in progress, or
/// NCCL's error (nothing is aborted here).
pub(crate) fn settle_once(
    api: &NcclApi,
    context: &Context,
    raw: RawComm,
    operation: &'static str,
) -> Result<Polled> {
    context.bind_to_thread()?;
    let state = raw::async_error(api, raw)?;
    match NcclCode::from_raw(state) {
        None => Ok(Polled::Done),
        Some(NcclCode::InProgress) => Ok(Polled::Pending),
        Some(kind) => Err(api.error(kind, state, operation, raw.0)),
    }
}

/// Checks `config` (before NCCL is loaded or called), then against the loaded NCCL, and
/// converts it for NCCL.
pub(crate) fn prepare(config: &CommConfig) -> Result<(&'static NcclApi, Arc<NcclConfig>)> {
    config.validate()?;
    let nccl = loader::nccl()?;
    Ok((
        nccl.api(),
        Arc::new(NcclConfig::new(config, nccl.version())?),
    ))
}

pub(crate) fn to_int(value: usize, what: &str, operation: &'static str) -> Result<c_int> {
    c_int::try_from(value).map_err(|_| {
        CollectiveError::invalid(operation, format!("{what} {value} does not fit a C int"))
    })
}

impl Communicator {
    /// Wraps the initialised handle in `slot`; aborts it when its shape cannot be read.
    pub(crate) fn from_slot(
        slot: HandleSlot,
        api: &'static NcclApi,
        context: Arc<Context>,
        config: CommConfig,
        world: Option<World>,
    ) -> Result<Self> {
        let raw = slot.get();
        let shape = context
            .bind_to_thread()
            .map_err(CollectiveError::from)
            .and_then(|()| raw::shape(api, raw));
        match shape {
            Ok((nranks, rank, _device)) => Ok(Self {
                inner: Arc::new(CommInner {
                    issue: Mutex::new(()),
                    handle: HandleCell::new(raw),
                    slot: Some(slot),
                    api,
                    context,
                    rank: rank as usize,
                    nranks: nranks as usize,
                    config,
                    world,
                }),
            }),
            Err(error) => {
                abort_raw(api, &context, raw);
                slot.leak();
                Err(error)
            }
        }
    }

    /// One communicator per device, all in this process, with group semantics: rank `i` is
    /// `devices[i]` (`ncclCommInitAll`'s shape, built from `ncclCommInitRankConfig` in one
    /// group so it can be non-blocking and time out).
    ///
    /// # Errors
    /// `InvalidConfig` for a config field out of range, `ConfigUnsupported` for one the loaded
    /// NCCL is too old for (both before NCCL is called); `NotFound`; `InvalidArgument` for no
    /// devices; NCCL's error (a device listed twice is
    /// `ncclInvalidUsage`, "Duplicate GPU detected"); `Timeout`. Every rank made is aborted on
    /// failure.
    pub fn init_all(devices: &[Device], config: &CommConfig) -> Result<Vec<Self>> {
        const OP: &str = "Communicator::init_all";
        if devices.is_empty() {
            return Err(CollectiveError::invalid(OP, "no devices"));
        }
        let (api, nccl_config) = prepare(config)?;
        let nranks = to_int(devices.len(), "device count", OP)?;
        let contexts = devices
            .iter()
            .map(|&device| Context::primary(device))
            .collect::<cuweave_driver::Result<Vec<_>>>()?;
        let id = UniqueId::new()?;
        let slots: Vec<HandleSlot> = devices
            .iter()
            .map(|_| HandleSlot::new(Arc::clone(&nccl_config)))
            .collect();
        let started = raw::group_start(api)?;
        api.check(started, "ncclGroupStart", std::ptr::null_mut())?;
        let mut failure = None;
        for (rank, (context, slot)) in contexts.iter().zip(&slots).enumerate() {
            let code = context
                .bind_to_thread()
                .map_err(CollectiveError::from)
                .and_then(|()| raw::init_rank(api, slot, nranks, rank as c_int, id.as_bytes()));
            match code.map(|code| (NcclCode::from_raw(code), code)) {
                Ok((None | Some(NcclCode::InProgress), _)) => {}
                Ok((Some(kind), code)) => {
                    failure = Some(api.error(kind, code, "ncclCommInitRankConfig", slot.get().0));
                    break;
                }
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        // Always close the group, so this thread leaves group mode.
        let ended = raw::group_end(api);
        let context_refs: Vec<&Arc<Context>> = contexts.iter().collect();
        let handles: Vec<RawComm> = slots.iter().map(HandleSlot::get).collect();
        let failure = failure.or_else(|| match ended {
            Ok(ended) => NcclCode::from_raw(ended)
                .filter(|k| *k != NcclCode::InProgress)
                .map(|kind| api.error(kind, ended, "ncclGroupEnd", std::ptr::null_mut())),
            Err(error) => Some(error),
        });
        let settled = match failure {
            Some(error) => {
                for (raw, context) in handles.iter().zip(&context_refs) {
                    if !raw.is_null() {
                        abort_raw(api, context, *raw);
                    }
                }
                Err(error)
            }
            None => settle_raw(api, &context_refs, &handles, OP, config.timeout),
        };
        if let Err(error) = settled {
            slots.into_iter().for_each(HandleSlot::leak);
            return Err(error);
        }
        let mut comms = Vec::with_capacity(slots.len());
        let world = World::fresh();
        let mut rest = slots.into_iter().zip(contexts);
        while let Some((slot, context)) = rest.next() {
            match Self::from_slot(slot, api, context, config.clone(), Some(world)) {
                Ok(comm) => comms.push(comm),
                Err(error) => {
                    // from_slot aborted this one; those already wrapped finalise on drop.
                    for (slot, context) in rest {
                        abort_raw(api, &context, slot.get());
                        slot.leak();
                    }
                    return Err(error);
                }
            }
        }
        Ok(comms)
    }

    /// Rank `rank` of `nranks` on `device`, joining the other ranks (in this or other
    /// processes and hosts) that call it with the same `id`.
    ///
    /// # Errors
    /// `InvalidArgument` unless `rank < nranks`; `InvalidConfig` for a config field out of
    /// range, `ConfigUnsupported` for one the loaded NCCL is too old for (both before NCCL is
    /// called); NCCL's error; `Timeout` when the other ranks do
    /// not all arrive within the configured deadline (the rank is then aborted).
    pub fn init_rank(
        nranks: usize,
        rank: usize,
        id: &UniqueId,
        device: Device,
        config: &CommConfig,
    ) -> Result<Self> {
        const OP: &str = "Communicator::init_rank";
        if rank >= nranks {
            return Err(CollectiveError::invalid(
                OP,
                format!("rank {rank} of {nranks}"),
            ));
        }
        let (nranks, rank) = (to_int(nranks, "nranks", OP)?, to_int(rank, "rank", OP)?);
        let (api, nccl_config) = prepare(config)?;
        let context = Context::primary(device)?;
        context.bind_to_thread()?;
        let slot = HandleSlot::new(nccl_config);
        let code = raw::init_rank(api, &slot, nranks, rank, id.as_bytes())?;
        let handle = slot.get();
        let settled = match NcclCode::from_raw(code) {
            None | Some(NcclCode::InProgress) => {
                settle_raw(api, &[&context], &[handle], OP, config.timeout)
            }
            Some(kind) => {
                let error = api.error(kind, code, "ncclCommInitRankConfig", handle.0);
                if !handle.is_null() {
                    abort_raw(api, &context, handle);
                }
                Err(error)
            }
        };
        if let Err(error) = settled {
            slot.leak();
            return Err(error);
        }
        Self::from_slot(slot, api, context, config.clone(), Some(World::of_id(id)))
    }

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
        if self.inner.handle.request_abort() != Requested::ByThisCaller {
            return;
        }
        let comm = self.clone();
        let spawned = std::thread::Builder::new()
            .name("cuweave-nccl-abort".into())
            .spawn(move || comm.run_requested_abort());
        if let Err(error) = spawned {
            tracing::warn!(%error, "no thread for a background NCCL abort; aborting inline");
            self.run_requested_abort();
        }
    }

    /// Runs the abort this caller requested (see [`HandleCell::run_requested_abort`]).
    fn run_requested_abort(&self) {
        let (api, context) = (self.inner.api, &self.inner.context);
        self.inner
            .handle
            .run_requested_abort(ABORT_GRACE, |raw| abort_raw(api, context, raw));
    }

    /// `ncclCommGetAsyncError`: `Ok(())` while healthy (or still busy with a non-blocking
    /// call), NCCL's error once one happened. An error aborts the communicator.
    ///
    /// Callable from any thread, without waiting for a call in progress on another.
    ///
    /// # Errors
    /// `Aborted`; NCCL's asynchronous error.
    pub fn check_async_error(&self) -> Result<()> {
        const OP: &str = "ncclCommGetAsyncError";
        match self.poll(OP) {
            Ok(_) => Ok(()),
            Err(error @ CollectiveError::Aborted { .. }) => Err(error),
            Err(error) => {
                self.abort();
                Err(error)
            }
        }
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

    /// One poll of `ncclCommGetAsyncError` under a fresh guard (nothing is aborted here).
    pub(crate) fn poll(&self, operation: &'static str) -> Result<Polled> {
        let guard = self.enter(operation)?;
        guard
            .call(|raw| settle_once(self.inner.api, &self.inner.context, raw, operation))
            .unwrap_or(Err(CollectiveError::Aborted { operation }))
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

    /// Polls until the communicator's non-blocking work is no longer in progress, within the
    /// deadline counted from `started`. NCCL's error, a failed poll or the deadline aborts the
    /// communicator; an abort from another thread ends the wait at the next poll with
    /// `Aborted`. No guard is held between polls.
    pub(crate) fn settle(&self, operation: &'static str, started: Instant) -> Result<()> {
        let settled = self.settle_without_abort(operation, started);
        if let Err(error) = &settled
            && !matches!(error, CollectiveError::Aborted { .. })
        {
            self.abort();
        }
        settled
    }

    /// As [`settle`](Self::settle), but a failure aborts nothing: for a group, whose
    /// communicators must be aborted together ([`abort_together`]).
    pub(crate) fn settle_without_abort(
        &self,
        operation: &'static str,
        started: Instant,
    ) -> Result<()> {
        poll_until(
            started,
            self.inner.config.timeout,
            || self.poll(operation),
            |waited| CollectiveError::Timeout { operation, waited },
        )
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

/// Aborts `comms` together (see [`abort_together`]).
pub(crate) fn abort_all(comms: &[&Communicator]) {
    abort_together(
        &comms
            .iter()
            .map(|comm| move || comm.abort())
            .collect::<Vec<_>>(),
    );
}

impl CommInner {
    /// `ncclCommFinalize` (waiting, within the deadline, for the rank's queued work), then
    /// `ncclCommDestroy`; when finalising fails or times out the handle is aborted instead.
    /// `Aborted` (and nothing done) once the handle is gone.
    fn close(&mut self) -> Result<()> {
        const OP: &str = "ncclCommFinalize";
        let Some(raw) = self.handle.take() else {
            // Aborted: NCCL's thread may have been cut short with the slot's address in hand.
            if let Some(slot) = self.slot.take() {
                slot.leak();
            }
            return Err(CollectiveError::Aborted { operation: OP });
        };
        // Initialised, so NCCL writes the slot no more: it is freed when this returns, and a
        // second close (a drop after `finalize`) finds neither handle nor slot.
        let _slot = self.slot.take();
        let api = self.api;
        let started = self
            .context
            .bind_to_thread()
            .map_err(CollectiveError::from)
            .and_then(|()| raw::finalize(api, raw))
            .and_then(|code| match NcclCode::from_raw(code) {
                None | Some(NcclCode::InProgress) => Ok(()),
                Some(kind) => Err(api.error(kind, code, OP, raw.0)),
            });
        if let Err(error) = started {
            abort_raw(api, &self.context, raw);
            return Err(error);
        }
        // Waits for the rank's queued work; on failure the handle is already aborted.
        settle_raw(api, &[&self.context], &[raw], OP, self.config.timeout)?;
        let code = raw::destroy(api, raw)?;
        api.check(code, "ncclCommDestroy", std::ptr::null_mut())
    }
}

impl Communicator {
    /// Finalises and destroys the rank now, and says how that went, where dropping the last
    /// clone does the same but can only log a failure: `ncclCommFinalize` (waiting, within
    /// [`CommConfig::timeout`], for the rank's queued work), then `ncclCommDestroy`, as an NCCL
    /// program ends its communicators and torch's `destroy_process_group` does.
    ///
    /// The rank is shared by its clones (and by pending [`completion`](Self::completion)
    /// futures), so only the last one can finalise it: while others are alive this clone is
    /// dropped and the call is `InvalidArgument`; the last clone to go finalises on drop.
    ///
    /// # Errors
    /// `InvalidArgument` while other clones are alive; `Aborted` for an aborted communicator;
    /// NCCL's error, or `Timeout` when the queued work does not finish in time (the
    /// communicator is then aborted).
    pub fn finalize(self) -> Result<()> {
        const OP: &str = "Communicator::finalize";
        if self.is_aborted() {
            // Nothing to finalise, whoever still holds a clone (a background abort does until
            // its `ncclCommAbort` returns).
            return Err(CollectiveError::Aborted { operation: OP });
        }
        let clones = Arc::strong_count(&self.inner) - 1;
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) => inner.close(),
            Err(_shared) => Err(CollectiveError::invalid(
                OP,
                format!("{clones} other clones of the communicator (or its futures) are alive"),
            )),
        }
    }
}

impl Drop for CommInner {
    fn drop(&mut self) {
        match self.close() {
            Ok(()) | Err(CollectiveError::Aborted { .. }) => {}
            Err(error) => {
                tracing::error!(%error, "finalising or destroying an NCCL communicator failed");
            }
        }
    }
}

#[cfg(test)]
mod abort_tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use super::abort_together;

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
