//! The stream layer against the raw driver calls it replaces.
//!
//! | group | cuweave | raw |
//! |---|---|---|
//! | `stream_acquire` | `StreamPool::get_stream` (round robin; also load balanced, by priority, by workload): an atomic counter and an `Arc` clone, or event queries | `cuStreamCreate(NON_BLOCKING)` + `cuStreamDestroy_v2` |
//! | `wait_for` | `PriorityStream::wait_for`: a pooled event recorded on the other stream and waited on (no event created) | `cuEventCreate` + `cuEventRecord` + `cuStreamWaitEvent` + `cuEventDestroy_v2` |
//! | `callback_latency` | `PriorityStream::add_callback`: `cuLaunchHostFunc` whose driver-thread side hands the closure to the stream's worker thread | `cuLaunchHostFunc` with a plain C function |
//!
//! Callback latency is the host time from opening a GPU-side gate (a `wait_u32` kernel polling
//! mapped pinned memory, queued before the callback) to the user's code running: the GPU
//! noticing the gate, the driver reaching the host function, and (cuweave only) the hand-off to
//! the worker thread. Both sides pay the same gate, so the difference is cuweave's hand-off. The
//! p50/p99 lines come from 2000 samples each, the two kinds interleaved, taken before criterion's
//! own measurement.
//!
//! Run with `cargo bench -p cuweave-benches --bench stream`; without a driver it prints
//! `skipping benches: no CUDA driver` and exits 0.

use std::ffi::c_void;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use criterion::Criterion;
use cuweave_benches::{Gpu, median_per_iteration};
use cuweave_driver::memory::{HostAllocFlags, HostAllocation};
use cuweave_driver::{DriverApi, Stream, driver, sys};
use cuweave_stream::{
    AllocationStrategy, PriorityStream, StreamPool, StreamPoolConfig, StreamPriority, WorkloadType,
};
use cuweave_test_support::kernels::TestKernels;

fn main() {
    cuweave_benches::run("stream", |c, gpu| {
        acquire(c, gpu);
        wait_for(c, gpu);
        callback_latency(c, gpu);
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

fn raw_create_destroy(iters: u64) -> Duration {
    let api = api();
    let create = api.stream_create.get().expect("cuStreamCreate");
    let destroy = api.stream_destroy.get().expect("cuStreamDestroy_v2");
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0;
    let started = Instant::now();
    for _ in 0..iters {
        let mut stream = std::ptr::null_mut();
        // SAFETY: valid out-pointer and flags; the caller made the context current.
        check(unsafe { create(&mut stream, flags) }, "cuStreamCreate");
        // SAFETY: the stream was created just above, has no work, and is destroyed once.
        check(unsafe { destroy(black_box(stream)) }, "cuStreamDestroy_v2");
    }
    started.elapsed()
}

fn acquire(c: &mut Criterion, gpu: &Gpu) {
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).expect("StreamPool::new");
    let balanced = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced),
    )
    .expect("StreamPool::new");
    gpu.context.bind_to_thread().expect("bind the context");
    let round_robin = |iters: u64| {
        let started = Instant::now();
        for _ in 0..iters {
            black_box(pool.get_stream().expect("get_stream"));
        }
        started.elapsed()
    };
    let mut group = c.benchmark_group("stream_acquire");
    group.bench_function("cuweave/get_stream_round_robin", |b| {
        b.iter_custom(round_robin)
    });
    group.bench_function("cuweave/get_priority_stream_high", |b| {
        b.iter(|| {
            black_box(
                pool.get_priority_stream(StreamPriority::High)
                    .expect("priority"),
            )
        })
    });
    group.bench_function("cuweave/get_stream_for_workload_compute", |b| {
        b.iter(|| {
            black_box(
                pool.get_stream_for_workload(WorkloadType::Compute)
                    .expect("workload"),
            )
        })
    });
    group.bench_function("cuweave/get_stream_load_balanced", |b| {
        b.iter(|| black_box(balanced.get_stream().expect("load balanced")))
    });
    group.bench_function("raw/cuStreamCreate+cuStreamDestroy", |b| {
        b.iter_custom(raw_create_destroy)
    });
    group.finish();
    let acquire = median_per_iteration(21, 100_000, round_robin);
    let create = median_per_iteration(21, 200, raw_create_destroy);
    println!(
        "summary stream_acquire: get_stream {:.1} ns, cuStreamCreate+cuStreamDestroy {:.1} ns: {:.0}x faster (target <= 50 ns and >= 50x)",
        acquire.as_secs_f64() * 1e9,
        create.as_secs_f64() * 1e9,
        create.as_secs_f64() / acquire.as_secs_f64()
    );
}

fn wait_for(c: &mut Criterion, gpu: &Gpu) {
    let a = PriorityStream::new(&gpu.context, StreamPriority::Normal).expect("stream");
    let b = PriorityStream::new(&gpu.context, StreamPriority::Normal).expect("stream");
    let api = api();
    let create = api.event_create.get().expect("cuEventCreate");
    let record = api.event_record.get().expect("cuEventRecord");
    let wait = api.stream_wait_event.get().expect("cuStreamWaitEvent");
    let destroy = api.event_destroy.get().expect("cuEventDestroy_v2");
    let mut group = c.benchmark_group("wait_for");
    group.bench_function("cuweave/wait_for_pooled_event", |bench| {
        bench.iter(|| a.wait_for(&b).expect("wait_for"));
    });
    group.bench_function("raw/create+record+wait+destroy", |bench| {
        gpu.context.bind_to_thread().expect("bind the context");
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        bench.iter(|| {
            let mut event = std::ptr::null_mut();
            // SAFETY: valid out-pointer and flags; the context is current on this thread.
            check(unsafe { create(&mut event, flags) }, "cuEventCreate");
            // SAFETY: the event and both streams are live handles of the current context.
            check(unsafe { record(event, b.as_raw()) }, "cuEventRecord");
            // SAFETY: as above.
            check(unsafe { wait(a.as_raw(), event, 0) }, "cuStreamWaitEvent");
            // SAFETY: created above; the queued wait keeps what it needs after destruction.
            check(unsafe { destroy(event) }, "cuEventDestroy_v2");
        });
    });
    group.finish();
    a.synchronize().expect("synchronize");
    let counters = a.event_pool().counters();
    println!(
        "wait_for: the context's pool created {} regular events over the run",
        counters.created_regular
    );
}

/// Nanoseconds since the first call: one clock for the host and the callbacks.
fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64 + 1
}

/// Where the raw host function writes when it ran (0 = not yet).
static RAW_SLOT: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" fn raw_callback(_data: *mut c_void) {
    RAW_SLOT.store(now_ns(), Ordering::Release);
}

/// A GPU-side gate: a `wait_u32` kernel holding a stream until the host writes its value into
/// mapped pinned memory.
struct Gate {
    host: HostAllocation,
    device_ptr: u64,
    next: u32,
}

impl Gate {
    fn new(gpu: &Gpu) -> Self {
        let mut host = HostAllocation::new(&gpu.context, 4, HostAllocFlags::PORTABLE_MAPPED)
            .expect("mapped pinned memory");
        host.as_bytes_mut().fill(0);
        let device_ptr = host.device_ptr().expect("its device address");
        Self {
            host,
            device_ptr,
            next: 0,
        }
    }

    /// Queues a closed gate on `stream`; returns the value that opens it.
    fn close(&mut self, kernels: &TestKernels, stream: &Stream) -> u32 {
        self.next = self.next.wrapping_add(1).max(1);
        // SAFETY: `device_ptr` is the mapped address of `host`, one u32, alive until the gate
        // kernel ends; the host writes it only volatile (in `open`).
        unsafe { kernels.wait_u32(stream, self.device_ptr, self.next, 1_000_000_000) }
            .expect("queue the gate");
        self.next
    }

    fn open(&mut self, value: u32) {
        // SAFETY: the allocation holds at least 4 bytes and is page-aligned; the GPU only reads it.
        unsafe { self.host.as_mut_ptr().cast::<u32>().write_volatile(value) };
    }
}

/// One latency sample: gate, callback (queued by `queue`), open, wait until `slot` is written.
fn sample(
    gate: &mut Gate,
    kernels: &TestKernels,
    stream: &Stream,
    slot: &AtomicU64,
    queue: impl FnOnce(),
) -> Duration {
    slot.store(0, Ordering::Release);
    let value = gate.close(kernels, stream);
    queue();
    let opened = now_ns();
    gate.open(value);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ran = slot.load(Ordering::Acquire);
        if ran != 0 {
            return Duration::from_nanos(ran.saturating_sub(opened));
        }
        assert!(Instant::now() < deadline, "the callback never ran");
        std::hint::spin_loop();
    }
}

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.50), at(0.99))
}

fn callback_latency(c: &mut Criterion, gpu: &Gpu) {
    let kernels = TestKernels::load(&gpu.context).expect("test kernels");
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).expect("stream");
    let mut gate = Gate::new(gpu);
    let slot = Arc::new(AtomicU64::new(0));
    let launch = api().launch_host_func.get().expect("cuLaunchHostFunc");

    let cuweave_sample = |gate: &mut Gate| {
        let slot2 = Arc::clone(&slot);
        sample(gate, &kernels, stream.stream(), &slot, || {
            stream
                .add_callback(move || slot2.store(now_ns(), Ordering::Release))
                .expect("add_callback")
        })
    };
    let raw_sample = |gate: &mut Gate| {
        sample(gate, &kernels, stream.stream(), &RAW_SLOT, || {
            // SAFETY: `raw_callback` matches CUhostFn, ignores its data pointer, and calls no CUDA.
            check(
                unsafe { launch(stream.as_raw(), Some(raw_callback), std::ptr::null_mut()) },
                "cuLaunchHostFunc",
            )
        })
    };

    const SAMPLES: usize = 2000;
    // Interleaved, so drift in the driver's or the machine's state hits both sides alike.
    let (mut cuweave, mut raw) = (Vec::with_capacity(SAMPLES), Vec::with_capacity(SAMPLES));
    for _ in 0..SAMPLES {
        cuweave.push(cuweave_sample(&mut gate));
        raw.push(raw_sample(&mut gate));
    }
    let ((c50, c99), (r50, r99)) = (percentiles(cuweave), percentiles(raw));
    println!(
        "summary callback_latency ({SAMPLES} samples each, gate open to user code running): cuweave add_callback p50 {:.1} us p99 {:.1} us; raw cuLaunchHostFunc p50 {:.1} us p99 {:.1} us",
        c50.as_secs_f64() * 1e6,
        c99.as_secs_f64() * 1e6,
        r50.as_secs_f64() * 1e6,
        r99.as_secs_f64() * 1e6
    );

    let mut group = c.benchmark_group("callback_latency");
    group.bench_function("cuweave/add_callback", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| cuweave_sample(&mut gate)).sum())
    });
    group.bench_function("raw/cuLaunchHostFunc", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| raw_sample(&mut gate)).sum())
    });
    group.finish();
    stream.synchronize().expect("drain the stream");
}
