//! Every test kernel on a real GPU: each does what its launcher's docs promise.
//!
//! Each test takes [`serial`]: several check timing or cross-stream concurrency, which other
//! tests' work on the same GPU would disturb.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuweave_driver::memory::{self, DeviceAllocation, HostAllocFlags, HostAllocation};
use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

const MS: u64 = 1_000_000;

fn setup(context: &Arc<Context>) -> (TestKernels, Stream) {
    let kernels = TestKernels::load(context).expect("load test kernels");
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream");
    (kernels, stream)
}

fn alloc<T>(context: &Arc<Context>, n: usize) -> DeviceAllocation {
    DeviceAllocation::new(context, n * size_of::<T>()).expect("device allocation")
}

fn upload<T: Copy>(context: &Context, dst: &DeviceAllocation, values: &[T]) {
    assert!(size_of_val(values) <= dst.len());
    // SAFETY: `values` is readable for its byte size, which fits in `dst`.
    unsafe {
        memory::copy_htod(
            context,
            dst.ptr(),
            values.as_ptr().cast(),
            size_of_val(values),
        )
        .expect("copy to device");
    }
}

fn download<T: Copy + Default>(context: &Context, src: &DeviceAllocation, n: usize) -> Vec<T> {
    let mut values = vec![T::default(); n];
    assert!(size_of_val(values.as_slice()) <= src.len());
    // SAFETY: `values` is writable for its byte size, which fits in `src`; the caller
    // synchronized the stream that wrote `src`.
    unsafe {
        memory::copy_dtoh(
            context,
            values.as_mut_ptr().cast(),
            src.ptr(),
            size_of_val(values.as_slice()),
        )
        .expect("copy to host");
    }
    values
}

#[test]
fn fill_increment_and_checksum_agree() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let (kernels, stream) = setup(ctx);
    // More elements than one grid of `for_elements` threads, so the grid-stride loops matter.
    let n = 20_000_000;
    let data = alloc::<u32>(ctx, n);
    let sum = alloc::<u64>(ctx, 1);
    upload(ctx, &sum, &[0u64]);
    // SAFETY: `data` holds `n` u32s and `sum` one u64, both alive until the synchronize below.
    unsafe {
        kernels.fill_u32(&stream, data.ptr(), 7, n).unwrap();
        kernels.increment_u32(&stream, data.ptr(), n).unwrap();
        kernels
            .checksum_u32(&stream, data.ptr(), n, sum.ptr())
            .unwrap();
    }
    stream.synchronize().unwrap();
    assert_eq!(download::<u64>(ctx, &sum, 1), [8 * n as u64]);
    let values = download::<u32>(ctx, &data, n);
    assert!(values.iter().all(|&v| v == 8));
}

#[test]
fn add_and_saxpy_compute_elementwise() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let (kernels, stream) = setup(ctx);
    let n = 100_003;
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..n).map(|i| (2 * i) as f32).collect();
    let (da, db, dout) = (
        alloc::<f32>(ctx, n),
        alloc::<f32>(ctx, n),
        alloc::<f32>(ctx, n),
    );
    upload(ctx, &da, &a);
    upload(ctx, &db, &b);
    // SAFETY: all three allocations hold `n` f32s and live until the synchronize below.
    unsafe {
        kernels
            .add_f32(&stream, da.ptr(), db.ptr(), dout.ptr(), n)
            .unwrap();
        // out = 0.5 * a + (a + b)
        kernels
            .saxpy_f32(&stream, 0.5, da.ptr(), dout.ptr(), n)
            .unwrap();
    }
    stream.synchronize().unwrap();
    let out = download::<f32>(ctx, &dout, n);
    for (i, value) in out.iter().enumerate() {
        assert_eq!(*value, 0.5 * a[i] + (a[i] + b[i]), "element {i}");
    }
}

/// A host-opened gate ([`TestKernels::wait_u32`]) on mapped pinned memory.
struct Gate {
    host: HostAllocation,
}

impl Gate {
    const TIMEOUT_NS: u64 = 10_000 * MS;

    fn new(context: &Arc<Context>) -> Self {
        let mut host = HostAllocation::new(context, 4, HostAllocFlags::PORTABLE_MAPPED).unwrap();
        host.as_bytes_mut().fill(0);
        Self { host }
    }

    /// Holds back later work on `stream` until [`Gate::open`].
    fn hold(&self, kernels: &TestKernels, stream: &Stream) {
        let flag = self.host.device_ptr().unwrap();
        // SAFETY: `flag` maps the 4 bytes of `self.host`; every test synchronizes its streams
        // before the gate is dropped, and the host writes the flag only volatile.
        unsafe { kernels.wait_u32(stream, flag, 1, Self::TIMEOUT_NS).unwrap() };
    }

    fn open(&self) {
        let flag = self.host.as_ptr().cast::<u32>().cast_mut();
        // SAFETY: 4 aligned bytes of live pinned memory that kernels only read.
        unsafe { flag.write_volatile(1) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Gate {
    /// A test that fails with the gate closed releases the waiting kernels rather than freeing
    /// the flag under them.
    fn drop(&mut self) {
        self.open();
    }
}

fn mapped_memory_supported(gpu: &cuweave_test_support::Gpu) -> bool {
    let supported = gpu.device.can_map_host_memory().unwrap();
    if !supported {
        eprintln!("device cannot map host memory; nothing to check");
    }
    supported
}

#[test]
fn spin_keeps_the_stream_busy_for_the_requested_time() {
    let _serial = serial();
    let gpu = require_gpu!();
    let (kernels, stream) = setup(&gpu.context);
    // Warm up: the first launch pays for lazy loading.
    kernels.spin_ns(&stream, 0).unwrap();
    stream.synchronize().unwrap();

    let start = Instant::now();
    kernels.spin_ns(&stream, 50 * MS).unwrap();
    let pending = !stream.query().unwrap();
    // The host may have been descheduled past the spin (tests run in parallel); only a prompt
    // query proves anything.
    if start.elapsed() < Duration::from_millis(40) {
        assert!(pending, "a 50 ms spin finished at once");
    }
    stream.synchronize().unwrap();
    let elapsed = start.elapsed();
    assert!(
        elapsed >= Duration::from_millis(50),
        "spun only {elapsed:?}"
    );
    assert!(elapsed < Duration::from_secs(5), "spun {elapsed:?}");
}

#[test]
fn wait_holds_the_stream_until_the_host_opens_the_gate() {
    let _serial = serial();
    let gpu = require_gpu!();
    if cuweave_test_support::skip_under_sanitizer(
        "kernels::wait_holds_the_stream_until_the_host_opens_the_gate",
        "memcheck serialises kernels, so the witness spin cannot run beside the held stream",
    ) {
        return;
    }
    if !mapped_memory_supported(&gpu) {
        return;
    }
    let (kernels, stream) = setup(&gpu.context);
    let gate = Gate::new(&gpu.context);
    gate.hold(&kernels, &stream);
    kernels.spin_ns(&stream, 0).unwrap();
    // Give the held stream 20 ms of GPU time in which to (wrongly) run past the gate: a spin on
    // a second stream, waited for, runs concurrently with it.
    let witness = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    kernels.spin_ns(&witness, 20 * MS).unwrap();
    witness.synchronize().unwrap();
    assert!(!stream.query().unwrap(), "work ran past a closed gate");
    let opened = Instant::now();
    gate.open();
    stream.synchronize().unwrap();
    assert!(
        opened.elapsed() < Duration::from_secs(5),
        "the gate did not see the host's write"
    );
}

#[test]
fn spin_then_store_reaches_mapped_host_memory_while_the_host_polls() {
    let _serial = serial();
    let gpu = require_gpu!();
    if !mapped_memory_supported(&gpu) {
        return;
    }
    let (kernels, stream) = setup(&gpu.context);
    let gate = Gate::new(&gpu.context);
    let mut host = HostAllocation::new(&gpu.context, 4, HostAllocFlags::PORTABLE_MAPPED).unwrap();
    host.as_bytes_mut().fill(0);
    let dptr = host.device_ptr().unwrap();
    let flag = host.as_ptr().cast::<u32>();

    gate.hold(&kernels, &stream);
    // SAFETY: `dptr` maps the 4 live bytes of `host`, which outlives the synchronize below; the
    // host only reads them, volatile.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, 20 * MS, dptr, 42)
            .unwrap();
    }
    // SAFETY: `flag` points to 4 aligned bytes of `host` (page-aligned pinned memory) that the
    // kernel writes; volatile reads see its store.
    let read = || unsafe { flag.read_volatile() };
    assert_eq!(read(), 0, "the store came before the gate opened");
    gate.open();
    let deadline = Instant::now() + Duration::from_secs(5);
    while read() != 42 {
        assert!(
            Instant::now() < deadline,
            "the store never reached the host"
        );
        std::hint::spin_loop();
    }
    stream.synchronize().unwrap();
}

#[test]
fn watch_counts_writes_made_while_it_runs_and_nothing_otherwise() {
    let _serial = serial();
    let gpu = require_gpu!();
    if !mapped_memory_supported(&gpu) {
        return;
    }
    let ctx = &gpu.context;
    let (kernels, watcher) = setup(ctx);
    let writer = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
    let n = 1 << 16;
    let data = alloc::<u32>(ctx, n);
    let mismatches = alloc::<u32>(ctx, 1);

    // Undisturbed: no mismatches.
    upload(ctx, &mismatches, &[0u32]);
    // SAFETY: `data` holds `n` u32s and `mismatches` one; both outlive the synchronizes below.
    unsafe {
        kernels.fill_u32(&watcher, data.ptr(), 5, n).unwrap();
        kernels
            .watch_u32(&watcher, data.ptr(), n, 5, 10 * MS, mismatches.ptr())
            .unwrap();
    }
    watcher.synchronize().unwrap();
    assert_eq!(download::<u32>(ctx, &mismatches, 1), [0]);

    // Overwritten 50 ms into a 200 ms watch from another stream: seen. Both streams start at the
    // gate, so the overlap does not depend on how fast this thread enqueues.
    let gate = Gate::new(ctx);
    gate.hold(&kernels, &watcher);
    gate.hold(&kernels, &writer);
    // SAFETY: as above; the writer's fill races the watch on purpose, which the watch allows.
    unsafe {
        kernels
            .watch_u32(&watcher, data.ptr(), n, 5, 200 * MS, mismatches.ptr())
            .unwrap();
        kernels.spin_ns(&writer, 50 * MS).unwrap();
        kernels.fill_u32(&writer, data.ptr(), 6, n).unwrap();
    }
    gate.open();
    writer.synchronize().unwrap();
    watcher.synchronize().unwrap();
    let seen = download::<u32>(ctx, &mismatches, 1)[0];
    assert!(seen > 0, "the watch missed a concurrent overwrite");
}
