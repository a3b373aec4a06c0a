//! [`PinnedPoolStats`]: what a [`PinnedPool`](super::PinnedPool) holds and how well it reuses.

/// A snapshot of a pinned pool's memory and counters.
///
/// Byte figures are block capacities (size classes), not requested lengths. They balance:
/// `pinned_bytes == allocated_bytes + cached_bytes`, and `pending_bytes <= cached_bytes`. The
/// counters satisfy `gets == hits + misses`; `returns` trails `gets` by the blocks still in use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinnedPoolStats {
    /// Bytes in blocks handed out and not yet returned.
    pub allocated_bytes: usize,
    /// The most `allocated_bytes` has been since creation or [`reset_peaks`](Self::reset_peaks).
    pub peak_allocated_bytes: usize,
    /// Blocks handed out and not yet returned.
    pub allocated_blocks: usize,
    /// Bytes in returned blocks the pool keeps for reuse: ready ones and pending ones.
    pub cached_bytes: usize,
    /// Returned blocks the pool keeps for reuse.
    pub cached_blocks: usize,
    /// Bytes in cached blocks whose last use had not been seen finished at the last poll.
    pub pending_bytes: usize,
    /// Cached blocks whose last use had not been seen finished at the last poll.
    pub pending_blocks: usize,
    /// Bytes of page-locked memory the pool holds from the driver: allocated plus cached.
    pub pinned_bytes: usize,
    /// The most `pinned_bytes` has been since creation or [`reset_peaks`](Self::reset_peaks).
    pub peak_pinned_bytes: usize,
    /// Successful `get`s.
    pub gets: u64,
    /// Blocks returned to the pool (dropped by their users).
    pub returns: u64,
    /// `get`s served from the cache.
    pub hits: u64,
    /// `get`s that pinned a new block.
    pub misses: u64,
    /// Blocks given back to the driver: by `trim`, or on return past `max_cached_bytes`.
    pub frees: u64,
    /// Pins that failed for lack of memory and were retried after freeing the cache.
    pub oom_retries: u64,
}

impl PinnedPoolStats {
    /// The share of `get`s served from the cache, in `0.0..=1.0` (`0.0` before any `get`).
    pub fn hit_rate(&self) -> f64 {
        if self.gets == 0 {
            0.0
        } else {
            self.hits as f64 / self.gets as f64
        }
    }

    /// Sets both peaks to their current values.
    pub fn reset_peaks(&mut self) {
        self.peak_allocated_bytes = self.allocated_bytes;
        self.peak_pinned_bytes = self.pinned_bytes;
    }

    /// Bytes of cached blocks that are ready for reuse now.
    pub fn ready_bytes(&self) -> usize {
        self.cached_bytes - self.pending_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_and_ready_bytes_follow_the_counters() {
        let mut stats = PinnedPoolStats::default();
        assert_eq!(stats.hit_rate(), 0.0);
        stats.gets = 4;
        stats.hits = 3;
        assert_eq!(stats.hit_rate(), 0.75);
        stats.cached_bytes = 12;
        stats.pending_bytes = 4;
        assert_eq!(stats.ready_bytes(), 8);
    }

    #[test]
    fn reset_peaks_brings_peaks_down_to_current() {
        let mut stats = PinnedPoolStats {
            allocated_bytes: 5,
            peak_allocated_bytes: 9,
            pinned_bytes: 7,
            peak_pinned_bytes: 11,
            ..PinnedPoolStats::default()
        };
        stats.reset_peaks();
        assert_eq!(
            (stats.peak_allocated_bytes, stats.peak_pinned_bytes),
            (5, 7)
        );
    }
}
