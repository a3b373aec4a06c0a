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
//!
//! **Host borrows.** A wait covers the launches made before it, not those made while the host
//! then reads or writes the memory. So a host borrow of memory that tracked captures used is
//! registered ([`HostBorrow::begin`]) under the exclusive gate, before its wait, and a launch of
//! a graph ended from one of those captures is refused ([`GraphError::HostBorrowed`]) until the
//! borrow ends: a launch that took the shared gate first was enqueued before the wait began and
//! is covered by it; one that takes it later sees the borrow. That ordering is model-checked
//! too.
//!
//! [`GraphError::HostBorrowed`]: super::GraphError::HostBorrowed

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

use super::fences::{LaunchesAfter, key_covers};

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
    /// Held shared by each launch across its borrow check, its count and its enqueue;
    /// exclusively, for a moment, by a mark and by a host borrow's start and end. It guards the
    /// live host borrows.
    gate: RwLock<Borrows>,
    /// Launches begun (counted before their enqueue).
    launches: AtomicU64,
}

/// The live host borrows: for each capture key (or [`ANY_CAPTURE`](super::fences::ANY_CAPTURE))
/// how many borrows name it.
/// Bounded by the borrows alive: a key leaves when its last borrow ends.
#[derive(Debug, Default)]
pub(crate) struct Borrows(Vec<(u64, usize)>);

impl Borrows {
    /// The capture whose launch a live borrow refuses, if any: `capture` itself, when a borrow
    /// names it or names every capture.
    fn refusing(&self, capture: u64) -> Option<u64> {
        self.0
            .iter()
            .any(|&(key, _)| key_covers(key, capture))
            .then_some(capture)
    }

    fn add(&mut self, keys: &[u64]) {
        for &key in keys {
            match self.0.iter_mut().find(|(held, _)| *held == key) {
                Some((_, count)) => *count += 1,
                None => self.0.push((key, 1)),
            }
        }
    }

    fn remove(&mut self, keys: &[u64]) {
        for &key in keys {
            if let Some(slot) = self.0.iter().position(|(held, _)| *held == key) {
                self.0[slot].1 -= 1;
                if self.0[slot].1 == 0 {
                    self.0.swap_remove(slot);
                }
            }
        }
    }

    /// How many capture keys live borrows name.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

/// A launch refused because a live host borrow names its capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Borrowed {
    /// The capture the graph was ended from.
    pub(crate) capture: u64,
}

impl LaunchLedger {
    #[cfg(not(all(loom, test)))]
    pub(crate) const fn new() -> Self {
        Self {
            gate: RwLock::new(Borrows(Vec::new())),
            launches: AtomicU64::new(0),
        }
    }

    #[cfg(all(loom, test))]
    fn shared(&self) -> loom::sync::RwLockReadGuard<'_, Borrows> {
        self.gate.read().expect("no holder of the gate panics")
    }

    #[cfg(not(all(loom, test)))]
    #[inline]
    fn shared(&self) -> parking_lot::RwLockReadGuard<'_, Borrows> {
        self.gate.read()
    }

    #[cfg(all(loom, test))]
    fn exclusive(&self) -> loom::sync::RwLockWriteGuard<'_, Borrows> {
        self.gate.write().expect("no holder of the gate panics")
    }

    #[cfg(not(all(loom, test)))]
    fn exclusive(&self) -> parking_lot::RwLockWriteGuard<'_, Borrows> {
        self.gate.write()
    }

    /// Counts a launch of a graph ended from tracked capture `capture` (`None`: untracked),
    /// then runs `enqueue` (the driver call), all under the shared gate; refused, uncounted and
    /// not enqueued, while a host borrow names the capture. A failed enqueue stays counted:
    /// that costs a later host access one needless wait, never a missed one.
    #[inline]
    pub(crate) fn launch<R>(
        &self,
        capture: Option<u64>,
        enqueue: impl FnOnce() -> R,
    ) -> Result<R, Borrowed> {
        let borrows = self.shared();
        if let Some(capture) = capture.and_then(|capture| borrows.refusing(capture)) {
            return Err(Borrowed { capture });
        }
        self.launches.fetch_add(1, Ordering::AcqRel);
        let enqueued = enqueue();
        drop(borrows);
        Ok(enqueued)
    }

    /// The count now, with every launch it includes enqueued (the exclusive gate waits for
    /// launches between their count and the end of their enqueue).
    pub(crate) fn settled_count(&self) -> LaunchMark {
        let _exclusive = self.exclusive();
        LaunchMark(self.launches.load(Ordering::Acquire))
    }

    /// Registers a host borrow under `keys` (capture ids, or
    /// [`ANY_CAPTURE`](super::fences::ANY_CAPTURE)): from its return,
    /// launches of those captures' graphs are refused until [`end_borrow`](Self::end_borrow).
    pub(crate) fn begin_borrow(&self, keys: &[u64]) {
        self.exclusive().add(keys);
    }

    /// Ends a borrow that [`begin_borrow`](Self::begin_borrow) registered under `keys`.
    pub(crate) fn end_borrow(&self, keys: &[u64]) {
        self.exclusive().remove(keys);
    }

    /// How many capture keys live host borrows name.
    pub(crate) fn borrowed_keys(&self) -> usize {
        self.shared().len()
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

/// A host borrow of memory that tracked captures used: while it lives, launches of graphs
/// ended from those captures are refused with
/// [`GraphError::HostBorrowed`](super::GraphError::HostBorrowed) (see the module docs).
/// The memory layer's host slices of pinned and managed buffers hold one; it ends on drop.
///
/// Begin it *before* the wait that makes the host access safe
/// ([`synchronize_launches`]): a launch that was not refused was then enqueued before that
/// wait began.
#[must_use = "the borrow ends when this is dropped"]
#[derive(Debug)]
pub struct HostBorrow {
    keys: Vec<u64>,
}

impl HostBorrow {
    /// Refuses launches of the graphs `conflicting` names until this is dropped: for a host
    /// read, the captures that wrote the memory; for a host write, those that used it.
    pub fn begin(conflicting: LaunchesAfter<'_>) -> Self {
        let keys = conflicting.keys().to_vec();
        LAUNCHES.begin_borrow(&keys);
        Self { keys }
    }
}

impl Drop for HostBorrow {
    fn drop(&mut self) {
        LAUNCHES.end_borrow(&self.keys);
    }
}

/// How many captures live host borrows name (for tests of the bound: a capture leaves when its
/// last borrow ends).
pub fn host_borrowed_captures() -> usize {
    LAUNCHES.borrowed_keys()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;

    use super::super::fences::ANY_CAPTURE;
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
        assert_eq!(ledger.launch(None, || 7), Ok(7));
        assert!(ledger.launched_since(before));
        let after = ledger.synchronize(|| Ok::<(), ()>(())).unwrap();
        assert_eq!(after.launches(), 1);
        assert!(!ledger.launched_since(after));
        assert_eq!(waits, 1);
    }

    #[test]
    fn a_failed_wait_gives_no_mark() {
        let ledger = LaunchLedger::new();
        ledger.launch(None, || ()).unwrap();
        assert_eq!(ledger.synchronize(|| Err("capturing")), Err("capturing"));
    }

    #[test]
    fn a_failed_enqueue_stays_counted() {
        let ledger = LaunchLedger::new();
        let mark = ledger.synchronize(|| Ok::<(), ()>(())).unwrap();
        let result: Result<(), &str> = ledger.launch(None, || Err("invalid stream")).unwrap();
        assert!(result.is_err());
        assert!(
            ledger.launched_since(mark),
            "one needless wait, never a missed one"
        );
    }

    #[test]
    fn a_host_borrow_refuses_only_its_captures_launches_until_it_ends() {
        let ledger = LaunchLedger::new();
        ledger.begin_borrow(&[3, 5]);
        ledger.begin_borrow(&[5]);
        assert_eq!(ledger.borrowed_keys(), 2);
        let before = ledger.settled_count();
        assert_eq!(ledger.launch(Some(3), || ()), Err(Borrowed { capture: 3 }));
        assert_eq!(ledger.launch(Some(5), || ()), Err(Borrowed { capture: 5 }));
        assert!(
            !ledger.launched_since(before),
            "a refused launch is neither counted nor enqueued"
        );
        assert_eq!(
            ledger.launch(Some(4), || 4),
            Ok(4),
            "another capture's graph"
        );
        assert_eq!(ledger.launch(None, || 0), Ok(0), "an untracked graph");
        ledger.end_borrow(&[3, 5]);
        assert_eq!(ledger.launch(Some(3), || 3), Ok(3));
        assert_eq!(
            ledger.launch(Some(5), || ()),
            Err(Borrowed { capture: 5 }),
            "the second borrow of 5 is still live"
        );
        ledger.end_borrow(&[5]);
        assert_eq!(ledger.launch(Some(5), || 5), Ok(5));
        assert_eq!(ledger.borrowed_keys(), 0, "ended borrows leave no key");
    }

    #[test]
    fn a_borrow_of_every_capture_refuses_every_tracked_launch_and_no_untracked_one() {
        let ledger = LaunchLedger::new();
        ledger.begin_borrow(&[ANY_CAPTURE]);
        assert_eq!(ledger.launch(Some(1), || ()), Err(Borrowed { capture: 1 }));
        assert_eq!(ledger.launch(Some(9), || ()), Err(Borrowed { capture: 9 }));
        assert_eq!(ledger.launch(None, || 2), Ok(2));
        ledger.end_borrow(&[ANY_CAPTURE]);
        assert_eq!(ledger.launch(Some(1), || 1), Ok(1));
    }

    #[test]
    fn a_million_borrows_keep_no_key_once_ended() {
        let ledger = LaunchLedger::new();
        for capture in 0..1_000_000u64 {
            ledger.begin_borrow(&[capture, capture / 2]);
            ledger.end_borrow(&[capture, capture / 2]);
        }
        assert_eq!(ledger.borrowed_keys(), 0);
    }

    #[test]
    fn many_launches_and_marks_from_several_threads_leave_the_last_mark_exact() {
        let ledger = Arc::new(LaunchLedger::new());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let ledger = Arc::clone(&ledger);
                std::thread::spawn(move || {
                    for i in 0..10_000u32 {
                        ledger.launch(Some(7), || ()).unwrap();
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

    use super::{LaunchLedger, LaunchMark};

    /// A thread launching a graph of `capture` once: whether the ledger let it, and the flag its
    /// enqueue sets.
    fn launcher(
        ledger: &Arc<LaunchLedger>,
        capture: Option<u64>,
    ) -> (thread::JoinHandle<bool>, Arc<AtomicBool>) {
        let enqueued = Arc::new(AtomicBool::new(false));
        let handle = {
            let (ledger, enqueued) = (Arc::clone(ledger), Arc::clone(&enqueued));
            thread::spawn(move || {
                ledger
                    .launch(capture, || enqueued.store(true, Ordering::Relaxed))
                    .is_ok()
            })
        };
        (handle, enqueued)
    }

    /// A mark and its wait, and whether the launch had been enqueued when the wait began.
    fn synchronize_noting(ledger: &LaunchLedger, enqueued: &AtomicBool) -> (LaunchMark, bool) {
        let mut enqueued_at_wait = false;
        let mark = ledger
            .synchronize(|| {
                enqueued_at_wait = enqueued.load(Ordering::Relaxed);
                Ok::<(), ()>(())
            })
            .unwrap();
        (mark, enqueued_at_wait)
    }

    /// A mark that counts a launch is taken only once that launch has been enqueued, so the
    /// wait paired with it covers the launch; a mark that does not count it sees it later.
    #[test]
    fn loom_a_mark_covers_every_launch_it_counts_and_misses_none_it_does_not() {
        loom::model(|| {
            let ledger = Arc::new(LaunchLedger::default());
            let (launcher, enqueued) = launcher(&ledger, None);
            let (mark, enqueued_at_wait) = synchronize_noting(&ledger, &enqueued);
            if mark.launches() == 1 {
                assert!(
                    enqueued_at_wait,
                    "the wait began before a counted launch was enqueued"
                );
            }
            assert!(
                launcher.join().unwrap(),
                "an untracked launch is never refused"
            );
            assert_eq!(
                ledger.launched_since(mark),
                mark.launches() == 0,
                "a launch the mark did not count went unseen"
            );
        });
    }

    /// A host borrow begun before its wait: a launch of the borrowed capture is either refused
    /// or was enqueued before the wait began (so the wait covers it). None runs while the host
    /// reads.
    #[test]
    fn loom_a_launch_never_runs_under_a_host_borrow() {
        loom::model(|| {
            let ledger = Arc::new(LaunchLedger::default());
            let (launcher, enqueued) = launcher(&ledger, Some(7));
            ledger.begin_borrow(&[7]);
            let (_, enqueued_at_wait) = synchronize_noting(&ledger, &enqueued);
            // The host reads here.
            let enqueued_while_borrowed = enqueued.load(Ordering::Relaxed) && !enqueued_at_wait;
            ledger.end_borrow(&[7]);
            let launched = launcher.join().unwrap();
            assert!(
                !enqueued_while_borrowed,
                "a launch was enqueued after the wait, while the host borrowed"
            );
            if launched {
                assert!(enqueued.load(Ordering::Relaxed));
            }
        });
    }
}
