//! The waits between streams that let one use another's allocations:
//! [`StreamOrderedAllocator::add_stream_dependency`] records them (one per pair of streams, the
//! latest), [`StreamOrderedAllocator::dependencies_satisfied`] says whether the GPU is past them,
//! and finished ones are forgotten.

use std::sync::Arc;

use cuweave_driver::OwnedPooledEvent;

use super::StreamOrderedAllocator;
use crate::error::{Result, StreamError, ensure_device};
use crate::stream::PriorityStream;

/// The latest point-in-time wait of `dependent` on `prerequisite`: a later one on the same
/// pair finishes after it (stream order), so one per pair is all that is kept.
#[derive(Debug)]
pub(super) struct Dependency {
    dependent: u64,
    prerequisite: u64,
    event: OwnedPooledEvent,
}

impl StreamOrderedAllocator {
    /// Makes `dependent` wait on the device for the work queued on `prerequisite` so far, and
    /// lets it use every allocation `prerequisite` may use now (those it owns and those it was
    /// given). The wait is noted on `dependent`
    /// ([`has_pending_waits`](PriorityStream::has_pending_waits)), so a pool does not hand it out
    /// as idle while it is held.
    ///
    /// While `prerequisite` is capturing, the wait is recorded into the graph (an edge, which
    /// forks `dependent` into the capture) and is not one that
    /// [`dependencies_satisfied`](Self::dependencies_satisfied) tracks: nothing runs until the
    /// graph is launched.
    ///
    /// # Errors
    /// [`StreamError::WrongDevice`] for streams of different devices (the memory is one
    /// device's); [`StreamError::SelfDependency`] for a stream and itself;
    /// [`GraphError::Capturing`], before anything is queued, when `dependent` captures and
    /// `prerequisite` is not in its capture (the driver would invalidate the capture); the
    /// driver's error.
    ///
    /// [`GraphError::Capturing`]: cuweave_driver::graph::GraphError::Capturing
    pub fn add_stream_dependency(
        &self,
        dependent: &Arc<PriorityStream>,
        prerequisite: &Arc<PriorityStream>,
    ) -> Result<()> {
        const OPERATION: &str = "StreamOrderedAllocator::add_stream_dependency";
        ensure_device(
            OPERATION,
            prerequisite.device().ordinal(),
            dependent.device().ordinal(),
        )?;
        if dependent.id() == prerequisite.id() {
            return Err(StreamError::SelfDependency {
                operation: OPERATION,
                stream: dependent.id(),
            });
        }
        crate::capture::refuse_wait_across_capture(
            dependent.stream(),
            prerequisite.stream(),
            OPERATION,
        )?;
        // Recorded into a capture, the wait is a graph edge: nothing runs that could be waited
        // for, and the event answers every later query with CUDA_ERROR_CAPTURED_EVENT.
        let captured = crate::capture::is_capturing(prerequisite.stream())?;
        let event = prerequisite.event_pool().acquire_owned(false)?;
        event.record(prerequisite.stream())?;
        dependent.stream().wait_event(&event)?;
        // Noted at once, as `wait_for` does: the wait holds `dependent` behind `prerequisite`'s
        // work, so the pool's `Priority` and `LoadBalanced` strategies must not read it as idle
        // (even if the capture bookkeeping below fails, the wait stays queued).
        dependent.note_queued_wait();
        crate::capture::note_wait_joined_capture(dependent.stream())?;
        let (pre, dep) = (prerequisite.id(), dependent.id());
        for entry in self.entries.lock().values_mut() {
            let usable = entry.owner.id() == pre || entry.users.iter().any(|user| user.id() == pre);
            if usable && entry.owner.id() != dep && !entry.users.iter().any(|user| user.id() == dep)
            {
                entry.users.push(Arc::clone(dependent));
            }
        }
        {
            let mut dependencies = self.dependencies.lock();
            // Finished waits are forgotten, as housekeeping: when a query fails (refused on a
            // capturing thread) the waits from there on are kept, for `dependencies_satisfied`
            // to report. The wait above is queued either way, so this call succeeds.
            let pruned = retain_pending(&mut dependencies, |dependency| {
                Ok(dependency.event.query()?)
            });
            if let Err(error) = pruned {
                tracing::debug!(%error, "stream-ordered allocator: finished waits not pruned");
            }
            if !captured {
                // The new wait is queued behind the earlier one of this pair (same streams, a
                // later point of `prerequisite`), so that one is forgotten (its event goes back
                // to the pool): the list holds at most one wait per pair of streams. A captured
                // wait replaces nothing: it is a graph edge, and the earlier eager wait still
                // holds `dependent` back.
                dependencies.retain(|dependency| {
                    dependency.dependent != dep || dependency.prerequisite != pre
                });
                dependencies.push(Dependency {
                    dependent: dep,
                    prerequisite: pre,
                    event,
                });
            }
        }
        self.with_stats(|stats| stats.dependencies += 1);
        Ok(())
    }

    /// Whether the GPU has passed every wait recorded for `dependent` so far, without blocking.
    /// Satisfied waits are forgotten.
    ///
    /// # Errors
    /// The driver's error from an event query ([`GraphError::Capturing`] on a thread that is
    /// capturing); every wait not known to be satisfied is then kept, so a later call still
    /// sees it.
    ///
    /// [`GraphError::Capturing`]: cuweave_driver::graph::GraphError::Capturing
    pub fn dependencies_satisfied(&self, dependent: &PriorityStream) -> Result<bool> {
        let mut dependencies = self.dependencies.lock();
        retain_pending(&mut dependencies, |dependency| {
            Ok(dependency.event.query()?)
        })?;
        Ok(!dependencies
            .iter()
            .any(|dependency| dependency.dependent == dependent.id()))
    }
}

/// Drops, in order, the entries `finished` says are done. At the first entry it cannot tell
/// about, it stops: that entry and every one after it are kept, and its error is returned.
fn retain_pending<D>(
    list: &mut Vec<D>,
    mut finished: impl FnMut(&D) -> Result<bool>,
) -> Result<()> {
    let mut failure = None;
    // `retain` visits every entry once, in order.
    list.retain(|entry| {
        if failure.is_some() {
            return true;
        }
        match finished(entry) {
            Ok(done) => !done,
            Err(error) => {
                failure = Some(error);
                true
            }
        }
    });
    failure.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use cuweave_driver::DriverError;
    use cuweave_driver::graph::GraphError;
    use rstest::rstest;

    use super::*;

    fn refused() -> StreamError {
        DriverError::from(GraphError::Capturing {
            operation: "Event::query",
            reason: "a test",
        })
        .into()
    }

    /// Entries are `(id, answer)`: `Some(done)` or `None` for a query that fails.
    #[rstest]
    #[case::all_answered(&[(1, Some(true)), (2, Some(false)), (3, Some(true))], &[2], false)]
    #[case::first_fails(&[(1, None), (2, Some(true)), (3, Some(false))], &[1, 2, 3], true)]
    #[case::middle_fails(&[(1, Some(true)), (2, None), (3, Some(true))], &[2, 3], true)]
    #[case::last_fails(&[(1, Some(false)), (2, Some(true)), (3, None)], &[1, 3], true)]
    #[case::empty(&[], &[], false)]
    fn a_failed_query_keeps_that_entry_and_every_later_one(
        #[case] entries: &[(u32, Option<bool>)],
        #[case] kept: &[u32],
        #[case] fails: bool,
    ) {
        let mut list = entries.to_vec();
        let mut asked = Vec::new();
        let result = retain_pending(&mut list, |&(id, answer)| {
            asked.push(id);
            answer.ok_or_else(refused)
        });
        assert_eq!(result.is_err(), fails);
        if fails {
            assert_eq!(result.unwrap_err(), refused());
            // Nothing after the failing entry was queried.
            let failed = entries.iter().position(|(_, a)| a.is_none()).unwrap();
            assert_eq!(asked.len(), failed + 1);
        }
        let ids: Vec<u32> = list.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, kept);
    }
}
