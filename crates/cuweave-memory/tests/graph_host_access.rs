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

/// A zeroed pinned buffer `output` and the executable of a graph that spins for [`SPIN_NS`],
/// then copies `source` (every element `value`) into it, captured on `stream`.
struct GraphWritesPinned {
    stream: Stream,
    output: PinnedBuffer<u32>,
    exec: cuweave_driver::GraphExec,
    /// What the graph copies from: kept alive as long as the executable (bind it, not `..`).
    _source: DeviceBuffer<u32>,
}

impl GraphWritesPinned {
    fn new(ctx: &std::sync::Arc<cuweave_driver::Context>, value: u32) -> Self {
        let kernels = TestKernels::load(ctx).unwrap();
        let stream = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
        let mut source = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
        source.fill(value).unwrap();
        let mut output = PinnedBuffer::<u32>::new(ctx, LEN).unwrap();
        stream
            .begin_capture_synchronized(CaptureMode::ThreadLocal)
            .unwrap();
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        output.copy_from_async(&source, &stream).unwrap();
        let graph = stream.end_capture().unwrap();
        assert!(graph.node_count().unwrap() >= 2, "spin and copy captured");
        let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
        Self {
            stream,
            output,
            exec,
            _source: source,
        }
    }
}

#[test]
fn host_access_to_a_pinned_buffer_waits_for_the_graph_launches_that_write_it() {
    let _serial = serial();
    let gpu = require_gpu!();
    let GraphWritesPinned {
        stream,
        mut output,
        exec,
        _source,
    } = GraphWritesPinned::new(&gpu.context, 7);

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
    let GraphWritesPinned {
        stream,
        output,
        exec,
        _source,
    } = GraphWritesPinned::new(&gpu.context, 9);
    let other = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();

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
