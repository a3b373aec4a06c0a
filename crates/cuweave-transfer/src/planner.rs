//! The method choice: which [`TransferMethod`] moves a path's bytes, and why ([`Plan`]).
//!
//! Pure logic, no driver: [`choose`] takes what the devices can do ([`PathFacts`]) and the
//! bandwidth tables, so it is tested against given calibration tables on any machine.

use std::fmt;

use serde::Serialize;

use crate::calibration::CalibrationTable;
use crate::location::{LocationKind, SizeClass, TransferPath};
use crate::method::TransferMethod;

/// What the devices on a path can do, as far as the method choice cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct PathFacts {
    /// The device can map pinned host memory into its address space and has unified
    /// addressing (needed by `ZeroCopy`).
    pub map_host_memory: bool,
    /// The unified side's device supports concurrent managed access, so managed memory can be
    /// prefetched (needed by `UnifiedMemory`).
    pub managed_prefetch: bool,
    /// The destination device can access the source device's memory directly (needed by
    /// `PeerToPeer`).
    pub peer_access: bool,
}

impl PathFacts {
    /// Why `method` cannot run on a path with these facts, or `None` when it can.
    pub fn missing(&self, method: TransferMethod) -> Option<&'static str> {
        match method {
            TransferMethod::ZeroCopy if !self.map_host_memory => {
                Some("the device cannot map pinned host memory (or lacks unified addressing)")
            }
            TransferMethod::UnifiedMemory if !self.managed_prefetch => {
                Some("the device cannot prefetch managed memory (no concurrent managed access)")
            }
            TransferMethod::PeerToPeer if !self.peer_access => {
                Some("the devices cannot access each other's memory (cuDeviceCanAccessPeer = 0)")
            }
            _ => None,
        }
    }
}

/// Why a [`Plan`] chose its method.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PlanReason {
    /// The fastest available method in this machine's calibration.
    Calibrated {
        /// Its measured bandwidth, GB/s.
        gbps: f64,
        /// The runner-up's, if another method was measured.
        runner_up: Option<f64>,
    },
    /// The fastest available method in the H100 defaults (nothing measured here for this
    /// path and size class).
    Default {
        /// Its bandwidth in the defaults, GB/s.
        gbps: f64,
    },
    /// The only method this path has (or the only one the devices can do).
    OnlyChoice,
    /// Nothing measured and no default: the first available in the preference order.
    Preference,
    /// The caller asked for this method.
    Requested,
}

/// A method that was passed over because the devices cannot do it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// The method.
    pub method: TransferMethod,
    /// What the devices lack.
    pub why: &'static str,
}

/// The method chosen for a transfer, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The path.
    pub path: TransferPath,
    /// The transfer's size class.
    pub size_class: SizeClass,
    /// The method that will run.
    pub method: TransferMethod,
    /// Why it was chosen.
    pub reason: PlanReason,
    /// Better-ranked methods the devices cannot do, in order.
    pub skipped: Vec<Skipped>,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} for {} ({}): ",
            self.method, self.path, self.size_class
        )?;
        match self.reason {
            PlanReason::Calibrated { gbps, runner_up } => {
                write!(f, "measured here at {gbps:.1} GB/s")?;
                if let Some(other) = runner_up {
                    write!(f, " (next best {other:.1} GB/s)")?;
                }
            }
            PlanReason::Default { gbps } => write!(f, "H100 default {gbps:.1} GB/s")?,
            PlanReason::OnlyChoice => {
                f.write_str("the only method for this path")?;
                if self.path.involves(LocationKind::Registered) {
                    f.write_str(
                        " (registered host memory is page-locked: the copy engine moves it \
                         directly at pinned speed; it is not mapped, so no ZeroCopy)",
                    )?;
                }
            }
            PlanReason::Preference => f.write_str("first available method (nothing measured)")?,
            PlanReason::Requested => f.write_str("requested")?,
        }
        for skipped in &self.skipped {
            write!(f, "; skipped {}: {}", skipped.method, skipped.why)?;
        }
        Ok(())
    }
}

/// Chooses the method for `bytes` bytes on `path`: among the path's candidates that `facts`
/// allow, the fastest in `measured` for the size class, else the fastest in `defaults`, else
/// the first in preference order.
pub fn choose(
    path: TransferPath,
    bytes: usize,
    facts: &PathFacts,
    measured: &CalibrationTable,
    defaults: &CalibrationTable,
) -> Plan {
    let size_class = SizeClass::of(bytes);
    let mut available = Vec::new();
    let mut skipped = Vec::new();
    for &method in TransferMethod::candidates(path) {
        match facts.missing(method) {
            Some(why) => skipped.push(Skipped { method, why }),
            None => available.push(method),
        }
    }
    // DirectCopy is a candidate of every path and needs nothing, so `available` is never empty.
    let first = available[0];
    let plan = |method: TransferMethod, reason: PlanReason, skipped: Vec<Skipped>| Plan {
        path,
        size_class,
        method,
        reason,
        skipped: skipped
            .into_iter()
            .filter(|s: &Skipped| {
                TransferMethod::candidates(path)
                    .iter()
                    .position(|&m| m == s.method)
                    < TransferMethod::candidates(path)
                        .iter()
                        .position(|&m| m == method)
            })
            .collect(),
    };
    if available.len() == 1 {
        return plan(first, PlanReason::OnlyChoice, skipped);
    }
    if let Some((method, gbps)) = measured.best(path, size_class, &available) {
        let runner_up = available
            .iter()
            .filter(|&&m| m != method)
            .filter_map(|&m| measured.gbps(path, size_class, m))
            .fold(None, |acc: Option<f64>, g| {
                Some(acc.map_or(g, |a| a.max(g)))
            });
        return plan(method, PlanReason::Calibrated { gbps, runner_up }, skipped);
    }
    if let Some((method, gbps)) = defaults.best(path, size_class, &available) {
        return plan(method, PlanReason::Default { gbps }, skipped);
    }
    plan(first, PlanReason::Preference, skipped)
}

/// The plan for a method the caller asked for, or why it cannot run on `path`.
pub fn require(
    path: TransferPath,
    bytes: usize,
    facts: &PathFacts,
    method: TransferMethod,
) -> Result<Plan, String> {
    if let Some(why) = method.not_served_because(path) {
        return Err(why.to_owned());
    }
    if !TransferMethod::candidates(path).contains(&method) {
        return Err(format!(
            "{method} does not serve this path (its methods: {})",
            TransferMethod::candidates(path)
                .iter()
                .map(|m| m.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if let Some(why) = facts.missing(method) {
        return Err(why.to_owned());
    }
    Ok(Plan {
        path,
        size_class: SizeClass::of(bytes),
        method,
        reason: PlanReason::Requested,
        skipped: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;
    use TransferMethod::*;

    const ALL_FACTS: PathFacts = PathFacts {
        map_host_memory: true,
        managed_prefetch: true,
        peer_access: true,
    };
    const MIB: usize = 1 << 20;

    fn table(rows: &[(TransferPath, SizeClass, TransferMethod, f64)]) -> CalibrationTable {
        let mut t = CalibrationTable::default();
        for &(p, c, m, g) in rows {
            t.record(p, c, m, g);
        }
        t
    }

    #[rstest]
    // Measured: the faster method wins, per size class.
    #[case::staged_wins_large(TransferPath::PAGEABLE_TO_DEVICE, 256 * MIB, HostStaged)]
    #[case::direct_wins_tiny(TransferPath::PAGEABLE_TO_DEVICE, 4096, DirectCopy)]
    #[case::d2h_staged(TransferPath::DEVICE_TO_PAGEABLE, 64 * MIB, HostStaged)]
    #[case::zero_copy_measured_faster(TransferPath::PINNED_TO_DEVICE, MIB, ZeroCopy)]
    #[case::peer(TransferPath::PEER, 64 * MIB, PeerToPeer)]
    fn the_fastest_measured_method_is_chosen(
        #[case] path: TransferPath,
        #[case] bytes: usize,
        #[case] expected: TransferMethod,
    ) {
        let measured = table(&[
            (
                TransferPath::PAGEABLE_TO_DEVICE,
                SizeClass::Large,
                DirectCopy,
                10.0,
            ),
            (
                TransferPath::PAGEABLE_TO_DEVICE,
                SizeClass::Large,
                HostStaged,
                31.0,
            ),
            (
                TransferPath::PAGEABLE_TO_DEVICE,
                SizeClass::Tiny,
                DirectCopy,
                5.0,
            ),
            (
                TransferPath::PAGEABLE_TO_DEVICE,
                SizeClass::Tiny,
                HostStaged,
                1.0,
            ),
            (
                TransferPath::DEVICE_TO_PAGEABLE,
                SizeClass::Large,
                DirectCopy,
                8.0,
            ),
            (
                TransferPath::DEVICE_TO_PAGEABLE,
                SizeClass::Large,
                HostStaged,
                29.0,
            ),
            (
                TransferPath::PINNED_TO_DEVICE,
                SizeClass::Small,
                DirectCopy,
                40.0,
            ),
            (
                TransferPath::PINNED_TO_DEVICE,
                SizeClass::Small,
                ZeroCopy,
                41.0,
            ),
            (TransferPath::PEER, SizeClass::Large, PeerToPeer, 390.0),
            (TransferPath::PEER, SizeClass::Large, HostStaged, 25.0),
        ]);
        let plan = choose(
            path,
            bytes,
            &ALL_FACTS,
            &measured,
            &CalibrationTable::default(),
        );
        assert_eq!(plan.method, expected, "{plan}");
        assert!(
            matches!(plan.reason, PlanReason::Calibrated { .. }),
            "{plan}"
        );
    }

    #[test]
    fn a_method_the_device_cannot_do_is_skipped_for_the_next_real_one() {
        let measured = table(&[
            (TransferPath::PEER, SizeClass::Large, PeerToPeer, 390.0),
            (TransferPath::PEER, SizeClass::Large, HostStaged, 25.0),
            (TransferPath::PEER, SizeClass::Large, DirectCopy, 20.0),
        ]);
        let facts = PathFacts {
            peer_access: false,
            ..ALL_FACTS
        };
        let plan = choose(
            TransferPath::PEER,
            64 * MIB,
            &facts,
            &measured,
            &CalibrationTable::default(),
        );
        assert_eq!(plan.method, HostStaged);
        assert_eq!(plan.skipped.len(), 1);
        assert_eq!(plan.skipped[0].method, PeerToPeer);
        assert!(plan.to_string().contains("skipped PeerToPeer"), "{plan}");
    }

    #[test]
    fn without_zero_copy_pinned_paths_have_one_choice() {
        let facts = PathFacts {
            map_host_memory: false,
            ..ALL_FACTS
        };
        let plan = choose(
            TransferPath::DEVICE_TO_PINNED,
            MIB,
            &facts,
            &CalibrationTable::default(),
            &CalibrationTable::h100_defaults(),
        );
        assert_eq!(plan.method, DirectCopy);
        assert_eq!(plan.reason, PlanReason::OnlyChoice);
    }

    #[test]
    fn unmeasured_classes_fall_back_to_the_defaults_then_preference() {
        let measured = table(&[(
            TransferPath::PAGEABLE_TO_DEVICE,
            SizeClass::Large,
            DirectCopy,
            10.0,
        )]);
        // Measured class: only DirectCopy was measured, so it wins even if staging might not.
        let plan = choose(
            TransferPath::PAGEABLE_TO_DEVICE,
            64 * MIB,
            &ALL_FACTS,
            &measured,
            &CalibrationTable::h100_defaults(),
        );
        assert_eq!(plan.method, DirectCopy);
        // Unmeasured class: the defaults decide.
        let plan = choose(
            TransferPath::PAGEABLE_TO_DEVICE,
            2 * MIB,
            &ALL_FACTS,
            &measured,
            &CalibrationTable::h100_defaults(),
        );
        assert!(matches!(plan.reason, PlanReason::Default { .. }), "{plan}");
        // Neither: the preference order.
        let plan = choose(
            TransferPath::local(LocationKind::Pageable, LocationKind::Unified),
            MIB,
            &ALL_FACTS,
            &measured,
            &CalibrationTable::h100_defaults(),
        );
        assert_eq!(
            (plan.method, plan.reason),
            (UnifiedMemory, PlanReason::Preference)
        );
    }

    #[rstest]
    #[case::tiny(4096, HostStaged)]
    #[case::medium(16 * MIB, HostStaged)]
    #[case::large(256 * MIB, HostStaged)]
    #[case::huge(1024 * MIB, HostStaged)]
    fn the_h100_defaults_stage_pageable_copies(
        #[case] bytes: usize,
        #[case] expected: TransferMethod,
    ) {
        let defaults = CalibrationTable::h100_defaults();
        for path in [
            TransferPath::PAGEABLE_TO_DEVICE,
            TransferPath::DEVICE_TO_PAGEABLE,
        ] {
            let plan = choose(
                path,
                bytes,
                &ALL_FACTS,
                &CalibrationTable::default(),
                &defaults,
            );
            assert_eq!(plan.method, expected, "{plan}");
        }
    }

    #[test]
    fn requested_methods_are_checked_against_the_path_and_the_devices() {
        assert!(require(TransferPath::DEVICE_TO_DEVICE, 1, &ALL_FACTS, HostStaged).is_err());
        let no_peer = PathFacts {
            peer_access: false,
            ..ALL_FACTS
        };
        let error = require(TransferPath::PEER, 1, &no_peer, PeerToPeer).unwrap_err();
        assert!(error.contains("cuDeviceCanAccessPeer"), "{error}");
        let plan = require(TransferPath::PEER, 1, &ALL_FACTS, PeerToPeer).unwrap();
        assert_eq!(plan.reason, PlanReason::Requested);
    }

    #[test]
    fn registered_paths_copy_directly_and_the_plan_says_why() {
        for path in [
            TransferPath::REGISTERED_TO_DEVICE,
            TransferPath::DEVICE_TO_REGISTERED,
            TransferPath::local(LocationKind::Registered, LocationKind::Pageable),
            TransferPath {
                src: LocationKind::Registered,
                dst: LocationKind::Device,
                cross_device: true,
            },
        ] {
            let plan = choose(
                path,
                64 * MIB,
                &ALL_FACTS,
                &CalibrationTable::default(),
                &CalibrationTable::h100_defaults(),
            );
            assert_eq!(
                (plan.method, plan.reason),
                (DirectCopy, PlanReason::OnlyChoice)
            );
            assert!(plan.to_string().contains("page-locked"), "{plan}");
        }
        let error =
            require(TransferPath::REGISTERED_TO_DEVICE, 1, &ALL_FACTS, ZeroCopy).unwrap_err();
        assert!(error.contains("CU_MEMHOSTREGISTER_DEVICEMAP"), "{error}");
        let error = require(
            TransferPath::DEVICE_TO_REGISTERED,
            1,
            &ALL_FACTS,
            HostStaged,
        )
        .unwrap_err();
        assert!(error.contains("already page-locked"), "{error}");
        let error = require(
            TransferPath::DEVICE_TO_REGISTERED,
            1,
            &ALL_FACTS,
            PeerToPeer,
        )
        .unwrap_err();
        assert!(error.contains("does not serve this path"), "{error}");
        assert!(
            require(
                TransferPath::REGISTERED_TO_DEVICE,
                1,
                &ALL_FACTS,
                DirectCopy
            )
            .is_ok()
        );
    }

    #[test]
    fn calibration_tables_round_trip_through_json_files() {
        let dir = std::env::temp_dir().join(format!("cuweave-cal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("cal.json");
        let t = CalibrationTable::h100_defaults();
        t.save(&file).unwrap();
        assert_eq!(CalibrationTable::load(&file).unwrap(), t);
        std::fs::write(&file, "{ not json").unwrap();
        assert!(matches!(
            CalibrationTable::load(&file),
            Err(crate::TransferError::CalibrationFile { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
