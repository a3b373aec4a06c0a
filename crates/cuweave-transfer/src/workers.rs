//! The staging workers: one persistent pool of host threads per process, sized from the machine,
//! that every pipelined transfer shares.
//!
//! A transfer never spawns a thread. Its calling thread takes part itself (it starts on the
//! first chunk at once) while it hands the other participants to the pool; a worker that wakes
//! late simply claims fewer chunks, because chunks are claimed from a shared counter rather than
//! dealt out in advance. After a transfer, the workers it used stay hot for [`WARM`]: each
//! spins on the pool's generation counter until the next transfer bumps it or the time is up,
//! and only then parks. So back-to-back transfers (the mid-size tensors a training loop moves)
//! find their workers running, with no futex wake and no scheduler latency on the critical
//! path; a pool idle for longer costs no CPU.
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

/// How long workers stay hot (spinning, ready for the next transfer) after a transfer.
pub const WARM: Duration = Duration::from_micros(300);

/// The process's staging workers.
pub(crate) struct Workers {
    /// Bumped by every transfer that starts: hot workers stop spinning and take its work.
    generation: AtomicU64,
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
        self.generation.fetch_add(1, Ordering::Release);
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
        pool.in_place_scope(|scope| {
            if participants > 1 {
                let (guarded, keep) = (&guarded, &keep);
                scope.spawn(move |scope| {
                    for w in 2..participants {
                        scope.spawn(move |_| keep(guarded(w)));
                    }
                    keep(guarded(1));
                });
            }
            keep(guarded(0));
        });
        self.keep_hot(pool, participants - 1);
        first_error.into_inner().map_or(Ok(()), Err)
    }

    /// Keeps `workers` workers spinning for [`WARM`] or until the next transfer starts. They
    /// have just finished and are still awake. As when a transfer starts, the caller hands the
    /// pool one job, which hands out the others from inside it, so the caller returns after one
    /// hand-off instead of one per worker.
    fn keep_hot(&'static self, pool: &rayon::ThreadPool, workers: usize) {
        if workers == 0 {
            return;
        }
        let generation = self.generation.load(Ordering::Acquire);
        let deadline = Instant::now() + WARM;
        let spin = move || {
            while self.generation.load(Ordering::Acquire) == generation && Instant::now() < deadline
            {
                std::hint::spin_loop();
            }
        };
        pool.spawn(move || {
            for _ in 1..workers {
                // On a worker of `pool`: spawned into `pool`.
                rayon::spawn(spin);
            }
            spin();
        });
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

    #[test]
    fn every_participant_runs_once_and_errors_and_panics_come_back() {
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
    fn many_runs_reuse_the_same_threads() {
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
