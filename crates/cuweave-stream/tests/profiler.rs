//! GPU tests of `StreamProfiler`: GPU-timed operations, per-stream and combined reports with the
//! overlap of two streams, and a Chrome trace that shows it.

use std::sync::Arc;

use cuweave_memory::DeviceBuffer;
use cuweave_stream::{
    OperationKind, PriorityStream, ProfileReport, StreamPriority, StreamProfiler,
};
use cuweave_test_support::kernels::TestKernels;

const MS: u64 = 1_000_000;

#[test]
fn reports_and_the_chrome_trace_show_two_streams_overlapping() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let high = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::High).unwrap());
    let low = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap());
    let mut buffer = DeviceBuffer::<u32>::new(&gpu.context, 1 << 20).unwrap();
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    profiler
        .profile(&low, "spin", OperationKind::KernelLaunch, 0, |s| {
            s.launch(|d| kernels.spin_ns(d, 30 * MS))
        })
        .unwrap();
    profiler
        .profile(&high, "spin", OperationKind::KernelLaunch, 0, |s| {
            s.launch(|d| kernels.spin_ns(d, 30 * MS))
        })
        .unwrap();
    profiler
        .profile(&high, "clear", OperationKind::Memset, 4 << 20, |s| {
            s.fill(&mut buffer, 0)
        })
        .unwrap();
    let report = profiler.report().unwrap();
    println!("{report}");
    assert_eq!(report.streams.len(), 2);
    assert_eq!(report.combined.operations, 3);
    assert_eq!(report.combined.kernel_launches, 2);
    assert_eq!(report.combined.bytes, 4 << 20);
    for stream in &report.streams {
        assert!(stream.gpu_time_ns >= 29 * MS, "{stream:?}");
    }
    assert!(
        report.combined.overlap_ns >= 20 * MS,
        "{:?}",
        report.combined
    );
    assert!(report.combined.busy_ns < report.combined.gpu_time_ns);
    let json = serde_json::to_string(&report).unwrap();
    assert_eq!(
        serde_json::from_str::<ProfileReport>(&json).unwrap(),
        report
    );

    let trace: serde_json::Value = serde_json::from_str(&profiler.chrome_trace().unwrap()).unwrap();
    let spins: Vec<(f64, f64, u64)> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["name"] == "spin")
        .map(|e| {
            (
                e["ts"].as_f64().unwrap(),
                e["dur"].as_f64().unwrap(),
                e["tid"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(spins.len(), 2);
    assert_ne!(spins[0].2, spins[1].2, "on two tracks");
    let overlap_us =
        (spins[0].0 + spins[0].1).min(spins[1].0 + spins[1].1) - spins[0].0.max(spins[1].0);
    assert!(
        overlap_us >= 20_000.0,
        "the trace shows {overlap_us} µs of overlap"
    );
}
