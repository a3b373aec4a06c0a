//! [`MultiStreamCoordinator`]: dependencies between streams as device-side, point-in-time event
//! waits (always accepted; cycles are a diagnostic); barriers; running a closure on every stream
//! in parallel; completion callbacks.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{Result, StreamError, panic_message};
use crate::stream::PriorityStream;

mod barrier;
mod cycles;
mod graph;

pub use barrier::{BarrierInfo, queue_barrier};
pub use graph::DependencyGraph;

/// Past this many streams, [`MultiStreamCoordinator::add_stream`] first retires the streams only
/// the coordinator holds whose work has finished.
pub const RETIRE_STREAMS_AT: usize = 64;

/// Counts of what the coordinator has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorStats {
    /// Dependencies queued as event waits.
    pub dependencies: u64,
    /// Barriers queued.
    pub barriers: u64,
    /// `execute_parallel` runs.
    pub parallel_runs: u64,
}

/// Coordinates work across a set of [`PriorityStream`]s.
///
/// - [`add_dependency`](Self::add_dependency): the dependent stream waits on the GPU
///   (`cuStreamWaitEvent`) for the work queued on the prerequisite so far (an event recorded
///   there now). Such a point-in-time wait can never deadlock (it waits only for work already
///   queued), so every one is accepted: `add_dependency(compute, copy)` then
///   `add_dependency(copy, compute)` is the alternation of a double-buffered pipeline. The
///   dependencies declared since the last barrier or [`reset`](Self::reset) form a graph that
///   [`has_cycles`](Self::has_cycles) and [`cycles`](Self::cycles) inspect, as a diagnostic.
/// - [`create_barrier`](Self::create_barrier): every stream waits for the work queued so far on
///   every other, on the device, through the one fan-in/fan-out [`queue_barrier`]; the host
///   does not block.
/// - [`execute_parallel`](Self::execute_parallel): a closure per stream on its own thread, every
///   error collected.
/// - [`on_stream_complete`](Self::on_stream_complete) /
///   [`on_all_complete`](Self::on_all_complete): callbacks when the GPU has finished the work
///   queued so far (through [`PriorityStream::add_callback`], so they may call CUDA).
///
/// ```no_run
/// use std::sync::Arc;
/// use cuweave_driver::{Context, Device};
/// use cuweave_stream::{MultiStreamCoordinator, PriorityStream, StreamPriority};
///
/// # fn main() -> cuweave_stream::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let [a, b] = [(); 2].map(|_| Arc::new(PriorityStream::new(&context, StreamPriority::Normal).unwrap()));
/// let coordinator = MultiStreamCoordinator::new();
/// coordinator.add_dependency(&b, &a)?; // b waits for a's work so far
/// coordinator.add_dependency(&a, &b)?; // then a waits for b's work so far: ping-pong
/// assert!(coordinator.has_cycles()); // a diagnostic, never a refusal
/// coordinator.create_barrier()?; // the graph starts afresh
/// assert!(!coordinator.has_cycles());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Default)]
pub struct MultiStreamCoordinator {
    streams: Mutex<Vec<Arc<PriorityStream>>>,
    /// How many streams the list may hold before adding one retires the streams no one else
    /// holds (0: [`RETIRE_STREAMS_AT`]); twice what a retirement kept.
    retire_at: AtomicUsize,
    graph: Mutex<DependencyGraph>,
    dependencies: AtomicU64,
    barriers: AtomicU64,
    parallel_runs: AtomicU64,
}

impl MultiStreamCoordinator {
    /// A coordinator with no streams yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A coordinator over `streams`.
    pub fn with_streams(streams: impl IntoIterator<Item = Arc<PriorityStream>>) -> Self {
        let coordinator = Self::new();
        for stream in streams {
            coordinator.add_stream(stream);
        }
        coordinator
    }

    /// Adds a stream (again adding one already there does nothing).
    ///
    /// The list is bounded for programs that order short-lived streams: past
    /// [`RETIRE_STREAMS_AT`] streams (and then twice what the last retirement kept), adding one
    /// first retires the streams that only the coordinator still holds and whose work has
    /// finished. No one can queue work on those any more, so no barrier or callback needs them.
    pub fn add_stream(&self, stream: Arc<PriorityStream>) {
        let mut streams = self.streams.lock();
        if streams.iter().any(|own| own.id() == stream.id()) {
            return;
        }
        let mut retired = Vec::new();
        if streams.len()
            >= self
                .retire_at
                .load(Ordering::Relaxed)
                .max(RETIRE_STREAMS_AT)
        {
            // No other thread can clone a stream out meanwhile (`streams` clones under the
            // lock), so a count of one means the coordinator is the last holder.
            streams.retain(|own| {
                let keep = Arc::strong_count(own) > 1 || !matches!(own.query(), Ok(true));
                if !keep {
                    retired.push(own.id());
                }
                keep
            });
            self.retire_at.store(2 * streams.len(), Ordering::Relaxed);
        }
        streams.push(stream);
        drop(streams);
        if !retired.is_empty() {
            let mut graph = self.graph.lock();
            for id in retired {
                graph.remove(id);
            }
        }
    }

    /// Removes a stream and the dependencies declared on it (waits already queued stay queued).
    pub fn remove_stream(&self, stream: &PriorityStream) {
        self.streams.lock().retain(|own| own.id() != stream.id());
        self.graph.lock().remove(stream.id());
    }

    /// The streams coordinated, in the order they were added.
    pub fn streams(&self) -> Vec<Arc<PriorityStream>> {
        self.streams.lock().clone()
    }

    /// Makes `dependent` wait on the device for the work queued on `prerequisite` so far, and
    /// declares the dependency. Both streams are added to the coordinator.
    ///
    /// Never refused for a cycle: the wait is for work already queued, which cannot depend on
    /// work queued later. The edge joins the diagnostic graph ([`has_cycles`](Self::has_cycles)).
    ///
    /// # Errors
    /// [`StreamError::SelfDependency`] for a stream and itself; the driver's error from the
    /// event record or wait.
    pub fn add_dependency(
        &self,
        dependent: &Arc<PriorityStream>,
        prerequisite: &Arc<PriorityStream>,
    ) -> Result<()> {
        if dependent.id() == prerequisite.id() {
            return Err(StreamError::SelfDependency {
                operation: "MultiStreamCoordinator::add_dependency",
                stream: dependent.id(),
            });
        }
        // The wait first: a refused one (a capture's boundary) leaves the coordinator as it was.
        dependent.wait_for(prerequisite)?;
        self.add_stream(Arc::clone(dependent));
        self.add_stream(Arc::clone(prerequisite));
        self.graph
            .lock()
            .add_unchecked(dependent.id(), prerequisite.id());
        self.dependencies.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The dependencies declared since the last barrier or reset, as
    /// `(dependent id, prerequisite id)`.
    pub fn dependencies(&self) -> Vec<(u64, u64)> {
        self.graph.lock().edges()
    }

    /// A copy of the dependency graph since the last barrier or reset.
    pub fn graph(&self) -> DependencyGraph {
        self.graph.lock().clone()
    }

    /// Whether the dependencies declared since the last barrier or reset contain a cycle: a
    /// diagnostic (ping-pong between two streams is one, and is correct), never a refusal.
    pub fn has_cycles(&self) -> bool {
        self.graph.lock().has_cycles()
    }

    /// The cycles among the dependencies declared since the last barrier or reset, one per
    /// strongly connected part.
    pub fn cycles(&self) -> Vec<Vec<u64>> {
        self.graph.lock().cycles()
    }

    /// Forgets the declared dependencies (the waits already queued stay queued): the graph of
    /// [`has_cycles`](Self::has_cycles) starts afresh. A barrier does the same.
    pub fn reset(&self) {
        self.graph.lock().clear();
    }

    /// Queues a barrier over every coordinated stream ([`queue_barrier`]: fanned in to the
    /// first stream and out again, `2 (n - 1)` waits). Work queued after it on any stream starts
    /// only once the work queued before it on all streams has finished. The host does not
    /// block. The diagnostic dependency graph starts afresh.
    ///
    /// # Errors
    /// The driver's error from an event record or wait; the waits queued before it stay queued
    /// and are noted on their streams, as a complete barrier's are.
    pub fn create_barrier(&self) -> Result<BarrierInfo> {
        let streams = self.streams();
        let pairs: Vec<_> = streams
            .iter()
            .map(|stream| (stream.stream(), stream.event_pool()))
            .collect();
        let queued = queue_barrier(&pairs);
        if streams.len() > 1 {
            // Every stream waits (the hub for the others, the others for the hub); noted after
            // a failure part way too, since the waits queued before it stay queued and hold
            // their streams (a note too many costs one stream query).
            for stream in &streams {
                stream.note_queued_wait();
            }
        }
        let info = queued?;
        self.graph.lock().clear();
        self.barriers.fetch_add(1, Ordering::Relaxed);
        Ok(info)
    }

    /// Runs `f` on every stream, each on its own thread, and waits for all of them.
    ///
    /// # Errors
    /// [`StreamError::Parallel`] listing every stream whose closure failed or panicked (a panic
    /// becomes [`StreamError::Panicked`]); `Ok` only when all succeeded.
    pub fn execute_parallel<F>(&self, f: F) -> Result<()>
    where
        F: Fn(&PriorityStream) -> Result<()> + Sync,
    {
        let streams = self.streams();
        self.parallel_runs.fetch_add(1, Ordering::Relaxed);
        let f = &f;
        let mut failures: Vec<(u64, StreamError)> = std::thread::scope(|scope| {
            let handles: Vec<_> = streams
                .iter()
                .map(|stream| {
                    let id = stream.id();
                    let handle = scope.spawn(move || {
                        std::panic::catch_unwind(AssertUnwindSafe(|| f(stream))).unwrap_or_else(
                            |payload| {
                                Err(StreamError::Panicked {
                                    operation: "MultiStreamCoordinator::execute_parallel",
                                    stream: id,
                                    message: panic_message(&*payload),
                                })
                            },
                        )
                    });
                    (id, handle)
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|(id, handle)| match handle.join() {
                    Ok(Ok(())) => None,
                    Ok(Err(error)) => Some((id, error)),
                    Err(payload) => Some((
                        id,
                        StreamError::Panicked {
                            operation: "MultiStreamCoordinator::execute_parallel",
                            stream: id,
                            message: panic_message(&*payload),
                        },
                    )),
                })
                .collect()
        });
        if failures.is_empty() {
            Ok(())
        } else {
            failures.sort_by_key(|(id, _)| *id);
            Err(StreamError::Parallel { failures })
        }
    }

    /// Runs `callback` on a cuweave worker thread once the GPU has finished the work queued on
    /// `stream` so far.
    ///
    /// # Errors
    /// As [`PriorityStream::add_callback`]: refused with
    /// [`GraphError::Capturing`](cuweave_driver::graph::GraphError::Capturing) on a capturing
    /// stream.
    pub fn on_stream_complete(
        &self,
        stream: &PriorityStream,
        callback: impl FnOnce() + Send + 'static,
    ) -> Result<()> {
        stream.refuse_callbacks_while_capturing("MultiStreamCoordinator::on_stream_complete")?;
        stream.queue_callback(Box::new(callback))
    }

    /// Runs `callback` once the GPU has finished the work queued so far on every coordinated
    /// stream (on the worker of the stream that finished last). With no streams it runs at once,
    /// on this thread.
    ///
    /// # Errors
    /// [`GraphError::Capturing`](cuweave_driver::graph::GraphError::Capturing) when any
    /// coordinated stream is capturing, before anything is queued (`callback` is dropped);
    /// otherwise as [`PriorityStream::add_callback`]: streams queued before a failure still
    /// count down, so `callback` does not run then.
    pub fn on_all_complete(&self, callback: impl FnOnce() + Send + 'static) -> Result<()> {
        let streams = self.streams();
        if streams.is_empty() {
            callback();
            return Ok(());
        }
        for stream in &streams {
            stream.refuse_callbacks_while_capturing("MultiStreamCoordinator::on_all_complete")?;
        }
        let remaining = Arc::new(AtomicUsize::new(streams.len()));
        let callback = Arc::new(Mutex::new(Some(callback)));
        for stream in &streams {
            let remaining = Arc::clone(&remaining);
            let callback = Arc::clone(&callback);
            stream.queue_callback(Box::new(move || {
                if remaining.fetch_sub(1, Ordering::AcqRel) == 1
                    && let Some(callback) = callback.lock().take()
                {
                    callback();
                }
            }))?;
        }
        Ok(())
    }

    /// What the coordinator has done so far.
    pub fn stats(&self) -> CoordinatorStats {
        CoordinatorStats {
            dependencies: self.dependencies.load(Ordering::Relaxed),
            barriers: self.barriers.load(Ordering::Relaxed),
            parallel_runs: self.parallel_runs.load(Ordering::Relaxed),
        }
    }
}
