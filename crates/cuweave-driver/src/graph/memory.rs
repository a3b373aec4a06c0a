//! The driver's graph memory pool of a device: what graphs that allocate (`MemAlloc` nodes)
//! hold, and giving it back.

use crate::device::Device;
use crate::error::Result;
use crate::loader::{cu, driver};
use crate::sys;

/// Graph memory of one device (`cuDeviceGetGraphMemAttribute`), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct GraphMemoryUsage {
    /// Held by graph allocations now.
    pub used: u64,
    /// The most ever held by graph allocations (since the last reset).
    pub used_high: u64,
    /// Reserved from the driver for graph allocations now.
    pub reserved: u64,
    /// The most ever reserved.
    pub reserved_high: u64,
}

fn attribute(device: Device, attribute: sys::CUgraphMem_attribute) -> Result<u64> {
    let api = driver()?;
    let mut value = 0u64;
    // SAFETY: the attribute is a cuuint64_t; valid out-pointer.
    unsafe {
        cu!(api.device_get_graph_mem_attribute(
            device.as_raw(),
            attribute,
            (&mut value as *mut u64).cast(),
        ))
    }?;
    Ok(value)
}

/// The graph memory `device` holds and reserves.
pub fn graph_memory_usage(device: Device) -> Result<GraphMemoryUsage> {
    use sys::CUgraphMem_attribute as A;
    Ok(GraphMemoryUsage {
        used: attribute(device, A::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)?,
        used_high: attribute(device, A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)?,
        reserved: attribute(device, A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?,
        reserved_high: attribute(device, A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?,
    })
}

/// Returns to the driver the graph memory `device` reserved and no graph uses
/// (`cuDeviceGraphMemTrim`).
pub fn trim_graph_memory(device: Device) -> Result<()> {
    let api = driver()?;
    // SAFETY: a valid device handle.
    unsafe { cu!(api.device_graph_mem_trim(device.as_raw())) }
}
