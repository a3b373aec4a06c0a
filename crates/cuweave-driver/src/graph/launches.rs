//! The process's graph launches, counted, so that host access to memory a graph may use can
//! tell whether a launch may still be running.
//!
//! A graph launch records no use on the buffers its nodes read and write (their trackers saw
//! the capture, not the launches), so a host borrow of pinned or managed memory that a graph
//! copies into could otherwise overlap a replay. The memory layer instead waits for the whole
//! context ([`synchronize_launches`]) and remembers the [`LaunchMark`] it waited up to: until the
//! count moves past that mark ([`launched_since`]), no launch can have begun since, and the host
//! may use the memory without another wait.
//!
//! The protocol holds no CUDA: [`LaunchLedger`] takes the enqueue and the wait as closures, so
//! its ordering is tested on its own. A launch counts itself *before* it enqueues, under a shared
//! gate; a synchronisation reads the count under the exclusive gate, so every launch that count
//! includes has been enqueued when the context synchronisation starts, and one that begins later
//! moves the count. That ordering is model-checked with loom (`loom_tests`).

// loom's types only in the driver's own test build under `--cfg loom` (as `owner_slot`).
#[cfg(all(loom, test))]
use loom::sync::{
    RwLock,
    atomic::{AtomicU64, Ordering},
};
#[cfg(not(all(loom, test)))]
use parking_lot::RwLock;
#[cfg(not(all(loom, test)))]
use std::sync::atomic::{AtomicU64, Ordering};

/// A point in the process's sequence of graph launches: every launch counted up to it had
/// finished when it was taken by [`synchronize_launches`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LaunchMark(u64);

impl LaunchMark {
    /// The number of launches the mark covers.
    pub fn launches(self) -> u64 {
        self.0
    }
}

/// Counts launches and takes marks (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct LaunchLedger {
    /// Held shared by each launch across its count and its enqueue; exclusively, for a moment,
    /// by a mark.
    gate: RwLock<()>,
    /// Launches begun (counted before their enqueue).
    launches: AtomicU64,
}

impl LaunchLedger {
    #[cfg(not(all(loom, test)))]
    pub(crate) const fn new() -> Self {
        Self {
            gate: RwLock::new(()),
            launches: AtomicU64::new(0),
        }
    }

    /// Counts a launch, then runs `enqueue` (the driver call), both under the shared gate. A
    /// failed enqueue stays counted: that costs a later host access one needless wait, never a
    /// missed one.
    #[inline]
    pub(crate) fn launch<R>(&self, enqueue: impl FnOnce() -> R) -> R {
        #[cfg(all(loom, test))]
        let _shared = self.gate.read().expect("the gate guards no data to poison");
        #[cfg(not(all(loom, test)))]
        let _shared = self.gate.read();
        self.launches.fetch_add(1, Ordering::AcqRel);
        enqueue()
    }

    /// The count now, with every launch it includes enqueued (the exclusive gate waits for
    /// launches between their count and the end of their enqueue).
    pub(crate) fn settled_count(&self) -> LaunchMark {
        #[cfg(all(loom, test))]
        let _exclusive = self
            .gate
            .write()
            .expect("the gate guards no data to poison");
        #[cfg(not(all(loom, test)))]
        let _exclusive = self.gate.write();
        LaunchMark(self.launches.load(Ordering::Acquire))
    }

    /// Takes the settled count, then runs `wait` (which waits for every launch enqueued so
    /// far): the mark it returns is covered by that wait.
    pub(crate) fn synchronize<E>(
        &self,
        wait: impl FnOnce() -> Result<(), E>,
    ) -> Result<LaunchMark, E> {
        let mark = self.settled_count();
        wait()?;
        Ok(mark)
    }

    /// Whether a launch has begun since `mark` was taken.
    #[inline]
    pub(crate) fn launched_since(&self, mark: LaunchMark) -> bool {
        self.launches.load(Ordering::Acquire) != mark.0
    }
}

/// The ledger of every [`GraphExec::launch`](super::GraphExec::launch) in the process.
#[cfg(not(all(loom, test)))]
pub(crate) static LAUNCHES: LaunchLedger = LaunchLedger::new();
/// Under loom (whose types have no `const` constructor) made on first use, which no loom model
/// reaches: the models build their own ledgers.
#[cfg(all(loom, test))]
pub(crate) static LAUNCHES: std::sync::LazyLock<LaunchLedger> =
    std::sync::LazyLock::new(LaunchLedger::default);

/// Blocks until every graph launch made so far through cuweave in `context` (and all other work
/// queued in it) has finished, and returns the mark that wait covers.
///
/// # Errors
/// As [`Context::synchronize`](crate::Context::synchronize): `GraphError::Capturing` while a
/// capture is active (a context synchronisation would wait on the capturing streams), the
/// driver's error otherwise.
pub fn synchronize_launches(context: &crate::Context) -> crate::Result<LaunchMark> {
    LAUNCHES.synchronize(|| context.synchronize())
}

/// Whether a graph was launched through cuweave, anywhere in the process, since `mark` was
/// taken by [`synchronize_launches`]. One atomic load.
#[inline]
pub fn launched_since(mark: LaunchMark) -> bool {
    LAUNCHES.launched_since(mark)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_mark_covers_the_launches_before_it_and_a_later_launch_moves_past_it() {
        let ledger = LaunchLedger::new();
        let mut waits = 0;
        let before = ledger
            .synchronize(|| {
                waits += 1;
                Ok::<(), ()>(())
            })
            .unwrap();
        assert_eq!(before.launches(), 0);
        assert!(!ledger.launched_since(before));
        assert_eq!(ledger.launch(|| 7), 7);
        assert!(ledger.launched_since(before));
        let after = ledger.synchronize(|| Ok::<(), ()>(())).unwrap();
        assert_eq!(after.launches(), 1);
        assert!(!ledger.launched_since(after));
        assert_eq!(waits, 1);
    }

    #[test]
    fn a_failed_wait_gives_no_mark() {
        let ledger = LaunchLedger::new();
        ledger.launch(|| ());
        assert_eq!(ledger.synchronize(|| Err("capturing")), Err("capturing"));
    }

    #[test]
    fn a_failed_enqueue_stays_counted() {
        let ledger = LaunchLedger::new();
        let mark = ledger.synchronize(|| Ok::<(), ()>(())).unwrap();
        let result: Result<(), &str> = ledger.launch(|| Err("invalid stream"));
        assert!(result.is_err());
        assert!(
            ledger.launched_since(mark),
            "one needless wait, never a missed one"
        );
    }

    #[test]
    fn many_launches_and_marks_from_several_threads_leave_the_last_mark_exact() {
        let ledger = Arc::new(LaunchLedger::new());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let ledger = Arc::clone(&ledger);
                std::thread::spawn(move || {
                    for i in 0..10_000u32 {
                        ledger.launch(|| ());
                        if i % 100 == 0 {
                            let mark = ledger.synchronize(|| Ok::<(), ()>(())).unwrap();
                            assert!(mark.launches() > u64::from(i));
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let mark = ledger.synchronize(|| Ok::<(), ()>(())).unwrap();
        assert_eq!(mark.launches(), 40_000);
        assert!(!ledger.launched_since(mark));
    }
}

/// Loom models of the ledger: every interleaving of a launch (count, then enqueue) with a mark
/// and its wait is explored.
///
/// Run with `RUSTFLAGS="--cfg loom" cargo test -p cuweave-driver --release --lib loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicBool, Ordering};
    use loom::thread;

    use super::LaunchLedger;

    /// A mark that counts a launch is taken only once that launch has been enqueued, so the
    /// wait paired with it covers the launch; a mark that does not count it sees it later.
    #[test]
    fn loom_a_mark_covers_every_launch_it_counts_and_misses_none_it_does_not() {
        loom::model(|| {
            let ledger = Arc::new(LaunchLedger::default());
            let enqueued = Arc::new(AtomicBool::new(false));
            let launcher = {
                let (ledger, enqueued) = (Arc::clone(&ledger), Arc::clone(&enqueued));
                thread::spawn(move || ledger.launch(|| enqueued.store(true, Ordering::Relaxed)))
            };
            let mut enqueued_at_wait = false;
            let mark = ledger
                .synchronize(|| {
                    enqueued_at_wait = enqueued.load(Ordering::Relaxed);
                    Ok::<(), ()>(())
                })
                .unwrap();
            if mark.launches() == 1 {
                assert!(
                    enqueued_at_wait,
                    "the wait began before a counted launch was enqueued"
                );
            }
            launcher.join().unwrap();
            assert_eq!(
                ledger.launched_since(mark),
                mark.launches() == 0,
                "a launch the mark did not count went unseen"
            );
        });
    }
}
