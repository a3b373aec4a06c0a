//! What the driver knows about an address (`cuPointerGetAttribute`).

use super::DevicePtr;
use crate::error::Result;
use crate::loader::{cu, driver};
use crate::sys;

/// Where memory physically lives, as the driver classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryType {
    /// Host memory (pinned or registered).
    Host,
    /// Device memory (including managed memory).
    Device,
    /// An array (texture memory).
    Array,
    /// Unified memory.
    Unified,
    /// A value this crate does not know.
    Other(u32),
}

/// Attributes of an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerAttributes {
    /// The memory's type.
    pub memory_type: MemoryType,
    /// The ordinal of the device the memory belongs to.
    pub device_ordinal: i32,
    /// Whether it is managed memory.
    pub is_managed: bool,
}

fn attribute<T: Default>(ptr: DevicePtr, attribute: sys::CUpointer_attribute) -> Result<T> {
    let api = driver()?;
    let mut value = T::default();
    // SAFETY: callers pick `T` to match the attribute's documented type; the out-pointer is valid.
    unsafe { cu!(api.pointer_get_attribute((&mut value as *mut T).cast(), attribute, ptr)) }?;
    Ok(value)
}

/// Asks the driver about `ptr`; unknown addresses are the driver's `CUDA_ERROR_INVALID_VALUE`.
pub fn pointer_attributes(ptr: DevicePtr) -> Result<PointerAttributes> {
    use sys::CUpointer_attribute as A;
    let raw_type: u32 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)?;
    let memory_type = match sys::CUmemorytype(raw_type) {
        sys::CUmemorytype::CU_MEMORYTYPE_HOST => MemoryType::Host,
        sys::CUmemorytype::CU_MEMORYTYPE_DEVICE => MemoryType::Device,
        sys::CUmemorytype::CU_MEMORYTYPE_ARRAY => MemoryType::Array,
        sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED => MemoryType::Unified,
        other => MemoryType::Other(other.0),
    };
    let device_ordinal: i32 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)?;
    let is_managed: u32 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_IS_MANAGED)?;
    Ok(PointerAttributes {
        memory_type,
        device_ordinal,
        is_managed: is_managed != 0,
    })
}
