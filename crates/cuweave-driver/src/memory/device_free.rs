//! [`DeviceAllocation::free`]: `cuMemFree` now, with its error returned instead of logged.

use std::sync::Arc;

use super::DeviceAllocation;
use crate::error::Result;

impl DeviceAllocation {
    /// Frees the memory now (`cuMemFree`, which waits for the device), returning the driver's
    /// error where dropping would only log it.
    ///
    /// The memory is given up either way: after an error it is not freed a second time.
    pub fn free(self) -> Result<()> {
        let context = Arc::clone(self.context());
        let (ptr, _) = self.into_raw();
        // SAFETY: `ptr` came from cuMemAlloc in `context` (the allocation owned it, and
        // `into_raw` handed ownership to us), and it is freed exactly once, here.
        unsafe { super::free_device_memory(&context, ptr) }
    }
}
