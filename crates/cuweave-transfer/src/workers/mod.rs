//! The staging workers: one persistent pool of host threads per process, sized from the machine,
//! that every pipelined transfer shares.
//!
//! A transfer never spawns a thread. Its calling thread takes part itself (it starts on the
//! first chunk at once) while it hands the other participants to the pool; a worker that wakes
//! late simply claims fewer chunks, because chunks are claimed from a shared counter rather than
//! dealt out in advance.
//!
//! Each worker runs one *resident* loop for the life of the process ([`residency`]): it takes
//! jobs from the pool's queues itself (rayon's `yield_now`), stays hot (spinning, looking for
//! the next transfer's jobs) for [`WARM`] after its own last job, and, if it took part in the
//! last transfer, until [`WARM`] after that transfer returned (the caller's wait for the copy
//! engine to drain counts as part of the transfer), and only then parks. So back-to-back
//! transfers (the mid-size tensors a training loop moves) find their workers running: handing a
//! participant out is a queue push with no futex call, and a hot worker takes it within a
//! microsecond or so. A pool idle for longer costs no CPU; a transfer that finds too few workers
//! awake wakes the others ([`Residency::handed_out`]).
//!
//! Borrowed host memory can be handed to the pool safely because [`Workers::run`] returns only
//! once every participant has finished (rayon's scoped spawns): the borrow outlives the work.
//! Work that must outlive its caller ([`Workers::spawn`]) owns everything it touches.

mod residency;

use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Result, TransferError};
use residency::Residency;

/// The most worker threads the pool starts, whatever the machine: beyond this the host's memory
/// bandwidth, not the thread count, limits staging.
pub const MAX_WORKERS: usize = 32;

/// How long workers stay hot (spinning, ready for the next transfer) after a transfer returns,
/// and after their own last job.
pub const WARM: Duration = Duration::from_micros(500);

/// The process's staging workers.
pub(crate) struct Workers {
    /// Nanoseconds after `epoch` until which the last run's workers stay hot.
    hot_until: AtomicU64,
    /// Runs handed out so far: the last one's workers stay hot in the hot time.
    runs: AtomicU64,
    epoch: Instant,
    /// When the workers look for work, park and are woken.
    residency: Residency,
    /// `None` when the operating system refused the threads: transfers then run on the caller.
    pool: Option<rayon::ThreadPool>,
    /// Pipelined transfers running now (those with more than one participant).
    active: AtomicUsize,
    threads: usize,
}

static WORKERS: OnceLock<Workers> = OnceLock::new();

thread_local! {
    /// On a worker: the run whose participant it last was.
    static LAST_RUN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Host threads the machine offers (logical CPUs this process may run on), read once:
/// `available_parallelism` reads the scheduler affinity and cgroup quota files on Linux, tens of
/// microseconds that a small transfer must not pay.
pub fn host_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(4, usize::from))
}

/// Whether the tuning switch `name` is set in the environment (to anything), read once into
/// `cell`: the staging pipeline's switches for measuring alternatives (see `docs/transfer.md`).
pub(crate) fn env_switch(cell: &'static OnceLock<bool>, name: &str) -> bool {
    *cell.get_or_init(|| std::env::var_os(name).is_some())
}

/// Whether transfers run their participants on threads spawned for the transfer (the design
/// before the pool: `CUWEAVE_STAGING_SPAWN` set) instead of the pool's workers; read once. A
/// tuning switch for comparing the two on a machine (see `docs/transfer.md`).
fn spawn_per_transfer() -> bool {
    static SPAWN: OnceLock<bool> = OnceLock::new();
    env_switch(&SPAWN, "CUWEAVE_STAGING_SPAWN")
}

/// Runs `work(0..participants)` with `work(0)` here and the others on threads spawned for this
/// call, returning the first error once all have finished.
fn spawned(participants: usize, work: &(impl Fn(usize) -> Result<()> + Sync)) -> Result<()> {
    std::thread::scope(|scope| {
        let others: Vec<_> = (1..participants)
            .map(|w| std::thread::Builder::new().spawn_scoped(scope, move || work(w)))
            .collect();
        let mut outcome = work(0);
        for other in others {
            let joined = match other {
                Ok(handle) => handle.join().unwrap_or(Err(TransferError::WorkerPanicked)),
                // No thread: the other participants claim its chunks.
                Err(_) => Ok(()),
            };
            outcome = outcome.and(joined);
        }
        outcome
    })
}

/// Waits, spinning on this thread for at most `most`, until the staging workers' hot time is up
/// and every one has parked; whether they did. For timing a copy apart from the transfers
/// before it, whose spinning workers would slow it: calibration does this before each short
/// candidate, and the transfer bench before each block of runs. Starts no workers.
pub fn wait_for_cold_workers(most: Duration) -> bool {
    WORKERS.get().is_none_or(|workers| workers.wait_cold(most))
}

/// `job`'s result, or [`TransferError::WorkerPanicked`] when it panics: for work on the staging
/// pool (a transfer's participants, the owned form's job), whose workers would abort the
/// process on a panic that escapes, and whose callers wait for an answer.
pub(crate) fn caught<V>(job: impl FnOnce() -> Result<V>) -> Result<V> {
    std::panic::catch_unwind(AssertUnwindSafe(job)).unwrap_or(Err(TransferError::WorkerPanicked))
}

/// The shared pool, started on first use with one worker per host thread but one (the caller
/// of a transfer is the last participant), at most [`MAX_WORKERS`].
pub(crate) fn shared() -> &'static Workers {
    let mut started = false;
    let workers = WORKERS.get_or_init(|| {
        started = true;
        let threads = host_threads().saturating_sub(1).clamp(1, MAX_WORKERS);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cuweave-staging-{i}"))
            .build()
            .inspect_err(|error| {
                tracing::warn!(%error, "no staging worker threads: pipelined copies run on the calling thread");
            })
            .ok();
        let threads = if pool.is_some() { threads } else { 0 };
        tracing::debug!(threads, "staging workers started");
        Workers {
            hot_until: AtomicU64::new(0),
            runs: AtomicU64::new(0),
            epoch: Instant::now(),
            residency: Residency::new(threads),
            active: AtomicUsize::new(0),
            pool,
            threads,
        }
    });
    if started && let Some(pool) = &workers.pool {
        // Once the pool is in its static home: every worker takes up its resident loop.
        pool.spawn_broadcast(move |_| workers.reside());
    }
    workers
}

impl Workers {
    /// The most participants one transfer can have: every worker and the caller.
    pub(crate) fn participants(&self) -> usize {
        self.threads + 1
    }

    /// Whether participant `w` of a running transfer should go on claiming chunks: concurrent
    /// transfers share the host threads (each gets `participants() / running transfers`, at
    /// least its caller), so two transfers at once do not run more copying threads than the
    /// machine has. A participant over its transfer's share stops after its chunk in hand (its
    /// chunks go to the others: they are claimed, not dealt). Off with `CUWEAVE_STAGING_NO_SHARE`
    /// (a tuning switch, read once).
    pub(crate) fn keeps(&self, w: usize) -> bool {
        static NO_SHARE: OnceLock<bool> = OnceLock::new();
        if w == 0 || env_switch(&NO_SHARE, "CUWEAVE_STAGING_NO_SHARE") {
            return true;
        }
        w < self.participants() / self.active.load(Ordering::Relaxed).max(1)
    }

    /// Runs `work(0..participants)`: `work(0)` on this thread, the others on pool workers, and
    /// returns once all have finished, with the first error (a panic becomes
    /// [`TransferError::WorkerPanicked`]).
    pub(crate) fn run(
        &'static self,
        participants: usize,
        work: impl Fn(usize) -> Result<()> + Sync,
    ) -> Result<()> {
        let participants = participants.clamp(1, self.participants());
        let guarded = |w: usize| caught(|| work(w));
        let Some(pool) = self.pool.as_ref().filter(|_| participants > 1) else {
            return guarded(0);
        };
        self.active.fetch_add(1, Ordering::Relaxed);
        let outcome = if spawn_per_transfer() {
            spawned(participants, &guarded)
        } else {
            self.run_on(pool, participants, &guarded)
        };
        self.active.fetch_sub(1, Ordering::Relaxed);
        outcome
    }

    fn run_on(
        &'static self,
        pool: &rayon::ThreadPool,
        participants: usize,
        guarded: &(impl Fn(usize) -> Result<()> + Sync),
    ) -> Result<()> {
        let first_error: Mutex<Option<TransferError>> = Mutex::new(None);
        let keep = |outcome: Result<()>| {
            if let Err(error) = outcome {
                first_error.lock().get_or_insert(error);
            }
        };
        // The run whose workers stay hot in the hot time: not one that runs beside another.
        let run = self.runs.fetch_add(1, Ordering::Relaxed) + 1;
        let run = if self.active.load(Ordering::Acquire) > 1 {
            0
        } else {
            run
        };
        // The caller queues the other participants (no rayon worker sleeps, so a push wakes
        // nobody), tells the residents, and starts its own part at once; hot residents take
        // the jobs from the queue, parked ones are woken as many as are short.
        let helpers = participants - 1;
        let started = AtomicUsize::new(0);
        pool.in_place_scope(|scope| {
            let (guarded, keep, started) = (&guarded, &keep, &started);
            for w in 1..participants {
                scope.spawn(move |_| {
                    let _busy = self.residency.busy();
                    // A resident may have taken this job before it saw the hand-out: wake for
                    // the others while they wait (`Residency::job_started`).
                    let now_started = started.fetch_add(1, Ordering::AcqRel) + 1;
                    self.residency.job_started(helpers - now_started);
                    LAST_RUN.set(run);
                    keep(guarded(w));
                });
            }
            self.residency.handed_out(helpers);
            keep(guarded(0));
        });
        self.extend_hot();
        first_error.into_inner().map_or(Ok(()), Err)
    }

    /// Keeps the last run's workers hot until [`WARM`] from now: called as each transfer
    /// returns (one atomic store), so the workers of a transfer whose caller waited for the copy
    /// engine after they finished are still looking when the next one starts.
    pub(crate) fn extend_hot(&self) {
        let until = self.epoch.elapsed() + WARM;
        self.hot_until.fetch_max(
            u64::try_from(until.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Whether the hot time ([`extend_hot`](Self::extend_hot)) is still running.
    fn in_hot_time(&self) -> bool {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
            < self.hot_until.load(Ordering::Relaxed)
    }

    /// Whether an idle worker whose last job (or wake) was at `last_work`, and whose last
    /// participant was of run `last_run`, stays hot: within [`WARM`] of its last job, or in
    /// the hot time when it took part in the last run; and only while at most one transfer
    /// runs (concurrent transfers need the host threads: a participant over its transfer's
    /// share finishes at once, and spinning it would take a core from another transfer's
    /// participants). Never with `CUWEAVE_STAGING_COLD` (a tuning switch, read once). So the
    /// workers that spin are about those of the last transfer, not every worker of the pool
    /// (through back-to-back transfers that would leave no core to the caller and the driver's
    /// threads).
    fn stays_hot(&self, last_work: Instant, last_run: u64) -> bool {
        static COLD: OnceLock<bool> = OnceLock::new();
        !env_switch(&COLD, "CUWEAVE_STAGING_COLD")
            && self.active.load(Ordering::Acquire) <= 1
            && (last_work.elapsed() < WARM
                || (last_run == self.runs.load(Ordering::Relaxed) && self.in_hot_time()))
    }

    /// A worker's resident loop, for the life of the process: looks for a job whenever a
    /// hand-out moves the residency's generation (and every few dozen spins), runs it, stays
    /// hot while [`stays_hot`](Self::stays_hot), then parks until a hand-out wakes it.
    fn reside(&'static self) {
        let residency = &self.residency;
        let mut seen = residency.generation();
        let mut last_work = Instant::now();
        let mut spins = 0u32;
        loop {
            let now = residency.generation();
            let moved = now != seen;
            if moved {
                seen = now;
                residency.wake_wanted();
            }
            if (moved || spins.is_multiple_of(32))
                && rayon::yield_now() == Some(rayon::Yield::Executed)
            {
                last_work = Instant::now();
                spins = 0;
                continue;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(32) || self.stays_hot(last_work, LAST_RUN.get()) {
                std::hint::spin_loop();
                continue;
            }
            if residency.park(seen) {
                last_work = Instant::now();
            }
            spins = 0;
        }
    }

    /// Workers not parked now: running a job, or hot (each parks within [`WARM`] of the last
    /// transfer's return and of its own last job).
    pub(crate) fn awake(&self) -> usize {
        self.residency.awake()
    }

    /// Waits, spinning on this thread for at most `most`, until the hot time is up and every
    /// worker has parked; whether it got there. Calibration calls this before it times a short
    /// copy, which the spinners of a different configuration's transfer would otherwise slow (on
    /// the H100 host a 256 KiB upload ran about a fifth slower right after a pipelined 16 MiB
    /// one).
    pub(crate) fn wait_cold(&self, most: Duration) -> bool {
        let deadline = Instant::now() + most;
        loop {
            if !self.in_hot_time() && self.awake() == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// Runs `job` on a worker in the background (on this thread when there are no workers).
    pub(crate) fn spawn(&'static self, job: impl FnOnce() + Send + 'static) {
        match &self.pool {
            Some(pool) => {
                pool.spawn(move || {
                    let _busy = self.residency.busy();
                    job();
                });
                self.residency.handed_out(1);
            }
            None => job(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn a_job_that_panics_becomes_worker_panicked() {
        assert_eq!(caught(|| Ok(7)).unwrap(), 7);
        let mut buffer = vec![1u8; 4];
        let outcome: Result<()> = caught(|| {
            buffer[0] = 2;
            panic!("a bug in a staging job");
        });
        assert!(matches!(outcome, Err(TransferError::WorkerPanicked)));
        // What the job borrowed is still the caller's, as it was left.
        assert_eq!(buffer, vec![2, 1, 1, 1]);
    }

    /// The pool is the process's: tests that watch its spinning workers run one at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    #[test]
    fn every_participant_runs_once_and_errors_and_panics_come_back() {
        let _serial = SERIAL.lock();
        let workers = shared();
        assert!(workers.participants() >= 1);
        let seen = AtomicUsize::new(0);
        workers
            .run(4, |w| {
                seen.fetch_or(1 << w, Ordering::Relaxed);
                Ok(())
            })
            .unwrap();
        let expected = (1usize << 4.min(workers.participants())) - 1;
        assert_eq!(seen.load(Ordering::Relaxed), expected);
        let error = workers.run(3, |w| {
            if w == 0 {
                Err(TransferError::WorkerPanicked)
            } else {
                Ok(())
            }
        });
        assert!(matches!(error, Err(TransferError::WorkerPanicked)));
        let panicked = workers.run(2, |w| {
            assert!(w != 1 || workers.participants() < 2, "worker 1 panics");
            Ok(())
        });
        if workers.participants() >= 2 {
            assert!(matches!(panicked, Err(TransferError::WorkerPanicked)));
        }
    }

    #[test]
    fn hot_workers_stop_spinning_within_the_warm_time_after_the_last_run() {
        let _serial = SERIAL.lock();
        let workers = shared();
        for _ in 0..100 {
            workers.run(workers.participants(), |_| Ok(())).unwrap();
        }
        // The spinners stop WARM after the last run returned (a few more for the scheduler on a
        // loaded two-core machine), and no transfer's state keeps them going.
        let deadline = Instant::now() + WARM * 2 + Duration::from_secs(2);
        while workers.awake() > 0 {
            assert!(
                Instant::now() < deadline,
                "{} workers still spinning long after the last run",
                workers.awake()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // And the pool still runs work afterwards (a parked worker is woken for it).
        let seen = AtomicUsize::new(0);
        workers
            .run(workers.participants(), |_| {
                seen.fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
            .unwrap();
        assert_eq!(seen.load(Ordering::Relaxed), workers.participants());
    }

    #[test]
    fn the_public_wait_leaves_every_worker_parked() {
        let _serial = SERIAL.lock();
        let workers = shared();
        workers.run(workers.participants(), |_| Ok(())).unwrap();
        assert!(wait_for_cold_workers(WARM * 2 + Duration::from_secs(2)));
        assert_eq!(workers.awake(), 0);
        assert!(!workers.in_hot_time());
    }

    #[test]
    fn waiting_cold_outlasts_the_hot_time_and_every_spinner() {
        let _serial = SERIAL.lock();
        let workers = shared();
        workers.run(workers.participants(), |_| Ok(())).unwrap();
        let started = Instant::now();
        // A generous bound for a loaded two-core machine; on an idle one it takes about WARM.
        assert!(workers.wait_cold(WARM * 2 + Duration::from_secs(2)));
        assert!(
            started.elapsed() + Duration::from_micros(50) >= WARM || workers.participants() < 2
        );
        assert_eq!(workers.awake(), 0);
        // Nothing keeps it waiting when nothing ran.
        let again = Instant::now();
        assert!(workers.wait_cold(WARM));
        assert!(again.elapsed() < WARM);
    }

    #[test]
    fn workers_do_not_stay_hot_while_another_transfer_runs() {
        let _serial = SERIAL.lock();
        let workers = shared();
        if workers.participants() < 2 {
            return;
        }
        let release = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            // A long transfer: its caller's part waits until released.
            let long = s.spawn(|| {
                workers.run(2, |w| {
                    while w == 0 && !release.load(Ordering::Acquire) {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    Ok(())
                })
            });
            while workers.active.load(Ordering::Acquire) == 0 {
                std::thread::yield_now();
            }
            // Short transfers meanwhile: their workers finish while the long one runs.
            for _ in 0..20 {
                workers.run(2, |_| Ok(())).unwrap();
            }
            // Kept hot by the clock (as a draining caller would), nobody spins: the short
            // transfers ran beside another.
            let until = Instant::now() + Duration::from_millis(20);
            let mut spinning_late = 0;
            while Instant::now() < until {
                workers.extend_hot();
                if until - Instant::now() < Duration::from_millis(10) {
                    spinning_late = spinning_late.max(workers.awake());
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            release.store(true, Ordering::Release);
            long.join().unwrap().unwrap();
            assert_eq!(
                spinning_late, 0,
                "workers spun while another transfer was running"
            );
        });
    }

    #[test]
    fn every_participant_joins_while_the_caller_still_works() {
        let _serial = SERIAL.lock();
        let workers = shared();
        // Runs of alternating sizes back to back, as calibration and a training loop make them:
        // the workers of each run are hot when the next is handed out, and may take its jobs
        // before they see the hand-out, while the others have parked during the run (each
        // lasts until they have, as a large transfer does). Each helper stays in its
        // job until the caller lets it go (a transfer's participants claim chunks until it is
        // done), and the caller waits for every helper to join: one the pool never woke would
        // join only after the caller's own part returned (a 1 GiB download ran on three of six
        // participants that way).
        let most = workers.participants();
        for round in 0..200 {
            let participants = [3, 6, most, 2, 8, 4][round % 6].min(most);
            let joined = AtomicUsize::new(0);
            let release = std::sync::atomic::AtomicBool::new(false);
            // How many had joined when the caller gave up waiting (none gave up: all).
            let joined_in_time = AtomicUsize::new(usize::MAX);
            workers
                .run(participants, |w| {
                    if w == 0 {
                        let deadline = Instant::now() + Duration::from_secs(5);
                        while joined.load(Ordering::Acquire) < participants - 1 {
                            if Instant::now() > deadline {
                                joined_in_time
                                    .store(joined.load(Ordering::Acquire), Ordering::Release);
                                break;
                            }
                            std::thread::yield_now();
                        }
                        // Until the workers outside this run have parked (within the warm
                        // time), as they have by the end of a large transfer.
                        let parked_by = Instant::now() + WARM * 2 + Duration::from_secs(2);
                        while workers.awake() > participants - 1 && Instant::now() < parked_by {
                            std::thread::yield_now();
                        }
                        release.store(true, Ordering::Release);
                    } else {
                        joined.fetch_add(1, Ordering::AcqRel);
                        while !release.load(Ordering::Acquire) {
                            std::thread::yield_now();
                        }
                    }
                    Ok(())
                })
                .unwrap();
            let in_time = joined_in_time.load(Ordering::Acquire);
            assert!(
                in_time == usize::MAX,
                "round {round}: {in_time} of {} helpers joined while the caller worked",
                participants - 1
            );
        }
    }

    #[test]
    fn many_runs_reuse_the_same_threads() {
        let _serial = SERIAL.lock();
        // 10^4 runs: no thread is spawned per run (the pool's size stays what it was).
        let workers = shared();
        let before = workers.threads;
        let total = AtomicUsize::new(0);
        for _ in 0..10_000 {
            workers
                .run(3, |_| {
                    total.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                })
                .unwrap();
        }
        assert_eq!(workers.threads, before);
        assert_eq!(
            total.load(Ordering::Relaxed),
            10_000 * 3.min(workers.participants())
        );
    }
}
