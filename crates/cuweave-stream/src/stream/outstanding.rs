//! [`OutstandingWork`]: how many operations queued on a stream the GPU has not finished, known
//! from markers (events) recorded behind them, not from a count of calls.
//!
//! The logic is generic over the marker so that it is tested without a GPU; the stream uses
//! disable-timing events of its context's [`EventPool`](cuweave_driver::EventPool), which go
//! back to the pool once the GPU has passed them (no spare list here).

use std::collections::VecDeque;

use parking_lot::Mutex;

/// Most markers kept per stream; past this the newest marker is re-recorded to cover the new
/// work too, so a stream that is fed far ahead of the GPU costs bounded memory.
pub(crate) const MAX_MARKERS: usize = 256;

/// Markers kept before a submission looks for finished ones to drop (a binary search: markers
/// finish in stream order), so a stream whose owner never asks for its outstanding work holds
/// about this many events while the GPU keeps up, not [`MAX_MARKERS`]. A search that finds none
/// finished doubles the mark (up to [`MAX_MARKERS`]) and skips as many submissions before the
/// next, so a stream far ahead of the GPU does not search on every submission.
pub(crate) const PRUNE_AT: usize = 32;

/// Markers behind queued work, oldest first, each with the number of operations it covers.
#[derive(Debug)]
pub(crate) struct OutstandingWork<M> {
    inner: Mutex<Inner<M>>,
}

#[derive(Debug)]
struct Inner<M> {
    pending: VecDeque<(M, u64)>,
    /// How many markers a submission lets wait before it looks for finished ones.
    prune_at: usize,
    /// Submissions left before the next look, after one that found nothing finished.
    calm: usize,
}

impl<M> Default for OutstandingWork<M> {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                pending: VecDeque::new(),
                prune_at: PRUNE_AT,
                calm: 0,
            }),
        }
    }
}

impl<M> Inner<M> {
    /// Drops the finished markers (a prefix: they finish in stream order), found by binary
    /// search with `is_done` (`Some(false)` also for a query that failed); moves the mark.
    ///
    /// A query that may not be made now (`None`: a capture is active or beginning) ends the
    /// search with nothing dropped and the mark left where it is: finding nothing *finished*
    /// backs the searches off (the GPU is behind), finding nothing *asked* must not, or the
    /// markers piled up during a long capture would wait out the back-off after it ends. The
    /// next search is put off by [`PRUNE_AT`] submissions, so a stream fed during a capture
    /// does not try on every one.
    fn prune(&mut self, is_done: impl Fn(&M) -> Option<bool>) {
        let (mut finished, mut unfinished) = (0, self.pending.len());
        while finished < unfinished {
            let middle = finished + (unfinished - finished) / 2;
            match is_done(&self.pending[middle].0) {
                Some(true) => finished = middle + 1,
                Some(false) => unfinished = middle,
                None => {
                    self.calm = PRUNE_AT;
                    return;
                }
            }
        }
        self.pending.drain(..finished);
        if finished == 0 {
            self.prune_at = (self.prune_at * 2).min(MAX_MARKERS);
            self.calm = self.prune_at;
        } else {
            self.prune_at = PRUNE_AT.max(self.pending.len() * 2);
        }
    }
}

impl<M> OutstandingWork<M> {
    /// Notes `ops` operations just queued: records a marker from `make` behind them with
    /// `record`. Past [`PRUNE_AT`] markers the finished ones are dropped first, found with
    /// `is_done` (which answers `None` for what it may not ask now, e.g. while a capture
    /// forbids queries: the search then stops, dropping nothing). Past [`MAX_MARKERS`]
    /// the newest marker is re-recorded instead (stream order makes it cover everything it
    /// covered before as well).
    pub(crate) fn submitted<E>(
        &self,
        ops: u64,
        make: impl FnOnce() -> Result<M, E>,
        record: impl Fn(&M) -> Result<(), E>,
        is_done: impl Fn(&M) -> Option<bool>,
    ) -> Result<(), E> {
        let mut inner = self.inner.lock();
        if inner.calm > 0 {
            inner.calm -= 1;
        } else if inner.pending.len() >= inner.prune_at {
            inner.prune(is_done);
        }
        if inner.pending.len() >= MAX_MARKERS
            && let Some((marker, covered)) = inner.pending.back_mut()
        {
            record(marker)?;
            *covered += ops;
            return Ok(());
        }
        let marker = make()?;
        record(&marker)?;
        inner.pending.push_back((marker, ops));
        Ok(())
    }

    /// Operations whose markers `is_done` does not report finished. Finished markers (a prefix,
    /// by stream order) are dropped (a pooled event goes back to its pool); the first
    /// unfinished one ends the scan.
    pub(crate) fn outstanding<E>(&self, is_done: impl Fn(&M) -> Result<bool, E>) -> Result<u64, E> {
        let mut inner = self.inner.lock();
        while let Some((front, _)) = inner.pending.front() {
            if !is_done(front)? {
                break;
            }
            inner.pending.pop_front();
        }
        Ok(inner.pending.iter().map(|(_, ops)| ops).sum())
    }

    /// Markers currently waiting (for tests and diagnostics).
    #[cfg(test)]
    pub(crate) fn markers(&self) -> usize {
        self.inner.lock().pending.len()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::convert::Infallible;

    use super::*;

    /// A fake marker: "done" once the test's clock (a counter it advances) has passed the value
    /// recorded in it.
    #[derive(Debug, Default)]
    struct Marker(Cell<u64>);

    /// Nothing found finished at submission (the GPU is behind).
    const NEVER_DONE: fn(&Marker) -> Option<bool> = |_| Some(false);

    /// A stream whose owner never asks for its outstanding work, with the GPU keeping up to
    /// within `lag` submissions: the markers held stay near `PRUNE_AT` (each search drops the
    /// finished prefix, with a handful of queries), not `MAX_MARKERS`; the count of
    /// outstanding operations stays exact; with the GPU stopped, the searches back off and
    /// the bound still holds.
    #[test]
    fn finished_markers_are_dropped_at_submission_with_few_queries() {
        let work = OutstandingWork::<Marker>::default();
        let submitted = Cell::new(0u64);
        let queries = Cell::new(0u64);
        let lag = Cell::new(5u64);
        let submit = || {
            submitted.set(submitted.get() + 1);
            let done_up_to = submitted.get().saturating_sub(lag.get());
            work.submitted::<Infallible>(
                1,
                || Ok(Marker::default()),
                |marker| {
                    marker.0.set(submitted.get());
                    Ok(())
                },
                |marker: &Marker| {
                    queries.set(queries.get() + 1);
                    Some(marker.0.get() <= done_up_to)
                },
            )
            .unwrap();
        };
        for _ in 0..10_000 {
            submit();
            assert!(work.markers() <= PRUNE_AT + 1, "{}", work.markers());
        }
        assert!(
            queries.get() < 10_000 / 4,
            "{} queries for 10,000 submissions",
            queries.get()
        );
        let done_up_to = submitted.get() - lag.get();
        assert_eq!(
            work.outstanding::<Infallible>(|marker| Ok(marker.0.get() <= done_up_to))
                .unwrap(),
            lag.get()
        );
        // The GPU stops: nothing finishes; the marks back off and the bound holds.
        lag.set(u64::MAX);
        queries.set(0);
        for _ in 0..2_000 {
            submit();
            assert!(work.markers() <= MAX_MARKERS);
        }
        assert!(
            queries.get() < 200,
            "{} queries while stopped",
            queries.get()
        );
        assert_eq!(
            work.outstanding::<Infallible>(|_| Ok(false)).unwrap(),
            lag_total(&work)
        );
    }

    fn lag_total(work: &OutstandingWork<Marker>) -> u64 {
        work.inner.lock().pending.iter().map(|(_, ops)| ops).sum()
    }

    #[test]
    fn outstanding_counts_only_unfinished_work_and_drops_finished_markers() {
        let work = OutstandingWork::<Marker>::default();
        let submitted = Cell::new(0u64);
        let made = Cell::new(0);
        let submit = |ops: u64| {
            submitted.set(submitted.get() + 1);
            work.submitted::<Infallible>(
                ops,
                || {
                    made.set(made.get() + 1);
                    Ok(Marker::default())
                },
                |marker| {
                    marker.0.set(submitted.get());
                    Ok(())
                },
                NEVER_DONE,
            )
            .unwrap();
        };
        submit(1);
        submit(2);
        submit(3);
        // The GPU has finished the work behind the first two markers.
        let done_up_to = 2;
        let outstanding = work
            .outstanding::<Infallible>(|marker| Ok(marker.0.get() <= done_up_to))
            .unwrap();
        assert_eq!(outstanding, 3);
        assert_eq!(work.markers(), 1);
        submit(4);
        assert_eq!(made.get(), 4);
        let all_done = work.outstanding::<Infallible>(|_| Ok(true)).unwrap();
        assert_eq!(all_done, 0);
    }

    /// A stream fed through a long capture elsewhere (every query skipped), then with the GPU
    /// keeping up: the skipped searches neither drop markers nor back the searches off, and
    /// are not retried on every submission; within `PRUNE_AT` submissions after the capture the
    /// piled-up finished markers are dropped.
    #[test]
    fn skipped_searches_do_not_back_off_so_markers_piled_up_in_a_capture_drop_after_it() {
        let work = OutstandingWork::<Marker>::default();
        let submitted = Cell::new(0u64);
        let queries = Cell::new(0u64);
        let capturing = Cell::new(true);
        let submit = || {
            submitted.set(submitted.get() + 1);
            work.submitted::<Infallible>(
                1,
                || Ok(Marker::default()),
                |marker| {
                    marker.0.set(submitted.get());
                    Ok(())
                },
                |marker: &Marker| {
                    queries.set(queries.get() + 1);
                    (!capturing.get()).then(|| marker.0.get() < submitted.get())
                },
            )
            .unwrap();
        };
        for _ in 0..1_000 {
            submit();
        }
        assert_eq!(
            work.markers(),
            MAX_MARKERS,
            "nothing dropped while queries are skipped"
        );
        assert!(
            queries.get() <= 1_000 / PRUNE_AT as u64 + 1,
            "{} skipped queries for 1,000 submissions",
            queries.get()
        );
        capturing.set(false);
        for _ in 0..=PRUNE_AT {
            submit();
        }
        assert!(
            work.markers() <= PRUNE_AT,
            "{} markers held {} submissions after the capture",
            work.markers(),
            PRUNE_AT + 1
        );
        // Only the newest marker's work is unfinished (the fake GPU is one submission behind).
        assert_eq!(
            work.outstanding::<Infallible>(|marker| Ok(marker.0.get() < submitted.get()))
                .unwrap(),
            1
        );
    }

    /// A search whose queries are skipped partway (a capture begins during it, after some
    /// markers were found finished) drops nothing and leaves the mark where it was; the next
    /// search, `PRUNE_AT` submissions on, drops the finished prefix as usual, and the count of
    /// outstanding operations stays exact throughout.
    #[test]
    fn a_search_skipped_partway_drops_nothing_and_the_next_one_drops_the_prefix() {
        let work = OutstandingWork::<Marker>::default();
        let submitted = Cell::new(0u64);
        // Queries answered before the skips begin (`u64::MAX`: never skipped).
        let answered = Cell::new(u64::MAX);
        let submit = || {
            submitted.set(submitted.get() + 1);
            work.submitted::<Infallible>(
                1,
                || Ok(Marker::default()),
                |marker| {
                    marker.0.set(submitted.get());
                    Ok(())
                },
                |marker: &Marker| {
                    let left = answered.get();
                    if left == 0 {
                        return None;
                    }
                    answered.set(left.saturating_sub(1));
                    // The fake GPU is two submissions behind.
                    Some(marker.0.get() + 2 <= submitted.get())
                },
            )
            .unwrap();
        };
        answered.set(0);
        for _ in 0..PRUNE_AT {
            submit();
        }
        assert_eq!(work.markers(), PRUNE_AT, "no search before the mark");
        // The search at the mark answers one query (the middle marker: finished), then skips.
        answered.set(1);
        submit();
        assert_eq!(answered.get(), 0, "one query answered, then the skip");
        assert_eq!(
            work.markers(),
            PRUNE_AT + 1,
            "nothing dropped by a skipped search"
        );
        // The skipped search puts the next off by `PRUNE_AT` submissions, no more.
        answered.set(u64::MAX);
        for _ in 0..PRUNE_AT {
            submit();
        }
        assert_eq!(work.markers(), 2 * PRUNE_AT + 1, "no search while put off");
        submit();
        // Held: the one behind the newest finished and the one just recorded.
        assert_eq!(
            work.markers(),
            2,
            "the next search drops every finished marker (the mark did not back off)"
        );
        let outstanding = work
            .outstanding::<Infallible>(|marker| Ok(marker.0.get() + 2 <= submitted.get()))
            .unwrap();
        assert_eq!(outstanding, 2);
    }

    #[test]
    fn markers_stay_bounded_by_rerecording_the_newest() {
        let work = OutstandingWork::<Marker>::default();
        for _ in 0..MAX_MARKERS + 10 {
            work.submitted::<Infallible>(1, || Ok(Marker::default()), |_| Ok(()), NEVER_DONE)
                .unwrap();
        }
        assert_eq!(work.markers(), MAX_MARKERS);
        let outstanding = work.outstanding::<Infallible>(|_| Ok(false)).unwrap();
        assert_eq!(outstanding, (MAX_MARKERS + 10) as u64);
    }

    #[test]
    fn a_failed_record_keeps_nothing_pending() {
        let work = OutstandingWork::<Marker>::default();
        let result = work.submitted(
            1,
            || Ok(Marker::default()),
            |_| Err("record failed"),
            NEVER_DONE,
        );
        assert_eq!(result, Err("record failed"));
        assert_eq!(work.outstanding::<Infallible>(|_| Ok(false)).unwrap(), 0);
    }
}
