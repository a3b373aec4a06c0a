//! Rendering a [`Report`] as text for people or as JSON for programs.

use std::fmt::Write as _;

use crate::info::{DeviceReport, Report, Status};

/// Bytes in a GiB, for the memory lines.
const GIB: f64 = (1u64 << 30) as f64;

/// Width of the label column in a device block.
const LABEL_WIDTH: usize = 27;

/// The report as pretty-printed JSON: `{"driver": …, "error": …, "devices": […], "nccl": …}`.
///
/// # Errors
/// Only if serialisation itself fails, which plain data like this does not do.
pub fn json(report: &Report) -> serde_json::Result<String> {
    serde_json::to_string_pretty(report)
}

/// The report as text: the driver version, the NCCL line, a block per device, and the peer
/// access matrix.
///
/// Without a usable driver this is the line that says why, e.g.
/// `no CUDA driver found: looked for libcuda.so.1, libcuda.so (…)`, then the NCCL line.
pub fn text(report: &Report) -> String {
    let mut out = String::new();
    if report.status == Status::NoGpu {
        if let Some(error) = &report.error {
            out.push_str(error);
            out.push('\n');
        }
        out.push_str(&report.nccl.line());
        return out;
    }
    // `fmt::Write` into a `String` cannot fail, so the results below are discarded.
    match &report.driver {
        Some(version) => {
            let _ = writeln!(out, "CUDA driver {version}");
        }
        None => out.push_str("CUDA driver (version unknown)\n"),
    }
    let _ = writeln!(out, "{}", report.nccl.line());
    match report.devices.len() {
        0 => out.push_str("no CUDA devices\n"),
        1 => out.push_str("1 device\n"),
        n => {
            let _ = writeln!(out, "{n} devices");
        }
    }
    for device in &report.devices {
        out.push('\n');
        device_block(&mut out, device);
    }
    if !report.devices.is_empty() {
        out.push('\n');
        peer_matrix(&mut out, &report.devices);
    }
    if let Some(error) = &report.error {
        let _ = write!(out, "\nerror: {error}\n");
    }
    // The caller adds the final newline.
    while out.ends_with('\n') {
        out.pop();
    }
    out
}

fn yes_no(flag: bool) -> &'static str {
    if flag { "yes" } else { "no" }
}

fn device_block(out: &mut String, device: &DeviceReport) {
    let caps = &device.capabilities;
    let priorities = &device.stream_priority_range;
    let _ = writeln!(out, "device {}: {}", device.ordinal, device.name);
    let rows: [(&str, String); 12] = [
        ("PCI bus id", device.pci_bus_id.clone()),
        ("compute capability", device.compute_capability.to_string()),
        (
            "memory",
            format!(
                "{:.2} GiB total, {:.2} GiB free",
                device.total_memory_bytes as f64 / GIB,
                device.free_memory_bytes as f64 / GIB
            ),
        ),
        ("multiprocessors (SMs)", caps.multiprocessors.to_string()),
        ("async copy engines", caps.async_engines.to_string()),
        ("managed memory", yes_no(caps.managed_memory).to_owned()),
        (
            "concurrent managed access",
            yes_no(caps.concurrent_managed_access).to_owned(),
        ),
        (
            "pageable memory access",
            yes_no(caps.pageable_memory_access).to_owned(),
        ),
        ("memory pools", yes_no(caps.memory_pools).to_owned()),
        (
            "unified addressing",
            yes_no(caps.unified_addressing).to_owned(),
        ),
        (
            "can map host memory",
            yes_no(caps.can_map_host_memory).to_owned(),
        ),
        (
            "stream priorities",
            format!(
                "{} (least) to {} (greatest)",
                priorities.least, priorities.greatest
            ),
        ),
    ];
    for (label, value) in rows {
        let _ = writeln!(out, "  {label:<LABEL_WIDTH$}{value}");
    }
}

/// `peer access: n/a (one device)`, or a matrix whose cell (row, column) says whether the row's
/// device can access the column's device memory directly.
fn peer_matrix(out: &mut String, devices: &[DeviceReport]) {
    if devices.len() < 2 {
        out.push_str("peer access: n/a (one device)\n");
        return;
    }
    let width = devices
        .iter()
        .map(|d| d.ordinal.to_string().len())
        .max()
        .unwrap_or(1)
        .max(3);
    out.push_str("peer access (can the row's device access the column's memory):\n");
    let _ = write!(out, "  {:>width$}", "");
    for column in devices {
        let _ = write!(out, "  {:>width$}", column.ordinal);
    }
    out.push('\n');
    for row in devices {
        let _ = write!(out, "  {:>width$}", row.ordinal);
        for column in devices {
            let cell = if row.ordinal == column.ordinal {
                "-"
            } else {
                match row.peer_access.iter().find(|p| p.peer == column.ordinal) {
                    Some(access) => yes_no(access.can_access),
                    None => "?",
                }
            };
            let _ = write!(out, "  {cell:>width$}");
        }
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use cuweave::driver::DriverError;
    use serde_json::{Value, json};

    use super::*;
    use crate::info::{
        Capabilities, ComputeCapability, DriverVersion, NcclReport, PeerAccess, StreamPriorityRange,
    };

    fn h100(ordinal: usize, peers: &[(usize, bool)]) -> DeviceReport {
        DeviceReport {
            ordinal,
            name: "NVIDIA H100 80GB HBM3".to_owned(),
            pci_bus_id: format!("0000:{:02X}:00.0", 0x1B + ordinal),
            compute_capability: ComputeCapability { major: 9, minor: 0 },
            total_memory_bytes: 80 << 30,
            free_memory_bytes: 79 << 30,
            capabilities: Capabilities {
                managed_memory: true,
                concurrent_managed_access: true,
                pageable_memory_access: false,
                memory_pools: true,
                unified_addressing: true,
                can_map_host_memory: true,
                async_engines: 3,
                multiprocessors: 132,
            },
            stream_priority_range: StreamPriorityRange {
                least: 0,
                greatest: -5,
            },
            peer_access: peers
                .iter()
                .map(|&(peer, can_access)| PeerAccess { peer, can_access })
                .collect(),
        }
    }

    fn report(devices: Vec<DeviceReport>) -> Report {
        Report {
            driver: Some(DriverVersion::from_raw(13000)),
            error: None,
            devices,
            nccl: NcclReport::found("2.28.9", "libnccl.so.2"),
            status: Status::Complete,
        }
    }

    fn no_driver() -> Report {
        let mut report = Report::unavailable(&DriverError::NotFound {
            searched: "libcuda.so.1, libcuda.so".to_owned(),
            reason: "libcuda.so: cannot open shared object file: No such file or directory"
                .to_owned(),
        });
        report.nccl = NcclReport::missing("no NCCL library found: tried libnccl.so.2 (gone)");
        report
    }

    #[test]
    fn text_shows_every_field_of_a_device() {
        let text = text(&report(vec![h100(0, &[])]));
        let expected = "\
CUDA driver 13.0 (13000)
NCCL 2.28.9 (libnccl.so.2)
1 device

device 0: NVIDIA H100 80GB HBM3
  PCI bus id                 0000:1B:00.0
  compute capability         9.0
  memory                     80.00 GiB total, 79.00 GiB free
  multiprocessors (SMs)      132
  async copy engines         3
  managed memory             yes
  concurrent managed access  yes
  pageable memory access     no
  memory pools               yes
  unified addressing         yes
  can map host memory        yes
  stream priorities          0 (least) to -5 (greatest)

peer access: n/a (one device)";
        assert_eq!(text, expected);
    }

    #[test]
    fn text_shows_peer_access_as_a_matrix() {
        let devices = vec![
            h100(0, &[(1, true), (2, false)]),
            h100(1, &[(0, true), (2, false)]),
            h100(2, &[(0, false), (1, false)]),
        ];
        let text = text(&report(devices));
        assert!(
            text.starts_with("CUDA driver 13.0 (13000)\nNCCL 2.28.9 (libnccl.so.2)\n3 devices\n")
        );
        let matrix = text
            .split_once("peer access (can the row's device access the column's memory):\n")
            .map(|(_, matrix)| matrix)
            .expect("a matrix heading");
        let expected = [
            "         0    1    2",
            "    0    -  yes   no",
            "    1  yes    -   no",
            "    2   no   no    -",
        ];
        assert_eq!(matrix.lines().collect::<Vec<_>>(), expected);
    }

    #[test]
    fn a_missing_peer_entry_shows_as_unknown() {
        let text = text(&report(vec![h100(0, &[]), h100(1, &[(0, true)])]));
        assert!(text.ends_with("    0    -    ?\n    1  yes    -"), "{text}");
    }

    #[test]
    fn text_without_a_driver_is_the_one_line_that_says_so() {
        assert_eq!(
            text(&no_driver()),
            "no CUDA driver found: looked for libcuda.so.1, libcuda.so \
             (libcuda.so: cannot open shared object file: No such file or directory)\n\
             NCCL: no NCCL library found: tried libnccl.so.2 (gone)"
        );
    }

    #[test]
    fn text_with_no_devices_and_with_errors() {
        assert_eq!(
            text(&report(Vec::new())),
            "CUDA driver 13.0 (13000)\nNCCL 2.28.9 (libnccl.so.2)\nno CUDA devices"
        );
        let mut failed = report(vec![h100(0, &[])]);
        failed.error = Some("device 1: cuDeviceGetAttribute failed".to_owned());
        failed.status = Status::Failed;
        assert!(
            text(&failed).ends_with("\n\nerror: device 1: cuDeviceGetAttribute failed"),
            "{}",
            text(&failed)
        );
    }

    #[test]
    fn json_without_a_driver_has_null_driver_and_no_devices() {
        let value: Value = serde_json::from_str(&json(&no_driver()).unwrap()).unwrap();
        assert_eq!(
            value,
            json!({
                "driver": null,
                "error": "no CUDA driver found: looked for libcuda.so.1, libcuda.so \
                          (libcuda.so: cannot open shared object file: No such file or directory)",
                "devices": [],
                "nccl": {
                    "version": null,
                    "library": null,
                    "error": "no NCCL library found: tried libnccl.so.2 (gone)",
                },
            })
        );
    }

    #[test]
    fn json_has_the_same_content_as_text() {
        let value: Value =
            serde_json::from_str(&json(&report(vec![h100(0, &[(1, true)])])).unwrap()).unwrap();
        assert_eq!(
            value,
            json!({
                "driver": { "version": 13000, "major": 13, "minor": 0 },
                "error": null,
                "devices": [{
                    "ordinal": 0,
                    "name": "NVIDIA H100 80GB HBM3",
                    "pci_bus_id": "0000:1B:00.0",
                    "compute_capability": { "major": 9, "minor": 0 },
                    "total_memory_bytes": 85_899_345_920u64,
                    "free_memory_bytes": 84_825_604_096u64,
                    "capabilities": {
                        "managed_memory": true,
                        "concurrent_managed_access": true,
                        "pageable_memory_access": false,
                        "memory_pools": true,
                        "unified_addressing": true,
                        "can_map_host_memory": true,
                        "async_engines": 3,
                        "multiprocessors": 132,
                    },
                    "stream_priority_range": { "least": 0, "greatest": -5 },
                    "peer_access": [{ "peer": 1, "can_access": true }],
                }],
                "nccl": { "version": "2.28.9", "library": "libnccl.so.2", "error": null },
            })
        );
    }
}
