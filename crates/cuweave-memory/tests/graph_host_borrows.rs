//! GPU tests: a host slice of a pinned or unified buffer holds back the launches of the graphs
//! whose captures conflict with it (`HostSlice` / `HostSliceMut` register a
//! `cuweave_driver::graph::HostBorrow`), from any thread, until it is dropped; other graphs
//! launch. And a graph of a tracked capture is refused when launched into another capture.
//!
//! Before, a launch needed no borrow of its graph's buffers: with a shared slice of `output`
//! live, a launch of the graph that copies into `output` was queued, and its copy landed under
//! the host's reads.

use cuweave_driver::graph::{CaptureMode, host_borrowed_captures};
use cuweave_driver::{DriverError, GraphError};
use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer};
use cuweave_memory::{ManagedCapabilities, MemoryError};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

#[path = "common/graph.rs"]
mod graph;
use graph::{capture_graph, instantiate, non_blocking, refused_for_host_borrow};

const LEN: usize = 1 << 18;
/// How long a graph spins before its copy: longer than the checks made while it may run.
const SPIN_NS: u64 = 50_000_000;

#[test]
fn a_graph_that_writes_a_pinned_buffer_waits_out_a_shared_host_slice_of_it() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let stream = non_blocking(ctx);
    let mut source = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    source.fill(7).unwrap();
    let mut output = PinnedBuffer::<u32>::new(ctx, LEN).unwrap();
    let graph = capture_graph(&stream, || {
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        output.copy_from_async(&source, &stream).unwrap();
    });
    let capture = graph.tracked_capture().expect("tracked buffers were used");
    let exec = instantiate(&graph);
    // A graph of another pinned buffer: it launches under the slice.
    let mut other_output = PinnedBuffer::<u32>::new(ctx, 1024).unwrap();
    let mut other_source = DeviceBuffer::<u32>::new(ctx, 1024).unwrap();
    other_source.fill(4).unwrap();
    let other_stream = non_blocking(ctx);
    let other_exec = instantiate(&capture_graph(&other_stream, || {
        other_output
            .copy_from_async(&other_source, &other_stream)
            .unwrap();
    }));

    exec.launch(&stream).unwrap();
    let slice = output.as_slice().unwrap();
    assert!(slice.holds_launches(), "a capture wrote the buffer");
    assert!(slice.iter().all(|&x| x == 7));
    // The next launch would copy 8s into the slice under the host's reads.
    source.fill(8).unwrap();
    assert_eq!(
        refused_for_host_borrow(&exec.launch(&stream)),
        Some(capture)
    );
    std::thread::scope(|s| {
        let refused = s.spawn(|| exec.launch(&stream)).join().unwrap();
        assert_eq!(
            refused_for_host_borrow(&refused),
            Some(capture),
            "a launch from another thread"
        );
    });
    other_exec.launch(&other_stream).unwrap();
    other_stream.synchronize().unwrap();
    assert!(stream.query().unwrap(), "nothing was queued");
    assert!(
        slice.iter().all(|&x| x == 7),
        "the slice changed under the host"
    );
    assert_eq!(host_borrowed_captures(), 1);
    drop(slice);

    assert_eq!(host_borrowed_captures(), 0);
    exec.launch(&stream).unwrap();
    assert!(output.as_slice().unwrap().iter().all(|&x| x == 8));
    assert!(
        other_output.as_slice().unwrap().iter().all(|&x| x == 4),
        "the other graph ran under the slice"
    );
}

#[test]
fn a_graph_that_reads_a_pinned_buffer_launches_under_a_shared_slice_but_not_a_mutable_one() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let stream = non_blocking(ctx);
    let mut input = PinnedBuffer::<u32>::from_slice(ctx, &vec![3u32; LEN]).unwrap();
    let mut result = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    let graph = capture_graph(&stream, || {
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        result.copy_from_async(&input, &stream).unwrap();
    });
    let capture = graph.tracked_capture().expect("tracked buffers were used");
    let exec = instantiate(&graph);

    // Reads on both sides overlap.
    {
        let shared = input.as_slice().unwrap();
        assert!(!shared.holds_launches(), "the capture only read the buffer");
        exec.launch(&stream).unwrap();
        assert!(shared.iter().all(|&x| x == 3));
    }
    assert_eq!(result.to_vec().unwrap(), vec![3u32; LEN]);

    // A host write must not land under the graph's read of it.
    let mut written = input.as_mut_slice().unwrap();
    assert!(written.holds_launches());
    assert_eq!(
        refused_for_host_borrow(&exec.launch(&stream)),
        Some(capture)
    );
    written.fill(5);
    drop(written);
    exec.launch(&stream).unwrap();
    assert_eq!(result.to_vec().unwrap(), vec![5u32; LEN]);
    assert_eq!(host_borrowed_captures(), 0);
}

#[test]
fn a_unified_buffer_that_a_graph_writes_holds_its_launches_while_sliced() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    if !ManagedCapabilities::of(gpu.device)
        .unwrap()
        .concurrent_managed_access
    {
        eprintln!("skipped: host slices of managed memory need concurrent managed access");
        return;
    }
    let kernels = TestKernels::load(ctx).unwrap();
    let stream = non_blocking(ctx);
    let mut source = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    source.fill(11).unwrap();
    let mut managed = UnifiedBuffer::<u32>::new(ctx, LEN).unwrap();
    let graph = capture_graph(&stream, || {
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        managed.copy_from_async(&source, &stream).unwrap();
    });
    let capture = graph.tracked_capture().unwrap();
    let exec = instantiate(&graph);
    exec.launch(&stream).unwrap();
    {
        let slice = managed.as_slice().unwrap();
        assert!(slice.iter().all(|&x| x == 11));
        source.fill(12).unwrap();
        assert_eq!(
            refused_for_host_borrow(&exec.launch(&stream)),
            Some(capture)
        );
        assert!(slice.iter().all(|&x| x == 11));
    }
    {
        let mut slice = managed.as_mut_slice().unwrap();
        assert_eq!(
            refused_for_host_borrow(&exec.launch(&stream)),
            Some(capture)
        );
        slice.fill(1);
    }
    exec.launch(&stream).unwrap();
    assert!(managed.as_slice().unwrap().iter().all(|&x| x == 12));
}

#[test]
fn a_busy_try_slice_leaves_no_borrow_and_many_slices_leave_none_either() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let stream = non_blocking(ctx);
    let mut source = DeviceBuffer::<u32>::new(ctx, 1024).unwrap();
    source.fill(2).unwrap();
    let mut output = PinnedBuffer::<u32>::new(ctx, 1024).unwrap();
    let graph = capture_graph(&stream, || {
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        output.copy_from_async(&source, &stream).unwrap();
    });
    let exec = instantiate(&graph);

    exec.launch(&stream).unwrap();
    assert!(matches!(
        output.try_as_slice().map(|_| ()),
        Err(MemoryError::DeviceBusy { .. })
    ));
    assert!(matches!(
        output.try_as_mut_slice().map(|_| ()),
        Err(MemoryError::DeviceBusy { .. })
    ));
    assert_eq!(host_borrowed_captures(), 0, "a refused slice holds nothing");
    exec.launch(&stream).expect("no borrow is left behind");
    stream.synchronize().unwrap();

    for i in 0..10_000u32 {
        if i % 2 == 0 {
            assert_eq!(output.as_slice().unwrap()[0], 2);
        } else {
            output.try_as_mut_slice().unwrap()[1] = i;
        }
    }
    assert_eq!(host_borrowed_captures(), 0);
    exec.launch(&stream).unwrap();
    assert_eq!(output.as_slice().unwrap()[1], 2);
}

#[test]
fn a_tracked_graph_is_refused_into_another_capture_and_the_capture_stays_valid() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let stream = non_blocking(ctx);
    let mut data = DeviceBuffer::<u32>::new(ctx, 1024).unwrap();
    let graph = capture_graph(&stream, || data.fill_async(6, &stream).unwrap());
    let capture = graph.tracked_capture().unwrap();
    let exec = instantiate(&graph);

    let outer = non_blocking(ctx);
    outer.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let refused = exec.launch(&outer);
    assert!(
        matches!(
            refused,
            Err(DriverError::Graph(GraphError::TrackedGraphInCapture { capture: c })) if c == capture
        ),
        "{refused:?}"
    );
    let outer_graph = outer.end_capture().expect("the capture was not broken");
    assert_eq!(outer_graph.node_count().unwrap(), 0, "nothing was queued");
    drop(outer_graph);

    exec.launch(&stream).unwrap();
    assert_eq!(data.to_vec().unwrap(), vec![6u32; 1024]);
}
