//! [`EventPool`]: reusable CUDA events, timing and non-timing, handed out as RAII handles.

mod recycler;

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use cuweave_driver::{Context, Event, EventFlags};

use crate::error::Result;
use recycler::Recycler;

/// A pool of CUDA events of one context, kept in two free lists: timing events (which record
/// timestamps, for [`Event::elapsed_ms`]) and non-timing events (cheaper to record and wait on,
/// for ordering and completion).
///
/// `cuEventCreate` + `cuEventDestroy` cost a few hundred nanoseconds; taking an event from the
/// pool and giving it back costs a lock-free queue pop and push and a reference count (tens of
/// nanoseconds; see `docs/events.md`). The pool grows on demand: when a list is empty, [`acquire_event`]
/// creates a new event, which joins the pool when released. Events are destroyed when the pool
/// and every handle are gone.
///
/// The pool is a cheap `Clone` (an `Arc`); handles keep it alive.
///
/// [`acquire_event`]: Self::acquire_event
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_event::EventPool;
///
/// # fn main() -> Result<(), cuweave_event::EventError> {
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
}

impl PoolShared {
    fn recycler(&self, timing: bool) -> &Recycler<Event> {
        if timing { &self.timing } else { &self.regular }
    }

    /// A free event of the kind, or a new one when that list is empty (the pool grows).
    fn take(&self, timing: bool) -> Result<Event> {
        let flags = if timing {
            EventFlags::TIMING
        } else {
            EventFlags::DISABLE_TIMING
        };
        Ok(self.recycler(timing).take(|| {
            tracing::debug!(timing, "event pool empty: creating an event");
            Event::new(&self.context, flags)
        })?)
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
    /// Non-timing events waiting in the pool.
    pub available_regular: usize,
    /// Timing events waiting in the pool.
    pub available_timing: usize,
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
        };
        for _ in 0..regular {
            shared
                .regular
                .stock(Event::new(context, EventFlags::DISABLE_TIMING)?);
        }
        for _ in 0..timing {
            shared
                .timing
                .stock(Event::new(context, EventFlags::TIMING)?);
        }
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// The context whose events this pool holds.
    pub fn context(&self) -> &Arc<Context> {
        &self.shared.context
    }

    /// Takes an event from the pool, creating one when none is free: a timing event when
    /// `timing`, otherwise one without timestamps. It returns to the pool when the handle drops.
    ///
    /// A released event may still be pending on the GPU; recording it again is how CUDA reuses
    /// events, and waits already queued on its earlier recording are unaffected.
    ///
    /// # Errors
    /// The driver's error when the pool had to grow and creating the event failed.
    pub fn acquire_event(&self, timing: bool) -> Result<PooledEvent> {
        Ok(PooledEvent {
            event: Some(self.shared.take(timing)?),
            timing,
            pool: Arc::clone(&self.shared),
        })
    }

    /// Takes an event for use within the caller's scope: like [`acquire_event`](Self::acquire_event),
    /// but the handle borrows the pool instead of sharing ownership of it, so taking and
    /// returning it touches no reference count (one queue pop and one push: the fastest way
    /// through the pool, for events recorded and waited on within one function).
    ///
    /// # Errors
    /// The driver's error when the pool had to grow and creating the event failed.
    pub fn acquire_scoped(&self, timing: bool) -> Result<ScopedEvent<'_>> {
        Ok(ScopedEvent {
            event: Some(self.shared.take(timing)?),
            timing,
            pool: &self.shared,
        })
    }

    /// Returns `event` to the pool now (what dropping it does).
    pub fn release_event(&self, event: PooledEvent) {
        drop(event);
    }

    /// What is free and what is held right now (a snapshot: other threads may be taking and
    /// returning events meanwhile).
    pub fn utilization(&self) -> PoolUtilization {
        let shared = &self.shared;
        let available_regular = shared.regular.available();
        let available_timing = shared.timing.available();
        let created = shared.regular.created() + shared.timing.created();
        PoolUtilization {
            available_regular,
            available_timing,
            in_use: (created as usize).saturating_sub(available_regular + available_timing),
        }
    }

    /// Running totals: events created of each kind, and how many the pool had to grow by.
    pub fn counters(&self) -> PoolCounters {
        let shared = &self.shared;
        PoolCounters {
            created_regular: shared.regular.created(),
            created_timing: shared.timing.created(),
            grown: shared.regular.grown() + shared.timing.grown(),
        }
    }
}

/// An event borrowed from an [`EventPool`]; dereferences to the [`Event`] and goes back to the
/// pool when dropped.
pub struct PooledEvent {
    event: Option<Event>,
    timing: bool,
    pool: Arc<PoolShared>,
}

impl PooledEvent {
    /// Whether this is a timing event.
    pub fn is_timing(&self) -> bool {
        self.timing
    }

    /// Whether this handle came from `pool`.
    pub fn belongs_to(&self, pool: &EventPool) -> bool {
        Arc::ptr_eq(&self.pool, &pool.shared)
    }
}

impl fmt::Debug for PooledEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledEvent")
            .field("event", &self.event)
            .field("timing", &self.timing)
            .finish()
    }
}

impl Deref for PooledEvent {
    type Target = Event;

    fn deref(&self) -> &Event {
        self.event
            .as_ref()
            .expect("a pooled event is present until dropped")
    }
}

impl AsRef<Event> for PooledEvent {
    fn as_ref(&self) -> &Event {
        self
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            self.pool.recycler(self.timing).give(event);
        }
    }
}

/// An event from [`EventPool::acquire_scoped`], borrowed from the pool for a scope and returned
/// to it when dropped. Dereferences to [`Event`].
#[must_use = "dropping the handle returns the event to the pool at once"]
pub struct ScopedEvent<'pool> {
    event: Option<Event>,
    timing: bool,
    pool: &'pool PoolShared,
}

impl ScopedEvent<'_> {
    /// Whether this is a timing event.
    pub fn is_timing(&self) -> bool {
        self.timing
    }
}

impl fmt::Debug for ScopedEvent<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScopedEvent")
            .field("event", &self.event)
            .field("timing", &self.timing)
            .finish()
    }
}

impl Deref for ScopedEvent<'_> {
    type Target = Event;

    fn deref(&self) -> &Event {
        self.event
            .as_ref()
            .expect("a scoped event is present until dropped")
    }
}

impl Drop for ScopedEvent<'_> {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            self.pool.recycler(self.timing).give(event);
        }
    }
}
