//! [`StreamTracker`]: the last use of a buffer on a stream, and ordering every later use after it.
//!
//! The protocol, which every operation on a buffer follows through [`run`]:
//!
//! 1. the stream about to use the buffer waits (device-side, `cuStreamWaitEvent`) for the
//!    event recorded after the buffer's previous use;
//! 2. the operation is queued;
//! 3. the event is recorded again on this stream.
//!
//! So the event, whenever it completes, proves that *every* earlier use of the buffer has
//! finished (each recording waited for the one before). Later uses on other streams are ordered
//! after it, host access synchronizes it, and the buffer's `Drop` synchronizes it before the
//! memory is freed. The three steps run under the tracker's lock so that two threads using one
//! buffer through `&self` cannot interleave them; the lock covers only the queueing calls
//! (which do not wait for the GPU, except a device-to-pageable-host copy, which the driver
//! performs synchronously), never a wait on an event.

use std::sync::Arc;

use cuweave_driver::{Context, Event, EventFlags, Stream};
use parking_lot::{Mutex, MutexGuard};

use crate::error::{MemoryError, Result};

/// Remembers the last stream that used a buffer, as an event recorded after that use.
///
/// Part of every buffer; reached through the [`Buffer`](super::Buffer) methods `prepare_use`,
/// `record_use`, `last_use`, `is_idle` and `synchronize`.
#[derive(Debug)]
pub struct StreamTracker {
    context: Arc<Context>,
    state: Mutex<TrackerState>,
}

#[derive(Debug, Default)]
struct TrackerState {
    /// Created on first use; recorded after every use since.
    event: Option<Arc<Event>>,
    /// Raw handle of the stream the event was last recorded on (`None`: never recorded).
    last_stream: Option<usize>,
}

impl TrackerState {
    fn ensure_event(&mut self, context: &Arc<Context>) -> Result<()> {
        if self.event.is_none() {
            self.event = Some(Arc::new(Event::new(context, EventFlags::DISABLE_TIMING)?));
        }
        Ok(())
    }

    fn wait_on(&self, stream: &Stream) -> Result<()> {
        if let (Some(event), Some(_)) = (&self.event, self.last_stream) {
            stream.wait_event(event)?;
        }
        Ok(())
    }

    fn record(&mut self, stream: &Stream) -> Result<()> {
        let event = self
            .event
            .as_ref()
            .expect("run creates the event before queueing work");
        event.record(stream)?;
        self.last_stream = Some(stream.as_raw() as usize);
        Ok(())
    }
}

impl StreamTracker {
    /// A tracker for a buffer of `context` that has not been used yet.
    pub(crate) fn new(context: &Arc<Context>) -> Self {
        Self {
            context: Arc::clone(context),
            state: Mutex::new(TrackerState::default()),
        }
    }

    /// The context of the buffer this tracker belongs to.
    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// The raw handle of the stream that last used the buffer (0 is the legacy default stream,
    /// which blocking operations use), or `None` if it was never used on a stream.
    pub(crate) fn last_use(&self) -> Option<usize> {
        self.state.lock().last_stream
    }

    fn event(&self) -> Option<Arc<Event>> {
        let state = self.state.lock();
        state.last_stream.and(state.event.clone())
    }

    /// Blocks until the last use (and so every use) has finished on the device.
    pub(crate) fn synchronize(&self) -> Result<()> {
        // The event is cloned out so that no lock is held while the host waits for the GPU.
        if let Some(event) = self.event() {
            event.synchronize()?;
        }
        Ok(())
    }

    /// Whether every use has finished, without blocking.
    pub(crate) fn is_idle(&self) -> Result<bool> {
        match self.event() {
            Some(event) => Ok(event.query()?),
            None => Ok(true),
        }
    }

    /// `Err(DeviceBusy)` unless every use has finished.
    pub(crate) fn ensure_idle(&self, operation: &'static str) -> Result<()> {
        if self.is_idle()? {
            Ok(())
        } else {
            Err(MemoryError::DeviceBusy {
                operation,
                stream: self.last_use().unwrap_or_default(),
            })
        }
    }

    /// Makes `stream` wait (device-side) for every use so far, without recording a new one.
    pub(crate) fn prepare_use(&self, operation: &'static str, stream: &Stream) -> Result<()> {
        ensure_same_device(operation, &self.context, stream)?;
        self.state.lock().wait_on(stream)
    }

    /// Records `stream` as the last user, after making it wait for the previous one.
    pub(crate) fn record_use(&self, operation: &'static str, stream: &Stream) -> Result<()> {
        run(operation, stream, &[self], || Ok(())).map_err(|failure| failure.error)
    }

    /// Waits for the last use, logging instead of failing: for `Drop`.
    pub(crate) fn synchronize_for_drop(&self, what: &'static str) {
        if let Err(error) = self.synchronize() {
            tracing::error!(%error, what, "waiting for a buffer's last use before freeing it failed");
        }
    }
}

/// `Err(WrongDevice)` unless `stream` runs on `context`'s device.
pub(crate) fn ensure_same_device(
    operation: &'static str,
    context: &Context,
    stream: &Stream,
) -> Result<()> {
    let (expected, actual) = (context.device(), stream.device());
    if expected == actual {
        Ok(())
    } else {
        Err(MemoryError::WrongDevice {
            operation,
            expected: expected.ordinal(),
            actual: actual.ordinal(),
        })
    }
}

/// Why [`run`] failed, and whether the stream was drained afterwards.
#[derive(Debug)]
pub(crate) struct OpFailure {
    /// The first error.
    pub(crate) error: MemoryError,
    /// `true` when no work of this call can still be running: nothing was queued, or the
    /// stream was synchronized after the failure. `false` only when that synchronization failed
    /// too; host memory handed to the operation must then be leaked, not freed.
    pub(crate) settled: bool,
}

impl From<OpFailure> for MemoryError {
    fn from(failure: OpFailure) -> Self {
        failure.error
    }
}

/// Runs `op` (which queues work on `stream` touching the buffers of `trackers`) under the
/// ordering protocol: `stream` first waits for each buffer's last use, and afterwards is
/// recorded as each buffer's last user.
///
/// If `op` or a recording fails after work may have been queued, the stream is synchronized
/// before returning, so no untracked work is left running.
pub(crate) fn run<R>(
    operation: &'static str,
    stream: &Stream,
    trackers: &[&StreamTracker],
    op: impl FnOnce() -> Result<R>,
) -> Result<R, OpFailure> {
    let unqueued = |error: MemoryError| OpFailure {
        error,
        settled: true,
    };
    for tracker in trackers {
        ensure_same_device(operation, &tracker.context, stream).map_err(unqueued)?;
    }
    let mut guards = lock_in_address_order(trackers);
    for (tracker, state) in &mut guards {
        state.ensure_event(&tracker.context).map_err(unqueued)?;
    }
    for (_, state) in &guards {
        // Waits touch no memory: a failure here leaves nothing unsafe queued.
        state.wait_on(stream).map_err(unqueued)?;
    }
    let outcome = op();
    let mut recorded = Ok(());
    for (_, state) in &mut guards {
        if let Err(error) = state.record(stream) {
            recorded = recorded.and(Err(error));
        }
    }
    drop(guards);
    match (outcome, recorded) {
        (Ok(value), Ok(())) => Ok(value),
        (outcome, recorded) => {
            let error = match (outcome, recorded) {
                (Err(error), _) | (Ok(_), Err(error)) => error,
                (Ok(_), Ok(())) => unreachable!("handled above"),
            };
            Err(OpFailure {
                error,
                settled: settle(stream),
            })
        }
    }
}

/// Synchronizes `stream` after a failure; `false` (logged) if even that fails.
pub(crate) fn settle(stream: &Stream) -> bool {
    match stream.synchronize() {
        Ok(()) => true,
        Err(error) => {
            tracing::error!(%error, "synchronizing a stream after a failed buffer operation failed");
            false
        }
    }
}

/// Locks each distinct tracker once, in address order, so that two operations locking the same
/// trackers cannot deadlock.
fn lock_in_address_order<'a>(
    trackers: &[&'a StreamTracker],
) -> Vec<(&'a StreamTracker, MutexGuard<'a, TrackerState>)> {
    let mut sorted = trackers.to_vec();
    sorted.sort_by_key(|tracker| std::ptr::from_ref(*tracker) as usize);
    sorted.dedup_by_key(|tracker| std::ptr::from_ref(*tracker) as usize);
    sorted
        .into_iter()
        .map(|tracker| (tracker, tracker.state.lock()))
        .collect()
}
