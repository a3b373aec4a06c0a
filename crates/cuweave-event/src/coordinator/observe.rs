//! How the coordinator observes completions: its own polls (on the caller's thread), the
//! waiter's watches (for callbacks), and what follows a decision (callbacks, retirement).

use std::sync::{Arc, Weak};

use cuweave_driver::OwnedPooledEvent;
use cuweave_driver::graph::{capture_is_active, outside_captures};

use super::capture_waits::{self, CapturedCompletion, captured_completion};
use super::metrics::MetricsCell;
use super::{CompletionCallback, Inner, Operation, OperationId, completion};
use crate::capture;
use crate::error::EventError;
use crate::waiter::WaitResult;

impl Inner {
    /// Has the waiter watch `id`'s completion event (for callbacks).
    ///
    /// The waiter does not keep the event: the operation does, until it is decided. An
    /// operation a poll decides first gives its event back to the pool at once. Were the
    /// waiter to keep it, every decided operation's event would stay out until the reactor's
    /// scan got to it, and a producer outpacing the reactor's driver queries (both contend for
    /// the context) would grow the event pool by the reactor's backlog.
    pub(super) fn watch(self: &Arc<Self>, id: OperationId, done: &Arc<OwnedPooledEvent>) {
        let inner: Weak<Inner> = Arc::downgrade(self);
        self.waiter.wait_while_held(done, move |result| {
            if let Some(inner) = inner.upgrade() {
                match &result {
                    Err(EventError::Driver(error)) if capture_waits::is_captured_event(error) => {
                        inner.on_captured_elsewhere(id);
                    }
                    _ => inner.on_gpu_complete(id, result),
                }
            }
        });
    }

    /// Has the waiter decide the operations recorded into `capture` once it has ended
    /// ([`decide_ended_capture`](Self::decide_ended_capture)), so that their callbacks run
    /// without a later coordinator call; it then polls for the rest. One watch per capture
    /// ([`State::watched_captures`](super::State)); it holds the coordinator weakly.
    pub(super) fn watch_capture_end(self: &Arc<Self>, capture: u64) {
        let inner: Weak<Inner> = Arc::downgrade(self);
        self.waiter.when_capture_ends(capture, move |_| {
            if let Some(inner) = inner.upgrade() {
                let decided = {
                    let mut state = inner.state.lock();
                    // Under the lock that decides: an operation of this capture queued with a
                    // callback after this point finds no watch and starts one, which fires at
                    // once (the capture has ended).
                    state.watched_captures.remove(&capture);
                    state.decide_captured(capture, capture_is_active)
                };
                inner.after_all_decided(decided);
                inner.poll();
            }
        });
    }

    /// Decides every queued operation recorded into `capture`, which has ended, and runs
    /// their callbacks: directly, not through a poll, which walks each stream from its front
    /// and would stop at eager work queued before them that the GPU has not finished (or
    /// whose query it skipped during another capture), with nothing to poll again later.
    /// Captured operations have no GPU time, so there is nothing to harvest first.
    pub(super) fn decide_ended_capture(&self, capture: u64) {
        let decided = self
            .state
            .lock()
            .decide_captured(capture, capture_is_active);
        self.after_all_decided(decided);
    }

    /// [`after_decided`](Self::after_decided) for each of `decided`, in order.
    fn after_all_decided(&self, decided: Vec<(OperationId, WaitResult, Vec<CompletionCallback>)>) {
        for (id, result, callbacks) in decided {
            self.after_decided(id, &result, callbacks);
        }
    }

    /// The waiter found `id`'s completion event recorded into a capture begun outside cuweave
    /// (it cannot be watched): decided now if that capture has ended, else left to the
    /// coordinator's polls, which decide it once it has (never `Failed` for that).
    fn on_captured_elsewhere(&self, id: OperationId) {
        let decided = {
            let mut state = self.state.lock();
            let Some(operation) = state.operations.get_mut(&id) else {
                return;
            };
            operation.watched = false;
            match operation.foreign_capture_ended() {
                Ok(false) => return,
                Ok(true) => (Ok(()), state.decide(id, &Ok(()))),
                Err(error) => {
                    let result = Err(EventError::from(error));
                    let callbacks = state.decide(id, &result);
                    (result, callbacks)
                }
            }
        };
        if let (result, Some(callbacks)) = decided {
            self.harvest_times();
            self.after_decided(id, &result, callbacks);
        }
    }

    /// Observes completions without blocking: on each stream, the oldest queued operations
    /// whose completion events the GPU has passed (a slow stream holds back only its own);
    /// then the finished GPU-time spans. Every operation taken off a queue is decided under
    /// the same lock, before any callback runs, so none is stranded whatever a callback does.
    pub(super) fn poll(&self) {
        let decided: Vec<_> = {
            let mut state = self.state.lock();
            let finished = state.take_finished(|op| {
                // A captured completion event cannot be queried (the driver refuses); its
                // capture says where the operation stands.
                if let Some(capture) = op.captured_into() {
                    return Ok(captured_completion(capture, capture_is_active)
                        == CapturedCompletion::Captured);
                }
                match &op.done {
                    // A query the coordinator makes of its own accord, on the caller's thread:
                    // only while no capture is active or beginning (a check of the capture
                    // count, then the query, would break a global-mode capture another thread
                    // began in between). Skipped: "not yet", as a refused query, asked again by
                    // a later poll.
                    Some(done) => match outside_captures(|| done.query()) {
                        None => Ok(false),
                        // Recorded into a capture begun outside cuweave, unseen at the record:
                        // complete once that capture has ended, as a cuweave capture's are.
                        Some(Err(error)) if capture_waits::is_captured_event(&error) => {
                            op.foreign_capture_ended()
                        }
                        Some(answer) => answer,
                    },
                    // A queued operation always has its event; without one there is nothing
                    // to see.
                    None => Ok(true),
                }
            });
            finished
                .into_iter()
                .filter_map(|(id, result)| {
                    let callbacks = state.decide(id, &result)?;
                    Some((id, result, callbacks))
                })
                .collect()
        };
        // GPU times first, so that a callback already finds its operation's.
        self.harvest_times();
        self.after_all_decided(decided);
    }

    /// Adds the GPU time of finished spans to the metrics (and to live operations' metadata).
    ///
    /// The harvest queries the spans' end events, of the coordinator's own accord. On the
    /// waiter's reactor thread, which holds relaxed capture mode
    /// ([`capture::holds_relaxed_mode`]), at once: the driver allows its queries during any
    /// capture on another thread, and they break none (the timer's end events were all
    /// recorded outside captures), so an operation the waiter decides during another thread's
    /// capture still has its GPU time when its callbacks run. On any other thread only while
    /// no capture is active or beginning, so that no global-mode capture another thread begins
    /// meanwhile is broken; skipped otherwise (the spans stay pending for a later harvest). A
    /// timer with nothing pending (timing off) asks nothing, and pays nothing for that.
    pub(super) fn harvest_times(&self) {
        // Taken first: a harvest under way on another thread may hold spans already taken out
        // of the timer, and their times are written before this returns.
        let _harvesting = self.harvesting.lock();
        if self.timer.pending() == 0 {
            return;
        }
        let mut times = Vec::new();
        // Made at once on the reactor, `Event::query` may wait out a capture begin under way
        // while this holds `harvesting` and the timer's lock: no thread inside
        // `outside_captures` waits for either (this takes `harvesting` before entering), so
        // the begin finishes.
        if let Some(Err(error)) = capture::own_query(capture::holds_relaxed_mode(), || {
            self.timer.harvest(|tag, time, _| times.push((tag, time)))
        }) {
            tracing::warn!(%error, "reading an operation's GPU time");
        }
        if times.is_empty() {
            return;
        }
        let mut state = self.state.lock();
        for ((id, operation_type), time) in times {
            self.metrics.add_gpu_time(operation_type, time);
            if let Some(op) = state.operations.get_mut(&id) {
                op.metadata.gpu_time = Some(time);
            }
        }
    }

    /// Called once the GPU reached (or failed to reach) `id`'s completion event, by the
    /// waiter's thread; the second report (a poll decided it first) is ignored.
    fn on_gpu_complete(&self, id: OperationId, result: WaitResult) {
        let Some(callbacks) = self.state.lock().decide(id, &result) else {
            return;
        };
        self.harvest_times();
        self.after_decided(id, &result, callbacks);
    }

    /// What follows a decision: the counters, the wake-up of `wait_until_ready`, the callbacks
    /// (each contained: one that panics stops neither the others nor the retirement), then
    /// retirement.
    fn after_decided(
        &self,
        id: OperationId,
        result: &WaitResult,
        callbacks: Vec<CompletionCallback>,
    ) {
        if result.is_ok() {
            MetricsCell::add(&self.metrics.completed, 1);
        } else {
            MetricsCell::add(&self.metrics.failed, 1);
        }
        self.changed.notify_all();
        let panicked = completion::run_callbacks(id, callbacks, result);
        MetricsCell::add(&self.metrics.callback_panics, panicked);
        self.state.lock().try_retire(id);
    }
}

impl Operation {
    /// Whether the capture begun outside cuweave that its completion event went into
    /// ([`capture_waits::is_captured_event`]) has ended, asked of its stream
    /// ([`capture_waits::foreign_capture_ended`]); with no stream there is nothing to wait for.
    fn foreign_capture_ended(&self) -> Result<bool, cuweave_driver::DriverError> {
        self.stream.as_ref().map_or(Ok(true), |stream| {
            capture_waits::foreign_capture_ended(stream.as_stream())
        })
    }
}
