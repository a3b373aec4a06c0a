//! [`LimitAdaptor`]: a cap on the bytes outstanding through a resource.

use std::sync::atomic::{AtomicUsize, Ordering};

use cuweave_driver::Stream;
use cuweave_driver::memory::DevicePtr;

use super::MemoryResource;
use super::statistics::saturating_sub;
use crate::error::{MemoryError, Result};

/// The bytes reserved against a cap, updated lock-free.
#[derive(Debug)]
struct Budget {
    cap: usize,
    used: AtomicUsize,
}

impl Budget {
    /// Reserves `bytes`, or says how much is in use when that would pass the cap.
    fn try_reserve(&self, bytes: usize) -> Result<(), usize> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= self.cap)
            })
            .map(|_| ())
    }

    fn release(&self, bytes: usize) {
        saturating_sub(&self.used, bytes);
    }

    fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}

/// Caps the bytes outstanding through it (RMM's `limiting_resource_adaptor`): for tests of
/// out-of-memory paths, and for programs that share a GPU and must stay within a share.
///
/// A request that would take the total past the cap fails with
/// [`MemoryError::OutOfMemory`] carrying `limit: Some(cap)`, without calling the upstream. The
/// [`CachingAllocator`](crate::caching::CachingAllocator) above it treats that like the device
/// running out: it releases its cache, retries once, and reports the cap in its own error.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::resource::{DriverResource, LimitAdaptor, MemoryResource};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let limited = LimitAdaptor::new(DriverResource::new(&context), 64 << 20);
/// let ptr = limited.allocate(48 << 20, &stream)?;
/// assert!(limited.allocate(32 << 20, &stream).unwrap_err().is_out_of_memory());
/// limited.deallocate(ptr, 48 << 20, &stream)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct LimitAdaptor<R> {
    upstream: R,
    name: String,
    budget: Budget,
}

impl<R: MemoryResource> LimitAdaptor<R> {
    /// Wraps `upstream`, allowing at most `cap` bytes outstanding.
    pub fn new(upstream: R, cap: usize) -> Self {
        let name = format!("limit({})", upstream.name());
        Self {
            upstream,
            name,
            budget: Budget {
                cap,
                used: AtomicUsize::new(0),
            },
        }
    }

    /// The cap in bytes.
    pub fn cap(&self) -> usize {
        self.budget.cap
    }

    /// Bytes outstanding through the adaptor.
    pub fn used(&self) -> usize {
        self.budget.used()
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.upstream
    }
}

impl<R: MemoryResource> LimitAdaptor<R> {
    /// Reserves `bytes` of the budget and allocates them through `upstream`'s call.
    fn allocate_with(
        &self,
        bytes: usize,
        allocate: impl FnOnce(&R) -> Result<DevicePtr>,
    ) -> Result<DevicePtr> {
        if bytes == 0 {
            return Err(MemoryError::ZeroLength {
                operation: "LimitAdaptor::allocate",
            });
        }
        // Frees a capture deferred hold budget until they come back: they do first.
        crate::caching::return_frees_deferred_by_captures();
        if let Err(used) = self.budget.try_reserve(bytes) {
            return Err(MemoryError::OutOfMemory {
                requested: bytes,
                allocated: used,
                reserved: used,
                limit: Some(self.budget.cap),
            });
        }
        allocate(&self.upstream).inspect_err(|_| {
            self.budget.release(bytes);
        })
    }
}

// SAFETY: hands out and frees exactly what the upstream does (it only refuses some requests).
#[allow(unsafe_code)]
unsafe impl<R: MemoryResource> MemoryResource for LimitAdaptor<R> {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.allocate_with(bytes, |upstream| upstream.allocate(bytes, stream))
    }

    fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.upstream.deallocate(ptr, bytes, stream)?;
        self.budget.release(bytes);
        Ok(())
    }

    fn allocate_owned(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.allocate_with(bytes, |upstream| upstream.allocate_owned(bytes, stream))
    }

    fn deallocate_owned(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.upstream.deallocate_owned(ptr, bytes, stream)?;
        self.budget.release(bytes);
        Ok(())
    }

    super::forward_to_upstream!();
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use rstest::rstest;

    fn budget(cap: usize, used: usize) -> Budget {
        Budget {
            cap,
            used: AtomicUsize::new(used),
        }
    }

    #[rstest]
    #[case(100, 0, 100, Ok(()))]
    #[case(100, 40, 60, Ok(()))]
    #[case(100, 40, 61, Err(40))]
    #[case(100, 0, 101, Err(0))]
    #[case(usize::MAX, 10, usize::MAX, Err(10))]
    fn reserves_only_within_the_cap(
        #[case] cap: usize,
        #[case] used: usize,
        #[case] bytes: usize,
        #[case] outcome: Result<(), usize>,
    ) {
        let budget = budget(cap, used);
        assert_eq!(budget.try_reserve(bytes), outcome);
        let expected = if outcome.is_ok() { used + bytes } else { used };
        assert_eq!(budget.used(), expected, "a refusal reserves nothing");
    }

    #[test]
    fn concurrent_reservations_never_pass_the_cap() {
        let budget = Arc::new(budget(1000, 0));
        let granted = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (budget, granted) = (Arc::clone(&budget), Arc::clone(&granted));
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        if budget.try_reserve(7).is_ok() {
                            granted.fetch_add(7, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(
            granted.load(Ordering::Relaxed),
            994,
            "142 reservations of 7 fit in 1000"
        );
        assert_eq!(budget.used(), 994);
        budget.release(994);
        budget.release(5);
        assert_eq!(budget.used(), 0);
    }
}
