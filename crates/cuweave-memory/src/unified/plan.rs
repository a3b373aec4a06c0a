//! [`PrefetchPlan`]: many (range, target) prefetches, issued on a stream in one go.

use std::fmt;

use cuweave_driver::memory::{DevicePtr, MemLocation};
use cuweave_driver::{Device, DriverError, Stream};

use super::capability::{ManagedCapabilities, check_ordinal, check_target};
use super::range::ManagedRange;
use super::raw;
use crate::buffer::tracker::{self, StreamTracker, ensure_same_device};
use crate::error::{MemoryError, Result};

/// How [`PrefetchPlan::execute`] issued its prefetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PrefetchPath {
    /// One `cuMemPrefetchBatchAsync` call (CUDA 13.0+ drivers).
    Batched,
    /// One `cuMemPrefetchAsync` (`_v2` where the driver has it) per entry, in order.
    PerRange,
}

impl fmt::Display for PrefetchPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Batched => "batched",
            Self::PerRange => "per-range",
        })
    }
}

/// A list of managed ranges and where each should migrate, executed on a stream in order.
///
/// Entries are checked when added: zero-length ranges, ranges of another device than the
/// plan's first entry, targets that do not exist, and devices without concurrent managed
/// access are refused. [`execute`](Self::execute) issues every entry with one
/// `cuMemPrefetchBatchAsync` where the driver has it (CUDA 13.0+) and one prefetch per entry
/// otherwise, and records the stream as a use of every buffer in the plan.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::buffer::UnifiedBuffer;
/// use cuweave_memory::unified::{MemLocation, PrefetchPlan};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let (inputs, outputs) = (
///     UnifiedBuffer::<f32>::new(&context, 1 << 20)?,
///     UnifiedBuffer::<f32>::new(&context, 1 << 20)?,
/// );
/// let mut plan = PrefetchPlan::new();
/// plan.add(&inputs, MemLocation::Device(0))?
///     .add(outputs.range(0, 1 << 10)?, MemLocation::Device(0))?;
/// let path = plan.execute(&stream)?;
/// println!("{} prefetches, {} bytes, {path}", plan.len(), plan.total_bytes());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct PrefetchPlan<'a> {
    entries: Vec<(ManagedRange<'a>, MemLocation)>,
}

impl<'a> PrefetchPlan<'a> {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a prefetch of `range` (a `&UnifiedBuffer`, or a [`ManagedRange`]) to `target`.
    ///
    /// # Errors
    /// `ZeroLength` for an empty range; `WrongDevice` for a range of another device than the
    /// plan's; `InvalidArgument` for a target device that does not exist; `CapabilityMissing`
    /// when the range's or the target's device lacks concurrent managed access.
    pub fn add(
        &mut self,
        range: impl Into<ManagedRange<'a>>,
        target: MemLocation,
    ) -> Result<&mut Self> {
        const OP: &str = "PrefetchPlan::add";
        let range = range.into();
        let plan_device = self
            .entries
            .first()
            .map(|(first, _)| first.device().ordinal());
        validate_entry(
            OP,
            range.bytes(),
            range.device().ordinal(),
            plan_device,
            target,
            Device::count()?,
        )?;
        ManagedCapabilities::of(range.device())?.require_concurrent_managed_access(OP)?;
        check_target(target, OP)?;
        self.entries.push((range, target));
        Ok(self)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the plan has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes over all entries.
    pub fn total_bytes(&self) -> usize {
        self.entries.iter().map(|(range, _)| range.bytes()).sum()
    }

    /// The entries, in order, as (address, bytes, target).
    pub fn entries(&self) -> impl Iterator<Item = (DevicePtr, usize, MemLocation)> + '_ {
        self.entries
            .iter()
            .map(|(range, target)| (range.ptr(), range.bytes(), *target))
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Queues every entry on `stream`, in order, and says which driver path it took.
    ///
    /// # Errors
    /// `ZeroLength` for an empty plan; `WrongDevice` for a stream of another device;
    /// `CapabilityMissing` without concurrent managed access; the driver's error.
    pub fn execute(&self, stream: &Stream) -> Result<PrefetchPath> {
        const OP: &str = "PrefetchPlan::execute";
        let Some((first, _)) = self.entries.first() else {
            return Err(MemoryError::ZeroLength { operation: OP });
        };
        ensure_same_device(OP, first.context(), stream)?;
        ManagedCapabilities::of(stream.device())?.require_concurrent_managed_access(OP)?;
        let batch_available = cuweave_driver::driver()?
            .mem_prefetch_batch_async
            .is_available();
        let trackers: Vec<&StreamTracker> = self
            .entries
            .iter()
            .filter_map(|(range, _)| range.tracker())
            .collect();
        let path = tracker::run(OP, stream, &trackers, || {
            if batch_available {
                match raw::prefetch_batch(&self.entries, stream) {
                    Ok(()) => return Ok(PrefetchPath::Batched),
                    Err(MemoryError::Driver(DriverError::Unsupported { .. })) => {}
                    Err(error) => return Err(error),
                }
            }
            for (range, target) in &self.entries {
                raw::prefetch(range, *target, stream)?;
            }
            Ok(PrefetchPath::PerRange)
        })?;
        Ok(path)
    }
}

/// The checks [`PrefetchPlan::add`] makes that need no driver: a nonzero length, the plan's
/// device, and a target device that exists among `device_count`.
pub(crate) fn validate_entry(
    operation: &'static str,
    bytes: usize,
    range_device: usize,
    plan_device: Option<usize>,
    target: MemLocation,
    device_count: usize,
) -> Result<()> {
    if bytes == 0 {
        return Err(MemoryError::ZeroLength { operation });
    }
    if let Some(expected) = plan_device.filter(|&expected| expected != range_device) {
        return Err(MemoryError::WrongDevice {
            operation,
            expected,
            actual: range_device,
        });
    }
    if let MemLocation::Device(ordinal) = target {
        check_ordinal(ordinal, device_count, operation)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case::first_entry(4096, 0, None, MemLocation::Device(0), 1, None)]
    #[case::host_target(4096, 1, Some(1), MemLocation::Host, 2, None)]
    #[case::second_device_target(1, 0, Some(0), MemLocation::Device(1), 2, None)]
    #[case::zero_size(0, 0, None, MemLocation::Device(0), 1, Some("zero"))]
    #[case::other_device(4096, 1, Some(0), MemLocation::Host, 2, Some("device"))]
    #[case::missing_target(4096, 0, Some(0), MemLocation::Device(1), 1, Some("target"))]
    fn entries_are_validated_when_added(
        #[case] bytes: usize,
        #[case] range_device: usize,
        #[case] plan_device: Option<usize>,
        #[case] target: MemLocation,
        #[case] device_count: usize,
        #[case] refusal: Option<&str>,
    ) {
        let got = validate_entry(
            "add",
            bytes,
            range_device,
            plan_device,
            target,
            device_count,
        );
        match (refusal, got) {
            (None, Ok(())) => {}
            (Some("zero"), Err(MemoryError::ZeroLength { operation: "add" })) => {}
            (
                Some("device"),
                Err(MemoryError::WrongDevice {
                    expected: 0,
                    actual: 1,
                    ..
                }),
            ) => {}
            (Some("target"), Err(MemoryError::Driver(DriverError::InvalidArgument { .. }))) => {}
            (refusal, got) => panic!("expected {refusal:?}, got {got:?}"),
        }
    }

    #[test]
    fn an_empty_plan_has_nothing_to_issue() {
        let mut plan = PrefetchPlan::new();
        assert!(plan.is_empty());
        assert_eq!((plan.len(), plan.total_bytes()), (0, 0));
        assert_eq!(plan.entries().count(), 0);
        plan.clear();
        assert!(plan.is_empty());
        assert_eq!(PrefetchPath::Batched.to_string(), "batched");
        assert_eq!(PrefetchPath::PerRange.to_string(), "per-range");
    }
}
