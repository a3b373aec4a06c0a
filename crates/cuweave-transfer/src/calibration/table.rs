//! [`CalibrationTable`]: measured bandwidth per path, device and size, recorded and read back
//! for the method choice.

use serde::{Deserialize, Serialize};

use super::{CalibrationEntry, Measure, RegistrationCost, StagingChoice, size_distance};
use crate::location::{SizeClass, TransferPath};
use crate::method::TransferMethod;

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
    /// What the figures were measured on (device 0's name, or a label), if known.
    pub device: Option<String>,
    /// Every device of the machine measured, by ordinal (empty in older files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
    /// The staging configuration chosen per path, device and size.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub staging: Vec<StagingChoice>,
    /// The measurements (none in a hand-written file that holds only staging choices or a
    /// registration cost).
    #[serde(default)]
    pub entries: Vec<CalibrationEntry>,
    /// What registering and unregistering host memory costs here, if measured (files written
    /// before it was measured have none, and load as `None`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registration: Option<RegistrationCost>,
}

impl CalibrationTable {
    /// Records (or replaces) the figure for `(path, size_class, method)`, rounded to 0.01 GB/s
    /// (a NaN, infinite or negative figure is left out, as in [`record_at`](Self::record_at)).
    pub fn record(
        &mut self,
        path: TransferPath,
        size_class: SizeClass,
        method: TransferMethod,
        gbps: f64,
    ) {
        let at = Measure {
            path,
            src_device: None,
            dst_device: None,
            bytes: size_class.calibration_bytes(),
        };
        self.record_at(at, method, gbps);
    }

    /// Records (or replaces) the figure for `method` on one measured transfer `at`, rounded
    /// to 0.01 GB/s. A figure that is not a finite, non-negative number (NaN, infinite,
    /// negative) is no measurement: it is left out, with a warning, as a table file holding it
    /// is refused by [`from_json`](Self::from_json), so the table stays one that loads back.
    pub fn record_at(&mut self, at: Measure, method: TransferMethod, gbps: f64) {
        // Two decimals are all a measurement carries, and they survive JSON exactly. (Checked
        // after rounding: a finite figure near f64::MAX rounds to infinity.)
        let rounded = (gbps * 100.0).round() / 100.0;
        if !(rounded.is_finite() && rounded >= 0.0) {
            tracing::warn!(
                gbps,
                ?method,
                ?at,
                "not a bandwidth: left out of the calibration table"
            );
            return;
        }
        let gbps = rounded;
        let entry = CalibrationEntry {
            path: at.path,
            size_class: SizeClass::of(at.bytes),
            method,
            gbps,
            bytes: at.bytes,
            src_device: at.src_device,
            dst_device: at.dst_device,
        };
        match self.entries.iter_mut().find(|e| {
            e.path == at.path
                && e.measured_bytes() == at.bytes
                && e.method == method
                && e.src_device == at.src_device
                && e.dst_device == at.dst_device
        }) {
            Some(existing) => *existing = entry,
            None => self.entries.push(entry),
        }
    }

    /// The fastest of `allowed` for a transfer like `at`, with its figure and the size it was
    /// measured at: among the entries for `at`'s devices (else those for any device), at the
    /// measured size nearest `at.bytes` (on a log scale) where one of `allowed` was measured,
    /// so that methods are compared at one size, never one method's 16 MiB figure against
    /// another's 1 MiB. Ties go to the method listed first in `allowed`.
    pub fn best_at(
        &self,
        at: Measure,
        allowed: &[TransferMethod],
    ) -> Option<(TransferMethod, f64, usize)> {
        // One pass picks the entries that apply (for these devices if any were measured, else
        // those for any device) and the measured size nearest the transfer's: this runs on
        // every transfer, so it must stay cheap (no allocation, no logarithms).
        let relevant = |e: &&CalibrationEntry| e.path == at.path && allowed.contains(&e.method);
        let exact =
            |e: &CalibrationEntry| e.src_device == at.src_device && e.dst_device == at.dst_device;
        let any = |e: &CalibrationEntry| e.src_device.is_none() && e.dst_device.is_none();
        let ratio = |bytes: usize| size_distance(bytes, at.bytes);
        let mut have_exact = false;
        let mut size: Option<(bool, f64, usize)> = None;
        for e in self.entries.iter().filter(relevant) {
            let is_exact = exact(e);
            if !is_exact && !any(e) {
                continue;
            }
            let bytes = e.measured_bytes();
            let candidate = (is_exact, ratio(bytes), bytes);
            have_exact |= is_exact;
            size = match size {
                None => Some(candidate),
                Some(best)
                    if (candidate.0, -candidate.1, std::cmp::Reverse(candidate.2))
                        > (best.0, -best.1, std::cmp::Reverse(best.2)) =>
                {
                    Some(candidate)
                }
                keep => keep,
            };
        }
        let (_, _, size) = size?;
        let mut best: Option<(TransferMethod, f64, usize)> = None;
        for &method in allowed {
            let figure = self
                .entries
                .iter()
                .filter(relevant)
                .find(|e| {
                    e.method == method
                        && e.measured_bytes() == size
                        && if have_exact { exact(e) } else { any(e) }
                })
                .map(|e| e.gbps);
            if let Some(gbps) = figure
                && best.is_none_or(|(_, b, _)| gbps > b)
            {
                best = Some((method, gbps, size));
            }
        }
        best
    }

    /// The figure for `method` at the entry [`best_at`](Self::best_at) would compare for `at`.
    pub fn gbps_at(&self, at: Measure, method: TransferMethod) -> Option<f64> {
        self.best_at(at, &[method]).map(|(_, gbps, _)| gbps)
    }

    /// The figure for one method in one size class, if measured: the figure for any device
    /// where one was recorded, else the lowest device's (pair's), at the class's
    /// [`SizeClass::calibration_bytes`] where measured there, else at the largest size
    /// measured in the class.
    pub fn gbps(
        &self,
        path: TransferPath,
        size_class: SizeClass,
        method: TransferMethod,
    ) -> Option<f64> {
        self.entries
            .iter()
            .filter(|e| e.path == path && e.size_class == size_class && e.method == method)
            .min_by_key(|e| {
                let bytes = e.measured_bytes();
                (
                    e.src_device.is_some() || e.dst_device.is_some(),
                    e.src_device,
                    e.dst_device,
                    bytes != size_class.calibration_bytes(),
                    std::cmp::Reverse(bytes),
                )
            })
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

    /// Whether nothing was measured (no bandwidth, no staging choice and no registration
    /// cost).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.registration.is_none() && self.staging.is_empty()
    }
}
