//! [`Engine`]: the caching allocator's algorithm, independent of CUDA: look in the cache, else
//! ask the upstream for a segment; on out-of-memory, empty the cache and retry once; park blocks
//! used on other streams until their markers complete.
//!
//! The upstream and the stream-use markers are traits, so the whole algorithm, out-of-memory
//! retry and pending blocks included, is tested here with fakes; [`super::allocator`] plugs in
//! the real [`MemoryResource`](crate::resource::MemoryResource) and pooled CUDA events.
//!
//! The engine keeps no spare markers: a completed marker is dropped (after the shard's lock is
//! released), which returns a pooled event to its context's pool; whoever records the next use
//! takes one from there.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::block::BlockId;
use super::pending::PendingFrees;
use super::pool::{Grant, Pools, Segment};
use super::size_class::{segment_size, smallest_segment};
use super::snapshot::MemorySnapshot;
use super::stats::{MemoryStats, Stat};
use super::stream_uses::{Marker, StreamKey};
use crate::error::{MemoryError, Result};

/// Gives whole segments back to where they came from.
pub(crate) trait Release {
    /// Returns `segments` to the upstream once no queued work can still use them. On an error
    /// some may not have been returned; the engine has already dropped them from its books.
    fn release_segments(&self, segments: &[Segment]) -> Result<()>;
}

/// Where new segments come from, for one request.
pub(crate) trait Upstream: Release {
    /// A new segment of `bytes` for the requesting stream.
    fn allocate_segment(&self, bytes: usize) -> Result<u64>;

    /// The end of the requesting stream, which the engine watches while it has segments of
    /// it (`engine_ends.rs`); `None` for a stream whose handle's drop says nothing (the legacy default
    /// stream) or an upstream that cannot tell.
    fn stream_end(&self) -> Option<Arc<dyn StreamEnd>> {
        None
    }

    /// A count that changes whenever a watched stream's handle is dropped (the driver's
    /// [`ended_watched_streams`](cuweave_driver::stream::ended_watched_streams)): while it
    /// stays the same, a miss looks at none of its watched streams.
    fn ended_streams(&self) -> u64 {
        0
    }
}

/// What the engine learns of a stream's end: the driver's
/// [`StreamEnd`](cuweave_driver::stream::StreamEnd) in the allocator, a flag in the tests.
pub(crate) trait StreamEnd: Send + Sync {
    /// Whether the stream's handle has been dropped (no driver call).
    fn dropped(&self) -> bool;
    /// Whether it has been dropped and all the work queued through it has finished; never
    /// blocks; `false` when that cannot be known.
    fn finished(&self) -> bool;
}

/// How many shards the free lists are split into by default. A stream's blocks live in shard
/// `stream id % shards`; stream ids are handed out in sequence, so up to this many streams made
/// one after another never share a shard (and so never a lock).
pub(crate) const SHARDS: usize = 32;

/// One shard: the pools of the streams that map to it, under their own lock, and the blocks of
/// those streams that wait for other streams' recorded uses.
///
/// Aligned to two cache lines so that two shards' locks never share a line (adjacent-line
/// prefetch pairs lines on x86), which would make threads on different shards contend anyway.
#[derive(Debug)]
#[repr(align(128))]
struct Shard<E> {
    pools: Mutex<Pools>,
    /// Blocks freed while recorded on other streams, with the markers they wait for.
    pending: Mutex<PendingFrees<E>>,
    /// `pending.blocks()`, readable without the lock: the hot path skips all polling while it is 0.
    pending_count: AtomicUsize,
}

impl<E> Default for Shard<E> {
    fn default() -> Self {
        Self {
            pools: Mutex::default(),
            pending: Mutex::new(PendingFrees::default()),
            pending_count: AtomicUsize::new(0),
        }
    }
}

/// Reserved bytes and segments of all shards together, kept exactly (peaks included): they
/// change only when a segment comes from or goes back to the upstream, never on the hot path.
#[derive(Debug, Default)]
struct Totals {
    reserved_bytes: Stat,
    segments: Stat,
}

/// The allocator's shared state: per-stream shards of the pools, each under its own short lock,
/// and the totals that span them.
///
/// Lock order: shards by index, then `totals`. A hit (allocate or free of a block of the
/// caller's stream) takes one shard's lock and touches nothing another shard's thread writes.
#[derive(Debug)]
pub(crate) struct Engine<E> {
    shards: Box<[Shard<E>]>,
    totals: Mutex<Totals>,
    /// Free segments of dead graph pools seen by captures' misses, with the capture epoch read
    /// after each was first seen: a later capture may adopt one ([`Adoption`]).
    retired: Mutex<Vec<capture::Retired>>,
    /// The streams this engine has segments of, watched for their end (`engine_ends.rs`).
    ends: Mutex<ends::Ends>,
    /// Serialises the out-of-memory retry and the release of cached segments (PyTorch runs
    /// both under its one allocator mutex): a thread whose upstream request fails waits here
    /// for a release in flight (segments already off the books, not yet back upstream) instead
    /// of finding nothing to release and failing beside it. Only these rare paths take it, and
    /// they hold it across the driver calls that wait for pending frees and free segments.
    releasing: Mutex<()>,
    /// Releases completed so far: a retry that waited for another thread's release tries the
    /// upstream again before giving back its own cache.
    releases: AtomicUsize,
}

/// How many times one request's out-of-memory retry gives the cache back and asks again, while
/// each round releases something (threads off this path may take the room between a release
/// and the request that follows it).
const RETRY_ROUNDS: usize = 4;

impl<E> Default for Engine<E> {
    fn default() -> Self {
        Self::with_shards(SHARDS)
    }
}

impl<E> Engine<E> {
    /// An engine with `shards` shards (a power of two, at least 1).
    pub fn with_shards(shards: usize) -> Self {
        Self::with_max_split(shards, None)
    }

    /// An engine with `shards` shards (a power of two, at least 1) whose large blocks of at
    /// least `max_split` bytes are never split ([`AllocatorConfig::max_split_size`]).
    ///
    /// [`AllocatorConfig::max_split_size`]: super::AllocatorConfig::max_split_size
    pub fn with_max_split(shards: usize, max_split: Option<usize>) -> Self {
        debug_assert!(shards.is_power_of_two());
        let shard = || {
            let shard = Shard::default();
            if let Some(bytes) = max_split {
                shard.pools.lock().set_max_split(bytes);
            }
            shard
        };
        Self {
            shards: (0..shards).map(|_| shard()).collect(),
            totals: Mutex::default(),
            retired: Mutex::new(Vec::new()),
            ends: Mutex::default(),
            releasing: Mutex::new(()),
            releases: AtomicUsize::new(0),
        }
    }

    /// The index of the shard that holds `stream`'s blocks.
    #[inline]
    pub fn shard_index(&self, stream: StreamKey) -> usize {
        stream.as_usize() & (self.shards.len() - 1)
    }
}

/// The cap a limiting adaptor reported in an out-of-memory error, if any.
pub(super) fn limit_of(error: &MemoryError) -> Option<usize> {
    match error {
        MemoryError::OutOfMemory { limit, .. } => *limit,
        _ => None,
    }
}

impl<E: Marker> Engine<E> {
    #[inline]
    fn shard(&self, stream: StreamKey) -> &Shard<E> {
        &self.shards[self.shard_index(stream)]
    }

    /// Hands out a block of at least `bytes` for `stream`: from the cache when a free block of
    /// that stream fits, else from a new upstream segment; on out-of-memory the cache of every
    /// shard is emptied and the upstream asked once more before failing with
    /// [`MemoryError::OutOfMemory`].
    #[inline]
    pub fn allocate(
        &self,
        stream: StreamKey,
        bytes: usize,
        upstream: &impl Upstream,
    ) -> Result<Grant> {
        let rounded = self.round_request(stream, bytes)?;
        let shard = self.shard(stream);
        if shard.pending_count.load(Ordering::Acquire) != 0 {
            self.process_pending_of(shard);
        }
        if let Some(grant) = shard.pools.lock().take_free(stream, rounded, bytes) {
            return Ok(grant);
        }
        self.allocate_from_upstream(stream, rounded, bytes, upstream)
    }

    /// The miss path of [`Self::allocate`]: a new segment, with the out-of-memory retry.
    #[cold]
    #[inline(never)]
    fn allocate_from_upstream(
        &self,
        stream: StreamKey,
        rounded: usize,
        bytes: usize,
        upstream: &impl Upstream,
    ) -> Result<Grant> {
        let Some(segment) = segment_size(rounded) else {
            return Err(self.out_of_memory(stream, rounded, None));
        };
        if let Some(grant) = self.adopt_from_ended(stream, rounded, bytes, upstream) {
            return Ok(grant);
        }
        let releases = self.releases.load(Ordering::Acquire);
        let first = match upstream.allocate_segment(segment) {
            Ok(ptr) => return Ok(self.add_segment(stream, ptr, segment, rounded, bytes)),
            Err(error) if error.is_out_of_memory() => error,
            Err(error) => return Err(error),
        };
        tracing::info!(
            requested = rounded,
            segment,
            error = %first,
            "caching allocator: upstream out of memory; releasing cached blocks and retrying"
        );
        self.shard(stream).pools.lock().stats_mut().oom_retries += 1;
        let _releasing = self.releasing.lock();
        let allocate = || {
            upstream
                .allocate_segment(segment)
                .map(|ptr| self.add_segment(stream, ptr, segment, rounded, bytes))
        };
        // Another thread released while this one waited for the lock: that may be room enough.
        if self.releases.load(Ordering::Acquire) != releases {
            match allocate() {
                Err(error) if error.is_out_of_memory() => {}
                done => return done,
            }
        }
        // First the blocks still waiting for their uses: one of this stream's may now fit, and
        // taking it costs no driver call (a program whose host runs ahead of its stream under
        // a budget lands here on every step). Only then the cached segments of every stream go
        // back to the upstream, as PyTorch's retry frees its cache.
        let take_free = || {
            self.shard(stream)
                .pools
                .lock()
                .take_free(stream, rounded, bytes)
        };
        let mut round = 0;
        loop {
            round += 1;
            self.wait_pending()?;
            if let Some(grant) = take_free() {
                return Ok(grant);
            }
            let released = self.release_cached_locked(upstream)?;
            if let Some(grant) = take_free() {
                return Ok(grant);
            }
            match allocate() {
                Err(error) if error.is_out_of_memory() => {
                    if released > 0 && round < RETRY_ROUNDS {
                        // Threads off this path took the room: give back what they cached since.
                        continue;
                    }
                    if let Some(grant) = self.own_size_segment(stream, rounded, bytes, upstream) {
                        return Ok(grant);
                    }
                    let limit = limit_of(&error).or(limit_of(&first));
                    let error = self.out_of_memory(stream, rounded, limit);
                    tracing::warn!(%error, "caching allocator: out of memory after retry");
                    return Err(error);
                }
                done => return done,
            }
        }
    }

    /// The last try after out-of-memory, with or without a retry before it: a 1-10 MiB request
    /// asks for a shared 20 MiB segment, and under a budget the room for the request itself may
    /// be there (two 4 MiB buffers on two streams under 24 MiB). PyTorch fails here; RMM's
    /// pools would not. `None` when the request has no smaller segment or it does not fit.
    pub(super) fn own_size_segment(
        &self,
        stream: StreamKey,
        rounded: usize,
        bytes: usize,
        upstream: &impl Upstream,
    ) -> Option<Grant> {
        let smallest = smallest_segment(rounded)?;
        let ptr = upstream.allocate_segment(smallest).ok()?;
        tracing::info!(
            requested = rounded,
            segment = smallest,
            "caching allocator: out of memory for a shared segment; a segment of the request's \
             own size fitted"
        );
        Some(self.add_segment(stream, ptr, smallest, rounded, bytes))
    }

    fn add_segment(
        &self,
        stream: StreamKey,
        ptr: u64,
        segment: usize,
        rounded: usize,
        bytes: usize,
    ) -> Grant {
        tracing::debug!(
            segment,
            requested = bytes,
            "caching allocator: new segment from upstream"
        );
        let mut pools = self.shard(stream).pools.lock();
        let grant = pools.add_segment(stream, ptr, segment, rounded, bytes);
        let mut totals = self.totals.lock();
        totals.reserved_bytes.add(segment);
        totals.segments.add(1);
        grant
    }

    /// Counts an out-of-memory failure and describes it with the current totals.
    #[cold]
    fn out_of_memory(
        &self,
        stream: StreamKey,
        requested: usize,
        limit: Option<usize>,
    ) -> MemoryError {
        self.shard(stream).pools.lock().stats_mut().ooms += 1;
        let stats = self.stats();
        MemoryError::OutOfMemory {
            requested,
            allocated: stats.allocated_bytes.current,
            reserved: stats.reserved_bytes.current,
            limit,
        }
    }

    /// Returns an allocated block of `stream`, not used on any other stream, to that stream's
    /// free list.
    #[inline]
    pub fn free(&self, stream: StreamKey, id: BlockId, ptr: u64) -> Result<()> {
        self.shard(stream).pools.lock().free(id, ptr)
    }

    /// Frees an allocated block of `stream` that waits for `markers` (recorded on the other
    /// streams it was used on) before it can be handed out again.
    pub fn free_after(
        &self,
        stream: StreamKey,
        id: BlockId,
        ptr: u64,
        markers: Vec<E>,
    ) -> Result<()> {
        let shard = self.shard(stream);
        let mut pools = shard.pools.lock();
        pools.free_to_pending(id, ptr)?;
        if markers.is_empty() {
            pools.release_pending(id);
            return Ok(());
        }
        drop(pools);
        let mut pending = shard.pending.lock();
        pending.push(id, markers);
        shard
            .pending_count
            .store(pending.blocks(), Ordering::Release);
        Ok(())
    }

    /// Frees an allocated block that must never be handed out again (its other-stream uses could
    /// not be tracked): it stays pending, and its segment is never released.
    pub fn free_never_reuse(&self, stream: StreamKey, id: BlockId, ptr: u64) -> Result<()> {
        self.shard(stream).pools.lock().free_to_pending(id, ptr)
    }

    #[cfg_attr(not(test), allow(dead_code))]
    /// Returns to their free lists the pending blocks, of every shard, whose markers have all
    /// completed, without blocking.
    pub fn process_pending(&self) {
        for shard in self.shards.iter() {
            if shard.pending_count.load(Ordering::Acquire) != 0 {
                self.process_pending_of(shard);
            }
        }
    }

    /// Returns `shard`'s completed pending blocks to its free lists, without blocking; skipped
    /// when another thread is already doing it, and while a capture is active or beginning.
    fn process_pending_of(&self, shard: &Shard<E>) {
        let Some(mut pending) = shard.pending.try_lock() else {
            return;
        };
        let mut completed = Vec::new();
        let mut ready = Vec::new();
        // The markers are polled (event queries) with no capture able to begin meanwhile (the
        // caller's check of `active_captures` leaves a window in which another thread's
        // global-mode capture could begin, and a query would then break it), or, while one is
        // active or beginning, in relaxed capture mode, which breaks none: the markers were
        // recorded eagerly (a marker recorded into a capture that is still active is refused
        // by its query and stays unfinished), so frees keep being reused while another thread
        // holds a long capture open. The pending lock, taken before, is never held by a thread
        // beginning a capture.
        let polled = cuweave_driver::graph::outside_captures_or_relaxed(|| {
            pending.poll(&mut completed, &mut ready);
        });
        if polled.is_err() {
            return;
        }
        shard
            .pending_count
            .store(pending.blocks(), Ordering::Release);
        drop(pending);
        // Back to their pool, outside the lock.
        drop(completed);
        if !ready.is_empty() {
            let mut pools = shard.pools.lock();
            for id in ready {
                pools.release_pending(id);
            }
        }
    }

    /// Waits for every pending block's markers, in every shard, and returns the blocks to their
    /// free lists.
    ///
    /// A block whose marker cannot be waited for stays pending for good (never reused).
    fn wait_pending(&self) -> Result<()> {
        let mut first_error = None;
        for shard in self.shards.iter() {
            let taken = {
                let mut pending = shard.pending.lock();
                shard.pending_count.store(0, Ordering::Release);
                std::mem::take(&mut *pending)
            };
            if taken.is_empty() {
                continue;
            }
            let mut ready = Vec::new();
            if let Err(error) = taken.wait_all(&mut ready) {
                first_error.get_or_insert(error);
            }
            let mut pools = shard.pools.lock();
            for id in ready {
                pools.release_pending(id);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Waits for pending blocks, then gives every free whole segment of every shard back through
    /// `release`; returns the bytes given back.
    pub fn release_cached(&self, release: &impl Release) -> Result<usize> {
        let _releasing = self.releasing.lock();
        self.release_cached_locked(release)
    }

    /// [`release_cached`](Self::release_cached), with `releasing` held by the caller.
    fn release_cached_locked(&self, release: &impl Release) -> Result<usize> {
        let waited = self.wait_pending();
        let segments = self.take_segments(|pools| pools.take_free_segments());
        let bytes = segments.iter().map(|segment| segment.size).sum();
        let released = if segments.is_empty() {
            Ok(())
        } else {
            tracing::info!(
                segments = segments.len(),
                bytes,
                "caching allocator: releasing cached segments"
            );
            let released = release.release_segments(&segments);
            self.releases.fetch_add(1, Ordering::Release);
            released
        };
        waited.and(released).map(|()| bytes)
    }

    /// Takes every free whole segment left, of graph pools that are still alive too, off the
    /// books: for the allocator's last handle, after [`release_cached`](Self::release_cached),
    /// to hand the graph pools' segments to the pools that hold them.
    pub fn take_all_free_segments(&self) -> Vec<Segment> {
        self.take_segments(|pools| pools.take_whole_segments(|_| true))
    }

    /// Takes the segments `take` picks out of every shard's pools, and counts them out of the
    /// totals.
    fn take_segments(&self, take: impl Fn(&mut Pools) -> Vec<Segment>) -> Vec<Segment> {
        let mut segments = Vec::new();
        for shard in self.shards.iter() {
            let mut pools = shard.pools.lock();
            let taken = take(&mut pools);
            if taken.is_empty() {
                continue;
            }
            let mut totals = self.totals.lock();
            for segment in &taken {
                totals.reserved_bytes.sub(segment.size);
                totals.segments.sub(1);
            }
            drop(totals);
            drop(pools);
            segments.extend(taken);
        }
        segments
    }

    /// Runs `f` with every shard's pools and the totals locked (in lock order), so that what it
    /// reads is one consistent state.
    fn with_all_locked<R>(
        &self,
        f: impl FnOnce(&mut [MutexGuard<'_, Pools>], &mut Totals) -> R,
    ) -> R {
        let mut guards: Vec<_> = self.shards.iter().map(|shard| shard.pools.lock()).collect();
        let mut totals = self.totals.lock();
        f(&mut guards, &mut totals)
    }

    /// A snapshot of the statistics, exact at one instant: every shard is locked while it is
    /// read. Counters and current values are the shards' sums; the reserved-bytes and segment
    /// peaks are exact; the peaks of allocated, requested and active bytes are the sums of the
    /// shards' peaks (exact for one stream; across streams an upper bound of the peak reached
    /// at once, since the shards do not share a counter on the hot path).
    pub fn stats(&self) -> MemoryStats {
        self.with_all_locked(|shards, totals| {
            let mut sum = MemoryStats::default();
            for pools in shards.iter() {
                sum.accumulate(pools.stats());
            }
            debug_assert_eq!(sum.reserved_bytes.current, totals.reserved_bytes.current);
            debug_assert_eq!(sum.segments.current, totals.segments.current);
            sum.reserved_bytes = totals.reserved_bytes;
            sum.segments = totals.segments;
            sum
        })
    }

    /// Every segment and its blocks, in address order, with every shard locked (one instant).
    pub fn snapshot(&self) -> MemorySnapshot {
        let mut segments = Vec::new();
        self.with_all_locked(|shards, _| {
            for pools in shards.iter() {
                pools.snapshot_segments(&mut segments);
            }
        });
        segments.sort_unstable_by_key(|segment| segment.address);
        MemorySnapshot { segments }
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak(&self) {
        self.with_all_locked(|shards, totals| {
            for pools in shards.iter_mut() {
                pools.stats_mut().reset_peak();
            }
            totals.reserved_bytes.reset_peak();
            totals.segments.reset_peak();
        });
    }

    /// Blocks that were freed but wait for other streams.
    pub fn pending_blocks(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.pending_count.load(Ordering::Acquire))
            .sum()
    }

    /// Panics unless every shard's structural invariants hold.
    #[cfg(test)]
    pub fn check_invariants(&self) {
        for shard in self.shards.iter() {
            shard.pools.lock().check_invariants();
        }
    }
}

#[path = "engine_capture.rs"]
mod capture;
#[path = "engine_ends.rs"]
mod ends;
pub(crate) use capture::Adoption;

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "engine_props.rs"]
mod props;
