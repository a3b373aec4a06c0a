//! Managed (unified) memory: allocation, advice, prefetch and range queries.
//!
//! Advice and prefetch go through the `_v2` entry points (a `CUmemLocation` naming a device or
//! the host) where the driver has them, and the CUDA 8 forms (a device ordinal, `CU_DEVICE_CPU`
//! for the host) otherwise; see [`crate::loader`].

use std::sync::Arc;

use super::{DevicePtr, nonzero};
use crate::context::Context;
use crate::error::{DriverError, Result};
use crate::loader::{MemAdviseFn, MemPrefetchFn, cu, driver};
use crate::stream::Stream;
use crate::sys;

/// Where managed memory should live or be accessed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemLocation {
    /// A device, by ordinal.
    Device(usize),
    /// The host (system memory).
    Host,
}

impl std::fmt::Display for MemLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Device(ordinal) => write!(f, "device {ordinal}"),
            Self::Host => f.write_str("host"),
        }
    }
}

impl MemLocation {
    /// The CUDA 12.2+ `CUmemLocation`.
    pub fn to_raw(self) -> sys::CUmemLocation {
        match self {
            Self::Device(ordinal) => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal as i32,
            },
            Self::Host => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                id: 0,
            },
        }
    }

    /// The pre-12.2 form: a device ordinal, or `CU_DEVICE_CPU` for the host.
    pub fn to_legacy_device(self) -> sys::CUdevice {
        match self {
            Self::Device(ordinal) => ordinal as sys::CUdevice,
            Self::Host => sys::CU_DEVICE_CPU,
        }
    }

    /// Decodes the legacy form a range attribute reports: `None` for "no location".
    pub fn from_legacy_device(raw: i32) -> Option<Self> {
        match raw {
            sys::CU_DEVICE_CPU => Some(Self::Host),
            ordinal if ordinal >= 0 => Some(Self::Device(ordinal as usize)),
            _ => None,
        }
    }
}

/// One `cuMemAdvise` advice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Advice {
    /// Data is mostly read: processors may keep read-only copies (location ignored).
    SetReadMostly,
    /// Undo [`Advice::SetReadMostly`] (location ignored).
    UnsetReadMostly,
    /// Prefer keeping the pages at the location.
    SetPreferredLocation,
    /// Forget the preferred location (location ignored).
    UnsetPreferredLocation,
    /// The location will access the data: keep it mapped there to avoid faults.
    SetAccessedBy,
    /// Undo [`Advice::SetAccessedBy`] for the location.
    UnsetAccessedBy,
}

impl Advice {
    /// The raw `CUmem_advise`.
    pub fn to_raw(self) -> sys::CUmem_advise {
        use sys::CUmem_advise as A;
        match self {
            Self::SetReadMostly => A::CU_MEM_ADVISE_SET_READ_MOSTLY,
            Self::UnsetReadMostly => A::CU_MEM_ADVISE_UNSET_READ_MOSTLY,
            Self::SetPreferredLocation => A::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
            Self::UnsetPreferredLocation => A::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION,
            Self::SetAccessedBy => A::CU_MEM_ADVISE_SET_ACCESSED_BY,
            Self::UnsetAccessedBy => A::CU_MEM_ADVISE_UNSET_ACCESSED_BY,
        }
    }
}

fn require_managed(context: &Context, concurrent: bool, operation: &'static str) -> Result<()> {
    let device = context.device();
    let support = device.managed_support()?;
    if !support.managed_memory {
        return Err(DriverError::CapabilityMissing {
            capability: "managed memory",
            device: device.ordinal(),
            operation,
        });
    }
    if concurrent && !support.concurrent_managed_access {
        return Err(DriverError::CapabilityMissing {
            capability: "concurrent managed access",
            device: device.ordinal(),
            operation,
        });
    }
    Ok(())
}

/// Managed memory from `cuMemAllocManaged` (attached globally), freed on drop.
///
/// Keep managed allocations within the device's free memory: oversubscribing managed memory
/// can stall the whole GPU, not only this process.
#[derive(Debug)]
pub struct ManagedAllocation {
    context: Arc<Context>,
    ptr: DevicePtr,
    bytes: usize,
}

impl ManagedAllocation {
    /// Allocates `bytes` of managed memory.
    ///
    /// # Errors
    /// `InvalidArgument` for zero bytes; `CapabilityMissing` on a device without managed memory.
    pub fn new(context: &Arc<Context>, bytes: usize) -> Result<Self> {
        nonzero(bytes, "ManagedAllocation::new")?;
        require_managed(context, false, "ManagedAllocation::new")?;
        context.bind_to_thread()?;
        let api = driver()?;
        let mut ptr = 0;
        // A capture records no allocation: relaxed while capturing, as `DeviceAllocation::new`.
        let relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: valid out-pointer; nonzero size; the context is current.
        let allocated = unsafe {
            cu!(api.mem_alloc_managed(
                &mut ptr,
                bytes,
                sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL.0
            ))
        };
        drop(relaxed);
        allocated?;
        Ok(Self {
            context: Arc::clone(context),
            ptr,
            bytes,
        })
    }

    /// The address, valid on the host and on every device.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Always `false`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The context it was allocated in.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

impl Drop for ManagedAllocation {
    fn drop(&mut self) {
        // SAFETY: we own this managed allocation and free it once (cuMemFree synchronises).
        if let Err(error) = unsafe { super::free_device_memory(&self.context, self.ptr) } {
            tracing::warn!(%error, bytes = self.bytes, "freeing managed memory failed");
        }
    }
}

/// Gives the driver `advice` about the managed range `[ptr, ptr + bytes)` for `location`.
///
/// # Errors
/// `CapabilityMissing` when the context's device lacks managed memory; `InvalidArgument` for a
/// zero-length range; the driver's error for a range that is not managed memory.
///
/// # Safety
/// The range must lie inside one live managed allocation. (Advice never moves data in a way
/// safe code can observe, but the driver's behaviour on foreign ranges is not specified.)
pub unsafe fn advise(
    context: &Context,
    ptr: DevicePtr,
    bytes: usize,
    advice: Advice,
    location: MemLocation,
) -> Result<()> {
    nonzero(bytes, "advise")?;
    require_managed(context, false, "advise")?;
    context.bind_to_thread()?;
    let api = driver()?;
    let code = match api.mem_advise()? {
        // SAFETY: the caller's contract; the location is a valid CUmemLocation by construction.
        MemAdviseFn::Location(f) => unsafe { f(ptr, bytes, advice.to_raw(), location.to_raw()) },
        // SAFETY: as above, in the ordinal form.
        MemAdviseFn::Ordinal(f) => unsafe {
            f(ptr, bytes, advice.to_raw(), location.to_legacy_device())
        },
    };
    api.check(code, "cuMemAdvise")
}

/// Queues a migration of the managed range to `location` on `stream`.
///
/// # Errors
/// `CapabilityMissing` without concurrent managed access (prefetch needs it); the driver's
/// error for a range that is not managed memory;
/// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing queued, when `stream` is
/// the legacy default stream while a blocking stream of its context captures
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// The range must lie inside one live managed allocation until `stream` passes the prefetch.
pub unsafe fn prefetch_async(
    ptr: DevicePtr,
    bytes: usize,
    location: MemLocation,
    stream: &Stream,
) -> Result<()> {
    nonzero(bytes, "prefetch_async")?;
    crate::graph::refuse_on_legacy_stream(stream, "prefetch_async")?;
    require_managed(stream.context(), true, "prefetch_async")?;
    stream.context().bind_to_thread()?;
    let api = driver()?;
    let code = match api.mem_prefetch()? {
        // SAFETY: the caller's contract; flags must be 0.
        MemPrefetchFn::Location(f) => unsafe {
            f(ptr, bytes, location.to_raw(), 0, stream.as_raw())
        },
        // SAFETY: the caller's contract, in the ordinal form.
        MemPrefetchFn::Ordinal(f) => unsafe {
            f(ptr, bytes, location.to_legacy_device(), stream.as_raw())
        },
    };
    api.check(code, "cuMemPrefetchAsync")
}

/// One range of a batched prefetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchRange {
    /// Start of the managed range.
    pub ptr: DevicePtr,
    /// Length in bytes (nonzero).
    pub bytes: usize,
    /// Where to migrate it.
    pub location: MemLocation,
}

/// Queues all `ranges` with one `cuMemPrefetchBatchAsync` (CUDA 13.0+ drivers).
///
/// Consecutive ranges with the same target share one location entry, as the call expects.
///
/// # Errors
/// `Unsupported { symbol: "cuMemPrefetchBatchAsync" }` on older drivers (callers fall back to
/// [`prefetch_async`] per range); `InvalidArgument` for an empty batch or a zero-length range;
/// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing queued, when `stream` is
/// the legacy default stream while a blocking stream of its context captures
/// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)).
///
/// # Safety
/// As [`prefetch_async`], for every range.
pub unsafe fn prefetch_batch_async(ranges: &[PrefetchRange], stream: &Stream) -> Result<()> {
    if ranges.is_empty() {
        return Err(DriverError::invalid("prefetch_batch_async", "empty batch"));
    }
    if let Some(index) = ranges.iter().position(|r| r.bytes == 0) {
        return Err(DriverError::invalid(
            "prefetch_batch_async",
            format!("range {index} is zero bytes long"),
        ));
    }
    crate::graph::refuse_on_legacy_stream(stream, "prefetch_batch_async")?;
    require_managed(stream.context(), true, "prefetch_batch_async")?;
    let api = driver()?;
    let function = api.mem_prefetch_batch_async.get()?;
    stream.context().bind_to_thread()?;
    let mut pointers: Vec<DevicePtr> = ranges.iter().map(|r| r.ptr).collect();
    let mut sizes: Vec<usize> = ranges.iter().map(|r| r.bytes).collect();
    let mut locations = Vec::new();
    let mut starts = Vec::new();
    for (index, range) in ranges.iter().enumerate() {
        if index == 0 || ranges[index - 1].location != range.location {
            locations.push(range.location.to_raw());
            starts.push(index);
        }
    }
    // SAFETY: the arrays are as long as the counts passed and live across the call; the caller
    // guarantees the ranges; flags must be 0.
    let code = unsafe {
        function(
            pointers.as_mut_ptr(),
            sizes.as_mut_ptr(),
            ranges.len(),
            locations.as_mut_ptr(),
            starts.as_mut_ptr(),
            locations.len(),
            0,
            stream.as_raw(),
        )
    };
    api.check(code, "cuMemPrefetchBatchAsync")
}

/// Reads one 32-bit range attribute of a managed range (`cuMemRangeGetAttribute`).
///
/// Safe: the driver validates the range and answers with an error for unmanaged memory.
pub fn range_attribute(
    context: &Context,
    ptr: DevicePtr,
    bytes: usize,
    attribute: sys::CUmem_range_attribute,
) -> Result<i32> {
    nonzero(bytes, "range_attribute")?;
    context.bind_to_thread()?;
    let api = driver()?;
    let mut value: i32 = 0;
    // SAFETY: the 32-bit attributes write one i32 into `value`, whose size we pass.
    unsafe {
        cu!(api.mem_range_get_attribute(
            (&mut value as *mut i32).cast(),
            size_of::<i32>(),
            attribute,
            ptr,
            bytes,
        ))
    }?;
    Ok(value)
}

/// Whether the whole range is advised read-mostly.
pub fn range_read_mostly(context: &Context, ptr: DevicePtr, bytes: usize) -> Result<bool> {
    let raw = range_attribute(
        context,
        ptr,
        bytes,
        sys::CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY,
    )?;
    Ok(raw != 0)
}

/// The range's preferred location, if the whole range has the same one.
pub fn range_preferred_location(
    context: &Context,
    ptr: DevicePtr,
    bytes: usize,
) -> Result<Option<MemLocation>> {
    use sys::CUmem_range_attribute as A;
    range_location(
        context,
        ptr,
        bytes,
        A::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION,
    )
}

/// Where the range was last prefetched to, if the whole range went to the same place.
pub fn range_last_prefetch_location(
    context: &Context,
    ptr: DevicePtr,
    bytes: usize,
) -> Result<Option<MemLocation>> {
    use sys::CUmem_range_attribute as A;
    range_location(
        context,
        ptr,
        bytes,
        A::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION,
    )
}

/// A location-valued range attribute, decoded from its legacy device-ordinal form.
fn range_location(
    context: &Context,
    ptr: DevicePtr,
    bytes: usize,
    attribute: sys::CUmem_range_attribute,
) -> Result<Option<MemLocation>> {
    let raw = range_attribute(context, ptr, bytes, attribute)?;
    Ok(MemLocation::from_legacy_device(raw))
}

/// Every location advised as accessing the range.
pub fn range_accessed_by(
    context: &Context,
    ptr: DevicePtr,
    bytes: usize,
) -> Result<Vec<MemLocation>> {
    nonzero(bytes, "range_accessed_by")?;
    context.bind_to_thread()?;
    let api = driver()?;
    // One slot per device plus the host; unused slots come back as CU_DEVICE_INVALID.
    let slots = crate::Device::count()? + 1;
    let mut raw = vec![sys::CU_DEVICE_INVALID; slots];
    // SAFETY: the buffer holds `slots` i32s and we pass its byte size.
    unsafe {
        cu!(api.mem_range_get_attribute(
            raw.as_mut_ptr().cast(),
            slots * size_of::<i32>(),
            sys::CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY,
            ptr,
            bytes,
        ))
    }?;
    Ok(raw
        .into_iter()
        .filter_map(MemLocation::from_legacy_device)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_encode_both_forms() {
        let device = MemLocation::Device(1).to_raw();
        assert_eq!(
            device.type_,
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
        );
        assert_eq!(device.id, 1);
        assert_eq!(
            MemLocation::Host.to_raw().type_,
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
        );
        assert_eq!(MemLocation::Host.to_legacy_device(), sys::CU_DEVICE_CPU);
        assert_eq!(MemLocation::Device(3).to_legacy_device(), 3);
    }

    #[test]
    fn legacy_answers_decode() {
        assert_eq!(MemLocation::from_legacy_device(-1), Some(MemLocation::Host));
        assert_eq!(
            MemLocation::from_legacy_device(0),
            Some(MemLocation::Device(0))
        );
        assert_eq!(
            MemLocation::from_legacy_device(sys::CU_DEVICE_INVALID),
            None
        );
    }
}
