//! [`MemoryStats`]: what the caching allocator holds, hands out and asks its upstream for.

/// A quantity's current value and the highest it has been since creation or the last
/// [`reset_peak`](crate::caching::CachingAllocator::reset_peak).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    /// The value now.
    pub current: usize,
    /// The highest value seen.
    pub peak: usize,
}

impl Stat {
    pub(crate) fn add(&mut self, amount: usize) {
        self.current += amount;
        self.peak = self.peak.max(self.current);
    }

    pub(crate) fn sub(&mut self, amount: usize) {
        debug_assert!(self.current >= amount, "stat underflow");
        self.current = self.current.saturating_sub(amount);
    }

    pub(crate) fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// A snapshot of a [`CachingAllocator`](crate::caching::CachingAllocator)'s counters.
///
/// Bytes are block sizes (requests rounded up to 512 B, or the whole block when the remainder was
/// not worth splitting off), except `requested_bytes`, which sums the sizes callers asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in blocks handed out to callers and not yet freed.
    pub allocated_bytes: Stat,
    /// Bytes callers asked for in those blocks, before rounding.
    pub requested_bytes: Stat,
    /// Bytes held from the upstream resource: every segment, in use or cached.
    pub reserved_bytes: Stat,
    /// Bytes that cannot be handed out: allocated, or freed but waiting for another stream's
    /// recorded use to pass (see [`CachedAllocation::record_stream`](crate::caching::CachedAllocation::record_stream)).
    pub active_bytes: Stat,
    /// Segments held from the upstream resource.
    pub segments: Stat,
    /// Allocations served, from cache or upstream.
    pub allocations: u64,
    /// Allocations freed (returned to the cache, or to the pending list).
    pub frees: u64,
    /// Allocations served from a cached block, without calling the upstream.
    pub cache_hits: u64,
    /// Allocations that needed a new segment from the upstream.
    pub cache_misses: u64,
    /// Segments handed back to the upstream (by `empty_cache`, the OOM path, or drop).
    pub segments_released: u64,
    /// Times the upstream ran out of memory and the cache was emptied for a retry.
    pub oom_retries: u64,
    /// Allocations that failed with [`MemoryError::OutOfMemory`](crate::MemoryError::OutOfMemory)
    /// even after the retry.
    pub ooms: u64,
}

impl MemoryStats {
    /// Adds another shard's counters, current values and peaks to these.
    pub(crate) fn accumulate(&mut self, other: &Self) {
        for (stat, add) in [
            (&mut self.allocated_bytes, other.allocated_bytes),
            (&mut self.requested_bytes, other.requested_bytes),
            (&mut self.reserved_bytes, other.reserved_bytes),
            (&mut self.active_bytes, other.active_bytes),
            (&mut self.segments, other.segments),
        ] {
            stat.current += add.current;
            stat.peak += add.peak;
        }
        self.allocations += other.allocations;
        self.frees += other.frees;
        self.cache_hits += other.cache_hits;
        self.cache_misses += other.cache_misses;
        self.segments_released += other.segments_released;
        self.oom_retries += other.oom_retries;
        self.ooms += other.ooms;
    }

    /// Sets every peak to its current value.
    pub fn reset_peak(&mut self) {
        for stat in [
            &mut self.allocated_bytes,
            &mut self.requested_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.segments,
        ] {
            stat.reset_peak();
        }
    }

    /// Bytes reserved from the upstream but not handed out: the cache, plus split remainders.
    pub fn cached_bytes(&self) -> usize {
        self.reserved_bytes
            .current
            .saturating_sub(self.allocated_bytes.current)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_follow_the_maximum_and_reset_to_current() {
        let mut stats = MemoryStats::default();
        stats.allocated_bytes.add(100);
        stats.allocated_bytes.add(50);
        stats.allocated_bytes.sub(120);
        stats.reserved_bytes.add(1000);
        assert_eq!(
            stats.allocated_bytes,
            Stat {
                current: 30,
                peak: 150
            }
        );
        assert_eq!(stats.cached_bytes(), 970);
        stats.reset_peak();
        assert_eq!(
            stats.allocated_bytes,
            Stat {
                current: 30,
                peak: 30
            }
        );
        assert_eq!(stats.reserved_bytes.peak, 1000);
    }
}
