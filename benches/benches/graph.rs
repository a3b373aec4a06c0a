//! CUDA graphs through cuweave against the raw driver calls, in one run.
//!
//! | group | cuweave | raw |
//! |---|---|---|
//! | `graph_100_kernels` | one `PriorityStream::launch_graph` of a captured 100-kernel graph + sync; 100 `Kernel::launch` + one sync | 100 `cuLaunchKernel` + `cuStreamSynchronize`; `cuGraphLaunch` + `cuStreamSynchronize` |
//! | `graph_launch_host` | `GraphExec::launch` (host time only, synchronised every 32 launches outside the timing), of the noop graph and of a graph that fills a tracked `DeviceBuffer` (one fence per launch), alone and after an eager fill of the buffer on another stream | `cuGraphLaunch` |
//! | `graph_first_launch` | launch + sync of a fresh executable after `GraphExec::upload`, and without it; steady state | — |
//! | `graph_pool` | 1 MiB allocate + free from a capture's private pool during the capture; the same from the general cache with no capture | — |
//!
//! The kernels are `noop` (one thread, no memory): what is measured is launch overhead.
//! Summary lines after criterion's report (under `--bench`) re-measure the ratios the issue's
//! targets name. Run with `cargo bench -p cuweave-benches --bench graph`; without a driver it
//! prints `skipping benches: no CUDA driver` and exits 0.

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::Criterion;
use cuweave_benches::{Gpu, measuring, median_per_iteration};
use cuweave_driver::{
    DriverApi, Graph, GraphExec, InstantiateOptions, Kernel, KernelArgs, LaunchConfig, Stream,
    StreamFlags, driver, sys,
};
use cuweave_memory::buffer::{Buffer, DeviceBuffer};
use cuweave_memory::caching::CachingAllocator;
use cuweave_stream::capture::{CaptureOptions, StreamCapture};
use cuweave_stream::{PriorityStream, StreamPriority};
use cuweave_test_support::event_kernels::EventKernels;

const KERNELS: usize = 100;

fn main() {
    cuweave_benches::run("graph", |c, gpu| {
        let setup = Setup::new(gpu);
        hundred_kernels(c, &setup);
        launch_host(c, &setup);
        first_launch(c, &setup);
        pool(c, &setup);
        if measuring() {
            summary(&setup);
        }
    });
}

fn api() -> &'static DriverApi {
    driver().expect("the CUDA driver loaded a moment ago")
}

fn check(code: sys::CUresult, operation: &'static str) {
    if let Err(error) = api().check(code, operation) {
        panic!("{error}");
    }
}

struct Setup {
    stream: PriorityStream,
    noop: Kernel,
    graph: Graph,
    exec: GraphExec,
    raw_exec: sys::CUgraphExec,
    allocator: CachingAllocator,
    /// A graph that fills `tracked_buffer` (a tracked capture: its launches leave fences).
    tracked: GraphExec,
    tracked_buffer: Mutex<DeviceBuffer<u32>>,
    /// Where eager fills of `tracked_buffer` run, for launches that wait for them.
    other: Stream,
    _kernels: EventKernels,
}

impl Setup {
    fn new(gpu: &Gpu) -> Self {
        let kernels = EventKernels::load(&gpu.context).expect("load the event kernels");
        let noop = kernels.module().function("noop").expect("noop");
        let stream =
            PriorityStream::new(&gpu.context, StreamPriority::Normal).expect("create a stream");
        let capture =
            StreamCapture::begin(&stream, CaptureOptions::default()).expect("begin capture");
        for _ in 0..KERNELS {
            launch_noop(&noop, &stream);
        }
        let graph = capture.finish().expect("end capture");
        let exec = graph
            .instantiate(&InstantiateOptions::default())
            .expect("instantiate");
        let raw_exec = {
            let mut raw = std::ptr::null_mut();
            let mut params = sys::CUDA_GRAPH_INSTANTIATE_PARAMS::default();
            let instantiate = api()
                .graph_instantiate_with_params
                .get()
                .expect("cuGraphInstantiateWithParams");
            // SAFETY: a live graph of the current context; valid out-pointers.
            check(
                unsafe { instantiate(&mut raw, graph.as_raw(), &mut params) },
                "cuGraphInstantiateWithParams",
            );
            raw
        };
        exec.upload(&stream).expect("upload");
        let mut tracked_buffer = DeviceBuffer::<u32>::new(&gpu.context, 1024).expect("buffer");
        let capture =
            StreamCapture::begin(&stream, CaptureOptions::default()).expect("begin capture");
        tracked_buffer
            .fill_async(1, &stream)
            .expect("captured fill");
        let tracked = capture
            .finish()
            .expect("end capture")
            .instantiate(&InstantiateOptions::default())
            .expect("instantiate");
        tracked.upload(&stream).expect("upload");
        stream.synchronize().expect("sync");
        let other = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("stream");
        Self {
            stream,
            noop,
            graph,
            exec,
            raw_exec,
            allocator: CachingAllocator::with_driver(&gpu.context),
            tracked,
            tracked_buffer: Mutex::new(tracked_buffer),
            other,
            _kernels: kernels,
        }
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let destroy = api().graph_exec_destroy.get().expect("cuGraphExecDestroy");
        // SAFETY: instantiated in `new`, destroyed once; the stream is idle.
        check(unsafe { destroy(self.raw_exec) }, "cuGraphExecDestroy");
    }
}

fn launch_noop(noop: &Kernel, stream: &Stream) {
    // SAFETY: noop() takes no arguments and touches no memory.
    unsafe { noop.launch(stream, LaunchConfig::single(), &KernelArgs::new()) }.expect("launch");
}

fn raw_sync(stream: &Stream) {
    let sync = api().stream_synchronize.get().expect("cuStreamSynchronize");
    // SAFETY: a live stream.
    check(unsafe { sync(stream.as_raw()) }, "cuStreamSynchronize");
}

fn raw_graph_launch(exec: sys::CUgraphExec, stream: &Stream) {
    let launch = api().graph_launch.get().expect("cuGraphLaunch");
    // SAFETY: a live executable and stream of the current context.
    check(unsafe { launch(exec, stream.as_raw()) }, "cuGraphLaunch");
}

fn cuweave_launches(setup: &Setup, iters: u64) -> Duration {
    let started = Instant::now();
    for _ in 0..iters {
        for _ in 0..KERNELS {
            launch_noop(&setup.noop, &setup.stream);
        }
        setup.stream.synchronize().expect("sync");
    }
    started.elapsed()
}

fn raw_launches(setup: &Setup, iters: u64) -> Duration {
    let launch = api().launch_kernel.get().expect("cuLaunchKernel");
    let function = setup.noop.as_raw();
    let stream = setup.stream.as_raw();
    let started = Instant::now();
    for _ in 0..iters {
        for _ in 0..KERNELS {
            // SAFETY: noop takes no arguments; a live stream of the current context.
            check(
                unsafe {
                    launch(
                        function,
                        1,
                        1,
                        1,
                        1,
                        1,
                        1,
                        0,
                        stream,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    )
                },
                "cuLaunchKernel",
            );
        }
        raw_sync(&setup.stream);
    }
    started.elapsed()
}

fn cuweave_graph(setup: &Setup, iters: u64) -> Duration {
    let started = Instant::now();
    for _ in 0..iters {
        setup
            .stream
            .launch_graph(&setup.exec)
            .expect("launch_graph");
        setup.stream.synchronize().expect("sync");
    }
    started.elapsed()
}

fn raw_graph(setup: &Setup, iters: u64) -> Duration {
    let started = Instant::now();
    for _ in 0..iters {
        raw_graph_launch(setup.raw_exec, &setup.stream);
        raw_sync(&setup.stream);
    }
    started.elapsed()
}

fn hundred_kernels(c: &mut Criterion, setup: &Setup) {
    let mut group = c.benchmark_group("graph_100_kernels");
    group.bench_function("cuweave/launch_graph+sync", |b| {
        b.iter_custom(|iters| cuweave_graph(setup, iters))
    });
    group.bench_function("cuweave/100_launches+sync", |b| {
        b.iter_custom(|iters| cuweave_launches(setup, iters))
    });
    group.bench_function("raw/cuGraphLaunch+sync", |b| {
        b.iter_custom(|iters| raw_graph(setup, iters))
    });
    group.bench_function("raw/100_cuLaunchKernel+sync", |b| {
        b.iter_custom(|iters| raw_launches(setup, iters))
    });
    group.finish();
}

/// Host time of `iters` runs of `run`, in batches of 32 with `settle` (a synchronisation)
/// after each batch, outside the timing.
fn timed_batches(iters: u64, mut run: impl FnMut(), settle: impl Fn()) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let batch = left.min(32);
        let started = Instant::now();
        for _ in 0..batch {
            run();
        }
        total += started.elapsed();
        settle();
        left -= batch;
    }
    total
}

/// Host time of `iters` launches, synchronising every 32 outside the timing.
fn host_launches(setup: &Setup, iters: u64, launch: impl Fn()) -> Duration {
    timed_batches(iters, launch, || setup.stream.synchronize().expect("sync"))
}

fn cuweave_launch_host(setup: &Setup, iters: u64) -> Duration {
    host_launches(setup, iters, || {
        setup.exec.launch(&setup.stream).expect("launch")
    })
}

fn tracked_launch_host(setup: &Setup, iters: u64) -> Duration {
    host_launches(setup, iters, || {
        setup.tracked.launch(&setup.stream).expect("launch")
    })
}

/// An eager fill of the tracked buffer on the other stream.
fn fill_tracked(setup: &Setup) {
    setup
        .tracked_buffer
        .lock()
        .expect("not poisoned")
        .fill_async(2, &setup.other)
        .expect("eager fill");
}

/// Host time of `iters` rounds of an eager fill of the tracked buffer on another stream (which
/// leaves a fence) and a launch of its graph (which waits for it); the fill is timed too.
fn tracked_after_eager_host(setup: &Setup, iters: u64) -> Duration {
    timed_batches(
        iters,
        || {
            fill_tracked(setup);
            setup.tracked.launch(&setup.stream).expect("launch");
        },
        || {
            setup.stream.synchronize().expect("sync");
            setup.other.synchronize().expect("sync");
        },
    )
}

/// Host time of `iters` eager fills of the tracked buffer on the other stream alone.
fn eager_fill_host(setup: &Setup, iters: u64) -> Duration {
    timed_batches(
        iters,
        || fill_tracked(setup),
        || setup.other.synchronize().expect("sync"),
    )
}

fn raw_launch_host(setup: &Setup, iters: u64) -> Duration {
    host_launches(setup, iters, || {
        raw_graph_launch(setup.raw_exec, &setup.stream)
    })
}

fn launch_host(c: &mut Criterion, setup: &Setup) {
    let mut group = c.benchmark_group("graph_launch_host");
    group.bench_function("cuweave/GraphExec::launch", |b| {
        b.iter_custom(|iters| cuweave_launch_host(setup, iters))
    });
    group.bench_function("cuweave/GraphExec::launch (tracked buffer)", |b| {
        b.iter_custom(|iters| tracked_launch_host(setup, iters))
    });
    group.bench_function("cuweave/eager fill + tracked launch", |b| {
        b.iter_custom(|iters| tracked_after_eager_host(setup, iters))
    });
    group.bench_function("raw/cuGraphLaunch", |b| {
        b.iter_custom(|iters| raw_launch_host(setup, iters))
    });
    group.finish();
}

/// Launch + sync of a freshly instantiated executable, after `upload` or not (instantiation
/// and upload are not timed).
fn first_launches(setup: &Setup, iters: u64, upload: bool) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let exec = setup
            .graph
            .instantiate(&InstantiateOptions::default())
            .expect("instantiate");
        if upload {
            exec.upload(&setup.stream).expect("upload");
        }
        setup.stream.synchronize().expect("sync");
        let started = Instant::now();
        exec.launch(&setup.stream).expect("launch");
        setup.stream.synchronize().expect("sync");
        total += started.elapsed();
    }
    total
}

fn steady_launches(setup: &Setup, iters: u64) -> Duration {
    let started = Instant::now();
    for _ in 0..iters {
        setup.exec.launch(&setup.stream).expect("launch");
        setup.stream.synchronize().expect("sync");
    }
    started.elapsed()
}

fn first_launch(c: &mut Criterion, setup: &Setup) {
    let mut group = c.benchmark_group("graph_first_launch");
    group.sample_size(20);
    group.bench_function("cuweave/after_upload", |b| {
        b.iter_custom(|iters| first_launches(setup, iters, true))
    });
    group.bench_function("cuweave/without_upload", |b| {
        b.iter_custom(|iters| first_launches(setup, iters, false))
    });
    group.bench_function("cuweave/steady_state", |b| {
        b.iter_custom(|iters| steady_launches(setup, iters))
    });
    group.finish();
}

/// `iters` 1 MiB allocate + free pairs on the setup stream, after one that may miss.
fn hits(setup: &Setup, iters: u64) -> Duration {
    drop(
        setup
            .allocator
            .allocate(1 << 20, &setup.stream)
            .expect("warm"),
    );
    let started = Instant::now();
    for _ in 0..iters {
        drop(black_box(
            setup
                .allocator
                .allocate(1 << 20, &setup.stream)
                .expect("allocate"),
        ));
    }
    started.elapsed()
}

/// [`hits`] while the setup stream captures into a private pool (the warm-up miss fills it).
fn pool_hits(setup: &Setup, iters: u64) -> Duration {
    let capture =
        StreamCapture::begin(&setup.stream, CaptureOptions::default()).expect("begin capture");
    let elapsed = hits(setup, iters);
    drop(capture.finish().expect("end capture"));
    elapsed
}

fn pool(c: &mut Criterion, setup: &Setup) {
    let mut group = c.benchmark_group("graph_pool");
    group.bench_function("cuweave/private_pool_hit_during_capture", |b| {
        b.iter_custom(|iters| pool_hits(setup, iters))
    });
    group.bench_function("cuweave/general_cache_hit_no_capture", |b| {
        b.iter_custom(|iters| hits(setup, iters))
    });
    group.finish();
}

fn us(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

fn summary(setup: &Setup) {
    let graph = median_per_iteration(11, 200, |n| cuweave_graph(setup, n));
    let launches = median_per_iteration(11, 50, |n| cuweave_launches(setup, n));
    let raw_graph_sync = median_per_iteration(11, 200, |n| raw_graph(setup, n));
    let raw_kernels = median_per_iteration(11, 50, |n| raw_launches(setup, n));
    println!(
        "summary graph_100_kernels: cuweave graph launch+sync {:.1} us, 100 cuweave launches+sync {:.1} us: {:.2}x (target >= 3.5x); raw cuGraphLaunch+sync {:.1} us (cuweave/raw {:.3}, target <= 1.1); raw 100 cuLaunchKernel+sync {:.1} us",
        us(graph),
        us(launches),
        launches.as_secs_f64() / graph.as_secs_f64(),
        us(raw_graph_sync),
        graph.as_secs_f64() / raw_graph_sync.as_secs_f64(),
        us(raw_kernels),
    );
    let host = median_per_iteration(11, 320, |n| cuweave_launch_host(setup, n));
    let raw_host = median_per_iteration(11, 320, |n| raw_launch_host(setup, n));
    println!(
        "summary graph_launch_host: GraphExec::launch {:.2} us (target <= 2 us), raw cuGraphLaunch {:.2} us",
        us(host),
        us(raw_host)
    );
    // A graph of a tracked buffer: its launch records a fence; after an eager fill of the
    // buffer on another stream, the fill records one too and the launch waits for it.
    let tracked = median_per_iteration(11, 320, |n| tracked_launch_host(setup, n));
    let fill = median_per_iteration(11, 320, |n| eager_fill_host(setup, n));
    let both = median_per_iteration(11, 320, |n| tracked_after_eager_host(setup, n));
    println!(
        "summary graph_tracked_launch: GraphExec::launch of a tracked graph {:.2} us; eager fill on another stream {:.2} us; fill + launch ordered after it {:.2} us (the ordering costs {:.2} us over fill + launch)",
        us(tracked),
        us(fill),
        us(both),
        us(both) - us(fill) - us(tracked)
    );
    let uploaded = median_per_iteration(11, 5, |n| first_launches(setup, n, true));
    let cold = median_per_iteration(11, 5, |n| first_launches(setup, n, false));
    let steady = median_per_iteration(11, 200, |n| steady_launches(setup, n));
    println!(
        "summary graph_first_launch: after upload {:.1} us, without upload {:.1} us, steady {:.1} us: after-upload/steady {:.3} (target <= 1.1)",
        us(uploaded),
        us(cold),
        us(steady),
        uploaded.as_secs_f64() / steady.as_secs_f64()
    );
    let hit = median_per_iteration(11, 20_000, |n| pool_hits(setup, n));
    let eager = median_per_iteration(11, 20_000, |n| hits(setup, n));
    println!(
        "summary graph_pool: 1 MiB private-pool hit during capture {:.1} ns (target <= 200 ns), general-cache hit without capture {:.1} ns",
        hit.as_secs_f64() * 1e9,
        eager.as_secs_f64() * 1e9
    );
}
