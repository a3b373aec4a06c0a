//! The reactor thread: watches completion words (plain loads) and events (queries), decides
//! wait cells, runs callbacks. It spins only for the first tens of microseconds after the last
//! progress; then it parks, woken by a new registration, by its sleeper thread (asleep in
//! `cuEventSynchronize` on the blocking-sync event behind a pending completion word), or by the
//! next deadline. When nothing is pending it parks until something is registered.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

use cuweave_driver::graph::capture_is_active;
use cuweave_driver::{Event, OwnedPooledEvent};

use parking_lot::{Condvar, Mutex};

use super::WaitId;
use super::source::WatchedEvent;
use super::words::{Lease, WordSlab};
use crate::capture::{self, own_query};
use crate::error::EventError;
use crate::wake::{Inbox, Outcome, WaitCell};

/// What a callback is told: `Ok(())` when the GPU got there, or why it will not be.
pub type WaitResult = Result<(), EventError>;

pub(crate) type Callback = Box<dyn FnOnce(WaitResult) + Send + 'static>;
pub(crate) type Cell = WaitCell<EventError>;

/// Spin (re-scanning at full speed) this long after the last progress or registration: GPU
/// work that ends within it is noticed within a scan, with no wake-up on the path.
const SPIN_FOR: Duration = Duration::from_micros(50);
/// The longest park while the sleeper waits on a pending wait's blocking-sync event (it wakes
/// the reactor sooner when the GPU gets there): a bound on how stale a wait can be when the
/// sleeper is stuck on another one, and the pace of dead-context probes.
const PARK_ARMED: Duration = Duration::from_millis(20);
/// Naps while only waits without a wake event are pending (event waits, or a sleeper still
/// busy): they start at `NAP_MIN` and double up to `NAP_MAX` while nothing progresses.
const NAP_MIN: Duration = Duration::from_micros(50);
const NAP_MAX: Duration = Duration::from_millis(1);
/// How often unwritten completion words make the reactor check their context is alive.
const PROBE_EVERY: Duration = Duration::from_millis(1);

/// What is being watched.
pub(crate) enum Source {
    Event(Box<dyn WatchedEvent>),
    /// An event the waiter does not keep alive: the wait ends (cancelled) once its holders let
    /// it go (a future's event is held by the future; the coordinator's by its operation, see
    /// [`AsyncEventWaiter::wait_while_held`]), so a dropped future's event goes back to its pool
    /// at once, however far behind the reactor is.
    ///
    /// [`AsyncEventWaiter::wait_while_held`]: super::AsyncEventWaiter::wait_while_held
    Held(Weak<dyn WatchedEvent>),
    /// A capture begun through cuweave: reached once it has ended, asked of the driver crate's
    /// capture registry (no driver call).
    CaptureEnd(u64),
    Word(Lease),
}

/// One wait handed to the reactor.
pub(crate) struct Registration {
    pub(crate) cell: Arc<Cell>,
    pub(crate) source: Source,
    pub(crate) deadline: Option<(Instant, Duration)>,
    pub(crate) callback: Option<(WaitId, Callback)>,
}

/// Counters the reactor keeps.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) registered: AtomicU64,
    pub(crate) completed: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) timed_out: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) pending: AtomicUsize,
}

/// State shared by the waiter's handle and its reactor thread.
#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) inbox: Inbox<Registration>,
    pub(crate) shutdown: AtomicBool,
    /// Live callback waits, so `cancel_wait` can find their cells.
    pub(crate) callbacks: Mutex<HashMap<WaitId, Arc<Cell>>>,
    pub(crate) counters: Counters,
}

enum Check {
    NotYet,
    Reached,
    Failed(EventError),
    /// A [`Source::Held`] event nobody else holds any more: nobody wants the wait.
    LetGo,
}

impl Registration {
    /// Where the wait stands; `relaxed`: whether this thread is in relaxed capture mode (see
    /// [`query`]).
    fn check(&self, relaxed: bool) -> Check {
        match &self.source {
            Source::Word(lease) if lease.is_reached() => Check::Reached,
            Source::Word(_) => Check::NotYet,
            Source::Event(event) => query(event.event(), relaxed),
            Source::Held(event) => match event.upgrade() {
                Some(event) => query(event.event(), relaxed),
                None => Check::LetGo,
            },
            Source::CaptureEnd(capture) if capture_is_active(*capture) => Check::NotYet,
            Source::CaptureEnd(_) => Check::Reached,
        }
    }

    fn slab(&self) -> Option<&Arc<WordSlab>> {
        match &self.source {
            Source::Word(lease) => Some(&lease.slab),
            Source::Event(_) | Source::Held(_) | Source::CaptureEnd(_) => None,
        }
    }
}

/// Asks the driver whether the GPU has passed `event`, a query the reactor makes of its own
/// accord. In relaxed capture mode (`relaxed`) the driver allows it during any capture on
/// another thread, and it breaks none: asked now, so that waits resolve whatever captures run
/// elsewhere (`waits_resolve_while_another_thread_runs_a_global_mode_capture`). Without the
/// mode, the query would break a global-mode capture another thread began, even one begun
/// between a check of the capture count and the query: it is made only inside
/// [`outside_captures`](cuweave_driver::graph::outside_captures), and a capture active or
/// beginning means "not yet".
fn query(event: &Event, relaxed: bool) -> Check {
    match own_query(relaxed, || event.query()) {
        // Skipped while a capture is active or beginning: asked again on a later scan.
        None => Check::NotYet,
        Some(Ok(true)) => Check::Reached,
        Some(Ok(false)) => Check::NotYet,
        // Refused while a capture lasts (only if this thread could not enter relaxed mode):
        // asked again on a later scan, never a failure.
        Some(Err(error)) if error.is_capture_refusal() => Check::NotYet,
        Some(Err(error)) => Check::Failed(error.into()),
    }
}

/// The reactor's helper: sleeps in `cuEventSynchronize` on a blocking-sync event the reactor
/// hands it, then wakes the reactor. Started on first need.
struct Sleeper {
    state: Mutex<SleeperState>,
    changed: Condvar,
    /// Set when the sleeper saw its event reached (read by the reactor before it parks).
    rang: AtomicBool,
}

#[derive(Default)]
struct SleeperState {
    target: Option<Arc<OwnedPooledEvent>>,
    /// The event the sleeper is asleep on, while it is.
    asleep_on: Option<Arc<OwnedPooledEvent>>,
    stop: bool,
}

impl Sleeper {
    fn start(reactor: Thread) -> Option<Arc<Self>> {
        let sleeper = Arc::new(Self {
            state: Mutex::new(SleeperState::default()),
            changed: Condvar::new(),
            rang: AtomicBool::new(false),
        });
        let worker = Arc::clone(&sleeper);
        let started = std::thread::Builder::new()
            .name("cuweave-event-sleeper".into())
            .spawn(move || worker.run(&reactor));
        match started {
            Ok(_) => Some(sleeper),
            Err(error) => {
                tracing::warn!(%error, "no sleeper thread: the reactor naps instead");
                None
            }
        }
    }

    fn run(&self, reactor: &Thread) {
        // Its `cuEventSynchronize` is on an event recorded outside any capture: a global-mode
        // capture on another thread must not refuse it (the sleeper would spin).
        let _relaxed = capture::relaxed_thread("cuweave-event-sleeper");
        loop {
            let event = {
                let mut state = self.state.lock();
                loop {
                    if state.stop {
                        return;
                    }
                    if let Some(event) = state.target.take() {
                        state.asleep_on = Some(Arc::clone(&event));
                        break event;
                    }
                    self.changed.wait(&mut state);
                }
            };
            // Asleep in the driver until the GPU reaches the event (or the context dies: the
            // reactor's scan then finds the failure).
            let _ = event.synchronize();
            drop(event);
            self.state.lock().asleep_on = None;
            self.rang.store(true, Ordering::Release);
            reactor.unpark();
        }
    }

    /// Hands `event` to the sleeper: whether it sleeps on it now (it already did, or it was
    /// free to take it); `false` while it still sleeps on another one.
    fn arm(&self, event: &Arc<OwnedPooledEvent>) -> bool {
        let mut state = self.state.lock();
        if let Some(asleep_on) = &state.asleep_on {
            // Asleep on this very event (one long wait, the reactor back from a park): it will
            // ring when the GPU gets there, so the reactor may park long again.
            return Arc::ptr_eq(asleep_on, event);
        }
        state.target = Some(Arc::clone(event));
        self.changed.notify_one();
        true
    }

    fn stop(&self) {
        self.state.lock().stop = true;
        self.changed.notify_one();
    }
}

/// The reactor thread's body; returns on shutdown.
///
/// From its first registration the thread stays in relaxed capture mode: it queries only
/// events and streams recorded outside captures (a wait on a capturing stream is refused when
/// it is made), so a global-mode capture on another thread must not turn its queries into
/// failures, nor be broken by them. Not before: entering the mode loads and initialises the
/// driver, which a waiter that never gets a registration (or a process with no GPU work yet)
/// should not pay. Should the mode be out of reach, its queries are made only inside
/// [`outside_captures`](cuweave_driver::graph::outside_captures) (see [`query`]).
pub(crate) fn run(shared: &Shared) {
    let mut relaxed = None;
    let mut reactor = Reactor {
        shared,
        entries: Vec::new(),
        zombies: Vec::new(),
        last_probe: Instant::now(),
        relaxed: false,
    };
    let mut sleeper: Option<Arc<Sleeper>> = None;
    let mut last_progress = Instant::now();
    let mut nap = NAP_MIN;
    loop {
        let mut arrived = false;
        while let Some(registration) = shared.inbox.pop() {
            reactor.entries.push(registration);
            arrived = true;
        }
        if shared.shutdown.load(Ordering::Acquire) {
            reactor.shut_down();
            if let Some(sleeper) = sleeper {
                sleeper.stop();
            }
            return;
        }
        let now = Instant::now();
        if arrived {
            if relaxed.is_none() {
                relaxed = capture::relaxed_thread("cuweave-event-reactor");
                reactor.relaxed = relaxed.is_some();
            }
            // A caller that just registered a wait expects a short one: spin first.
            last_progress = now;
        }
        if reactor.scan(now) {
            last_progress = now;
            nap = NAP_MIN;
            continue;
        }
        if now.saturating_duration_since(last_progress) < SPIN_FOR {
            std::hint::spin_loop();
            continue;
        }
        if reactor.entries.is_empty() && reactor.zombies.is_empty() {
            // Nothing to watch: park until a registration (no ticks while idle).
            shared
                .inbox
                .park_until_nonempty(|| shared.shutdown.load(Ordering::Acquire));
            last_progress = Instant::now();
            continue;
        }
        // Waits are pending and the GPU is slow: sleep until it gets somewhere.
        let wake = reactor.wake_event();
        if wake.is_some() && sleeper.is_none() {
            sleeper = Sleeper::start(std::thread::current());
        }
        let armed = match (&sleeper, &wake) {
            (Some(sleeper), Some(event)) => sleeper.arm(event),
            _ => false,
        };
        let mut park = if armed { PARK_ARMED } else { nap };
        if let Some(deadline) = reactor.next_deadline() {
            park = park.min(deadline.saturating_duration_since(now));
        }
        let rang = sleeper.as_ref().map(|sleeper| &sleeper.rang);
        shared.inbox.park_timeout(park, || {
            shared.shutdown.load(Ordering::Acquire)
                || rang.is_some_and(|rang| rang.load(Ordering::Acquire))
        });
        if let Some(sleeper) = &sleeper {
            sleeper.rang.store(false, Ordering::Release);
        }
        if !armed {
            nap = (nap * 2).min(NAP_MAX);
        }
    }
}

struct Reactor<'a> {
    shared: &'a Shared,
    entries: Vec<Registration>,
    /// Words whose wait ended (cancelled, timed out) before the GPU wrote them: kept until it
    /// does, so a late write never lands in a word lent to someone else.
    zombies: Vec<Lease>,
    last_probe: Instant,
    /// Whether this thread holds relaxed capture mode: its queries then need not keep out of
    /// captures (see [`query`]).
    relaxed: bool,
}

impl Reactor<'_> {
    /// One pass over every wait; whether any ended.
    fn scan(&mut self, now: Instant) -> bool {
        let mut progressed = false;
        let mut index = 0;
        while index < self.entries.len() {
            let entry = &self.entries[index];
            if entry.cell.outcome() == Outcome::Cancelled {
                self.retire_cancelled(index);
                progressed = true;
                continue;
            }
            match entry.check(self.relaxed) {
                Check::Reached => {
                    let entry = self.entries.swap_remove(index);
                    if entry.cell.complete() {
                        self.shared
                            .counters
                            .completed
                            .fetch_add(1, Ordering::Relaxed);
                        self.finish(entry, Ok(()), true);
                    } else {
                        self.count_cancelled_meanwhile(&entry.cell);
                        self.retire(entry, true);
                    }
                    progressed = true;
                }
                Check::Failed(error) => {
                    let entry = self.entries.swap_remove(index);
                    self.fail(entry, error);
                    progressed = true;
                }
                Check::LetGo => {
                    // Ends as a cancellation (the callback is dropped, never run), counted
                    // once whether or not `cancel_wait` got there first.
                    entry.cell.cancel();
                    self.retire_cancelled(index);
                    progressed = true;
                }
                Check::NotYet => match entry.deadline {
                    Some((deadline, timeout)) if now >= deadline => {
                        let entry = self.entries.swap_remove(index);
                        if entry.cell.time_out() {
                            self.shared
                                .counters
                                .timed_out
                                .fetch_add(1, Ordering::Relaxed);
                            self.finish(entry, Err(EventError::TimedOut { timeout }), false);
                        } else {
                            self.count_cancelled_meanwhile(&entry.cell);
                            self.retire(entry, false);
                        }
                        progressed = true;
                    }
                    _ => index += 1,
                },
            }
        }
        let zombies_before = self.zombies.len();
        let mut still = Vec::with_capacity(zombies_before);
        for lease in self.zombies.drain(..) {
            if lease.is_reached() {
                lease.recycle();
            } else {
                still.push(lease);
            }
        }
        self.zombies = still;
        progressed |= self.zombies.len() != zombies_before;
        if now.saturating_duration_since(self.last_probe) >= PROBE_EVERY {
            self.last_probe = now;
            progressed |= self.probe_contexts();
        }
        progressed
    }

    /// Asks each context with unwritten words whether it is still alive; fails the waits of
    /// dead ones (a kernel fault leaves their words unwritten for ever). Whether any failed.
    fn probe_contexts(&mut self) -> bool {
        let mut slabs: Vec<Arc<WordSlab>> = Vec::new();
        let in_use = self
            .entries
            .iter()
            .filter_map(Registration::slab)
            .chain(self.zombies.iter().map(|lease| &lease.slab));
        for slab in in_use {
            if !slabs.iter().any(|seen| Arc::ptr_eq(seen, slab)) {
                slabs.push(Arc::clone(slab));
            }
        }
        let mut failed_any = false;
        for slab in slabs {
            // A stream query of cuweave's own, as the scan's event queries (see [`query`]):
            // without relaxed mode, made only while no capture is active or beginning.
            let probed = own_query(self.relaxed, || slab.probe());
            // Skipped (a capture is active or beginning): no news of a death.
            let Some(Err(error)) = probed else { continue };
            if error.is_capture_refusal() {
                // Not asked (a capture forbids it on this thread): no news of a death.
                continue;
            }
            tracing::error!(%error, "a context with pending GPU waits died; failing its waits");
            failed_any = true;
            let (dead, alive): (Vec<_>, Vec<_>) = std::mem::take(&mut self.entries)
                .into_iter()
                .partition(|entry| entry.slab().is_some_and(|s| Arc::ptr_eq(s, &slab)));
            self.entries = alive;
            for entry in dead {
                // Its word will never be written: `fail` keeps it out of the free list; the
                // driver's `MappedWords` decides when its chunk may be freed.
                self.fail(entry, error.clone().into());
            }
            let (dead, alive): (Vec<_>, Vec<_>) = std::mem::take(&mut self.zombies)
                .into_iter()
                .partition(|lease| Arc::ptr_eq(&lease.slab, &slab));
            self.zombies = alive;
            dead.into_iter().for_each(Lease::abandon);
        }
        failed_any
    }

    fn fail(&mut self, entry: Registration, error: EventError) {
        let Registration {
            cell,
            source,
            callback,
            ..
        } = entry;
        abandon(source);
        self.decide_failed(&cell, callback, error);
    }

    fn decide_failed(
        &mut self,
        cell: &Arc<Cell>,
        callback: Option<(WaitId, Callback)>,
        error: EventError,
    ) {
        let for_callback = callback.as_ref().map(|_| error.clone());
        if cell.fail(error) {
            self.shared.counters.failed.fetch_add(1, Ordering::Relaxed);
            if let (Some((id, callback)), Some(error)) = (callback, for_callback) {
                self.shared.callbacks.lock().remove(&id);
                run_callback(callback, Err(error));
            }
        } else {
            self.count_cancelled_meanwhile(cell);
            if let Some((id, _)) = callback {
                self.shared.callbacks.lock().remove(&id);
            }
        }
        self.shared.counters.pending.fetch_sub(1, Ordering::Relaxed);
    }

    /// Counts a wait whose outcome this reactor was about to decide when it was cancelled (the
    /// cancel won the race): every registered wait ends in exactly one counter.
    fn count_cancelled_meanwhile(&self, cell: &Cell) {
        if cell.outcome() == Outcome::Cancelled {
            self.shared
                .counters
                .cancelled
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Ends a wait whose cell this reactor decided: runs its callback with `result`.
    fn finish(&mut self, entry: Registration, result: WaitResult, reached: bool) {
        let Registration {
            source, callback, ..
        } = entry;
        self.release_source(source, reached);
        if let Some((id, callback)) = callback {
            self.shared.callbacks.lock().remove(&id);
            run_callback(callback, result);
        }
        // After the callback, so that `pending() == 0` means every callback has returned.
        self.shared.counters.pending.fetch_sub(1, Ordering::Relaxed);
    }

    /// Takes the cancelled wait at `index` off the list, counted once.
    fn retire_cancelled(&mut self, index: usize) {
        let entry = self.entries.swap_remove(index);
        self.shared
            .counters
            .cancelled
            .fetch_add(1, Ordering::Relaxed);
        self.retire(entry, false);
    }

    /// Ends a wait someone else decided (cancelled): its callback is dropped, never run.
    fn retire(&mut self, entry: Registration, reached: bool) {
        let Registration {
            source, callback, ..
        } = entry;
        self.release_source(source, reached);
        self.shared.counters.pending.fetch_sub(1, Ordering::Relaxed);
        if let Some((id, callback)) = callback {
            self.shared.callbacks.lock().remove(&id);
            drop(callback);
        }
    }

    fn release_source(&mut self, source: Source, reached: bool) {
        if let Source::Word(lease) = source {
            if reached || lease.is_reached() {
                lease.recycle();
            } else {
                self.zombies.push(lease);
            }
        }
    }

    /// The blocking-sync event behind the first pending completion word that has one.
    fn wake_event(&self) -> Option<Arc<OwnedPooledEvent>> {
        self.entries.iter().find_map(|entry| match &entry.source {
            Source::Word(lease) => lease.wake(),
            Source::Event(_) | Source::Held(_) | Source::CaptureEnd(_) => None,
        })
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.entries
            .iter()
            .filter_map(|entry| entry.deadline.map(|(deadline, _)| deadline))
            .min()
    }

    /// Cancels callback waits (their callbacks never run) and fails futures with
    /// [`EventError::WaiterShutDown`], so no awaiting task hangs.
    fn shut_down(&mut self) {
        for entry in std::mem::take(&mut self.entries) {
            if entry.callback.is_some() {
                entry.cell.cancel();
                self.retire(entry, false);
            } else {
                self.fail(entry, EventError::WaiterShutDown);
            }
        }
        while let Some(entry) = self.shared.inbox.pop() {
            if entry.callback.is_some() {
                entry.cell.cancel();
                self.retire(entry, false);
            } else {
                self.fail(entry, EventError::WaiterShutDown);
            }
        }
        // Words still unwritten are never lent again; the driver's `MappedWords` frees their
        // chunks only after the context's queued writes (or leaks them for a dead context).
        std::mem::take(&mut self.zombies)
            .into_iter()
            .for_each(Lease::abandon);
    }
}

/// Drops a source, abandoning (never recycling) a completion word the GPU may still write.
fn abandon(source: Source) {
    match source {
        Source::Word(lease) if lease.is_reached() => lease.recycle(),
        Source::Word(lease) => lease.abandon(),
        Source::Event(event) => drop(event),
        Source::Held(_) | Source::CaptureEnd(_) => {}
    }
}

fn run_callback(callback: Callback, result: WaitResult) {
    if std::panic::catch_unwind(AssertUnwindSafe(|| callback(result))).is_err() {
        tracing::error!("an event-wait callback panicked; the panic was contained");
    }
}
