//! The staging workers: one persistent pool of host threads per process, sized from the machine,
//! that every pipelined transfer shares.
//!
//! A transfer never spawns a thread. Its calling thread takes part itself (it starts on the
//! first chunk at once) while it hands the other participants to the pool; a worker that wakes
//! late simply claims fewer chunks, because chunks are claimed from a shared counter rather than
//! dealt out in advance. A worker that has done its part of a transfer stays hot: at once, on
//! its own thread (no wake, no hand-off), it spins on the pool's generation counter until the
//! next transfer bumps it, or until [`WARM`] after the last transfer returned (the caller's
//! wait for the copy engine to drain counts as part of the transfer), and only then parks. So
//! back-to-back transfers (the mid-size tensors a training loop moves) find their workers
//! running, with no futex wake and no scheduler latency on the critical path; a pool idle for
//! longer costs no CPU.
//!
//! Borrowed host memory can be handed to the pool safely because [`Workers::run`] returns only
//! once every participant has finished (rayon's scoped spawns): the borrow outlives the work.
//! Work that must outlive its caller ([`Workers::spawn`]) owns everything it touches.

use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Result, TransferError};

/// The most worker threads the pool starts, whatever the machine: beyond this the host's memory
/// bandwidth, not the thread count, limits staging.
pub const MAX_WORKERS: usize = 32;

/// How long workers stay hot (spinning, ready for the next transfer) after a transfer returns.
pub const WARM: Duration = Duration::from_micros(500);

/// The process's staging workers.
pub(crate) struct Workers {
    /// Bumped by every transfer that starts: hot workers stop spinning and take its work.
    generation: AtomicU64,
    /// Nanoseconds after `epoch` until which finished workers stay hot.
    hot_until: AtomicU64,
    epoch: Instant,
    /// Workers spinning hot now.
    spinning: AtomicUsize,
    /// `None` when the operating system refused the threads: transfers then run on the caller.
    pool: Option<rayon::ThreadPool>,
    /// Pipelined transfers running now (those with more than one participant).
    active: AtomicUsize,
    threads: usize,
}

static WORKERS: OnceLock<Workers> = OnceLock::new();

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

/// The shared pool, started on first use with one worker per host thread but one (the caller
/// of a transfer is the last participant), at most [`MAX_WORKERS`].
pub(crate) fn shared() -> &'static Workers {
    WORKERS.get_or_init(|| {
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
            generation: AtomicU64::new(0),
            hot_until: AtomicU64::new(0),
            epoch: Instant::now(),
            spinning: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            pool,
            threads,
        }
    })
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
        let guarded = |w: usize| {
            std::panic::catch_unwind(AssertUnwindSafe(|| work(w)))
                .unwrap_or(Err(TransferError::WorkerPanicked))
        };
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
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        let first_error: Mutex<Option<TransferError>> = Mutex::new(None);
        let keep = |outcome: Result<()>| {
            if let Err(error) = outcome {
                first_error.lock().get_or_insert(error);
            }
        };
        // The caller hands the pool one job, which hands out the others from inside the pool,
        // and starts its own part at once: each job handed in from outside the pool may wake a
        // sleeping worker (a futex call, a few microseconds each), which on the caller's thread
        // delayed its first chunk by about 20 µs with three workers (H100 host); from a worker,
        // those wakes are off the caller's path, and hot workers take the jobs first anyway.
        // Each worker stays hot once its part is done ([`stay_hot`](Self::stay_hot)).
        pool.in_place_scope(|scope| {
            if participants > 1 {
                let (guarded, keep) = (&guarded, &keep);
                scope.spawn(move |scope| {
                    for w in 2..participants {
                        scope.spawn(move |_| {
                            keep(guarded(w));
                            self.stay_hot(generation);
                        });
                    }
                    keep(guarded(1));
                    self.stay_hot(generation);
                });
            }
            keep(guarded(0));
        });
        self.extend_hot();
        first_error.into_inner().map_or(Ok(()), Err)
    }

    /// Keeps finished workers hot until [`WARM`] from now: called as each transfer returns
    /// (one atomic store), so the workers of a transfer whose caller waited for the copy engine
    /// after they finished are still spinning when the next one starts.
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

    /// On a worker that has just done its part of the transfer of `generation`: keeps it
    /// spinning, ready for the next transfer, until one starts (the generation changes) or
    /// the hot time ([`extend_hot`](Self::extend_hot)) is up. Spawned into the worker's own
    /// queue, so the worker runs it next, with no wake and no other thread involved; it only
    /// stops rayon from putting the worker to sleep in between. A job queued on this worker
    /// meanwhile (a participant of its transfer that no other worker has taken) is run, and the
    /// spin ends, so no job waits behind it. Only while its transfer is the only one running:
    /// concurrent transfers need the host threads (a participant over its transfer's share
    /// finishes at once, and spinning it would take a core from another transfer's
    /// participants, or keep their queued jobs waiting).
    fn stay_hot(&'static self, generation: u64) {
        static COLD: OnceLock<bool> = OnceLock::new();
        if env_switch(&COLD, "CUWEAVE_STAGING_COLD") || self.active.load(Ordering::Acquire) > 1 {
            return;
        }
        self.extend_hot();
        rayon::spawn(move || {
            self.spinning.fetch_add(1, Ordering::AcqRel);
            let mut spins = 0u32;
            while self.generation.load(Ordering::Acquire) == generation
                && self.active.load(Ordering::Acquire) <= 1
                && self.in_hot_time()
            {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && rayon::yield_local() == Some(rayon::Yield::Executed)
                {
                    break;
                }
                std::hint::spin_loop();
            }
            self.spinning.fetch_sub(1, Ordering::AcqRel);
        });
    }

    /// Workers spinning hot now (each stops within [`WARM`] of the last transfer's return).
    pub(crate) fn spinning(&self) -> usize {
        self.spinning.load(Ordering::Acquire)
    }

    /// Waits, spinning on this thread for at most `most`, until the hot time is up and no worker
    /// spins; whether it got there. Calibration calls this before it times a short copy, which
    /// the spinners of a different configuration's transfer would otherwise slow (on the H100
    /// host a 256 KiB upload ran about a fifth slower right after a pipelined 16 MiB one).
    pub(crate) fn wait_cold(&self, most: Duration) -> bool {
        let deadline = Instant::now() + most;
        loop {
            if !self.in_hot_time() && self.spinning() == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// Runs `job` on a worker in the background (on this thread when there are no workers).
    pub(crate) fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        match &self.pool {
            Some(pool) => {
                self.generation.fetch_add(1, Ordering::Release);
                pool.spawn(job);
            }
            None => job(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

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
        while workers.spinning() > 0 {
            assert!(
                Instant::now() < deadline,
                "{} workers still spinning long after the last run",
                workers.spinning()
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
        assert_eq!(workers.spinning(), 0);
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
            // Kept hot by the clock (as a draining caller would), nobody spins.
            let until = Instant::now() + Duration::from_millis(20);
            let mut spinning_late = 0;
            while Instant::now() < until {
                workers.extend_hot();
                if until - Instant::now() < Duration::from_millis(10) {
                    spinning_late = spinning_late.max(workers.spinning());
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
