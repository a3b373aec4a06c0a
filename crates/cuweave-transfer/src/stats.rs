//! [`TransferStats`]: counts, bytes, time, failures and bandwidth per path and size class.

use std::collections::BTreeMap;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;

use crate::location::{SizeClass, TransferPath};

/// What was moved on one path in one size class.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct PathStats {
    /// Transfers that completed.
    pub count: u64,
    /// Bytes they moved.
    pub bytes: u64,
    /// Wall time they took, in total.
    pub time: Duration,
    /// Transfers that failed.
    pub failures: u64,
    /// The best bandwidth of one transfer, GB/s (10^9 bytes per second).
    pub best_gbps: f64,
}

impl PathStats {
    /// Mean bandwidth over all completed transfers (total bytes / total time), GB/s.
    pub fn mean_gbps(&self) -> f64 {
        let secs = self.time.as_secs_f64();
        if secs > 0.0 {
            self.bytes as f64 / secs / 1e9
        } else {
            0.0
        }
    }

    fn add(&mut self, bytes: usize, time: Duration) {
        self.count += 1;
        self.bytes += bytes as u64;
        self.time += time;
        let secs = time.as_secs_f64();
        if secs > 0.0 {
            self.best_gbps = self.best_gbps.max(bytes as f64 / secs / 1e9);
        }
    }
}

/// Statistics of a [`TransferManager`](crate::TransferManager), per (path, size class).
///
/// One short lock per recorded transfer; never held across a driver call.
#[derive(Debug, Default)]
pub struct TransferStats {
    entries: Mutex<BTreeMap<(TransferPath, SizeClass), PathStats>>,
}

impl TransferStats {
    /// Records a completed transfer of `bytes` that took `time`.
    pub fn record_success(&self, path: TransferPath, bytes: usize, time: Duration) {
        self.entries
            .lock()
            .entry((path, SizeClass::of(bytes)))
            .or_default()
            .add(bytes, time);
    }

    /// Records a failed transfer of `bytes`.
    pub fn record_failure(&self, path: TransferPath, bytes: usize) {
        self.entries
            .lock()
            .entry((path, SizeClass::of(bytes)))
            .or_default()
            .failures += 1;
    }

    /// The figures for one path and size class (zeros if nothing was recorded).
    pub fn get(&self, path: TransferPath, size_class: SizeClass) -> PathStats {
        self.entries
            .lock()
            .get(&(path, size_class))
            .copied()
            .unwrap_or_default()
    }

    /// Every (path, size class) with its figures, ordered by path then size.
    pub fn snapshot(&self) -> Vec<(TransferPath, SizeClass, PathStats)> {
        self.entries
            .lock()
            .iter()
            .map(|(&(path, class), &stats)| (path, class, stats))
            .collect()
    }

    /// Forgets everything recorded.
    pub fn reset(&self) {
        self.entries.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_add_up_per_path_and_size_class() {
        let stats = TransferStats::default();
        let p = TransferPath::PAGEABLE_TO_DEVICE;
        stats.record_success(p, 1 << 30, Duration::from_millis(100)); // 10.7 GB/s
        stats.record_success(p, 1 << 30, Duration::from_millis(50)); // 21.5 GB/s
        stats.record_failure(p, 1 << 30);
        stats.record_success(p, 100, Duration::from_micros(10));
        let huge = stats.get(p, SizeClass::Huge);
        assert_eq!((huge.count, huge.failures, huge.bytes), (2, 1, 2 << 30));
        assert!((huge.best_gbps - 21.47).abs() < 0.01, "{}", huge.best_gbps);
        assert!(
            (huge.mean_gbps() - 14.32).abs() < 0.01,
            "{}",
            huge.mean_gbps()
        );
        assert_eq!(stats.get(p, SizeClass::Tiny).count, 1);
        assert_eq!(stats.snapshot().len(), 2);
        stats.reset();
        assert!(stats.snapshot().is_empty());
        assert_eq!(stats.get(p, SizeClass::Huge), PathStats::default());
    }
}
