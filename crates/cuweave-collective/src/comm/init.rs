//! Making communicators: checking the config, and initialising ranks alone or together.

use std::ffi::c_int;
use std::sync::Arc;

use cuweave_driver::{Context, Device};
use parking_lot::Mutex;

use crate::config::NcclConfig;
use crate::error::{CollectiveError, NcclCode, Result};
use crate::handle::HandleCell;
use crate::id::UniqueId;
use crate::loader::{self, NcclApi};
use crate::raw::{self, HandleSlot, RawComm};

use super::{
    CommConfig, CommInner, Communicator, World, abort_raw, abort_raw_together, settle_raw,
};

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
        refuse_beside_global_captures(OP)?;
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
                // One group's handles: aborted together, as `settle_raw` aborts them.
                abort_raw_together(
                    api,
                    context_refs
                        .iter()
                        .map(|context| &***context)
                        .zip(handles.iter().copied()),
                );
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
        refuse_beside_global_captures(OP)?;
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
}

/// Refuses making communicators while a global-mode capture is active on any thread (or any
/// capture on this one): NCCL's setup allocates, pins and synchronises on threads it starts
/// itself, beyond the relaxed capture mode the calling thread's NCCL calls run in, and each
/// such call would break the capture (seen on the GPU). PyTorch asks the same: NCCL is set up
/// before graphs are captured. A capture begun while NCCL sets up is not seen.
pub(crate) fn refuse_beside_global_captures(operation: &'static str) -> Result<()> {
    cuweave_driver::graph::refuse_while_capturing(None, operation)?;
    Ok(())
}
