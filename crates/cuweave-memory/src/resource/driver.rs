//! [`DriverResource`]: device memory straight from `cuMemAlloc` / `cuMemFree`.

use std::sync::Arc;

use cuweave_driver::memory::{DeviceAllocation, DevicePtr};
use cuweave_driver::{Context, Stream};
use dashmap::DashMap;

use super::{MemoryResource, check_request, check_stream, unknown_or_mismatch};
use crate::error::Result;

/// Device memory from `cuMemAlloc`, freed with `cuMemFree`: the base resource, and the slowest
/// (each call is a driver round trip, and `cuMemFree` waits for the device).
///
/// The stream arguments are checked for the device but otherwise unused: `cuMemAlloc` memory is
/// usable at once by every stream, and `cuMemFree` waits for all queued work first. Outstanding
/// allocations are kept by address, so a wrong or repeated free is an error, not a double free;
/// whatever is still allocated when the resource drops is freed then.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::resource::{DriverResource, MemoryResource};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let resource = DriverResource::new(&context);
/// let ptr = resource.allocate(4096, &stream)?;
/// resource.deallocate(ptr, 4096, &stream)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct DriverResource {
    context: Arc<Context>,
    live: DashMap<DevicePtr, DeviceAllocation>,
}

impl DriverResource {
    /// A resource allocating in `context`. Makes no driver call.
    pub fn new(context: &Arc<Context>) -> Self {
        Self {
            context: Arc::clone(context),
            live: DashMap::new(),
        }
    }

    /// How many allocations are outstanding.
    pub fn outstanding(&self) -> usize {
        self.live.len()
    }
}

impl MemoryResource for DriverResource {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_request(self.device(), bytes, stream, "DriverResource::allocate")?;
        let allocation = DeviceAllocation::new(&self.context, bytes)?;
        let ptr = allocation.ptr();
        self.live.insert(ptr, allocation);
        Ok(ptr)
    }

    fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        const OPERATION: &str = "DriverResource::deallocate";
        check_stream(self.device(), stream, OPERATION)?;
        // The map's shard lock is released before the (blocking) cuMemFree.
        let Some((_, allocation)) = self.live.remove_if(&ptr, |_, a| a.len() == bytes) else {
            let recorded = self.live.get(&ptr).map(|a| a.len());
            return Err(unknown_or_mismatch(ptr, bytes, recorded, OPERATION));
        };
        Ok(allocation.free()?)
    }

    fn context(&self) -> &Arc<Context> {
        &self.context
    }

    fn name(&self) -> &str {
        "driver"
    }
}
