//! Work that must run once, never be replayed, is refused on a capturing stream: host functions
//! (their boxed `FnOnce` is freed by the first run, so a graph's second launch would free it
//! again) and completion-word writes (a graph launched after the words are freed would write
//! into freed memory). Each refusal is a typed `GraphError::Capturing`, records nothing into the
//! graph, and drops what it was given.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cuweave_driver::memory::{CompletionWords, MappedWords, StreamMarks};
use cuweave_driver::{
    CaptureMode, DriverError, Event, EventFlags, GraphError, Stream, StreamFlags,
};
use cuweave_test_support::outside_capture::capture_outside_cuweave;
use cuweave_test_support::require_gpu;

/// Asserts that `result` is a `GraphError::Capturing` refusal of `operation`.
fn assert_refused<T: std::fmt::Debug>(result: Result<T, DriverError>, operation: &str) {
    match result {
        Err(DriverError::Graph(GraphError::Capturing { operation: op, .. })) => {
            assert_eq!(op, operation);
        }
        other => panic!("expected {operation} to be refused while capturing, got {other:?}"),
    }
}

#[test]
fn a_host_function_on_a_capturing_stream_is_refused_and_its_closure_dropped() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let held = Arc::new(());
    let in_closure = Arc::clone(&held);

    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let refused = stream.launch_host_fn(move || drop(in_closure));
    let graph = stream.end_capture().unwrap();

    assert_refused(refused, "Stream::launch_host_fn");
    assert_eq!(
        Arc::strong_count(&held),
        1,
        "the refused closure was dropped, not leaked"
    );
    assert_eq!(graph.node_count().unwrap(), 0, "no host node was recorded");

    // The stream is usable again, and a host function on it runs once.
    let (sender, receiver) = mpsc::channel();
    let in_closure = Arc::clone(&held);
    stream
        .launch_host_fn(move || {
            drop(in_closure);
            sender.send(()).unwrap();
        })
        .unwrap();
    receiver
        .recv_timeout(Duration::from_secs(10))
        .expect("the host function after the capture never ran");
    stream.synchronize().unwrap();
    assert_eq!(Arc::strong_count(&held), 1);
}

#[test]
fn a_host_function_on_a_stream_forked_into_a_capture_is_refused() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let origin = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let forked = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let fork = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).unwrap();
    let join = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).unwrap();
    let held = Arc::new(());
    let in_closure = Arc::clone(&held);

    origin.begin_capture(CaptureMode::ThreadLocal).unwrap();
    fork.record(&origin).unwrap();
    forked.wait_event(&fork).unwrap();
    let refused = forked.launch_host_fn(move || drop(in_closure));
    join.record(&forked).unwrap();
    origin.wait_event(&join).unwrap();
    let graph = origin.end_capture().unwrap();

    assert_refused(refused, "Stream::launch_host_fn");
    assert_eq!(Arc::strong_count(&held), 1);
    assert!(
        !graph
            .node_types()
            .unwrap()
            .contains(&cuweave_driver::graph::GraphNodeType::Host)
    );
}

#[test]
fn a_host_function_on_a_stream_captured_outside_cuweave_is_refused() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let held = Arc::new(());
    let in_closure = Arc::clone(&held);
    assert_eq!(cuweave_driver::graph::active_captures(), 0);

    let (refused, graph) = capture_outside_cuweave(&gpu.context, &stream, || {
        stream.launch_host_fn(move || drop(in_closure))
    });

    assert_refused(refused, "Stream::launch_host_fn");
    assert_eq!(Arc::strong_count(&held), 1);
    assert_eq!(graph.node_count().unwrap(), 0);
}

#[test]
fn completion_word_writes_on_a_capturing_stream_are_refused_and_nothing_is_captured() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    // Made before the capture: pinned allocation is no capture-time call.
    let words = MappedWords::new(&gpu.context, 4).unwrap();
    let marks = StreamMarks::new(
        Arc::new(MappedWords::new(&gpu.context, 1).unwrap()),
        0,
        &stream,
        0,
    )
    .unwrap();
    let completion = CompletionWords::new(&gpu.context).unwrap();

    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let write = words.enqueue_write(&stream, 0, 7);
    let mark = marks.mark(&stream);
    let waited = completion.synchronize(&stream);
    let graph = stream.end_capture().unwrap();

    assert_refused(write, "MappedWords::enqueue_write");
    assert_refused(mark, "MappedWords::enqueue_write");
    assert_refused(waited, "MappedWords::enqueue_write");
    assert_eq!(graph.node_count().unwrap(), 0, "no word write was recorded");

    // After the capture the writes run, and the refused mark used no number.
    words.enqueue_write(&stream, 0, 7).unwrap();
    let mark = marks.mark(&stream).unwrap();
    assert_eq!(mark.value(), 1);
    marks.wait(mark, &stream).unwrap();
    completion.synchronize(&stream).unwrap();
    assert_eq!(words.load(0), Some(7));
}

#[test]
fn a_completion_word_write_on_a_stream_forked_into_a_capture_is_refused() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let origin = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let forked = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let fork = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).unwrap();
    let join = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).unwrap();
    let words = MappedWords::new(&gpu.context, 1).unwrap();

    origin.begin_capture(CaptureMode::ThreadLocal).unwrap();
    fork.record(&origin).unwrap();
    forked.wait_event(&fork).unwrap();
    let write = words.enqueue_write(&forked, 0, 3);
    join.record(&forked).unwrap();
    origin.wait_event(&join).unwrap();
    let graph = origin.end_capture().unwrap();

    assert_refused(write, "MappedWords::enqueue_write");
    // A captured word write would be a batch memory-operation node.
    assert!(
        graph
            .node_types()
            .unwrap()
            .iter()
            .all(|node| !matches!(node, cuweave_driver::graph::GraphNodeType::Other(_)))
    );
    // Never written, so dropping frees at once (no context synchronisation).
    drop(words);
}

#[test]
fn the_recording_check_binds_the_streams_context_for_the_null_stream() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = Arc::clone(&gpu.context);
    // A fresh thread has no current context: the null stream's capture status is asked of the
    // context the check makes current, not refused with CUDA_ERROR_INVALID_CONTEXT.
    let checked = std::thread::spawn(move || {
        assert!(
            cuweave_driver::Context::current_raw().unwrap().is_null(),
            "a new thread starts with no current context"
        );
        // SAFETY: null is the legacy default stream of whichever context is current; the
        // handle does not own it.
        let null = unsafe { Stream::from_raw(&context, std::ptr::null_mut(), false) };
        cuweave_driver::graph::refuse_recording(
            &null,
            cuweave_driver::graph::StatusCheck::Always,
            "test",
            "the null stream is never capturing",
        )
    })
    .join()
    .unwrap();
    checked.expect("the null stream's status is asked in its own context");
}

#[test]
fn pinning_host_memory_on_a_thread_local_capturing_thread_works_and_keeps_the_capture() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let device = cuweave_driver::memory::DeviceAllocation::new(&gpu.context, 64).unwrap();

    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // The driver refuses cuMemHostAlloc on this thread in thread-local mode; cuweave pins in
    // relaxed mode while its capture is active, and the pinning is not recorded.
    let mut pinned = cuweave_driver::memory::HostAllocation::new(
        &gpu.context,
        4096,
        cuweave_driver::memory::HostAllocFlags::default(),
    )
    .unwrap();
    pinned.as_bytes_mut().fill(0x5a);
    assert!(stream.is_capturing().unwrap(), "the capture survived");
    // SAFETY: a live allocation of 64 bytes; the capture records the memset, nothing runs.
    unsafe { cuweave_driver::memory::memset_d8_async(device.ptr(), 0x33, 64, &stream) }.unwrap();
    let graph = stream.end_capture().unwrap();
    assert_eq!(
        graph.node_count().unwrap(),
        1,
        "only the memset was captured"
    );
    let exec = graph
        .instantiate(&cuweave_driver::InstantiateOptions::default())
        .unwrap();
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    let mut back = [0u8; 64];
    // SAFETY: 64 writable bytes from a live 64-byte allocation; the stream was synchronised.
    unsafe { cuweave_driver::memory::copy_dtoh(&gpu.context, back.as_mut_ptr(), device.ptr(), 64) }
        .unwrap();
    assert_eq!(back, [0x33; 64]);
    assert!(pinned.as_bytes().iter().all(|&b| b == 0x5a));
}
