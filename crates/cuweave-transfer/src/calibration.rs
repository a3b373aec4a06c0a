//! [`CalibrationTable`]: measured bandwidth per (path, size class, method), the input of the
//! method choice, and what registering host memory costs ([`RegistrationCost`]); saved and
//! loaded as JSON; [`CalibrationTable::h100_defaults`] when nothing was measured.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TransferError};
use crate::location::{SizeClass, TransferPath};
use crate::method::TransferMethod;

/// One measurement: `method` moved `path`'s bytes at `gbps` (10^9 bytes per second) for
/// transfers of `size_class`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CalibrationEntry {
    /// The path measured.
    pub path: TransferPath,
    /// The size class measured (at [`SizeClass::calibration_bytes`]).
    pub size_class: SizeClass,
    /// The method measured.
    pub method: TransferMethod,
    /// Best bandwidth seen, GB/s.
    pub gbps: f64,
}

/// Bandwidth figures the method choice reads: from [`calibrate`](crate::TransferManager::calibrate)
/// on this machine, from a JSON file, or [`h100_defaults`](Self::h100_defaults).
///
/// ```
/// use cuweave_transfer::{CalibrationTable, SizeClass, TransferMethod, TransferPath};
///
/// let mut table = CalibrationTable::default();
/// table.record(TransferPath::PAGEABLE_TO_DEVICE, SizeClass::Large, TransferMethod::DirectCopy, 10.0);
/// table.record(TransferPath::PAGEABLE_TO_DEVICE, SizeClass::Large, TransferMethod::HostStaged, 30.0);
/// let json = table.to_json();
/// let back = CalibrationTable::from_json(&json).unwrap();
/// assert_eq!(
///     back.best(TransferPath::PAGEABLE_TO_DEVICE, SizeClass::Large, &[TransferMethod::DirectCopy, TransferMethod::HostStaged]),
///     Some((TransferMethod::HostStaged, 30.0))
/// );
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CalibrationTable {
    /// What the figures were measured on (device name), if known.
    pub device: Option<String>,
    /// The measurements.
    pub entries: Vec<CalibrationEntry>,
    /// What registering and unregistering host memory costs here, if measured (files written
    /// before it was measured have none, and load as `None`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registration: Option<RegistrationCost>,
}

/// What page-locking a host buffer in place costs: `cuMemHostRegister` plus the matching
/// `cuMemHostUnregister`, as a fixed part and a part per MiB, fitted by
/// [`calibrate`](crate::TransferManager::calibrate) through two measured sizes.
///
/// ```
/// use std::time::Duration;
/// use cuweave_transfer::RegistrationCost;
///
/// let cost = RegistrationCost::fit(
///     (4 << 20, Duration::from_millis(11)),
///     (64 << 20, Duration::from_millis(20)),
/// );
/// assert_eq!((cost.fixed_ms, cost.ms_per_mib), (10.4, 0.15));
/// assert!((cost.millis(128 << 20) - 29.6).abs() < 1e-9); // 10.4 + 128 * 0.15
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RegistrationCost {
    /// Milliseconds paid whatever the size.
    pub fixed_ms: f64,
    /// Milliseconds per MiB (2^20 bytes) registered.
    pub ms_per_mib: f64,
}

impl RegistrationCost {
    /// The cost assumed until [`calibrate`](crate::TransferManager::calibrate) measures it on
    /// this machine: the H100 host's, as its calibration measured it (0.247 ms + 0.0720 ms per
    /// MiB; registering and unregistering 64 MiB took 4.57 ms raw and 4.65 ms through
    /// [`register_host`](crate::TransferManager::register_host) in the same run; see
    /// `docs/transfer.md`).
    pub const H100_DEFAULT: Self = Self {
        fixed_ms: 0.25,
        ms_per_mib: 0.072,
    };

    /// The line through two measurements `(bytes, time)` (in any order), with neither part
    /// negative (measurement noise can tilt the line), rounded to 0.001 ms.
    pub fn fit(a: (usize, Duration), b: (usize, Duration)) -> Self {
        let (small, large) = if a.0 <= b.0 { (a, b) } else { (b, a) };
        let mib = |bytes: usize| bytes as f64 / (1u64 << 20) as f64;
        let ms = |time: Duration| time.as_secs_f64() * 1e3;
        let span = mib(large.0) - mib(small.0);
        let ms_per_mib = if span > 0.0 {
            ((ms(large.1) - ms(small.1)) / span).max(0.0)
        } else {
            0.0
        };
        let fixed_ms = (ms(small.1) - ms_per_mib * mib(small.0)).max(0.0);
        let round = |x: f64| (x * 1e3).round() / 1e3;
        Self {
            fixed_ms: round(fixed_ms),
            ms_per_mib: round(ms_per_mib),
        }
    }

    /// Milliseconds to register and unregister `bytes`.
    pub fn millis(&self, bytes: usize) -> f64 {
        self.fixed_ms + self.ms_per_mib * bytes as f64 / (1u64 << 20) as f64
    }

    /// The time to register and unregister `bytes`.
    pub fn duration(&self, bytes: usize) -> Duration {
        // `max` also turns a NaN (from a hand-edited file) into zero; no panic either way.
        Duration::try_from_secs_f64((self.millis(bytes) / 1e3).max(0.0)).unwrap_or(Duration::MAX)
    }
}

impl CalibrationTable {
    /// Records (or replaces) the figure for `(path, size_class, method)`, rounded to 0.01 GB/s.
    pub fn record(
        &mut self,
        path: TransferPath,
        size_class: SizeClass,
        method: TransferMethod,
        gbps: f64,
    ) {
        // Two decimals are all a measurement carries, and they survive JSON exactly.
        let gbps = (gbps * 100.0).round() / 100.0;
        let entry = CalibrationEntry {
            path,
            size_class,
            method,
            gbps,
        };
        match self
            .entries
            .iter_mut()
            .find(|e| e.path == path && e.size_class == size_class && e.method == method)
        {
            Some(existing) => *existing = entry,
            None => self.entries.push(entry),
        }
    }

    /// The figure for one method, if measured.
    pub fn gbps(
        &self,
        path: TransferPath,
        size_class: SizeClass,
        method: TransferMethod,
    ) -> Option<f64> {
        self.entries
            .iter()
            .find(|e| e.path == path && e.size_class == size_class && e.method == method)
            .map(|e| e.gbps)
    }

    /// The fastest of `allowed` for `(path, size_class)` with its figure, among those measured.
    /// Ties go to the method listed first in `allowed`.
    pub fn best(
        &self,
        path: TransferPath,
        size_class: SizeClass,
        allowed: &[TransferMethod],
    ) -> Option<(TransferMethod, f64)> {
        let mut best: Option<(TransferMethod, f64)> = None;
        for &method in allowed {
            if let Some(gbps) = self.gbps(path, size_class, method)
                && best.is_none_or(|(_, b)| gbps > b)
            {
                best = Some((method, gbps));
            }
        }
        best
    }

    /// Whether nothing was measured (no bandwidth and no registration cost).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.registration.is_none()
    }

    /// The table as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a calibration table always serialises")
    }

    /// A table from JSON (as [`to_json`](Self::to_json) writes it).
    ///
    /// # Errors
    /// [`TransferError::CalibrationFile`] (path `<json>`) when the text is not a table.
    pub fn from_json(json: &str) -> Result<Self> {
        serde_json::from_str(json).map_err(|error| TransferError::CalibrationFile {
            path: "<json>".to_owned(),
            message: error.to_string(),
        })
    }

    /// Writes the table to `path` as JSON.
    ///
    /// # Errors
    /// [`TransferError::CalibrationFile`] when the file cannot be written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_json()).map_err(|error| TransferError::CalibrationFile {
            path: path.display().to_string(),
            message: error.to_string(),
        })
    }

    /// Reads a table written by [`save`](Self::save).
    ///
    /// # Errors
    /// [`TransferError::CalibrationFile`] when the file cannot be read or is not a table.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|error| TransferError::CalibrationFile {
                path: path.display().to_string(),
                message: error.to_string(),
            })?;
        serde_json::from_str(&text).map_err(|error| TransferError::CalibrationFile {
            path: path.display().to_string(),
            message: error.to_string(),
        })
    }

    /// The figures used when nothing was measured: `TransferManager::calibrate` on an NVIDIA
    /// H100 80GB HBM3 (PCIe Gen5 host link, driver 580) with the default staging configuration,
    /// as listed in `docs/transfer.md`.
    ///
    /// Only paths with a real choice are listed; the others have one candidate (registered
    /// host memory moves at the pinned figures). The registration cost is
    /// [`RegistrationCost::H100_DEFAULT`], measured on the H100 host.
    pub fn h100_defaults() -> Self {
        use TransferMethod::{DirectCopy, HostStaged, PeerToPeer, ZeroCopy};
        let mut table = Self {
            device: Some("NVIDIA H100 80GB HBM3 (defaults)".to_owned()),
            entries: Vec::new(),
            registration: Some(RegistrationCost::H100_DEFAULT),
        };
        let rows: &[DefaultRow] = &[
            (
                TransferPath::PAGEABLE_TO_DEVICE,
                DEFAULT_PAGEABLE_H2D,
                DirectCopy,
                HostStaged,
            ),
            (
                TransferPath::DEVICE_TO_PAGEABLE,
                DEFAULT_PAGEABLE_D2H,
                DirectCopy,
                HostStaged,
            ),
            (
                TransferPath::PINNED_TO_DEVICE,
                DEFAULT_PINNED_H2D,
                DirectCopy,
                ZeroCopy,
            ),
            (
                TransferPath::DEVICE_TO_PINNED,
                DEFAULT_PINNED_D2H,
                DirectCopy,
                ZeroCopy,
            ),
            (TransferPath::PEER, DEFAULT_PEER, HostStaged, PeerToPeer),
        ];
        for &(path, figures, first, second) in rows {
            for (class, a, b) in figures {
                table.record(path, class, first, a);
                table.record(path, class, second, b);
            }
        }
        table
    }
}

/// A path's default figures and the two methods they are for.
type DefaultRow = (
    TransferPath,
    [(SizeClass, f64, f64); 5],
    TransferMethod,
    TransferMethod,
);

// Measured figures (GB/s) per size class: (class, first method, second method) in the order of
// the rows in `h100_defaults`. From `TransferManager::calibrate` on the H100 (run 1 of issue 8,
// staging 4 MiB x 2 x 6 threads; Large and Huge are both measured at 64 MiB), rounded; the peer
// row is the H200 pair's expected NVLink figure until measured. See docs/transfer.md.
const DEFAULT_PAGEABLE_H2D: [(SizeClass, f64, f64); 5] = [
    (SizeClass::Tiny, 2.02, 3.66),
    (SizeClass::Small, 10.34, 8.57),
    (SizeClass::Medium, 10.89, 15.94),
    (SizeClass::Large, 8.04, 29.9),
    (SizeClass::Huge, 7.46, 23.95),
];
const DEFAULT_PAGEABLE_D2H: [(SizeClass, f64, f64); 5] = [
    (SizeClass::Tiny, 3.03, 3.88),
    (SizeClass::Small, 7.82, 9.24),
    (SizeClass::Medium, 9.89, 19.79),
    (SizeClass::Large, 10.47, 23.67),
    (SizeClass::Huge, 10.34, 30.0),
];
const DEFAULT_PINNED_H2D: [(SizeClass, f64, f64); 5] = [
    (SizeClass::Tiny, 4.1, 5.23),
    (SizeClass::Small, 29.55, 34.13),
    (SizeClass::Medium, 52.36, 53.16),
    (SizeClass::Large, 54.26, 54.54),
    (SizeClass::Huge, 54.23, 54.6),
];
const DEFAULT_PINNED_D2H: [(SizeClass, f64, f64); 5] = [
    (SizeClass::Tiny, 4.54, 5.87),
    (SizeClass::Small, 31.54, 34.28),
    (SizeClass::Medium, 52.76, 53.28),
    (SizeClass::Large, 54.47, 54.69),
    (SizeClass::Huge, 54.29, 54.69),
];
const DEFAULT_PEER: [(SizeClass, f64, f64); 5] = [
    (SizeClass::Tiny, 1.0, 20.0),
    (SizeClass::Small, 8.0, 150.0),
    (SizeClass::Medium, 20.0, 350.0),
    (SizeClass::Large, 25.0, 390.0),
    (SizeClass::Huge, 25.0, 390.0),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_costs_fit_two_points_and_never_go_negative() {
        let ms = Duration::from_millis;
        let cost = RegistrationCost::fit((64 << 20, ms(20)), (4 << 20, ms(11)));
        assert_eq!(
            cost,
            RegistrationCost {
                fixed_ms: 10.4,
                ms_per_mib: 0.15
            }
        );
        assert!((cost.millis(64 << 20) - 20.0).abs() < 1e-9);
        // Noise: the larger buffer registered faster. No negative slope, no negative fixed part.
        let cost = RegistrationCost::fit((4 << 20, ms(12)), (64 << 20, ms(11)));
        assert_eq!((cost.fixed_ms, cost.ms_per_mib), (12.0, 0.0));
        let cost = RegistrationCost::fit((4 << 20, ms(1)), (64 << 20, ms(31)));
        assert_eq!((cost.fixed_ms, cost.ms_per_mib), (0.0, 0.5));
        // One size twice: all of it is fixed.
        let cost = RegistrationCost::fit((8 << 20, ms(3)), (8 << 20, ms(5)));
        assert_eq!((cost.fixed_ms, cost.ms_per_mib), (3.0, 0.0));
    }

    #[test]
    fn tables_without_a_registration_cost_still_load_and_round_trip_with_one() {
        // A file written before registration was measured.
        let old = r#"{ "device": "NVIDIA H100 80GB HBM3",
            "entries": [ { "path": { "src": "pageable", "dst": "device", "cross_device": false },
                           "size_class": "large", "method": "host_staged", "gbps": 29.9 } ] }"#;
        let table = CalibrationTable::from_json(old).unwrap();
        assert_eq!(table.registration, None);
        assert_eq!(table.entries.len(), 1);
        assert!(!table.to_json().contains("registration"));
        let mut table = table;
        table.registration = Some(RegistrationCost {
            fixed_ms: 0.25,
            ms_per_mib: 0.125,
        });
        table.record(
            TransferPath::REGISTERED_TO_DEVICE,
            SizeClass::Large,
            TransferMethod::DirectCopy,
            53.1,
        );
        let json = table.to_json();
        assert!(
            json.contains("\"registration\"") && json.contains("\"registered\""),
            "{json}"
        );
        assert_eq!(CalibrationTable::from_json(&json).unwrap(), table);
        assert_eq!(
            CalibrationTable::h100_defaults().registration,
            Some(RegistrationCost::H100_DEFAULT)
        );
    }
}
