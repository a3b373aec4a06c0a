//! The unified module's unsafe spot: the driver's advise and prefetch calls on managed ranges,
//! and the raw-range constructor whose caller vouches for the range's lifetime.
//!
//! The driver's `advise`, `prefetch_async` and `prefetch_batch_async` require a range inside one
//! live managed allocation (until the stream passes a prefetch). A [`ManagedRange`] guarantees
//! that: one from a buffer borrows it (and prefetches are recorded on its tracker, which the
//! buffer synchronizes before freeing), one from [`ManagedMemoryHints::from_raw`] carries that
//! function's contract.

use std::sync::Arc;

use cuweave_driver::memory::{self, DevicePtr, MemLocation, PrefetchRange};
use cuweave_driver::{Context, DriverError, Stream};

use super::advice::MemAdvice;
use super::capability::ManagedCapabilities;
use super::hints::ManagedMemoryHints;
use super::range::ManagedRange;
use crate::buffer::range::DeviceSpan;
use crate::error::{MemoryError, Result};

/// Gives the driver `advice` about `range`.
pub(crate) fn advise(range: &ManagedRange<'_>, advice: MemAdvice) -> Result<()> {
    let (code, location) = advice.driver_args(range.device().ordinal());
    // SAFETY: a ManagedRange lies inside one live managed allocation (its invariant).
    unsafe { memory::advise(range.context(), range.ptr(), range.bytes(), code, location) }?;
    Ok(())
}

/// Queues a prefetch of `range` to `location` on `stream` (inside `tracker::run`).
pub(crate) fn prefetch(
    range: &ManagedRange<'_>,
    location: MemLocation,
    stream: &Stream,
) -> Result<()> {
    // SAFETY: a ManagedRange lies inside one live managed allocation, which outlives the queued
    // prefetch: a buffer's because the caller records it on the buffer's tracker, a raw range's
    // by `from_raw`'s contract.
    unsafe { memory::prefetch_async(range.ptr(), range.bytes(), location, stream) }?;
    Ok(())
}

/// Queues every `(range, target)` with one `cuMemPrefetchBatchAsync` (inside `tracker::run`).
pub(crate) fn prefetch_batch(
    entries: &[(ManagedRange<'_>, MemLocation)],
    stream: &Stream,
) -> Result<()> {
    let ranges: Vec<PrefetchRange> = entries
        .iter()
        .map(|(range, location)| PrefetchRange {
            ptr: range.ptr(),
            bytes: range.bytes(),
            location: *location,
        })
        .collect();
    // SAFETY: as in `prefetch`, for every range.
    unsafe { memory::prefetch_batch_async(&ranges, stream) }?;
    Ok(())
}

impl ManagedMemoryHints<'static> {
    /// Hints for `bytes` bytes of managed memory at `ptr` that this crate did not allocate
    /// (another library's `cudaMallocManaged`, say). Offsets and lengths are then in bytes.
    ///
    /// Checks that the length is nonzero, that the device has managed memory, that the driver
    /// reports `ptr` as managed memory, and that the range lies inside the allocation holding
    /// `ptr`.
    ///
    /// # Safety
    /// The range must stay allocated for as long as the hints (and ranges and plans made from
    /// them) are used, and until every prefetch queued through them has finished on its stream.
    ///
    /// # Errors
    /// `ZeroLength`; `CapabilityMissing`; `InvalidArgument` for memory that is not managed;
    /// `OutOfRange` when the range runs past its allocation; the driver's error for an address
    /// it does not know.
    pub unsafe fn from_raw(context: &Arc<Context>, ptr: DevicePtr, bytes: usize) -> Result<Self> {
        const OP: &str = "ManagedMemoryHints::from_raw";
        if bytes == 0 {
            return Err(MemoryError::ZeroLength { operation: OP });
        }
        let capabilities = ManagedCapabilities::of(context.device())?;
        capabilities.require_managed_memory(OP)?;
        context.bind_to_thread()?;
        let attributes = memory::pointer_attributes(ptr)?;
        if !attributes.is_managed {
            return Err(DriverError::InvalidArgument {
                operation: OP,
                reason: format!(
                    "{ptr:#x} is not managed memory ({:?})",
                    attributes.memory_type
                ),
            }
            .into());
        }
        let (base, size) = memory::address_range(context, ptr)?;
        let offset = (ptr - base) as usize;
        if offset.checked_add(bytes).is_none_or(|end| end > size) {
            return Err(MemoryError::OutOfRange {
                operation: OP,
                offset,
                len: bytes,
                capacity: size,
            });
        }
        let range = ManagedRange::new(context, DeviceSpan::checked(ptr, bytes), None);
        Ok(ManagedMemoryHints::new(range, 1, capabilities))
    }
}
