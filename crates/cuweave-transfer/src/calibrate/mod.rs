//! Measuring this machine: [`TransferManager::calibrate`] times each candidate method per path,
//! device (or device pair) and size, and chooses a staging configuration per size, once per
//! process.

use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::calibration::{CalibrationTable, Measure};
use crate::endpoint::{Destination, Source};
use crate::error::{Result, TransferError};
use crate::location::{Location, TransferPath};
use crate::manager::TransferManager;
use crate::method::TransferMethod;
use crate::planner;
use crate::stats::TransferStats;

mod candidates;
mod paths;
mod timing;
mod tune;

pub use candidates::staging_candidates;

/// The calibration measured in this process, shared by every manager created after it.
static PROCESS: OnceLock<Mutex<Option<CalibrationTable>>> = OnceLock::new();

pub(crate) fn process_calibration() -> Option<CalibrationTable> {
    PROCESS.get().and_then(|cell| cell.lock().clone())
}

fn remember(table: &CalibrationTable) {
    *PROCESS.get_or_init(|| Mutex::new(None)).lock() = Some(table.clone());
}

/// `table` without what a recalibration of `devices` measures again: keeps what names a
/// device outside `devices` (another device's host paths and staging choices, peer pairs with a
/// device not among them); drops the figures of `devices` alone, those that name no device, and
/// the registration cost.
fn without_devices(mut table: CalibrationTable, devices: &[usize]) -> CalibrationTable {
    let other = |device: Option<usize>| device.is_some_and(|d| !devices.contains(&d));
    table
        .entries
        .retain(|entry| other(entry.src_device) || other(entry.dst_device));
    table.staging.retain(|choice| other(Some(choice.device)));
    table.registration = None;
    table
}

/// Held while a calibration measures: one at a time in a process.
static CALIBRATING: Mutex<()> = Mutex::new(());

/// What a table lacks for a manager's devices: the devices whose host paths it has not
/// measured, and the ordered pairs of them whose peer path it has not.
#[derive(Debug, PartialEq)]
struct Missing {
    devices: Vec<usize>,
    pairs: Vec<(usize, usize)>,
}

impl Missing {
    /// Everything, for a table not measured yet.
    fn all(devices: &[usize]) -> Self {
        Self::where_not(devices, |_| false, |_, _| false)
    }

    /// What `table` lacks: a device counts as measured when its pageable uploads are, a pair
    /// when its peer copies are.
    fn of(table: &CalibrationTable, devices: &[usize]) -> Self {
        let has = |path, src, dst| {
            table
                .entries
                .iter()
                .any(|e| e.path == path && e.src_device == src && e.dst_device == dst)
        };
        Self::where_not(
            devices,
            |d| has(TransferPath::PAGEABLE_TO_DEVICE, None, Some(d)),
            |a, b| has(TransferPath::PEER, Some(a), Some(b)),
        )
    }

    fn where_not(
        devices: &[usize],
        measured: impl Fn(usize) -> bool,
        pair_measured: impl Fn(usize, usize) -> bool,
    ) -> Self {
        Self {
            devices: devices.iter().copied().filter(|&d| !measured(d)).collect(),
            pairs: devices
                .iter()
                .flat_map(|&a| devices.iter().map(move |&b| (a, b)))
                .filter(|&(a, b)| a != b && !pair_measured(a, b))
                .collect(),
        }
    }

    fn is_empty(&self) -> bool {
        self.devices.is_empty() && self.pairs.is_empty()
    }
}

/// The transfer sizes calibration measures, each at its own size: every size class is
/// represented (64 KiB up to 1 GiB), so the method choice compares methods at the measured size
/// nearest each transfer. Up to 4 MiB every factor of two: there the pipeline's margin over
/// the plain call is thinnest (1.1-2x on the H100 host), and a size between two measured ones
/// took a choice measured at twice or half its size (512 KiB uploads ran 0.93-1.09x the plain
/// call on the 256 KiB and 1 MiB choices); above, where it runs 2-7x, every factor of four.
pub const CALIBRATION_SIZES: [usize; 11] = [
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    256 << 20,
    1 << 30,
];

impl TransferManager {
    /// The calibration for this machine: measured once per process, then reused by this and
    /// every later manager, and in use by this manager.
    ///
    /// For every device the manager serves: each candidate method of the pageable, pinned and
    /// registered host paths at each of [`CALIBRATION_SIZES`] (each size class at its own
    /// sizes, 1 GiB included), and for pageable copies a [`StagingConfig`] of
    /// [`staging_candidates`] per size (the default unless another was faster round after round;
    /// see `choose_staging`); for every ordered pair of devices, the peer path's
    /// candidates; and once, the cost of registering host memory (`cuMemHostRegister` +
    /// `cuMemHostUnregister` of 4 MiB and 64 MiB). A few seconds per device on an H100; save
    /// the table ([`CalibrationTable::save`]) to skip it next time.
    ///
    /// The measuring transfers are counted in calibration's own statistics, never in
    /// [`stats`](Self::stats). Where the driver cannot register host memory, the registration
    /// figures are left out (with a `tracing` warning).
    ///
    /// The process's table is shared by managers serving different devices: a manager whose
    /// devices (or device pairs) it does not cover yet measures those, and only those, into
    /// it. One calibration runs at a time in a process (a second waits for the first, so that
    /// neither skews the other's timings).
    ///
    /// # Errors
    /// The driver's or memory layer's error when a measurement fails (nothing is cached then).
    ///
    /// [`StagingConfig`]: crate::StagingConfig
    pub fn calibrate(&self) -> Result<CalibrationTable> {
        // A table that covers this manager is used without waiting for a calibration that
        // another manager may be running.
        if let Some(table) = process_calibration()
            && Missing::of(&table, &self.devices()).is_empty()
        {
            self.set_measured(table.clone());
            return Ok(table);
        }
        let _alone = CALIBRATING.lock();
        // Taken again under the lock: the calibration waited for may have measured it all.
        self.measure_missing(process_calibration())
    }

    /// Measures again even if this process already calibrated (see [`calibrate`](Self::calibrate)):
    /// also the way to replace a table loaded from another machine. Every figure of this
    /// manager's devices is measured anew; the process's figures for devices it does not serve
    /// stay.
    ///
    /// # Errors
    /// As [`calibrate`](Self::calibrate).
    pub fn recalibrate(&self) -> Result<CalibrationTable> {
        let _alone = CALIBRATING.lock();
        // The process's table also serves managers of other devices: what this one does not
        // serve (other devices' paths, pairs with a device it lacks) stays as measured before,
        // and all the rest is missing, so measured again.
        let devices = self.devices();
        let earlier = process_calibration().map(|table| without_devices(table, &devices));
        self.measure_missing(earlier)
    }

    /// Measures into `known` (a new table when `None`) what it lacks for this manager's
    /// devices: their host paths, every ordered pair's peer path, and the registration cost;
    /// then shares and uses the table.
    fn measure_missing(&self, known: Option<CalibrationTable>) -> Result<CalibrationTable> {
        let devices = self.devices();
        let missing = known
            .as_ref()
            .map_or_else(|| Missing::all(&devices), |t| Missing::of(t, &devices));
        if let (Some(table), true) = (&known, missing.is_empty()) {
            self.set_measured(table.clone());
            return Ok(table.clone());
        }
        let mut table = known.unwrap_or_else(|| {
            let machine = self.machine();
            CalibrationTable {
                device: machine.first().cloned(),
                devices: machine,
                ..CalibrationTable::default()
            }
        });
        let stats = TransferStats::default();
        for &device in &missing.devices {
            let with_registration = table.registration.is_none();
            self.measure_host_paths(device, with_registration, &mut table, &stats)?;
        }
        for &(a, b) in &missing.pairs {
            self.measure_peer_path(a, b, &mut table, &stats)?;
        }
        remember(&table);
        self.set_measured(table.clone());
        tracing::info!(
            entries = table.entries.len(),
            transfers = stats
                .snapshot()
                .iter()
                .map(|(_, _, s)| s.count)
                .sum::<u64>(),
            "transfer calibration measured"
        );
        Ok(table)
    }

    /// Runs `method` from `src` to `dst`, counted in calibration's own `stats`.
    fn run_with<T: cuweave_memory::Element>(
        &self,
        method: TransferMethod,
        src: Source<'_, T>,
        dst: Destination<'_, T>,
        stats: &TransferStats,
    ) -> Result<()> {
        let (from, to) = (src.location(), dst.location());
        let plan = planner::require(
            TransferPath::between(from, to),
            src.bytes(),
            &self.facts(from, to),
            method,
        )
        .map_err(|reason| TransferError::Unsupported {
            method,
            path: format!("{from} -> {to}"),
            reason,
        })?;
        self.run(plan, src, dst, stats).map(drop)
    }
}

/// The calibration key of a copy of `bytes` from device `from` to device `to`.
pub fn peer_measure(from: usize, to: usize, bytes: usize) -> Measure {
    planner::Query::new(Location::Device(from), Location::Device(to), bytes).measure
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibration_measures_only_the_devices_and_pairs_its_table_lacks() {
        assert_eq!(
            Missing::all(&[0, 1]),
            Missing {
                devices: vec![0, 1],
                pairs: vec![(0, 1), (1, 0)],
            }
        );
        // A table measured by a manager limited to device 0 (or to none: empty).
        let mut table = CalibrationTable::default();
        assert_eq!(Missing::of(&table, &[0]), Missing::all(&[0]));
        assert!(Missing::of(&table, &[]).is_empty());
        let up = |d| planner::Query::new(Location::PageableHost, Location::Device(d), 4 << 20);
        table.record_at(up(0).measure, TransferMethod::HostStaged, 30.0);
        assert!(Missing::of(&table, &[0]).is_empty());
        // A manager for both devices then measures device 1 and the two pairs only.
        assert_eq!(
            Missing::of(&table, &[0, 1]),
            Missing {
                devices: vec![1],
                pairs: vec![(0, 1), (1, 0)],
            }
        );
        table.record_at(up(1).measure, TransferMethod::HostStaged, 30.0);
        table.record_at(
            peer_measure(0, 1, 4 << 20),
            TransferMethod::PeerToPeer,
            40.0,
        );
        assert_eq!(
            Missing::of(&table, &[0, 1]),
            Missing {
                devices: vec![],
                pairs: vec![(1, 0)],
            }
        );
        table.record_at(
            peer_measure(1, 0, 4 << 20),
            TransferMethod::PeerToPeer,
            40.0,
        );
        assert!(Missing::of(&table, &[0, 1]).is_empty());
        assert!(Missing::of(&table, &[1]).is_empty());
    }

    #[test]
    fn a_recalibration_keeps_what_it_did_not_measure_again() {
        let up = |d| planner::Query::new(Location::PageableHost, Location::Device(d), 4 << 20);
        let choice = |device| crate::calibration::StagingChoice {
            path: TransferPath::PAGEABLE_TO_DEVICE,
            device,
            bytes: 4 << 20,
            config: crate::StagingConfig::for_upload(4 << 20),
            gbps: 30.0,
        };
        // Measured earlier by a manager of devices 0 and 1.
        let mut earlier = CalibrationTable::default();
        for d in [0, 1] {
            earlier.record_at(up(d).measure, TransferMethod::HostStaged, 30.0);
            earlier.record_staging(choice(d));
        }
        earlier.record_at(
            peer_measure(0, 1, 4 << 20),
            TransferMethod::PeerToPeer,
            40.0,
        );
        earlier.registration = Some(crate::calibration::RegistrationCost {
            fixed_ms: 0.2,
            ms_per_mib: 0.06,
        });
        // A manager of device 0 alone: device 0 and the registration cost are missing again,
        // nothing else.
        let mut measured = without_devices(earlier, &[0]);
        assert_eq!(
            Missing::of(&measured, &[0]),
            Missing {
                devices: vec![0],
                pairs: vec![],
            }
        );
        assert!(measured.registration.is_none());
        // It measures device 0 again.
        measured.record_at(up(0).measure, TransferMethod::HostStaged, 35.0);
        measured.record_staging(choice(0));
        // Device 1 and the pair stay as measured; device 0 is the new figure, once.
        assert_eq!(Missing::of(&measured, &[0, 1]).pairs, vec![(1, 0)]);
        assert!(Missing::of(&measured, &[0, 1]).devices.is_empty());
        let zero: Vec<f64> = measured
            .entries
            .iter()
            .filter(|e| e.dst_device == Some(0) && e.src_device.is_none())
            .map(|e| e.gbps)
            .collect();
        assert_eq!(zero, vec![35.0]);
        assert_eq!(measured.staging.len(), 2);
        assert!(measured.staging.iter().any(|c| c.device == 1));
    }

    #[test]
    fn every_size_class_is_measured_at_its_own_size() {
        use crate::SizeClass;
        for class in SizeClass::ALL {
            assert!(
                CALIBRATION_SIZES.iter().any(|&b| SizeClass::of(b) == class),
                "{class}"
            );
        }
        assert!(CALIBRATION_SIZES.contains(&(1 << 30)));
    }
}
