//! [`AsyncEventWaiter`]: one background thread that watches many points in GPU work and wakes
//! futures or runs callbacks when the GPU reaches them.

mod future;
mod reactor;
mod source;
mod words;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use cuweave_driver::{Context, EventPool, OwnedPooledEvent, Stream};
use parking_lot::Mutex;

pub use future::WaitFuture;
pub use reactor::WaitResult;
pub use source::WatchedEvent;

use crate::capture;
use crate::error::{EventError, Result};
use crate::wake::WaitCell;
use reactor::{Callback, Cell, Registration, Shared, Source};
use words::WordSlab;

/// The process-wide waiter ([`AsyncEventWaiter::global`]).
static GLOBAL: OnceLock<Result<AsyncEventWaiter>> = OnceLock::new();

/// Identifies a callback wait, and the waiter that issued it, for
/// [`AsyncEventWaiter::cancel_wait`]: another waiter does not know it (its `cancel_wait` returns
/// `false`), so an id handed to the wrong waiter can never cancel that waiter's own, unrelated
/// wait (as [`OperationId`](crate::OperationId) carries its coordinator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WaitId {
    /// The waiter that issued it (unique in the process, from 1).
    waiter: u64,
    /// Its order among that waiter's callback waits, from 1.
    number: u64,
}

impl fmt::Display for WaitId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "wait#{}", self.number)
    }
}

/// The ids one waiter issues: its number in the process, and a counter.
#[derive(Debug)]
struct WaitIds {
    waiter: u64,
    next: std::sync::atomic::AtomicU64,
}

impl WaitIds {
    /// The ids of a waiter no other of the process shares.
    fn new() -> Self {
        static NEXT_WAITER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self {
            waiter: NEXT_WAITER.fetch_add(1, Ordering::Relaxed),
            next: std::sync::atomic::AtomicU64::new(1),
        }
    }

    /// A fresh id of this waiter.
    fn issue(&self) -> WaitId {
        WaitId {
            waiter: self.waiter,
            number: self.next.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Whether `id` was issued by this waiter.
    fn owns(&self, id: WaitId) -> bool {
        id.waiter == self.waiter
    }
}

/// How the host learns that a stream got past its queued work.
///
/// Measured on an H100 in `docs/events.md`; [`CompletionWord`](Self::CompletionWord) is the
/// default because it is the fastest and makes no driver call on the waking path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WakeMechanism {
    /// The stream writes a sequence number into mapped pinned host memory behind the work
    /// (`cuStreamWriteValue64`); the reactor sees it with a plain atomic load. A dead context is
    /// noticed by a periodic probe (every millisecond while words are unwritten).
    #[default]
    CompletionWord,
    /// An event is recorded behind the work and the reactor polls it with `cuEventQuery`.
    EventQuery,
    /// A host function (`cuLaunchHostFunc`) queued behind the work wakes the task from the
    /// driver's callback thread. No reactor involved, but slower to wake (see the docs), no
    /// timeouts, and a context that dies never runs it, so the future would hang: use it only
    /// to compare.
    HostFunction,
}

/// Options of one stream wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct WaitOptions {
    /// How the wake-up travels.
    pub mechanism: WakeMechanism,
    /// Give up after this long: the future resolves to [`EventError::TimedOut`].
    pub timeout: Option<Duration>,
}

impl WaitOptions {
    /// A wait woken through `mechanism`, without a timeout.
    pub fn new(mechanism: WakeMechanism) -> Self {
        Self {
            mechanism,
            timeout: None,
        }
    }

    /// The same wait, given up after `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

/// Counters of an [`AsyncEventWaiter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WaiterStats {
    /// Waits registered with the reactor.
    pub registered: u64,
    /// Waits the GPU completed.
    pub completed: u64,
    /// Waits that failed (driver error, dead context, shutdown).
    pub failed: u64,
    /// Waits whose timeout expired first.
    pub timed_out: u64,
    /// Waits cancelled (by `cancel_wait` or by dropping the future).
    pub cancelled: u64,
    /// Waits the reactor still watches.
    pub pending: usize,
}

/// Watches many points in GPU work from one background thread (the reactor), and tells waiters
/// when the GPU gets there: futures ([`WaitFuture`]) are woken, callbacks run.
///
/// - [`stream_idle`](Self::stream_idle): a future for "the work queued on this stream so far
///   has finished", by default through a completion word (see [`WakeMechanism`]).
/// - [`event_done`](Self::event_done): a future for an event, polled with `cuEventQuery`.
/// - [`wait_async`](Self::wait_async): a callback for an event, with an optional timeout that
///   the callback is told about; [`cancel_wait`](Self::cancel_wait) cancels it, and once that
///   returns `true` the callback never runs.
///
/// The reactor spins while waits are pending (about 200 µs after the last completion, then it
/// yields, then it naps 100 µs between scans) and parks once nothing has been pending for 2 ms,
/// so an idle waiter costs no CPU. Callbacks run on the reactor thread: keep them short, and never block in them.
/// The reactor and its sleeper thread stay in relaxed capture mode, so that a
/// [`CaptureMode::Global`](cuweave_driver::CaptureMode::Global) capture on another thread does
/// not fail their waits (nor do their queries break it); for the same reason a callback must
/// make no CUDA call that a capture forbids (no allocation, no synchronisation).
/// Dropping the waiter stops the thread: pending callbacks are cancelled (never run) and pending
/// futures resolve to [`EventError::WaiterShutDown`]. A callback may own the last handle (an
/// `Arc` of the waiter, or of an [`OperationCoordinator`](crate::OperationCoordinator)): the
/// waiter is then dropped on its own reactor thread, which stops once the callback returns.
///
/// [`AsyncEventWaiter::global`] is a process-wide waiter for code that has no waiter of its own.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_event::AsyncEventWaiter;
///
/// # async fn run() -> Result<(), cuweave_event::EventError> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// // ... queue kernels and copies on `stream` ...
/// AsyncEventWaiter::global()?.stream_idle(&stream)?.await?;
/// # Ok(())
/// # }
/// ```
pub struct AsyncEventWaiter {
    shared: Arc<Shared>,
    reactor: Thread,
    handle: Option<JoinHandle<()>>,
    slabs: Mutex<HashMap<usize, Arc<WordSlab>>>,
    ids: WaitIds,
}

impl fmt::Debug for AsyncEventWaiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncEventWaiter")
            .field("stats", &self.stats())
            .finish()
    }
}

impl AsyncEventWaiter {
    /// Starts a waiter and its reactor thread (which parks until there is something to watch).
    ///
    /// # Errors
    /// [`EventError::ThreadSpawn`] when the operating system refuses a new thread.
    pub fn new() -> Result<Self> {
        let shared = Arc::new(Shared::default());
        let handle = std::thread::Builder::new()
            .name("cuweave-event-reactor".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || reactor::run(&shared)
            })
            .map_err(|error| EventError::ThreadSpawn {
                operation: "AsyncEventWaiter::new",
                thread: "cuweave-event-reactor",
                reason: error.to_string(),
            })?;
        Ok(Self {
            shared,
            reactor: handle.thread().clone(),
            handle: Some(handle),
            slabs: Mutex::new(HashMap::new()),
            ids: WaitIds::new(),
        })
    }

    /// The process-wide waiter, started on first use and never stopped.
    ///
    /// # Errors
    /// As [`new`](Self::new), on first use.
    pub fn global() -> Result<&'static Self> {
        GLOBAL
            .get_or_init(|| {
                cuweave_driver::process_caches::register_process_cache(
                    "cuweave-event: the global waiter's completion words",
                    || {
                        GLOBAL
                            .get()
                            .and_then(|waiter| waiter.as_ref().ok())
                            .map_or(0, AsyncEventWaiter::release_free_words)
                    },
                );
                Self::new()
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Frees the chunks of completion words no wait is using (they are made again on demand);
    /// returns the bytes freed. Part of [`cuweave_driver::empty_process_caches`] for the
    /// [global](Self::global) waiter.
    pub fn release_free_words(&self) -> usize {
        let slabs: Vec<Arc<WordSlab>> = self.slabs.lock().values().cloned().collect();
        slabs.iter().map(|slab| slab.release_free_chunks()).sum()
    }

    fn register(&self, registration: Registration) {
        let counters = &self.shared.counters;
        counters.registered.fetch_add(1, Ordering::Relaxed);
        counters.pending.fetch_add(1, Ordering::Relaxed);
        self.shared.inbox.push(registration, &self.reactor);
    }

    fn slab(&self, context: &Arc<Context>) -> Result<Arc<WordSlab>> {
        let key = context.as_raw() as usize;
        let mut slabs = self.slabs.lock();
        if let Some(slab) = slabs.get(&key) {
            return Ok(Arc::clone(slab));
        }
        let slab = Arc::new(WordSlab::new(context)?);
        slabs.insert(key, Arc::clone(&slab));
        Ok(slab)
    }

    /// A future that resolves once the work queued on `stream` so far has finished on the GPU,
    /// woken through a completion word.
    ///
    /// Its results are then visible to the host. The marker queued behind that work (the word
    /// write, or with [`WakeMechanism::HostFunction`] the host function, which wakes the task
    /// from inside itself) may still be retiring, so `stream.query()` can report the stream busy
    /// for a moment after the future resolves.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](cuweave_driver::GraphError::Capturing) (inside
    /// [`EventError::Driver`]) when `stream` is capturing: nothing queued on it now would run.
    /// The driver's error when the completion word cannot be queued (e.g. a device without
    /// stream memory operations: use [`stream_idle_with`](Self::stream_idle_with) and
    /// [`WakeMechanism::EventQuery`] there).
    pub fn stream_idle(&self, stream: &Stream) -> Result<WaitFuture> {
        self.stream_idle_with(stream, WaitOptions::default())
    }

    /// [`stream_idle`](Self::stream_idle) with a chosen mechanism and an optional timeout.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](cuweave_driver::GraphError::Capturing) when `stream` is
    /// capturing (refused before anything is queued); the driver's error when queueing the
    /// marker fails; `InvalidArgument` for a timeout with [`WakeMechanism::HostFunction`],
    /// which cannot time out.
    pub fn stream_idle_with(&self, stream: &Stream, options: WaitOptions) -> Result<WaitFuture> {
        capture::refuse_capturing_stream(stream, "AsyncEventWaiter::stream_idle")?;
        let cell = Arc::new(WaitCell::new());
        // The future keeps what the reactor watches weakly (an event), so that a dropped
        // future lets go of it at once, however far behind the reactor is.
        let (source, held): (Source, Option<Arc<dyn WatchedEvent>>) = match options.mechanism {
            WakeMechanism::CompletionWord => {
                let mut lease = self.slab(stream.context())?.lease(stream)?;
                let wake = lease.hand_over_wake();
                (
                    Source::Word(lease),
                    wake.map(|wake| wake as Arc<dyn WatchedEvent>),
                )
            }
            WakeMechanism::EventQuery => {
                let event = EventPool::for_context(stream.context())?.acquire_owned(false)?;
                event.record(stream)?;
                let event: Arc<dyn WatchedEvent> = Arc::new(event);
                (Source::Held(Arc::downgrade(&event)), Some(event))
            }
            WakeMechanism::HostFunction => {
                if options.timeout.is_some() {
                    return Err(EventError::invalid(
                        "AsyncEventWaiter::stream_idle_with",
                        "a host-function wait cannot carry a timeout",
                    ));
                }
                let decided = Arc::clone(&cell);
                // Only decides the cell and wakes the task: no CUDA call in a host function.
                stream.launch_host_fn(move || {
                    decided.complete();
                })?;
                return Ok(WaitFuture::new(cell, None));
            }
        };
        self.register(Registration {
            cell: Arc::clone(&cell),
            source,
            deadline: deadline(options.timeout),
            callback: None,
        });
        let future = WaitFuture::new(cell, options.timeout);
        Ok(match held {
            Some(event) => future.holding(event),
            None => future,
        })
    }

    /// A future that resolves once `event` has completed on the GPU (polled by the reactor with
    /// `cuEventQuery`). The future owns `event` until it resolves or is dropped (the reactor
    /// only watches it: a dropped future's event is let go at once, not when the reactor next
    /// gets round to it); pass an `Arc` to keep using it.
    pub fn event_done(&self, event: impl WatchedEvent) -> WaitFuture {
        self.event_done_with(event, None)
    }

    /// [`event_done`](Self::event_done) with an optional timeout.
    pub fn event_done_with(
        &self,
        event: impl WatchedEvent,
        timeout: Option<Duration>,
    ) -> WaitFuture {
        let cell = Arc::new(WaitCell::new());
        let event: Arc<dyn WatchedEvent> = Arc::new(event);
        self.register(Registration {
            cell: Arc::clone(&cell),
            source: Source::Held(Arc::downgrade(&event)),
            deadline: deadline(timeout),
            callback: None,
        });
        WaitFuture::new(cell, timeout).holding(event)
    }

    /// Runs `callback(Ok(()))` on the reactor thread once `event` has completed, or
    /// `callback(Err(..))` when watching it fails (a dead context). Returns the id to cancel it.
    pub fn wait_async<F>(&self, event: impl WatchedEvent, callback: F) -> WaitId
    where
        F: FnOnce(WaitResult) + Send + 'static,
    {
        self.wait_async_inner(Source::Event(Box::new(event)), None, Box::new(callback))
    }

    /// [`wait_async`](Self::wait_async) on an event the waiter does not keep: the wait ends,
    /// cancelled (the callback dropped, never run), once every other holder of `event` has let
    /// it go. For a caller that holds the event exactly as long as it wants the callback (the
    /// coordinator holds an operation's completion event until it decides the operation): the
    /// event goes back to its pool when that holder lets go, however far behind the reactor is.
    pub(crate) fn wait_while_held<F>(&self, event: &Arc<OwnedPooledEvent>, callback: F) -> WaitId
    where
        F: FnOnce(WaitResult) + Send + 'static,
    {
        let event: Arc<dyn WatchedEvent> = Arc::clone(event) as Arc<dyn WatchedEvent>;
        self.wait_async_inner(
            Source::Held(Arc::downgrade(&event)),
            None,
            Box::new(callback),
        )
    }

    /// Runs `callback` (with `Ok`) once the capture `capture`, begun through cuweave, has
    /// ended (however it ended): what decides the operations recorded into it. Asked of the
    /// capture registry at each scan, with no driver call.
    pub(crate) fn when_capture_ends<F>(&self, capture: u64, callback: F) -> WaitId
    where
        F: FnOnce(WaitResult) + Send + 'static,
    {
        self.wait_async_inner(Source::CaptureEnd(capture), None, Box::new(callback))
    }

    /// [`wait_async`](Self::wait_async) that gives up after `timeout`: the callback then gets
    /// `Err(EventError::TimedOut { .. })`.
    pub fn wait_async_timeout<F>(
        &self,
        event: impl WatchedEvent,
        timeout: Duration,
        callback: F,
    ) -> WaitId
    where
        F: FnOnce(WaitResult) + Send + 'static,
    {
        self.wait_async_inner(
            Source::Event(Box::new(event)),
            Some(timeout),
            Box::new(callback),
        )
    }

    /// Runs `callback` once the work queued on `stream` so far has finished (through a
    /// completion word).
    ///
    /// # Errors
    /// [`GraphError::Capturing`](cuweave_driver::GraphError::Capturing) when `stream` is
    /// capturing (refused before anything is queued; the callback never runs); the driver's
    /// error when the completion word cannot be queued.
    pub fn wait_stream_async<F>(&self, stream: &Stream, callback: F) -> Result<WaitId>
    where
        F: FnOnce(WaitResult) + Send + 'static,
    {
        capture::refuse_capturing_stream(stream, "AsyncEventWaiter::wait_stream_async")?;
        let lease = self.slab(stream.context())?.lease(stream)?;
        Ok(self.wait_async_inner(Source::Word(lease), None, Box::new(callback)))
    }

    fn wait_async_inner(
        &self,
        source: Source,
        timeout: Option<Duration>,
        callback: Callback,
    ) -> WaitId {
        let id = self.ids.issue();
        let cell: Arc<Cell> = Arc::new(WaitCell::new());
        self.shared.callbacks.lock().insert(id, Arc::clone(&cell));
        self.register(Registration {
            cell,
            source,
            deadline: deadline(timeout),
            callback: Some((id, callback)),
        });
        id
    }

    /// Cancels a callback wait: `true` when this call cancelled it, after which its callback
    /// never runs; `false` when it had already completed, failed, timed out or been cancelled
    /// (its callback ran, runs now, or never will), and for an id another waiter issued
    /// (nothing of this waiter's is touched).
    pub fn cancel_wait(&self, id: WaitId) -> bool {
        if !self.ids.owns(id) {
            return false;
        }
        let cell = self.shared.callbacks.lock().remove(&id);
        cell.is_some_and(|cell| cell.cancel())
    }

    /// Waits the reactor still watches.
    pub fn pending(&self) -> usize {
        self.shared.counters.pending.load(Ordering::Relaxed)
    }

    /// The waiter's counters.
    pub fn stats(&self) -> WaiterStats {
        let counters = &self.shared.counters;
        WaiterStats {
            registered: counters.registered.load(Ordering::Relaxed),
            completed: counters.completed.load(Ordering::Relaxed),
            failed: counters.failed.load(Ordering::Relaxed),
            timed_out: counters.timed_out.load(Ordering::Relaxed),
            cancelled: counters.cancelled.load(Ordering::Relaxed),
            pending: counters.pending.load(Ordering::Relaxed),
        }
    }
}

impl Drop for AsyncEventWaiter {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.inbox.ring(&self.reactor);
        let Some(handle) = self.handle.take() else {
            return;
        };
        if handle.thread().id() == std::thread::current().id() {
            // The last handle was dropped on the reactor thread itself: a callback owned it
            // (a clone of an `Arc<AsyncEventWaiter>`, or of a coordinator that owns the
            // waiter, moved into the closure). Joining would join this very thread (a panic,
            // an abort under `panic = "abort"`); the reactor sees the flag once the callback
            // returns, shuts down as usual and exits by itself.
            drop(handle);
        } else if handle.join().is_err() {
            tracing::error!("the event reactor thread panicked");
        }
    }
}

/// When a wait of `timeout` times out; none for no timeout, or one past what a clock can hold
/// (`Duration::MAX`: as long as it takes).
fn deadline(timeout: Option<Duration>) -> Option<(Instant, Duration)> {
    timeout.and_then(|timeout| Some((Instant::now().checked_add(timeout)?, timeout)))
}

/// A future for the work queued on `stream` so far, served by [`AsyncEventWaiter::global`].
///
/// # Errors
/// As [`AsyncEventWaiter::stream_idle`].
pub fn stream_idle(stream: &Stream) -> Result<WaitFuture> {
    AsyncEventWaiter::global()?.stream_idle(stream)
}

/// A future for `event`, served by [`AsyncEventWaiter::global`].
///
/// # Errors
/// When the global waiter could not start.
pub fn event_done(event: impl WatchedEvent) -> Result<WaitFuture> {
    Ok(AsyncEventWaiter::global()?.event_done(event))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_ids_carry_their_waiter_and_a_foreign_one_cancels_nothing() {
        let (first, second) = (WaitIds::new(), WaitIds::new());
        let (a, b) = (first.issue(), second.issue());
        assert_eq!((a.number, b.number), (1, 1), "numbered per waiter");
        assert_ne!(a, b, "equal numbers of two waiters are different ids");
        assert!(first.owns(a) && second.owns(b));
        assert!(!second.owns(a) && !first.owns(b));
        assert_eq!(a.to_string(), "wait#1");
        assert_eq!(first.issue().number, 2);
    }

    /// A live callback wait of one waiter survives `cancel_wait` with another waiter's id of
    /// the same number; its own id cancels it. No GPU: the wait's cell is put in the map as
    /// `wait_async` does, without an event for the reactor to watch.
    #[test]
    fn cancel_wait_with_another_waiters_id_leaves_this_waiters_wait_alone() {
        let (first, second) = (
            AsyncEventWaiter::new().unwrap(),
            AsyncEventWaiter::new().unwrap(),
        );
        let (foreign, own) = (first.ids.issue(), second.ids.issue());
        let cell: Arc<Cell> = Arc::new(WaitCell::new());
        second
            .shared
            .callbacks
            .lock()
            .insert(own, Arc::clone(&cell));
        assert!(!second.cancel_wait(foreign));
        assert_eq!(second.shared.callbacks.lock().len(), 1, "nothing removed");
        assert!(second.cancel_wait(own));
        assert!(!second.cancel_wait(own), "cancelled once");
    }
}
