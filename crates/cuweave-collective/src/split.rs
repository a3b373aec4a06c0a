//! Splitting communicators: [`Communicator::split`] for one rank per process (or per thread),
//! and [`Communicator::split_all`] for several ranks driven from one thread (communicators made
//! by [`Communicator::init_all`]), whose splits NCCL needs in one group.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::{Communicator, World, abort_raw, settle_raw, to_int};
use crate::config::NcclConfig;
use crate::error::{CollectiveError, NcclCode, Result};
use crate::handle::{Polled, end_group, poll_until};
use crate::loader;
use crate::raw::{self, HandleSlot, RawComm};
use crate::sys;

/// The `(color, key)` pairs as NCCL takes them: a color over `i32::MAX` or a key over it is
/// refused; `None` is `NCCL_SPLIT_NOCOLOR`.
fn to_nccl(splits: &[(Option<u32>, u32)], operation: &'static str) -> Result<Vec<(c_int, c_int)>> {
    splits
        .iter()
        .map(|&(color, key)| {
            let color = match color {
                Some(color) => to_int(color as usize, "color", operation)?,
                None => sys::NCCL_SPLIT_NOCOLOR,
            };
            Ok((color, to_int(key as usize, "key", operation)?))
        })
        .collect()
}

/// The world of each parent's child: the children of one color made by one `split_all` from
/// parents of one known world are ranks of one communicator; any other child's world is not
/// known here (one `split` per thread makes each rank's child alone).
fn child_worlds(parents: &[&Communicator], splits: &[(Option<u32>, u32)]) -> Vec<Option<World>> {
    let mut made: Vec<((World, u32), World)> = Vec::new();
    parents
        .iter()
        .zip(splits)
        .map(|(parent, &(color, _))| {
            let key = (parent.world()?, color?);
            Some(match made.iter().find(|(k, _)| *k == key) {
                Some(&(_, world)) => world,
                None => {
                    let world = World::fresh();
                    made.push((key, world));
                    world
                }
            })
        })
        .collect()
}

/// Checks `split_all`'s arguments: as many splits as parents, at least one, no parent twice.
fn check_parents(parents: &[&Communicator], splits: usize, operation: &'static str) -> Result<()> {
    if parents.is_empty() {
        return Err(CollectiveError::invalid(operation, "no communicators"));
    }
    if parents.len() != splits {
        return Err(CollectiveError::invalid(
            operation,
            format!(
                "{} communicators but {splits} (color, key) pairs",
                parents.len()
            ),
        ));
    }
    let blocking: Vec<(usize, bool)> = parents
        .iter()
        .map(|parent| (parent.rank(), parent.config().blocking))
        .collect();
    crate::group_checks::check_blocking(&blocking)
        .map_err(|reason| CollectiveError::invalid(operation, reason))?;
    for (i, parent) in parents.iter().enumerate() {
        if parents[..i]
            .iter()
            .any(|other| Arc::ptr_eq(&other.inner, &parent.inner))
        {
            return Err(CollectiveError::invalid(
                operation,
                format!("communicator {i} (rank {}) is listed twice", parent.rank()),
            ));
        }
    }
    Ok(())
}

impl Communicator {
    /// Splits the communicator: every rank calls it (it is collective); ranks passing the same
    /// `color` form a new communicator, ordered by `key` (then by their rank here). `None` as
    /// the color takes no part (`NCCL_SPLIT_NOCOLOR`) and returns `Ok(None)`.
    ///
    /// This is for one rank per process, or one thread per rank: it returns only once this
    /// rank's split has completed, which needs every other rank's split under way. Ranks
    /// driven from one thread (made by [`init_all`](Self::init_all)) split together with
    /// [`split_all`](Self::split_all).
    ///
    /// # Errors
    /// `InvalidArgument` for a color or key over `i32::MAX`; `Aborted`; NCCL's error;
    /// `Timeout` (both the parent and the child are then aborted).
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Self>> {
        let mut children = Self::split_all_as(&[self], &[(color, key)], "Communicator::split")?;
        Ok(children.pop().flatten())
    }

    /// Splits several communicators driven from this thread (the ranks of
    /// [`init_all`](Self::init_all), or some of them) at once: `splits[i]` is `parents[i]`'s
    /// `(color, key)`, as in [`split`](Self::split). Every split is issued in one NCCL group
    /// (NCCL's rule for several ranks in one thread: each rank's split waits for the others),
    /// then all are waited for within the smallest of the parents' deadlines. The result holds,
    /// per parent, its child (`None` for a `None` color).
    ///
    /// ```no_run
    /// use cuweave_collective::{CommConfig, Communicator};
    /// use cuweave_driver::Device;
    ///
    /// # fn main() -> cuweave_collective::Result<()> {
    /// let comms = Communicator::init_all(&Device::all()?, &CommConfig::default())?;
    /// let parents: Vec<&Communicator> = comms.iter().collect();
    /// // Even ranks in one child, odd ranks in another.
    /// let splits: Vec<_> = (0..comms.len()).map(|r| (Some((r % 2) as u32), r as u32)).collect();
    /// let children = Communicator::split_all(&parents, &splits)?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// `InvalidArgument` for no parents, a count of splits that differs, a parent listed twice,
    /// or a color or key over `i32::MAX`; `Aborted`; NCCL's error (every child made is aborted,
    /// and a parent whose split was accepted is settled, or aborted when it fails); `Timeout`
    /// (every parent and every child is then aborted).
    pub fn split_all(
        parents: &[&Communicator],
        splits: &[(Option<u32>, u32)],
    ) -> Result<Vec<Option<Self>>> {
        Self::split_all_as(parents, splits, "Communicator::split_all")
    }

    fn split_all_as(
        parents: &[&Communicator],
        splits: &[(Option<u32>, u32)],
        op: &'static str,
    ) -> Result<Vec<Option<Self>>> {
        check_parents(parents, splits.len(), op)?;
        let nccl_splits = to_nccl(splits, op)?;
        crate::comm::refuse_beside_global_captures(op)?;
        let api = parents[0].api();
        let timeout = parents
            .iter()
            .map(|parent| parent.config().timeout)
            .min()
            .unwrap_or(Duration::ZERO);
        // Issue locks in one order (parents are distinct), so two threads splitting
        // overlapping sets cannot deadlock.
        let mut order: Vec<&Communicator> = parents.to_vec();
        order.sort_by_key(|comm| Arc::as_ptr(&comm.inner));
        let _issuing: Vec<_> = order.iter().map(|comm| comm.issue_lock()).collect();
        // Each child is made with its parent's config (checked when the parent was made).
        let loaded = loader::nccl()?.version();
        let slots = parents
            .iter()
            .map(|parent| {
                NcclConfig::new(parent.config(), loaded).map(|c| HandleSlot::new(Arc::new(c)))
            })
            .collect::<Result<Vec<_>>>()?;
        let started = Instant::now();
        let mut accepted = vec![false; parents.len()];
        let failure = issue_splits(parents, &nccl_splits, &slots, &mut accepted, op)?;
        if let Some(error) = failure {
            // Nothing waits for a refused group: settle the parents whose split NCCL took, abort
            // those that fail to (together and inline: their aborts must have ended before the
            // slots are read, or a child written after the read would never be aborted), then
            // abort any child already written.
            let mut failed: Vec<&Communicator> = Vec::new();
            for (parent, _) in parents.iter().zip(&accepted).filter(|(_, a)| **a) {
                if let Err(error) = parent.settle_without_abort(op, started)
                    && !matches!(error, CollectiveError::Aborted { .. })
                {
                    failed.push(parent);
                }
            }
            crate::comm::abort_all(&failed);
            abort_children(parents, &slots);
            slots.into_iter().for_each(HandleSlot::leak);
            return Err(error);
        }
        // A non-blocking split runs on NCCL's thread (the parent reports it in progress) and
        // writes the child's handle into its slot when made: wait for every parent to be idle
        // and every wanted child to be written, then for the children's own initialisation.
        // No guard is held between polls, so an abort from another thread ends the wait.
        let waited = poll_until(
            started,
            timeout,
            || {
                let mut state = Polled::Done;
                for ((parent, slot), &(color, _)) in parents.iter().zip(&slots).zip(splits) {
                    let idle = parent.poll(op)? == Polled::Done;
                    if !idle || (color.is_some() && slot.get().is_null()) {
                        state = Polled::Pending;
                    }
                }
                Ok(state)
            },
            |waited| CollectiveError::Timeout {
                operation: op,
                waited,
            },
        );
        if let Err(error) = waited {
            // The splits ran as one group job: aborted one after another, the first abort could
            // wait for ever on a split that only another parent's abort flag stops.
            crate::comm::abort_all(parents);
            abort_children(parents, &slots);
            slots.into_iter().for_each(HandleSlot::leak);
            return Err(error);
        }
        let children: Vec<RawComm> = slots.iter().map(HandleSlot::get).collect();
        let contexts: Vec<_> = parents.iter().map(|parent| parent.context()).collect();
        let left = timeout.saturating_sub(started.elapsed());
        if let Err(error) = settle_raw(api, &contexts, &children, op, left) {
            slots.into_iter().for_each(HandleSlot::leak);
            return Err(error);
        }
        let mut made = Vec::with_capacity(parents.len());
        let worlds = child_worlds(parents, splits);
        let mut rest = slots.into_iter().zip(parents).zip(&children);
        let mut worlds = worlds.into_iter();
        while let Some(((slot, parent), child)) = rest.next() {
            let world = worlds.next().flatten();
            if child.is_null() {
                // No part in any child. The parent is idle (waited for above): the split's
                // job, which had the slot's address, has ended and writes nothing more, so the
                // slot is freed rather than leaked on every split that sits one out.
                drop(slot);
                made.push(None);
                continue;
            }
            let context = Arc::clone(parent.context());
            match Self::from_slot(slot, api, context, parent.config().clone(), world) {
                Ok(child) => made.push(Some(child)),
                Err(error) => {
                    // from_slot aborted this one; those already wrapped finalise on drop.
                    for ((slot, parent), child) in rest {
                        if !child.is_null() {
                            abort_raw(api, parent.context(), *child);
                        }
                        slot.leak();
                    }
                    return Err(error);
                }
            }
        }
        Ok(made)
    }
}

/// Issues every parent's `ncclCommSplit` in one group. Each parent's guard is taken after the
/// previous call and kept until `ncclGroupEnd`, the group's one blocking call (a blocking
/// communicator initialises the children there, for hundreds of milliseconds): an abort from
/// another thread waits for the guards while the splits are recorded, and may cut only
/// `ncclGroupEnd` short, after which no parent's handle is read (see [`crate::handle`]).
/// `accepted[i]` tells whether NCCL took parent `i`'s split. An error returned here happened
/// before anything reached NCCL; the failure returned in `Ok` happened after.
fn issue_splits(
    parents: &[&Communicator],
    nccl_splits: &[(c_int, c_int)],
    slots: &[HandleSlot],
    accepted: &mut [bool],
    op: &'static str,
) -> Result<Option<CollectiveError>> {
    if parents.iter().any(|parent| parent.is_aborted()) {
        return Err(CollectiveError::Aborted { operation: op });
    }
    let api = parents[0].api();
    api.check(
        raw::group_start(api)?,
        "ncclGroupStart",
        std::ptr::null_mut(),
    )?;
    let mut failure = None;
    let mut guards = Vec::with_capacity(parents.len());
    for (i, (parent, &(color, key))) in parents.iter().zip(nccl_splits).enumerate() {
        let guard = match parent.context().bind_to_thread() {
            Ok(()) => parent.enter(op),
            Err(error) => Err(error.into()),
        };
        let guard = match guard {
            Ok(guard) => guard,
            Err(error) => {
                failure = Some(error);
                break;
            }
        };
        let called = guard.call(|raw| {
            let code = raw::split(api, raw, &slots[i], color, key)?;
            match NcclCode::from_raw(code) {
                None | Some(NcclCode::InProgress) => Ok(()),
                Some(kind) => Err(api.error(kind, code, "ncclCommSplit", raw.0)),
            }
        });
        guards.push(guard);
        match called {
            Some(Ok(())) => accepted[i] = true,
            Some(Err(error)) => {
                failure = Some(error);
                break;
            }
            None => {
                failure = Some(CollectiveError::Aborted { operation: op });
                break;
            }
        }
    }
    // Always close the group, so this thread leaves group mode.
    let (ended, cut_short) = end_group(guards, || raw::group_end(api));
    let ended = ended.and_then(|code| match NcclCode::from_raw(code) {
        None | Some(NcclCode::InProgress) => Ok(()),
        Some(kind) => Err(api.error(kind, code, "ncclGroupEnd", std::ptr::null_mut())),
    });
    Ok(failure
        .or(ended.err())
        .or_else(|| cut_short.then_some(CollectiveError::Aborted { operation: op })))
}

/// Aborts every child NCCL has written so far (their slots are leaked by the caller).
fn abort_children(parents: &[&Communicator], slots: &[HandleSlot]) {
    // Together, as the parents: the children of one color initialise as one job.
    let Some(first) = parents.first() else {
        return;
    };
    crate::comm::abort_raw_together(
        first.api(),
        parents
            .iter()
            .map(|parent| &**parent.context())
            .zip(slots.iter().map(HandleSlot::get)),
    );
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case::none_and_some(&[(None, 0), (Some(3), 1)], Some(vec![(sys::NCCL_SPLIT_NOCOLOR, 0), (3, 1)]))]
    #[case::color_too_big(&[(Some(u32::MAX), 0)], None)]
    #[case::key_too_big(&[(Some(0), 1 << 31)], None)]
    fn colors_and_keys_become_c_ints_or_a_typed_error(
        #[case] splits: &[(Option<u32>, u32)],
        #[case] want: Option<Vec<(c_int, c_int)>>,
    ) {
        match (to_nccl(splits, "test"), want) {
            (Ok(got), Some(want)) => assert_eq!(got, want),
            (Err(CollectiveError::InvalidArgument { .. }), None) => {}
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }
}
