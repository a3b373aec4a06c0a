//! Gathering what `cuweave info` shows: the driver version and every device's properties,
//! capabilities, stream priorities and peer access, as plain data ([`Report`]).
//!
//! Rendering lives in [`crate::render`], so the report's shape is tested on hand-built values on
//! machines without a GPU.

use cuweave::driver::{self, Context, Device, DeviceCapabilities, DriverError};
use serde::Serialize;

/// Everything `cuweave info` reports, in the order it is shown.
///
/// Serialised as the `--json` output: `driver` is `null` and `devices` empty when no usable
/// driver is present, and `error` says why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The driver's CUDA version, when the driver loaded and initialised.
    pub driver: Option<DriverVersion>,
    /// Why the report is incomplete or empty (no driver, a failed query), if it is.
    pub error: Option<String>,
    /// Every device that was read successfully, in ordinal order.
    pub devices: Vec<DeviceReport>,
    /// NCCL's version and where it loaded from, or why none was found (gathered whether or not
    /// a GPU is present: the library loads without one).
    pub nccl: NcclReport,
    /// How the gathering went; decides the exit status, not part of the JSON.
    #[serde(skip)]
    pub status: Status,
}

/// How gathering a [`Report`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Status {
    /// Every query succeeded (there may still be zero devices).
    #[default]
    Complete,
    /// No usable driver: none installed, or `cuInit` failed (e.g. `CUDA_ERROR_NO_DEVICE`).
    /// Not a failure of the command: the machine has no GPU to report.
    NoGpu,
    /// The driver initialised but a query failed; the report holds what could be read.
    Failed,
}

impl Status {
    /// The process exit status for this outcome: 0 unless a query failed.
    pub fn exit_code(self) -> u8 {
        match self {
            Self::Complete | Self::NoGpu => 0,
            Self::Failed => 1,
        }
    }
}

/// What `cuweave info` says about NCCL (`cuweave-collective`'s loader).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NcclReport {
    /// `ncclGetVersion`'s answer, e.g. `2.28.9`, when a library loaded.
    pub version: Option<String>,
    /// The candidate that loaded: a path, or a name the dynamic loader resolved.
    pub library: Option<String>,
    /// Why no NCCL loaded, when none did.
    pub error: Option<String>,
}

impl NcclReport {
    /// Loads NCCL (once per process) and reports it.
    pub fn gather() -> Self {
        match cuweave::collective::nccl() {
            Ok(nccl) => Self::found(&nccl.version().to_string(), nccl.path()),
            Err(error) => Self::missing(&error.to_string()),
        }
    }

    /// The report for a library that loaded.
    pub fn found(version: &str, library: &str) -> Self {
        Self {
            version: Some(version.to_owned()),
            library: Some(library.to_owned()),
            error: None,
        }
    }

    /// The report for no library, with the reason.
    pub fn missing(reason: &str) -> Self {
        Self {
            version: None,
            library: None,
            error: Some(reason.to_owned()),
        }
    }

    /// The one line `cuweave info` prints, e.g. `NCCL 2.28.9 (libnccl.so.2)`.
    pub fn line(&self) -> String {
        match (&self.version, &self.library, &self.error) {
            (Some(version), Some(library), _) => format!("NCCL {version} ({library})"),
            (_, _, Some(error)) => format!("NCCL: {error}"),
            _ => "NCCL: unknown".to_owned(),
        }
    }
}

/// The driver's CUDA version, as `cuDriverGetVersion` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DriverVersion {
    /// The raw value, `1000 * major + 10 * minor` (13000 for CUDA 13.0).
    pub version: i32,
    /// The major version, e.g. 13.
    pub major: i32,
    /// The minor version, e.g. 0.
    pub minor: i32,
}

impl DriverVersion {
    /// Splits the raw `cuDriverGetVersion` value into major and minor.
    pub fn from_raw(version: i32) -> Self {
        Self {
            version,
            major: version / 1000,
            minor: (version % 1000) / 10,
        }
    }
}

impl std::fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{} ({})", self.major, self.minor, self.version)
    }
}

/// One device's properties, as `cuweave info` shows them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceReport {
    /// The device ordinal.
    pub ordinal: usize,
    /// The marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// The PCI bus id, e.g. `0000:1B:00.0`.
    pub pci_bus_id: String,
    /// The compute capability, e.g. 9.0.
    pub compute_capability: ComputeCapability,
    /// Total device memory in bytes.
    pub total_memory_bytes: u64,
    /// Free device memory in bytes, read through the device's primary context (which this
    /// command retains to ask, so the context's own footprint is already subtracted).
    pub free_memory_bytes: u64,
    /// Every capability of the driver's [`DeviceCapabilities`].
    pub capabilities: Capabilities,
    /// The stream priorities the device offers (lower numbers are higher priority).
    pub stream_priority_range: StreamPriorityRange,
    /// Whether this device can access each other device's memory directly, in ordinal order.
    pub peer_access: Vec<PeerAccess>,
}

/// A compute capability, as in the driver's `ComputeCapability`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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

/// The device capabilities cuweave's layers decide on; mirrors [`DeviceCapabilities`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// Can allocate managed (unified) memory.
    pub managed_memory: bool,
    /// Host and device may access managed memory concurrently.
    pub concurrent_managed_access: bool,
    /// The device reads pageable host memory directly (HMM / ATS).
    pub pageable_memory_access: bool,
    /// Stream-ordered allocation and memory pools are supported.
    pub memory_pools: bool,
    /// Device and host share one address space.
    pub unified_addressing: bool,
    /// Pinned host memory can be mapped into the device's address space.
    pub can_map_host_memory: bool,
    /// Copy engines that can overlap copies with kernels.
    pub async_engines: u32,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
}

impl From<DeviceCapabilities> for Capabilities {
    fn from(caps: DeviceCapabilities) -> Self {
        Self {
            managed_memory: caps.managed_memory,
            concurrent_managed_access: caps.concurrent_managed_access,
            pageable_memory_access: caps.pageable_memory_access,
            memory_pools: caps.memory_pools_supported,
            unified_addressing: caps.unified_addressing,
            can_map_host_memory: caps.can_map_host_memory,
            async_engines: caps.async_engine_count,
            multiprocessors: caps.multiprocessor_count,
        }
    }
}

/// The range of stream priorities a device's context offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StreamPriorityRange {
    /// The lowest priority (numerically greatest, usually 0).
    pub least: i32,
    /// The highest priority (numerically least, e.g. -5).
    pub greatest: i32,
}

/// Whether a device can access one peer's memory directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PeerAccess {
    /// The peer's ordinal.
    pub peer: usize,
    /// `cuDeviceCanAccessPeer` for the pair.
    pub can_access: bool,
}

impl Report {
    /// The report for a machine where the driver is missing or failed to initialise.
    pub fn unavailable(error: &DriverError) -> Self {
        let message = if error.is_not_found() {
            // Already reads "no CUDA driver found: looked for … (…)".
            error.to_string()
        } else {
            format!("CUDA driver found but not usable: {error}")
        };
        Self {
            driver: None,
            error: Some(message),
            devices: Vec::new(),
            nccl: NcclReport::gather(),
            status: Status::NoGpu,
        }
    }
}

/// Loads the driver and reads everything [`Report`] holds.
///
/// Never fails as a whole: a missing driver gives [`Status::NoGpu`], a failed query is recorded
/// in `error` (with [`Status::Failed`]) and the devices that could be read are still reported.
pub fn gather() -> Report {
    if let Err(error) = driver::driver() {
        return Report::unavailable(&error);
    }
    let mut errors = Vec::new();
    let driver = match driver::driver_version() {
        Ok(raw) => Some(DriverVersion::from_raw(raw)),
        Err(error) => {
            errors.push(format!("reading the driver version: {error}"));
            None
        }
    };
    let all = match Device::all() {
        Ok(all) => all,
        Err(error) => {
            errors.push(format!("listing devices: {error}"));
            Vec::new()
        }
    };
    let mut devices = Vec::with_capacity(all.len());
    for device in &all {
        match gather_device(device, &all) {
            Ok(report) => devices.push(report),
            Err(error) => errors.push(format!("device {}: {error}", device.ordinal())),
        }
    }
    let (error, status) = if errors.is_empty() {
        (None, Status::Complete)
    } else {
        (Some(errors.join("; ")), Status::Failed)
    };
    Report {
        driver,
        error,
        devices,
        nccl: NcclReport::gather(),
        status,
    }
}

fn gather_device(device: &Device, all: &[Device]) -> Result<DeviceReport, DriverError> {
    let capability = device.compute_capability()?;
    let context = Context::primary(*device)?;
    let memory = context.memory_info()?;
    let priorities = context.stream_priority_range()?;
    let peer_access = all
        .iter()
        .filter(|peer| *peer != device)
        .map(|peer| {
            Ok(PeerAccess {
                peer: peer.ordinal(),
                can_access: device.can_access_peer(peer)?,
            })
        })
        .collect::<Result<Vec<_>, DriverError>>()?;
    Ok(DeviceReport {
        ordinal: device.ordinal(),
        name: device.name()?,
        pci_bus_id: device.pci_bus_id()?,
        compute_capability: ComputeCapability {
            major: capability.major,
            minor: capability.minor,
        },
        total_memory_bytes: device.total_memory()? as u64,
        free_memory_bytes: memory.free as u64,
        capabilities: device.capabilities()?.into(),
        stream_priority_range: StreamPriorityRange {
            least: priorities.least,
            greatest: priorities.greatest,
        },
        peer_access,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_versions_split_into_major_and_minor() {
        let v = DriverVersion::from_raw(13000);
        assert_eq!((v.major, v.minor), (13, 0));
        assert_eq!(v.to_string(), "13.0 (13000)");
        let v = DriverVersion::from_raw(12080);
        assert_eq!((v.major, v.minor), (12, 8));
        assert_eq!(v.to_string(), "12.8 (12080)");
    }

    #[test]
    fn a_missing_driver_is_reported_in_its_own_words_and_exits_zero() {
        let report = Report::unavailable(&DriverError::NotFound {
            searched: "libcuda.so.1, libcuda.so".to_owned(),
            reason: "libcuda.so: cannot open shared object file".to_owned(),
        });
        assert_eq!(
            report.error.as_deref(),
            Some(
                "no CUDA driver found: looked for libcuda.so.1, libcuda.so \
                 (libcuda.so: cannot open shared object file)"
            )
        );
        assert_eq!(report.status, Status::NoGpu);
        assert_eq!(report.status.exit_code(), 0);
        assert!(report.driver.is_none() && report.devices.is_empty());
    }

    #[test]
    fn a_driver_that_fails_to_initialise_is_no_gpu_too() {
        let report = Report::unavailable(&DriverError::Cuda {
            code: 100,
            operation: "cuInit",
        });
        // The code's name and text come from the driver when one is loaded.
        let error = report.error.as_deref().unwrap();
        assert!(
            error.starts_with("CUDA driver found but not usable: cuInit failed: ")
                && error.contains("(100)"),
            "{error}"
        );
        assert_eq!(report.status.exit_code(), 0);
    }

    #[test]
    fn nccl_lines_say_the_version_or_why_none_was_found() {
        assert_eq!(
            NcclReport::found("2.28.9", "libnccl.so.2").line(),
            "NCCL 2.28.9 (libnccl.so.2)"
        );
        assert_eq!(
            NcclReport::missing("no NCCL library found: tried libnccl.so.2 (gone)").line(),
            "NCCL: no NCCL library found: tried libnccl.so.2 (gone)"
        );
    }

    #[test]
    fn only_failed_queries_exit_non_zero() {
        assert_eq!(Status::Complete.exit_code(), 0);
        assert_eq!(Status::NoGpu.exit_code(), 0);
        assert_eq!(Status::Failed.exit_code(), 1);
    }

    #[test]
    fn capabilities_mirror_the_driver_struct() {
        let caps = Capabilities::from(DeviceCapabilities {
            managed_memory: true,
            concurrent_managed_access: false,
            pageable_memory_access: true,
            memory_pools_supported: true,
            unified_addressing: false,
            can_map_host_memory: true,
            async_engine_count: 3,
            multiprocessor_count: 132,
        });
        assert!(caps.managed_memory && !caps.concurrent_managed_access);
        assert!(caps.pageable_memory_access && caps.memory_pools);
        assert!(!caps.unified_addressing && caps.can_map_host_memory);
        assert_eq!((caps.async_engines, caps.multiprocessors), (3, 132));
    }
}
