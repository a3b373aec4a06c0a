//! [`Residency`]: when the staging workers look for work, park, and are woken. CUDA-free and
//! rayon-free, so its protocol is model-checked with `loom` (`--cfg transfer_loom`).
//!
//! Every staging worker runs one *resident* loop for the life of the process: it looks for jobs
//! (rayon's `yield_now`, which takes one from any queue of the pool), stays hot for a while
//! after its last one, then parks here. Rayon's own idle workers are never involved: rayon
//! wakes a sleeping worker (a futex call, about 5 µs on the H100 host) for every job pushed
//! onto a non-empty queue and for every job an idle worker finds while others sleep, so with
//! its own sleep a transfer's participants joined one every 5 µs. Residents are never asleep
//! in rayon's sense, so pushing a job costs an atomic or two, and only the residents a
//! hand-out needs are woken, by the hand-out itself when nobody is awake, otherwise by the
//! first awake resident to see it.

use crate::sync::{AtomicUsize, Condvar, Mutex, MutexGuard, Ordering};

/// The residents' shared state: the generation of hand-outs, the wakes wanted, and the parked.
pub(crate) struct Residency {
    /// Moved after every hand-out of jobs, once they are in a queue: a resident parks only if
    /// it has not moved since the resident last looked for work.
    generation: AtomicUsize,
    /// Wakes a hand-out asked for that no resident has made yet.
    wanted: AtomicUsize,
    /// Residents running a job now (an estimate: hand-outs read it to count idle residents).
    busy: AtomicUsize,
    /// `Parking::awake`, readable without the lock (an estimate).
    awake: AtomicUsize,
    parking: Mutex<Parking>,
    wake: Condvar,
}

/// The part of the state that changes only under the lock.
struct Parking {
    /// Residents not parked (running a job, looking for one, or on their way to park).
    awake: usize,
    parked: usize,
    /// Wakes made and not yet taken by a parked resident (each lets exactly one out).
    tokens: usize,
    /// Set by [`Residency::close`] (tests): every parked resident leaves.
    #[cfg(test)]
    closed: bool,
}

/// Counts a resident as running a job until dropped.
pub(crate) struct Busy<'r>(&'r Residency);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Residency {
    /// The state of `residents` residents, all counted awake (each parks once it finds
    /// nothing to do).
    pub(crate) fn new(residents: usize) -> Self {
        Self {
            generation: AtomicUsize::new(0),
            wanted: AtomicUsize::new(0),
            busy: AtomicUsize::new(0),
            awake: AtomicUsize::new(residents),
            parking: Mutex::new(Parking {
                awake: residents,
                parked: 0,
                tokens: 0,
                #[cfg(test)]
                closed: false,
            }),
            wake: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Parking> {
        // Nothing panics while holding the lock; a poisoned one is still consistent.
        self.parking
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The generation now: a resident loads it before it looks for work, and passes it to
    /// [`park`](Self::park).
    pub(crate) fn generation(&self) -> usize {
        self.generation.load(Ordering::Acquire)
    }

    /// Residents not parked now (an estimate).
    pub(crate) fn awake(&self) -> usize {
        self.awake.load(Ordering::Relaxed)
    }

    /// Counts the calling resident as running a job until the guard is dropped.
    pub(crate) fn busy(&self) -> Busy<'_> {
        self.busy.fetch_add(1, Ordering::Relaxed);
        Busy(self)
    }

    /// Called after jobs that want `helpers` residents were put in a queue: moves the
    /// generation (so no resident that has not looked since parks), and asks for wakes so that
    /// about `helpers` idle residents look for them. When no resident is idle, one is woken
    /// here (someone must run the jobs, and the awake ones may be inside jobs that last the
    /// whole of another transfer, or be the caller itself, handing out from inside a job); the
    /// other wakes are left to the first idle resident that sees the generation move
    /// ([`wake_wanted`](Self::wake_wanted)), off the caller's path.
    pub(crate) fn handed_out(&self, helpers: usize) {
        let mut parking = self.lock();
        let idle = self.idle(&parking);
        let short = helpers.saturating_sub(idle);
        let here = usize::from(short > 0 && idle == 0);
        // The wakes wanted before the generation moves: an idle resident that sees it move
        // makes them before it takes a job (and may then be inside that job for the whole
        // transfer). Under the lock: a resident that parks after this sees the move.
        if short > here {
            self.wanted.fetch_add(short - here, Ordering::AcqRel);
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        let woken = Self::unpark(&mut parking, here);
        drop(parking);
        self.notify(woken);
    }

    /// Called by each job of a hand-out as it starts (counted [`busy`](Self::busy)), with the
    /// number of that hand-out's jobs not started yet: while some wait and no resident is idle
    /// to take them, wakes one parked resident, whose job does the same when it starts, and so
    /// on until every job has started.
    ///
    /// The hand-out's own wakes are not enough: a hot resident also looks for jobs every few
    /// dozen spins, so it can take one of them before it sees the generation move, and then
    /// runs it (a whole transfer) without making the wakes the hand-out left to idle residents
    /// (which counted it idle). On the H100 host that left three of a 1 GiB download's six
    /// participants, or four of an upload's eight, unstarted until the transfer was over.
    pub(crate) fn job_started(&self, not_started: usize) {
        if not_started == 0 {
            return;
        }
        let mut parking = self.lock();
        if self.idle(&parking) > 0 {
            return;
        }
        let woken = Self::unpark(&mut parking, 1);
        drop(parking);
        self.notify(woken);
    }

    /// Residents awake and not running a job, under the lock. The busy count is read with a
    /// read-modify-write, which sees every job's start before it in the count's order: two
    /// jobs starting at once, each reading the count with a plain load, could each miss the
    /// other's start and count it idle, and neither would wake for the jobs left (the loom
    /// model `check_long_jobs` found that with the plain `awake` copy and loads).
    fn idle(&self, parking: &Parking) -> usize {
        parking
            .awake
            .saturating_sub(self.busy.fetch_add(0, Ordering::AcqRel))
    }

    /// On a resident that has just seen the generation move (or been woken): makes the wakes a
    /// hand-out asked for, as many as there are parked residents.
    pub(crate) fn wake_wanted(&self) {
        if self.wanted.load(Ordering::Acquire) == 0 {
            return;
        }
        let wanted = self.wanted.swap(0, Ordering::AcqRel);
        if wanted == 0 {
            return;
        }
        let mut parking = self.lock();
        let woken = Self::unpark(&mut parking, wanted);
        drop(parking);
        self.notify(woken);
    }

    /// Gives up to `n` parked residents (those not already let out) a token each; how many.
    fn unpark(parking: &mut Parking, n: usize) -> usize {
        let n = n.min(parking.parked - parking.tokens);
        parking.tokens += n;
        n
    }

    fn notify(&self, woken: usize) {
        for _ in 0..woken {
            self.wake.notify_one();
        }
    }

    /// Parks the calling resident, which has found no work since it loaded generation `seen`,
    /// until a hand-out wakes it; returns at once, `false`, if the generation has moved since
    /// (jobs it has not looked for may be queued). `true` once woken.
    pub(crate) fn park(&self, seen: usize) -> bool {
        let mut parking = self.lock();
        // Under the lock, where hand-outs move it: a hand-out after this one counts this
        // resident parked, and so wakes it if nobody else is idle.
        if self.generation.load(Ordering::Acquire) != seen {
            return false;
        }
        parking.awake -= 1;
        parking.parked += 1;
        self.awake.store(parking.awake, Ordering::Relaxed);
        while parking.tokens == 0 && !Self::closed(&parking) {
            parking = self
                .wake
                .wait(parking)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        parking.tokens = parking.tokens.saturating_sub(1);
        parking.parked -= 1;
        parking.awake += 1;
        self.awake.store(parking.awake, Ordering::Relaxed);
        true
    }

    #[cfg(test)]
    fn closed(parking: &Parking) -> bool {
        parking.closed
    }

    #[cfg(not(test))]
    fn closed(_: &Parking) -> bool {
        false
    }

    /// Lets every parked resident out, now and from now on (tests: the residents of a model
    /// must end).
    #[cfg(test)]
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_all();
    }
}

#[cfg(all(test, not(transfer_loom)))]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    use parking_lot::Mutex as Queue;

    use super::*;

    /// Residents on plain threads taking jobs (numbers) from a queue: every job handed out is
    /// run once, residents that find nothing park, and a hand-out wakes them.
    #[test]
    fn every_job_handed_out_runs_once_and_idle_residents_park() {
        let residents = 3;
        let residency = Residency::new(residents);
        let queue: Queue<Vec<usize>> = Queue::new(Vec::new());
        let ran: Vec<std::sync::atomic::AtomicUsize> = (0..400)
            .map(|_| std::sync::atomic::AtomicUsize::new(0))
            .collect();
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            for _ in 0..residents {
                scope.spawn(|| {
                    while !stop.load(Ordering::Acquire) {
                        let seen = residency.generation();
                        residency.wake_wanted();
                        let job = queue.lock().pop();
                        match job {
                            Some(job) => {
                                let _busy = residency.busy();
                                ran[job].fetch_add(1, Ordering::Relaxed);
                            }
                            None => {
                                residency.park(seen);
                            }
                        }
                    }
                });
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            let wait_for = |done: &dyn Fn() -> bool, what: &str| {
                while !done() {
                    assert!(Instant::now() < deadline, "{what}");
                    std::thread::sleep(Duration::from_millis(1));
                }
            };
            let all_ran = |jobs: usize| ran[..jobs].iter().all(|r| r.load(Ordering::Relaxed) > 0);
            for round in 0..100 {
                // Jobs in the queue first, then the hand-out.
                for job in 4 * round..4 * round + 4 {
                    queue.lock().push(job);
                }
                residency.handed_out(4);
                if round % 10 == 0 {
                    // Every tenth hand-out finds every resident parked: the next one must wake.
                    wait_for(
                        &|| all_ran(4 * round + 4) && residency.awake() == 0,
                        "residents never parked between hand-outs",
                    );
                }
            }
            wait_for(&|| all_ran(ran.len()), "a job handed out never ran");
            // With nothing left to do, every resident parks.
            wait_for(&|| residency.awake() == 0, "residents never parked");
            stop.store(true, Ordering::Release);
            residency.close();
        });
        assert!(ran.iter().all(|r| r.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_resident_does_not_park_after_the_generation_moved_and_a_hand_out_wakes_a_parked_one() {
        let residency = Residency::new(1);
        let seen = residency.generation();
        residency.handed_out(1);
        // Jobs were handed out since `seen`: the resident looks again instead of parking.
        assert!(!residency.park(seen));
        assert_eq!(residency.awake(), 1);
        std::thread::scope(|scope| {
            let parked = scope.spawn(|| residency.park(residency.generation()));
            while residency.awake() > 0 {
                std::thread::yield_now();
            }
            // Nobody awake: the hand-out wakes the parked resident itself.
            residency.handed_out(1);
            assert!(parked.join().unwrap());
        });
        assert_eq!(residency.awake(), 1);
    }

    #[test]
    fn a_hand_out_from_inside_a_job_wakes_a_parked_resident() {
        let residency = Residency::new(2);
        std::thread::scope(|scope| {
            let parked = scope.spawn(|| residency.park(residency.generation()));
            while residency.awake() > 1 {
                std::thread::yield_now();
            }
            // The other resident runs a job that hands out more (an owned transfer's pipeline):
            // it is awake but not idle, and will not look for the jobs until its own is done.
            let busy = residency.busy();
            residency.handed_out(1);
            let deadline = Instant::now() + Duration::from_secs(10);
            while !parked.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            let woken = parked.is_finished();
            drop(busy);
            residency.close();
            assert!(woken, "the parked resident was not woken");
            assert!(parked.join().unwrap());
        });
    }
}

#[cfg(all(test, transfer_loom))]
mod loom_models {
    use loom::sync::Arc;

    use super::*;

    /// A model's state: the residency, the queued jobs, and how many have run.
    struct Model {
        residency: Residency,
        queued: AtomicUsize,
        ran: AtomicUsize,
        jobs: usize,
    }

    /// A resident: takes queued jobs, parks when there are none, and closes the residency once
    /// every job has run (so the others leave). It never counts itself busy, so hand-outs see
    /// every awake resident as idle and wake the fewest.
    fn reside(model: &Model) {
        loop {
            if model.ran.load(Ordering::Acquire) == model.jobs {
                model.residency.close();
                return;
            }
            let seen = model.residency.generation();
            model.residency.wake_wanted();
            let took = model
                .queued
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok();
            if took {
                model.ran.fetch_add(1, Ordering::AcqRel);
            } else {
                model.residency.park(seen);
            }
        }
    }

    /// `residents` residents, and `jobs` jobs handed out one at a time by the model's thread,
    /// each wanting `helpers`: in every interleaving (up to three preemptions) every job runs;
    /// a lost wake-up leaves every thread blocked, which loom reports.
    fn check(residents: usize, jobs: usize, helpers: usize) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(move || {
            let model = Arc::new(Model {
                residency: Residency::new(residents),
                queued: AtomicUsize::new(0),
                ran: AtomicUsize::new(0),
                jobs,
            });
            let threads: Vec<_> = (0..residents)
                .map(|_| {
                    let model = Arc::clone(&model);
                    loom::thread::spawn(move || reside(&model))
                })
                .collect();
            for _ in 0..jobs {
                model.queued.fetch_add(1, Ordering::AcqRel);
                model.residency.handed_out(helpers);
            }
            for thread in threads {
                thread.join().unwrap();
            }
            assert_eq!(model.ran.load(Ordering::Acquire), jobs);
        });
    }

    /// One hand-out of `helpers` long jobs (a transfer's participants: each runs until every
    /// job of the hand-out has started) to `residents` residents that, like the staging
    /// workers, look for a job whether or not they saw the generation move, and make the
    /// hand-out's wakes only when they see it move. A job counts its resident busy and calls
    /// [`Residency::job_started`]. In every interleaving (up to `preemptions` preemptions)
    /// every job starts; a resident left inside its job while a parked one is never woken for
    /// the others blocks every thread, which loom reports (without `job_started`, or with it
    /// reading the counts with plain loads, it did). Three residents took eight minutes at two
    /// preemptions (they pass), too long for CI.
    fn check_long_jobs(residents: usize, helpers: usize, preemptions: usize) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(preemptions);
        builder.check(move || {
            let model = Arc::new(Model {
                residency: Residency::new(residents),
                queued: AtomicUsize::new(0),
                ran: AtomicUsize::new(0),
                jobs: helpers,
            });
            // How many jobs have started, and the wait for all of them.
            let started = Arc::new((Mutex::new(0usize), Condvar::new()));
            let threads: Vec<_> = (0..residents)
                .map(|_| {
                    let (model, started) = (Arc::clone(&model), Arc::clone(&started));
                    loom::thread::spawn(move || {
                        let mut seen = model.residency.generation();
                        loop {
                            if model.ran.load(Ordering::Acquire) == model.jobs {
                                model.residency.close();
                                return;
                            }
                            let now = model.residency.generation();
                            if now != seen {
                                seen = now;
                                model.residency.wake_wanted();
                            }
                            let took = model
                                .queued
                                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                                    n.checked_sub(1)
                                })
                                .is_ok();
                            if !took {
                                model.residency.park(seen);
                                continue;
                            }
                            let busy = model.residency.busy();
                            let (count, all) = &*started;
                            let mut count_now = count.lock().unwrap();
                            *count_now += 1;
                            let not_started = model.jobs - *count_now;
                            drop(count_now);
                            model.residency.job_started(not_started);
                            let mut count_now = count.lock().unwrap();
                            all.notify_all();
                            while *count_now < model.jobs {
                                count_now = all.wait(count_now).unwrap();
                            }
                            drop(count_now);
                            drop(busy);
                            model.ran.fetch_add(1, Ordering::AcqRel);
                        }
                    })
                })
                .collect();
            // The jobs are queued first, then handed out, as `Workers::run` does.
            model.queued.fetch_add(helpers, Ordering::AcqRel);
            model.residency.handed_out(helpers);
            for thread in threads {
                thread.join().unwrap();
            }
            assert_eq!(model.ran.load(Ordering::Acquire), helpers);
        });
    }

    #[test]
    fn loom_long_jobs_all_start_with_two_residents() {
        check_long_jobs(2, 2, 3);
    }

    #[test]
    fn loom_one_resident_runs_every_job() {
        check(1, 2, 1);
    }

    #[test]
    fn loom_two_residents_one_job_wanting_both() {
        check(2, 1, 2);
    }

    #[test]
    fn loom_two_residents_two_jobs() {
        check(2, 2, 1);
    }
}
