//! The NCCL calls themselves: every `unsafe` FFI call of the crate outside the loader.
//!
//! Each function is safe to call from the rest of the crate under the contract its doc states
//! (a live communicator handle; device addresses valid for the element counts given on the
//! stream's device); the safe layers above (`comm`, `collective`) establish those from typed
//! buffers and owned handles. They return the raw `ncclResult_t` so the caller decides how an
//! `ncclInProgress` of a non-blocking communicator is settled.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, Ordering};

use cuweave_driver::Stream;
use cuweave_driver::graph::{CaptureMode, CaptureModeGuard};
use cuweave_driver::memory::DevicePtr;

use crate::config::NcclConfig;
use crate::error::Result;
use crate::loader::NcclApi;
use crate::sys::{self, ncclResult_t};

/// An NCCL communicator handle. Owned by `comm::CommInner`, which destroys or aborts it once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawComm(pub(crate) sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as operations are not
// issued on it concurrently; `comm::CommInner` serialises issuing behind its issue lock, and
// lends the handle only to calls made under a guard of its handle cell, which an abort waits
// for before freeing the handle, except a blocking call hung inside NCCL, which `ncclCommAbort`
// from another thread is meant to cut short, and which never reads the handle again (the
// invariants of `crate::handle`; `ncclCommGetAsyncError` and `ncclCommAbort` are NCCL's calls
// from another thread).
unsafe impl Send for RawComm {}
// SAFETY: as above: shared references only reach NCCL through the issue lock and the guards.
unsafe impl Sync for RawComm {}

impl RawComm {
    pub(crate) fn is_null(self) -> bool {
        self.0.is_null()
    }
}

fn stream_handle(stream: &Stream) -> sys::cudaStream_t {
    // `CUstream` and `cudaStream_t` are the same pointer to the same opaque struct.
    stream.as_raw().cast()
}

fn address(ptr: DevicePtr) -> *mut c_void {
    ptr as usize as *mut c_void
}

/// `ncclGetUniqueId`.
pub(crate) fn unique_id(api: &NcclApi) -> Result<[u8; 128]> {
    let f = api.get_unique_id.get()?;
    let mut id = sys::ncclUniqueId::default();
    // SAFETY: `id` is a valid out-pointer to an `ncclUniqueId`.
    let code = unsafe { f(&mut id) };
    api.check(code, "ncclGetUniqueId", std::ptr::null_mut())?;
    Ok(id.internal.map(|byte| byte as u8))
}

/// Where NCCL writes a new communicator's handle, and the config strings NCCL keeps pointers
/// to. A non-blocking initialisation or split keeps the slot's address and writes it from its
/// own thread, later (the handle once a split is done; `nullptr` when an initialisation fails
/// and is undone), so the slot lives on the heap and is read atomically, and whoever owns it
/// keeps it until NCCL can no longer write it: the communicator's whole life, until the
/// split's job has ended for a split that makes none, or for ever (leaked) after a failure. NCCL reads the config's `commName` from the same thread, for as
/// long (see [`crate::config`]), so the slot keeps that config alive too.
#[derive(Debug)]
pub(crate) struct HandleSlot {
    handle: Box<AtomicPtr<sys::ncclComm>>,
    config: Arc<NcclConfig>,
}

impl HandleSlot {
    /// An empty slot for a communicator made with `config`, which it keeps as long as itself.
    pub(crate) fn new(config: Arc<NcclConfig>) -> Self {
        Self {
            handle: Box::new(AtomicPtr::new(std::ptr::null_mut())),
            config,
        }
    }

    /// The handle NCCL has written so far (null before it has).
    pub(crate) fn get(&self) -> RawComm {
        RawComm(self.handle.load(Ordering::Acquire))
    }

    /// Leaks the slot (and the config it keeps): NCCL may still write or read them.
    pub(crate) fn leak(self) {
        std::mem::forget(self);
    }

    /// The raw config for NCCL, pointing at the strings this slot keeps.
    fn raw_config(&self) -> sys::ncclConfig_t {
        self.config.to_raw()
    }

    fn as_out(&self) -> *mut sys::ncclComm_t {
        // `AtomicPtr<T>` has the layout of `*mut T`; NCCL's plain store of an aligned pointer
        // and our atomic loads agree on every platform NCCL supports.
        self.handle.as_ptr()
    }
}

/// This thread in relaxed capture mode for one NCCL call. NCCL's calls allocate, free,
/// synchronise and query on the calling thread (init, split, finalize, destroy and abort
/// above all); in the default global mode each of those, made while another thread captures
/// in global mode, breaks that capture (seen on the GPU in the sixth-look probes). Relaxed,
/// they break none, and a collective on a capturing stream is still captured: the mode only
/// lifts the driver's ban on "unsafe" calls. `None` when the driver is missing (NCCL then
/// fails on its own).
fn relaxed() -> Option<CaptureModeGuard> {
    CaptureModeGuard::enter(CaptureMode::Relaxed).ok()
}

/// `ncclCommInitRankConfig` for the device whose context is current on this thread, writing the
/// handle into `slot` (which must outlive any write NCCL can make: see [`HandleSlot`]) with the
/// config `slot` keeps.
pub(crate) fn init_rank(
    api: &NcclApi,
    slot: &HandleSlot,
    nranks: c_int,
    rank: c_int,
    id: &[u8; 128],
) -> Result<ncclResult_t> {
    let f = api.comm_init_rank_config.get()?;
    let mut unique = sys::ncclUniqueId::default();
    for (dst, src) in unique.internal.iter_mut().zip(id) {
        *dst = *src as std::ffi::c_char;
    }
    let mut config = slot.raw_config();
    let _relaxed = relaxed();
    // SAFETY: the slot is a heap cell its owner keeps alive while NCCL may write it; `config`
    // is copied during the call, and the strings it points at live in the slot, as long as
    // NCCL may read them; the id is passed by value.
    Ok(unsafe { f(slot.as_out(), nranks, unique, rank, &mut config) })
}

/// `ncclCommSplit`, writing the child's handle into `slot` (see [`HandleSlot`]), with the config
/// `slot` keeps.
pub(crate) fn split(
    api: &NcclApi,
    parent: RawComm,
    slot: &HandleSlot,
    color: c_int,
    key: c_int,
) -> Result<ncclResult_t> {
    let f = api.comm_split.get()?;
    let mut config = slot.raw_config();
    let _relaxed = relaxed();
    // SAFETY: `parent` is a live communicator (the caller holds a guard of it); the slot and
    // the strings it keeps outlive NCCL's writes and reads (see above); `config` is copied
    // during the call.
    Ok(unsafe { f(parent.0, color, key, slot.as_out(), &mut config) })
}

macro_rules! comm_call {
    ($(#[$doc:meta])* $name:ident => $entry:ident) => {
        $(#[$doc])*
        pub(crate) fn $name(api: &NcclApi, comm: RawComm) -> Result<ncclResult_t> {
            let f = api.$entry.get()?;
            let _relaxed = relaxed();
            // SAFETY: `comm` is a live communicator handle owned by the caller.
            Ok(unsafe { f(comm.0) })
        }
    };
}

comm_call!(
    /// `ncclCommFinalize`.
    finalize => comm_finalize
);
comm_call!(
    /// `ncclCommDestroy`.
    destroy => comm_destroy
);
comm_call!(
    /// `ncclCommAbort`.
    abort => comm_abort
);

/// `ncclCommGetAsyncError`: the communicator's state (`ncclInProgress` while a non-blocking
/// call runs, an error once one happened).
pub(crate) fn async_error(api: &NcclApi, comm: RawComm) -> Result<ncclResult_t> {
    let f = api.comm_get_async_error.get()?;
    let mut state = ncclResult_t::ncclSuccess;
    // NCCL may poll its own events here (a non-blocking communicator's progress).
    let _relaxed = relaxed();
    // SAFETY: `comm` is live; `state` is a valid out-pointer.
    let code = unsafe { f(comm.0, &mut state) };
    api.check(code, "ncclCommGetAsyncError", comm.0)?;
    Ok(state)
}

/// `ncclCommCount`, `ncclCommUserRank` and `ncclCommCuDevice`.
pub(crate) fn shape(api: &NcclApi, comm: RawComm) -> Result<(c_int, c_int, c_int)> {
    let (count, rank, device) = (
        api.comm_count.get()?,
        api.comm_user_rank.get()?,
        api.comm_cu_device.get()?,
    );
    let (mut n, mut r, mut d) = (0, 0, 0);
    // SAFETY: `comm` is live and initialised; the out-pointers are valid.
    let status = unsafe { count(comm.0, &mut n) };
    api.check(status, "ncclCommCount", comm.0)?;
    // SAFETY: as above.
    let status = unsafe { rank(comm.0, &mut r) };
    api.check(status, "ncclCommUserRank", comm.0)?;
    // SAFETY: as above.
    let status = unsafe { device(comm.0, &mut d) };
    api.check(status, "ncclCommCuDevice", comm.0)?;
    Ok((n, r, d))
}

/// `ncclGroupStart`.
pub(crate) fn group_start(api: &NcclApi) -> Result<ncclResult_t> {
    let f = api.group_start.get()?;
    // SAFETY: no arguments; groups nest.
    Ok(unsafe { f() })
}

/// `ncclGroupEnd`.
pub(crate) fn group_end(api: &NcclApi) -> Result<ncclResult_t> {
    let f = api.group_end.get()?;
    let _relaxed = relaxed();
    // SAFETY: no arguments; called once per `group_start`.
    Ok(unsafe { f() })
}

/// One collective or point-to-point call, with device addresses and counts the caller has
/// checked against live buffers on `stream`'s device.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Call {
    AllReduce {
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        op: sys::ncclRedOp_t,
    },
    Broadcast {
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        root: c_int,
    },
    Reduce {
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        op: sys::ncclRedOp_t,
        root: c_int,
    },
    AllGather {
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
    },
    ReduceScatter {
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        op: sys::ncclRedOp_t,
    },
    Send {
        send: DevicePtr,
        count: usize,
        peer: c_int,
    },
    Recv {
        recv: DevicePtr,
        count: usize,
        peer: c_int,
    },
}

impl Call {
    /// NCCL's name for the call.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::AllReduce { .. } => "ncclAllReduce",
            Self::Broadcast { .. } => "ncclBroadcast",
            Self::Reduce { .. } => "ncclReduce",
            Self::AllGather { .. } => "ncclAllGather",
            Self::ReduceScatter { .. } => "ncclReduceScatter",
            Self::Send { .. } => "ncclSend",
            Self::Recv { .. } => "ncclRecv",
        }
    }

    /// Queues the call on `stream`.
    ///
    /// Contract (checked by `collective`): `comm` is live; every address is a device allocation
    /// on `stream`'s device valid for the bytes NCCL touches (counts × `dtype`'s size, ×
    /// nranks for the gathered or scattered side), kept alive and unused by conflicting work
    /// until the stream passes the call (the buffers' use trackers record it).
    pub(crate) fn issue(
        self,
        api: &NcclApi,
        comm: RawComm,
        dtype: sys::ncclDataType_t,
        stream: &Stream,
    ) -> Result<ncclResult_t> {
        let (c, s) = (comm.0, stream_handle(stream));
        let _relaxed = relaxed();
        // SAFETY (every arm): the contract above; NCCL reads `send` and writes `recv` for the
        // given counts only, and enqueues the work on `s` without blocking on the device.
        Ok(match self {
            Self::AllReduce {
                send,
                recv,
                count,
                op,
            } => {
                let f = api.all_reduce.get()?;
                // SAFETY: see above.
                unsafe { f(address(send), address(recv), count, dtype, op, c, s) }
            }
            Self::Broadcast {
                send,
                recv,
                count,
                root,
            } => {
                let f = api.broadcast.get()?;
                // SAFETY: see above.
                unsafe { f(address(send), address(recv), count, dtype, root, c, s) }
            }
            Self::Reduce {
                send,
                recv,
                count,
                op,
                root,
            } => {
                let f = api.reduce.get()?;
                // SAFETY: see above.
                unsafe { f(address(send), address(recv), count, dtype, op, root, c, s) }
            }
            Self::AllGather {
                send,
                recv,
                send_count,
            } => {
                let f = api.all_gather.get()?;
                // SAFETY: see above.
                unsafe { f(address(send), address(recv), send_count, dtype, c, s) }
            }
            Self::ReduceScatter {
                send,
                recv,
                recv_count,
                op,
            } => {
                let f = api.reduce_scatter.get()?;
                // SAFETY: see above.
                unsafe { f(address(send), address(recv), recv_count, dtype, op, c, s) }
            }
            Self::Send { send, count, peer } => {
                let f = api.send.get()?;
                // SAFETY: see above.
                unsafe { f(address(send), count, dtype, peer, c, s) }
            }
            Self::Recv { recv, count, peer } => {
                let f = api.recv.get()?;
                // SAFETY: see above.
                unsafe { f(address(recv), count, dtype, peer, c, s) }
            }
        })
    }
}
