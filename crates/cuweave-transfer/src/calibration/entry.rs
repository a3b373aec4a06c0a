//! One measurement of the table ([`CalibrationEntry`]), and what a transfer is as far as the
//! table is concerned ([`Measure`]).

use serde::{Deserialize, Serialize};

use crate::location::{SizeClass, TransferPath};
use crate::method::TransferMethod;

/// One measurement: `method` moved `path`'s bytes at `gbps` (10^9 bytes per second) for
/// transfers of `bytes` (in `size_class`), between the given devices.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CalibrationEntry {
    /// The path measured.
    pub path: TransferPath,
    /// The size class measured.
    pub size_class: SizeClass,
    /// The method measured.
    pub method: TransferMethod,
    /// Best bandwidth seen, GB/s.
    pub gbps: f64,
    /// The transfer size measured (0 in files written before sizes were recorded: then the
    /// class's [`SizeClass::calibration_bytes`]).
    #[serde(default)]
    pub bytes: usize,
    /// The source's device (`None`: host memory, or a figure for any device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub src_device: Option<usize>,
    /// The destination's device (`None`: host memory, or a figure for any device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst_device: Option<usize>,
}

impl CalibrationEntry {
    /// The size measured (the class's calibration size for old files).
    pub fn measured_bytes(&self) -> usize {
        if self.bytes == 0 {
            self.size_class.calibration_bytes()
        } else {
            self.bytes
        }
    }
}

/// What one transfer is, as far as the calibration is concerned: its path, the devices on
/// each side and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measure {
    /// The path.
    pub path: TransferPath,
    /// The source's device, if it has one.
    pub src_device: Option<usize>,
    /// The destination's device, if it has one.
    pub dst_device: Option<usize>,
    /// Bytes moved.
    pub bytes: usize,
}
