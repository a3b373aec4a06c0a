//! The pool's bookkeeping, apart from the driver: ready blocks by size class, returned blocks
//! waiting on the fences of their last use, the cap on cached bytes, and the statistics.
//!
//! [`BlockCache`] is generic over the block ([`Capacity`]) and the fence ([`Fence`]), so that it
//! is tested with fake blocks and fences that pass when a test says so. It never frees anything
//! itself: blocks and fences it lets go of are moved into a [`Released`], which the pool drops
//! after unlocking, because freeing pinned memory and destroying events are driver calls that
//! must not run under the pool's lock.

use std::collections::{BTreeMap, VecDeque};

use cuweave_driver::DriverError;

use super::stats::PinnedPoolStats;

/// A block the cache can hold: it knows its size class.
pub(crate) trait Capacity {
    /// The block's size in bytes (its size class).
    fn capacity(&self) -> usize;
}

/// A marker of a block's last use on the GPU.
pub(crate) trait Fence {
    /// Whether the work it marks has finished; never blocks.
    fn passed(&self) -> Result<bool, DriverError>;
    /// Blocks until the work it marks has finished.
    fn wait(&self) -> Result<(), DriverError>;
}

/// Blocks and fences the cache let go of, to be dropped (freed) once the pool's lock is released.
#[derive(Debug)]
pub(crate) struct Released<B, F> {
    /// Blocks to give back to the driver.
    pub(crate) blocks: Vec<B>,
    /// Fences that have passed, to recycle or destroy.
    pub(crate) fences: Vec<F>,
}

impl<B, F> Default for Released<B, F> {
    fn default() -> Self {
        Self {
            blocks: Vec::new(),
            fences: Vec::new(),
        }
    }
}

/// A returned block waiting for the fences of its last use.
#[derive(Debug)]
struct Pending<B, F> {
    block: B,
    /// Fences not yet seen passed.
    fences: Vec<F>,
    /// Why the block is never reused, if it is quarantined: it is not queried again, and
    /// leaked rather than freed when the pool goes away.
    quarantine: Option<Quarantine>,
}

/// Why a returned block is never handed out again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quarantine {
    /// Querying a fence failed: the GPU work it marks faulted, so whether that work is finished
    /// with the block is unknowable.
    Faulted,
    /// A stream capture used the block: a graph made from it may replay with the block's
    /// address at any time, also after the pool has gone, and no event says when it no longer
    /// will. The graph pools of the captures hold the ticket and
    /// [release](BlockCache::release_captured) the block once they have all died; a ticket no
    /// pool could take (a capture with no pool) is never released.
    Captured(u64),
}

/// Ready blocks by size class, pending blocks, and the statistics that track them.
#[derive(Debug)]
pub(crate) struct BlockCache<B, F> {
    /// Blocks ready for reuse, by capacity, oldest return first: [`take`](Self::take) hands out
    /// the most recently returned (warmest) block, [`take_cold`](Self::take_cold) the oldest.
    ready: BTreeMap<usize, VecDeque<B>>,
    pending: Vec<Pending<B, F>>,
    max_cached_bytes: usize,
    stats: PinnedPoolStats,
    /// The ticket of the next captured block.
    next_ticket: u64,
}

impl<B: Capacity, F: Fence> BlockCache<B, F> {
    /// An empty cache that keeps at most `max_cached_bytes` of ready blocks.
    pub(crate) fn new(max_cached_bytes: usize) -> Self {
        Self {
            ready: BTreeMap::new(),
            pending: Vec::new(),
            max_cached_bytes,
            stats: PinnedPoolStats::default(),
            next_ticket: 0,
        }
    }

    /// The current statistics.
    pub(crate) fn stats(&self) -> PinnedPoolStats {
        self.stats
    }

    /// Sets the peaks to the current values.
    pub(crate) fn reset_peaks(&mut self) {
        self.stats.reset_peaks();
    }

    /// Hands out a ready block of `class`, counting a get and a hit.
    ///
    /// Pending blocks are polled only when no block of `class` is ready and some are pending, so
    /// the common hit costs no driver call. `None` means the caller must pin a new block and then
    /// report it with [`add_pinned`](Self::add_pinned).
    pub(crate) fn take(&mut self, class: usize, released: &mut Released<B, F>) -> Option<B> {
        if !self.has_ready(class) && !self.pending.is_empty() {
            self.poll(released);
        }
        let block = self.ready.get_mut(&class)?.pop_back()?;
        self.count_hit(class);
        Some(block)
    }

    /// Hands out the ready block of `class` returned longest ago, but only while more than `keep`
    /// others of its class are ready, counting a get and a hit; `None` means the caller must pin
    /// a new block (and report it with [`add_pinned`](Self::add_pinned)).
    ///
    /// So every block handed out this way was returned before at least `keep` others of its class
    /// that were returned since: with `keep` blocks' worth of host reads in between, the lines a
    /// host copy read out of it have left the reading cores' private caches. A device-to-host DMA
    /// into lines still held there ran at half the bus speed (the pool's `get_cold`). The class
    /// settles at `keep + 1` ready blocks plus those in use. When the cache has no room for
    /// another block of the class (the cap on cached bytes), the oldest ready one goes out
    /// whatever `keep` says: a rotation that cannot grow must not pin a block per request.
    pub(crate) fn take_cold(
        &mut self,
        class: usize,
        keep: usize,
        released: &mut Released<B, F>,
    ) -> Option<B> {
        if self.ready_count(class) <= keep && !self.pending.is_empty() {
            self.poll(released);
        }
        let full = self
            .stats
            .cached_bytes
            .checked_add(class)
            .is_none_or(|cached| cached > self.max_cached_bytes);
        let ready = self.ready.get_mut(&class)?;
        if ready.len() <= keep && !full {
            return None;
        }
        let block = ready.pop_front()?;
        self.count_hit(class);
        Some(block)
    }

    /// Counts a ready block of `class` handed out: a get and a hit.
    fn count_hit(&mut self, class: usize) {
        let stats = &mut self.stats;
        stats.cached_bytes -= class;
        stats.cached_blocks -= 1;
        stats.gets += 1;
        stats.hits += 1;
        self.hand_out(class);
    }

    /// Counts a newly pinned block of `capacity` bytes handed out: a get and a miss.
    pub(crate) fn add_pinned(&mut self, capacity: usize) {
        let stats = &mut self.stats;
        stats.gets += 1;
        stats.misses += 1;
        stats.pinned_bytes += capacity;
        stats.peak_pinned_bytes = stats.peak_pinned_bytes.max(stats.pinned_bytes);
        self.hand_out(capacity);
    }

    /// Counts a pin that failed for lack of memory and is retried after freeing the cache.
    pub(crate) fn add_oom_retry(&mut self) {
        self.stats.oom_retries += 1;
    }

    /// Takes back a block from its user together with the fences of its last use.
    ///
    /// Without fences the block is ready at once (or freed, past the cap); with fences it waits
    /// until they have all passed.
    pub(crate) fn give_back(&mut self, block: B, fences: Vec<F>, released: &mut Released<B, F>) {
        let capacity = block.capacity();
        let stats = &mut self.stats;
        stats.returns += 1;
        stats.allocated_bytes -= capacity;
        stats.allocated_blocks -= 1;
        if fences.is_empty() {
            self.settle(block, released);
        } else {
            stats.cached_bytes += capacity;
            stats.cached_blocks += 1;
            stats.pending_bytes += capacity;
            stats.pending_blocks += 1;
            self.pending.push(Pending {
                block,
                fences,
                quarantine: None,
            });
        }
    }

    /// Takes back a block that a stream capture used: it is not handed out again, nor freed,
    /// until [`release_captured`](Self::release_captured) is called with the ticket returned
    /// (a graph of the capture may replay with it for as long as the graph lives, which nothing
    /// here can see: the graph pools of the captures hold the ticket). Until then it is counted
    /// as pending; when the pool goes away with it unreleased, it is leaked. Its `fences` (eager
    /// uses) are not needed any more (the release comes after the device finished): they go to
    /// `released`.
    pub(crate) fn give_back_captured(
        &mut self,
        block: B,
        fences: Vec<F>,
        released: &mut Released<B, F>,
    ) -> u64 {
        let capacity = block.capacity();
        let stats = &mut self.stats;
        stats.returns += 1;
        stats.allocated_bytes -= capacity;
        stats.allocated_blocks -= 1;
        stats.cached_bytes += capacity;
        stats.cached_blocks += 1;
        stats.pending_bytes += capacity;
        stats.pending_blocks += 1;
        released.fences.extend(fences);
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.pending.push(Pending {
            block,
            fences: Vec::new(),
            quarantine: Some(Quarantine::Captured(ticket)),
        });
        ticket
    }

    /// Makes the captured block of `ticket` ([`give_back_captured`](Self::give_back_captured))
    /// ready again (or frees it, past the cap): no graph can use it any more and the device has
    /// finished with it. `false` when no block has that ticket (released already).
    pub(crate) fn release_captured(&mut self, ticket: u64, released: &mut Released<B, F>) -> bool {
        let Some(index) = self
            .pending
            .iter()
            .position(|entry| entry.quarantine == Some(Quarantine::Captured(ticket)))
        else {
            return false;
        };
        let entry = self.pending.swap_remove(index);
        self.unlist_pending(entry.block.capacity());
        self.settle(entry.block, released);
        true
    }

    /// Takes a block of `capacity` bytes, just removed from `pending`, out of the counts (its
    /// settling counts it again where it goes).
    fn unlist_pending(&mut self, capacity: usize) {
        let stats = &mut self.stats;
        stats.pending_bytes -= capacity;
        stats.pending_blocks -= 1;
        stats.cached_bytes -= capacity;
        stats.cached_blocks -= 1;
    }

    /// Moves every pending block whose fences have all passed to the ready lists (or frees it,
    /// past the cap). Passed fences go to `released` for recycling.
    pub(crate) fn poll(&mut self, released: &mut Released<B, F>) {
        for mut entry in std::mem::take(&mut self.pending) {
            if entry.quarantine.is_none() && !drain_passed(&mut entry.fences, &mut released.fences)
            {
                entry.quarantine = Some(Quarantine::Faulted);
            }
            if entry.quarantine.is_some() || !entry.fences.is_empty() {
                self.pending.push(entry);
                continue;
            }
            self.unlist_pending(entry.block.capacity());
            self.settle(entry.block, released);
        }
    }

    /// Frees every ready block, polling pending ones first so that those past their use are
    /// freed too; returns the bytes freed.
    pub(crate) fn drain_ready(&mut self, released: &mut Released<B, F>) -> usize {
        let pinned_before = self.stats.pinned_bytes;
        if !self.pending.is_empty() {
            // Blocks that become ready here past the cap are freed by the poll itself.
            self.poll(released);
        }
        for block in std::mem::take(&mut self.ready).into_values().flatten() {
            self.stats.cached_bytes -= block.capacity();
            self.stats.cached_blocks -= 1;
            self.free(block, released);
        }
        pinned_before - self.stats.pinned_bytes
    }

    /// Frees what is left when the pool goes away: ready blocks at once, pending blocks after
    /// waiting for their fences. A quarantined block (its work faulted, or a capture used it)
    /// is leaked rather than freed under work that may still use it.
    pub(crate) fn shutdown(self) {
        drop(self.ready);
        for entry in self.pending {
            if matches!(entry.quarantine, Some(Quarantine::Captured(_))) {
                tracing::warn!(
                    bytes = entry.block.capacity(),
                    "leaking a pinned block a stream capture used: a graph may still replay with it"
                );
                std::mem::forget(entry.block);
                continue;
            }
            let waited = entry.quarantine.is_none()
                && entry.fences.iter().all(|fence| match fence.wait() {
                    Ok(()) => true,
                    Err(error) => {
                        tracing::warn!(%error, "waiting on a pinned block's last use failed");
                        false
                    }
                });
            if waited {
                drop(entry.block);
            } else {
                tracing::warn!(
                    bytes = entry.block.capacity(),
                    "leaking a pinned block whose last use faulted: freeing it is not provably safe"
                );
                std::mem::forget(entry.block);
            }
        }
    }

    fn has_ready(&self, class: usize) -> bool {
        self.ready_count(class) > 0
    }

    fn ready_count(&self, class: usize) -> usize {
        self.ready.get(&class).map_or(0, VecDeque::len)
    }

    /// Counts `capacity` bytes handed to a user.
    fn hand_out(&mut self, capacity: usize) {
        let stats = &mut self.stats;
        stats.allocated_bytes += capacity;
        stats.allocated_blocks += 1;
        stats.peak_allocated_bytes = stats.peak_allocated_bytes.max(stats.allocated_bytes);
    }

    /// Makes a block (not counted as cached) ready, or frees it when it does not fit the cap.
    fn settle(&mut self, block: B, released: &mut Released<B, F>) {
        let capacity = block.capacity();
        let fits = self
            .stats
            .cached_bytes
            .checked_add(capacity)
            .is_some_and(|cached| cached <= self.max_cached_bytes);
        if fits {
            self.stats.cached_bytes += capacity;
            self.stats.cached_blocks += 1;
            self.ready.entry(capacity).or_default().push_back(block);
        } else {
            self.free(block, released);
        }
    }

    /// Counts a block (no longer counted as allocated or cached) given back to the driver.
    fn free(&mut self, block: B, released: &mut Released<B, F>) {
        self.stats.pinned_bytes -= block.capacity();
        self.stats.frees += 1;
        released.blocks.push(block);
    }
}

/// Moves the leading passed fences of `fences` into `passed`, stopping at the first one still
/// pending (the block cannot be ready before it has passed). `false` when a query failed.
fn drain_passed<F: Fence>(fences: &mut Vec<F>, passed: &mut Vec<F>) -> bool {
    let mut done = 0;
    for fence in fences.iter() {
        match fence.passed() {
            Ok(true) => done += 1,
            Ok(false) => break,
            Err(error) => {
                tracing::warn!(
                    %error,
                    "querying a pinned block's last use failed; the block is quarantined"
                );
                passed.extend(fences.drain(..done));
                return false;
            }
        }
    }
    passed.extend(fences.drain(..done));
    true
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod props;
