//! [`CalibrationTable::h100_defaults`]: the figures used until this machine is measured, and
//! the machine they were measured on ([`DEFAULT_MACHINE`]).

use super::{CalibrationTable, Measure, RegistrationCost};
use crate::location::TransferPath;
use crate::method::TransferMethod;

/// The machine [`CalibrationTable::h100_defaults`] was measured on.
pub const DEFAULT_MACHINE: &str = "NVIDIA H100 80GB HBM3";

impl CalibrationTable {
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

    use crate::staging::StagingConfig;

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
