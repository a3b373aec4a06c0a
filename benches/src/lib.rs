//! Shared setup for cuweave's criterion benchmarks: the GPU gate, one criterion configuration,
//! and GPU-side timing.
//!
//! Every bench binary (`benches/benches/*.rs`, `harness = false`) starts with [`run`]. On a
//! machine without a CUDA driver it prints [`SKIP_LINE`] and returns before registering any
//! benchmark, so `cargo bench` succeeds (quickly) everywhere; on a GPU it prints which device and
//! driver the figures come from and hands a [`Gpu`] (device 0 and its primary context) and a
//! [`Criterion`] configured by [`criterion()`] to the benches.
//!
//! The whole suite is sized to finish in about two minutes on one GPU: short warm-up and
//! measurement times, and few samples for the operations that take milliseconds.
//!
//! ```no_run
//! use criterion::Criterion;
//! use cuweave_benches::Gpu;
//!
//! fn benches(c: &mut Criterion, gpu: &Gpu) {
//!     c.bench_function("context_bind", |b| b.iter(|| gpu.context.bind_to_thread().unwrap()));
//! }
//!
//! fn main() {
//!     cuweave_benches::run("example", benches);
//! }
//! ```
#![forbid(unsafe_code)]

use std::time::Duration;

use criterion::Criterion;
use cuweave_driver::{Event, EventFlags, Stream};

pub use cuweave_test_support::Gpu;

/// What a bench binary prints, and all it does, on a machine with no usable CUDA driver.
pub const SKIP_LINE: &str = "skipping benches: no CUDA driver";

/// One mebibyte.
pub const MIB: usize = 1 << 20;

/// Device 0 and its primary context, or `None` after printing [`SKIP_LINE`] when no driver loads.
///
/// The driver check comes first and never panics, so a bench binary stays harmless on a machine
/// without CUDA even when `CUWEAVE_REQUIRE_GPU=1` is set (as the GPU bundle's `run` script does).
/// A driver that loads but has no usable device 0 goes through the test-support gate, which
/// skips, or fails under `CUWEAVE_REQUIRE_GPU=1`.
pub fn gpu_or_skip(bench: &str) -> Option<Gpu> {
    if !cuweave_driver::is_available() {
        println!("{SKIP_LINE}");
        return None;
    }
    let gpu = cuweave_test_support::gpu(bench);
    if gpu.is_none() {
        println!("{SKIP_LINE}");
    }
    gpu
}

/// The criterion configuration every cuweave bench starts from; command-line arguments
/// (`--bench`, filters, `--sample-size`, ...) still override it.
///
/// Half a second of warm-up and one second of measurement over 50 samples: the operations timed
/// here are microsecond-scale driver calls, whose estimates settle well within that. Groups that
/// time millisecond-scale work lower the sample count themselves ([`slow_group`]).
pub fn criterion() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(1))
        .sample_size(50)
        .without_plots()
        .configure_from_args()
}

/// Configures `group` for operations that take milliseconds each (pinning, 256 MiB copies,
/// managed-memory migration): 10 flat samples within `measurement`, 300 ms of warm-up.
pub fn slow_group<M: criterion::measurement::Measurement>(
    group: &mut criterion::BenchmarkGroup<'_, M>,
    measurement: Duration,
) {
    group
        .sample_size(10)
        .sampling_mode(criterion::SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(measurement);
}

/// Runs a bench binary: the GPU gate ([`gpu_or_skip`]), a header naming the device and driver,
/// then `benches` with a [`criterion()`] and the [`Gpu`], then criterion's final summary.
///
/// Returns without registering anything (after printing [`SKIP_LINE`]) when there is no driver.
pub fn run(bench: &str, benches: impl FnOnce(&mut Criterion, &Gpu)) {
    let Some(gpu) = gpu_or_skip(bench) else {
        return;
    };
    println!("{}", header(bench, &gpu));
    let mut criterion = criterion();
    benches(&mut criterion, &gpu);
    criterion.final_summary();
}

/// One line naming the bench binary, the device, its compute capability and the driver version.
pub fn header(bench: &str, gpu: &Gpu) -> String {
    let name = gpu
        .device
        .name()
        .unwrap_or_else(|error| format!("device 0 ({error})"));
    let capability = gpu
        .device
        .compute_capability()
        .map(|cc| cc.to_string())
        .unwrap_or_else(|_| "?".to_owned());
    let driver = cuweave_driver::driver_version()
        .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
        .unwrap_or_else(|_| "?".to_owned());
    format!("cuweave bench `{bench}`: {name} (sm {capability}), CUDA driver {driver}")
}

/// A pair of timing events that measures device time between two points in a stream.
///
/// Criterion's `iter_custom` takes the sum of what [`GpuTimer::time`] returns, so untimed setup
/// (prefetching pages away, zeroing an output) can run between the timed regions.
#[derive(Debug)]
pub struct GpuTimer {
    start: Event,
    stop: Event,
}

impl GpuTimer {
    /// Two timing events in `gpu`'s context.
    ///
    /// # Panics
    /// When the driver cannot create an event (a broken GPU setup is a failed bench).
    pub fn new(gpu: &Gpu) -> Self {
        let event = || Event::new(&gpu.context, EventFlags::TIMING).expect("create a timing event");
        Self {
            start: event(),
            stop: event(),
        }
    }

    /// The device time from just before to just after the work `enqueue` puts on `stream`:
    /// records the start event, calls `enqueue`, records the stop event and waits for it.
    ///
    /// # Panics
    /// When recording, waiting on or reading the events fails.
    pub fn time(&self, stream: &Stream, enqueue: impl FnOnce()) -> Duration {
        self.start.record(stream).expect("record the start event");
        enqueue();
        self.stop.record(stream).expect("record the stop event");
        self.stop.synchronize().expect("wait for the stop event");
        let ms = self
            .start
            .elapsed_ms(&self.stop)
            .expect("read the elapsed time");
        Duration::from_secs_f64(f64::from(ms) / 1e3)
    }
}

/// The median over `batches` runs of `batch(iters)` of the time per iteration: a quick second
/// measurement for one-line summaries after criterion's report (which keeps its estimates to
/// itself). `batch` runs `iters` iterations and returns how long they took, as criterion's
/// `iter_custom` routines do, so the same closures serve both.
///
/// # Panics
/// When `batches` or `iters` is zero.
pub fn median_per_iteration(
    batches: usize,
    iters: u64,
    mut batch: impl FnMut(u64) -> Duration,
) -> Duration {
    assert!(
        batches > 0 && iters > 0,
        "need at least one batch of one iteration"
    );
    let mut times: Vec<Duration> = (0..batches)
        .map(|_| Duration::from_secs_f64(batch(iters).as_secs_f64() / iters as f64))
        .collect();
    times.sort();
    times[times.len() / 2]
}

/// Whether criterion runs in its measuring mode (`--bench`, as `cargo bench` and the GPU
/// bundle's `run --bench` pass), not as a quick `cargo test --benches` smoke run.
pub fn measuring() -> bool {
    std::env::args().any(|arg| arg == "--bench")
}
