//! Keeping a buffer's tracked uses bounded: the finished ones are dropped (found in a handful of
//! event queries), and the rest merged into one use when there are still more than
//! [`MAX_USES`](super::MAX_USES).

use std::sync::Arc;

use super::{ByteRange, CaptureView, Use, UseEvent, UseState, UseStream};

impl<E: UseEvent> UseState<E> {
    /// Makes `stream` wait for every use it is not ordered after, then records one event there
    /// that stands for all of them, as a write of their combined range.
    ///
    /// Only uses on the same side of capture as `stream` (`tag`: the capture it records into, or
    /// none) are merged: the others cannot be waited for from it, and stay until their capture
    /// ends (or, for eager uses seen from a capturing stream, until it ends) - a bound that holds
    /// again then.
    pub(super) fn merge_on<S: UseStream<Event = E>>(
        &mut self,
        stream: &S,
        identity: Option<u64>,
        tag: Option<u64>,
    ) {
        let same_side = |used: &Use<E>| used.capture == tag;
        let (mut all, other_writes): (Vec<Use<E>>, Vec<Use<E>>) =
            self.writes.drain(..).partition(same_side);
        let (same_reads, other_reads): (Vec<Use<E>>, Vec<Use<E>>) =
            self.reads.drain(..).partition(same_side);
        all.extend(same_reads);
        self.writes = other_writes;
        self.reads = other_reads;
        let mut hull: Option<ByteRange> = None;
        let mut waited = Ok(());
        for used in &all {
            hull = Some(hull.map_or(used.range, |h| h.hull(used.range)));
            if waited.is_ok() && !used.covers(identity) {
                waited = stream.wait_for(&used.event);
            }
        }
        let Some(range) = hull else { return };
        let (first_epoch, first_seq) = all.first().map_or((0, 0), |first| (first.epoch, first.seq));
        self.records += 1;
        let seq = self.records;
        let mut uses = all.into_iter();
        let merged = uses.next().map(|first| first.event);
        let recorded = match (&waited, &merged) {
            (Ok(()), Some(event)) => stream.record(event),
            (Err(_), _) | (_, None) => Err(crate::MemoryError::ZeroLength {
                operation: "merge of tracked uses",
            }),
        };
        match (recorded, merged) {
            (Ok(()), Some(event)) => {
                // The merged uses' other events go back.
                drop(uses);
                self.writes.push(Use {
                    event,
                    stream: identity,
                    slot: None,
                    range,
                    epoch: stream.capture_epoch(),
                    capture: tag,
                    seq,
                });
            }
            (_, merged) => {
                // Could not merge: keep every use as it was (the bound is exceeded until the
                // next record succeeds, never a use forgotten).
                tracing::warn!("merging a buffer's tracked uses failed; keeping them all");
                let mut rest: Vec<Use<E>> = uses.collect();
                if let Some(event) = merged {
                    rest.push(Use {
                        event,
                        stream: None,
                        slot: None,
                        range,
                        epoch: first_epoch,
                        capture: tag,
                        seq: first_seq,
                    });
                }
                self.writes.extend(rest);
            }
        }
    }

    /// Drops the uses whose events have completed (nothing need wait for them); a use whose
    /// event cannot be queried is kept. Queries nothing while any capture is active, and no
    /// capture begins during the queries (a query of an event recorded before a capture can
    /// invalidate it, another thread's global-mode one too; one recorded in a capture fails).
    ///
    /// Events recorded on one stream complete in the order they were recorded, so the finished
    /// eager uses of a stream are its oldest ones: a binary search over them finds where they
    /// end in a handful of queries (a buffer written chunk after chunk on one stream holds up to
    /// [`MAX_USES`] of them, and querying each cost a poll of an async transfer 30-100 µs). Uses
    /// of the default streams (no identity) and captured ones are queried one by one.
    ///
    /// [`MAX_USES`]: super::MAX_USES
    pub(super) fn prune_finished(&mut self, view: &CaptureView) {
        if view.any_active {
            return;
        }
        // The view was read at the start of the operation: a capture may have begun since, and
        // one may begin between a check and a query. The queries run only while none is active
        // or beginning; otherwise nothing is pruned, as when the view saw one.
        let _ = cuweave_driver::graph::outside_captures(|| self.prune_finished_now());
    }

    /// The queries and retirement of [`prune_finished`](Self::prune_finished), run outside
    /// captures.
    fn prune_finished_now(&mut self) {
        let mut ordered: Vec<(u64, u64, &Arc<E>)> = self
            .writes
            .iter()
            .chain(&self.reads)
            .filter(|used| used.capture.is_none())
            .filter_map(|used| used.stream.map(|stream| (stream, used.seq, &used.event)))
            .collect();
        ordered.sort_unstable_by_key(|&(stream, seq, _)| (stream, seq));
        // Per stream, the `seq` of its newest use known to have finished.
        let mut finished_through: Vec<(u64, u64)> = Vec::new();
        for uses in ordered.chunk_by(|a, b| a.0 == b.0) {
            // A failed query counts as not finished: fewer uses dropped, never one too many.
            let done = |used: &(u64, u64, &Arc<E>)| matches!(used.2.is_complete(), Ok(true));
            let newest = uses.len() - 1;
            // The newest first (a stream that has caught up costs one query), else a binary
            // search of the others for where the finished ones end.
            let finished = if done(&uses[newest]) {
                uses.len()
            } else {
                uses[..newest].partition_point(done)
            };
            if let Some(last) = finished.checked_sub(1) {
                finished_through.push((uses[last].0, uses[last].1));
            }
        }
        let finished = |used: &Use<E>| match (used.capture, used.stream) {
            (None, Some(stream)) => finished_through
                .iter()
                .any(|&(done, seq)| done == stream && used.seq <= seq),
            _ => matches!(used.event.is_complete(), Ok(true)),
        };
        self.reads.retain(|used| !finished(used));
        self.writes.retain(|used| !finished(used));
    }
}
