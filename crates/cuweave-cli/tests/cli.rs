//! The built `cuweave` binary, run as a user would: `info` and `info --json` exit 0 and report
//! what this machine has, a missing driver in plain words included.

use std::path::PathBuf;
use std::process::{Command, Output};

use cuweave::driver::{self, Device, DriverError, loader::LIBRARY_CANDIDATES};
use cuweave_test_support::require_gpu;
use serde_json::Value;

/// The `cuweave` binary: beside this test in a `cargo xtask gpu-test` bundle (`bin/` next to
/// `tests/`), where cargo's build path does not exist, else the one cargo built for this test.
fn cuweave_binary() -> PathBuf {
    let exe = format!("cuweave{}", std::env::consts::EXE_SUFFIX);
    let bundled = std::env::current_exe()
        .ok()
        .and_then(|test| Some(test.parent()?.parent()?.join("bin").join(&exe)))
        .filter(|path| path.is_file());
    bundled.unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_cuweave")))
}

fn run(args: &[&str]) -> Output {
    let binary = cuweave_binary();
    Command::new(&binary)
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("running {}: {error}", binary.display()))
}

fn stdout_of(args: &[&str]) -> String {
    let output = run(args);
    assert!(
        output.status.success(),
        "cuweave {} exited with {}; stderr:\n{}",
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

/// What this process sees of the driver, which the binary must see the same way.
enum DriverState {
    NotFound,
    Unusable(DriverError),
    Usable { devices: usize },
}

fn driver_state() -> DriverState {
    match driver::driver() {
        Err(error) if error.is_not_found() => DriverState::NotFound,
        Err(error) => DriverState::Unusable(error),
        Ok(_) => DriverState::Usable {
            devices: Device::count().expect("device count after a successful cuInit"),
        },
    }
}

#[test]
fn info_exits_zero_and_reports_the_driver_or_its_absence() {
    let text = stdout_of(&["info"]);
    match driver_state() {
        DriverState::NotFound => {
            let expected = format!(
                "no CUDA driver found: looked for {} (",
                LIBRARY_CANDIDATES.join(", ")
            );
            assert!(text.starts_with(&expected), "{text}");
            // The driver's line, then NCCL's.
            assert_eq!(text.lines().count(), 2, "{text}");
            assert!(
                text.lines().nth(1).is_some_and(|l| l.starts_with("NCCL")),
                "{text}"
            );
        }
        DriverState::Unusable(error) => {
            assert_eq!(
                text.trim_end(),
                format!("CUDA driver found but not usable: {error}")
            );
        }
        DriverState::Usable { devices } => {
            let version = driver::driver_version().expect("driver version");
            assert!(
                text.starts_with(&format!(
                    "CUDA driver {}.{} ({version})\n",
                    version / 1000,
                    version % 1000 / 10
                )),
                "{text}"
            );
            for ordinal in 0..devices {
                assert!(text.contains(&format!("\ndevice {ordinal}: ")), "{text}");
            }
            if devices == 1 {
                assert!(text.contains("peer access: n/a (one device)"), "{text}");
            }
            assert!(!text.contains("error:"), "{text}");
        }
    }
}

#[test]
fn info_json_has_the_same_content_for_programs() {
    let value: Value =
        serde_json::from_str(&stdout_of(&["info", "--json"])).expect("info --json prints JSON");
    let object = value.as_object().expect("a JSON object");
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["devices", "driver", "error", "nccl"]);
    let nccl = &value["nccl"];
    assert!(
        nccl["version"].is_string() != nccl["error"].is_string(),
        "either a version or why none: {nccl}"
    );
    match driver_state() {
        DriverState::NotFound => {
            assert_eq!(value["driver"], Value::Null);
            assert_eq!(value["devices"], serde_json::json!([]));
            let error = value["error"].as_str().expect("an error message");
            assert!(
                error.starts_with("no CUDA driver found: looked for "),
                "{error}"
            );
        }
        DriverState::Unusable(_) => {
            assert_eq!(value["driver"], Value::Null);
            assert_eq!(value["devices"], serde_json::json!([]));
            assert!(value["error"].is_string());
        }
        DriverState::Usable { devices } => {
            let version = driver::driver_version().expect("driver version");
            assert_eq!(value["driver"]["version"], version);
            assert_eq!(value["error"], Value::Null);
            let reported = value["devices"].as_array().expect("a device list");
            assert_eq!(reported.len(), devices);
            for (ordinal, device) in reported.iter().enumerate() {
                assert_eq!(device["ordinal"], ordinal);
                assert_eq!(
                    device["peer_access"].as_array().map(Vec::len),
                    Some(devices - 1)
                );
                for capability in [
                    "managed_memory",
                    "concurrent_managed_access",
                    "pageable_memory_access",
                    "memory_pools",
                    "unified_addressing",
                    "can_map_host_memory",
                ] {
                    assert!(device["capabilities"][capability].is_boolean(), "{device}");
                }
            }
        }
    }
}

#[test]
fn info_json_matches_what_the_driver_says_about_device_zero() {
    let gpu = require_gpu!();
    let value: Value = serde_json::from_str(&stdout_of(&["info", "--json"])).expect("JSON");
    let reported = &value["devices"][0];
    let device = gpu.device;
    assert_eq!(reported["name"], device.name().unwrap());
    assert_eq!(reported["pci_bus_id"], device.pci_bus_id().unwrap());
    let cc = device.compute_capability().unwrap();
    assert_eq!(reported["compute_capability"]["major"], cc.major);
    assert_eq!(reported["compute_capability"]["minor"], cc.minor);
    let total = device.total_memory().unwrap() as u64;
    assert_eq!(reported["total_memory_bytes"], total);
    let free = reported["free_memory_bytes"].as_u64().expect("free bytes");
    assert!(free > 0 && free <= total, "free {free} of {total}");
    let caps = device.capabilities().unwrap();
    let reported_caps = &reported["capabilities"];
    assert_eq!(reported_caps["managed_memory"], caps.managed_memory);
    assert_eq!(
        reported_caps["concurrent_managed_access"],
        caps.concurrent_managed_access
    );
    assert_eq!(reported_caps["memory_pools"], caps.memory_pools_supported);
    assert_eq!(reported_caps["async_engines"], caps.async_engine_count);
    assert_eq!(reported_caps["multiprocessors"], caps.multiprocessor_count);
    let range = gpu.context.stream_priority_range().unwrap();
    assert_eq!(reported["stream_priority_range"]["least"], range.least);
    assert_eq!(
        reported["stream_priority_range"]["greatest"],
        range.greatest
    );
}

#[test]
fn usage_errors_exit_non_zero_and_version_exits_zero() {
    let missing = run(&[]);
    assert!(!missing.status.success());
    let unknown = run(&["frobnicate"]);
    assert_eq!(unknown.status.code(), Some(2));
    let version = stdout_of(&["--version"]);
    assert_eq!(
        version.trim_end(),
        format!("cuweave {}", env!("CARGO_PKG_VERSION"))
    );
}
