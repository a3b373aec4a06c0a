//! [`ManagedMemoryHints`]: advice, policies, prefetches and read-backs for one managed range.

use cuweave_driver::memory::{self, MemLocation};
use cuweave_driver::{Device, Stream};

use super::advice::MemAdvice;
use super::capability::{ManagedCapabilities, check_ordinal, check_target};
use super::policy::MigrationPolicy;
use super::range::ManagedRange;
use super::raw;
use crate::buffer::range::DeviceSpan;
use crate::buffer::tracker::{self, StreamTracker, ensure_same_device};
use crate::buffer::{Buffer, UnifiedBuffer};
use crate::element::Element;
use crate::error::Result;

/// Migration hints for one managed range: each advice, policies, prefetches (whole or
/// range-checked) and the driver's read-back of what is in effect.
///
/// Made for a [`UnifiedBuffer`] ([`UnifiedBuffer::hints`] or [`for_buffer`](Self::for_buffer);
/// offsets and lengths are then in the buffer's elements, and prefetches are recorded as uses
/// of the buffer, so its host access waits for them) or for a raw range
/// ([`from_raw`](Self::from_raw); offsets in bytes).
///
/// Capabilities are checked first, from a per-device cache: any hint needs managed memory;
/// prefetching, and advice aimed at a device, need concurrent managed access (of the stream's
/// device and the target device). A device that lacks one is
/// [`DriverError::CapabilityMissing`](cuweave_driver::DriverError::CapabilityMissing) naming it;
/// a device ordinal that does not exist is `InvalidArgument`.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::buffer::UnifiedBuffer;
/// use cuweave_memory::unified::{MemLocation, MigrationPolicy};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let weights = UnifiedBuffer::<f32>::new(&context, 1 << 20)?;
/// let hints = weights.hints()?;
/// hints.apply_policy(&MigrationPolicy::ReadMostly)?;
/// assert!(hints.read_mostly()?);
/// hints.prefetch_range(0, 1 << 19, MemLocation::Device(0), &stream)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ManagedMemoryHints<'a> {
    range: ManagedRange<'a>,
    element_size: usize,
    capabilities: ManagedCapabilities,
}

impl<'a> ManagedMemoryHints<'a> {
    pub(crate) fn new(
        range: ManagedRange<'a>,
        element_size: usize,
        capabilities: ManagedCapabilities,
    ) -> Self {
        Self {
            range,
            element_size,
            capabilities,
        }
    }

    /// Hints for the whole of `buffer`.
    ///
    /// # Errors
    /// `CapabilityMissing` when the device has no managed memory.
    pub fn for_buffer<T: Element>(buffer: &'a UnifiedBuffer<T>) -> Result<Self> {
        let capabilities = ManagedCapabilities::of(buffer.device())?;
        capabilities.require_managed_memory("ManagedMemoryHints::for_buffer")?;
        Ok(Self::new(buffer.as_range(), size_of::<T>(), capabilities))
    }

    /// Hints for one managed range (of a buffer, or of raw hints); offsets are then in bytes.
    ///
    /// # Errors
    /// `CapabilityMissing` when the device has no managed memory.
    pub fn for_range(range: ManagedRange<'a>) -> Result<Self> {
        let capabilities = ManagedCapabilities::of(range.device())?;
        capabilities.require_managed_memory("ManagedMemoryHints::for_range")?;
        Ok(Self::new(range, 1, capabilities))
    }

    /// The whole range the hints are for.
    pub fn as_range(&self) -> &ManagedRange<'a> {
        &self.range
    }

    /// Units `offset..offset + len` of the range (elements for a buffer, bytes for a raw range).
    ///
    /// # Errors
    /// `ZeroLength` for `len == 0`, `OutOfRange` past the end.
    pub fn subrange(&self, offset: usize, len: usize) -> Result<ManagedRange<'a>> {
        self.checked_subrange("ManagedMemoryHints::subrange", offset, len)
    }

    fn checked_subrange(
        &self,
        operation: &'static str,
        offset: usize,
        len: usize,
    ) -> Result<ManagedRange<'a>> {
        let capacity = self.range.bytes() / self.element_size;
        let span = DeviceSpan::of_elements(
            operation,
            self.range.ptr(),
            capacity,
            self.element_size,
            offset,
            len,
        )?;
        Ok(ManagedRange::new(
            self.range.context(),
            span,
            self.range.tracker(),
        ))
    }

    /// The device's managed-memory capabilities.
    pub fn capabilities(&self) -> ManagedCapabilities {
        self.capabilities
    }

    /// Gives the driver one advice about the whole range.
    pub fn advise(&self, advice: MemAdvice) -> Result<()> {
        self.check_advice(advice, "ManagedMemoryHints::advise")?;
        raw::advise(&self.range, advice)
    }

    fn check_advice(&self, advice: MemAdvice, operation: &'static str) -> Result<()> {
        self.capabilities.require_managed_memory(operation)?;
        match advice {
            MemAdvice::SetPreferredLocation(target) | MemAdvice::SetAccessedBy(target) => {
                check_target(target, operation)
            }
            MemAdvice::UnsetAccessedBy(MemLocation::Device(ordinal)) => {
                check_ordinal(ordinal, Device::count()?, operation)
            }
            _ => Ok(()),
        }
    }

    /// Advises that the range is mostly read.
    pub fn set_read_mostly(&self) -> Result<()> {
        self.advise(MemAdvice::SetReadMostly)
    }

    /// Undoes [`set_read_mostly`](Self::set_read_mostly).
    pub fn unset_read_mostly(&self) -> Result<()> {
        self.advise(MemAdvice::UnsetReadMostly)
    }

    /// Advises keeping the pages at `location`.
    pub fn set_preferred_location(&self, location: MemLocation) -> Result<()> {
        self.advise(MemAdvice::SetPreferredLocation(location))
    }

    /// Forgets the preferred location.
    pub fn unset_preferred_location(&self) -> Result<()> {
        self.advise(MemAdvice::UnsetPreferredLocation)
    }

    /// Advises that `location` will access the range (keep it mapped there).
    pub fn set_accessed_by(&self, location: MemLocation) -> Result<()> {
        self.advise(MemAdvice::SetAccessedBy(location))
    }

    /// Undoes [`set_accessed_by`](Self::set_accessed_by) for `location`.
    pub fn unset_accessed_by(&self, location: MemLocation) -> Result<()> {
        self.advise(MemAdvice::UnsetAccessedBy(location))
    }

    /// Replaces the range's policy with `policy`: clears read-mostly, the preferred location and
    /// every accessed-by (the ones the range reports, the host's, and those of every device that
    /// could hold one: the driver reports an accessed-by only when it covers the whole range, so
    /// one set on part of it is cleared by name), then issues [`MigrationPolicy::advice`].
    /// Targets are checked before anything changes.
    pub fn apply_policy(&self, policy: &MigrationPolicy) -> Result<()> {
        const OP: &str = "ManagedMemoryHints::apply_policy";
        let advice = policy.advice();
        for &one in &advice {
            self.check_advice(one, OP)?;
        }
        raw::advise(&self.range, MemAdvice::UnsetReadMostly)?;
        raw::advise(&self.range, MemAdvice::UnsetPreferredLocation)?;
        let mut accessors = self.accessed_by()?;
        if !accessors.contains(&MemLocation::Host) {
            accessors.push(MemLocation::Host);
        }
        for ordinal in 0..Device::count()? {
            let device = MemLocation::Device(ordinal);
            if !accessors.contains(&device)
                && ManagedCapabilities::of(Device::get(ordinal)?)?.concurrent_managed_access
            {
                accessors.push(device);
            }
        }
        for accessor in accessors {
            raw::advise(&self.range, MemAdvice::UnsetAccessedBy(accessor))?;
        }
        for one in advice {
            raw::advise(&self.range, one)?;
        }
        Ok(())
    }

    /// Queues a migration of the whole range to `location` on `stream`.
    pub fn prefetch_to(&self, location: MemLocation, stream: &Stream) -> Result<()> {
        prefetch(&self.range, location, stream)
    }

    /// Queues a migration of units `offset..offset + len` (elements for a buffer, bytes for a
    /// raw range) to `location` on `stream`.
    ///
    /// # Errors
    /// `ZeroLength` / `OutOfRange` for a bad range, before any driver call.
    pub fn prefetch_range(
        &self,
        offset: usize,
        len: usize,
        location: MemLocation,
        stream: &Stream,
    ) -> Result<()> {
        let range = self.checked_subrange("ManagedMemoryHints::prefetch_range", offset, len)?;
        prefetch(&range, location, stream)
    }

    /// Whether the driver reports the whole range as read-mostly.
    pub fn read_mostly(&self) -> Result<bool> {
        let range = &self.range;
        Ok(memory::range_read_mostly(
            range.context(),
            range.ptr(),
            range.bytes(),
        )?)
    }

    /// The preferred location the driver reports for the whole range, if it has one.
    pub fn preferred_location(&self) -> Result<Option<MemLocation>> {
        let range = &self.range;
        Ok(memory::range_preferred_location(
            range.context(),
            range.ptr(),
            range.bytes(),
        )?)
    }

    /// Every location the driver reports as accessing the whole range.
    pub fn accessed_by(&self) -> Result<Vec<MemLocation>> {
        let range = &self.range;
        Ok(memory::range_accessed_by(
            range.context(),
            range.ptr(),
            range.bytes(),
        )?)
    }

    /// Where the whole range was last asked to be prefetched to (whether or not that finished).
    pub fn last_prefetch_location(&self) -> Result<Option<MemLocation>> {
        let range = &self.range;
        Ok(memory::range_last_prefetch_location(
            range.context(),
            range.ptr(),
            range.bytes(),
        )?)
    }
}

/// Checks capabilities and devices, then queues a prefetch of `range`, recorded on its buffer.
pub(crate) fn prefetch(
    range: &ManagedRange<'_>,
    location: MemLocation,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "prefetch";
    ensure_same_device(OP, range.context(), stream)?;
    ManagedCapabilities::of(stream.device())?.require_concurrent_managed_access(OP)?;
    check_target(location, OP)?;
    let trackers: Vec<&StreamTracker> = range.tracker().into_iter().collect();
    tracker::run(OP, stream, &trackers, || {
        raw::prefetch(range, location, stream)
    })?;
    Ok(())
}

/// Migration hints and prefetches straight from the buffer.
impl<T: Element> UnifiedBuffer<T> {
    /// Hints for the whole buffer (offsets in elements).
    pub fn hints(&self) -> Result<ManagedMemoryHints<'_>> {
        ManagedMemoryHints::for_buffer(self)
    }

    /// Gives the driver one advice about the whole buffer.
    pub fn advise(&self, advice: MemAdvice) -> Result<()> {
        self.hints()?.advise(advice)
    }

    /// Replaces the buffer's migration policy (see [`ManagedMemoryHints::apply_policy`]).
    pub fn apply_policy(&self, policy: &MigrationPolicy) -> Result<()> {
        self.hints()?.apply_policy(policy)
    }

    /// Queues a migration of the whole buffer to `location` on `stream`, recorded as a use:
    /// host access waits for it.
    pub fn prefetch_to(&self, location: MemLocation, stream: &Stream) -> Result<()> {
        prefetch(&self.as_range(), location, stream)
    }

    /// Queues a migration of elements `offset..offset + len` to `location` on `stream`.
    pub fn prefetch_range(
        &self,
        offset: usize,
        len: usize,
        location: MemLocation,
        stream: &Stream,
    ) -> Result<()> {
        prefetch(&self.range(offset, len)?, location, stream)
    }
}
