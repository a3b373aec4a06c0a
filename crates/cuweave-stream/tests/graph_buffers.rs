//! GPU tests of typed buffers across a capture's boundary: a buffer written eagerly (by a slow
//! kernel still running when the capture is asked for) and then used inside the capture, the
//! graph replayed bit-exactly, the buffer used eagerly again afterwards; and the typed
//! refusals when work inside and outside a running capture would have to wait for each other,
//! leaving both streams usable.
//!
//! Every test takes `serial()`, as in `graphs.rs`: a capture changes what the whole process may
//! do while it runs.

use std::sync::Arc;

use cuweave_driver::{Context, InstantiateOptions, Kernel, LaunchConfig, Stream, StreamFlags};
use cuweave_memory::caching::CachingAllocator;
use cuweave_memory::{Buffer, DeviceBuffer, MemoryError, TrackedLaunch};
use cuweave_stream::StreamError;
use cuweave_stream::capture::{CaptureOptions, StreamCapture};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{gpu, serial};

const N: usize = 1 << 18;
const MS: u64 = 1_000_000;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).unwrap()
}

/// `fill_u32` and `saxpy_f32` of the test kernels, as kernels `TrackedLaunch` can launch.
struct Kernels {
    test: TestKernels,
    fill: Kernel,
    saxpy: Kernel,
    config: LaunchConfig,
}

impl Kernels {
    fn load(context: &Arc<Context>) -> Self {
        let test = TestKernels::load(context).unwrap();
        Self {
            fill: test.module().function("fill_u32").unwrap(),
            saxpy: test.module().function("saxpy_f32").unwrap(),
            test,
            config: LaunchConfig::for_elements(N, 256).unwrap(),
        }
    }

    /// `buffer[i] = value` on `stream`, tracked as a write.
    fn fill(
        &self,
        stream: &Stream,
        buffer: &mut DeviceBuffer<f32>,
        value: f32,
    ) -> Result<(), MemoryError> {
        let (bits, n) = (value.to_bits(), N as u64);
        // SAFETY: fill_u32(unsigned*, unsigned, size_t) writes n 4-byte elements of `buffer`,
        // which holds N f32s; declared written.
        unsafe {
            TrackedLaunch::new(&self.fill, stream, self.config)
                .write(buffer)
                .arg(&bits)
                .arg(&n)
                .launch()
        }
    }

    /// `y[i] += a * x[i]` on `stream`, tracked as a read of `x` and a write of `y`.
    fn saxpy(
        &self,
        stream: &Stream,
        a: f32,
        x: &DeviceBuffer<f32>,
        y: &mut DeviceBuffer<f32>,
    ) -> Result<(), MemoryError> {
        let n = N as u64;
        // SAFETY: saxpy_f32(float, const float*, float*, size_t) reads n elements of `x` and
        // writes n of `y`, both N f32s, declared so.
        unsafe {
            TrackedLaunch::new(&self.saxpy, stream, self.config)
                .arg(&a)
                .read(x)
                .write(y)
                .arg(&n)
                .launch()
        }
    }
}

fn assert_all_bits(buffer: &DeviceBuffer<f32>, expected: f32) {
    let host = buffer.to_vec().unwrap();
    assert_eq!(host.len(), N);
    if let Some((index, value)) = host
        .iter()
        .enumerate()
        .find(|(_, value)| value.to_bits() != expected.to_bits())
    {
        panic!("element {index} is {value}, expected {expected} bit for bit");
    }
}

fn assert_capturing(result: Result<(), MemoryError>) {
    let error = StreamError::from(result.unwrap_err());
    assert!(
        error.is_capture_refusal(),
        "expected a Capturing refusal, got {error}"
    );
}

#[test]
fn eagerly_written_buffers_captured_and_replayed_bit_exact_then_used_eagerly() {
    let Some(gpu) =
        gpu("eagerly_written_buffers_captured_and_replayed_bit_exact_then_used_eagerly")
    else {
        return;
    };
    let _serial = serial();
    let kernels = Kernels::load(&gpu.context);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let (eager, origin) = (stream(&gpu.context), stream(&gpu.context));
    let mut x = allocator.buffer::<f32>(N, &eager).unwrap();
    let mut y = allocator.buffer::<f32>(N, &eager).unwrap();

    // Eager writes behind a 50 ms kernel: still running when the capture is asked for.
    kernels.test.spin_ns(&eager, 50 * MS).unwrap();
    kernels.fill(&eager, &mut x, 1.5).unwrap();
    kernels.fill(&eager, &mut y, 0.0).unwrap();

    // Begin synchronises the context first, so the capture uses x and y without waiting on the
    // events of those eager writes (which the driver would refuse: capture isolation).
    let capture = StreamCapture::begin(&origin, CaptureOptions::default()).unwrap();
    kernels.saxpy(&origin, 2.0, &x, &mut y).unwrap();
    let graph = capture
        .finish()
        .expect("the capture was not invalidated by the eager uses before it");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..100 {
        exec.launch(&origin).unwrap();
    }
    // The graph's launches are ordered by the stream they are launched on.
    origin.synchronize().unwrap();
    assert_all_bits(&y, 300.0); // 100 x (2.0 x 1.5), every partial sum exact
    assert_all_bits(&x, 1.5);

    // Eager use after the capture: the uses recorded inside it are forgotten, not waited on.
    kernels.fill(&eager, &mut x, 2.5).unwrap();
    kernels.saxpy(&eager, 2.0, &x, &mut y).unwrap();
    eager.synchronize().unwrap();
    assert_all_bits(&y, 305.0);
    // The graph's launches recorded no uses on x and y: they count as busy until a wait that
    // covers the launches (a context synchronisation), which `synchronize` makes.
    assert!(!x.is_idle().unwrap() && !y.is_idle().unwrap());
    x.synchronize().unwrap();
    y.synchronize().unwrap();
    assert!(x.is_idle().unwrap() && y.is_idle().unwrap());
    drop((exec, graph));
}

#[test]
fn crossing_a_running_capture_is_a_typed_error_and_both_streams_stay_usable() {
    let Some(gpu) = gpu("crossing_a_running_capture_is_a_typed_error_and_both_streams_stay_usable")
    else {
        return;
    };
    let _serial = serial();
    let kernels = Kernels::load(&gpu.context);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let (other, origin) = (stream(&gpu.context), stream(&gpu.context));
    let mut captured = allocator.buffer::<f32>(N, &origin).unwrap();
    let mut late = allocator.buffer::<f32>(N, &other).unwrap();
    let mut out = allocator.buffer::<f32>(N, &origin).unwrap();
    kernels.fill(&origin, &mut captured, 0.0).unwrap();
    kernels.fill(&origin, &mut out, 0.0).unwrap();
    kernels.fill(&other, &mut late, 1.0).unwrap();

    let capture = StreamCapture::begin(&origin, CaptureOptions::default()).unwrap();
    kernels.fill(&origin, &mut captured, 4.0).unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            // Another thread, eager: waiting for the captured write is refused...
            assert_capturing(kernels.fill(&other, &mut captured, 9.0));
            // ...and a write recorded now, after the capture began, is an ordinary eager use.
            kernels.fill(&other, &mut late, 3.0).unwrap();
        });
    });
    // The capturing stream cannot wait for that later eager write: refused, nothing queued.
    assert_capturing(kernels.saxpy(&origin, 1.0, &late, &mut out));
    kernels.saxpy(&origin, 1.0, &captured, &mut out).unwrap();
    let graph = capture
        .finish()
        .expect("the refusals left the capture intact");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.launch(&origin).unwrap();
    exec.launch(&origin).unwrap();
    origin.synchronize().unwrap();
    assert_all_bits(&out, 8.0); // two replays of: captured = 4; out += captured

    // Both streams usable, and every buffer usable eagerly on either.
    other.synchronize().unwrap();
    assert_all_bits(&late, 3.0);
    kernels.fill(&other, &mut captured, 9.0).unwrap();
    kernels.saxpy(&origin, 1.0, &late, &mut out).unwrap();
    kernels.saxpy(&origin, 1.0, &captured, &mut out).unwrap();
    origin.synchronize().unwrap();
    assert_all_bits(&out, 20.0);
    drop((exec, graph));
}
