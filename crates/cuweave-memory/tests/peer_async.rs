//! `copy_peer_async`: a copy between buffers of two devices (or one) ordered on a stream of each
//! device, with no host wait (PyTorch's `tensor.to(other_device, non_blocking=True)`, a model
//! split across GPUs handing activations to the next stage). Each test proves an ordering with a
//! gate kernel that holds a stream until the host opens it: the copy waits for the source's
//! writer, a later writer of the source waits for the copy, a dropped source is not reused under
//! the copy; bytes are checked exactly. The two-device test skips, with its reason, on one GPU.

use std::sync::Arc;

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::{Context, Device, Stream, StreamFlags};
use cuweave_memory::buffer::{Buffer, DeviceBuffer, copy_peer_async};
use cuweave_memory::{CachingAllocator, MemoryError};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

/// Elements copied (1 MiB of `u32`).
const N: usize = 1 << 18;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream")
}

fn pattern(seed: u32) -> Vec<u32> {
    (0..N as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed))
        .collect()
}

/// A pipeline stage's hand-off on one device: the producer writes the source on its own
/// stream behind a gate; the copy is queued at once on the consumer's stream. Checks: the call
/// returns while the producer is held (the consumer stream still has the copy pending, so the
/// host did not wait), and once the gate opens the destination holds what the producer wrote.
#[test]
fn the_copy_waits_device_side_for_the_sources_writer_and_the_host_does_not_wait() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (producer, source_stream, consumer) = (stream(context), stream(context), stream(context));
    let gate = Gate::new(context);
    let mut src = DeviceBuffer::<u32>::new_on(&producer, N).expect("source");
    gate.hold(&kernels, &producer);
    src.fill_async(7, &producer).expect("producer's write");
    let mut dst = DeviceBuffer::<u32>::zeroed(context, N).expect("destination");
    copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream).expect("queued");
    assert!(
        !consumer.query().expect("query"),
        "the copy waits behind the producer's gated write, and the call returned before it ran"
    );
    gate.open();
    assert_eq!(dst.to_vec().expect("read back"), vec![7; N]);
    drop(src);
}

/// Double buffering across the hand-off: right after queueing the copy the producer overwrites
/// the source on another stream (PyTorch's next micro-batch into the same activation buffer).
/// The copy's stream is held by a gate, so the copy has not read the source yet. Checks: the
/// overwrite waits for the copy (its stream is still busy while the gate holds), the
/// destination gets the old bytes exactly and the source the new ones.
#[test]
fn a_write_of_the_source_after_the_copy_waits_for_the_copy_to_read_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (source_stream, consumer, next) = (stream(context), stream(context), stream(context));
    let old = pattern(11);
    let mut src = DeviceBuffer::from_slice(context, &old).expect("source");
    let mut dst = DeviceBuffer::<u32>::zeroed(context, N).expect("destination");
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream).expect("queued");
    src.fill_async(0xDEAD, &next).expect("overwrite queued");
    assert!(
        !next.query().expect("query"),
        "the overwrite waits for the held copy's read of the source"
    );
    gate.open();
    assert_eq!(dst.to_vec().expect("destination"), old);
    assert_eq!(src.to_vec().expect("source"), vec![0xDEAD; N]);
}

/// The source is a temporary from the caching allocator, dropped as soon as the copy is queued
/// (a framework freeing an activation right after `.to(other_device, non_blocking=True)`), and
/// its stream's allocations go on. Checks: the new allocations on that stream, filled at once,
/// never reach the copy's bytes: the destination holds the temporary's bytes exactly.
#[test]
fn a_source_dropped_right_after_the_copy_is_not_reused_under_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let (source_stream, consumer) = (stream(context), stream(context));
    let expected = pattern(23);
    let mut src = allocator
        .buffer::<u32>(N, &source_stream)
        .expect("temporary");
    src.copy_from_host(&expected).expect("upload");
    let mut dst = DeviceBuffer::<u32>::zeroed(context, N).expect("destination");
    let gate = Gate::new(context);
    gate.hold(&kernels, &consumer);
    copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream).expect("queued");
    drop(src);
    let mut reused = Vec::new();
    for round in 0..4u32 {
        let mut next = allocator
            .buffer::<u32>(N, &source_stream)
            .expect("next temporary");
        next.fill_async(round, &source_stream).expect("fill");
        reused.push(next);
    }
    gate.open();
    assert_eq!(dst.to_vec().expect("destination"), expected);
    for (round, next) in reused.iter().enumerate() {
        assert_eq!(
            next.to_vec().expect("later temporary"),
            vec![round as u32; N]
        );
    }
}

/// Slices on both sides, at odd offsets: a view of a larger buffer is copied into the middle of
/// another, leaving the bytes around it untouched.
#[test]
fn views_at_offsets_copy_only_their_range() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (source_stream, consumer) = (stream(context), stream(context));
    let data = pattern(5);
    let src = DeviceBuffer::from_slice(context, &data).expect("source");
    let mut dst = DeviceBuffer::from_slice(context, &vec![1u32; N]).expect("destination");
    let (from, to, len) = (1_001, 70_003, 100_000);
    copy_peer_async(&mut dst, to, &src, from, len, &consumer, &source_stream).expect("queued");
    let back = dst.to_vec().expect("read back");
    assert!(back[..to].iter().all(|&v| v == 1));
    assert_eq!(back[to..to + len], data[from..from + len]);
    assert!(back[to + len..].iter().all(|&v| v == 1));
}

/// Bad input and captures are refused before anything is queued: an empty copy, a range past
/// either end, and a capturing stream on either side (the copy would become a graph node whose
/// read of the source nothing records). Checks the variants, that the capture ends valid with
/// no node, and that the destination is untouched.
#[test]
fn bad_ranges_and_capturing_streams_are_typed_refusals_with_nothing_queued() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (source_stream, consumer) = (stream(context), stream(context));
    let src = DeviceBuffer::from_slice(context, &pattern(3)).expect("source");
    let mut dst = DeviceBuffer::from_slice(context, &vec![9u32; N]).expect("destination");
    assert!(matches!(
        copy_peer_async(&mut dst, 0, &src, 0, 0, &consumer, &source_stream),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        copy_peer_async(&mut dst, 1, &src, 0, N, &consumer, &source_stream),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        copy_peer_async(&mut dst, 0, &src, 1, N, &consumer, &source_stream),
        Err(MemoryError::OutOfRange { .. })
    ));
    for capturing_destination in [true, false] {
        let capturing = if capturing_destination {
            &consumer
        } else {
            &source_stream
        };
        capturing
            .begin_capture(CaptureMode::ThreadLocal)
            .expect("begin");
        let refused = copy_peer_async(&mut dst, 0, &src, 0, N, &consumer, &source_stream);
        let graph = capturing.end_capture().expect("the capture ends valid");
        let refused = refused.expect_err("a capturing stream is refused");
        assert!(refused.is_capture_refusal(), "{refused}");
        assert_eq!(graph.node_types().expect("nodes").len(), 0);
    }
    assert_eq!(dst.to_vec().expect("destination"), vec![9u32; N]);
}

/// Model parallelism on two GPUs: stage one writes its activations on GPU 0 behind a gate, the
/// copy to GPU 1 is queued on a stream of each device, then GPU 1's result goes back to a
/// second buffer on GPU 0. Checks: GPU 1's stream waits (device-side, across devices) for GPU
/// 0's gated write, and both hops arrive byte for byte. Skips on one GPU.
#[test]
fn activations_cross_two_devices_and_back_ordered_device_side() {
    let gpu = require_gpu!();
    let _serial = serial();
    if Device::count().expect("device count") < 2 {
        cuweave_test_support::skip(
            "activations_cross_two_devices_and_back_ordered_device_side",
            "needs two GPUs",
        );
        return;
    }
    let first = &gpu.context;
    let second = Context::primary(Device::get(1).expect("device 1")).expect("context 1");
    let kernels = TestKernels::load(first).expect("kernels");
    let (producer, stage_one) = (stream(first), stream(first));
    let stage_two = stream(&second);
    let gate = Gate::new(first);
    let mut activations = DeviceBuffer::<u32>::new_on(&producer, N).expect("activations");
    gate.hold(&kernels, &producer);
    activations
        .fill_async(0x5EED, &producer)
        .expect("gated write");
    let mut remote = DeviceBuffer::<u32>::new_on(&stage_two, N).expect("remote");
    copy_peer_async(&mut remote, 0, &activations, 0, N, &stage_two, &stage_one).expect("to GPU 1");
    assert!(
        !stage_two.query().expect("query"),
        "GPU 1's copy waits for GPU 0's gated write"
    );
    gate.open();
    assert_eq!(remote.to_vec().expect("on GPU 1"), vec![0x5EED; N]);
    let data = pattern(41);
    remote.copy_from_host(&data).expect("GPU 1 result");
    let mut back = DeviceBuffer::<u32>::zeroed(first, N).expect("back on GPU 0");
    copy_peer_async(&mut back, 0, &remote, 0, N, &stage_one, &stage_two).expect("to GPU 0");
    drop(remote);
    assert_eq!(back.to_vec().expect("on GPU 0"), data);
}
