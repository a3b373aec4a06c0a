//! [`StreamPool`]: priority streams made once per context, handed out by an
//! [`AllocationStrategy`] or by [`WorkloadType`].

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cuweave_driver::{Context, Device};
use dashmap::DashMap;
use serde::{Deserialize, Serialize};

use crate::error::{Result, StreamError, ensure_device};
use crate::priority::StreamPriority;
use crate::stream::PriorityStream;

mod ready;
mod strategy;
mod workload;

use ready::ready_for_work;
pub use ready::wait_for_any_ready;
pub use strategy::AllocationStrategy;
pub use workload::{WorkloadLayout, WorkloadType, compute_stream_share};

use strategy::least_loaded;
use workload::{StreamSet, WorkloadRecord};

/// How many streams of each priority a [`StreamPool`] makes, and its strategy.
///
/// The default (2 high, 4 normal, 2 low, 2 of the normal ones for compute, round robin) makes 8
/// streams: the number of hardware work queues a CUDA context gets by default
/// (`CUDA_DEVICE_MAX_CONNECTIONS`), beyond which streams share queues and serialize.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct StreamPoolConfig {
    /// High-priority streams.
    pub high: usize,
    /// Normal-priority streams.
    pub normal: usize,
    /// Low-priority streams.
    pub low: usize,
    /// How many normal streams serve `Compute` at first (the rest serve `Mixed`).
    pub compute_streams: usize,
    /// The strategy `get_stream` uses.
    pub strategy: AllocationStrategy,
}

impl Default for StreamPoolConfig {
    fn default() -> Self {
        Self {
            high: 2,
            normal: 4,
            low: 2,
            compute_streams: 2,
            strategy: AllocationStrategy::RoundRobin,
        }
    }
}

impl StreamPoolConfig {
    /// The default counts with `strategy`.
    pub fn with_strategy(strategy: AllocationStrategy) -> Self {
        Self {
            strategy,
            ..Self::default()
        }
    }

    /// These counts of high, normal and low streams (the rest as [`Default`]); the compute
    /// streams are capped at `normal`.
    pub fn with_counts(mut self, high: usize, normal: usize, low: usize) -> Self {
        self.high = high;
        self.normal = normal;
        self.low = low;
        self.compute_streams = self.compute_streams.min(normal);
        self
    }

    /// `compute` of the normal streams serve `Compute` at first.
    pub fn with_compute_streams(mut self, compute: usize) -> Self {
        self.compute_streams = compute;
        self
    }

    fn count(&self, priority: StreamPriority) -> usize {
        match priority {
            StreamPriority::High => self.high,
            StreamPriority::Normal => self.normal,
            StreamPriority::Low => self.low,
        }
    }
}

/// What [`StreamPool::optimize_configuration`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigurationChange {
    /// The layout before.
    pub before: WorkloadLayout,
    /// The layout after.
    pub after: WorkloadLayout,
}

impl ConfigurationChange {
    /// Whether anything changed.
    pub fn changed(&self) -> bool {
        self.before != self.after
    }
}

/// Streams made once per context and priority, handed out by strategy, priority or workload.
///
/// Every stream is a [`PriorityStream`] shared as `Arc`; handing one out is an atomic counter and
/// an `Arc` clone (round robin) or a scan of the streams' outstanding-work events (load
/// balanced), never a `cuStreamCreate`. Work from many holders of one stream runs in order on
/// it; pick different streams for work that should overlap.
///
/// ```no_run
/// use cuweave_driver::{Context, Device};
/// use cuweave_stream::{StreamPool, StreamPoolConfig, StreamPriority, WorkloadType};
///
/// # fn main() -> cuweave_stream::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let pool = StreamPool::new(&context, StreamPoolConfig::default())?;
/// let any = pool.get_stream()?;
/// let urgent = pool.get_priority_stream(StreamPriority::High)?;
/// let copies = pool.get_stream_for_workload(WorkloadType::Memory)?;
/// assert!(urgent.driver_priority() < copies.driver_priority());
/// # drop(any);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct StreamPool {
    context: Arc<Context>,
    /// Streams by priority index (`StreamPriority::index`).
    sets: [Vec<Arc<PriorityStream>>; 3],
    strategy: AtomicU8,
    cursor: AtomicUsize,
    priority_cursors: [AtomicUsize; 3],
    workload_cursors: [AtomicUsize; 4],
    compute_streams: AtomicUsize,
    records: [WorkloadRecord; 4],
}

impl StreamPool {
    /// Makes the pool's streams in `context`.
    ///
    /// # Errors
    /// [`StreamError::InvalidArgument`] for a configuration with no streams or more compute
    /// streams than normal ones; the driver's error when a stream cannot be made.
    pub fn new(context: &Arc<Context>, config: StreamPoolConfig) -> Result<Self> {
        if config.high + config.normal + config.low == 0 {
            return Err(StreamError::invalid(
                "StreamPool::new",
                "a pool needs at least one stream",
            ));
        }
        if config.compute_streams > config.normal {
            return Err(StreamError::invalid(
                "StreamPool::new",
                format!(
                    "{} compute streams asked for but only {} normal-priority streams",
                    config.compute_streams, config.normal
                ),
            ));
        }
        let make = |priority: StreamPriority| -> Result<Vec<Arc<PriorityStream>>> {
            (0..config.count(priority))
                .map(|_| PriorityStream::new(context, priority).map(Arc::new))
                .collect()
        };
        Ok(Self {
            context: Arc::clone(context),
            sets: [
                make(StreamPriority::High)?,
                make(StreamPriority::Normal)?,
                make(StreamPriority::Low)?,
            ],
            strategy: AtomicU8::new(config.strategy.to_u8()),
            cursor: AtomicUsize::new(0),
            priority_cursors: Default::default(),
            workload_cursors: Default::default(),
            compute_streams: AtomicUsize::new(config.compute_streams),
            records: Default::default(),
        })
    }

    /// The process-wide pool of `device` (default configuration, on its primary context), made on
    /// first use: one pool per device in a multi-GPU process.
    ///
    /// # Errors
    /// The driver's error for a missing device or a failed stream creation.
    pub fn for_device(device: Device) -> Result<Arc<Self>> {
        static POOLS: OnceLock<DashMap<usize, Arc<StreamPool>>> = OnceLock::new();
        let pools = POOLS.get_or_init(DashMap::new);
        if let Some(pool) = pools.get(&device.ordinal()) {
            return Ok(Arc::clone(&pool));
        }
        let context = Context::primary(device)?;
        let made = Arc::new(Self::new(&context, StreamPoolConfig::default())?);
        // A racing thread's pool wins; ours is dropped and its streams destroyed.
        Ok(Arc::clone(&pools.entry(device.ordinal()).or_insert(made)))
    }

    /// The context the streams belong to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// The device the streams run on.
    pub fn device(&self) -> Device {
        self.context.device()
    }

    /// The strategy `get_stream` uses.
    pub fn strategy(&self) -> AllocationStrategy {
        AllocationStrategy::from_u8(self.strategy.load(Ordering::Relaxed))
    }

    /// Changes the strategy `get_stream` uses.
    pub fn set_strategy(&self, strategy: AllocationStrategy) {
        self.strategy.store(strategy.to_u8(), Ordering::Relaxed);
    }

    /// Every stream, high priority first.
    pub fn streams(&self) -> impl Iterator<Item = &Arc<PriorityStream>> {
        self.sets.iter().flatten()
    }

    /// The streams of one priority.
    pub fn streams_of(&self, priority: StreamPriority) -> &[Arc<PriorityStream>] {
        &self.sets[priority.index()]
    }

    /// How many streams the pool holds.
    pub fn len(&self) -> usize {
        self.sets.iter().map(Vec::len).sum()
    }

    /// Always `false`: a pool has at least one stream.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `stream` is one of this pool's.
    pub fn contains(&self, stream: &PriorityStream) -> bool {
        self.streams().any(|own| own.id() == stream.id())
    }

    /// An error unless `stream` runs on this pool's device.
    ///
    /// # Errors
    /// [`StreamError::WrongDevice`] for a stream of another device.
    pub fn ensure_same_device(&self, stream: &PriorityStream) -> Result<()> {
        ensure_device(
            "StreamPool::ensure_same_device",
            self.device().ordinal(),
            stream.device().ordinal(),
        )
    }

    /// A stream picked by the pool's [`AllocationStrategy`].
    ///
    /// # Errors
    /// The driver's error from querying outstanding work (`LoadBalanced`, `Priority`);
    /// [`StreamError::NoStreamForWorkload`] when the pool has no stream for the choice.
    pub fn get_stream(&self) -> Result<Arc<PriorityStream>> {
        match self.strategy() {
            AllocationStrategy::RoundRobin => {
                let set = self.default_set();
                let i = self.cursor.fetch_add(1, Ordering::Relaxed) % set.len();
                Ok(Arc::clone(&set[i]))
            }
            AllocationStrategy::LoadBalanced => {
                let set = self.default_set();
                let start = self.cursor.fetch_add(1, Ordering::Relaxed) % set.len();
                Ok(self.least_loaded_of(set, start)?.0)
            }
            AllocationStrategy::Priority => self.most_urgent_idle(),
            AllocationStrategy::Workload => self.get_stream_for_workload(WorkloadType::Mixed),
        }
    }

    /// The next stream of `priority`, round robin; a pool without streams of that priority hands
    /// out the nearest priority it has (normal, then the other).
    ///
    /// # Errors
    /// None today; `Result` leaves room for lazily made streams.
    pub fn get_priority_stream(&self, priority: StreamPriority) -> Result<Arc<PriorityStream>> {
        let order: [StreamPriority; 3] = match priority {
            StreamPriority::High => [
                StreamPriority::High,
                StreamPriority::Normal,
                StreamPriority::Low,
            ],
            StreamPriority::Normal => [
                StreamPriority::Normal,
                StreamPriority::High,
                StreamPriority::Low,
            ],
            StreamPriority::Low => [
                StreamPriority::Low,
                StreamPriority::Normal,
                StreamPriority::High,
            ],
        };
        let level = order
            .into_iter()
            .find(|level| !self.sets[level.index()].is_empty())
            .unwrap_or(StreamPriority::Normal);
        let set = &self.sets[level.index()];
        let i = self.priority_cursors[level.index()].fetch_add(1, Ordering::Relaxed) % set.len();
        Ok(Arc::clone(&set[i]))
    }

    /// The next stream of the set serving `workload` (see [`WorkloadType`]), round robin within
    /// the set.
    ///
    /// # Errors
    /// [`StreamError::NoStreamForWorkload`] when the layout gives it no stream (memory work in a
    /// pool whose only streams are compute streams).
    pub fn get_stream_for_workload(&self, workload: WorkloadType) -> Result<Arc<PriorityStream>> {
        let set = self.set_for(workload)?;
        let streams = &self.sets[set.priority.index()][set.start..set.start + set.len];
        let i =
            self.workload_cursors[workload.index()].fetch_add(1, Ordering::Relaxed) % streams.len();
        Ok(Arc::clone(&streams[i]))
    }

    /// The streams serving `workload` in the current layout.
    ///
    /// # Errors
    /// As [`get_stream_for_workload`](Self::get_stream_for_workload).
    pub fn workload_streams(&self, workload: WorkloadType) -> Result<&[Arc<PriorityStream>]> {
        let set = self.set_for(workload)?;
        Ok(&self.sets[set.priority.index()][set.start..set.start + set.len])
    }

    /// Records that a piece of `workload` took `duration` (measure it with GPU timing events,
    /// e.g. from [`StreamMetrics::gpu_time_ns`](crate::StreamMetrics::gpu_time_ns) or the
    /// profiler), for [`average_workload_time`](Self::average_workload_time) and
    /// [`optimize_configuration`](Self::optimize_configuration).
    pub fn record_workload_completion(&self, workload: WorkloadType, duration: Duration) {
        self.records[workload.index()].record(duration);
    }

    /// The mean recorded duration of `workload`, or `None` before the first record.
    pub fn average_workload_time(&self, workload: WorkloadType) -> Option<Duration> {
        self.records[workload.index()].average()
    }

    /// How many completions of `workload` were recorded.
    pub fn workload_count(&self, workload: WorkloadType) -> u64 {
        self.records[workload.index()].count()
    }

    /// The current layout: stream counts and how many normal streams serve compute.
    pub fn layout(&self) -> WorkloadLayout {
        WorkloadLayout {
            high: self.sets[0].len(),
            normal: self.sets[1].len(),
            low: self.sets[2].len(),
            compute_streams: self.compute_streams.load(Ordering::Relaxed),
        }
    }

    /// Re-divides the normal-priority streams between `Compute` and `Mixed` work in proportion to
    /// the total time recorded for each (count × average), by [`compute_stream_share`]: each side
    /// keeps at least one stream while it has records, and nothing changes without records or
    /// with fewer than two normal streams. Memory and coordination sets (low and high streams) are
    /// fixed by priority.
    pub fn optimize_configuration(&self) -> ConfigurationChange {
        let before = self.layout();
        let compute = self.records[WorkloadType::Compute.index()].total();
        let mixed = self.records[WorkloadType::Mixed.index()].total();
        let share = compute_stream_share(before.normal, compute, mixed, before.compute_streams);
        self.compute_streams.store(share, Ordering::Relaxed);
        let after = self.layout();
        if before != after {
            tracing::debug!(?before, ?after, "stream pool layout optimized");
        }
        ConfigurationChange { before, after }
    }

    /// Whether any stream of the pool has finished all its queued work (`cuStreamQuery`); a
    /// stream capturing a graph (on any thread) is not ready and is not queried.
    ///
    /// # Errors
    /// The driver's error from a query.
    pub fn has_ready_streams(&self) -> Result<bool> {
        for stream in self.streams() {
            if ready_for_work(stream)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The first stream (in pool order among those found ready together) whose queued work has
    /// finished, or `None` after `timeout`; polls with a backoff that sleeps, see
    /// [`wait_for_any_ready`].
    ///
    /// # Errors
    /// The driver's error from a query.
    pub fn wait_for_any_ready(&self, timeout: Duration) -> Result<Option<Arc<PriorityStream>>> {
        let streams: Vec<Arc<PriorityStream>> = self.streams().cloned().collect();
        wait_for_any_ready(&streams, timeout)
    }

    fn set_for(&self, workload: WorkloadType) -> Result<StreamSet> {
        self.layout()
            .set_for(workload)
            .ok_or(StreamError::NoStreamForWorkload { workload })
    }

    /// The set `RoundRobin` and `LoadBalanced` draw from: normal priority, else every stream's
    /// first non-empty set.
    fn default_set(&self) -> &[Arc<PriorityStream>] {
        if self.sets[1].is_empty() {
            self.sets
                .iter()
                .find(|set| !set.is_empty())
                .map_or(&[], Vec::as_slice)
        } else {
            &self.sets[1]
        }
    }

    /// The least loaded stream of `set` (ties in round-robin order from `start`) and its load.
    fn least_loaded_of(
        &self,
        set: &[Arc<PriorityStream>],
        start: usize,
    ) -> Result<(Arc<PriorityStream>, u64)> {
        let loads = set.iter().map(load_of).collect::<Result<Vec<u64>>>()?;
        let i = least_loaded(&loads, start).ok_or(StreamError::NoStreamForWorkload {
            workload: WorkloadType::Mixed,
        })?;
        Ok((Arc::clone(&set[i]), loads[i]))
    }

    /// The first idle stream looking at high, then normal, then low priority, else the least
    /// loaded high-priority one. A capturing stream is never idle, and is handed out only when
    /// every stream of the pool captures.
    ///
    /// Each set is looked at from the stream after the one last handed out of it (PyTorch's
    /// round robin within a priority), so callers asking at once, before any work they queue
    /// shows, spread over the idle streams instead of all getting the first.
    fn most_urgent_idle(&self) -> Result<Arc<PriorityStream>> {
        for (level, set) in self.sets.iter().enumerate() {
            let start = self.priority_cursors[level].load(Ordering::Relaxed);
            for offset in 0..set.len() {
                let i = (start + offset) % set.len();
                if load_of(&set[i])? == 0 {
                    self.priority_cursors[level].store(i + 1, Ordering::Relaxed);
                    return Ok(Arc::clone(&set[i]));
                }
            }
        }
        let set = if self.sets[0].is_empty() {
            self.default_set()
        } else {
            &self.sets[0]
        };
        let start = self.priority_cursors[0].fetch_add(1, Ordering::Relaxed) % set.len().max(1);
        let (stream, load) = self.least_loaded_of(set, start)?;
        if load != CAPTURING {
            return Ok(stream);
        }
        // Every stream of that set captures: the least loaded of the whole pool.
        let all: Vec<Arc<PriorityStream>> = self.streams().cloned().collect();
        Ok(self.least_loaded_of(&all, start % all.len())?.0)
    }
}

/// The load [`load_of`] gives a capturing stream: more than any real count.
const CAPTURING: u64 = u64::MAX;

/// What the strategies compare: the operations still queued on `stream`, plus one while device
/// waits queued on it may hold it back ([`PriorityStream::outstanding_work`],
/// [`PriorityStream::has_pending_waits`]), or [`CAPTURING`]
/// while it captures a graph (on any thread). A capturing stream records no markers (its work
/// runs only when the graph is launched), so its count would read 0 and make it look idle:
/// handed out to eager work, that work would be recorded into the capture or break it. It is
/// handed out only when every candidate captures.
///
/// While a capture forbids event queries on this thread (the capturing thread, or any thread
/// during a global capture) the queued work cannot be read without breaking the capture: a
/// stream that is not capturing then counts as idle (`LoadBalanced` falls back to the
/// round-robin order, `Priority` to the most urgent stream), as PyTorch's pool hands out
/// streams inside a capture.
///
/// # Errors
/// The driver's error from the status query or an event query.
fn load_of(stream: &Arc<PriorityStream>) -> Result<u64> {
    if crate::capture::is_capturing(stream.stream())? {
        return Ok(CAPTURING);
    }
    // Queued device waits count too: work handed to a stream held behind another stream's
    // work would wait for it, however few operations of its own it has.
    match stream
        .outstanding_work()
        .and_then(|work| Ok(work + u64::from(stream.has_pending_waits()?)))
    {
        Err(error) if error.is_capture_refusal() => Ok(0),
        other => other,
    }
}
