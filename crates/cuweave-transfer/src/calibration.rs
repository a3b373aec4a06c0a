//! [`CalibrationTable`]: measured bandwidth per (path, size class, method), the input of the
//! method choice, and what registering host memory costs ([`RegistrationCost`]); saved and
//! loaded as JSON; [`CalibrationTable::h100_defaults`] when nothing was measured.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TransferError};
use crate::location::{SizeClass, TransferPath};
use crate::method::TransferMethod;
use crate::staging::StagingConfig;

/// How far apart two transfer sizes are, on a log scale: the larger over the smaller (1 for
/// equal sizes). Cheap enough for every transfer's planning (no logarithm).
pub(crate) fn size_distance(a: usize, b: usize) -> f64 {
    let (a, b) = (a.max(1) as f64, b.max(1) as f64);
    if a > b { a / b } else { b / a }
}

/// The machine [`CalibrationTable::h100_defaults`] was measured on.
pub const DEFAULT_MACHINE: &str = "NVIDIA H100 80GB HBM3";

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

/// The staging configuration calibration chose for one path, device and size: the size's default
/// unless another measured faster than it round after round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StagingChoice {
    /// The path (pageable to device, or device to pageable).
    pub path: TransferPath,
    /// The device.
    pub device: usize,
    /// The size measured.
    pub bytes: usize,
    /// The configuration chosen there.
    pub config: StagingConfig,
    /// Its bandwidth, GB/s.
    pub gbps: f64,
}

/// A calibration table whose devices are not this machine's (see
/// [`TransferManager::set_calibration`](crate::TransferManager::set_calibration)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineMismatch {
    /// The devices the table was measured on (empty: not recorded).
    pub table: Vec<String>,
    /// This machine's devices.
    pub machine: Vec<String>,
}

impl MachineMismatch {
    /// The table's machine, as plans name it.
    pub fn measured_on(&self) -> String {
        if self.table.is_empty() {
            "an unrecorded machine".to_owned()
        } else {
            self.table.join(" + ")
        }
    }
}

impl std::fmt::Display for MachineMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "calibration measured on {}, this machine has {}; TransferManager::recalibrate() \
             measures this machine",
            self.measured_on(),
            if self.machine.is_empty() {
                "no devices".to_owned()
            } else {
                self.machine.join(" + ")
            }
        )
    }
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
    /// What the figures were measured on (device 0's name, or a label), if known.
    pub device: Option<String>,
    /// Every device of the machine measured, by ordinal (empty in older files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
    /// The staging configuration chosen per path, device and size.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub staging: Vec<StagingChoice>,
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

    /// Records the staging configuration chosen for `path` on `device` at `bytes`.
    pub fn record_staging(&mut self, choice: StagingChoice) {
        self.staging
            .retain(|c| (c.path, c.device, c.bytes) != (choice.path, choice.device, choice.bytes));
        self.staging.push(choice);
    }

    /// The staging configuration chosen for `path` on `device` at the size nearest
    /// `bytes` (log scale), if any was measured.
    ///
    /// A choice that ran as one block where it was measured (its chunk held that whole copy, on
    /// the calling thread) says nothing of how many participants a copy its chunk does not hold
    /// wants: such a copy takes the nearest choice that applies to it instead, and that one
    /// only when no other was measured. (On the H100 host a 256 KiB choice of one 256 KiB
    /// block ran 512 KiB uploads as two chunks on one thread, at 0.93x the plain call; in the
    /// staging sweep that form moved 9.0 / 10.5 GB/s at 384 / 512 KiB, the 1 MiB choice of two
    /// participants 10.9 / 12.0.)
    pub fn staging_for(
        &self,
        path: TransferPath,
        device: usize,
        bytes: usize,
    ) -> Option<StagingConfig> {
        let distance = |b: usize| size_distance(b, bytes);
        // A table built in code may hold a configuration `parse` would refuse: never used.
        let measured = || {
            self.staging
                .iter()
                .filter(|c| c.path == path && c.device == device && c.config.validate().is_ok())
        };
        let applies = |c: &&StagingChoice| {
            c.config.runs_as_one_block(bytes) || !c.config.runs_as_one_block(c.bytes)
        };
        let nearest = |a: &&StagingChoice, b: &&StagingChoice| {
            distance(a.bytes).total_cmp(&distance(b.bytes))
        };
        measured()
            .filter(applies)
            .min_by(nearest)
            .or_else(|| measured().min_by(nearest))
            .map(|c| c.config)
    }

    /// `None` when the table was measured on a machine with exactly the devices `machine`
    /// (names by ordinal), else what differs. Tables without a device list compare their
    /// `device` label with device 0.
    pub fn check_machine(&self, machine: &[String]) -> Option<MachineMismatch> {
        let table = if self.devices.is_empty() {
            self.device.iter().cloned().collect::<Vec<_>>()
        } else {
            self.devices.clone()
        };
        let same = if self.devices.is_empty() {
            table.len() == 1 && machine.first() == table.first()
        } else {
            table == machine
        };
        (!same).then(|| MachineMismatch {
            table,
            machine: machine.to_vec(),
        })
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

    /// Whether nothing was measured (no bandwidth and no registration cost).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.registration.is_none() && self.staging.is_empty()
    }

    /// The table as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a calibration table always serialises")
    }

    /// A table from JSON (as [`to_json`](Self::to_json) writes it).
    ///
    /// # Errors
    /// [`TransferError::CalibrationFile`] (path `<json>`) when the text is not a table, names a
    /// staging configuration that cannot run ([`StagingConfig::validate`]), or holds a negative
    /// bandwidth or registration cost.
    pub fn from_json(json: &str) -> Result<Self> {
        Self::parse(json, "<json>")
    }

    /// The table in `text`, read from `path`, with every staging configuration checked
    /// ([`StagingConfig::validate`]): a file can name one that would overflow or pin without
    /// bound.
    fn parse(text: &str, path: &str) -> Result<Self> {
        let file_error = |message: String| TransferError::CalibrationFile {
            path: path.to_owned(),
            message,
        };
        let table: Self = serde_json::from_str(text).map_err(|e| file_error(e.to_string()))?;
        for choice in &table.staging {
            choice
                .config
                .validate()
                .map_err(|e| file_error(e.to_string()))?;
        }
        // A planner that compares figures must never read a negative one as a real speed, nor a
        // negative registration cost as a saving.
        let figures = table
            .entries
            .iter()
            .map(|e| ("a bandwidth", e.gbps))
            .chain(
                table
                    .staging
                    .iter()
                    .map(|c| ("a staging bandwidth", c.gbps)),
            )
            .chain(table.registration.iter().flat_map(|r| {
                [
                    ("the fixed registration cost", r.fixed_ms),
                    ("the registration cost per MiB", r.ms_per_mib),
                ]
            }));
        for (what, figure) in figures {
            if !(figure.is_finite() && figure >= 0.0) {
                return Err(file_error(format!(
                    "{what} of {figure} (figures are finite and not negative)"
                )));
            }
        }
        Ok(table)
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
        Self::parse(&text, &path.display().to_string())
    }

    /// The figures used when nothing was measured: [`TransferManager::calibrate`] on an NVIDIA
    /// H100 80GB HBM3 host (PCIe Gen5, 16 host threads, driver 580), at each of
    /// [`CALIBRATION_SIZES`](crate::CALIBRATION_SIZES), as listed in `docs/transfer.md`. Plans that use them say so and name that machine
    /// ([`DEFAULT_MACHINE`]).
    ///
    /// Only host paths with a real choice are listed; device pairs have no default (no pair was
    /// measured), so until calibration they go by preference (peer access where the devices
    /// allow it). The registration cost is [`RegistrationCost::H100_DEFAULT`].
    ///
    /// [`TransferManager::calibrate`]: crate::TransferManager::calibrate
    pub fn h100_defaults() -> Self {
        let mut table = Self {
            device: Some(format!("{DEFAULT_MACHINE} (defaults)")),
            devices: vec![DEFAULT_MACHINE.to_owned()],
            registration: Some(RegistrationCost::H100_DEFAULT),
            ..Self::default()
        };
        for &(path, bytes, method, gbps) in DEFAULTS {
            let at = Measure {
                path,
                src_device: None,
                dst_device: None,
                bytes,
            };
            table.record_at(at, method, gbps);
        }
        table
    }
}

/// One default figure: path, size measured, method, GB/s.
type DefaultRow = (TransferPath, usize, TransferMethod, f64);

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

// From `TransferManager::calibrate` on the H100 host, device 0 (issue 15, GPU run of
// 2026-11-24 with the per-direction staging defaults: the staging sweep example with
// SWEEP_CALIBRATE=1), GB/s at each calibration size.
const DEFAULTS: &[DefaultRow] = {
    use TransferMethod::{DirectCopy as D, HostStaged as S, ZeroCopy as Z};
    const H2D: TransferPath = TransferPath::PAGEABLE_TO_DEVICE;
    const D2H: TransferPath = TransferPath::DEVICE_TO_PAGEABLE;
    const PH2D: TransferPath = TransferPath::PINNED_TO_DEVICE;
    const PD2H: TransferPath = TransferPath::DEVICE_TO_PINNED;
    &[
        (H2D, 64 * KIB, D, 2.58),
        (H2D, 64 * KIB, S, 4.28),
        (H2D, 256 * KIB, D, 9.14),
        (H2D, 256 * KIB, S, 9.26),
        (H2D, MIB, D, 11.62),
        (H2D, MIB, S, 16.01),
        (H2D, 4 * MIB, D, 11.45),
        // At 4 and 16 MiB the ordered uploads of the staging sweep (issue 15, fifth pass) at
        // the configurations `StagingConfig::for_upload` picks; from 64 MiB its ordered uploads
        // at the configurations the fourteenth pass chose (`examples/upload_timeline.rs`, the
        // median of twelve rounds' medians on three leases, of four rounds' at 1 GiB).
        (H2D, 4 * MIB, S, 28.23),
        (H2D, 16 * MIB, D, 12.01),
        (H2D, 16 * MIB, S, 38.16),
        (H2D, 64 * MIB, D, 5.27),
        (H2D, 64 * MIB, S, 42.45),
        (H2D, 256 * MIB, D, 5.87),
        (H2D, 256 * MIB, S, 49.35),
        (H2D, GIB, D, 6.0),
        (H2D, GIB, S, 50.8),
        (D2H, 64 * KIB, D, 4.18),
        (D2H, 64 * KIB, S, 5.28),
        (D2H, 256 * KIB, D, 8.67),
        (D2H, 256 * KIB, S, 9.05),
        (D2H, MIB, D, 9.37),
        (D2H, MIB, S, 12.78),
        (D2H, 4 * MIB, D, 8.51),
        // From 4 MiB the ordered downloads of the staging sweep (issue 15, fourth pass) at the
        // configurations `StagingConfig::for_download` now picks.
        (D2H, 4 * MIB, S, 21.75),
        (D2H, 16 * MIB, D, 12.71),
        (D2H, 16 * MIB, S, 35.32),
        (D2H, 64 * MIB, D, 9.17),
        (D2H, 64 * MIB, S, 45.52),
        (D2H, 256 * MIB, D, 9.11),
        (D2H, 256 * MIB, S, 51.08),
        (D2H, GIB, D, 9.36),
        (D2H, GIB, S, 53.07),
        (PH2D, 64 * KIB, D, 6.81),
        (PH2D, 64 * KIB, Z, 6.82),
        (PH2D, 256 * KIB, D, 19.28),
        (PH2D, 256 * KIB, Z, 19.41),
        (PH2D, MIB, D, 36.79),
        (PH2D, MIB, Z, 37.05),
        (PH2D, 4 * MIB, D, 47.58),
        (PH2D, 4 * MIB, Z, 47.09),
        (PH2D, 16 * MIB, D, 52.74),
        (PH2D, 16 * MIB, Z, 52.86),
        (PH2D, 64 * MIB, D, 52.82),
        (PH2D, 64 * MIB, Z, 53.12),
        (PH2D, 256 * MIB, D, 52.73),
        (PH2D, 256 * MIB, Z, 51.97),
        (PH2D, GIB, D, 53.9),
        (PH2D, GIB, Z, 54.22),
        (PD2H, 64 * KIB, D, 7.79),
        (PD2H, 64 * KIB, Z, 7.69),
        (PD2H, 256 * KIB, D, 21.28),
        (PD2H, 256 * KIB, Z, 21.58),
        (PD2H, MIB, D, 38.55),
        (PD2H, MIB, Z, 39.06),
        (PD2H, 4 * MIB, D, 47.92),
        (PD2H, 4 * MIB, Z, 48.54),
        (PD2H, 16 * MIB, D, 53.4),
        (PD2H, 16 * MIB, Z, 53.47),
        (PD2H, 64 * MIB, D, 54.24),
        (PD2H, 64 * MIB, Z, 54.66),
        (PD2H, 256 * MIB, D, 54.48),
        (PD2H, 256 * MIB, Z, 54.72),
        (PD2H, GIB, D, 55.02),
        (PD2H, GIB, Z, 54.98),
    ]
};

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

    #[test]
    fn negative_figures_in_a_file_are_refused_by_name() {
        let table = CalibrationTable::h100_defaults();
        let json = table.to_json();
        assert_eq!(CalibrationTable::from_json(&json).unwrap(), table);
        let mut bad = table.clone();
        bad.entries[0].gbps = -3.5;
        let error = CalibrationTable::from_json(&bad.to_json()).unwrap_err();
        assert!(error.to_string().contains("a bandwidth of -3.5"), "{error}");
        let mut bad = table.clone();
        bad.registration = Some(RegistrationCost {
            fixed_ms: 0.2,
            ms_per_mib: -0.01,
        });
        let error = CalibrationTable::from_json(&bad.to_json()).unwrap_err();
        assert!(error.to_string().contains("per MiB of -0.01"), "{error}");
        // Zero is a figure a failed measurement can round to: it loads, and never wins.
        let mut zero = table;
        zero.entries[0].gbps = 0.0;
        assert_eq!(CalibrationTable::from_json(&zero.to_json()).unwrap(), zero);
    }
}
#[cfg(test)]
mod machine_tests {
    use super::*;

    #[test]
    fn tables_from_other_machines_are_found_out() {
        let here = vec!["NVIDIA H100 80GB HBM3".to_owned()];
        let defaults = CalibrationTable::h100_defaults();
        assert_eq!(defaults.check_machine(&here), None);
        let two = vec![here[0].clone(), here[0].clone()];
        let mismatch = defaults.check_machine(&two).unwrap();
        assert!(mismatch.to_string().contains("recalibrate"), "{mismatch}");
        // An old file with only a device label, and one with nothing at all.
        let old = CalibrationTable {
            device: Some("NVIDIA A100-SXM4-40GB".to_owned()),
            ..CalibrationTable::default()
        };
        assert_eq!(
            old.check_machine(&here).unwrap().measured_on(),
            "NVIDIA A100-SXM4-40GB"
        );
        assert_eq!(
            CalibrationTable::default()
                .check_machine(&here)
                .unwrap()
                .measured_on(),
            "an unrecorded machine"
        );
    }

    #[test]
    fn staging_choices_are_per_path_device_and_nearest_size() {
        let mut table = CalibrationTable::default();
        let config = |chunk_bytes| StagingConfig {
            chunk_bytes,
            depth: 2,
            threads: 8,
            host_copy: crate::HostCopy::Cached,
            order: crate::ChunkOrder::Ordered,
        };
        let h2d = TransferPath::PAGEABLE_TO_DEVICE;
        for (bytes, chunk) in [(4 << 20, 256 << 10), (256 << 20, 4 << 20)] {
            table.record_staging(StagingChoice {
                path: h2d,
                device: 0,
                bytes,
                config: config(chunk),
                gbps: 30.0,
            });
        }
        // Replacing keeps one choice per key (the table stays bounded over recalibrations).
        for _ in 0..1000 {
            table.record_staging(StagingChoice {
                path: h2d,
                device: 0,
                bytes: 4 << 20,
                config: config(512 << 10),
                gbps: 31.0,
            });
        }
        assert_eq!(table.staging.len(), 2);
        assert_eq!(
            table.staging_for(h2d, 0, 3 << 20).unwrap().chunk_bytes,
            512 << 10
        );
        assert_eq!(
            table.staging_for(h2d, 0, 1 << 30).unwrap().chunk_bytes,
            4 << 20
        );
        assert_eq!(table.staging_for(h2d, 1, 4 << 20), None);
        assert_eq!(
            table.staging_for(TransferPath::DEVICE_TO_PAGEABLE, 0, 4 << 20),
            None
        );
        let back = CalibrationTable::from_json(&table.to_json()).unwrap();
        assert_eq!(back, table);
    }

    #[rstest::rstest]
    #[case::held_by_the_block(200 << 10, 256 << 10, 1)]
    #[case::the_block_itself(256 << 10, 256 << 10, 1)]
    #[case::just_past_the_block(300 << 10, 256 << 10, 2)]
    #[case::tied_between_the_two(512 << 10, 256 << 10, 2)]
    #[case::nearer_the_pipeline(768 << 10, 256 << 10, 2)]
    fn a_one_block_choice_applies_only_where_its_block_holds_the_copy(
        #[case] bytes: usize,
        #[case] chunk: usize,
        #[case] threads: usize,
    ) {
        let h2d = TransferPath::PAGEABLE_TO_DEVICE;
        let config = |threads| StagingConfig {
            chunk_bytes: 256 << 10,
            depth: 2,
            threads,
            host_copy: crate::HostCopy::Streaming,
            order: crate::ChunkOrder::Ordered,
        };
        let mut table = CalibrationTable::default();
        // As calibration records them: one 256 KiB block at 256 KiB, a pipeline of two
        // participants at 1 MiB.
        for (at, threads) in [(256 << 10, 1), (1 << 20, 2)] {
            table.record_staging(StagingChoice {
                path: h2d,
                device: 0,
                bytes: at,
                config: config(threads),
                gbps: 10.0,
            });
        }
        let chosen = table.staging_for(h2d, 0, bytes).unwrap();
        assert_eq!((chosen.chunk_bytes, chosen.threads), (chunk, threads));
        // With nothing else measured, the one-block choice is still the nearest there is.
        table.staging.retain(|c| c.bytes == 256 << 10);
        assert_eq!(table.staging_for(h2d, 0, bytes).unwrap().threads, 1);
    }

    #[rstest::rstest]
    #[case::depth_that_overflows(4 << 20, usize::MAX, 8, "depth")]
    #[case::no_depth(4 << 20, 0, 8, "depth")]
    #[case::empty_chunks(0, 2, 8, "chunk_bytes")]
    #[case::byte_chunks(1, 2, 8, "chunk_bytes")]
    #[case::chunks_past_1_gib((1 << 30) + 1, 2, 8, "chunk_bytes")]
    #[case::no_threads(4 << 20, 2, 0, "threads")]
    #[case::more_threads_than_workers(4 << 20, 2, crate::MAX_WORKERS + 2, "threads")]
    fn a_staging_configuration_that_cannot_run_is_refused_from_files_and_never_used(
        #[case] chunk_bytes: usize,
        #[case] depth: usize,
        #[case] threads: usize,
        #[case] bound: &str,
    ) {
        let h2d = TransferPath::PAGEABLE_TO_DEVICE;
        let bad = StagingConfig {
            chunk_bytes,
            depth,
            threads,
            host_copy: crate::HostCopy::Streaming,
            order: crate::ChunkOrder::Ordered,
        };
        assert!(matches!(
            bad.validate(),
            Err(TransferError::InvalidStaging { config, reason })
                if config == bad && reason.contains(bound)
        ));
        let mut table = CalibrationTable::default();
        table.record_staging(StagingChoice {
            path: h2d,
            device: 0,
            bytes: 64 << 20,
            config: bad,
            gbps: 40.0,
        });
        let error = CalibrationTable::from_json(&table.to_json()).unwrap_err();
        assert!(
            matches!(&error, TransferError::CalibrationFile { path, message }
                if path == "<json>" && message.contains(bound)),
            "{error}"
        );
        // Built in code instead: the planner passes over it to the defaults.
        assert_eq!(table.staging_for(h2d, 0, 64 << 20), None);
        // Saturates instead of overflowing (a debug build would panic).
        assert!(bad.staging_bytes() >= bad.chunk_bytes);
    }

    #[test]
    fn every_staging_configuration_shipped_or_measured_can_run() {
        let shipped = CalibrationTable::h100_defaults();
        for choice in &shipped.staging {
            choice.config.validate().unwrap();
        }
        for bytes in crate::CALIBRATION_SIZES {
            for path in [
                TransferPath::PAGEABLE_TO_DEVICE,
                TransferPath::DEVICE_TO_PAGEABLE,
            ] {
                StagingConfig::for_path(path, bytes).validate().unwrap();
                for candidate in crate::staging_candidates(path, bytes) {
                    candidate.validate().unwrap();
                }
            }
        }
        StagingConfig::default().validate().unwrap();
    }
}
