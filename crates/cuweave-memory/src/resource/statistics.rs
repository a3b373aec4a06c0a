//! [`StatisticsAdaptor`]: counts what passes through to its upstream.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use cuweave_driver::Stream;
use cuweave_driver::memory::DevicePtr;

use super::MemoryResource;
use crate::error::Result;

/// What a [`StatisticsAdaptor`] has counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceStats {
    /// Bytes allocated through the adaptor and not yet freed.
    pub current_bytes: usize,
    /// The most `current_bytes` has been since creation or [`StatisticsAdaptor::reset_peak`].
    pub peak_bytes: usize,
    /// Allocations outstanding.
    pub current_allocations: usize,
    /// The most `current_allocations` has been.
    pub peak_allocations: usize,
    /// Successful allocations, ever.
    pub total_allocations: u64,
    /// Successful frees, ever.
    pub total_deallocations: u64,
    /// Allocations the upstream refused.
    pub failed_allocations: u64,
}

/// Lock-free counters, current and peak.
#[derive(Debug, Default)]
struct Counters {
    bytes: AtomicUsize,
    peak_bytes: AtomicUsize,
    count: AtomicUsize,
    peak_count: AtomicUsize,
    allocations: AtomicU64,
    deallocations: AtomicU64,
    failures: AtomicU64,
}

impl Counters {
    fn allocated(&self, bytes: usize) {
        let now = self.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_bytes.fetch_max(now, Ordering::Relaxed);
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak_count.fetch_max(count, Ordering::Relaxed);
        self.allocations.fetch_add(1, Ordering::Relaxed);
    }

    fn deallocated(&self, bytes: usize) {
        saturating_sub(&self.bytes, bytes);
        saturating_sub(&self.count, 1);
        self.deallocations.fetch_add(1, Ordering::Relaxed);
    }

    fn failed(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> ResourceStats {
        ResourceStats {
            current_bytes: self.bytes.load(Ordering::Relaxed),
            peak_bytes: self.peak_bytes.load(Ordering::Relaxed),
            current_allocations: self.count.load(Ordering::Relaxed),
            peak_allocations: self.peak_count.load(Ordering::Relaxed),
            total_allocations: self.allocations.load(Ordering::Relaxed),
            total_deallocations: self.deallocations.load(Ordering::Relaxed),
            failed_allocations: self.failures.load(Ordering::Relaxed),
        }
    }

    fn reset_peak(&self) {
        self.peak_bytes
            .store(self.bytes.load(Ordering::Relaxed), Ordering::Relaxed);
        self.peak_count
            .store(self.count.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// Subtracts without wrapping below zero (a caller passing a wrong size must not poison the
/// counters for everybody else).
pub(super) fn saturating_sub(counter: &AtomicUsize, amount: usize) {
    // The closure always returns Some, so the update cannot fail.
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |value| {
        Some(value.saturating_sub(amount))
    });
}

/// Counts the allocations, frees and bytes that pass through to its upstream (RMM's
/// `statistics_resource_adaptor`): current and peak bytes and allocations, totals, failures.
///
/// Counting is a few relaxed atomic operations, so the adaptor can stay in production stacks.
/// Put it under a [`CachingAllocator`](crate::caching::CachingAllocator) to count the driver
/// allocations the cache saves.
///
/// ```no_run
/// use std::sync::Arc;
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::caching::CachingAllocator;
/// use cuweave_memory::resource::{DriverResource, StatisticsAdaptor};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let counted = Arc::new(StatisticsAdaptor::new(DriverResource::new(&context)));
/// let allocator = CachingAllocator::new(counted.clone());
/// drop(allocator.allocate(1 << 20, &stream)?);
/// drop(allocator.allocate(1 << 20, &stream)?);
/// assert_eq!(counted.stats().total_allocations, 1, "the second came from the cache");
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct StatisticsAdaptor<R> {
    upstream: R,
    name: String,
    counters: Counters,
}

impl<R: MemoryResource> StatisticsAdaptor<R> {
    /// Wraps `upstream`.
    pub fn new(upstream: R) -> Self {
        let name = format!("statistics({})", upstream.name());
        Self {
            upstream,
            name,
            counters: Counters::default(),
        }
    }

    /// What has been counted so far.
    pub fn stats(&self) -> ResourceStats {
        self.counters.snapshot()
    }

    /// Sets the peaks to the current values.
    pub fn reset_peak(&self) {
        self.counters.reset_peak();
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.upstream
    }
}

impl<R: MemoryResource> StatisticsAdaptor<R> {
    /// Counts what `allocated` (the upstream's answer for `bytes`) did.
    fn count(&self, bytes: usize, allocated: Result<DevicePtr>) -> Result<DevicePtr> {
        match allocated {
            Ok(ptr) => {
                self.counters.allocated(bytes);
                Ok(ptr)
            }
            Err(error) => {
                self.counters.failed();
                Err(error)
            }
        }
    }
}

// SAFETY: hands out and frees exactly what the upstream does (it only counts).
#[allow(unsafe_code)]
unsafe impl<R: MemoryResource> MemoryResource for StatisticsAdaptor<R> {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.count(bytes, self.upstream.allocate(bytes, stream))
    }

    fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.upstream.deallocate(ptr, bytes, stream)?;
        self.counters.deallocated(bytes);
        Ok(())
    }

    fn allocate_owned(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.count(bytes, self.upstream.allocate_owned(bytes, stream))
    }

    fn deallocate_owned(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.upstream.deallocate_owned(ptr, bytes, stream)?;
        self.counters.deallocated(bytes);
        Ok(())
    }

    super::forward_to_upstream!();
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn counters_track_current_peak_and_totals() {
        let counters = Counters::default();
        counters.allocated(100);
        counters.allocated(300);
        counters.deallocated(100);
        counters.failed();
        assert_eq!(
            counters.snapshot(),
            ResourceStats {
                current_bytes: 300,
                peak_bytes: 400,
                current_allocations: 1,
                peak_allocations: 2,
                total_allocations: 2,
                total_deallocations: 1,
                failed_allocations: 1,
            }
        );
        counters.reset_peak();
        let stats = counters.snapshot();
        assert_eq!((stats.peak_bytes, stats.peak_allocations), (300, 1));
        counters.deallocated(1000);
        assert_eq!(
            counters.snapshot().current_bytes,
            0,
            "never wraps below zero"
        );
    }

    #[test]
    fn counters_balance_under_contention() {
        let counters = Arc::new(Counters::default());
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let counters = Arc::clone(&counters);
                std::thread::spawn(move || {
                    for size in 1..=1000 {
                        counters.allocated(size);
                        counters.deallocated(size);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let stats = counters.snapshot();
        assert_eq!((stats.current_bytes, stats.current_allocations), (0, 0));
        assert_eq!(stats.total_allocations, 8000);
        assert!(stats.peak_allocations >= 1 && stats.peak_allocations <= 8);
    }
}
