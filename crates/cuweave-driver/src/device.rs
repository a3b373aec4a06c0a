//! [`Device`]: a CUDA device by ordinal, its properties and capabilities.

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::{OnceLock, RwLock};

use crate::error::{DriverError, Result};
use crate::loader::{cu, driver};
use crate::sys;

/// A CUDA device, identified by its ordinal. Cheap to copy; holds no driver resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device {
    ordinal: usize,
    raw: sys::CUdevice,
}

/// A compute capability, e.g. 9.0 for an H100.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ComputeCapability {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl std::fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The capabilities of a device that cuweave's layers decide on, read once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCapabilities {
    /// Can allocate managed (unified) memory.
    pub managed_memory: bool,
    /// Device and host may access managed memory concurrently (needed for prefetch and advice to
    /// matter, and for host access while the device is busy).
    pub concurrent_managed_access: bool,
    /// The device can access pageable host memory directly (HMM / ATS).
    pub pageable_memory_access: bool,
    /// Stream-ordered allocation (`cuMemAllocAsync`, memory pools) is supported.
    pub memory_pools_supported: bool,
    /// Device and host share one address space.
    pub unified_addressing: bool,
    /// Pinned host memory can be mapped into the device's address space (zero-copy).
    pub can_map_host_memory: bool,
    /// Copy engines that can overlap copies with kernels.
    pub async_engine_count: u32,
    /// Streaming multiprocessors.
    pub multiprocessor_count: u32,
}

/// A device's managed-memory support: what advice, prefetch and managed allocation need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ManagedSupport {
    /// Can allocate managed memory (`CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY`).
    pub managed_memory: bool,
    /// Host and device may access managed memory concurrently
    /// (`CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`); prefetch needs it.
    pub concurrent_managed_access: bool,
}

impl Device {
    /// A device handle for tests that never reach the driver (ordinal and handle equal).
    #[cfg(test)]
    pub(crate) fn for_tests(ordinal: usize) -> Self {
        Self {
            ordinal,
            raw: sys::CUdevice::try_from(ordinal).expect("a small ordinal"),
        }
    }

    /// How many CUDA devices the driver sees.
    pub fn count() -> Result<usize> {
        let api = driver()?;
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer.
        unsafe { cu!(api.device_get_count(&mut count)) }?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    /// The device with this ordinal.
    ///
    /// # Errors
    /// `InvalidArgument` when the ordinal is past [`Device::count`].
    pub fn get(ordinal: usize) -> Result<Self> {
        let count = Self::count()?;
        if ordinal >= count {
            return Err(DriverError::invalid(
                "Device::get",
                format!("device ordinal {ordinal} out of range: {count} device(s) present"),
            ));
        }
        let api = driver()?;
        let mut raw = 0;
        let ordinal_c = i32::try_from(ordinal).expect("ordinal < count, which fits in i32");
        // SAFETY: `raw` is a valid out-pointer and the ordinal is in range.
        unsafe { cu!(api.device_get(&mut raw, ordinal_c)) }?;
        Ok(Self { ordinal, raw })
    }

    /// Every device the driver sees, in ordinal order.
    pub fn all() -> Result<Vec<Self>> {
        (0..Self::count()?).map(Self::get).collect()
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The raw `CUdevice` handle.
    pub fn as_raw(&self) -> sys::CUdevice {
        self.raw
    }

    /// Wraps a raw `CUdevice` handle obtained from another CUDA library.
    ///
    /// The ordinal is taken to equal the handle, which holds for every current driver.
    pub fn from_raw(raw: sys::CUdevice) -> Result<Self> {
        let ordinal = usize::try_from(raw)
            .map_err(|_| DriverError::invalid("Device::from_raw", format!("handle {raw}")))?;
        Self::get(ordinal)
    }

    /// The device's marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> Result<String> {
        let api = driver()?;
        let mut buffer = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer is writable for its full length, which we pass.
        unsafe { cu!(api.device_get_name(buffer.as_mut_ptr(), buffer.len() as i32, self.raw)) }?;
        // SAFETY: the driver NUL-terminates within the length given.
        let name = unsafe { CStr::from_ptr(buffer.as_ptr()) };
        Ok(name.to_string_lossy().into_owned())
    }

    /// The device's PCI bus id, e.g. `0000:1B:00.0`.
    pub fn pci_bus_id(&self) -> Result<String> {
        let api = driver()?;
        let mut buffer = [0 as std::ffi::c_char; 32];
        // SAFETY: the buffer is writable for its full length, which we pass.
        unsafe {
            cu!(api.device_get_pci_bus_id(buffer.as_mut_ptr(), buffer.len() as i32, self.raw))
        }?;
        // SAFETY: the driver NUL-terminates within the length given.
        let id = unsafe { CStr::from_ptr(buffer.as_ptr()) };
        Ok(id.to_string_lossy().into_owned())
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        let api = driver()?;
        let mut bytes = 0;
        // SAFETY: `bytes` is a valid out-pointer.
        unsafe { cu!(api.device_total_mem(&mut bytes, self.raw)) }?;
        Ok(bytes)
    }

    /// One device attribute, as the driver reports it.
    pub fn attribute(&self, attribute: sys::CUdevice_attribute) -> Result<i32> {
        let api = driver()?;
        let mut value = 0;
        // SAFETY: `value` is a valid out-pointer; unknown attributes are reported as errors.
        unsafe { cu!(api.device_get_attribute(&mut value, attribute, self.raw)) }?;
        Ok(value)
    }

    fn flag(&self, attribute: sys::CUdevice_attribute) -> Result<bool> {
        Ok(self.attribute(attribute)? != 0)
    }

    /// The compute capability.
    pub fn compute_capability(&self) -> Result<ComputeCapability> {
        use sys::CUdevice_attribute as A;
        Ok(ComputeCapability {
            major: self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
            minor: self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
        })
    }

    /// Whether the device can allocate managed memory.
    pub fn supports_managed_memory(&self) -> Result<bool> {
        self.flag(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)
    }

    /// Whether host and device can access managed memory concurrently.
    pub fn supports_concurrent_managed_access(&self) -> Result<bool> {
        self.flag(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)
    }

    /// The device's managed-memory support, queried once per device and cached for the process
    /// (the attributes never change), so the checks before every advise and prefetch cost no
    /// driver call after the first.
    pub fn managed_support(&self) -> Result<ManagedSupport> {
        static CACHE: OnceLock<RwLock<HashMap<usize, ManagedSupport>>> = OnceLock::new();
        let cache = CACHE.get_or_init(RwLock::default);
        let known = cache
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&self.ordinal)
            .copied();
        if let Some(known) = known {
            return Ok(known);
        }
        let support = ManagedSupport {
            managed_memory: self.supports_managed_memory()?,
            concurrent_managed_access: self.supports_concurrent_managed_access()?,
        };
        cache
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(self.ordinal, support);
        Ok(support)
    }

    /// Whether the device reads pageable host memory directly.
    pub fn supports_pageable_memory_access(&self) -> Result<bool> {
        self.flag(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS)
    }

    /// Whether stream-ordered allocation and memory pools are supported.
    pub fn supports_memory_pools(&self) -> Result<bool> {
        self.flag(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
    }

    /// Whether the device shares a unified address space with the host.
    pub fn supports_unified_addressing(&self) -> Result<bool> {
        self.flag(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)
    }

    /// Whether pinned host memory can be mapped into the device's address space.
    pub fn can_map_host_memory(&self) -> Result<bool> {
        self.flag(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)
    }

    /// How many copy engines can run alongside kernels.
    pub fn async_engine_count(&self) -> Result<u32> {
        Ok(self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)? as u32)
    }

    /// Every capability in [`DeviceCapabilities`], read in one go.
    pub fn capabilities(&self) -> Result<DeviceCapabilities> {
        Ok(DeviceCapabilities {
            managed_memory: self.supports_managed_memory()?,
            concurrent_managed_access: self.supports_concurrent_managed_access()?,
            pageable_memory_access: self.supports_pageable_memory_access()?,
            memory_pools_supported: self.supports_memory_pools()?,
            unified_addressing: self.supports_unified_addressing()?,
            can_map_host_memory: self.can_map_host_memory()?,
            async_engine_count: self.async_engine_count()?,
            multiprocessor_count: self
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
                as u32,
        })
    }

    /// Whether this device's primary context is active: retained by someone in this process
    /// (`cuDevicePrimaryCtxGetState`). Asking makes no context.
    pub fn primary_context_active(&self) -> Result<bool> {
        let api = driver()?;
        let (mut flags, mut active) = (0u32, 0i32);
        // SAFETY: both are valid out-pointers; the handle came from cuDeviceGet.
        unsafe { cu!(api.device_primary_ctx_get_state(self.raw, &mut flags, &mut active)) }?;
        Ok(active != 0)
    }

    /// Whether this device can access `peer`'s memory directly once peer access is enabled
    /// (see [`crate::Context::enable_peer_access`]). A device is never its own peer.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if peer == self {
            return Ok(false);
        }
        let api = driver()?;
        let mut can = 0;
        // SAFETY: `can` is a valid out-pointer; both handles came from cuDeviceGet.
        unsafe { cu!(api.device_can_access_peer(&mut can, self.raw, peer.raw)) }?;
        Ok(can != 0)
    }

    /// A peer-to-peer attribute of the link from this device to `peer` (`cuDeviceGetP2PAttribute`).
    ///
    /// # Errors
    /// `InvalidArgument` when `peer` is this device (the driver rejects that pair).
    pub fn p2p_attribute(
        &self,
        peer: &Device,
        attribute: sys::CUdevice_P2PAttribute,
    ) -> Result<i32> {
        if peer == self {
            return Err(DriverError::invalid(
                "Device::p2p_attribute",
                format!("device {} is not its own peer", self.ordinal()),
            ));
        }
        let api = driver()?;
        let mut value = 0;
        // SAFETY: `value` is a valid out-pointer; both handles came from cuDeviceGet.
        unsafe { cu!(api.device_get_p2p_attribute(&mut value, attribute, self.raw, peer.raw)) }?;
        Ok(value)
    }

    /// The driver's relative performance rank of the link to `peer` (lower is faster), or `None`
    /// when this device cannot access `peer` directly.
    pub fn peer_link(&self, peer: &Device) -> Result<Option<PeerLink>> {
        use sys::CUdevice_P2PAttribute as A;
        if peer == self
            || self.p2p_attribute(peer, A::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)? == 0
        {
            return Ok(None);
        }
        Ok(Some(PeerLink {
            performance_rank: self
                .p2p_attribute(peer, A::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?,
            native_atomics: self
                .p2p_attribute(peer, A::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)?
                != 0,
        }))
    }
}

/// What the driver says of a direct link between two devices ([`Device::peer_link`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerLink {
    /// Relative performance of the link among this system's links (0 is the fastest).
    pub performance_rank: i32,
    /// Whether atomics over the link are native.
    pub native_atomics: bool,
}
