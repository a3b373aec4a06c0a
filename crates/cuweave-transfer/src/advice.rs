//! Whether registering a host buffer pays ([`RegistrationAdvice`]): the one-off cost of
//! `cuMemHostRegister` + `cuMemHostUnregister` against what `k` transfers save by running at
//! pinned speed instead of the best pageable speed.
//!
//! Pure logic, no driver: [`advise`] reads the calibration tables, so it is tested against
//! given tables on any machine. With `c` the registration cost, `b` the bytes per transfer, `R`
//! the registered (pinned) bandwidth and `P` the best pageable one, `k` transfers take
//! `c + k·b/R` registered and `k·b/P` pageable, so registration pays from
//! `k = ⌊c / (b/P − b/R)⌋ + 1` transfers, and never when `R <= P`.

use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::calibration::{CalibrationTable, RegistrationCost};
use crate::location::{SizeClass, TransferPath};
use crate::method::TransferMethod;

/// Which way a repeated transfer between a host buffer and a device goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferDirection {
    /// Host memory to a device (an upload).
    HostToDevice,
    /// A device to host memory (a download).
    DeviceToHost,
}

impl TransferDirection {
    /// The path the buffer takes while pageable.
    pub fn pageable_path(self) -> TransferPath {
        match self {
            Self::HostToDevice => TransferPath::PAGEABLE_TO_DEVICE,
            Self::DeviceToHost => TransferPath::DEVICE_TO_PAGEABLE,
        }
    }

    /// The path it takes once registered.
    pub fn registered_path(self) -> TransferPath {
        match self {
            Self::HostToDevice => TransferPath::REGISTERED_TO_DEVICE,
            Self::DeviceToHost => TransferPath::DEVICE_TO_REGISTERED,
        }
    }

    /// The pinned path, whose `DirectCopy` figure stands in for registered memory where that
    /// was not measured (both are page-locked host memory the copy engine DMAs directly).
    pub fn pinned_path(self) -> TransferPath {
        match self {
            Self::HostToDevice => TransferPath::PINNED_TO_DEVICE,
            Self::DeviceToHost => TransferPath::DEVICE_TO_PINNED,
        }
    }
}

/// Whether registering a host buffer pays for the transfers expected of it, with the figures
/// behind the answer; from
/// [`TransferManager::registration_advice`](crate::TransferManager::registration_advice).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RegistrationAdvice {
    /// The direction of the transfers.
    pub direction: TransferDirection,
    /// Bytes per transfer (the buffer's size).
    pub bytes: usize,
    /// How many transfers were expected.
    pub expected_transfers: u64,
    /// Whether registering, then transferring `expected_transfers` times, takes less time in
    /// all than the same transfers from pageable memory.
    pub pays: bool,
    /// The fewest transfers for which registering pays; `None` when it never does (pageable
    /// transfers are as fast, or a figure is missing).
    pub break_even_transfers: Option<u64>,
    /// Registering plus unregistering the buffer, once.
    pub registration_cost: Duration,
    /// The bandwidth of one transfer from or to registered memory, GB/s.
    pub registered_gbps: f64,
    /// The bandwidth of the best pageable method, GB/s.
    pub pageable_gbps: f64,
    /// The best pageable method (`None` when nothing is known for the path).
    pub pageable_method: Option<TransferMethod>,
    /// The registration and `expected_transfers` registered transfers.
    pub total_registered: Duration,
    /// `expected_transfers` pageable transfers.
    pub total_pageable: Duration,
    /// Whether every figure was measured on this machine (not a default).
    pub calibrated: bool,
    /// The answer in words, with where each figure came from.
    pub reason: String,
}

/// A figure and where it came from, for the reason.
struct Figure<T> {
    value: T,
    source: &'static str,
    measured: bool,
}

/// The advice for `expected_transfers` transfers of `bytes` in `direction`, from `measured`
/// figures where they exist and `defaults` otherwise (see the module documentation for the
/// formula).
pub fn advise(
    direction: TransferDirection,
    bytes: usize,
    expected_transfers: u64,
    measured: &CalibrationTable,
    defaults: &CalibrationTable,
) -> RegistrationAdvice {
    let class = SizeClass::of(bytes);
    let cost = registration_cost(measured, defaults);
    let registered = registered_gbps(direction, class, measured, defaults);
    let pageable = pageable_best(direction, class, measured, defaults);
    let mut advice = RegistrationAdvice {
        direction,
        bytes,
        expected_transfers,
        pays: false,
        break_even_transfers: None,
        registration_cost: cost.value.duration(bytes),
        registered_gbps: registered.as_ref().map_or(0.0, |f| f.value),
        pageable_gbps: pageable.as_ref().map_or(0.0, |f| f.value.1),
        pageable_method: pageable.as_ref().map(|f| f.value.0),
        total_registered: Duration::ZERO,
        total_pageable: Duration::ZERO,
        calibrated: false,
        reason: String::new(),
    };
    let (Some(registered), Some(pageable)) = (registered, pageable) else {
        advice.reason = format!(
            "no bandwidth figures for {} transfers of {} ({class}): registration is not advised",
            if advice.registered_gbps == 0.0 {
                "registered"
            } else {
                "pageable"
            },
            mib(bytes),
        );
        return advice;
    };
    advice.calibrated = cost.measured && registered.measured && pageable.measured;
    let cost_s = cost.value.millis(bytes) / 1e3;
    let per_registered = seconds(bytes, registered.value);
    let per_pageable = seconds(bytes, pageable.value.1);
    let saving = per_pageable - per_registered;
    let k = expected_transfers as f64;
    advice.total_registered = duration(cost_s + k * per_registered);
    advice.total_pageable = duration(k * per_pageable);
    advice.break_even_transfers = (saving > 0.0).then(|| {
        // `as` saturates: a saving too small to matter gives u64::MAX, not a wrap.
        ((cost_s / saving).floor() as u64).saturating_add(1)
    });
    advice.pays = advice
        .break_even_transfers
        .is_some_and(|k| expected_transfers >= k);

    let reason = &mut advice.reason;
    let _ = write!(
        reason,
        "registering {} costs {:.2} ms ({}); a transfer takes {:.3} ms registered ({:.2} GB/s, {}) \
         against {:.3} ms pageable ({} {:.2} GB/s, {})",
        mib(bytes),
        cost_s * 1e3,
        cost.source,
        per_registered * 1e3,
        registered.value,
        registered.source,
        per_pageable * 1e3,
        pageable.value.0,
        pageable.value.1,
        pageable.source,
    );
    match advice.break_even_transfers {
        None => reason.push_str(": registered transfers are no faster, so it never pays"),
        Some(from) => {
            let _ = write!(
                reason,
                ", saving {:.3} ms each: it pays from {from} transfers, so for {expected_transfers} \
                 it {}",
                saving * 1e3,
                if advice.pays { "does" } else { "does not" },
            );
        }
    }
    advice
}

fn registration_cost(
    measured: &CalibrationTable,
    defaults: &CalibrationTable,
) -> Figure<RegistrationCost> {
    if let Some(value) = measured.registration {
        return Figure {
            value,
            source: "measured",
            measured: true,
        };
    }
    Figure {
        value: defaults
            .registration
            .unwrap_or(RegistrationCost::H100_DEFAULT),
        source: "H100 default",
        measured: false,
    }
}

/// The registered figure: measured on the registered path, else on the pinned path, else the
/// same from the defaults.
fn registered_gbps(
    direction: TransferDirection,
    class: SizeClass,
    measured: &CalibrationTable,
    defaults: &CalibrationTable,
) -> Option<Figure<f64>> {
    let sources = [
        (measured, direction.registered_path(), "measured", true),
        (measured, direction.pinned_path(), "measured pinned", true),
        (defaults, direction.registered_path(), "default", false),
        (defaults, direction.pinned_path(), "default pinned", false),
    ];
    sources
        .into_iter()
        .find_map(|(table, path, source, measured)| {
            table
                .gbps(path, class, TransferMethod::DirectCopy)
                .filter(|&g| g > 0.0)
                .map(|value| Figure {
                    value,
                    source,
                    measured,
                })
        })
}

/// The fastest method of the pageable path: measured, else from the defaults.
fn pageable_best(
    direction: TransferDirection,
    class: SizeClass,
    measured: &CalibrationTable,
    defaults: &CalibrationTable,
) -> Option<Figure<(TransferMethod, f64)>> {
    let path = direction.pageable_path();
    let methods = TransferMethod::candidates(path);
    [(measured, "measured", true), (defaults, "default", false)]
        .into_iter()
        .find_map(|(table, source, measured)| {
            table
                .best(path, class, methods)
                .filter(|&(_, g)| g > 0.0)
                .map(|value| Figure {
                    value,
                    source,
                    measured,
                })
        })
}

/// Seconds to move `bytes` at `gbps` (10^9 bytes per second).
fn seconds(bytes: usize, gbps: f64) -> f64 {
    bytes as f64 / (gbps * 1e9)
}

fn duration(seconds: f64) -> Duration {
    Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX)
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;
    use TransferDirection::{DeviceToHost, HostToDevice};
    use TransferMethod::{DirectCopy, HostStaged};

    const MIB: usize = 1 << 20;

    /// Pageable uploads at 25 GB/s (staged; direct 8), registered ones at 50 GB/s, downloads
    /// at 20 (staged) and 40 GB/s; registering costs 11 ms flat.
    fn measured() -> CalibrationTable {
        let mut t = CalibrationTable {
            registration: Some(RegistrationCost {
                fixed_ms: 11.0,
                ms_per_mib: 0.0,
            }),
            ..CalibrationTable::default()
        };
        for class in SizeClass::ALL {
            t.record(TransferPath::PAGEABLE_TO_DEVICE, class, HostStaged, 25.0);
            t.record(TransferPath::PAGEABLE_TO_DEVICE, class, DirectCopy, 8.0);
            t.record(TransferPath::REGISTERED_TO_DEVICE, class, DirectCopy, 50.0);
            t.record(TransferPath::DEVICE_TO_PAGEABLE, class, HostStaged, 20.0);
            t.record(TransferPath::DEVICE_TO_REGISTERED, class, DirectCopy, 40.0);
        }
        t
    }

    #[rstest]
    // 100 MB: 4 ms pageable, 2 ms registered, 2 ms saved per transfer; 11 ms / 2 ms = 5.5.
    #[case::one_transfer(1, false)]
    #[case::five(5, false)]
    #[case::at_break_even(6, true)]
    #[case::many(1000, true)]
    fn a_large_buffer_pays_from_the_break_even_count(#[case] transfers: u64, #[case] pays: bool) {
        let bytes = 100_000_000;
        let advice = advise(
            HostToDevice,
            bytes,
            transfers,
            &measured(),
            &CalibrationTable::h100_defaults(),
        );
        assert_eq!(advice.break_even_transfers, Some(6), "{}", advice.reason);
        assert_eq!(advice.pays, pays, "{}", advice.reason);
        assert_eq!(
            advice.pays,
            advice.total_registered < advice.total_pageable,
            "{advice:?}"
        );
        assert_eq!(
            (
                advice.registered_gbps,
                advice.pageable_gbps,
                advice.pageable_method
            ),
            (50.0, 25.0, Some(HostStaged))
        );
        assert_eq!(advice.registration_cost, Duration::from_millis(11));
        assert!(advice.calibrated);
        assert!(
            advice.reason.contains("pays from 6 transfers"),
            "{}",
            advice.reason
        );
    }

    #[test]
    fn downloads_use_their_own_figures() {
        // 100 MB: 5 ms pageable, 2.5 ms registered; 11 / 2.5 = 4.4.
        let advice = advise(
            DeviceToHost,
            100_000_000,
            5,
            &measured(),
            &CalibrationTable::default(),
        );
        assert_eq!(advice.break_even_transfers, Some(5));
        assert!(advice.pays);
        let advice = advise(
            DeviceToHost,
            100_000_000,
            4,
            &measured(),
            &CalibrationTable::default(),
        );
        assert!(!advice.pays);
    }

    #[test]
    fn it_never_pays_when_pageable_transfers_are_as_fast() {
        let mut table = measured();
        table.record(
            TransferPath::PAGEABLE_TO_DEVICE,
            SizeClass::Large,
            HostStaged,
            50.0,
        );
        let advice = advise(
            HostToDevice,
            64 * MIB,
            u64::MAX,
            &table,
            &CalibrationTable::default(),
        );
        assert_eq!((advice.pays, advice.break_even_transfers), (false, None));
        assert!(advice.reason.contains("never pays"), "{}", advice.reason);
        // Nothing to move never pays either, and asks for no division by zero.
        let advice = advise(HostToDevice, 0, 10, &table, &CalibrationTable::default());
        assert_eq!((advice.pays, advice.break_even_transfers), (false, None));
    }

    #[test]
    fn the_per_mib_cost_counts() {
        // 64 MiB at 10 ms + 0.1 ms/MiB = 16.4 ms; 2.684 - 1.342 ms saved: 12.2 -> 13.
        let mut table = measured();
        table.registration = Some(RegistrationCost {
            fixed_ms: 10.0,
            ms_per_mib: 0.1,
        });
        let advice = advise(
            HostToDevice,
            64 * MIB,
            13,
            &table,
            &CalibrationTable::default(),
        );
        assert_eq!(advice.break_even_transfers, Some(13), "{}", advice.reason);
        assert!(advice.pays);
        assert!(
            !advise(
                HostToDevice,
                64 * MIB,
                12,
                &table,
                &CalibrationTable::default()
            )
            .pays
        );
    }

    #[test]
    fn without_a_calibration_the_h100_defaults_decide() {
        // Pinned 52.82 GB/s against staged 42.45 GB/s at 64 MiB, 0.25 + 0.072 * 64 = 4.858 ms:
        // the saving of 0.310 ms a transfer repays it after 15.7 transfers.
        let advice = advise(
            HostToDevice,
            64 * MIB,
            1,
            &CalibrationTable::default(),
            &CalibrationTable::h100_defaults(),
        );
        assert_eq!(advice.break_even_transfers, Some(16), "{}", advice.reason);
        assert!(!advice.pays && !advice.calibrated);
        assert_eq!(
            (advice.registered_gbps, advice.pageable_gbps),
            (52.82, 42.45)
        );
        assert!(advice.reason.contains("H100 default"), "{}", advice.reason);
        assert!(
            advise(
                HostToDevice,
                64 * MIB,
                16,
                &CalibrationTable::default(),
                &CalibrationTable::h100_defaults()
            )
            .pays
        );
    }

    #[test]
    fn measured_pinned_figures_stand_in_for_unmeasured_registered_ones() {
        let mut table = CalibrationTable::default();
        table.record(
            TransferPath::PAGEABLE_TO_DEVICE,
            SizeClass::Large,
            HostStaged,
            25.0,
        );
        table.record(
            TransferPath::PINNED_TO_DEVICE,
            SizeClass::Large,
            DirectCopy,
            50.0,
        );
        let advice = advise(
            HostToDevice,
            64 * MIB,
            1,
            &table,
            &CalibrationTable::h100_defaults(),
        );
        assert_eq!(advice.registered_gbps, 50.0);
        assert!(
            advice.reason.contains("measured pinned"),
            "{}",
            advice.reason
        );
        // The cost was not measured, so the advice is not fully calibrated.
        assert!(!advice.calibrated);
        // No figures at all: no advice to register.
        let advice = advise(
            HostToDevice,
            64 * MIB,
            1000,
            &CalibrationTable::default(),
            &CalibrationTable::default(),
        );
        assert_eq!((advice.pays, advice.break_even_transfers), (false, None));
        assert!(
            advice.reason.contains("no bandwidth figures"),
            "{}",
            advice.reason
        );
    }
}
