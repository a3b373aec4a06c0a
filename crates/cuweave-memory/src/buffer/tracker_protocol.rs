//! The ordering protocol every operation on a buffer follows ([`run`], [`run_uses`],
//! [`run_completed`]), over the parts of tracked buffers it uses ([`Part`]); the tracker's
//! module docs describe it.

use std::sync::Arc;

use cuweave_driver::graph::{CaptureStatus, LaunchesAfter, active_captures};
use cuweave_driver::{Context, OwnedPooledEvent, Stream};
use parking_lot::MutexGuard;

use super::super::uses::{ByteRange, CaptureView, Capturing, FencedCaptures, UseState};
use super::{Access, StreamTracker, Tracked};
use crate::error::{MemoryError, Result};

/// Part of a tracked buffer: its tracker, the bytes a use touches, and whether the borrow it
/// came from allows writing them (a shared view does not).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Part<'a> {
    /// The buffer's tracker.
    pub(crate) tracker: &'a StreamTracker,
    /// The bytes, relative to the buffer's first byte.
    pub(crate) range: ByteRange,
    /// `false` for a shared view: a write through it is refused.
    pub(crate) writable: bool,
}

impl<'a> Part<'a> {
    /// The whole buffer of `tracker`, writable.
    pub(crate) fn whole(tracker: &'a StreamTracker) -> Self {
        Self {
            tracker,
            range: ByteRange::WHOLE,
            writable: true,
        }
    }

    /// `Err(ReadOnlyView)` for a write through a shared view.
    pub(crate) fn check(&self, operation: &'static str, access: Access) -> Result<()> {
        if access == Access::Write && !self.writable {
            Err(MemoryError::ReadOnlyView { operation })
        } else {
            Ok(())
        }
    }

    /// Makes `stream` wait (device-side) for the uses an `access` of this part conflicts with,
    /// without recording a new one.
    pub(crate) fn prepare(
        &self,
        operation: &'static str,
        stream: &Stream,
        access: Access,
    ) -> Result<()> {
        self.check(operation, access)?;
        ensure_same_device(operation, self.tracker.context(), stream)?;
        let view = capture_view(self.tracker, stream, operation)?;
        wait_before_use(
            &mut self.tracker.state.lock(),
            self.tracker.context(),
            operation,
            stream,
            self.range,
            access,
            &view,
        )
    }

    /// Records an `access` of this part by the work just queued on `stream`, after making
    /// `stream` wait for the uses it conflicts with.
    pub(crate) fn record(
        &self,
        operation: &'static str,
        stream: &Stream,
        access: Access,
    ) -> Result<()> {
        run_uses(operation, stream, &[(*self, access)], || Ok(())).map_err(|failure| failure.error)
    }
}

/// Makes `stream` wait for what a `range` / `access` use conflicts with, before the use is
/// queued: the tracked uses ([`UseState::wait_on_range`]) and, for a buffer a capture used,
/// the launches of that capture's graphs on the context's other streams (those of captures
/// that used bytes of `range`; for a read, that wrote some). A launch records no use here (see
/// the [module docs]), so without the second eager work on another stream could overlap a replay
/// that reads or writes the memory. A capturing stream waits for no launch (the wait would
/// break its capture; its captured uses follow the rules of [`super::uses`]).
///
/// A cached buffer not yet used on another stream first orders `stream` after its allocation
/// stream ([`Origin`](super::Origin)), so that work queued there unrecorded before the buffer
/// got the memory cannot race this use.
///
/// [module docs]: super
/// [`super::uses`]: super::super::uses
#[inline]
fn wait_before_use(
    state: &mut Tracked,
    context: &Arc<Context>,
    operation: &'static str,
    stream: &Stream,
    range: ByteRange,
    access: Access,
    view: &CaptureView,
) -> Result<()> {
    if let Some(origin) = &state.origin
        && origin.order(context, stream, view)?
    {
        state.origin = None;
    }
    if state.used_in_graphs() && view.capture.is_none() {
        cuweave_driver::graph::wait_for_graph_launches(stream, |capture| {
            state.waits_for_capture(capture, range, access)
        })?;
    }
    state.wait_on_range(operation, stream, range, access, view)
}

/// The captures whose graphs' launches must be ordered after an eager `access` of `range` just
/// recorded ([`UseState::launches_after`]); `None` for a use recorded into a capture (it
/// belongs to that graph) and for a buffer no capture used.
#[inline]
fn launches_after(
    state: &UseState<OwnedPooledEvent>,
    range: ByteRange,
    access: Access,
    view: &CaptureView,
) -> Option<FencedCaptures> {
    if view.capture.is_some() || !state.used_in_graphs() {
        return None;
    }
    state.launches_after(range, access)
}

/// Records one event on `stream` behind eager work just queued there, taken from `tracker`'s
/// pool, as the fence the launches of the graphs of `fenced` wait for on other streams
/// ([`cuweave_driver::graph::fence_eager_use`]).
///
/// # Errors
/// The driver's error when the event cannot be recorded: the caller then drains the stream,
/// so no unfenced work is left running.
#[cold]
fn fence_for_launches(
    tracker: &StreamTracker,
    stream: &Stream,
    fenced: &FencedCaptures,
) -> Result<()> {
    let event = tracker.event_for(stream)?;
    event.record(stream)?;
    let after = match fenced {
        FencedCaptures::These(captures) => LaunchesAfter::Captures(captures),
        FencedCaptures::Any => LaunchesAfter::AnyCapture,
    };
    cuweave_driver::graph::fence_eager_use(stream, after, event);
    Ok(())
}

/// Where `stream` stands with respect to capture, for a use of `tracker`'s buffer: one atomic
/// load while no capture is active anywhere.
///
/// # Errors
/// [`MemoryError::GraphAllocation`] when the buffer's memory is a graph allocation and `stream`
/// does not capture into that graph's capture; the driver's error from the status query.
#[inline]
fn capture_view(
    tracker: &StreamTracker,
    stream: &Stream,
    operation: &'static str,
) -> Result<CaptureView> {
    let view = if active_captures() == 0 {
        CaptureView::NONE
    } else {
        capture_view_slow(tracker.context(), stream)?
    };
    match tracker.graph_allocation_of {
        Some(capture) if view.capture.is_none_or(|c| c.id != capture) => {
            Err(MemoryError::GraphAllocation { operation, capture })
        }
        _ => Ok(view),
    }
}

#[cold]
fn capture_view_slow(context: &Context, stream: &Stream) -> Result<CaptureView> {
    // A thread that has not used the context yet (another thread's eager work) gets it current
    // before asking the driver about the stream.
    stream.context().bind_to_thread()?;
    let capture = match stream.capture_status()? {
        CaptureStatus::None => None,
        status => status.id().map(|id| Capturing {
            id,
            complete_before: cuweave_driver::graph::known_complete_before(id, context),
        }),
    };
    if let Some(capturing) = capture {
        // A tracked buffer is about to be used in this capture: its graph's launches leave
        // fences for eager work on other streams to wait on (`wait_before_use`).
        cuweave_driver::graph::note_tracked_use(capturing.id);
    }
    Ok(CaptureView {
        any_active: true,
        capture,
    })
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

/// Runs `op` (which queues work on `stream` writing the buffers of `trackers`) under the
/// ordering protocol; see [`run_uses`].
pub(crate) fn run<R>(
    operation: &'static str,
    stream: &Stream,
    trackers: &[&StreamTracker],
    op: impl FnOnce() -> Result<R>,
) -> Result<R, OpFailure> {
    match trackers {
        [tracker] => run_uses(
            operation,
            stream,
            &[(Part::whole(tracker), Access::Write)],
            op,
        ),
        _ => {
            let uses: Vec<_> = trackers
                .iter()
                .map(|tracker| (Part::whole(tracker), Access::Write))
                .collect();
            run_uses(operation, stream, &uses, op)
        }
    }
}

/// Runs `op` (which queues work on `stream` using the buffers of `uses`, each as its
/// [`Access`] says) under the ordering protocol: `stream` first waits for the uses each access
/// conflicts with, and afterwards each access is recorded.
///
/// A buffer listed twice counts as written if either entry writes it. If `op` or a recording
/// fails after work may have been queued, the stream is synchronized before returning, so no
/// untracked work is left running.
pub(crate) fn run_uses<R>(
    operation: &'static str,
    stream: &Stream,
    uses: &[(Part<'_>, Access)],
    op: impl FnOnce() -> Result<R>,
) -> Result<R, OpFailure> {
    let unqueued = |error: MemoryError| OpFailure {
        error,
        settled: true,
    };
    for (part, access) in uses {
        part.check(operation, *access).map_err(unqueued)?;
        ensure_same_device(operation, part.tracker.context(), stream).map_err(unqueued)?;
    }
    if let [(part, access)] = uses {
        // One buffer: no sorting, no allocation.
        let tracker = part.tracker;
        let view = capture_view(tracker, stream, operation).map_err(unqueued)?;
        let mut state = tracker.state.lock();
        wait_before_use(
            &mut state,
            tracker.context(),
            operation,
            stream,
            part.range,
            *access,
            &view,
        )
        .map_err(unqueued)?;
        let outcome = op();
        let recorded =
            state.record_range(stream, part.range, *access, &view, || tracker.new_event());
        let fenced = launches_after(&state, part.range, *access, &view);
        drop(state);
        let recorded = match fenced {
            Some(fenced) => recorded.and_then(|()| fence_for_launches(tracker, stream, &fenced)),
            None => recorded,
        };
        return finish(outcome, recorded, stream);
    }
    let views = uses
        .iter()
        .map(|(part, _)| capture_view(part.tracker, stream, operation))
        .collect::<Result<Vec<_>>>()
        .map_err(unqueued)?;
    let view_of = |tracker: &StreamTracker| {
        uses.iter()
            .position(|(part, _)| std::ptr::eq(part.tracker, tracker))
            .map_or(CaptureView::NONE, |index| views[index])
    };
    let (mut guards, order) = lock_in_address_order(uses);
    for &(guard, range, access) in &order {
        let view = view_of(guards[guard].0);
        let (tracker, state) = &mut guards[guard];
        // Waits touch no memory: a failure here leaves nothing unsafe queued.
        wait_before_use(
            state,
            tracker.context(),
            operation,
            stream,
            range,
            access,
            &view,
        )
        .map_err(unqueued)?;
    }
    let outcome = op();
    let mut recorded = Ok(());
    // The captures to fence for, over every buffer, and a tracker to take the event from.
    let mut fenced: Option<(FencedCaptures, &StreamTracker)> = None;
    for &(guard, range, access) in &order {
        let view = view_of(guards[guard].0);
        let (tracker, state) = &mut guards[guard];
        if let Err(error) = state.record_range(stream, range, access, &view, || tracker.new_event())
        {
            recorded = recorded.and(Err(error));
        }
        if let Some(captures) = launches_after(state, range, access, &view) {
            match &mut fenced {
                Some((all, _)) => all.merge(captures),
                None => fenced = Some((captures, *tracker)),
            }
        }
    }
    drop(guards);
    let recorded = match fenced {
        Some((fenced, tracker)) => {
            recorded.and_then(|()| fence_for_launches(tracker, stream, &fenced))
        }
        None => recorded,
    };
    finish(outcome, recorded, stream)
}

/// Runs a *blocking* `op` that uses one buffer on `stream`: the stream waits for the uses the
/// access conflicts with, `op` does the work on `stream` and returns only once it, and so
/// everything queued on `stream` before it, has completed (the driver's blocking copies on the
/// legacy stream do), and the tracker then forgets what is now known to be finished
/// ([`UseState::settle_range`]) instead of recording an event behind work that is done.
///
/// The lock is held until the state is settled, so no other thread's use can slip between the
/// completed work and the settling. On failure the stream is drained and the state is left as
/// it was (still tracking every earlier use).
pub(crate) fn run_completed<R>(
    operation: &'static str,
    stream: &Stream,
    part: Part<'_>,
    access: Access,
    op: impl FnOnce() -> Result<R>,
) -> Result<R, OpFailure> {
    let unqueued = |error: MemoryError| OpFailure {
        error,
        settled: true,
    };
    part.check(operation, access).map_err(unqueued)?;
    ensure_same_device(operation, part.tracker.context(), stream).map_err(unqueued)?;
    let view = capture_view(part.tracker, stream, operation).map_err(unqueued)?;
    let mut state = part.tracker.state.lock();
    wait_before_use(
        &mut state,
        part.tracker.context(),
        operation,
        stream,
        part.range,
        access,
        &view,
    )
    .map_err(unqueued)?;
    match op() {
        Ok(value) => {
            state.settle_range(stream, part.range, access);
            Ok(value)
        }
        Err(error) => Err(OpFailure {
            error,
            settled: settle(stream),
        }),
    }
}

fn finish<R>(outcome: Result<R>, recorded: Result<()>, stream: &Stream) -> Result<R, OpFailure> {
    match (outcome, recorded) {
        (Ok(value), Ok(())) => Ok(value),
        (Err(error), _) | (Ok(_), Err(error)) => Err(OpFailure {
            error,
            settled: settle(stream),
        }),
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

/// The locked state of one tracker.
type Locked<'a> = (&'a StreamTracker, MutexGuard<'a, Tracked>);

/// Locks each distinct tracker once, in address order, so that two operations locking the same
/// trackers cannot deadlock; returns the guards and, for each use, its guard's index, range and
/// access (a tracker listed twice, say for a copy between two parts of one buffer, is locked
/// once and keeps both uses).
fn lock_in_address_order<'a>(
    uses: &[(Part<'a>, Access)],
) -> (Vec<Locked<'a>>, Vec<(usize, ByteRange, Access)>) {
    let mut sorted = uses.to_vec();
    sorted.sort_by_key(|(part, _)| std::ptr::from_ref(part.tracker) as usize);
    let mut guards: Vec<Locked<'a>> = Vec::with_capacity(sorted.len());
    let mut order = Vec::with_capacity(sorted.len());
    for (part, access) in sorted {
        if !guards
            .last()
            .is_some_and(|(tracker, _)| std::ptr::eq(*tracker, part.tracker))
        {
            guards.push((part.tracker, part.tracker.state.lock()));
        }
        order.push((guards.len() - 1, part.range, access));
    }
    // Reads first: a write of the same tracker recorded after them retires what it covers.
    order.sort_by_key(|&(_, _, access)| access == Access::Write);
    (guards, order)
}
