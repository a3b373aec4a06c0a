//! Queuing calls on NCCL: checking them, issuing them alone or as one group, settling them,
//! and recording their buffers' uses.

use std::sync::Arc;
use std::time::Instant;

use crate::comm::Communicator;
use crate::error::{CollectiveError, NcclCode, Result};
use crate::group_checks::{
    Direction, Party, PointToPoint, check_blocking, check_captures, check_pairs,
};
use crate::handle::{Blocking, end_group};
use crate::loader::NcclApi;
use crate::raw::{self, Call};

use super::op::Op;

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
pub(super) fn run(ops: Vec<Op<'_>>, grouped: bool) -> Result<()> {
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
    // A group's work waits on each other: one failed or aborted communicator aborts them all,
    // together and in the background (the caller is not held while queued work drains).
    if grouped && (settling_failed || comms.iter().any(|comm| comm.is_aborted())) {
        crate::comm::abort_all_in_background(&comms);
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
    let mut blocking = Vec::new();
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
                blocking.push((op.comm.rank(), op.comm.config().blocking));
                comms.len() - 1
            })
        })
        .collect();
    check_blocking(&blocking).map_err(|reason| CollectiveError::invalid(operation, reason))?;
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
