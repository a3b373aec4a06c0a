//! GPU tests of buffer operations on a capturing stream: those a capture cannot hold (copies with
//! pageable host memory, copies that return once landed, fills no memset can write) are refused
//! with [`MemoryError::NotCapturable`] before they touch the stream, and the capture goes on: a
//! memset captured after them is replayed by the graph. Copies with pinned host memory are
//! captured, and the graph reads and writes that memory at every launch.

use std::sync::{Mutex, MutexGuard, PoisonError};

use cuweave_driver::graph::{CaptureMode, CaptureStatus};
use cuweave_driver::{InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer};
use cuweave_memory::{HostCopyError, MemoryError};
use cuweave_test_support::require_gpu;

const LEN: usize = 4096;

/// Serializes this file's tests: a capture begun while another test's capture is active skips
/// the context synchronisation that lets it drop earlier eager uses.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `result` is a `NotCapturable` refusal of `operation`.
fn assert_refused<T: std::fmt::Debug>(result: cuweave_memory::Result<T>, operation: &str) {
    match result {
        Err(error @ MemoryError::NotCapturable { operation: op, .. }) => {
            assert_eq!(op, operation, "{error}");
            assert!(error.is_capture_refusal());
        }
        other => panic!("{operation}: expected NotCapturable, got {other:?}"),
    }
}

/// `result` is a `NotCapturable` refusal of `operation` that hands the host side back; returns
/// it.
fn refused_host<T: std::fmt::Debug, H>(result: Result<T, HostCopyError<H>>, operation: &str) -> H {
    let (error, host) = match result {
        Err(refused) => refused.into_parts(),
        Ok(other) => panic!("{operation}: expected NotCapturable, got {other:?}"),
    };
    assert_refused::<()>(Err(error), operation);
    host.unwrap_or_else(|| panic!("{operation}: the refusal kept the host side"))
}

fn assert_capture_active(stream: &Stream) {
    let status = stream.capture_status().unwrap();
    assert!(
        matches!(status, CaptureStatus::Active { .. }),
        "the capture was broken: {status:?}"
    );
}

#[test]
fn uncapturable_operations_are_refused_and_the_capture_survives() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let stream = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
    let mut words = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    let mut wide = DeviceBuffer::<u64>::new(ctx, LEN).unwrap();
    words.fill(1).unwrap();
    wide.fill(2).unwrap();

    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    // Pageable host sides, both directions, owned as Vec and Box: each refusal hands the host
    // side back, unchanged, for the caller to use once the capture has ended.
    let upload = refused_host(
        words.copy_from_host_async(vec![5u32; LEN], &stream),
        "Buffer::copy_range_from_host_async",
    );
    assert_eq!(upload, vec![5u32; LEN]);
    let boxed = refused_host(
        words.copy_from_host_async(vec![5u32; LEN].into_boxed_slice(), &stream),
        "Buffer::copy_range_from_host_async",
    );
    assert_eq!(&*boxed, &[5u32; LEN][..]);
    let sink = refused_host(
        words.copy_to_host_async(vec![9u32; LEN], &stream),
        "Buffer::copy_range_to_host_async",
    );
    assert_eq!(sink, vec![9u32; LEN]);
    refused_host(
        words.copy_range_to_host_async(1, vec![0u32; 3].into_boxed_slice(), &stream),
        "Buffer::copy_range_to_host_async",
    );
    // Copies that return once landed, pageable or pinned.
    refused_host(
        words.copy_range_from_host_on(0, vec![5u32; 8], &stream),
        "Buffer::copy_range_from_host_on",
    );
    let pinned = PinnedBuffer::from_slice(ctx, &[5u32; 8]).unwrap();
    // A borrowed pinned buffer is still the caller's: its refusal is the MemoryError alone.
    assert_refused(
        words.copy_range_from_host_on(0, &pinned, &stream),
        "Buffer::copy_range_from_host_on",
    );
    // Staged chunks from pageable memory.
    let staged = words
        .staged_write(0, 8, std::slice::from_ref(&stream), |write| {
            write.copy_in(0, 0, vec![5u32; 8]).map(|_| ())
        })
        .unwrap();
    assert_refused(staged, "StagedWrite::copy_in");
    // A value no memset can write (a u64 whose halves differ): the host-staged pattern path.
    assert_refused(
        wide.fill_async(0x1122_3344_5566_7788, &stream),
        "Buffer::fill_async",
    );
    assert_refused(
        wide.slice_mut(1..4)
            .unwrap()
            .fill_async(0x1122_3344_5566_7788, &stream),
        "Buffer::fill_async",
    );
    assert_capture_active(&stream);

    // The capture is intact: memsets captured after the refusals replay.
    words.fill_async(0x0a0b_0c0d, &stream).unwrap();
    wide.fill_async(0x0707_0707_0707_0707, &stream).unwrap();
    assert_capture_active(&stream);
    let graph = stream.end_capture().unwrap();
    assert!(
        graph.node_count().unwrap() >= 2,
        "both memsets were captured"
    );
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    assert_eq!(
        words.to_vec().unwrap(),
        vec![1; LEN],
        "nothing ran while capturing"
    );
    assert_eq!(wide.to_vec().unwrap(), vec![2; LEN]);
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(words.to_vec().unwrap(), vec![0x0a0b_0c0d; LEN]);
    assert_eq!(wide.to_vec().unwrap(), vec![0x0707_0707_0707_0707; LEN]);

    // Off the capture, the refused operations run, on the host sides they handed back.
    words
        .copy_from_host_async(upload, &stream)
        .unwrap()
        .wait()
        .unwrap();
    let sink = words
        .copy_to_host_async(sink, &stream)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(sink, vec![5u32; LEN]);
    drop(boxed);
    wide.fill_async(0x1122_3344_5566_7788, &stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(words.to_vec().unwrap(), vec![5; LEN]);
    assert_eq!(wide.to_vec().unwrap(), vec![0x1122_3344_5566_7788; LEN]);
}

#[test]
fn pinned_host_copies_are_captured_and_use_the_host_memory_at_every_launch() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let stream = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
    let mut device = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    device.fill(0).unwrap();
    let mut input = PinnedBuffer::from_slice(ctx, &[9u32; LEN]).unwrap();
    let mut output = PinnedBuffer::<u32>::new(ctx, LEN).unwrap();

    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let up = device.copy_from_host_async(&input, &stream).unwrap();
    assert!(up.is_captured());
    assert!(
        up.is_complete().unwrap(),
        "a captured copy has nothing to wait for"
    );
    up.wait().unwrap();
    let down = device.copy_to_host_async(&mut output, &stream).unwrap();
    assert!(down.is_captured());
    down.wait().unwrap();
    assert_capture_active(&stream);
    let graph = stream.end_capture().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    assert!(
        output.as_slice().unwrap().iter().all(|&x| x == 0),
        "nothing ran while capturing"
    );

    // Each launch reads the input's current contents and writes the output.
    for round in [11u32, 12, 13] {
        input.as_mut_slice().unwrap().fill(round);
        exec.launch(&stream).unwrap();
        stream.synchronize().unwrap();
        assert!(
            output.as_slice().unwrap().iter().all(|&x| x == round),
            "launch with input {round}"
        );
    }
    assert_eq!(device.to_vec().unwrap(), vec![13; LEN]);
    drop(exec);
    drop(graph);
}
