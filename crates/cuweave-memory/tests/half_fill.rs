//! GPU tests of 16-bit fills (`cuMemsetD16`): a `u16` view that starts 2 bytes in and holds an
//! odd number of elements, where a word memset cannot be used, is filled with a value whose bytes
//! differ (no byte memset either): every element inside takes it, the neighbours keep theirs.
//! The same fill is a memset a stream capture can hold: captured, replayed, checked.

use std::sync::{Mutex, MutexGuard, PoisonError};

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::{InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::buffer::{Buffer, DeviceBuffer};
use cuweave_test_support::require_gpu;

const LEN: usize = 8;
const BACKGROUND: u16 = 0xeeee;

/// Serializes this file's tests: one captures, and a capture begun while another test works
/// eagerly on the context is harder to reason about.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Elements 1..6 hold `inside`, the others [`BACKGROUND`].
fn expected(inside: u16) -> Vec<u16> {
    (0..LEN)
        .map(|i| {
            if (1..6).contains(&i) {
                inside
            } else {
                BACKGROUND
            }
        })
        .collect()
}

#[test]
fn u16_view_two_bytes_in_with_an_odd_length_is_filled_exactly() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let stream = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
    let mut buffer = DeviceBuffer::<u16>::new(ctx, LEN).unwrap();
    buffer.fill(BACKGROUND).unwrap();

    // Blocking, then on a stream.
    buffer.slice_mut(1..6).unwrap().fill(0x1234).unwrap();
    assert_eq!(buffer.to_vec().unwrap(), expected(0x1234));
    buffer
        .slice_mut(1..6)
        .unwrap()
        .fill_async(0xa55a, &stream)
        .unwrap();
    stream.synchronize().unwrap();
    assert_eq!(buffer.to_vec().unwrap(), expected(0xa55a));
}

#[test]
fn u16_view_fill_is_captured_and_replayed() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let stream = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
    let mut buffer = DeviceBuffer::<u16>::new(ctx, LEN).unwrap();
    buffer.fill(BACKGROUND).unwrap();

    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    // A 16-bit memset: before cuMemsetD16 it took the host-staged pattern path, refused here.
    buffer
        .slice_mut(1..6)
        .unwrap()
        .fill_async(0x1234, &stream)
        .unwrap();
    let graph = stream.end_capture().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    assert_eq!(
        buffer.to_vec().unwrap(),
        vec![BACKGROUND; LEN],
        "nothing ran while capturing"
    );

    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(buffer.to_vec().unwrap(), expected(0x1234));

    // A replay after the elements changed writes them again, and only them.
    buffer.fill(BACKGROUND).unwrap();
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(buffer.to_vec().unwrap(), expected(0x1234));
    drop(exec);
    drop(graph);
}
