//! Probes of `copy_peer_async` (a copy between buffers of two devices, or one, ordered on a
//! stream of each device with no host wait) from what users of PyTorch's
//! `tensor.to(other, non_blocking=True)`, RMM and cudarc do around it, beyond
//! `peer_async.rs`: a third stream reading the destination, host access to pinned and unified
//! buffers on either side, two views of one buffer as source and destination, the legacy default
//! stream as either stream, cached and stream-ordered-pool sources dropped (with their streams)
//! and a cached destination dropped
//! at once, graph launches that write the source before and after the copy, another thread's
//! global-mode capture, 10^4 copies on streams that come and go kept bounded, and a stream of
//! the wrong device. Each ordering is proven with a gate kernel that holds a stream until the
//! host opens it; bytes are checked exactly. The two-device test skips, with its reason, on one
//! GPU.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::{
    Context, Device, EventPool, GraphExec, InstantiateOptions, Stream, StreamFlags,
};
use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer, copy_peer_async};
use cuweave_memory::{
    AsyncPoolResource, CachingAllocator, DriverResource, ManagedCapabilities, MemoryError,
    MemoryResource,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{poll_until, require_gpu, serial, skip};

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

/// Elements copied (1 MiB of `u32`).
const N: usize = 1 << 18;

/// How long a condition the host waits for may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(30);

/// Most uses a buffer's tracker keeps (its `MAX_USES`, 32), plus the one being recorded.
const TRACKED_BOUND: usize = 33;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream")
}

fn pattern(seed: u32) -> Vec<u32> {
    (0..N as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed))
        .collect()
}

/// Asserts `got` equals `want` element for element, naming the first difference.
fn assert_same(got: &[u32], want: &[u32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(at) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!(
            "{what}: element {at} is {:#x}, expected {:#x}",
            got[at], want[at]
        );
    }
}

fn assert_busy<T>(result: cuweave_memory::Result<T>, what: &str) {
    match result {
        Err(MemoryError::DeviceBusy { .. }) => {}
        Err(other) => panic!("{what}: expected DeviceBusy, got {other:?}"),
        Ok(_) => panic!("{what}: host access granted while the held peer copy still uses it"),
    }
}

/// Whether device 0 has managed memory with concurrent access (host slices of a unified buffer
/// need it); prints a skip line otherwise.
fn managed_usable(device: Device, test: &str) -> bool {
    let capabilities = ManagedCapabilities::of(device).expect("capabilities");
    if capabilities.managed_memory && capabilities.concurrent_managed_access {
        true
    } else {
        skip(test, "no managed memory with concurrent access on device 0");
        false
    }
}

/// The executable of what `record` queues on `stream`, captured after a context
/// synchronisation (as `torch.cuda.graph` does).
fn capture_exec(stream: &Stream, record: impl FnOnce()) -> GraphExec {
    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .expect("begin capture");
    record();
    let graph = stream.end_capture().expect("end capture");
    assert!(
        graph.tracked_capture().is_some(),
        "the capture used a tracked buffer"
    );
    graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate")
}

/// Pipeline parallelism: stage two's consumer copies the activations out on its own stream,
/// and a third stream (a logger, an all-reduce bucket) reads the destination right after the
/// call, by a device copy. The copy's stream is held by a gate. Checks: the third stream's read
/// waits for the copy (still busy while the gate holds); a host read of the *source* right after
/// the call does not wait for the copy (reads overlap: the copy is still held once it returns);
/// the third stream's copy gets the source's bytes exactly.
#[test]
fn a_third_stream_reading_the_destination_waits_while_a_host_read_of_the_source_does_not() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (source_stream, consumer, logger) = (stream(context), stream(context), stream(context));
    let data = pattern(101);
    let src = DeviceBuffer::from_slice(context, &data).expect("source");
    let mut dst = DeviceBuffer::<u32>::zeroed(context, N).expect("destination");
    let mut logged = DeviceBuffer::<u32>::zeroed(context, N).expect("logged");
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream).expect("queued");
    assert!(
        !source_stream.query().expect("query"),
        "work queued on the source stream after the call runs after the held copy"
    );
    logged
        .copy_from_async(&dst, &logger)
        .expect("third stream's read queued");
    assert!(
        !logger.query().expect("query"),
        "the third stream's read of the destination waits for the held copy"
    );
    let host_copy = src.to_vec().expect("host read of the source");
    assert_same(&host_copy, &data, "the host read of the source");
    assert!(
        !consumer.query().expect("query"),
        "the host read of the source returned without waiting for the held copy's read"
    );
    gate.open();
    logger.synchronize().expect("logger");
    assert_same(
        &logged.to_vec().expect("logged"),
        &data,
        "what the third stream read",
    );
    assert_same(&dst.to_vec().expect("destination"), &data, "destination");
}

/// A data loader hands a batch from a unified (managed) buffer to the GPU with a non-blocking
/// copy, then wants to refill the batch from the host at once. The copy is held by a gate.
/// Checks: a host write slice of the unified source is `DeviceBusy` until the copy has read it
/// (the read is recorded behind the copy on the source stream), a host read slice is granted
/// at once (reads overlap), and once the gate opens the write goes through, while the
/// destination keeps the old batch exactly.
#[test]
fn a_unified_source_is_not_handed_to_a_host_writer_before_the_copy_has_read_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    if !managed_usable(
        gpu.device,
        "a_unified_source_is_not_handed_to_a_host_writer_before_the_copy_has_read_it",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (source_stream, consumer) = (stream(context), stream(context));
    let old = pattern(7);
    let mut src = UnifiedBuffer::from_slice(context, &old).expect("unified source");
    let mut dst = DeviceBuffer::<u32>::zeroed(context, N).expect("destination");
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream).expect("queued");
    assert_busy(
        src.try_as_mut_slice(),
        "a host write of the unified source before the held copy read it",
    );
    {
        let read = src
            .try_as_slice()
            .expect("a host read beside the copy's device read");
        assert_same(&read, &old, "the host read of the unified source");
    }
    gate.open();
    assert!(
        poll_until(PATIENCE, || src.try_as_mut_slice().is_ok()),
        "the unified source stayed busy after the copy ran"
    );
    src.as_mut_slice()
        .expect("host write")
        .copy_from_slice(&pattern(8));
    assert_same(&dst.to_vec().expect("destination"), &old, "destination");
    assert_same(
        &src.to_vec().expect("source"),
        &pattern(8),
        "refilled source",
    );
}

/// The other direction of a host staging pair: activations go from the device into a pinned
/// buffer on the consumer stream (PyTorch's `.to("cpu", non_blocking=True)` into pinned memory),
/// and a pinned source goes to the device and is dropped at once while new pinned buffers of the
/// same size are taken and written by the host. Checks: the pinned destination's host slice is
/// `DeviceBusy` while the held copy may write it, and then holds the bytes exactly; the dropped
/// pinned source's block is not handed to the new buffers (whose host writes would land under
/// the held copy): the device destination gets the dropped buffer's bytes exactly.
#[test]
fn pinned_buffers_on_either_side_are_held_until_the_copy_is_done_with_them() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (source_stream, consumer) = (stream(context), stream(context));

    // Device -> pinned.
    let data = pattern(31);
    let src = DeviceBuffer::from_slice(context, &data).expect("device source");
    let mut pinned_dst = PinnedBuffer::<u32>::zeroed(context, N).expect("pinned destination");
    // First without a gate, so that a refusal fails fast instead of draining a held stream.
    copy_peer_async(&mut pinned_dst, 0, &src, 0, N, &consumer, &source_stream).unwrap_or_else(
        |error| {
            panic!(
                "copy_peer_async accepted a PinnedBuffer destination (it is a Buffer) and failed: \
                 {error}"
            )
        },
    );
    assert_same(
        &pinned_dst.as_slice().expect("pinned destination"),
        &data,
        "pinned destination, ungated",
    );
    pinned_dst.as_mut_slice().expect("host write").fill(0);
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut pinned_dst, 0, &src, 0, N, &consumer, &source_stream)
        .expect("device to pinned queued");
    assert_busy(
        pinned_dst.try_as_slice(),
        "a host read of the pinned destination before the held copy wrote it",
    );
    gate.open();
    assert!(
        poll_until(PATIENCE, || pinned_dst.try_as_slice().is_ok()),
        "the pinned destination stayed busy after the copy ran"
    );
    assert_same(
        &pinned_dst.as_slice().expect("pinned destination"),
        &data,
        "pinned destination",
    );

    // Pinned -> device, the pinned source dropped at once.
    let staged = pattern(32);
    let pinned_src = PinnedBuffer::from_slice(context, &staged).expect("pinned source");
    let mut dst = DeviceBuffer::<u32>::zeroed(context, N).expect("device destination");
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut dst, 0, &pinned_src, 0, N, &consumer, &source_stream)
        .expect("pinned to device queued");
    drop(pinned_src);
    let mut reused = Vec::new();
    for round in 0..4u32 {
        let mut next = PinnedBuffer::<u32>::new(context, N).expect("next pinned buffer");
        next.as_mut_slice()
            .expect("a fresh pinned buffer is the host's")
            .fill(0xBAD0_0000 + round);
        reused.push(next);
    }
    gate.open();
    assert_same(
        &dst.to_vec().expect("device destination"),
        &staged,
        "the device destination of the dropped pinned source",
    );
    for (round, next) in reused.iter().enumerate() {
        assert!(
            next.as_slice()
                .expect("later pinned buffer")
                .iter()
                .all(|&v| v == 0xBAD0_0000 + round as u32),
            "later pinned buffer {round} was changed"
        );
    }
}

/// One buffer as both sides: a ring buffer shifting its head into its tail (`split_at_mut`
/// halves, which safe code can hold at once), and the overlapping case, which safe code can
/// only reach through two shared views. Checks: a shared view as the destination is
/// `ReadOnlyView` and writes nothing; the disjoint halves copy exactly, and a write of the head
/// on a third stream right after waits for the held copy to have read it.
#[test]
fn one_buffer_as_source_and_destination_through_views() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (source_stream, consumer, writer) = (stream(context), stream(context), stream(context));
    let data = pattern(55);
    let mut ring = DeviceBuffer::from_slice(context, &data).expect("ring");
    let half = N / 2;

    // Overlapping: two shared views of the whole buffer.
    {
        let whole = ring.slice(..).expect("shared view");
        let mut also_whole = ring.slice(..).expect("second shared view");
        let refused = copy_peer_async(
            &mut also_whole,
            1,
            &whole,
            0,
            N - 1,
            &consumer,
            &source_stream,
        );
        assert!(
            matches!(refused, Err(MemoryError::ReadOnlyView { .. })),
            "a copy into a shared view of its own source: {refused:?}"
        );
    }
    assert_same(
        &ring.to_vec().expect("ring"),
        &data,
        "the ring after the refused copy",
    );

    // Disjoint halves, held; the head overwritten right after.
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    {
        let (mut head, mut tail) = ring.split_at_mut(half).expect("halves");
        copy_peer_async(&mut tail, 0, &head, 0, half, &consumer, &source_stream)
            .expect("head into tail queued");
        head.fill_async(0xABCD, &writer)
            .expect("overwrite of the head queued");
    }
    assert!(
        !writer.query().expect("query"),
        "the overwrite of the head waits for the held copy's read of it"
    );
    gate.open();
    let back = ring.to_vec().expect("ring");
    assert!(
        back[..half].iter().all(|&v| v == 0xABCD),
        "head overwritten"
    );
    assert_same(&back[half..], &data[..half], "tail holds the old head");
}

/// cudarc's `default_stream()` / CUDA C++'s stream 0 on either side: a program that queues its
/// consumer work on the legacy default stream, and one that names it as the source's stream.
/// Checks: with the legacy stream as the destination stream, the copy waits device-side for the
/// producer's gated write on a non-blocking stream (the legacy stream is still busy while the
/// gate holds) and then lands exactly; with it as the source stream, a later writer of the
/// source on a non-blocking stream waits for the held copy, and the destination gets the old
/// bytes.
#[test]
fn the_legacy_default_stream_as_either_stream_keeps_the_orderings() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let legacy = Stream::legacy_default(context);
    let (producer, source_stream, consumer, writer) = (
        stream(context),
        stream(context),
        stream(context),
        stream(context),
    );

    // Legacy as the destination stream.
    let mut src = DeviceBuffer::<u32>::new_on(&producer, N).expect("source");
    let mut dst = DeviceBuffer::<u32>::zeroed(context, N).expect("destination");
    let gate = Gate::new(context);
    gate.hold(&kernels, &producer);
    src.fill_async(0x1E6A, &producer).expect("gated write");
    copy_peer_async(&mut dst, 0, &src, 0, N, &legacy, &source_stream).expect("on legacy");
    assert!(
        !legacy.query().expect("query"),
        "the copy on the legacy stream waits for the gated write of its source"
    );
    gate.open();
    assert_eq!(dst.to_vec().expect("destination"), vec![0x1E6A; N]);

    // Legacy as the source stream.
    let old = pattern(9);
    src.copy_from_host(&old).expect("upload");
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &legacy).expect("legacy as source");
    src.fill_async(0xF00D, &writer).expect("overwrite queued");
    assert!(
        !writer.query().expect("query"),
        "the overwrite waits for the held copy's read (recorded on the legacy stream)"
    );
    gate.open();
    assert_same(&dst.to_vec().expect("destination"), &old, "destination");
    assert_eq!(src.to_vec().expect("source"), vec![0xF00D; N]);
}

/// A framework's temporaries: the source comes from a caching allocator on stream A, the copy
/// runs on two *other* streams, and right after the call both the source and its source stream
/// are dropped, while new temporaries of the same size are taken on A (and on the consumer
/// stream, which the gate holds) and filled at once. Checks: none of them gets the source's
/// block under the held copy: the destination holds the temporary's bytes exactly and every new
/// temporary its own fill.
#[test]
fn a_cached_source_dropped_with_its_source_stream_is_not_reused_under_the_copy() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let (home, consumer) = (stream(context), stream(context));
    let source_stream = stream(context);
    let expected = pattern(77);
    let mut src = allocator.buffer::<u32>(N, &home).expect("temporary");
    src.copy_from_host(&expected).expect("upload");
    let mut dst = DeviceBuffer::<u32>::zeroed(context, N).expect("destination");
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream).expect("queued");
    drop(src);
    drop(source_stream);
    let mut reused = Vec::new();
    for round in 0..4u32 {
        let mut next = allocator.buffer::<u32>(N, &home).expect("next temporary");
        next.fill_async(round, &home).expect("fill");
        reused.push(next);
    }
    // The consumer's own temporaries, queued behind the held copy.
    for round in 4..6u32 {
        let mut next = allocator
            .buffer::<u32>(N, &consumer)
            .expect("consumer temporary");
        next.fill_async(round, &consumer).expect("fill");
        reused.push(next);
    }
    gate.open();
    assert_same(
        &dst.to_vec().expect("destination"),
        &expected,
        "destination",
    );
    for (round, next) in reused.iter().enumerate() {
        assert_eq!(
            next.to_vec().expect("later temporary"),
            vec![round as u32; N],
            "temporary {round}"
        );
    }
}

/// The other side of a framework's temporaries: the *destination* (a cached buffer of stream
/// A) is dropped right after the call, while the copy that writes it is held on the consumer
/// stream, and new temporaries of the same size are taken on A and filled at once (an
/// activation freed by autograd right after an async hand-off into it). Checks: the held copy,
/// once it runs, writes none of them: each keeps its own fill exactly.
#[test]
fn a_destination_dropped_right_after_the_call_is_not_reused_under_the_copy() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let (home, source_stream, consumer) = (stream(context), stream(context), stream(context));
    let src = DeviceBuffer::from_slice(context, &pattern(88)).expect("source");
    let mut dst = allocator.buffer::<u32>(N, &home).expect("destination");
    dst.fill_async(1, &home)
        .expect("first use on the allocation stream");
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream).expect("queued");
    drop(dst);
    let mut reused = Vec::new();
    for round in 0..4u32 {
        let mut next = allocator.buffer::<u32>(N, &home).expect("next temporary");
        next.fill_async(0xCAFE_0000 + round, &home).expect("fill");
        reused.push(next);
    }
    gate.open();
    consumer.synchronize().expect("the held copy ran");
    for (round, next) in reused.iter().enumerate() {
        assert_eq!(
            next.to_vec().expect("later temporary"),
            vec![0xCAFE_0000 + round as u32; N],
            "temporary {round} was overwritten by the copy into the dropped destination"
        );
    }
}

/// RMM's shape: the source comes from the device's stream-ordered pool (`cuMemAllocAsync`) on
/// stream A, the destination from the plain driver resource, and the copy is queued at once on
/// two other streams (the allocation is ordered before it only device-side). Right after, the
/// pool buffer and stream A are dropped and new pool buffers of the same size are taken on a
/// new stream and filled. Checks: the copy reads the bytes written on A, not the new fills; the
/// destination (another resource) is exact; the new buffers hold their own fills.
#[test]
fn a_stream_ordered_pool_source_into_a_driver_resource_buffer_dropped_at_once() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let pool: Arc<dyn MemoryResource> = match AsyncPoolResource::new(context) {
        Ok(pool) => Arc::new(pool),
        Err(error) => {
            skip(
                "a_stream_ordered_pool_source_into_a_driver_resource_buffer_dropped_at_once",
                &format!("no stream-ordered pool: {error}"),
            );
            return;
        }
    };
    let driver: Arc<dyn MemoryResource> = Arc::new(DriverResource::new(context));
    let kernels = TestKernels::load(context).expect("kernels");
    let (home, source_stream, consumer) = (stream(context), stream(context), stream(context));
    let mut src = DeviceBuffer::<u32>::with_resource(Arc::clone(&pool), N, &home).expect("pool");
    src.fill_async(0x5151, &home)
        .expect("fill on the allocation stream");
    let mut dst = DeviceBuffer::<u32>::with_resource(driver, N, &consumer).expect("driver");
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream).expect("queued");
    drop(src);
    drop(home);
    let next_home = stream(context);
    let mut reused = Vec::new();
    for round in 0..4u32 {
        let mut next =
            DeviceBuffer::<u32>::with_resource(Arc::clone(&pool), N, &next_home).expect("next");
        next.fill_async(round, &next_home).expect("fill");
        reused.push(next);
    }
    gate.open();
    assert_eq!(dst.to_vec().expect("destination"), vec![0x5151; N]);
    for (round, next) in reused.iter().enumerate() {
        assert_eq!(
            next.to_vec().expect("later pool buffer"),
            vec![round as u32; N],
            "pool buffer {round}"
        );
    }
}

/// A training step replayed as a CUDA graph writes the activations; the hand-off to the next
/// stage is an eager non-blocking copy, and the next replay overwrites them. Checks: a copy
/// queued right after a gated launch of the graph that writes the source waits for that launch
/// (the consumer is busy while the gate holds) and gets the graph's bytes; a launch of a graph
/// that overwrites the source, queued right after a held copy, waits for the copy to have read
/// it (its stream busy while the gate holds), and the destination keeps the old bytes.
#[test]
fn graph_launches_writing_the_source_are_ordered_around_the_copy() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (graph_stream, source_stream, consumer) =
        (stream(context), stream(context), stream(context));
    let mut src = DeviceBuffer::<u32>::zeroed(context, N).expect("source");
    let launch_gate = Gate::new(context);
    let produce = capture_exec(&graph_stream, || {
        launch_gate.hold(&kernels, &graph_stream);
        src.fill_async(7, &graph_stream).expect("captured fill");
    });
    let overwrite = capture_exec(&graph_stream, || {
        src.fill_async(5, &graph_stream)
            .expect("captured overwrite");
    });

    // A copy after a launch that writes the source.
    src.fill(1).expect("eager fill");
    let mut first = DeviceBuffer::<u32>::zeroed(context, N).expect("first destination");
    produce.launch(&graph_stream).expect("gated launch");
    copy_peer_async(&mut first, 0, &src, 0, N, &consumer, &source_stream).expect("queued");
    assert!(
        !consumer.query().expect("query"),
        "the copy waits for the gated graph launch that writes its source"
    );
    launch_gate.open();
    consumer.synchronize().expect("consumer");
    assert_eq!(
        first.to_vec().expect("first destination"),
        vec![7; N],
        "the copy read the source before the graph's write"
    );

    // A launch that overwrites the source after a held copy.
    graph_stream.synchronize().expect("graph stream");
    let mut second = DeviceBuffer::<u32>::zeroed(context, N).expect("second destination");
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut second, 0, &src, 0, N, &consumer, &source_stream).expect("queued");
    overwrite.launch(&graph_stream).expect("overwrite launch");
    assert!(
        !graph_stream.query().expect("query"),
        "the overwriting launch waits for the held copy's read of the source"
    );
    gate.open();
    graph_stream.synchronize().expect("graph stream");
    assert_eq!(
        second.to_vec().expect("second destination"),
        vec![7; N],
        "the graph overwrote the source before the copy read it"
    );
    assert_eq!(src.to_vec().expect("source"), vec![5; N]);
}

/// PyTorch's default capture mode is global: while the model thread captures a graph, a
/// pipeline thread keeps handing activations on with non-blocking copies (on streams that do
/// not capture) and overwriting the source for the next micro-batch. Checks: every call is
/// accepted (no event query or host wait is needed on that path), the capture ends valid and
/// replays (fill 7 captured: the replay writes 7), and afterwards the destination holds the last
/// micro-batch exactly.
#[test]
fn copies_on_another_thread_during_a_global_capture_succeed_and_leave_the_capture_valid() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let capturing = stream(context);
    let mut captured_out = DeviceBuffer::<u32>::zeroed(context, 1024).expect("captured output");
    let mut src = DeviceBuffer::<u32>::zeroed(context, N).expect("source");
    let mut dst = DeviceBuffer::<u32>::zeroed(context, N).expect("destination");
    let (writer, source_stream, consumer) = (stream(context), stream(context), stream(context));
    // Warm up the path (events, streams) before the capture.
    src.fill_async(1, &writer).expect("warm-up fill");
    copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream).expect("warm-up copy");
    consumer.synchronize().expect("warm-up");

    capturing
        .begin_capture_synchronized(CaptureMode::Global)
        .expect("begin global capture");
    captured_out
        .fill_async(7, &capturing)
        .expect("captured fill");
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let mut outcomes = Vec::new();
        for batch in 0..64u32 {
            outcomes.push(
                src.fill_async(0x100 + batch, &writer)
                    .map_err(|e| format!("fill {batch}: {e}")),
            );
            outcomes.push(
                copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream)
                    .map_err(|e| format!("copy {batch}: {e}")),
            );
        }
        let _ = tx.send(outcomes);
        (src, dst, writer, source_stream, consumer)
    });
    let outcomes = rx.recv_timeout(Duration::from_secs(60));
    let (_src, dst, _writer, _source_stream, consumer) = worker.join().expect("worker");
    let graph = capturing.end_capture();
    let outcomes = outcomes.expect("the pipeline thread finished within 60 s");
    let graph = graph.expect("the global capture ends valid beside the copies");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");
    exec.launch(&capturing).expect("replay");
    capturing.synchronize().expect("replay done");
    assert_eq!(captured_out.to_vec().expect("replayed"), vec![7; 1024]);
    for outcome in outcomes {
        if let Err(error) = outcome {
            panic!("during another thread's global capture: {error}");
        }
    }
    consumer.synchronize().expect("consumer");
    assert_eq!(dst.to_vec().expect("destination"), vec![0x100 + 63; N]);
}

/// A long-running pipeline: 10^4 hand-offs of one source into one destination, each on a
/// source stream made for the call and dropped right after it (streams that come and go, as a
/// pool handing out fresh ones), the source rewritten on a writer stream every 100 copies.
/// Checks: both buffers' tracked uses stay within the tracker's bound the whole time (reads of
/// 100 distinct streams between writes merge), the context's event pool grows by a bounded
/// number of events, and at each checkpoint the destination holds the latest value exactly.
#[test]
fn ten_thousand_copies_on_streams_that_come_and_go_stay_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    const LEN: usize = 4096;
    const COPIES: u32 = 10_000;
    let (writer, consumer) = (stream(context), stream(context));
    let mut src = DeviceBuffer::<u32>::zeroed(context, LEN).expect("source");
    let mut dst = DeviceBuffer::<u32>::zeroed(context, LEN).expect("destination");
    let events = EventPool::for_context(context).expect("event pool");
    // Warm-up so the pool holds what one round needs.
    for _ in 0..4 {
        let once = stream(context);
        copy_peer_async(&mut dst, 0, &src, 0, LEN, &consumer, &once).expect("warm-up");
    }
    consumer.synchronize().expect("warm-up");
    let created_before = events.counters().created_regular;
    let mut most_tracked = 0;
    for i in 0..COPIES {
        if i % 100 == 0 {
            src.fill_async(i / 100, &writer).expect("rewrite");
        }
        let once = stream(context);
        copy_peer_async(&mut dst, 0, &src, 0, LEN, &consumer, &once)
            .unwrap_or_else(|e| panic!("copy {i}: {e}"));
        drop(once);
        most_tracked = most_tracked.max(src.tracked_uses()).max(dst.tracked_uses());
        assert!(
            most_tracked <= TRACKED_BOUND,
            "copy {i}: {} uses tracked on the source, {} on the destination",
            src.tracked_uses(),
            dst.tracked_uses()
        );
        if i % 1000 == 999 {
            assert_eq!(
                dst.to_vec().expect("destination"),
                vec![i / 100; LEN],
                "checkpoint after copy {i}"
            );
        }
    }
    consumer.synchronize().expect("consumer");
    let grown = events.counters().created_regular - created_before;
    assert!(
        grown <= 256,
        "{grown} events created over {COPIES} copies (most tracked uses {most_tracked})"
    );
}

/// Model parallelism on two GPUs with mistakes and the default streams: a stream of the wrong
/// device on either side is `WrongDevice` naming both ordinals, before anything is queued (the
/// destination untouched); then the copy with device 1's legacy default stream as the
/// destination stream and device 0's as the source stream, called from a thread whose current
/// context is device 0's, waits for a gated producer on device 0 and lands exactly on device 1.
/// Skips on one GPU.
#[test]
fn wrong_device_streams_are_typed_and_legacy_streams_of_two_devices_keep_the_order() {
    let gpu = require_gpu!();
    let _serial = serial();
    if Device::count().expect("device count") < 2 {
        skip(
            "wrong_device_streams_are_typed_and_legacy_streams_of_two_devices_keep_the_order",
            "needs two GPUs",
        );
        return;
    }
    let first = &gpu.context;
    let second = Context::primary(Device::get(1).expect("device 1")).expect("context 1");
    let kernels = TestKernels::load(first).expect("kernels");
    let (producer, on_first) = (stream(first), stream(first));
    let on_second = stream(&second);
    let data = pattern(61);
    let src = DeviceBuffer::from_slice(first, &data).expect("source on GPU 0");
    let mut remote = DeviceBuffer::from_slice(&second, &vec![3u32; N]).expect("on GPU 1");

    let wrong_destination_stream =
        copy_peer_async(&mut remote, 0, &src, 0, N, &on_first, &on_first);
    assert!(
        matches!(
            wrong_destination_stream,
            Err(MemoryError::WrongDevice {
                expected: 1,
                actual: 0,
                ..
            })
        ),
        "{wrong_destination_stream:?}"
    );
    let wrong_source_stream = copy_peer_async(&mut remote, 0, &src, 0, N, &on_second, &on_second);
    assert!(
        matches!(
            wrong_source_stream,
            Err(MemoryError::WrongDevice {
                expected: 0,
                actual: 1,
                ..
            })
        ),
        "{wrong_source_stream:?}"
    );
    assert_eq!(remote.to_vec().expect("untouched"), vec![3u32; N]);

    let (legacy_first, legacy_second) = (
        Stream::legacy_default(first),
        Stream::legacy_default(&second),
    );
    let mut activations = DeviceBuffer::<u32>::new_on(&producer, N).expect("activations");
    let gate = Gate::new(first);
    gate.hold(&kernels, &producer);
    activations
        .fill_async(0xACE, &producer)
        .expect("gated write");
    first.bind_to_thread().expect("device 0 current");
    copy_peer_async(
        &mut remote,
        0,
        &activations,
        0,
        N,
        &legacy_second,
        &legacy_first,
    )
    .expect("between legacy streams");
    assert!(
        !legacy_second.query().expect("query"),
        "device 1's legacy stream waits for device 0's gated write"
    );
    gate.open();
    assert_eq!(remote.to_vec().expect("on GPU 1"), vec![0xACE; N]);
    drop(activations);
    assert_same(&src.to_vec().expect("source"), &data, "source untouched");
}
