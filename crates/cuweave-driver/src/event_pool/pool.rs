//! The pool itself and its two handles: [`PooledEvent`] borrows the pool, [`OwnedPooledEvent`]
//! shares ownership of it.

use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::arena::Arena;
use super::recycler::{Recycler, TakeError};
use crate::context::Context;
use crate::error::{DriverError, Result};
use crate::event::{Event, EventFlags};
use crate::graph::{RecordedIn, capture_is_active, captures_ended};

/// The pool of each context that has one in use (keyed by the raw `CUcontext`), held weakly:
/// a pool lives while a user holds it, and [`EventPool::for_context`] hands every caller in
/// the meantime the same one.
static CONTEXT_POOLS: Mutex<Vec<(usize, Weak<PoolShared>)>> = Mutex::new(Vec::new());

/// A pool of CUDA events of one context, kept in two free lists: timing events (which record
/// timestamps, for [`Event::elapsed_ms`]) and non-timing events (cheaper to record and wait on,
/// for ordering and completion).
///
/// `cuEventCreate` + `cuEventDestroy` cost a few hundred nanoseconds. Taking an event from the
/// pool and giving it back on the same thread costs one atomic swap: each thread caches the
/// last event it released in a slot of its own, and takes it back from there (see
/// `docs/events.md` for the figures). Other events wait in shared lock-free queues. When
/// nothing is free anywhere, not even in another thread's slot, [`acquire_event`] creates a new
/// event, which joins the pool when released: the pool never holds more events than were in
/// use at once. Events are destroyed when the pool and every owned handle are gone.
///
/// Two handles: [`acquire_event`] returns a [`PooledEvent`] that borrows the pool (the fast
/// path, for events recorded and waited on while the pool is in reach), and [`acquire_owned`]
/// an [`OwnedPooledEvent`] that keeps the pool alive by reference count (to store an event in
/// a struct, send it to another thread or hand it to an [`AsyncEventWaiter`]), like tokio's
/// `Semaphore::acquire` and `acquire_owned`.
///
/// The pool is a cheap `Clone` (an `Arc`).
///
/// An event given back while it was last recorded into a stream capture that is still active
/// is parked until that capture ends, then rejoins its free list: recording it again on
/// another thread while the capture goes on races inside the driver.
///
/// [`acquire_event`]: Self::acquire_event
/// [`acquire_owned`]: Self::acquire_owned
/// [`AsyncEventWaiter`]: https://docs.rs/cuweave-event
///
/// Every layer of cuweave takes its events from the pool of its context
/// ([`for_context`](Self::for_context)): stream markers and timers, coordinators, barriers,
/// allocators, transfers. A layer never keeps a spare list of its own.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, EventPool, Stream, StreamFlags};
///
/// # fn main() -> Result<(), cuweave_driver::DriverError> {
/// let context = Context::primary(Device::get(0)?)?;
/// let pool = EventPool::new(&context, 32, 4)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// {
///     let done = pool.acquire_event(false)?;
///     done.record(&stream)?;
///     done.synchronize()?;
/// } // `done` goes back to the pool here
/// assert_eq!(pool.utilization().in_use, 0);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct EventPool {
    shared: Arc<PoolShared>,
}

struct PoolShared {
    context: Arc<Context>,
    regular: Recycler<Event>,
    timing: Recycler<Event>,
    blocking: Recycler<Event>,
    /// Events given back while last recorded into a capture that is still active, with that
    /// capture: they return to their free list once it has ended (see [`PoolShared::give`]).
    parked: Mutex<Vec<(Kind, u32, u64)>>,
    /// `parked.len()`, read without the lock on every give.
    parked_count: AtomicUsize,
    /// [`captures_ended`] when `parked` was last looked through: gives and takes look again
    /// only once another capture has ended.
    looked_at_ends: AtomicU64,
}

/// The three kinds of event a pool keeps apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `DISABLE_TIMING`: ordering and completion.
    Regular,
    /// Timestamps, for elapsed times.
    Timing,
    /// `DISABLE_TIMING | BLOCKING_SYNC`: a thread waiting on it sleeps in the kernel instead
    /// of spinning.
    Blocking,
}

impl Kind {
    fn of(timing: bool) -> Self {
        if timing { Self::Timing } else { Self::Regular }
    }

    fn flags(self) -> EventFlags {
        match self {
            Self::Regular => EventFlags::DISABLE_TIMING,
            Self::Timing => EventFlags::TIMING,
            Self::Blocking => EventFlags::DISABLE_TIMING.with_blocking_sync(),
        }
    }
}

impl PoolShared {
    /// Gives event `index` back. One recorded into a capture that is still active is parked
    /// instead, until that capture ends: handed out at once, it would be recorded eagerly by
    /// another thread while the capturing thread goes on with the capture the event is part
    /// of, a race inside the driver that crashed `cuEventRecord` (the facade's fourth-programs
    /// probe, a buffer dropped inside a capture while other threads copied). One relaxed load
    /// for an event recorded eagerly, and two more while any event is parked (the parked ones
    /// are looked through once per capture that ends, not once per give).
    #[inline]
    fn give(&self, kind: Kind, index: u32) {
        let recycler = self.recycler(kind);
        if let RecordedIn::Capture(capture) = recycler.get(index).recorded_in()
            && capture_is_active(capture)
        {
            self.park(kind, index, capture);
            return;
        }
        recycler.give(index);
        self.unpark_if_a_capture_ended();
    }

    /// [`unpark_ended`](Self::unpark_ended) when events are parked and a capture has ended
    /// since they were last looked through.
    #[inline]
    fn unpark_if_a_capture_ended(&self) {
        if self.parked_count.load(Ordering::Relaxed) != 0
            && captures_ended() != self.looked_at_ends.load(Ordering::Relaxed)
        {
            self.unpark_ended();
        }
    }

    #[cold]
    fn park(&self, kind: Kind, index: u32, capture: u64) {
        {
            let mut parked = self.parked.lock();
            parked.push((kind, index, capture));
            self.parked_count.store(parked.len(), Ordering::Relaxed);
        }
        // Ended between the check and the push, possibly after the last look: look now.
        if !capture_is_active(capture) {
            self.unpark_ended();
        }
    }

    /// Returns the parked events whose capture has ended to their free lists.
    #[cold]
    fn unpark_ended(&self) {
        let ended: Vec<(Kind, u32, u64)> = {
            let mut parked = self.parked.lock();
            // Read before looking: a capture that ends during the look moves the count again.
            self.looked_at_ends
                .store(captures_ended(), Ordering::Relaxed);
            let (ended, still) = parked
                .drain(..)
                .partition(|&(_, _, capture)| !capture_is_active(capture));
            *parked = still;
            self.parked_count.store(parked.len(), Ordering::Relaxed);
            ended
        };
        for (kind, index, _) in ended {
            self.recycler(kind).give(index);
        }
    }

    #[inline]
    fn recycler(&self, kind: Kind) -> &Recycler<Event> {
        match kind {
            Kind::Regular => &self.regular,
            Kind::Timing => &self.timing,
            Kind::Blocking => &self.blocking,
        }
    }

    /// The index of a free event of the kind, or of a new one when none is free (the pool
    /// grows).
    #[inline]
    fn take(&self, kind: Kind) -> Result<u32> {
        self.unpark_if_a_capture_ended();
        self.recycler(kind)
            .take(|| self.create(kind))
            .map_err(Self::take_error)
    }

    #[cold]
    fn create(&self, kind: Kind) -> Result<Event> {
        tracing::debug!(?kind, "event pool empty: creating an event");
        Event::new(&self.context, kind.flags())
    }

    #[cold]
    fn take_error(error: TakeError<DriverError>) -> DriverError {
        match error {
            TakeError::Make(error) => error,
            TakeError::Full => DriverError::InvalidArgument {
                operation: "EventPool::acquire_event",
                reason: format!(
                    "the pool already holds {} events, the most it can index",
                    Arena::<Event>::MAX_LEN
                ),
            },
        }
    }
}

impl fmt::Debug for EventPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventPool")
            .field("device", &self.shared.context.device().ordinal())
            .field("utilization", &self.utilization())
            .finish()
    }
}

/// How much of an [`EventPool`] is free and how much is held, at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolUtilization {
    /// Non-timing events free in the pool (shared lists and threads' slots).
    pub available_regular: usize,
    /// Timing events free in the pool.
    pub available_timing: usize,
    /// Blocking-sync events free in the pool.
    pub available_blocking: usize,
    /// Events handed out and not yet returned.
    pub in_use: usize,
}

/// Running totals of an [`EventPool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolCounters {
    /// Non-timing events created (pre-created and grown).
    pub created_regular: u64,
    /// Timing events created.
    pub created_timing: u64,
    /// Blocking-sync events created.
    pub created_blocking: u64,
    /// Events created because the pool was empty when one was asked for.
    pub grown: u64,
}

impl EventPool {
    /// Creates a pool of `context`'s events with `regular` non-timing and `timing` timing events
    /// made up front.
    ///
    /// # Errors
    /// The driver's error when creating an event fails.
    pub fn new(context: &Arc<Context>, regular: usize, timing: usize) -> Result<Self> {
        let shared = PoolShared {
            context: Arc::clone(context),
            regular: Recycler::new(),
            timing: Recycler::new(),
            blocking: Recycler::new(),
            parked: Mutex::new(Vec::new()),
            parked_count: AtomicUsize::new(0),
            looked_at_ends: AtomicU64::new(0),
        };
        for (recycler, count, flags) in [
            (&shared.regular, regular, EventFlags::DISABLE_TIMING),
            (&shared.timing, timing, EventFlags::TIMING),
        ] {
            for _ in 0..count {
                recycler
                    .stock(Event::new(context, flags)?)
                    .map_err(|_| PoolShared::take_error(TakeError::Full))?;
            }
        }
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// The pool of `context`'s events that every layer shares: the one already in use for
    /// this context (the same `CUcontext`, e.g. a device's primary context) if any, otherwise a
    /// new, empty one. It lives while someone holds it; events are made on first demand, so
    /// the pool never holds more than were in use at once.
    ///
    /// # Errors
    /// None today; the `Result` leaves room for a pool that pre-creates events.
    pub fn for_context(context: &Arc<Context>) -> Result<Self> {
        let key = context.as_raw() as usize;
        let mut pools = CONTEXT_POOLS.lock();
        if let Some(shared) = pools
            .iter()
            .find(|(raw, _)| *raw == key)
            .and_then(|(_, pool)| pool.upgrade())
        {
            return Ok(Self { shared });
        }
        pools.retain(|(_, pool)| pool.strong_count() > 0);
        let pool = Self::new(context, 0, 0)?;
        pools.push((key, Arc::downgrade(&pool.shared)));
        Ok(pool)
    }

    /// The context whose events this pool holds.
    pub fn context(&self) -> &Arc<Context> {
        &self.shared.context
    }

    /// Takes an event from the pool, creating one when none is free: a timing event when
    /// `timing`, otherwise one without timestamps. The handle borrows the pool and returns the
    /// event to it when dropped; [`acquire_owned`](Self::acquire_owned) gives a handle that
    /// does not borrow.
    ///
    /// A released event may still be pending on the GPU; recording it again is how CUDA reuses
    /// events, and waits already queued on its earlier recording are unaffected.
    ///
    /// # Errors
    /// The driver's error when the pool had to grow and creating the event failed;
    /// [`DriverError::InvalidArgument`] when it already holds the most events it can index
    /// (`u32::MAX - 1`).
    #[inline]
    pub fn acquire_event(&self, timing: bool) -> Result<PooledEvent<'_>> {
        let kind = Kind::of(timing);
        Ok(PooledEvent {
            index: self.shared.take(kind)?,
            kind,
            pool: self,
        })
    }

    /// Takes an event like [`acquire_event`](Self::acquire_event), in a handle that shares
    /// ownership of the pool (one reference-count increment and decrement more per round
    /// trip), so it may outlive this borrow: stored, sent to another thread, or watched by an
    /// `AsyncEventWaiter` (in `cuweave-event`).
    ///
    /// # Errors
    /// As [`acquire_event`](Self::acquire_event).
    #[inline]
    pub fn acquire_owned(&self, timing: bool) -> Result<OwnedPooledEvent> {
        self.acquire_kind(Kind::of(timing))
    }

    /// Takes a blocking-sync, non-timing event (`CU_EVENT_BLOCKING_SYNC`): a thread in
    /// [`Event::synchronize`] on it sleeps until the GPU reaches it instead of spinning. What
    /// a waiter that parks records behind the work it waits for.
    ///
    /// # Errors
    /// As [`acquire_event`](Self::acquire_event).
    #[inline]
    pub fn acquire_blocking_owned(&self) -> Result<OwnedPooledEvent> {
        self.acquire_kind(Kind::Blocking)
    }

    #[inline]
    fn acquire_kind(&self, kind: Kind) -> Result<OwnedPooledEvent> {
        Ok(OwnedPooledEvent {
            index: self.shared.take(kind)?,
            kind,
            pool: Arc::clone(&self.shared),
        })
    }

    /// Returns `event` to the pool now (what dropping it does).
    #[inline]
    pub fn release_event(&self, event: PooledEvent<'_>) {
        drop(event);
    }

    /// What is free and what is held right now (a snapshot: other threads may be taking and
    /// returning events meanwhile).
    pub fn utilization(&self) -> PoolUtilization {
        let shared = &self.shared;
        if shared.parked_count.load(Ordering::Relaxed) != 0 {
            shared.unpark_ended();
        }
        let available_regular = shared.regular.available();
        let available_timing = shared.timing.available();
        let available_blocking = shared.blocking.available();
        let created =
            shared.regular.created() + shared.timing.created() + shared.blocking.created();
        PoolUtilization {
            available_regular,
            available_timing,
            available_blocking,
            in_use: (created as usize)
                .saturating_sub(available_regular + available_timing + available_blocking),
        }
    }

    /// Running totals: events created of each kind, and how many the pool had to grow by.
    pub fn counters(&self) -> PoolCounters {
        let shared = &self.shared;
        PoolCounters {
            created_regular: shared.regular.created(),
            created_timing: shared.timing.created(),
            created_blocking: shared.blocking.created(),
            grown: shared.regular.grown() + shared.timing.grown() + shared.blocking.grown(),
        }
    }
}

/// An event taken from an [`EventPool`] by [`acquire_event`](EventPool::acquire_event):
/// borrows the pool, dereferences to the [`Event`], and goes back to the pool when dropped.
#[must_use = "dropping the handle returns the event to the pool at once"]
pub struct PooledEvent<'pool> {
    index: u32,
    kind: Kind,
    pool: &'pool EventPool,
}

impl PooledEvent<'_> {
    /// Whether this is a timing event.
    pub fn is_timing(&self) -> bool {
        self.kind == Kind::Timing
    }

    /// Whether this handle came from `pool`.
    pub fn belongs_to(&self, pool: &EventPool) -> bool {
        Arc::ptr_eq(&self.pool.shared, &pool.shared)
    }

    /// Turns this handle into one that shares ownership of the pool (the same event).
    pub fn into_owned(self) -> OwnedPooledEvent {
        let this = std::mem::ManuallyDrop::new(self);
        OwnedPooledEvent {
            index: this.index,
            kind: this.kind,
            pool: Arc::clone(&this.pool.shared),
        }
    }
}

impl fmt::Debug for PooledEvent<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledEvent")
            .field("event", &**self)
            .field("kind", &self.kind)
            .finish()
    }
}

impl Deref for PooledEvent<'_> {
    type Target = Event;

    #[inline]
    fn deref(&self) -> &Event {
        self.pool.shared.recycler(self.kind).get(self.index)
    }
}

impl AsRef<Event> for PooledEvent<'_> {
    fn as_ref(&self) -> &Event {
        self
    }
}

impl Drop for PooledEvent<'_> {
    #[inline]
    fn drop(&mut self) {
        self.pool.shared.give(self.kind, self.index);
    }
}

/// An event taken from an [`EventPool`] by [`acquire_owned`](EventPool::acquire_owned): keeps
/// the pool alive, dereferences to the [`Event`], and goes back to the pool when dropped.
pub struct OwnedPooledEvent {
    index: u32,
    kind: Kind,
    pool: Arc<PoolShared>,
}

impl OwnedPooledEvent {
    /// Whether this is a timing event.
    pub fn is_timing(&self) -> bool {
        self.kind == Kind::Timing
    }

    /// Whether this handle came from `pool`.
    pub fn belongs_to(&self, pool: &EventPool) -> bool {
        Arc::ptr_eq(&self.pool, &pool.shared)
    }
}

impl fmt::Debug for OwnedPooledEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedPooledEvent")
            .field("event", &**self)
            .field("kind", &self.kind)
            .finish()
    }
}

impl Deref for OwnedPooledEvent {
    type Target = Event;

    #[inline]
    fn deref(&self) -> &Event {
        self.pool.recycler(self.kind).get(self.index)
    }
}

impl AsRef<Event> for OwnedPooledEvent {
    fn as_ref(&self) -> &Event {
        self
    }
}

impl Drop for OwnedPooledEvent {
    #[inline]
    fn drop(&mut self) {
        self.pool.give(self.kind, self.index);
    }
}
