//! The method choice: which [`TransferMethod`] moves a path's bytes, and why ([`Plan`]).
//!
//! Pure logic, no driver: [`choose`] takes what the devices can do ([`PathFacts`]) and the
//! bandwidth tables, so it is tested against given calibration tables on any machine.

use std::fmt;

use serde::Serialize;

use crate::calibration::{CalibrationTable, DEFAULT_MACHINE, Measure};
use crate::location::{Location, LocationKind, SizeClass, TransferPath};
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
    /// The fastest available method in the calibration in use (measured on this machine,
    /// unless [`Plan::measured_on`] names another).
    Calibrated {
        /// Its measured bandwidth, GB/s.
        gbps: f64,
        /// The runner-up's at the same size, if another method was measured there.
        runner_up: Option<f64>,
        /// The transfer size the figures were measured at (the nearest to this transfer's).
        at_bytes: usize,
    },
    /// The fastest available method in the defaults, measured on another machine (nothing
    /// was measured here for this path).
    Default {
        /// Its bandwidth in the defaults, GB/s.
        gbps: f64,
        /// The machine the defaults were measured on.
        machine: &'static str,
        /// The transfer size the figure was measured at.
        at_bytes: usize,
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
    /// For a [`PlanReason::Calibrated`] plan whose table came from another machine (loaded,
    /// with devices unlike this machine's): that machine. `None`: measured here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured_on: Option<String>,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} for {} ({}): ",
            self.method, self.path, self.size_class
        )?;
        match self.reason {
            PlanReason::Calibrated {
                gbps,
                runner_up,
                at_bytes,
            } => {
                match &self.measured_on {
                    None => write!(f, "measured here at {gbps:.1} GB/s")?,
                    Some(machine) => write!(
                        f,
                        "measured on {machine} (not this machine) at {gbps:.1} GB/s"
                    )?,
                }
                write!(f, " for {}", bytes_label(at_bytes))?;
                if let Some(other) = runner_up {
                    write!(f, " (next best {other:.1} GB/s)")?;
                }
            }
            PlanReason::Default {
                gbps,
                machine,
                at_bytes,
            } => write!(
                f,
                "default from {machine} ({gbps:.1} GB/s for {}; not measured here)",
                bytes_label(at_bytes)
            )?,
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

/// `bytes` as `64 KiB`, `4 MiB`, `1 GiB` (whole units where exact, else one decimal).
pub fn bytes_label(bytes: usize) -> String {
    let units = [(1usize << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in units {
        if bytes >= unit {
            return if bytes.is_multiple_of(unit) {
                format!("{} {name}", bytes / unit)
            } else {
                format!("{:.1} {name}", bytes as f64 / unit as f64)
            };
        }
    }
    format!("{bytes} B")
}

/// One transfer to plan: where from, where to, how many bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Query {
    /// The path.
    pub path: TransferPath,
    /// The calibration key: path, devices and size.
    pub measure: Measure,
}

impl Query {
    /// The transfer of `bytes` from `src` to `dst`.
    pub fn new(src: Location, dst: Location, bytes: usize) -> Self {
        let path = TransferPath::between(src, dst);
        Self {
            path,
            measure: Measure {
                path,
                src_device: src.device(),
                dst_device: dst.device(),
                bytes,
            },
        }
    }

    /// A transfer of `bytes` on `path` with no particular devices.
    pub fn any_device(path: TransferPath, bytes: usize) -> Self {
        Self {
            path,
            measure: Measure {
                path,
                src_device: None,
                dst_device: None,
                bytes,
            },
        }
    }
}

/// Chooses the method for `bytes` bytes on `path` (any devices), with `measured` taken as
/// this machine's: see [`choose_for`].
pub fn choose(
    path: TransferPath,
    bytes: usize,
    facts: &PathFacts,
    measured: &CalibrationTable,
    defaults: &CalibrationTable,
) -> Plan {
    choose_for(
        Query::any_device(path, bytes),
        facts,
        measured,
        None,
        defaults,
    )
}

/// Chooses the method for `query`: among the path's candidates that `facts` allow, the
/// fastest in `measured` at the measured size nearest the transfer's (for its devices; see
/// [`CalibrationTable::best_at`]), else the fastest in `defaults` likewise, else the first in
/// preference order. `foreign` names the machine `measured` came from when it is not this one.
pub fn choose_for(
    query: Query,
    facts: &PathFacts,
    measured: &CalibrationTable,
    foreign: Option<&str>,
    defaults: &CalibrationTable,
) -> Plan {
    let path = query.path;
    let bytes = query.measure.bytes;
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
    let plan = |method: TransferMethod,
                reason: PlanReason,
                skipped: Vec<Skipped>,
                measured_on: Option<String>| Plan {
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
        measured_on,
    };
    if available.len() == 1 {
        return plan(first, PlanReason::OnlyChoice, skipped, None);
    }
    if let Some((method, gbps, at_bytes)) = measured.best_at(query.measure, &available) {
        let at = Measure {
            bytes: at_bytes,
            ..query.measure
        };
        let runner_up = available
            .iter()
            .filter(|&&m| m != method)
            .filter_map(|&m| {
                measured
                    .best_at(at, &[m])
                    .filter(|&(_, _, b)| b == at_bytes)
                    .map(|(_, g, _)| g)
            })
            .fold(None, |acc: Option<f64>, g| {
                Some(acc.map_or(g, |a| a.max(g)))
            });
        let reason = PlanReason::Calibrated {
            gbps,
            runner_up,
            at_bytes,
        };
        return plan(method, reason, skipped, foreign.map(str::to_owned));
    }
    if let Some((method, gbps, at_bytes)) = defaults.best_at(query.measure, &available) {
        let reason = PlanReason::Default {
            gbps,
            machine: DEFAULT_MACHINE,
            at_bytes,
        };
        return plan(method, reason, skipped, None);
    }
    plan(first, PlanReason::Preference, skipped, None)
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
        measured_on: None,
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
    fn unmeasured_paths_fall_back_to_the_defaults_then_preference() {
        let measured = table(&[(
            TransferPath::PAGEABLE_TO_DEVICE,
            SizeClass::Large,
            DirectCopy,
            10.0,
        )]);
        // Measured path: only DirectCopy was measured, so it wins even if staging might not,
        // at every size (the nearest measured size decides).
        for bytes in [2 * MIB, 64 * MIB] {
            let plan = choose(
                TransferPath::PAGEABLE_TO_DEVICE,
                bytes,
                &ALL_FACTS,
                &measured,
                &CalibrationTable::h100_defaults(),
            );
            assert_eq!(plan.method, DirectCopy);
            assert!(plan.to_string().contains("measured here"), "{plan}");
        }
        // Unmeasured path: the defaults decide, and the plan names their machine.
        let plan = choose(
            TransferPath::DEVICE_TO_PAGEABLE,
            2 * MIB,
            &ALL_FACTS,
            &measured,
            &CalibrationTable::h100_defaults(),
        );
        assert!(matches!(plan.reason, PlanReason::Default { .. }), "{plan}");
        assert!(plan.to_string().contains(DEFAULT_MACHINE), "{plan}");
        assert!(plan.to_string().contains("not measured here"), "{plan}");
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

#[cfg(test)]
mod size_tests {
    use super::*;
    use crate::calibration::Measure;
    use TransferMethod::{DirectCopy, HostStaged, PeerToPeer};

    const MIB: usize = 1 << 20;
    const FACTS: PathFacts = PathFacts {
        map_host_memory: true,
        managed_prefetch: true,
        peer_access: true,
    };

    fn at(path: TransferPath, src: Option<usize>, dst: Option<usize>, bytes: usize) -> Measure {
        Measure {
            path,
            src_device: src,
            dst_device: dst,
            bytes,
        }
    }

    #[test]
    fn methods_are_compared_at_the_measured_size_nearest_the_transfer() {
        // Staging measured slower than the plain call at 4 MiB, faster at 16 MiB (the case the
        // issue found: a 4 MiB copy was planned staged from a 16 MiB figure).
        let h2d = TransferPath::PAGEABLE_TO_DEVICE;
        let mut table = CalibrationTable::default();
        table.record_at(at(h2d, None, Some(0), 4 * MIB), DirectCopy, 11.1);
        table.record_at(at(h2d, None, Some(0), 4 * MIB), HostStaged, 8.7);
        table.record_at(at(h2d, None, Some(0), 16 * MIB), DirectCopy, 12.8);
        table.record_at(at(h2d, None, Some(0), 16 * MIB), HostStaged, 20.3);
        let plan_at = |bytes: usize| {
            choose_for(
                Query::new(Location::PageableHost, Location::Device(0), bytes),
                &FACTS,
                &table,
                None,
                &CalibrationTable::default(),
            )
        };
        for bytes in [3 * MIB, 4 * MIB, 6 * MIB] {
            let plan = plan_at(bytes);
            assert_eq!(plan.method, DirectCopy, "{bytes}: {plan}");
            assert_eq!(
                plan.reason,
                PlanReason::Calibrated {
                    gbps: 11.1,
                    runner_up: Some(8.7),
                    at_bytes: 4 * MIB
                }
            );
        }
        for bytes in [12 * MIB, 16 * MIB, 64 * MIB] {
            assert_eq!(plan_at(bytes).method, HostStaged, "{bytes}");
        }
        assert!(plan_at(4 * MIB).to_string().contains("for 4 MiB"));
    }

    #[test]
    fn peer_figures_are_kept_per_ordered_pair() {
        let mut table = CalibrationTable::default();
        let peer = TransferPath::PEER;
        // 0 -> 1 has fast peer access; 1 -> 0 measured peer access slower than staging.
        table.record_at(at(peer, Some(0), Some(1), 64 * MIB), PeerToPeer, 390.0);
        table.record_at(at(peer, Some(0), Some(1), 64 * MIB), HostStaged, 25.0);
        table.record_at(at(peer, Some(1), Some(0), 64 * MIB), PeerToPeer, 10.0);
        table.record_at(at(peer, Some(1), Some(0), 64 * MIB), HostStaged, 25.0);
        let plan = |a: usize, b: usize| {
            choose_for(
                Query::new(Location::Device(a), Location::Device(b), 64 * MIB),
                &FACTS,
                &table,
                None,
                &CalibrationTable::h100_defaults(),
            )
        };
        assert_eq!(plan(0, 1).method, PeerToPeer);
        assert_eq!(plan(1, 0).method, HostStaged);
        // A pair never measured: no default either (none was measured for any pair), so the
        // preference order decides, and says so.
        let unmeasured = plan(2, 3);
        assert_eq!(
            (unmeasured.method, unmeasured.reason),
            (PeerToPeer, PlanReason::Preference)
        );
        let json = table.to_json();
        assert_eq!(CalibrationTable::from_json(&json).unwrap(), table);
    }

    #[test]
    fn host_figures_are_kept_per_device() {
        let mut table = CalibrationTable::default();
        let h2d = TransferPath::PAGEABLE_TO_DEVICE;
        table.record_at(at(h2d, None, Some(0), 64 * MIB), DirectCopy, 8.0);
        table.record_at(at(h2d, None, Some(0), 64 * MIB), HostStaged, 40.0);
        table.record_at(at(h2d, None, Some(1), 64 * MIB), DirectCopy, 12.0);
        table.record_at(at(h2d, None, Some(1), 64 * MIB), HostStaged, 6.0);
        let plan = |d: usize| {
            choose_for(
                Query::new(Location::PageableHost, Location::Device(d), 64 * MIB),
                &FACTS,
                &table,
                None,
                &CalibrationTable::default(),
            )
        };
        assert_eq!(plan(0).method, HostStaged);
        assert_eq!(plan(1).method, DirectCopy);
    }

    #[test]
    fn figures_from_another_machine_say_so() {
        let mut table = CalibrationTable::default();
        let h2d = TransferPath::PAGEABLE_TO_DEVICE;
        table.record_at(at(h2d, None, Some(0), MIB), DirectCopy, 8.0);
        table.record_at(at(h2d, None, Some(0), MIB), HostStaged, 9.0);
        let plan = choose_for(
            Query::new(Location::PageableHost, Location::Device(0), MIB),
            &FACTS,
            &table,
            Some("NVIDIA A100-SXM4-40GB"),
            &CalibrationTable::default(),
        );
        let text = plan.to_string();
        assert!(
            text.contains("measured on NVIDIA A100-SXM4-40GB (not this machine)"),
            "{text}"
        );
    }

    #[test]
    fn byte_labels() {
        assert_eq!(bytes_label(64 << 10), "64 KiB");
        assert_eq!(bytes_label(4 << 20), "4 MiB");
        assert_eq!(bytes_label(1 << 30), "1 GiB");
        assert_eq!(bytes_label(1536 << 10), "1.5 MiB");
        assert_eq!(bytes_label(100), "100 B");
    }
}
