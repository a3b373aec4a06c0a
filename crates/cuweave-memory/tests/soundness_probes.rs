//! Adversarial soundness probes of cuweave-memory's safe API, as GPU tests.
//!
//! Each test is a sequence of safe calls that would let the host or the device touch memory it
//! must not (a race with queued or graph work, memory handed to a new owner while a graph still
//! uses it) or that returns `Ok` for work it did not do. Each one asserts the behaviour the crate
//! promises, byte for byte, so a test that fails names a hole. Regression tests say, above them,
//! which sequence broke and where.
//!
//! Three more holes the review found are now compile errors, kept as `compile_fail` doctests:
//! items of a host slice taken by value outlived the guard that holds back graph launches
//! (`buffer/host_slice.rs`), and a resource written in safe code could hand one block to two
//! buffers, or lay a device buffer over a pinned buffer's memory (`MemoryResource` is now an
//! `unsafe trait`, `resource/mod.rs`).

use std::sync::Arc;

use cuweave_driver::Context;
use cuweave_driver::graph::CaptureMode;
use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer, copy_peer};
use cuweave_memory::parts::SharedParts;
use cuweave_memory::{
    AsyncPoolResource, DriverResource, ManagedCapabilities, MemLocation, MemoryError,
    MemoryResource, PinnedPool,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

#[path = "common/graph.rs"]
mod graph;
use graph::{capture_graph, instantiate, non_blocking, refused_for_host_borrow};

const MS: u64 = 1_000_000;
/// How long a stream or graph spins before the work a probe races against: longer than the host
/// checks made meanwhile.
const SPIN_NS: u64 = 50 * MS;
/// Elements of the buffers the graph probes use (1 MiB of `u32`).
const LEN: usize = 1 << 18;

fn pattern(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

fn managed_usable(ctx: &Arc<Context>) -> bool {
    let usable = ManagedCapabilities::of(ctx.device())
        .map(|caps| caps.managed_memory && caps.concurrent_managed_access)
        .unwrap_or(false);
    if !usable {
        eprintln!("skipped: host slices of managed memory need concurrent managed access");
    }
    usable
}

// A regression test. `copy_peer` (crates/cuweave-memory/src/buffer/peer.rs) checked nothing
// about capture: on a capturing stream it recorded `dst`'s captured write and queued
// `cuMemcpyPeerAsync` (captured into the graph), then its closing `stream.synchronize()` was
// refused with `GraphError::Capturing`, so the call returned `Err`, but the memcpy node stayed in
// the capture. Its read of `src` was never recorded in `src`'s tracker (only
// `src.tracker().synchronize()` ran, before the copy), so dropping `src` returned its block to the
// cache at once, the next buffer of that size got it, and every launch of the graph read (copied)
// the new owner's bytes. Expected: refused before anything is queued (no node), or `src` kept
// for the graph as captured copies keep their pinned host side. It is now refused first.
#[test]
fn copy_peer_on_a_capturing_stream_leaves_no_read_of_a_source_that_can_be_freed() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let stream = non_blocking(ctx);
    const N: usize = 3 << 18; // 3 MiB of u32: its own large-pool size class
    let mut dst = DeviceBuffer::<u32>::zeroed(ctx, N).unwrap();
    let src = DeviceBuffer::<u32>::from_slice(ctx, &vec![3u32; N]).unwrap();
    let src_ptr = src.device_ptr();

    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let copied = copy_peer(&mut dst, 0, &src, 0, N, &stream);
    let graph = stream.end_capture().unwrap();
    let nodes = graph.node_count().unwrap();

    drop(src);
    let mut reuse = DeviceBuffer::<u32>::new(ctx, N).unwrap();
    reuse.fill(9).unwrap();
    let reused_the_block = reuse.device_ptr() == src_ptr;
    let exec = instantiate(&graph);
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    let got = dst.to_vec().unwrap();
    let from_new_owner = got.iter().filter(|&&x| x == 9).count();
    assert_eq!(
        from_new_owner, 0,
        "the graph copied {from_new_owner} elements of the buffer that took the freed source's \
         block (copy_peer returned {copied:?}, graph nodes {nodes})"
    );
    assert!(
        !(nodes > 0 && reused_the_block),
        "the freed source's block went to a new buffer while the graph still reads it \
         (copy_peer returned {copied:?})"
    );
    assert!(
        copied.is_ok() || nodes == 0,
        "copy_peer returned {copied:?} yet left {nodes} node(s) in the capture"
    );
}

// A regression test. `DeviceBuffer::with_resource` (buffer/device.rs) on a capturing stream
// with `AsyncPoolResource` makes `cuMemAllocFromPoolAsync` record an allocation *node*: the
// address belongs to the graph (mapped only while a launch's allocation lives), yet it came
// back as an ordinary `DeviceBuffer` that safe code could fill, read and drop outside any
// launch. Now the buffer is marked as that capture's graph allocation (the resource says it
// `allocates_in_graphs`): work captured into the capture may use it (PyTorch's
// `cudaMallocAsync` scratch inside `torch.cuda.graph`), and any use outside it is refused with
// `MemoryError::GraphAllocation` before anything is queued; the capture stays valid.
#[test]
fn a_resource_buffer_from_an_allocation_node_serves_only_its_capture() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let stream = non_blocking(ctx);
    let resource: Arc<dyn MemoryResource> = match AsyncPoolResource::new(ctx) {
        Ok(pool) => Arc::new(pool),
        Err(error) => {
            eprintln!("skipped: no memory pools: {error}");
            return;
        }
    };
    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let mut scratch =
        DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 1 << 16, &stream).unwrap();
    scratch
        .fill_async(3, &stream)
        .expect("the capture's own work uses its scratch");
    let other = non_blocking(ctx);
    assert!(
        matches!(
            scratch.fill_async(4, &other),
            Err(MemoryError::GraphAllocation { .. })
        ),
        "eager work on another stream, during the capture"
    );
    let graph = stream.end_capture().expect("the capture stays valid");
    assert!(matches!(
        scratch.to_vec(),
        Err(MemoryError::GraphAllocation { .. })
    ));
    assert!(matches!(
        scratch.fill(1),
        Err(MemoryError::GraphAllocation { .. })
    ));
    let exec = instantiate(&graph);
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    drop(exec);
    drop(graph);
    drop(scratch);
}

// Expected to pass. Staged chunks whose host sides are borrowed pinned buffers record their use
// in those buffers' own trackers (raw.rs `run_chunk`), so forgetting the pending copies must not
// let host slices in early: the upload chunk is read before the host overwrites its source, and
// the download chunk has landed before the host reads its sink.
#[test]
fn forgotten_staged_chunks_of_borrowed_pinned_buffers_are_waited_for_by_host_slices() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let lanes = [non_blocking(ctx), non_blocking(ctx)];
    const N: usize = 1 << 18;
    let data = pattern(N, 0x5eed);
    let mut device = DeviceBuffer::<u32>::zeroed(ctx, N).unwrap();
    let mut source = PinnedBuffer::from_slice(ctx, &data).unwrap();
    let mut sink = PinnedBuffer::<u32>::new(ctx, N).unwrap();

    kernels.spin_ns(&lanes[0], SPIN_NS).unwrap();
    device
        .staged_write(0, N, &lanes, |staged| {
            std::mem::forget(staged.copy_in(0, 0, &source).unwrap());
        })
        .unwrap();
    // The chunk is behind a 50 ms spin: the host write must wait for its read.
    source.as_mut_slice().unwrap().fill(0xdead_beef);

    kernels.spin_ns(&lanes[1], SPIN_NS).unwrap();
    device
        .staged_read(0, N, &lanes, |staged| {
            std::mem::forget(staged.copy_out(1, 0, &mut sink).unwrap());
        })
        .unwrap();
    let landed = sink.as_slice().unwrap();
    let wrong = landed.iter().zip(&data).filter(|(a, b)| a != b).count();
    assert_eq!(
        wrong, 0,
        "{wrong} elements differ: the upload read the overwritten source or the host read the \
         sink before the download landed"
    );
    drop(landed);
    assert_eq!(device.to_vec().unwrap(), data);
}

// Expected to pass. A download captured into a *borrowed* pinned sink (`&mut PinnedBuffer` as
// `HostSink`, recorded through raw.rs `read_async`'s host tracker in the capture) whose pending
// copy is forgotten: host access after a launch waits for it, and its slice holds back the next
// launch until dropped.
#[test]
fn a_forgotten_captured_download_into_a_borrowed_pinned_sink_is_waited_for_and_held() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let stream = non_blocking(ctx);
    let mut source = DeviceBuffer::<u32>::new(ctx, LEN).unwrap();
    source.fill(4).unwrap();
    let mut sink = PinnedBuffer::<u32>::new(ctx, LEN).unwrap();
    let mut captured = false;
    let graph = capture_graph(&stream, || {
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        let pending = source.copy_to_host_async(&mut sink, &stream).unwrap();
        captured = pending.is_captured();
        std::mem::forget(pending);
    });
    assert!(captured, "a pinned sink is captured");
    let exec = instantiate(&graph);
    exec.launch(&stream).unwrap();
    {
        let slice = sink.as_slice().unwrap();
        assert!(
            slice.iter().all(|&x| x == 4),
            "the host read the sink before the launch's download landed"
        );
        assert!(slice.holds_launches());
        source.fill(5).unwrap();
        let relaunch = exec.launch(&stream);
        assert!(refused_for_host_borrow(&relaunch).is_some(), "{relaunch:?}");
        assert!(slice.iter().all(|&x| x == 4));
    }
    exec.launch(&stream).unwrap();
    assert!(sink.as_slice().unwrap().iter().all(|&x| x == 5));
}

// Expected to pass. A blocking upload on a stream (`copy_range_from_host_on`, pageable: raw.rs
// `write_completed` -> tracker.rs `run_completed` -> uses.rs `settle_range`) forgets the uses it
// waited for. It must wait for a pending read of a view it overlaps (on another stream), and must
// not forget a pending write of a disjoint range on a third stream: a later blocking read on the
// legacy stream (which does not synchronise with non-blocking streams) still waits for it.
#[test]
fn a_blocking_upload_waits_for_the_reads_it_overlaps_and_forgets_no_disjoint_write() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let (a, b, d) = (non_blocking(ctx), non_blocking(ctx), non_blocking(ctx));
    const N: usize = 1 << 20;
    let old = pattern(N, 1);
    let mut device = DeviceBuffer::from_slice(ctx, &old).unwrap();

    kernels.spin_ns(&a, SPIN_NS).unwrap();
    let read = device
        .slice(..N / 2)
        .unwrap()
        .copy_to_host_async(vec![0u32; N / 2], &a)
        .unwrap();
    kernels.spin_ns(&d, 2 * SPIN_NS).unwrap();
    device
        .slice_mut(3 * N / 4..)
        .unwrap()
        .fill_async(7, &d)
        .unwrap();

    let upload_len = N / 4 + N / 8;
    let back = device
        .copy_range_from_host_on(N / 4, vec![5u32; upload_len], &b)
        .unwrap();
    assert_eq!(back.len(), upload_len);
    assert!(
        read.is_complete().unwrap(),
        "the upload returned before the read of the range it overwrote had run"
    );
    assert_eq!(
        read.wait().unwrap(),
        old[..N / 2],
        "the pending read saw the upload"
    );

    let mut want = old.clone();
    want[N / 4..N / 4 + upload_len].fill(5);
    want[3 * N / 4..].fill(7);
    let got = device.to_vec().unwrap();
    let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    assert_eq!(
        wrong, 0,
        "{wrong} elements differ: the blocking read did not wait for the disjoint write on a third \
         stream (forgotten by the upload's settle?)"
    );
}

// Expected to pass. A pinned buffer borrowed as an upload's source: the `PendingCopy` borrows it,
// and forgetting that copy ends the borrow; the read the copy made is in the buffer's own tracker
// (raw.rs `write_async`), so a host write must wait for it, and the device gets the old bytes.
#[test]
fn a_forgotten_upload_from_a_borrowed_pinned_source_lands_before_the_host_rewrites_it() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let stream = non_blocking(ctx);
    const N: usize = 1 << 18;
    let data = pattern(N, 77);
    let mut source = PinnedBuffer::from_slice(ctx, &data).unwrap();
    let mut device = DeviceBuffer::<u32>::new_on(&stream, N).unwrap();
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    std::mem::forget(device.copy_from_host_async(&source, &stream).unwrap());
    assert!(matches!(
        source.try_as_mut_slice().map(|_| ()),
        Err(MemoryError::DeviceBusy { .. })
    ));
    source.as_mut_slice().unwrap().fill(0);
    assert_eq!(device.to_vec().unwrap(), data);
}

// Expected to pass. A buffer from a pinned pool, used as the owned host side of a download that
// is dropped (not forgotten) early on another thread, then returned: the pool must not hand the
// block out again while the copy runs, and a typed block from the pool carries the data back.
#[test]
fn a_pool_buffer_handed_back_under_a_queued_download_is_not_reused_early() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let stream = non_blocking(ctx);
    let pool = PinnedPool::new(ctx);
    const N: usize = 1 << 18;
    let data = pattern(N, 9);
    let device = DeviceBuffer::from_slice(ctx, &data).unwrap();

    // Borrowed sink of a pool buffer: forgotten copy, then the buffer itself is dropped while the
    // download is still behind the spin. Its block must wait in the pool.
    let mut staging = pool.buffer::<u32>(N).unwrap();
    let staging_ptr = staging.as_host_ptr() as usize;
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    std::mem::forget(device.copy_to_host_async(&mut staging, &stream).unwrap());
    drop(staging);
    let mut next = pool.get_typed::<u32>(N).unwrap();
    let next_ptr = next.as_slice().as_ptr() as usize;
    if next_ptr == staging_ptr {
        assert!(
            stream.query().unwrap(),
            "the pool handed out a block a queued download still writes"
        );
    }
    next.as_mut_slice().fill(0);
    stream.synchronize().unwrap();
    assert!(
        next.as_slice().iter().all(|&x| x == 0),
        "the queued download landed in a block the pool had handed out again"
    );
    let back = device
        .copy_to_host_async(next, &stream)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(back.as_slice(), &data[..]);
}

// Expected to pass. Bad input across the less-trodden entry points is a typed error, never a
// panic, and queues nothing: staged chunks at overflowing offsets or lanes, `copy_peer` ranges,
// pool requests that overflow, views with an excluded `usize::MAX` start, managed ranges and
// prefetches past the end, resource buffers of zero or overflowing length, and `SharedParts`
// with absurd part sizes.
#[test]
fn bad_input_on_less_common_entry_points_is_a_typed_error_not_a_panic() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let stream = non_blocking(ctx);
    const N: usize = 1024;
    let mut device = DeviceBuffer::from_slice(ctx, &pattern(N, 3)).unwrap();
    let other = DeviceBuffer::from_slice(ctx, &pattern(N, 4)).unwrap();
    let lanes = [non_blocking(ctx)];

    let inner = device
        .staged_write(0, N, &lanes, |staged| {
            let past = staged.copy_in(0, usize::MAX, vec![1u32; 2]).map(drop);
            let lane = staged.copy_in(usize::MAX, 0, vec![1u32; 2]).map(drop);
            (past, lane)
        })
        .unwrap();
    assert!(
        matches!(inner.0, Err(MemoryError::OutOfRange { .. })),
        "{inner:?}"
    );
    assert!(
        matches!(inner.1, Err(MemoryError::OutOfRange { .. })),
        "{inner:?}"
    );
    let staged_empty = device.staged_read(0, N, &[], |staged| staged.streams());
    assert_eq!(staged_empty.unwrap(), 0);

    assert!(matches!(
        copy_peer(&mut device, usize::MAX, &other, 0, 2, &stream),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        copy_peer(&mut device, 0, &other, N - 1, 2, &stream),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        copy_peer(&mut device, 0, &other, 0, 0, &stream),
        Err(MemoryError::ZeroLength { .. })
    ));

    let excluded_max = device.slice((
        std::ops::Bound::Excluded(usize::MAX),
        std::ops::Bound::Unbounded,
    ));
    assert!(matches!(excluded_max, Err(MemoryError::OutOfRange { .. })));
    let inverted = device.slice((
        std::ops::Bound::Included(N - 1),
        std::ops::Bound::Excluded(1),
    ));
    assert!(inverted.is_err());

    let refused = device.copy_range_from_host_on(usize::MAX, vec![1u32; 3], &stream);
    match refused {
        Err(refusal) => {
            let (error, host) = refusal.into_parts();
            assert!(matches!(error, MemoryError::OutOfRange { .. }), "{error}");
            assert_eq!(
                host,
                Some(vec![1u32; 3]),
                "the refusal hands the host side back"
            );
        }
        Ok(_) => panic!("an upload at usize::MAX was accepted"),
    }
    assert_eq!(
        device.to_vec().unwrap(),
        pattern(N, 3),
        "nothing was written"
    );

    let pool = PinnedPool::new(ctx);
    assert!(pool.get(usize::MAX).is_err());
    assert!(pool.get(0).is_err());
    assert!(pool.get_typed::<u64>(usize::MAX / 4).is_err());
    assert!(pool.get_typed::<u64>(0).is_err());
    assert!(pool.buffer::<u32>(usize::MAX / 2).is_err());

    let resource: Arc<dyn MemoryResource> = Arc::new(DriverResource::new(ctx));
    assert!(matches!(
        DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 0, &stream),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(DeviceBuffer::<u64>::with_resource(resource, usize::MAX / 4, &stream).is_err());

    if managed_usable(ctx) {
        let managed = UnifiedBuffer::<u32>::new(ctx, N).unwrap();
        assert!(matches!(
            managed.range(usize::MAX, 2),
            Err(MemoryError::OutOfRange { .. })
        ));
        assert!(matches!(
            managed.prefetch_range(1, usize::MAX, MemLocation::Device(0), &stream),
            Err(MemoryError::OutOfRange { .. })
        ));
        let hints = managed.hints().unwrap();
        assert!(hints.subrange(N, 1).is_err());
        assert!(hints.subrange(0, 0).is_err());
    }

    let parts = SharedParts::new(vec![7u8; 10], usize::MAX);
    assert_eq!(parts.count(), 1);
    assert_eq!(parts.take(0).map(|part| part.len()), Some(10));
    assert!(parts.take(0).is_none());
    assert!(parts.take(usize::MAX).is_none());
    assert!(parts.range(usize::MAX).is_none());
}
