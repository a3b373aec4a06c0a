//! Streams and events on a real GPU: priorities, timing, polling, cross-stream ordering and host
//! callbacks, each observed through what the device actually did.
//!
//! Every stream here is non-blocking, so work that other tests put on the legacy default stream
//! (synchronous copies, frees) cannot slip into the timings measured here.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cuweave_driver::memory::{self, DeviceAllocation, HostAllocFlags, HostAllocation};
use cuweave_driver::{Context, DriverError, Event, EventFlags, Stream, StreamFlags};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const MS: u64 = 1_000_000;

/// Loaded kernels and a non-blocking stream, with one launch done so that lazy module loading is
/// paid for before anything is measured.
fn warmed_up(context: &Arc<Context>) -> (TestKernels, Stream) {
    let kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    kernels.spin_ns(&stream, 0).unwrap();
    stream.synchronize().unwrap();
    (kernels, stream)
}

fn assert_invalid(result: Result<impl std::fmt::Debug, DriverError>, expected_operation: &str) {
    match result {
        Err(DriverError::InvalidArgument { operation, .. }) => {
            assert_eq!(operation, expected_operation);
        }
        other => panic!("expected InvalidArgument from {expected_operation}, got {other:?}"),
    }
}

#[test]
fn streams_at_both_ends_of_the_priority_range_report_their_priority() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let range = context.stream_priority_range().unwrap();
    for priority in [range.greatest, range.least] {
        let stream = Stream::with_priority(context, StreamFlags::NON_BLOCKING, priority).unwrap();
        assert_eq!(stream.priority().unwrap(), priority);
        assert!(stream.flags().unwrap().is_non_blocking());
        assert_eq!(stream.device(), gpu.device);
        // The stream works: an empty one is idle and synchronizes at once.
        assert!(stream.query().unwrap());
        stream.synchronize().unwrap();
    }
    assert_invalid(
        Stream::with_priority(context, StreamFlags::NON_BLOCKING, range.greatest - 1),
        "Stream::with_priority",
    );
    assert_invalid(
        Stream::with_priority(context, StreamFlags::NON_BLOCKING, range.least + 1),
        "Stream::with_priority",
    );
}

#[test]
fn a_plain_stream_has_the_default_priority_and_its_flags() {
    let gpu = require_gpu!();
    let range = gpu.context.stream_priority_range().unwrap();
    let blocking = Stream::new(&gpu.context, StreamFlags::DEFAULT).unwrap();
    assert!(!blocking.flags().unwrap().is_non_blocking());
    // cuStreamCreate gives priority 0, which the driver keeps inside the range.
    assert_eq!(blocking.priority().unwrap(), range.clamp(0));
    let non_blocking = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    assert!(non_blocking.flags().unwrap().is_non_blocking());
}

#[test]
fn events_time_a_two_millisecond_kernel() {
    let gpu = require_gpu!();
    let (kernels, stream) = warmed_up(&gpu.context);
    let start = Event::new(&gpu.context, EventFlags::TIMING).unwrap();
    let end = Event::new(&gpu.context, EventFlags::TIMING.with_blocking_sync()).unwrap();
    assert!(end.flags().is_blocking_sync());
    // A gate in front of the start event: by the time the GPU reaches it, the host has queued
    // everything behind it, so a slow host thread cannot stretch the measured interval.
    kernels.spin_ns(&stream, 10 * MS).unwrap();
    start.record(&stream).unwrap();
    kernels.spin_ns(&stream, 2 * MS).unwrap();
    end.record(&stream).unwrap();
    end.synchronize().unwrap();
    assert!(start.query().unwrap() && end.query().unwrap());
    let ms = start.elapsed_ms(&end).unwrap();
    eprintln!("2 ms spin measured as {ms:.3} ms");
    assert!((1.5..50.0).contains(&ms), "2 ms spin measured as {ms} ms");
}

#[test]
fn elapsed_time_needs_timing_on_both_events() {
    let gpu = require_gpu!();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let untimed = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).unwrap();
    let timed = Event::new(&gpu.context, EventFlags::TIMING).unwrap();
    let timed_later = Event::new(&gpu.context, EventFlags::TIMING).unwrap();
    assert!(!untimed.flags().is_timing());
    timed.record(&stream).unwrap();
    untimed.record(&stream).unwrap();
    timed_later.record(&stream).unwrap();
    stream.synchronize().unwrap();
    assert_invalid(untimed.elapsed_ms(&timed_later), "Event::elapsed_ms");
    assert_invalid(timed.elapsed_ms(&untimed), "Event::elapsed_ms");
    // All three are recorded and complete, so only the flags can have refused the calls above.
    assert!(timed.elapsed_ms(&timed_later).unwrap() >= 0.0);
}

#[test]
fn queries_say_pending_while_a_kernel_spins_and_done_after_synchronize() {
    let gpu = require_gpu!();
    let (kernels, stream) = warmed_up(&gpu.context);
    let event = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).unwrap();
    assert!(
        event.query().unwrap(),
        "a never-recorded event counts as done"
    );

    let spin = Duration::from_millis(200);
    // The answer proves something only when the host asked well before the spin could have
    // ended; a host thread descheduled that long leaves the attempt inconclusive, so retry.
    for attempt in 1..=3 {
        let launched = Instant::now();
        kernels.spin_ns(&stream, spin.as_nanos() as u64).unwrap();
        event.record(&stream).unwrap();
        let event_done = event.query().unwrap();
        let stream_done = stream.query().unwrap();
        let asked_after = launched.elapsed();

        event.synchronize().unwrap();
        assert!(event.query().unwrap(), "event pending after synchronize");
        assert!(stream.query().unwrap(), "stream busy after its last event");
        if asked_after < spin / 2 {
            assert!(
                !event_done,
                "event done {asked_after:?} into a {spin:?} spin"
            );
            assert!(
                !stream_done,
                "stream idle {asked_after:?} into a {spin:?} spin"
            );
            return;
        }
        eprintln!("attempt {attempt}: the host took {asked_after:?} to ask; retrying");
    }
    panic!("the host never managed to query within 100 ms of a launch");
}

#[test]
fn wait_event_orders_a_second_stream_after_the_first() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let (kernels, producer) = warmed_up(context);
    let consumer = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let flag = DeviceAllocation::new(context, 4).unwrap();
    let mut seen = HostAllocation::new(context, 4, HostAllocFlags::default()).unwrap();
    seen.as_bytes_mut().fill(0xFF);
    let stored = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();

    // SAFETY: `flag` (4 bytes) and `seen` (4 pinned bytes) outlive both synchronizes below; the
    // host does not touch `seen` until the consumer, which writes it, has synchronized.
    unsafe {
        memory::memset_d32_async(flag.ptr(), 0, 1, &producer).unwrap();
        kernels
            .spin_then_store_u32(&producer, 20 * MS, flag.ptr(), 0xF1A6)
            .unwrap();
        stored.record(&producer).unwrap();
        consumer.wait_event(&stored).unwrap();
        // Queued at once, but 20 ms before the store: only the wait keeps it from reading 0.
        memory::copy_dtoh_async(seen.as_mut_ptr(), flag.ptr(), 4, &consumer).unwrap();
    }
    consumer.synchronize().unwrap();
    let value = u32::from_ne_bytes(seen.as_bytes().try_into().unwrap());
    assert_eq!(
        value, 0xF1A6,
        "the consumer read the flag before the producer stored it"
    );
    // Waiting on the consumer implied the producer got as far as the event.
    assert!(stored.query().unwrap());
    producer.synchronize().unwrap();
}

#[test]
fn a_host_callback_runs_after_the_kernel_before_it() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    assert!(gpu.device.can_map_host_memory().unwrap());
    let (kernels, stream) = warmed_up(context);
    let mut mapped = HostAllocation::new(context, 4, HostAllocFlags::PORTABLE_MAPPED).unwrap();
    mapped.as_bytes_mut().fill(0);
    let flag = mapped.device_ptr().unwrap();
    // The callback keeps its own handle so the memory it reads outlives it; the test's handle
    // outlives the callback (it is dropped after the synchronize), so the callback never frees
    // it, which would be a CUDA call from a callback.
    let mapped = Arc::new(mapped);
    let in_callback = Arc::clone(&mapped);
    let (sender, receiver) = mpsc::channel();

    // SAFETY: `flag` maps the 4 live bytes of `mapped`, which outlive the synchronize below; the
    // host reads them only volatile.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, 20 * MS, flag, 0xC0FFEE)
            .unwrap();
    }
    stream
        .launch_host_fn(move || {
            // SAFETY: 4 aligned bytes of live pinned memory (held by `in_callback`); the kernel
            // wrote them with a system-wide fence, and a volatile read sees that store.
            let value = unsafe { in_callback.as_ptr().cast::<u32>().read_volatile() };
            let _ = sender.send((value, std::thread::current().id()));
        })
        .unwrap();
    let (value, callback_thread) = receiver
        .recv_timeout(Duration::from_secs(10))
        .expect("the host callback never ran");
    assert_eq!(value, 0xC0FFEE, "the callback ran before the kernel stored");
    assert_ne!(
        callback_thread,
        std::thread::current().id(),
        "callbacks run on a driver thread"
    );
    stream.synchronize().unwrap();
    assert_eq!(
        Arc::strong_count(&mapped),
        1,
        "the callback's handle was dropped"
    );
}

#[test]
fn host_callbacks_on_one_stream_run_in_order() {
    let gpu = require_gpu!();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    for index in 0..16 {
        let order = Arc::clone(&order);
        stream
            .launch_host_fn(move || order.lock().unwrap().push(index))
            .unwrap();
    }
    stream.synchronize().unwrap();
    assert_eq!(*order.lock().unwrap(), (0..16).collect::<Vec<_>>());
}

#[test]
fn a_panicking_callback_is_contained_and_the_stream_goes_on() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    const WORDS: usize = 1 << 16;
    let buffer = DeviceAllocation::new(context, WORDS * 4).unwrap();
    let mut host = vec![0u32; WORDS];
    let (sender, receiver) = mpsc::channel();

    stream
        .launch_host_fn(|| panic!("deliberate panic in a host callback; the test expects it"))
        .unwrap();
    // SAFETY: `buffer` holds WORDS u32s and `host` as many; both outlive the synchronize, and the
    // host reads `host` only after it.
    unsafe {
        memory::memset_d32_async(buffer.ptr(), 0x600D_CAFE, WORDS, &stream).unwrap();
        memory::copy_dtoh_async(host.as_mut_ptr().cast(), buffer.ptr(), WORDS * 4, &stream)
            .unwrap();
    }
    stream
        .launch_host_fn(move || sender.send(()).unwrap())
        .unwrap();
    receiver
        .recv_timeout(Duration::from_secs(10))
        .expect("the callback after the panicking one never ran");
    stream
        .synchronize()
        .expect("the stream is healthy after a panicking callback");
    assert!(host.iter().all(|&word| word == 0x600D_CAFE));
}
