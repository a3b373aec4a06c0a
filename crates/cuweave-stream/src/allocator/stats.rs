//! [`AllocatorStats`]: what the stream-ordered allocator has handed out, per size class.

use serde::{Deserialize, Serialize};

use super::size_class::{CLASS_COUNT, class_limit};

/// Counts of one size class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SizeClassStats {
    /// The largest block of the class, `None` for the class of blocks over 1 MiB.
    pub limit: Option<usize>,
    /// Allocations made.
    pub allocations: u64,
    /// Allocations freed.
    pub frees: u64,
    /// Bytes (rounded) now held.
    pub live_bytes: u64,
}

/// Statistics of a [`StreamOrderedAllocator`](super::StreamOrderedAllocator).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorStats {
    /// Allocations made.
    pub allocations: u64,
    /// Allocations freed (queued for freeing in stream order).
    pub frees: u64,
    /// Allocations outstanding.
    pub live: u64,
    /// Bytes (rounded) outstanding.
    pub live_bytes: u64,
    /// Bytes requested by the outstanding allocations, before rounding.
    pub requested_bytes: u64,
    /// Most bytes (rounded) outstanding at once.
    pub peak_bytes: u64,
    /// Cross-stream dependencies recorded.
    pub dependencies: u64,
    /// Per size class, smallest first.
    pub classes: Vec<SizeClassStats>,
}

impl AllocatorStats {
    pub(crate) fn empty() -> Self {
        Self {
            classes: (0..CLASS_COUNT)
                .map(|class| SizeClassStats {
                    limit: class_limit(class),
                    ..SizeClassStats::default()
                })
                .collect(),
            ..Self::default()
        }
    }

    pub(crate) fn on_allocate(&mut self, class: usize, rounded: u64, requested: u64) {
        self.allocations += 1;
        self.live += 1;
        self.live_bytes += rounded;
        self.requested_bytes += requested;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
        let class = &mut self.classes[class];
        class.allocations += 1;
        class.live_bytes += rounded;
    }

    pub(crate) fn on_free(&mut self, class: usize, rounded: u64, requested: u64) {
        self.frees += 1;
        self.live -= 1;
        self.live_bytes -= rounded;
        self.requested_bytes -= requested;
        let class = &mut self.classes[class];
        class.frees += 1;
        class.live_bytes -= rounded;
    }
}

impl std::fmt::Display for AllocatorStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} allocations, {} frees, {} live ({} bytes, {} requested, peak {}), {} dependencies",
            self.allocations,
            self.frees,
            self.live,
            self.live_bytes,
            self.requested_bytes,
            self.peak_bytes,
            self.dependencies
        )?;
        for class in self.classes.iter().filter(|c| c.allocations > 0) {
            let limit = class
                .limit
                .map_or_else(|| "> 1 MiB".to_string(), |l| format!("<= {l} B"));
            writeln!(
                f,
                "  {limit:>12}: {} allocations, {} frees, {} live bytes",
                class.allocations, class.frees, class.live_bytes
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_track_live_bytes_and_peak() {
        let mut stats = AllocatorStats::empty();
        stats.on_allocate(0, 512, 100);
        stats.on_allocate(12, 2 << 20, 1_500_000);
        stats.on_free(0, 512, 100);
        assert_eq!(stats.live, 1);
        assert_eq!(stats.live_bytes, 2 << 20);
        assert_eq!(stats.peak_bytes, (2 << 20) + 512);
        assert_eq!(stats.classes[0].frees, 1);
        assert_eq!(stats.classes[12].live_bytes, 2 << 20);
        assert!(stats.to_string().contains("> 1 MiB"));
    }
}
