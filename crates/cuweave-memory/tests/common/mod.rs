//! Helpers shared by the caching allocator's GPU tests: a device counter for watch kernels.

use std::sync::Arc;

use cuweave_driver::Context;
use cuweave_driver::memory::{self, DeviceAllocation};

/// One zeroed `u32` on the device, for a watch kernel's mismatch count.
pub fn counter(context: &Arc<Context>) -> DeviceAllocation {
    let counter = DeviceAllocation::new(context, 4).expect("allocate counter");
    // SAFETY: the allocation is 4 bytes and nothing else uses it yet.
    unsafe { memory::memset_d32(context, counter.ptr(), 0, 1) }.expect("zero counter");
    counter
}

/// Reads one `u32` (the caller has synchronised whatever wrote it).
pub fn read_u32(context: &Context, ptr: u64) -> u32 {
    let mut value = 0u32;
    // SAFETY: `value` is writable for 4 bytes and `ptr` is live device memory of at least 4.
    unsafe { memory::copy_dtoh(context, (&raw mut value).cast(), ptr, 4) }.expect("read u32");
    value
}
