//! GPU tests: host access to a pinned buffer that a graph copies into waits for the graph's
//! launches, which record no uses on the buffer (its tracker saw the capture, not the
//! launches).

use std::sync::{Mutex, MutexGuard, PoisonError};

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::{InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::MemoryError;
use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const LEN: usize = 1 << 20;
/// How long the graph's kernel spins before its copy: far longer than a host access takes.
const SPIN_NS: u64 = 200_000_000;

/// Serializes this file's tests: a capture active in one makes the other's context waits a
/// typed refusal.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A graph that spins for [`SPIN_NS`], then copies `source` into `output`, and its executable.
fn spin_then_copy_graph(
    kernels: &TestKernels,
    stream: &Stream,
    source: &DeviceBuffer<u32>,
    output: &mut PinnedBuffer<u32>,
) -> cuweave_driver::GraphExec {
    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    kernels.spin_ns(stream, SPIN_NS).unwrap();
    output.copy_from_async(source, stream).unwrap();
    let graph = stream.end_capture().unwrap();
    assert!(graph.node_count().unwrap() >= 2, "spin and copy captured");
    graph.instantiate(&InstantiateOptions::default()).unwrap()
}

#[test]
fn host_access_to_a_pinned_buffer_waits_for_the_graph_launches_that_write_it() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let stream = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
    let mut source = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    source.fill(7).unwrap();
    let mut output = PinnedBuffer::<u32>::new(ctx, LEN).unwrap();
    let exec = spin_then_copy_graph(&kernels, &stream, &source, &mut output);

    // A read right after a launch sees what the graph's copy wrote, never the zeros before it.
    exec.launch(&stream).unwrap();
    assert!(
        matches!(output.try_as_slice(), Err(MemoryError::DeviceBusy { .. })),
        "a launch that copies into the buffer may still run"
    );
    assert!(
        output.as_slice().unwrap().iter().all(|&x| x == 7),
        "the host read the buffer under the graph's copy"
    );
    // That wait covered the launch: the buffer is idle until the next one.
    assert!(output.try_as_slice().is_ok());
    assert!(output.is_idle().unwrap());

    // A host write after a launch lands after the graph's copy, not under it (the copy would
    // overwrite it with 7s).
    exec.launch(&stream).unwrap();
    assert!(!output.is_idle().unwrap());
    output.as_mut_slice().unwrap().fill(1);
    stream.synchronize().unwrap();
    assert!(
        output.as_slice().unwrap().iter().all(|&x| x == 1),
        "the graph's copy overwrote a host write made after the launch"
    );
    drop(exec);
}

#[test]
fn a_wait_for_graph_launches_during_another_capture_is_a_typed_refusal() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let stream = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
    let other = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
    let mut source = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    source.fill(9).unwrap();
    let mut output = PinnedBuffer::<u32>::new(ctx, LEN).unwrap();
    let exec = spin_then_copy_graph(&kernels, &stream, &source, &mut output);

    exec.launch(&stream).unwrap();
    // Waiting for the launch means a context synchronisation, which would wait on the capturing
    // stream too: refused, and the capture stays valid.
    other.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let refused = output.as_slice().map(|_| ()).unwrap_err();
    assert!(refused.is_capture_refusal(), "{refused}");
    let graph = other.end_capture().expect("the capture was not broken");
    drop(graph);
    assert!(output.as_slice().unwrap().iter().all(|&x| x == 9));
    drop(exec);
}
