//! GPU tests of `StreamProfiler`: GPU-timed operations, per-stream and combined reports with the
//! overlap of two streams, and a Chrome trace that shows it; and of the `GpuTimer` under it:
//! nothing timed on a capturing stream, and no span lost when another cannot be read.

use std::sync::Arc;
use std::time::Duration;

use cuweave_driver::EventPool;
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_stream::capture::CaptureOptions;
use cuweave_stream::{
    GpuTimer, OperationKind, PriorityStream, ProfileReport, StreamError, StreamPriority,
    StreamProfiler,
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

#[test]
fn a_launch_profiled_inside_a_capture_is_untimed_and_the_report_keeps_the_one_outside() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    profiler
        .profile(&stream, "outside", OperationKind::KernelLaunch, 0, |s| {
            s.launch(|d| kernels.spin_ns(d, 2 * MS))
        })
        .unwrap();
    let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
    profiler
        .profile(&stream, "inside", OperationKind::KernelLaunch, 0, |s| {
            s.launch(|d| kernels.spin_ns(d, 2 * MS))
        })
        .unwrap();
    assert_eq!(
        profiler.pending(),
        1,
        "nothing is timed on a capturing stream"
    );
    let graph = capture.finish().unwrap();

    // With the captured span pending, this failed with CUDA_ERROR_CAPTURED_EVENT after the
    // timer had let go of the outside span too.
    let report = profiler.report().unwrap();
    assert_eq!(report.combined.operations, 1, "{report}");
    assert_eq!(report.combined.kernel_launches, 1);
    let operations = profiler.operations().unwrap();
    let names: Vec<&str> = operations.iter().map(|op| op.name.as_str()).collect();
    assert_eq!(names, ["outside"]);
    assert!(operations[0].duration_ns >= 2 * MS, "{:?}", operations[0]);

    // The graph replays, and its launch is what gets profiled.
    let exec = graph.instantiate(&Default::default()).unwrap();
    profiler
        .profile(&stream, "replay", OperationKind::GraphLaunch, 0, |s| {
            s.launch_graph(&exec)
        })
        .unwrap();
    let report = profiler.report().unwrap();
    assert_eq!(report.combined.operations, 2);
    assert_eq!(report.combined.graph_launches, 1);
}

/// Three spans on `stream`, the middle one ended by a disable-timing event, so that its
/// duration cannot be read; returns the timer.
fn timer_with_an_unreadable_middle_span(
    gpu: &cuweave_test_support::Gpu,
    kernels: &TestKernels,
    stream: &PriorityStream,
) -> GpuTimer<&'static str> {
    let events = EventPool::for_context(&gpu.context).unwrap();
    let timer = GpuTimer::new(events.clone());
    for name in ["first", "broken", "last"] {
        let span = timer.start(stream.stream()).unwrap();
        assert!(span.is_some());
        kernels.spin_ns(stream.stream(), MS).unwrap();
        if name == "broken" {
            let end = Arc::new(events.acquire_owned(false).unwrap());
            end.record(stream.stream()).unwrap();
            timer.finish_with(span, end, name);
        } else {
            timer.finish(span, stream.stream(), name).unwrap();
        }
    }
    assert_eq!(timer.pending(), 3);
    timer
}

#[test]
fn a_span_that_cannot_be_read_costs_no_other_span() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();

    // Waiting for all of them: the spans after the broken one are still read.
    let timer = timer_with_an_unreadable_middle_span(&gpu, &kernels, &stream);
    let mut read = Vec::new();
    let error = timer
        .harvest_all(|name, time, _| read.push((name, time)))
        .unwrap_err();
    assert!(matches!(error, StreamError::Driver(_)), "{error}");
    let names: Vec<&str> = read.iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["first", "last"]);
    assert!(
        read.iter()
            .all(|(_, time)| *time >= Duration::from_millis(1))
    );
    assert_eq!(timer.pending(), 0);

    // Reading the finished ones: the broken span is dropped, not left to block the queue.
    let timer = timer_with_an_unreadable_middle_span(&gpu, &kernels, &stream);
    stream.synchronize().unwrap();
    let mut names = Vec::new();
    assert!(timer.harvest(|name, _, _| names.push(name)).is_err());
    assert_eq!(names, ["first", "last"]);
    assert_eq!(timer.pending(), 0);
    timer.harvest(|name, _, _| names.push(name)).unwrap();
    assert_eq!(names.len(), 2);
}

#[test]
fn harvesting_on_the_capturing_thread_is_refused_and_keeps_every_span() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let eager = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let captured = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let timer = GpuTimer::new(EventPool::for_context(&gpu.context).unwrap());
    for name in ["a", "b", "c"] {
        let span = timer.start(eager.stream()).unwrap();
        kernels.spin_ns(eager.stream(), MS).unwrap();
        timer.finish(span, eager.stream(), name).unwrap();
    }
    let capture = captured.begin_capture(CaptureOptions::default()).unwrap();
    assert!(
        timer.start(captured.stream()).unwrap().is_none(),
        "no span starts on a capturing stream"
    );
    let mut names = Vec::new();
    let error = timer
        .harvest_all(|name, _, _| names.push(name))
        .unwrap_err();
    assert!(error.is_capture_refusal(), "{error}");
    let error = timer.harvest(|name, _, _| names.push(name)).unwrap_err();
    assert!(error.is_capture_refusal(), "{error}");
    assert!(names.is_empty());
    assert_eq!(timer.pending(), 3, "the refused harvests dropped nothing");
    drop(capture.finish().unwrap());

    timer.harvest_all(|name, _, _| names.push(name)).unwrap();
    assert_eq!(names, ["a", "b", "c"]);
    assert_eq!(timer.pending(), 0);
}

#[test]
fn a_long_profiled_run_keeps_the_newest_operations_within_the_limit() {
    let gpu = cuweave_test_support::require_gpu!();
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let mut buffer = DeviceBuffer::<u32>::new(&gpu.context, 1024).unwrap();
    let profiler = StreamProfiler::with_limit(&gpu.context, 16).unwrap();
    for round in 0..500u32 {
        profiler
            .profile(
                &stream,
                format!("fill {round}"),
                OperationKind::Memset,
                4096,
                |s| s.fill(&mut buffer, round),
            )
            .unwrap();
        if round % 100 == 99 {
            // Reading the operations collects what finished, which is when the limit applies.
            assert!(profiler.operations().unwrap().len() <= 16);
        }
    }
    let kept = profiler.operations().unwrap();
    assert_eq!(kept.len(), 16);
    assert_eq!(profiler.evicted(), 500 - 16);
    // The newest sixteen, in GPU order.
    let names: Vec<String> = kept.iter().map(|op| op.name.clone()).collect();
    let expected: Vec<String> = (484..500).map(|round| format!("fill {round}")).collect();
    assert_eq!(names, expected);
    assert_eq!(profiler.report().unwrap().combined.operations, 16);
    assert_eq!(buffer.to_vec().unwrap(), vec![499; 1024]);
}
