//! Collectives and point-to-point calls on typed cuweave buffers, and [`Group`] calls.
//!
//! Every call orders itself with the buffers' other uses through their use trackers, exactly as
//! a tracked kernel launch does: the stream first waits for what the call conflicts with (a
//! buffer NCCL only reads waits for its last write; one it writes waits for every use since),
//! NCCL queues the work, and the call is then recorded as a read or a write. So a buffer is
//! never freed, reused by the caching allocator, or touched by the host while a collective that
//! uses it is still running, and readers on other streams overlap with it.
//!
//! Views ([`Buffer::slice`], [`Buffer::slice_mut`]) take part like whole buffers, their uses
//! tracked for their range alone; a read-only view given as an output is refused by its tracker
//! (`MemoryError::ReadOnlyView`) before NCCL sees it.
//!
//! Element types are [`NcclType`]s, so the `ncclDataType_t` NCCL is told always matches the
//! buffer; lengths are checked against the communicator's size before NCCL sees them.

use std::ffi::c_int;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Instant;

use cuweave_driver::Stream;
use cuweave_driver::memory::DevicePtr;
use cuweave_memory::{Access, Buffer};

use crate::comm::Communicator;
use crate::error::{CollectiveError, NcclCode, Result};
use crate::group_checks::{Direction, Party, PointToPoint, check_captures, check_pairs};
use crate::handle::{Blocking, end_group};
use crate::loader::NcclApi;
use crate::raw::{self, Call};
use crate::sys;
use crate::types::{NcclType, ReduceOp};

/// A buffer a call uses, with its element type erased, so calls of different types can be
/// collected in one [`Group`].
trait TrackUse {
    fn prepare(&self, stream: &Stream, access: Access) -> cuweave_memory::Result<()>;
    fn record(&self, stream: &Stream, access: Access) -> cuweave_memory::Result<()>;
}

struct Tracked<'a, T, B: ?Sized>(&'a B, PhantomData<fn() -> T>);

impl<T: NcclType, B: Buffer<T> + ?Sized> TrackUse for Tracked<'_, T, B> {
    fn prepare(&self, stream: &Stream, access: Access) -> cuweave_memory::Result<()> {
        match access {
            Access::Read => self.0.prepare_read(stream),
            _ => self.0.prepare_write(stream),
        }
    }

    fn record(&self, stream: &Stream, access: Access) -> cuweave_memory::Result<()> {
        match access {
            Access::Read => self.0.record_read(stream),
            _ => self.0.record_write(stream),
        }
    }
}

/// One call, ready to queue: what NCCL is asked, and the buffers it uses.
struct Op<'a> {
    comm: &'a Communicator,
    stream: &'a Stream,
    call: Call,
    data_type: sys::ncclDataType_t,
    /// Bytes per element of `data_type`.
    element_size: usize,
    uses: Vec<(Box<dyn TrackUse + 'a>, Access)>,
}

fn read<'a, T: NcclType, B: Buffer<T> + ?Sized>(buffer: &'a B) -> (Box<dyn TrackUse + 'a>, Access) {
    (Box::new(Tracked::<T, B>(buffer, PhantomData)), Access::Read)
}

fn write<'a, T: NcclType, B: Buffer<T> + ?Sized>(
    buffer: &'a B,
) -> (Box<dyn TrackUse + 'a>, Access) {
    (
        Box::new(Tracked::<T, B>(buffer, PhantomData)),
        Access::Write,
    )
}

fn check_device<T: NcclType, B: Buffer<T> + ?Sized>(
    comm: &Communicator,
    buffer: &B,
    stream: &Stream,
    operation: &'static str,
) -> Result<()> {
    let device = comm.device();
    if buffer.device() != device || stream.device() != device {
        return Err(CollectiveError::invalid(
            operation,
            format!(
                "the communicator's rank is on device {}, the buffer on {}, the stream on {}",
                device.ordinal(),
                buffer.device().ordinal(),
                stream.device().ordinal()
            ),
        ));
    }
    Ok(())
}

fn check_len(operation: &'static str, what: &str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(CollectiveError::invalid(
            operation,
            format!("{what} holds {got} elements, expected {expected}"),
        ));
    }
    Ok(())
}

fn peer_rank(
    comm: &Communicator,
    rank: usize,
    what: &str,
    operation: &'static str,
) -> Result<c_int> {
    if rank >= comm.size() {
        return Err(CollectiveError::invalid(
            operation,
            format!(
                "{what} {rank} is not a rank of a {}-rank communicator",
                comm.size()
            ),
        ));
    }
    Ok(rank as c_int)
}

fn offset<T>(ptr: DevicePtr, elements: usize) -> DevicePtr {
    ptr + (elements * size_of::<T>()) as DevicePtr
}

/// Queues `ops` (grouped between `ncclGroupStart` and `ncclGroupEnd` when `grouped`) under the
/// use-tracking protocol: every stream waits for what its buffers' uses conflict with, NCCL
/// queues the calls, and the uses are recorded once NCCL has queued the work.
///
/// Issuing is serialised per communicator by its issue lock, held until the calls have
/// settled; the handles are guarded per NCCL call (see [`issue`]), never while settling, so an
/// abort from another thread stops the settling at its next poll.
///
/// Once NCCL has accepted any call, a failure (a later call refused, `ncclGroupEnd`'s error,
/// an asynchronous error, the deadline, an abort from another thread) still settles every
/// communicator of the call (aborting those that fail; in a group, all of them once one is
/// aborted, since their work waits on each other) and records every use before the first error
/// is returned: a launched kernel may still touch the buffers until the stream passes it.
fn run(ops: Vec<Op<'_>>, grouped: bool) -> Result<()> {
    let Some(first) = ops.first() else {
        return Ok(());
    };
    check_calls(&ops, grouped)?;
    let api = first.comm.api();
    let operation = if grouped {
        "ncclGroupEnd"
    } else {
        first.call.name()
    };
    // Issue locks in a fixed order, once per communicator.
    let mut comms: Vec<&Communicator> = ops.iter().map(|op| op.comm).collect();
    comms.sort_by_key(|comm| Arc::as_ptr(&comm.inner));
    comms.dedup_by_key(|comm| Arc::as_ptr(&comm.inner));
    let _issuing: Vec<_> = comms.iter().map(|comm| comm.issue_lock()).collect();
    let started = Instant::now();
    let issued = issue(&ops, grouped, api)?;
    if !issued.accepted {
        // NCCL refused the first call: nothing was queued, nothing to settle or record.
        return issued.failure.map_or(Ok(()), Err);
    }
    let mut first_error = issued.failure;
    let mut settling_failed = false;
    if issued.pending || first_error.is_some() {
        for comm in &comms {
            // A group's communicators are aborted together below, never one by one.
            let settled = if grouped {
                comm.settle_without_abort(operation, started)
            } else {
                comm.settle(operation, started)
            };
            if let Err(error) = settled {
                settling_failed |= !matches!(error, CollectiveError::Aborted { .. });
                first_error.get_or_insert(error);
            }
        }
    }
    // A group's work waits on each other: one failed or aborted communicator aborts them all.
    if grouped && (settling_failed || comms.iter().any(|comm| comm.is_aborted())) {
        crate::comm::abort_all(&comms);
    }
    let mut recorded = Ok(());
    for op in &ops {
        for (buffer, access) in &op.uses {
            if let Err(error) = buffer.record(op.stream, *access) {
                recorded = recorded.and(Err(error));
            }
        }
    }
    if let Err(error) = recorded {
        // Work is queued that a tracker could not record: wait for it before anything can
        // free or reuse the buffers.
        for op in &ops {
            let _ = op.stream.synchronize();
        }
        return Err(first_error.unwrap_or(error.into()));
    }
    first_error.map_or(Ok(()), Err)
}

/// Refuses, before anything reaches NCCL, the calls NCCL would refuse or mishandle only once
/// a communicator has taken part of them (see [`crate::group_checks`]):
///
/// - streams that mix captures: a communicator's calls on streams that are not all uncaptured
///   or all in one capture, or a group whose communicators are partly captured (one driver
///   query per call's stream; only for more than one call, since a lone call is never mixed);
/// - sends and receives that do not pair up: a rank's sends to itself and receives from itself
///   (NCCL pairs them per communicator, in order, only within one group, and its copy moves the
///   *send's* bytes into the receive buffer, so a smaller receive would be written past its
///   end), and, between two ranks of one communicator both in the call, the sends from one and
///   the receives at the other (as many, equal bytes in order; element types may differ).
fn check_calls(ops: &[Op<'_>], grouped: bool) -> Result<()> {
    let operation = if grouped {
        "Group::launch"
    } else {
        ops[0].call.name()
    };
    let mut comms: Vec<*const crate::comm::CommInner> = Vec::new();
    let mut parties = Vec::new();
    let party_of: Vec<usize> = ops
        .iter()
        .map(|op| {
            let comm = Arc::as_ptr(&op.comm.inner);
            comms.iter().position(|c| *c == comm).unwrap_or_else(|| {
                comms.push(comm);
                parties.push(Party {
                    world: op.comm.world(),
                    rank: op.comm.rank(),
                });
                comms.len() - 1
            })
        })
        .collect();
    if ops.len() > 1 {
        // One query per distinct stream (a coalesced group has many calls on few streams).
        let mut seen: Vec<(u64, Option<u64>)> = Vec::new();
        let mut captures = Vec::with_capacity(ops.len());
        for (op, &party) in ops.iter().zip(&party_of) {
            let stream = op.stream.id();
            let capture = match seen.iter().find(|(id, _)| *id == stream) {
                Some(&(_, capture)) => capture,
                None => {
                    let capture = op.stream.capture_status()?.id();
                    seen.push((stream, capture));
                    capture
                }
            };
            captures.push((party, capture));
        }
        check_captures(&parties, &captures)
            .map_err(|reason| CollectiveError::invalid(operation, reason))?;
    }
    let exchanges: Vec<PointToPoint> = ops
        .iter()
        .zip(&party_of)
        .filter_map(|(op, &party)| {
            let (direction, count, peer) = match op.call {
                Call::Send { count, peer, .. } => (Direction::Send, count, peer),
                Call::Recv { count, peer, .. } => (Direction::Recv, count, peer),
                _ => return None,
            };
            Some(PointToPoint {
                party,
                direction,
                peer: peer as usize,
                bytes: count * op.element_size,
            })
        })
        .collect();
    if exchanges.is_empty() {
        return Ok(());
    }
    check_pairs(&parties, &exchanges).map_err(|reason| CollectiveError::invalid(operation, reason))
}

/// What issuing found: whether NCCL accepted any call (so work may be queued), whether any is
/// still in progress (a non-blocking communicator), and the first failure.
struct Issued {
    accepted: bool,
    pending: bool,
    failure: Option<CollectiveError>,
}

/// Prepares every buffer, then issues every call (in one group when `grouped`). An error
/// returned here happened before anything reached NCCL.
///
/// The handles are guarded per NCCL call, taken after the buffers are prepared (which may wait
/// on a tracker's lock): an ungrouped call is one blocking call, which an abort from another
/// thread may cut short if it hangs inside NCCL; a group's guards are held from its first call
/// to `ncclGroupEnd` (NCCL only records the calls until then, and acts on every communicator
/// in `ncclGroupEnd`), which is the group's one blocking call. An abort requested in between is
/// seen at the next call, and a call cut short never reaches its handle again (see
/// [`crate::handle`]).
fn issue(ops: &[Op<'_>], grouped: bool, api: &NcclApi) -> Result<Issued> {
    if let Some(op) = ops.iter().find(|op| op.comm.is_aborted()) {
        return Err(CollectiveError::Aborted {
            operation: op.call.name(),
        });
    }
    for op in ops {
        for (buffer, access) in &op.uses {
            buffer.prepare(op.stream, *access)?;
        }
    }
    if grouped {
        issue_group(ops, api)
    } else {
        let mut issued = Issued {
            accepted: false,
            pending: false,
            failure: None,
        };
        for op in ops {
            match issue_one(op, api) {
                Ok(one) => {
                    issued.accepted |= one.accepted;
                    issued.pending |= one.pending;
                    if one.failure.is_some() {
                        issued.failure = one.failure;
                        break;
                    }
                }
                Err(error) if !issued.accepted => return Err(error),
                Err(error) => {
                    issued.failure = Some(error);
                    break;
                }
            }
        }
        Ok(issued)
    }
}

/// One call outside a group: a blocking call on its communicator's handle.
fn issue_one(op: &Op<'_>, api: &NcclApi) -> Result<Issued> {
    let operation = op.call.name();
    op.comm.context().bind_to_thread()?;
    let guard = op.comm.enter(operation)?;
    let code = match guard.blocking_call(|raw| op.call.issue(api, raw, op.data_type, op.stream)) {
        Blocking::Refused => return Err(CollectiveError::Aborted { operation }),
        // NCCL may have queued the work before the abort: settle and record as accepted.
        Blocking::CutShort => {
            return Ok(Issued {
                accepted: true,
                pending: false,
                failure: Some(CollectiveError::Aborted { operation }),
            });
        }
        Blocking::Returned(code) => code?,
    };
    match NcclCode::from_raw(code) {
        None => Ok(Issued {
            accepted: true,
            pending: false,
            failure: None,
        }),
        Some(NcclCode::InProgress) => Ok(Issued {
            accepted: true,
            pending: true,
            failure: None,
        }),
        Some(kind) => Err(op.comm.nccl_error(kind, code, operation)),
    }
}

/// Every call between `ncclGroupStart` and `ncclGroupEnd`, each under a guard kept until the
/// group is closed.
fn issue_group(ops: &[Op<'_>], api: &NcclApi) -> Result<Issued> {
    api.check(
        raw::group_start(api)?,
        "ncclGroupStart",
        std::ptr::null_mut(),
    )?;
    let mut issued = Issued {
        accepted: false,
        pending: false,
        failure: None,
    };
    let mut guards = Vec::with_capacity(ops.len());
    for op in ops {
        let operation = op.call.name();
        let guard = match op.comm.context().bind_to_thread() {
            Ok(()) => op.comm.enter(operation),
            Err(error) => Err(error.into()),
        };
        let guard = match guard {
            Ok(guard) => guard,
            Err(error) => {
                issued.failure = Some(error);
                break;
            }
        };
        // Inside an open group NCCL only records the call: it does not block, so the guard
        // pins the handle until `ncclGroupEnd`.
        let called = guard.call(|raw| {
            let code = op.call.issue(api, raw, op.data_type, op.stream)?;
            match NcclCode::from_raw(code) {
                None => Ok(false),
                Some(NcclCode::InProgress) => Ok(true),
                Some(kind) => Err(api.error(kind, code, operation, raw.0)),
            }
        });
        guards.push(guard);
        match called {
            Some(Ok(pending)) => {
                issued.accepted = true;
                issued.pending |= pending;
            }
            Some(Err(error)) => {
                issued.failure = Some(error);
                break;
            }
            None => {
                issued.failure = Some(CollectiveError::Aborted { operation });
                break;
            }
        }
    }
    // Always close the group, even after a failed call or an abort request, so this thread
    // leaves group mode; the guards kept every handle alive until here.
    let (ended, cut_short) = end_group(guards, || raw::group_end(api));
    match ended.map(|code| (NcclCode::from_raw(code), code)) {
        Ok((None, _)) => {}
        Ok((Some(NcclCode::InProgress), _)) => issued.pending = true,
        Ok((Some(kind), code)) => {
            let error = api.error(kind, code, "ncclGroupEnd", std::ptr::null_mut());
            issued.failure.get_or_insert(error);
        }
        Err(error) => {
            issued.failure.get_or_insert(error);
        }
    }
    if cut_short {
        issued.failure.get_or_insert(CollectiveError::Aborted {
            operation: "ncclGroupEnd",
        });
    }
    Ok(issued)
}

/// Builders for each call, shared by the communicator's methods and [`Group`].
impl Communicator {
    /// The `ncclRedOp_t` for `op` on this communicator. On one rank the mean is the value
    /// itself, and NCCL 2.28.3's one-rank `ncclAvg` kernel was measured on the H100 to leave
    /// the tail of a count that does not split evenly unwritten (262 147 f32: the last 3), so
    /// one rank asks for the sum, which NCCL runs as a plain copy: the same bytes.
    fn red_op(&self, op: ReduceOp) -> sys::ncclRedOp_t {
        if op == ReduceOp::Avg && self.size() == 1 {
            ReduceOp::Sum.as_raw()
        } else {
            op.as_raw()
        }
    }

    /// A call that reads `send` and writes `recv` (both on this rank's device), after the
    /// caller checked their lengths; `call` gets their addresses.
    fn pair_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        stream: &'a Stream,
        operation: &'static str,
        call: impl FnOnce(DevicePtr, DevicePtr) -> Result<Call>,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        check_device(self, send, stream, operation)?;
        check_device(self, recv, stream, operation)?;
        Ok(Op {
            comm: self,
            stream,
            call: call(send.device_ptr(), recv.device_ptr())?,
            data_type: T::DATA_TYPE,
            element_size: size_of::<T>(),
            uses: vec![read::<T, S>(send), write::<T, R>(recv)],
        })
    }

    /// A call on one buffer, `access` as NCCL uses it; `call` gets its address and length.
    fn single_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        access: Access,
        stream: &'a Stream,
        operation: &'static str,
        call: impl FnOnce(DevicePtr, usize) -> Result<Call>,
    ) -> Result<Op<'a>> {
        check_device(self, buffer, stream, operation)?;
        let tracked = match access {
            Access::Read => read::<T, B>(buffer),
            _ => write::<T, B>(buffer),
        };
        Ok(Op {
            comm: self,
            stream,
            call: call(buffer.device_ptr(), buffer.len())?,
            data_type: T::DATA_TYPE,
            element_size: size_of::<T>(),
            uses: vec![tracked],
        })
    }

    fn all_reduce_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        const OP: &str = "ncclAllReduce";
        check_len(OP, "the receive buffer", send.len(), recv.len())?;
        let (count, op) = (send.len(), self.red_op(op));
        self.pair_op(send, recv, stream, OP, |send, recv| {
            Ok(Call::AllReduce {
                send,
                recv,
                count,
                op,
            })
        })
    }

    fn all_reduce_in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let op = self.red_op(op);
        self.in_place_op(buffer, stream, "ncclAllReduce", |ptr, count| {
            Ok(Call::AllReduce {
                send: ptr,
                recv: ptr,
                count,
                op,
            })
        })
    }

    fn in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        stream: &'a Stream,
        operation: &'static str,
        call: impl FnOnce(DevicePtr, usize) -> Result<Call>,
    ) -> Result<Op<'a>> {
        self.single_op(buffer, Access::Write, stream, operation, call)
    }

    fn broadcast_in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        root: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let root = peer_rank(self, root, "root", "ncclBroadcast")?;
        self.in_place_op(buffer, stream, "ncclBroadcast", |ptr, len| {
            Ok(Call::Broadcast {
                send: ptr,
                recv: ptr,
                count: len,
                root,
            })
        })
    }

    fn reduce_in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        op: ReduceOp,
        root: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let (root, op) = (
            peer_rank(self, root, "root", "ncclReduce")?,
            self.red_op(op),
        );
        self.in_place_op(buffer, stream, "ncclReduce", |ptr, len| {
            Ok(Call::Reduce {
                send: ptr,
                recv: ptr,
                count: len,
                op,
                root,
            })
        })
    }

    fn all_gather_in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let (rank, size) = (self.rank(), self.size());
        self.in_place_op(buffer, stream, "ncclAllGather", |ptr, len| {
            let chunk = chunk_of(len, size, "ncclAllGather")?;
            Ok(Call::AllGather {
                send: offset::<T>(ptr, rank * chunk),
                recv: ptr,
                send_count: chunk,
            })
        })
    }

    fn reduce_scatter_in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let (rank, size, op) = (self.rank(), self.size(), self.red_op(op));
        self.in_place_op(buffer, stream, "ncclReduceScatter", |ptr, len| {
            let chunk = chunk_of(len, size, "ncclReduceScatter")?;
            Ok(Call::ReduceScatter {
                send: ptr,
                recv: offset::<T>(ptr, rank * chunk),
                recv_count: chunk,
                op,
            })
        })
    }

    fn broadcast_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        root: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        const OP: &str = "ncclBroadcast";
        check_len(OP, "the receive buffer", send.len(), recv.len())?;
        let (count, root) = (send.len(), peer_rank(self, root, "root", OP)?);
        self.pair_op(send, recv, stream, OP, |send, recv| {
            Ok(Call::Broadcast {
                send,
                recv,
                count,
                root,
            })
        })
    }

    fn reduce_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        op: ReduceOp,
        root: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        const OP: &str = "ncclReduce";
        check_len(OP, "the receive buffer", send.len(), recv.len())?;
        let (count, op, root) = (
            send.len(),
            self.red_op(op),
            peer_rank(self, root, "root", OP)?,
        );
        self.pair_op(send, recv, stream, OP, |send, recv| {
            Ok(Call::Reduce {
                send,
                recv,
                count,
                op,
                root,
            })
        })
    }

    fn all_gather_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        stream: &'a Stream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        const OP: &str = "ncclAllGather";
        check_len(
            OP,
            "the receive buffer",
            send.len() * self.size(),
            recv.len(),
        )?;
        let send_count = send.len();
        self.pair_op(send, recv, stream, OP, |send, recv| {
            Ok(Call::AllGather {
                send,
                recv,
                send_count,
            })
        })
    }

    fn reduce_scatter_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        const OP: &str = "ncclReduceScatter";
        check_len(OP, "the send buffer", recv.len() * self.size(), send.len())?;
        let (recv_count, op) = (recv.len(), self.red_op(op));
        self.pair_op(send, recv, stream, OP, |send, recv| {
            Ok(Call::ReduceScatter {
                send,
                recv,
                recv_count,
                op,
            })
        })
    }

    fn send_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let peer = peer_rank(self, peer, "peer", "ncclSend")?;
        self.single_op(buffer, Access::Read, stream, "ncclSend", |send, count| {
            Ok(Call::Send { send, count, peer })
        })
    }

    fn recv_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let peer = peer_rank(self, peer, "peer", "ncclRecv")?;
        self.single_op(buffer, Access::Write, stream, "ncclRecv", |recv, count| {
            Ok(Call::Recv { recv, count, peer })
        })
    }

    /// Queues an all-reduce on `stream`: every rank's `recv` becomes `op` over all ranks'
    /// `send` (same length).
    ///
    /// # Errors
    /// `InvalidArgument` for lengths that differ or a buffer or stream on another device than
    /// this rank; `Aborted`; NCCL's error; the use tracker's error.
    pub fn all_reduce<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        run(vec![self.all_reduce_op(send, &*recv, op, stream)?], false)
    }

    /// [`all_reduce`](Self::all_reduce) in place: `buffer` is both the input and the result.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_reduce_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let op = self.all_reduce_in_place_op(&*buffer, op, stream)?;
        run(vec![op], false)
    }

    /// Queues a broadcast: every rank's `recv` becomes rank `root`'s `send` (only the root's
    /// `send` is read; the others' is ignored but must have the same length).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce); `InvalidArgument` for a root out of range.
    pub fn broadcast<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        root: usize,
        stream: &Stream,
    ) -> Result<()>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        run(vec![self.broadcast_op(send, &*recv, root, stream)?], false)
    }

    /// [`broadcast`](Self::broadcast) in place: `buffer` is the root's input and every rank's
    /// result.
    ///
    /// # Errors
    /// As [`broadcast`](Self::broadcast).
    pub fn broadcast_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let op = self.broadcast_in_place_op(&*buffer, root, stream)?;
        run(vec![op], false)
    }

    /// Queues a reduction to `root`: the root's `recv` becomes `op` over every rank's `send`;
    /// other ranks' `recv` is not written (but is recorded as written, conservatively).
    ///
    /// # Errors
    /// As [`broadcast`](Self::broadcast).
    pub fn reduce<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        run(vec![self.reduce_op(send, &*recv, op, root, stream)?], false)
    }

    /// [`reduce`](Self::reduce) in place.
    ///
    /// # Errors
    /// As [`reduce`](Self::reduce).
    pub fn reduce_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        op: ReduceOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let op = self.reduce_in_place_op(&*buffer, op, root, stream)?;
        run(vec![op], false)
    }

    /// Queues an all-gather: `recv` (`send.len() × size()` elements) becomes every rank's
    /// `send`, in rank order.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_gather<T, S, R>(&self, send: &S, recv: &mut R, stream: &Stream) -> Result<()>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        run(vec![self.all_gather_op(send, &*recv, stream)?], false)
    }

    /// [`all_gather`](Self::all_gather) in place: this rank's input is its own slot of
    /// `buffer` (elements `rank × n .. (rank + 1) × n`, `n = buffer.len() / size()`).
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather); `InvalidArgument` unless the length divides by
    /// the size.
    pub fn all_gather_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        stream: &Stream,
    ) -> Result<()> {
        let op = self.all_gather_in_place_op(&*buffer, stream)?;
        run(vec![op], false)
    }

    /// Queues a reduce-scatter: `recv` (`send.len() / size()` elements) becomes `op` over every
    /// rank's `send`, this rank's slot of it.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn reduce_scatter<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        run(
            vec![self.reduce_scatter_op(send, &*recv, op, stream)?],
            false,
        )
    }

    /// [`reduce_scatter`](Self::reduce_scatter) in place: the result lands in this rank's slot
    /// of `buffer` (elements `rank × n .. (rank + 1) × n`, `n = buffer.len() / size()`).
    ///
    /// # Errors
    /// As [`all_gather_in_place`](Self::all_gather_in_place).
    pub fn reduce_scatter_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let op = self.reduce_scatter_in_place_op(&*buffer, op, stream)?;
        run(vec![op], false)
    }

    /// Queues sending `buffer` to rank `peer`, which must [`recv`](Self::recv) the same length.
    /// A send and a receive between the same two ranks must be in one [`Group`] (or the
    /// first blocks the stream until the second is queued elsewhere). A send to this rank
    /// itself is only possible in a [`Group`], with its receive from itself.
    ///
    /// # Errors
    /// As [`broadcast`](Self::broadcast), for the peer; `InvalidArgument` for a send to this
    /// rank itself, which outside a group has no receive to pair with (see [`Group::launch`]).
    pub fn send<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &B,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        run(vec![self.send_op(buffer, peer, stream)?], false)
    }

    /// Queues receiving `buffer` from rank `peer`.
    ///
    /// # Errors
    /// As [`send`](Self::send) (a receive from this rank itself needs its send in a [`Group`]).
    pub fn recv<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        run(vec![self.recv_op(&*buffer, peer, stream)?], false)
    }
}

fn chunk_of(len: usize, size: usize, operation: &'static str) -> Result<usize> {
    if !len.is_multiple_of(size) {
        return Err(CollectiveError::invalid(
            operation,
            format!("{len} elements do not split into {size} equal slots"),
        ));
    }
    Ok(len / size)
}

/// Several calls queued as one NCCL group (`ncclGroupStart` … `ncclGroupEnd`): the calls of one
/// process on several communicators (one process driving several GPUs), or sends and receives
/// that must progress together.
///
/// Calls are collected (and checked) first and queued by [`launch`](Self::launch); buffers stay
/// borrowed until then. The buffers' uses are recorded after `ncclGroupEnd`, when NCCL has
/// queued the work.
///
/// ```no_run
/// use cuweave_collective::{CommConfig, Communicator, Group, ReduceOp};
/// use cuweave_driver::{Device, Stream, StreamFlags};
/// use cuweave_memory::DeviceBuffer;
///
/// # fn main() -> cuweave_collective::Result<()> {
/// let devices = Device::all()?;
/// let comms = Communicator::init_all(&devices, &CommConfig::default())?;
/// let mut buffers = Vec::new();
/// let mut streams = Vec::new();
/// for comm in &comms {
///     buffers.push(DeviceBuffer::<f32>::from_slice(comm.context(), &[1.0; 1024])?);
///     streams.push(Stream::new(comm.context(), StreamFlags::NON_BLOCKING)?);
/// }
/// let mut group = Group::new();
/// for ((comm, buffer), stream) in comms.iter().zip(&mut buffers).zip(&streams) {
///     group.all_reduce_in_place(comm, buffer, ReduceOp::Sum, stream)?;
/// }
/// group.launch()?;
/// for (comm, stream) in comms.iter().zip(&streams) {
///     comm.synchronize(stream)?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Default)]
#[must_use = "a group queues nothing until `launch` is called"]
pub struct Group<'a> {
    ops: Vec<Op<'a>>,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.ops.iter().map(|op| op.call.name()))
            .finish()
    }
}

impl<'a> Group<'a> {
    /// An empty group.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many calls it holds.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Adds [`Communicator::all_reduce`].
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`]'s checks.
    pub fn all_reduce<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<&mut Self>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.ops.push(comm.all_reduce_op(send, &*recv, op, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::all_reduce_in_place`].
    ///
    /// # Errors
    /// As its checks.
    pub fn all_reduce_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        let op = comm.all_reduce_in_place_op(&*buffer, op, stream)?;
        self.ops.push(op);
        Ok(self)
    }

    /// Adds [`Communicator::broadcast`].
    ///
    /// # Errors
    /// As its checks.
    pub fn broadcast<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.ops
            .push(comm.broadcast_op(send, &*recv, root, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::broadcast_in_place`]: torch's `broadcast(tensor, src)` of every
    /// rank driven from this thread.
    ///
    /// # Errors
    /// As its checks.
    pub fn broadcast_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        root: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        let op = comm.broadcast_in_place_op(&*buffer, root, stream)?;
        self.ops.push(op);
        Ok(self)
    }

    /// Adds [`Communicator::reduce`].
    ///
    /// # Errors
    /// As its checks.
    pub fn reduce<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
        root: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.ops
            .push(comm.reduce_op(send, &*recv, op, root, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::reduce_in_place`].
    ///
    /// # Errors
    /// As its checks.
    pub fn reduce_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        op: ReduceOp,
        root: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        let op = comm.reduce_in_place_op(&*buffer, op, root, stream)?;
        self.ops.push(op);
        Ok(self)
    }

    /// Adds [`Communicator::all_gather`].
    ///
    /// # Errors
    /// As its checks.
    pub fn all_gather<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        stream: &'a Stream,
    ) -> Result<&mut Self>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.ops.push(comm.all_gather_op(send, &*recv, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::all_gather_in_place`].
    ///
    /// # Errors
    /// As its checks.
    pub fn all_gather_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        let op = comm.all_gather_in_place_op(&*buffer, stream)?;
        self.ops.push(op);
        Ok(self)
    }

    /// Adds [`Communicator::reduce_scatter`].
    ///
    /// # Errors
    /// As its checks.
    pub fn reduce_scatter<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<&mut Self>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.ops
            .push(comm.reduce_scatter_op(send, &*recv, op, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::reduce_scatter_in_place`].
    ///
    /// # Errors
    /// As its checks.
    pub fn reduce_scatter_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        let op = comm.reduce_scatter_in_place_op(&*buffer, op, stream)?;
        self.ops.push(op);
        Ok(self)
    }

    /// Adds [`Communicator::send`].
    ///
    /// # Errors
    /// As its checks.
    pub fn send<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a B,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        self.ops.push(comm.send_op(buffer, peer, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::recv`].
    ///
    /// # Errors
    /// As its checks.
    pub fn recv<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        self.ops.push(comm.recv_op(&*buffer, peer, stream)?);
        Ok(self)
    }

    /// Queues every call as one NCCL group.
    ///
    /// Checked before anything is queued, so that NCCL never refuses the group after a
    /// communicator has taken part of it (which would leave it with an asynchronous error and
    /// abort it):
    ///
    /// - **Captures.** One communicator's calls must all be on streams that are not capturing,
    ///   or all on streams of the same capture; and either none or all of the group's
    ///   communicators capture (NCCL's two rules). Each distinct stream's capture status is
    ///   asked of the driver once.
    /// - **Pairs.** A rank's sends to itself and receives from itself are paired by NCCL in
    ///   the order they were added: each needs its partner in the group, with the same number
    ///   of bytes (NCCL's copy moves the send's bytes into the receive buffer). Between two
    ///   ranks of one communicator that are both in the group (one process driving several
    ///   GPUs), the k-th send from one to the other pairs with the k-th receive there from
    ///   the first: as many on each side, equal bytes in order (element types may differ).
    ///   Ranks are known to be of one communicator when made by one
    ///   [`init_all`](Communicator::init_all), joined with the same [`UniqueId`](crate::UniqueId),
    ///   or made with one color by one [`split_all`](Communicator::split_all); a rank in
    ///   another process or thread is not checked.
    ///
    /// # Errors
    /// `InvalidArgument` (nothing is queued, every communicator untouched) for streams that
    /// mix captures as above, or sends and receives that do not pair up, in number or in
    /// bytes; the driver's error when a capture status cannot be read; `Aborted` for an aborted
    /// communicator; NCCL's error (the group is closed either way); a non-blocking group that
    /// fails or passes the deadline while settling aborts its communicators; the use tracker's
    /// error.
    pub fn launch(self) -> Result<()> {
        run(self.ops, true)
    }
}
