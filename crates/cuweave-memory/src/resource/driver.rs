//! [`DriverResource`]: device memory straight from `cuMemAlloc` / `cuMemFree`.

use std::sync::Arc;

use super::{LiveAllocations, MemoryResource, check_request, check_stream};
use crate::error::Result;
use cuweave_driver::memory::{DeviceAllocation, DevicePtr};
use cuweave_driver::{Context, Stream};

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
    /// The live allocations, by address.
    live: LiveAllocations<DeviceAllocation>,
}

impl DriverResource {
    /// A resource allocating in `context`. Makes no driver call.
    pub fn new(context: &Arc<Context>) -> Self {
        Self {
            context: Arc::clone(context),
            live: LiveAllocations::new(),
        }
    }

    /// How many allocations are outstanding.
    pub fn outstanding(&self) -> usize {
        self.live.len()
    }

    fn allocate_marked(&self, bytes: usize, stream: &Stream, owned: bool) -> Result<DevicePtr> {
        // Frees a capture deferred (this resource's among them) come back first, so a program
        // allocating straight from the resource after a capture sees its memory again.
        crate::caching::return_frees_deferred_by_captures();
        check_request(self.device(), bytes, stream, "DriverResource::allocate")?;
        // cuMemAlloc breaks a capture that forbids it (thread-local or global mode).
        cuweave_driver::graph::refuse_while_capturing(None, "DriverResource::allocate")?;
        let allocation = DeviceAllocation::new(&self.context, bytes)?;
        let ptr = allocation.ptr();
        self.live.insert(ptr, bytes, owned, allocation);
        Ok(ptr)
    }

    fn deallocate_marked(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
        owned: bool,
    ) -> Result<()> {
        const OPERATION: &str = "DriverResource::deallocate";
        check_stream(self.device(), stream, OPERATION)?;
        // cuMemFree waits for the device: it breaks a capture that forbids that.
        cuweave_driver::graph::refuse_while_capturing(None, OPERATION)?;
        // Off the books (the map's lock released) before the blocking cuMemFree.
        let allocation = self.live.take(ptr, bytes, owned, OPERATION)?;
        Ok(allocation.free()?)
    }
}

// SAFETY: memory comes from `cuMemAlloc`, one allocation per address while live; `live` takes
// each address off its books once, at its free, and `cuMemFree` waits for the device first; any
// other free is refused.
#[allow(unsafe_code)]
unsafe impl MemoryResource for DriverResource {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.allocate_marked(bytes, stream, false)
    }

    fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.deallocate_marked(ptr, bytes, stream, false)
    }

    fn allocate_owned(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.allocate_marked(bytes, stream, true)
    }

    fn deallocate_owned(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.deallocate_marked(ptr, bytes, stream, true)
    }

    fn context(&self) -> &Arc<Context> {
        &self.context
    }

    fn name(&self) -> &str {
        "driver"
    }
}
