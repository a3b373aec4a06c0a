//! GPU tests of `PriorityStream`: priorities read back, overlap and overtaking seen in
//! `%globaltimer` stamps, counted and GPU-timed operations, host callbacks (refused on a
//! capturing stream).

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cuweave_driver::{Event, EventFlags, InstantiateOptions};
use cuweave_memory::{Buffer, DeviceBuffer, MemLocation, UnifiedBuffer};
use cuweave_stream::capture::CaptureOptions;
use cuweave_stream::{MultiStreamCoordinator, PriorityStream, StreamError, StreamPriority};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;

const MS: u64 = 1_000_000;

/// Start and end (`%globaltimer` ns) of a `spin_stamped` launch on `stream`.
fn stamped_spin(
    kernels: &StreamKernels,
    stream: &PriorityStream,
    stamps: &DeviceBuffer<u64>,
    ns: u64,
    blocks: u32,
) {
    stream
        .launch(|s| {
            // SAFETY: `stamps` holds two u64s and outlives the kernel (the test synchronizes
            // the stream before reading or dropping it).
            unsafe { kernels.spin_stamped(s, ns, blocks, stamps.device_ptr()) }
        })
        .expect("spin_stamped");
}

fn new_stamps(gpu: &cuweave_test_support::Gpu) -> DeviceBuffer<u64> {
    DeviceBuffer::from_slice(&gpu.context, &[u64::MAX, 0]).expect("stamps")
}

#[test]
fn each_level_gets_its_driver_priority_read_back() {
    let gpu = cuweave_test_support::require_gpu!();
    let range = gpu.context.stream_priority_range().unwrap();
    let mut seen = Vec::new();
    for level in StreamPriority::ALL {
        let stream = PriorityStream::new(&gpu.context, level).unwrap();
        assert_eq!(stream.priority(), level);
        assert_eq!(stream.driver_priority(), level.to_driver(range));
        assert_eq!(
            stream.stream().priority().unwrap(),
            stream.driver_priority()
        );
        seen.push(stream.driver_priority());
    }
    eprintln!("priority range {range:?}: high/normal/low = {seen:?}");
    if range.greatest < range.least {
        assert!(
            seen[0] < seen[2],
            "high must be numerically below low: {seen:?}"
        );
    }
}

#[test]
fn high_and_low_priority_streams_run_at_the_same_time() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = StreamKernels::load(&gpu.context).unwrap();
    let high = PriorityStream::new(&gpu.context, StreamPriority::High).unwrap();
    let low = PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap();
    let (high_stamps, low_stamps) = (new_stamps(&gpu), new_stamps(&gpu));
    stamped_spin(&kernels, &low, &low_stamps, 20 * MS, 1);
    stamped_spin(&kernels, &high, &high_stamps, 20 * MS, 1);
    high.synchronize().unwrap();
    low.synchronize().unwrap();
    let (h, l) = (high_stamps.to_vec().unwrap(), low_stamps.to_vec().unwrap());
    let overlap = h[1].min(l[1]).saturating_sub(h[0].max(l[0]));
    eprintln!(
        "high {}..{} low {}..{}: overlap {:.3} ms",
        h[0],
        h[1],
        l[0],
        l[1],
        overlap as f64 / 1e6
    );
    assert!(
        overlap >= 10 * MS,
        "two 20 ms spins on two streams overlapped only {overlap} ns"
    );
}

#[test]
fn high_priority_work_overtakes_queued_low_priority_blocks() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = StreamKernels::load(&gpu.context).unwrap();
    let high = PriorityStream::new(&gpu.context, StreamPriority::High).unwrap();
    let low = PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap();
    let (high_stamps, low_stamps) = (new_stamps(&gpu), new_stamps(&gpu));
    // Many more blocks than the GPU holds at once: a queue of pending low-priority blocks.
    stamped_spin(&kernels, &low, &low_stamps, 100_000, 100_000);
    // Let the low-priority kernel start filling the GPU before the urgent one arrives.
    std::thread::sleep(Duration::from_micros(300));
    stamped_spin(&kernels, &high, &high_stamps, 10_000, 1);
    high.synchronize().unwrap();
    low.synchronize().unwrap();
    let (h, l) = (high_stamps.to_vec().unwrap(), low_stamps.to_vec().unwrap());
    let low_span = l[1] - l[0];
    eprintln!(
        "low-priority queue ran {:.3} ms; the high-priority block started {:.3} ms in and ended {:.3} ms before the queue drained",
        low_span as f64 / 1e6,
        h[0].saturating_sub(l[0]) as f64 / 1e6,
        l[1].saturating_sub(h[1]) as f64 / 1e6
    );
    assert!(l[0] < h[0], "the low-priority kernel started first");
    assert!(
        h[1] + low_span / 4 < l[1],
        "the high-priority block must finish well before the low-priority queue drains"
    );
}

#[test]
fn operations_are_counted_and_timed_on_the_gpu() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    stream.set_timing(true);
    const N: usize = 1 << 18;
    let mut a = DeviceBuffer::<u32>::new(&gpu.context, N).unwrap();
    let mut b = DeviceBuffer::<u32>::new(&gpu.context, N).unwrap();
    stream.fill(&mut a, 7).unwrap();
    let upload = stream.copy_from_host(&mut b, vec![3u32; N]).unwrap();
    stream.launch(|s| kernels.spin_ns(s, 20 * MS)).unwrap();
    // Checked before the download: a copy into pageable memory returns only once it is done.
    assert!(
        stream.outstanding_work().unwrap() > 0,
        "the 20 ms spin is still queued"
    );
    stream.copy_buffer(&mut a, &b).unwrap();
    let download = stream.copy_to_host(&a, vec![0u32; N]).unwrap();
    assert_eq!(download.wait().unwrap(), vec![3u32; N]);
    upload.wait().unwrap();
    stream.synchronize().unwrap();
    assert_eq!(stream.outstanding_work().unwrap(), 0);
    let metrics = stream.metrics().unwrap();
    eprintln!("{metrics}");
    assert_eq!(metrics.operations, 5);
    assert_eq!(metrics.copies, 3);
    assert_eq!(metrics.memsets, 1);
    assert_eq!(metrics.kernel_launches, 1);
    assert_eq!(metrics.bytes, 4 * (N as u64) * 4);
    assert_eq!(metrics.timed_operations, 5);
    assert!(
        metrics.gpu_time_ns >= 19 * MS,
        "GPU time {} ns",
        metrics.gpu_time_ns
    );
    assert!(
        metrics.gpu_time_ns < 200 * MS,
        "GPU time {} ns",
        metrics.gpu_time_ns
    );

    // A refused copy hands its Vec back, unchanged, and is not counted.
    let refused = stream
        .copy_to_host(&a, vec![1u32; N - 1])
        .expect_err("a shorter Vec was copied into");
    assert!(
        matches!(
            refused.error(),
            StreamError::Memory(cuweave_memory::MemoryError::SizeMismatch { .. })
        ),
        "{refused}"
    );
    assert_eq!(refused.into_host(), Some(vec![1u32; N - 1]));
    assert_eq!(stream.metrics().unwrap().operations, 5);
}

#[test]
fn unified_prefetch_is_counted() {
    let gpu = cuweave_test_support::require_gpu!();
    if !gpu.device.supports_managed_memory().unwrap() {
        eprintln!("device has no managed memory; prefetch refused as a typed error instead");
    }
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap();
    let buffer = UnifiedBuffer::<u32>::from_slice(&gpu.context, &[1u32; 16 << 10]).unwrap();
    stream
        .prefetch(&buffer, MemLocation::Device(gpu.device.ordinal()))
        .unwrap();
    stream.prefetch(&buffer, MemLocation::Host).unwrap();
    stream.synchronize().unwrap();
    let metrics = stream.metrics().unwrap();
    assert_eq!(metrics.prefetches, 2);
    assert_eq!(metrics.bytes, 2 * (64 << 10));
    assert_eq!(buffer.as_slice().unwrap()[0], 1);
}

#[test]
fn callbacks_fire_when_the_gpu_gets_there_in_order_before_synchronize() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let (tx, rx) = mpsc::channel::<(u32, Instant)>();
    let queued = Instant::now();
    for i in 0..3u32 {
        stream.launch(|s| kernels.spin_ns(s, 10 * MS)).unwrap();
        let tx = tx.clone();
        stream
            .add_callback(move || tx.send((i, Instant::now())).unwrap())
            .unwrap();
    }
    // No synchronize: the callbacks must arrive on their own.
    let got: Vec<(u32, Instant)> = (0..3)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(5))
                .expect("callback fired")
        })
        .collect();
    assert_eq!(
        got.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert!(
        got[0].1 - queued >= Duration::from_millis(9),
        "the first callback waited for the first spin"
    );
    assert!(
        got[2].1 - queued >= Duration::from_millis(29),
        "the last callback waited for all three spins"
    );
    assert_eq!(stream.metrics().unwrap().callbacks, 3);
}

#[test]
fn a_callback_may_call_cuda_and_a_panicking_one_is_reported() {
    let gpu = cuweave_test_support::require_gpu!();
    let stream = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let other = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let (tx, rx) = mpsc::channel::<Result<bool, String>>();
    stream
        .add_callback(|| panic!("deliberate callback panic"))
        .unwrap();
    let context = Arc::clone(&gpu.context);
    let tx2 = tx.clone();
    let other2 = Arc::clone(&other);
    stream
        .add_callback(move || {
            // CUDA calls from the callback: the raw driver forbids them on its own thread.
            let result = Event::new(&context, EventFlags::DISABLE_TIMING)
                .and_then(|event| {
                    event.record(other2.stream())?;
                    event.synchronize()?;
                    event.query()
                })
                .map_err(|error| error.to_string());
            tx2.send(result).unwrap();
        })
        .unwrap();
    let outcome = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("callback ran");
    assert_eq!(outcome, Ok(true));
    let failures = stream.callback_failures();
    assert_eq!(failures.len(), 1);
    assert_eq!(failures[0].sequence, 0);
    assert!(failures[0].message.contains("deliberate callback panic"));
    assert_eq!(stream.metrics().unwrap().callback_panics, 1);
    drop(tx);
}

fn assert_capture_refusal(result: Result<(), StreamError>) {
    let error = result.unwrap_err();
    assert!(error.is_capture_refusal(), "{error}");
}

#[test]
fn host_callbacks_are_refused_on_a_capturing_stream_and_their_closures_dropped() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let capturing = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let idle = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let coordinator =
        MultiStreamCoordinator::with_streams([Arc::clone(&idle), Arc::clone(&capturing)]);
    let token = Arc::new(());

    let capture = capturing.begin_capture(CaptureOptions::default()).unwrap();
    kernels.spin_ns(&capturing, 1000).unwrap();
    let held = Arc::clone(&token);
    assert_capture_refusal(capturing.add_callback(move || drop(held)));
    let held = Arc::clone(&token);
    assert_capture_refusal(coordinator.on_stream_complete(&capturing, move || drop(held)));
    // Refused before anything is queued, on the idle stream too.
    let held = Arc::clone(&token);
    assert_capture_refusal(coordinator.on_all_complete(move || drop(held)));
    assert_eq!(
        Arc::strong_count(&token),
        1,
        "no host node or queued callback holds a closure"
    );
    let graph = capture
        .finish()
        .expect("the refusals did not break the capture");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        capturing.launch_graph(&exec).unwrap();
    }
    capturing.synchronize().unwrap();
    assert_eq!(Arc::strong_count(&token), 1);

    // After the capture, callbacks run again.
    let (tx, rx) = mpsc::channel();
    let held = Arc::clone(&token);
    coordinator
        .on_all_complete(move || {
            drop(held);
            tx.send(()).unwrap();
        })
        .unwrap();
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(Arc::strong_count(&token), 1);
}

#[test]
#[cfg(target_os = "linux")]
fn a_callback_on_a_stream_captured_outside_cuweave_is_refused_before_its_worker_starts() {
    use cuweave_test_support::outside_capture::capture_outside_cuweave;

    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    stream.set_timing(true);
    let token = Arc::new(());
    let held = Arc::clone(&token);
    assert_eq!(cuweave_driver::graph::active_captures(), 0);

    // A capture cuweave does not count: begun with the driver's own call.
    let ((refused, threads, threads_after), graph) =
        capture_outside_cuweave(&gpu.context, &stream, || {
            let threads = cuweave_test_support::process_threads();
            let refused = stream.add_callback(move || drop(held));
            (refused, threads, cuweave_test_support::process_threads())
        });

    assert_capture_refusal(refused);
    assert_eq!(
        threads_after, threads,
        "the refusal came before the stream's callback worker thread was started"
    );
    assert_eq!(Arc::strong_count(&token), 1, "the closure was dropped");
    assert_eq!(graph.node_count().unwrap(), 0, "nothing was recorded");
    assert_eq!(stream.metrics().unwrap().operations, 0, "nothing counted");
}
