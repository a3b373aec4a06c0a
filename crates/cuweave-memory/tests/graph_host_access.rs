//! GPU tests: host access to a pinned buffer that a graph copies into waits for the graph's
//! launches, which record no uses on the buffer (its tracker saw the capture, not the
//! launches); and eager device work on another stream waits for them too, through the fences
//! the launches leave (`cuweave_driver::graph::wait_for_graph_launches`); and a launch waits for
//! the eager work on another stream that it conflicts with (`fence_eager_use`).

use std::sync::{Mutex, MutexGuard, PoisonError};

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::{GraphExec, InstantiateOptions, Stream};
use cuweave_memory::MemoryError;
use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

#[path = "common/graph.rs"]
mod graph;
use graph::{capture_graph, instantiate, non_blocking};

const LEN: usize = 1 << 20;
/// How long the graph's kernel spins before its copy: far longer than a host access takes.
const SPIN_NS: u64 = 200_000_000;

/// Serializes this file's tests: a capture active in one makes the other's context waits a
/// typed refusal.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// [`capture_graph`], instantiated.
fn capture_exec(stream: &Stream, record: impl FnOnce()) -> GraphExec {
    instantiate(&capture_graph(stream, record))
}

/// A zeroed pinned buffer `output` and the executable of a graph that spins for [`SPIN_NS`],
/// then copies `source` (every element `value`) into it, captured on `stream`.
struct GraphWritesPinned {
    stream: Stream,
    output: PinnedBuffer<u32>,
    exec: GraphExec,
    /// What the graph copies from: kept alive as long as the executable (bind it, not `..`).
    _source: DeviceBuffer<u32>,
}

impl GraphWritesPinned {
    fn new(ctx: &std::sync::Arc<cuweave_driver::Context>, value: u32) -> Self {
        let kernels = TestKernels::load(ctx).unwrap();
        let stream = non_blocking(ctx);
        let mut source = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
        source.fill(value).unwrap();
        let mut output = PinnedBuffer::<u32>::new(ctx, LEN).unwrap();
        let graph = capture_graph(&stream, || {
            kernels.spin_ns(&stream, SPIN_NS).unwrap();
            output.copy_from_async(&source, &stream).unwrap();
        });
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
    let other = non_blocking(&gpu.context);

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

/// A graph that spins, then fills a device buffer with 7, launched on one stream; eager work
/// on another stream right after the launch is ordered after it: a download reads the 7s (not
/// what was there before), and a fill of 9 lands after the graph's fill, so 9 stays. A graph
/// that does not use the buffer, spinning on a third stream, is not waited for.
#[test]
fn eager_work_on_another_stream_waits_for_the_graph_launches_that_use_the_buffer() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let (graph_stream, other) = (non_blocking(ctx), non_blocking(ctx));
    let mut data = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    let graph = capture_graph(&graph_stream, || {
        kernels.spin_ns(&graph_stream, SPIN_NS).unwrap();
        data.fill_async(7, &graph_stream).unwrap();
    });
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    assert!(
        graph.tracked_capture().is_some(),
        "a tracked buffer was used"
    );
    // A graph of another buffer, spinning long: eager work on `data` does not wait for it.
    let (unrelated_stream, mut unrelated) = (
        non_blocking(ctx),
        DeviceBuffer::<u32>::new(ctx, 1024).unwrap(),
    );
    let unrelated_exec = capture_exec(&unrelated_stream, || {
        kernels.spin_ns(&unrelated_stream, 5 * SPIN_NS).unwrap();
        unrelated.fill_async(5, &unrelated_stream).unwrap();
    });
    unrelated_exec.launch(&unrelated_stream).unwrap();

    // A reader on another stream.
    data.fill(1).unwrap();
    exec.launch(&graph_stream).unwrap();
    let read = data
        .copy_to_host_async(vec![0u32; LEN], &other)
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        read.iter().all(|&x| x == 7),
        "the download on another stream overlapped the graph's launch: read {}",
        read[0]
    );
    assert!(
        !unrelated_stream.query().unwrap(),
        "the download waited for a graph that does not use its buffer"
    );

    // A writer on another stream.
    exec.launch(&graph_stream).unwrap();
    data.fill_async(9, &other).unwrap();
    other.synchronize().unwrap();
    graph_stream.synchronize().unwrap();
    unrelated_stream.synchronize().unwrap();
    assert!(
        data.to_vec().unwrap().iter().all(|&x| x == 9),
        "the graph's fill landed after the later eager fill on another stream"
    );

    // The fences stay bounded: one per stream that launched, and finished ones (of streams
    // since dropped) are pruned.
    let mut scratch = DeviceBuffer::<u32>::new(ctx, 1024).unwrap();
    let quick = capture_exec(&graph_stream, || {
        scratch.fill_async(3, &graph_stream).unwrap()
    });
    for _ in 0..64 {
        let launcher = non_blocking(ctx);
        quick.launch(&launcher).unwrap();
        launcher.synchronize().unwrap();
    }
    let fences = cuweave_driver::graph::graph_launch_fences();
    assert!(
        fences <= cuweave_driver::graph::PRUNE_FENCES_AT,
        "{fences} fences kept after 64 launching streams"
    );
    assert_eq!(scratch.to_vec().unwrap(), vec![3u32; 1024]);
}

/// The other direction: a graph launched on one stream is ordered after the eager work on
/// another stream that it conflicts with, as two eager operations would be. A graph that copies
/// `input` into `output` reads the 7s an eager fill queued behind a spin wrote (not the 1s from
/// before); a graph that overwrites `input` waits for an eager copy out of it behind a spin,
/// which reads the 7s (not the graph's 5s). A graph that only reads `input` overlaps an eager
/// read of it, and a graph that fills one half of it an eager fill of the other half. The fences
/// stay bounded over many writing streams.
#[test]
fn a_graph_launch_waits_for_the_eager_work_on_another_stream_that_it_conflicts_with() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let (graph_stream, other) = (non_blocking(ctx), non_blocking(ctx));
    let mut input = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    let mut output = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    input.fill(1).unwrap();
    output.fill(0).unwrap();
    let copy = capture_exec(&graph_stream, || {
        output.copy_from_async(&input, &graph_stream).unwrap()
    });
    let overwrite = capture_exec(&graph_stream, || {
        input.fill_async(5, &graph_stream).unwrap()
    });

    // Read after an eager write.
    kernels.spin_ns(&other, SPIN_NS).unwrap();
    input.fill_async(7, &other).unwrap();
    copy.launch(&graph_stream).unwrap();
    graph_stream.synchronize().unwrap();
    assert!(
        output.to_vec().unwrap().iter().all(|&x| x == 7),
        "the graph read its input before the eager write on another stream landed"
    );

    // Write after an eager read (a device-to-device copy: a download into pageable memory
    // would return only once it has run).
    let mut scratch = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    kernels.spin_ns(&other, SPIN_NS).unwrap();
    scratch.copy_from_async(&input, &other).unwrap();
    overwrite.launch(&graph_stream).unwrap();
    other.synchronize().unwrap();
    graph_stream.synchronize().unwrap();
    let read = scratch.to_vec().unwrap();
    assert!(
        read.iter().all(|&x| x == 7),
        "the graph overwrote its input before the eager copy on another stream read it: read {}",
        read[0]
    );
    assert!(input.to_vec().unwrap().iter().all(|&x| x == 5));

    // Reads overlap: a graph that only reads the input does not wait for an eager read.
    kernels.spin_ns(&other, SPIN_NS).unwrap();
    scratch.copy_from_async(&input, &other).unwrap();
    copy.launch(&graph_stream).unwrap();
    graph_stream.synchronize().unwrap();
    assert!(
        !other.query().unwrap(),
        "a graph that only reads its input waited for an eager read of it"
    );
    other.synchronize().unwrap();
    assert!(scratch.to_vec().unwrap().iter().all(|&x| x == 5));
    assert!(output.to_vec().unwrap().iter().all(|&x| x == 5));

    // Disjoint bytes are not ordered: a graph that fills the first half does not wait for an
    // eager fill of the second half.
    let half = LEN / 2;
    let first_half = capture_exec(&graph_stream, || {
        input
            .slice_mut(..half)
            .unwrap()
            .fill_async(3, &graph_stream)
            .unwrap()
    });
    kernels.spin_ns(&other, SPIN_NS).unwrap();
    input
        .slice_mut(half..)
        .unwrap()
        .fill_async(4, &other)
        .unwrap();
    first_half.launch(&graph_stream).unwrap();
    graph_stream.synchronize().unwrap();
    assert!(
        !other.query().unwrap(),
        "a graph that fills one half waited for an eager fill of the other half"
    );
    other.synchronize().unwrap();
    let halves = input.to_vec().unwrap();
    assert!(halves[..half].iter().all(|&x| x == 3) && halves[half..].iter().all(|&x| x == 4));

    // Bounded: one fence per (stream, capture) pair, the finished ones pruned.
    for value in 0..64u32 {
        let writer = non_blocking(ctx);
        input.fill_async(value, &writer).unwrap();
        writer.synchronize().unwrap();
    }
    let fences = cuweave_driver::graph::eager_use_fences();
    assert!(
        fences <= cuweave_driver::graph::PRUNE_FENCES_AT,
        "{fences} eager fences kept after 64 writing streams"
    );
    copy.launch(&graph_stream).unwrap();
    graph_stream.synchronize().unwrap();
    assert!(output.to_vec().unwrap().iter().all(|&x| x == 63));
}
