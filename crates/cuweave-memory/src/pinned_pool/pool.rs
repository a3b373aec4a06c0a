//! [`PinnedPool`]: the shared pool, and the driver side of its bookkeeping.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use cuweave_driver::memory::HostAllocation;
use cuweave_driver::{Context, DriverError, EventPool, OwnedPooledEvent, Stream};
use parking_lot::Mutex;

use super::block::{PinnedBlock, TypedPinnedBlock};
use super::cache::{BlockCache, Capacity, Fence, Released};
use super::config::PinnedPoolConfig;
use super::size_class::block_size;
use super::stats::PinnedPoolStats;
use crate::caching::GraphHeld;
use crate::element::{Element, byte_len};
use crate::error::{MemoryError, Result};
use crate::events::ContextEvents;

impl Capacity for HostAllocation {
    fn capacity(&self) -> usize {
        self.len()
    }
}

impl Fence for OwnedPooledEvent {
    /// While no capture is active or beginning, a plain query, with no capture able to begin
    /// during it ([`outside_captures`](cuweave_driver::graph::outside_captures): a check then
    /// a query would leave a window for one). While one is, the query is made in relaxed
    /// capture mode, which breaks no capture (the event reactor's queries are made so): a
    /// loader's pinned staging blocks keep being reused while another thread holds a long
    /// capture open, instead of a new block being pinned for every transfer. A fence recorded
    /// into a capture that is still active is refused by the query (it marks a graph, not
    /// work that runs) and reads as not passed. The pool's lock, held around the poll, is
    /// never held by a thread beginning a capture.
    fn passed(&self) -> Result<bool, DriverError> {
        match cuweave_driver::graph::outside_captures_or_relaxed(|| self.query())? {
            Err(error) if error.is_capture_refusal() => Ok(false),
            answer => answer,
        }
    }

    fn wait(&self) -> Result<(), DriverError> {
        self.synchronize()
    }
}

/// A pool of page-locked host blocks, reused by size class so that staging a transfer does not
/// pay for pinning (tens of milliseconds for 64 MiB) each time.
///
/// Blocks are pinned portable, so streams of every context and device may use them, and
/// optionally mapped for zero-copy kernels ([`PinnedPoolConfig`]). Requests are rounded to a size
/// class ([`super::block_size`]); a block is reused only for its own class.
///
/// A returned block whose use was [`record`](PinnedBlock::record)ed on streams waits until
/// every such stream has passed that use; [`get`](Self::get) never waits for it, it pins a new
/// block instead. Pinning and freeing happen outside the pool's lock.
///
/// Cloning is cheap and shares the pool; it is `Send + Sync`. Memory goes back to the driver on
/// [`trim`](Self::trim), when a returned block does not fit
/// [`max_cached_bytes`](PinnedPoolConfig::max_cached_bytes), and when the last clone and the last
/// block are gone (that last drop waits for pending blocks' streams).
///
/// ```no_run
/// use cuweave_driver::{Context, Device};
/// use cuweave_memory::pinned_pool::PinnedPool;
///
/// # fn main() -> Result<(), cuweave_memory::MemoryError> {
/// let pool = PinnedPool::new(&Context::primary(Device::get(0)?)?);
/// let first = pool.get(16 << 20)?;
/// let address = first.as_slice().as_ptr();
/// drop(first);
/// let second = pool.get(16 << 20)?; // no pinning: the same block again
/// assert_eq!(second.as_slice().as_ptr(), address);
/// assert_eq!(pool.stats().hits, 1);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PinnedPool {
    inner: Arc<Inner>,
}

/// The state shared by a pool's clones and its blocks.
pub(super) struct Inner {
    context: Arc<Context>,
    config: PinnedPoolConfig,
    /// The context's event pool, where the events recorded behind blocks' uses come from and
    /// go back to (once the block they guard is ready again).
    events: ContextEvents,
    state: Mutex<State>,
}

struct State {
    cache: BlockCache<HostAllocation, OwnedPooledEvent>,
    /// Until when [`PinnedPool::get_cold`] hands out the oldest ready block rather than pinning
    /// one more for a rotation that is not full yet.
    next_growth: Instant,
}

impl PinnedPool {
    /// The process-wide pool of `context`, made on first use: the one
    /// [`PinnedBuffer::new`](crate::PinnedBuffer::new) takes its blocks from. Its blocks are
    /// mapped; its cache is capped at [`PinnedPoolConfig::DEFAULT_MAX_CACHED_BYTES`];
    /// [`cuweave_driver::empty_process_caches`] trims it. It keeps `context` retained for the
    /// life of the process. A borrowed context ([`Context::is_borrowed`]) gets a new pool of
    /// its own instead, which nothing process-wide keeps.
    pub fn default_for(context: &Arc<Context>) -> Self {
        super::default::for_context(context)
    }

    /// An empty pool pinning in `context`, with the default [`PinnedPoolConfig`].
    pub fn new(context: &Arc<Context>) -> Self {
        Self::with_config(context, PinnedPoolConfig::default())
    }

    /// An empty pool pinning in `context` as `config` says.
    pub fn with_config(context: &Arc<Context>, config: PinnedPoolConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                context: Arc::clone(context),
                config,
                events: ContextEvents::default(),
                state: Mutex::new(State {
                    cache: BlockCache::new(config.max_cached_bytes),
                    next_growth: Instant::now(),
                }),
            }),
        }
    }

    /// The context blocks are pinned in.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner.context
    }

    /// The event pool of the pool's context, which the events recorded behind blocks' uses come
    /// from (typed buffers from the pool track their uses with it too).
    pub(crate) fn event_pool(&self) -> Result<&EventPool> {
        self.inner.events.pool(&self.inner.context)
    }

    /// The configuration the pool was made with.
    pub fn config(&self) -> PinnedPoolConfig {
        self.inner.config
    }

    /// A block of at least `bytes` bytes: a cached one of the request's size class whose last use
    /// has finished, or else a newly pinned one.
    ///
    /// Never waits for the GPU. If pinning fails for lack of memory, the cache's ready blocks are
    /// freed and pinning is tried once more.
    ///
    /// # Errors
    /// [`MemoryError::ZeroLength`] for zero bytes; [`MemoryError::OutOfMemory`] when the request
    /// cannot be rounded to a size class or the host cannot pin that much even after the cache
    /// was freed; the driver's error when pinning fails otherwise.
    pub fn get(&self, bytes: usize) -> Result<PinnedBlock> {
        let class = self.class_of("PinnedPool::get", bytes)?;
        let cached = self
            .inner
            .with_state(|state, released| state.cache.take(class, released));
        let allocation = match cached {
            Some(allocation) => allocation,
            None => self.inner.pin(class)?,
        };
        Ok(PinnedBlock::new(allocation, bytes, Arc::clone(&self.inner)))
    }

    /// A block of at least `bytes` bytes for the device to write and the host to read, such as a
    /// download's staging block: the cached block of the size class returned longest ago, once
    /// [`COLD_ROTATION_BYTES`](Self::COLD_ROTATION_BYTES) of others of its class (at most
    /// [`COLD_ROTATION_BLOCKS`](Self::COLD_ROTATION_BLOCKS)) have been returned since.
    ///
    /// A device-to-host copy into memory that host cores have just read runs at about half the
    /// bus speed: the lines are still in those cores' private caches, and every write the copy
    /// engine makes must take them back first (H100 host, 2 MiB blocks read by four threads: 18.9
    /// GB/s into the block just read, 45 GB/s into another). [`get`](Self::get) hands out the
    /// warmest block, which for a download loop is exactly the one just copied out. Blocks from
    /// here rotate instead.
    ///
    /// The rotation costs up to `COLD_ROTATION_BYTES` of pinned memory per size class used this
    /// way (within [`max_cached_bytes`](PinnedPoolConfig::max_cached_bytes); [`trim`](Self::trim)
    /// frees it). It fills without holding up the first requests: while it is short, a request
    /// pins one more block only if pinning has taken at most half the time since the last
    /// block this pinned, and otherwise gets the oldest ready block; one with no ready block of
    /// its class pins, as [`get`](Self::get) does.
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub fn get_cold(&self, bytes: usize) -> Result<PinnedBlock> {
        let class = self.class_of("PinnedPool::get_cold", bytes)?;
        let now = Instant::now();
        let cached = self.inner.with_state(|state, released| {
            let cache = &mut state.cache;
            cache
                .take_cold(class, cold_rotation(class), released)
                .or_else(|| {
                    (now < state.next_growth)
                        .then(|| cache.take_cold(class, 0, released))
                        .flatten()
                })
        });
        let allocation = match cached {
            Some(allocation) => allocation,
            None => {
                let allocation = self.inner.pin(class)?;
                let pinning = now.elapsed();
                self.inner.state.lock().next_growth = Instant::now() + pinning * GROWTH_PAUSE;
                allocation
            }
        };
        Ok(PinnedBlock::new(allocation, bytes, Arc::clone(&self.inner)))
    }

    /// The pinned bytes, per size class, that [`get_cold`](Self::get_cold) keeps ready besides
    /// the blocks in use, so that the host has read this much of the class's other blocks since
    /// it last read a block it hands out. Each core that copies a download out keeps what it
    /// read and what it wrote in its 2 MiB of L2 (H100 host); with up to eight such cores, 8 MiB
    /// more of reads, besides the transfer's own blocks in flight, has pushed a block's lines out
    /// of them. On that host a 4 MiB download loop read by four threads ran the copy engine at
    /// about half speed into blocks 4 MiB of reads old, and at full speed into blocks 16 MiB old.
    pub const COLD_ROTATION_BYTES: usize = 8 << 20;

    /// The most blocks of one size class [`get_cold`](Self::get_cold) keeps ready, whatever their
    /// size: small classes (whose copies are short, and mostly latency) stay few blocks.
    pub const COLD_ROTATION_BLOCKS: usize = 32;

    /// The size class of a request of `bytes`.
    fn class_of(&self, operation: &'static str, bytes: usize) -> Result<usize> {
        if bytes == 0 {
            return Err(MemoryError::ZeroLength { operation });
        }
        block_size(bytes).ok_or_else(|| self.inner.out_of_memory(bytes))
    }

    /// A typed pinned buffer of `len` elements in a block of this pool (see
    /// [`PinnedBuffer::from_pool`](crate::PinnedBuffer::from_pool)): host slices wait for its
    /// queued copies, and the block returns to the pool behind them.
    ///
    /// # Errors
    /// As [`PinnedBuffer::from_pool`](crate::PinnedBuffer::from_pool).
    pub fn buffer<T: Element>(&self, len: usize) -> Result<crate::PinnedBuffer<T>> {
        crate::PinnedBuffer::from_pool(self, len)
    }

    /// A block holding `len` elements of `T`, viewable as `&[T]` / `&mut [T]` (see [`get`](Self::get)).
    ///
    /// # Errors
    /// [`MemoryError::ZeroLength`] for no elements (or a zero-sized `T`);
    /// [`MemoryError::Misaligned`] when the byte size overflows or `T` needs more than page
    /// alignment; otherwise as [`get`](Self::get).
    pub fn get_typed<T: Element>(&self, len: usize) -> Result<TypedPinnedBlock<T>> {
        self.typed("PinnedPool::get_typed", len, |bytes| self.get(bytes))
    }

    /// A block holding `len` elements of `T` from the cold rotation (see
    /// [`get_cold`](Self::get_cold)): for staging downloads.
    ///
    /// # Errors
    /// As [`get_typed`](Self::get_typed).
    pub fn get_typed_cold<T: Element>(&self, len: usize) -> Result<TypedPinnedBlock<T>> {
        self.typed("PinnedPool::get_typed_cold", len, |bytes| {
            self.get_cold(bytes)
        })
    }

    fn typed<T: Element>(
        &self,
        operation: &'static str,
        len: usize,
        get: impl FnOnce(usize) -> Result<PinnedBlock>,
    ) -> Result<TypedPinnedBlock<T>> {
        let misaligned = |bytes| MemoryError::Misaligned {
            operation,
            bytes,
            element_size: size_of::<T>(),
        };
        let bytes = byte_len::<T>(len).ok_or_else(|| misaligned(usize::MAX))?;
        if bytes == 0 {
            return Err(MemoryError::ZeroLength { operation });
        }
        TypedPinnedBlock::new(get(bytes)?).ok_or_else(|| misaligned(bytes))
    }

    /// Gives every cached block that is ready for reuse back to the driver; returns the bytes
    /// unpinned.
    ///
    /// Blocks whose last use is still running stay pending (they are freed by a later `trim`,
    /// or when the pool goes away); blocks in use are untouched.
    pub fn trim(&self) -> usize {
        let freed = self
            .inner
            .with_state(|state, released| state.cache.drain_ready(released));
        if freed > 0 {
            tracing::debug!(freed, "pinned pool trimmed");
        }
        freed
    }

    /// A snapshot of the pool's memory and counters.
    ///
    /// Pending figures are as of the last poll (a `get` that found no ready block, or a `trim`):
    /// this does not query the GPU.
    pub fn stats(&self) -> PinnedPoolStats {
        self.inner.state.lock().cache.stats()
    }

    /// Sets the peak figures of [`stats`](Self::stats) to their current values.
    pub fn reset_peak_stats(&self) {
        self.inner.state.lock().cache.reset_peaks();
    }
}

impl fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedPool")
            .field("device", &self.inner.context.device().ordinal())
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// After pinning a block, how many times as long [`PinnedPool::get_cold`] hands out ready blocks
/// before it pins one more to grow a rotation: growing takes at most half the time, so a
/// rotation fills within a few dozen transfers (about 30 of 4 MiB on the H100 host) and no
/// transfer while it fills takes more than about twice its time.
const GROWTH_PAUSE: u32 = 1;

/// How many ready blocks of `class` bytes [`PinnedPool::get_cold`] leaves in the cache.
fn cold_rotation(class: usize) -> usize {
    (PinnedPool::COLD_ROTATION_BYTES / class.max(1)).clamp(1, PinnedPool::COLD_ROTATION_BLOCKS)
}

impl Inner {
    /// Runs `f` under the lock, and drops what it released after unlocking: freeing pinned
    /// memory is a driver call, and so is destroying events when a passed fence was the last
    /// handle of another context's pool (fences of this pool's context just go back to it).
    fn with_state<R>(
        &self,
        f: impl FnOnce(&mut State, &mut Released<HostAllocation, OwnedPooledEvent>) -> R,
    ) -> R {
        let mut released = Released::default();
        let result = f(&mut self.state.lock(), &mut released);
        drop(released);
        result
    }

    /// Pins a new block of `class` bytes, outside the lock; on lack of memory frees the cache
    /// and tries once more.
    fn pin(&self, class: usize) -> Result<HostAllocation> {
        let flags = self.config.host_alloc_flags();
        let started = Instant::now();
        // Works on a capturing thread too: `HostAllocation::new` pins in relaxed capture mode
        // while a capture is active (a capture does not record pinning).
        let pinned = HostAllocation::new(&self.context, class, flags);
        let allocation = match pinned {
            Ok(allocation) => allocation,
            Err(error) if error.is_out_of_memory() => {
                let freed = self.with_state(|state, released| {
                    let freed = state.cache.drain_ready(released);
                    if freed > 0 {
                        state.cache.add_oom_retry();
                    }
                    freed
                });
                tracing::warn!(
                    bytes = class,
                    freed,
                    "pinning failed for lack of memory; freed the cache to retry"
                );
                if freed == 0 {
                    return Err(self.out_of_memory(class));
                }
                HostAllocation::new(&self.context, class, flags).map_err(|error| {
                    if error.is_out_of_memory() {
                        self.out_of_memory(class)
                    } else {
                        error.into()
                    }
                })?
            }
            Err(error) => return Err(error.into()),
        };
        self.with_state(|state, _| state.cache.add_pinned(class));
        tracing::debug!(
            bytes = class,
            mapped = flags.device_map,
            elapsed_us = started.elapsed().as_micros() as u64,
            "pinned pool: pinned a new block"
        );
        Ok(allocation)
    }

    /// An event for marking a use on `stream`, from the event pool of the stream's context
    /// (the pool's own for streams of its context), never under the pool's lock.
    pub(super) fn event_for(&self, stream: &Stream) -> Result<OwnedPooledEvent> {
        self.events.for_stream(&self.context, stream)
    }

    /// Takes back a block from a dropped [`PinnedBlock`] with the events of its last use.
    pub(super) fn give_back(&self, allocation: HostAllocation, events: Vec<OwnedPooledEvent>) {
        self.with_state(|state, released| state.cache.give_back(allocation, events, released));
    }

    /// Takes back a block that stream captures used, whose graph pools are `graph_pools`: it
    /// is quarantined, and the pools hold its release ([`GraphHold`]) until the last of them
    /// dies (or for good, when a capture had no pool).
    pub(super) fn give_back_for_graphs(
        this: &Arc<Self>,
        allocation: HostAllocation,
        events: Vec<OwnedPooledEvent>,
        graph_pools: &[u64],
    ) {
        let bytes = allocation.len();
        let ticket = this.with_state(|state, released| {
            state.cache.give_back_captured(allocation, events, released)
        });
        let hold = GraphHold {
            pool: Arc::clone(this),
            ticket,
        };
        crate::caching::hold_for_graphs(Box::new(hold), graph_pools, bytes);
    }

    fn out_of_memory(&self, requested: usize) -> MemoryError {
        let stats = self.state.lock().cache.stats();
        MemoryError::OutOfMemory {
            requested,
            allocated: stats.allocated_bytes,
            reserved: stats.pinned_bytes,
            limit: None,
        }
    }
}

/// The release of a pinned block that captures used, held by their graph pools: it keeps the
/// pinned pool alive (its context and cache) until then.
struct GraphHold {
    pool: Arc<Inner>,
    ticket: u64,
}

impl GraphHeld for GraphHold {
    fn give_back(
        self: Box<Self>,
        synced: &mut Vec<Arc<Context>>,
    ) -> Result<Option<Box<dyn GraphHeld>>> {
        // A launch of a dead pool's graph may still be running: the device finishes first. A
        // capture begun since the flush checked refuses the wait: the hold comes back, to try
        // again once none is active. On another failure the block stays quarantined (the hold
        // just goes).
        match crate::caching::synchronize_once(&self.pool.context, synced) {
            Err(error) if error.is_capture_refusal() => return Ok(Some(self)),
            Err(error) => return Err(error),
            Ok(()) => {}
        }
        self.pool.with_state(|state, released| {
            state.cache.release_captured(self.ticket, released);
        });
        Ok(None)
    }

    fn strand(self: Box<Self>) {
        // Never released: the block stays quarantined, and the pool leaks it when it goes away.
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let state = self.state.get_mut();
        let cache = std::mem::replace(&mut state.cache, BlockCache::new(0));
        let stats = cache.stats();
        if stats.pending_blocks > 0 {
            tracing::debug!(
                pending = stats.pending_blocks,
                "pinned pool dropped: waiting for pending blocks' last use before freeing them"
            );
        }
        cache.shutdown();
    }
}
