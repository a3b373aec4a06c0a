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
//! moves the count.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

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
        let _shared = self.gate.read();
        self.launches.fetch_add(1, Ordering::AcqRel);
        enqueue()
    }

    /// The count now, with every launch it includes enqueued (the exclusive gate waits for
    /// launches between their count and the end of their enqueue).
    pub(crate) fn settled_count(&self) -> LaunchMark {
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
pub(crate) static LAUNCHES: LaunchLedger = LaunchLedger::new();

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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

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

    /// A mark taken while a launch sits between its count and the end of its enqueue waits for
    /// that enqueue: the wait it is paired with then covers the launch.
    #[test]
    fn a_mark_waits_for_a_launch_that_has_counted_itself_but_not_yet_enqueued() {
        let ledger = Arc::new(LaunchLedger::new());
        let enqueued = Arc::new(AtomicBool::new(false));
        let (counted_tx, counted_rx) = std::sync::mpsc::sync_channel::<()>(0);
        let launcher = {
            let ledger = Arc::clone(&ledger);
            let enqueued = Arc::clone(&enqueued);
            std::thread::spawn(move || {
                ledger.launch(|| {
                    counted_tx.send(()).unwrap();
                    std::thread::sleep(Duration::from_millis(50));
                    enqueued.store(true, Ordering::SeqCst);
                });
            })
        };
        counted_rx.recv().unwrap();
        let mark = ledger
            .synchronize(|| {
                assert!(
                    enqueued.load(Ordering::SeqCst),
                    "the wait began before a counted launch was enqueued"
                );
                Ok::<(), ()>(())
            })
            .unwrap();
        assert_eq!(mark.launches(), 1);
        launcher.join().unwrap();
        assert!(!ledger.launched_since(mark));
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
