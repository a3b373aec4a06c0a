//! Which allocation an address lies in (`cuMemGetAddressRange`).

use super::DevicePtr;
use crate::context::Context;
use crate::error::Result;
use crate::loader::{cu, driver};

/// The base address and size of the allocation that contains `ptr`.
///
/// Works for device and managed allocations (and mapped pinned memory under unified
/// addressing); an address the driver did not allocate is its `CUDA_ERROR_NOT_FOUND` or
/// `CUDA_ERROR_INVALID_VALUE`.
pub fn address_range(context: &Context, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
    context.bind_to_thread()?;
    let api = driver()?;
    let (mut base, mut size) = (0, 0);
    // SAFETY: both are valid out-pointers; the driver only reads its own allocation table.
    unsafe { cu!(api.mem_get_address_range(&mut base, &mut size, ptr)) }?;
    Ok((base, size))
}
