//! Programs that users of `cudaMallocManaged` (RMM's `managed_memory_resource`, out-of-core loops,
//! `cudaMemAdvise` / `cudaMemPrefetchAsync` pipelines, host reads after kernels) and of pinned
//! memory (PyTorch's `pin_memory()`, DataLoader staging, `non_blocking=True` copies, pinned
//! pools reused over many batches) write, aimed at what the other test files leave out:
//!
//! - ten thousand DataLoader batches staged through the pinned pool and checksummed on another
//!   stream, with the pool's pinned bytes bounded by the prefetch depth;
//! - pool blocks written by queued device work (a fill, a zero-copy kernel) never handed to a
//!   new owner before that work has run, proved by the new owner's bytes surviving it;
//! - every write path through a shared view of a pinned or managed buffer refused while a host
//!   slice of it is held, and exclusive view writes keeping the host out until they land;
//! - an out-of-core loop over a ring of managed chunks, prefetched both ways with advice set;
//! - read-mostly weights read on two streams and updated by the host in between;
//! - migration policies on halves of one buffer combined, replaced and cleared, including
//!   host accessed-by advice on part of a range;
//! - prefetch plans alternating targets over views of two buffers;
//! - persistent pinned outputs of `non_blocking` downloads reused across thousands of batches;
//! - views of pool pinned buffers and managed buffers copied into each other;
//! - host read-modify-write of managed memory between kernels on two streams and threads;
//! - variable-sized pinned batches under a cache cap;
//! - bad input of every kind (zero lengths, ranges past the end, sizes that differ, devices
//!   that do not exist or lack a capability, streams of another device) as typed errors.
//!
//! No test changes clocks, power or compute mode. Managed allocations stay at 4 MiB each and
//! 16 MiB per test at most. Nothing here is timed: where a test needs queued work to still be
//! pending while it checks something, a `wait_u32` gate the host opens holds the stream.

use std::collections::VecDeque;

use cuweave_driver::memory::{
    MemLocation, range_accessed_by, range_last_prefetch_location, range_preferred_location,
    range_read_mostly,
};
use cuweave_driver::{Context, Device, DriverError, Stream};
use cuweave_memory::pinned_pool::PinnedPoolConfig;
use cuweave_memory::{
    Buffer, DeviceBuffer, ManagedCapabilities, ManagedMemoryHints, MemAdvice, MemoryError,
    MigrationPolicy, PendingCopy, PinnedBuffer, PinnedPool, PrefetchPath, PrefetchPlan,
    UnifiedBuffer,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

#[path = "common/managed.rs"]
mod managed;
use managed::{assert_busy, managed_usable, stream, tracked_checksum};

fn assert_read_only<T>(result: cuweave_memory::Result<T>, what: &str) {
    match result {
        Err(MemoryError::ReadOnlyView { .. }) => {}
        Err(other) => panic!("{what}: expected ReadOnlyView, got {other:?}"),
        Ok(_) => panic!("{what}: a write through a shared view was accepted"),
    }
}

fn assert_invalid_target<T>(result: cuweave_memory::Result<T>, what: &str) {
    match result {
        Err(MemoryError::Driver(DriverError::InvalidArgument { .. })) => {}
        Err(other) => panic!("{what}: expected InvalidArgument, got {other:?}"),
        Ok(_) => panic!("{what}: a device that does not exist was accepted"),
    }
}

// ---------------------------------------------------------------------------------------------
// PyTorch DataLoader: pin_memory=True, non_blocking=True, ten thousand batches
// ---------------------------------------------------------------------------------------------

/// A DataLoader with `pin_memory=True` and a prefetch depth of four: every batch is built on the
/// host in a pool-backed pinned buffer, uploaded `non_blocking` on a copy stream into one of
/// four device slots, and consumed by a checksum kernel on a compute stream. A slot is uploaded
/// again four batches later, so the copy stream must wait for the compute stream's read of it
/// (write after read across streams) and the compute stream for the upload (read after write).
/// Ten thousand batches: the device's running checksum equals the host's exactly, the pool pins
/// no more blocks than are in flight, and its books balance.
#[test]
fn ten_thousand_pinned_dataloader_batches_reuse_a_bounded_set_of_pool_blocks() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (copy, compute) = (stream(context), stream(context));
    const BATCH: usize = 4 * KIB; // u32s: 16 KiB, one size class
    const BATCHES: usize = 10_000;
    const DEPTH: usize = 4;
    let pool = PinnedPool::new(context);
    let mut slots: Vec<DeviceBuffer<u32>> = (0..DEPTH)
        .map(|_| DeviceBuffer::new_on(&copy, BATCH).expect("device slot"))
        .collect();
    let total = DeviceBuffer::<u64>::zeroed(context, 1).expect("device checksum");
    let mut in_flight: VecDeque<PendingCopy<PinnedBuffer<u32>>> = VecDeque::new();
    let mut expected = 0u64;

    for batch in 0..BATCHES {
        if in_flight.len() == DEPTH {
            // The oldest batch's pinned buffer goes back to the pool once its upload landed.
            drop(
                in_flight
                    .pop_front()
                    .expect("oldest")
                    .wait()
                    .expect("upload"),
            );
        }
        let mut staged = pool.buffer::<u32>(BATCH).expect("pin_memory");
        for (i, slot) in staged
            .as_mut_slice()
            .expect("a fresh pool buffer")
            .iter_mut()
            .enumerate()
        {
            *slot = (batch as u32).wrapping_mul(2_654_435_761) ^ i as u32;
            expected += u64::from(*slot);
        }
        let slot = &mut slots[batch % DEPTH];
        in_flight.push_back(
            slot.copy_from_host_async(staged, &copy)
                .expect("non_blocking upload"),
        );
        tracked_checksum(&kernels, &compute, slot, &total);
    }
    for pending in in_flight.drain(..) {
        drop(pending.wait().expect("upload"));
    }
    assert_eq!(
        total.to_vec().expect("checksum")[0],
        expected,
        "some batch was overwritten before it was consumed, or consumed before it landed"
    );
    for slot in &slots {
        assert!(slot.tracked_uses() <= 32, "{}", slot.tracked_uses());
    }

    let stats = pool.stats();
    assert_eq!(stats.gets, BATCHES as u64);
    assert_eq!(stats.returns, stats.gets);
    assert_eq!(stats.gets, stats.hits + stats.misses);
    assert_eq!((stats.allocated_bytes, stats.allocated_blocks), (0, 0));
    assert_eq!(
        stats.pinned_bytes,
        stats.allocated_bytes + stats.cached_bytes
    );
    assert!(
        stats.misses <= DEPTH as u64 + 1,
        "the pool pinned {} blocks for {DEPTH} batches in flight: {stats:?}",
        stats.misses
    );
    assert!(
        stats.peak_pinned_bytes <= (DEPTH + 1) * BATCH * 4,
        "pinned memory grew with the number of batches: {stats:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Pool blocks and queued device writes
// ---------------------------------------------------------------------------------------------

/// A pool pinned buffer zeroed on the device (`fill_async`, as `torch.zeros(..).pin_memory()`
/// followed by a device-side fill) and another written in place by a zero-copy kernel are
/// dropped while that work is still queued behind a closed gate. Two new owners of the same
/// size class, one typed buffer and one raw block, must get other blocks: they write their own
/// stamps, the gate opens, the queued writes run, and the stamps must survive them. Once the
/// writes are done the two blocks come back without pinning, holding exactly what was written.
#[test]
fn pool_blocks_written_by_queued_device_work_are_not_handed_out_before_it_runs() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let s = stream(context);
    let pool = PinnedPool::new(context);
    const N: usize = 64 * KIB; // u32s: 256 KiB
    const FILLED: u32 = 0x1234_5678;
    const WRITTEN: u32 = 0x0BAD_F00D;
    const STAMP: u32 = 0x5555_AAAA;

    let mut filled = pool.buffer::<u32>(N).expect("first block");
    let filled_at = filled.as_host_ptr() as usize;
    let written = pool.buffer::<u32>(N).expect("second block");
    let written_at = written.as_host_ptr() as usize;
    let gate = Gate::new(context);
    gate.hold(&kernels, &s);
    filled.fill_async(FILLED, &s).expect("queued device fill");
    written.prepare_write(&s).expect("prepare");
    // SAFETY: the pool buffer's N u32s are device-accessible (mapped, or pinned under unified
    // addressing) and stay pinned until the kernel has run: its drop hands the recorded write's
    // event to the pool, which reuses or unpins the block only after it.
    unsafe { kernels.fill_u32(&s, written.device_ptr(), WRITTEN, N) }.expect("zero-copy kernel");
    written.record_write(&s).expect("record");
    assert_busy(filled.try_as_slice(), "a queued device fill");
    assert_busy(written.try_as_slice(), "a queued zero-copy kernel");
    drop(filled);
    drop(written);
    assert_eq!(pool.stats().pending_blocks, 2, "{:?}", pool.stats());

    // New owners while the gate holds both writes back.
    let mut next = pool.buffer::<u32>(N).expect("third block");
    let mut raw = pool.get_typed::<u32>(N).expect("fourth block");
    for address in [
        next.as_host_ptr() as usize,
        raw.as_slice().as_ptr() as usize,
    ] {
        assert!(
            address != filled_at && address != written_at,
            "the pool handed out a block under queued device work"
        );
    }
    next.as_mut_slice().expect("idle").fill(STAMP);
    raw.as_mut_slice().fill(!STAMP);
    let stats = pool.stats();
    assert_eq!(stats.pending_blocks, 2, "{stats:?}");
    assert_eq!(stats.misses, 4, "{stats:?}");
    gate.open();
    s.synchronize().expect("the queued writes ran");
    assert!(
        next.as_slice().expect("idle").iter().all(|&v| v == STAMP),
        "a queued device write landed in a new owner's block"
    );
    assert!(raw.as_slice().iter().all(|&v| v == !STAMP));
    drop(next);
    drop(raw);

    // Every block is ready now: four gets reuse all four, and the two written ones hold
    // exactly what the device wrote (it finished before the block came back).
    let again: Vec<_> = (0..4)
        .map(|_| pool.get_typed::<u32>(N).expect("reused block"))
        .collect();
    let stats = pool.stats();
    assert_eq!((stats.misses, stats.hits), (4, 4), "{stats:?}");
    let mut seen = 0;
    for block in &again {
        let at = block.as_slice().as_ptr() as usize;
        let want = if at == filled_at {
            FILLED
        } else if at == written_at {
            WRITTEN
        } else {
            continue;
        };
        seen += 1;
        assert!(block.as_slice().iter().all(|&v| v == want), "{want:#x}");
    }
    assert_eq!(
        seen, 2,
        "both written blocks come back once their work is done"
    );
}

// ---------------------------------------------------------------------------------------------
// Host slices and views: driving a data race through the safe API
// ---------------------------------------------------------------------------------------------

/// Tries every write path of the [`Buffer`] trait through `view`, a shared view of a buffer
/// whose host slice the caller holds: each must be refused as a read-only view.
fn try_every_write<B: Buffer<u32>>(view: &mut B, device: &DeviceBuffer<u32>, s: &Stream) {
    let len = view.len();
    let zeros = vec![0u32; len];
    assert_read_only(view.fill(0), "fill");
    assert_read_only(view.fill(0x0102_0304), "fill by pattern");
    assert_read_only(view.fill_async(0, s), "fill_async");
    assert_read_only(view.fill_async(0x0102_0304, s), "fill_async by words");
    assert_read_only(view.copy_from_host(&zeros), "copy_from_host");
    assert_read_only(view.copy_range_from_host(1, &zeros[1..]), "ranged upload");
    match view.copy_from_host_async(zeros.clone(), s) {
        Err(refused) => {
            assert!(
                matches!(refused.error(), MemoryError::ReadOnlyView { .. }),
                "{:?}",
                refused.error()
            );
            assert_eq!(refused.into_host(), Some(zeros.clone()), "handed back");
        }
        Ok(_) => panic!("an async upload through a shared view was accepted"),
    }
    match view.copy_range_from_host_on(0, zeros.clone(), s) {
        Err(refused) => assert!(matches!(refused.error(), MemoryError::ReadOnlyView { .. })),
        Ok(_) => panic!("an upload on a stream through a shared view was accepted"),
    }
    let source = device.slice(..len).expect("source view");
    assert_read_only(view.copy_from(&source), "copy_from");
    assert_read_only(view.copy_from_async(&source, s), "copy_from_async");
    assert_read_only(view.copy_range_from(0, device, 0, 1), "copy_range_from");
    assert_read_only(
        view.copy_range_from_async(0, device, 0, 1, s),
        "copy_range_from_async",
    );
    let lanes = [stream(device.context())];
    assert_read_only(view.staged_write(0, len, &lanes, |_| ()), "staged_write");
    assert_read_only(view.prepare_write(s), "prepare_write");
    assert_read_only(view.record_write(s), "record_write");
    assert_read_only(view.prepare_use(s), "prepare_use");
    assert_read_only(view.record_use(s), "record_use");
    // A mutable view of a shared view is no more writable than the shared one.
    let mut nested = view.slice_mut(1..).expect("nested view");
    assert_read_only(nested.fill_async(0, s), "fill_async through a nested view");
    assert_read_only(
        nested.copy_from_async(&device.slice(..len - 1).expect("source"), s),
        "copy through a nested view",
    );
}

/// A host reading a pinned or a managed buffer (`as_slice` held) while the program tries to
/// write it on the GPU through shared views, by every write path the [`Buffer`] trait has: each
/// is refused, nothing is queued, the slice keeps the host's bytes. Reads may share: an upload
/// *from* the pinned buffer runs while the host holds its slice. An exclusive view's device
/// write then keeps the host out (`DeviceBusy`) until it has landed, and lands only in its
/// range.
#[test]
fn host_slices_of_pinned_and_managed_buffers_cannot_be_raced_through_views() {
    let gpu = require_gpu!();
    let _serial = serial();
    let test = "host_slices_of_pinned_and_managed_buffers_cannot_be_raced_through_views";
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let s = stream(context);
    const N: usize = 4096;
    let data: Vec<u32> = (0..N as u32).map(|i| i * 3 + 1).collect();
    let other: Vec<u32> = (0..N as u32).map(|i| !i).collect();
    let device = DeviceBuffer::from_slice(context, &other).expect("device");

    let mut pinned = PinnedBuffer::from_slice(context, &data).expect("pinned");
    {
        let host = pinned.as_slice().expect("host slice");
        try_every_write(&mut pinned.slice(..).expect("whole view"), &device, &s);
        try_every_write(&mut pinned.slice(100..200).expect("part view"), &device, &s);
        // Reads coexist with the host's slice: an upload from the borrowed pinned buffer.
        let mut copy = DeviceBuffer::<u32>::new_on(&s, N).expect("copy");
        copy.copy_from_host_async(&pinned, &s)
            .expect("upload while the host reads")
            .wait()
            .expect("landed");
        assert_eq!(host, &data[..], "the host's bytes changed under its slice");
        assert_eq!(copy.to_vec().expect("copy"), data);
    }
    assert!(pinned.is_idle().expect("idle"));

    let managed = if managed_usable(gpu.device, test) {
        let managed = UnifiedBuffer::from_slice(context, &data).expect("managed");
        {
            let host = managed.as_slice().expect("host slice");
            try_every_write(&mut managed.slice(..).expect("whole view"), &device, &s);
            try_every_write(
                &mut managed.slice(N - 64..).expect("tail view"),
                &device,
                &s,
            );
            assert_eq!(host, &data[..]);
        }
        assert!(managed.is_idle().expect("idle"));
        Some(managed)
    } else {
        None
    };

    // Exclusive views write on the GPU; the host waits for them, and sees them only in range.
    let gate = Gate::new(context);
    gate.hold(&kernels, &s);
    pinned
        .slice_mut(10..20)
        .expect("exclusive view")
        .copy_from_async(&device.slice(0..10).expect("source"), &s)
        .expect("queued device copy into pinned memory");
    assert_busy(pinned.try_as_slice(), "pinned read under a queued copy");
    assert_busy(
        pinned.try_as_mut_slice(),
        "pinned write under a queued copy",
    );
    let mut managed = managed;
    if let Some(managed) = managed.as_mut() {
        managed
            .slice_mut(N - 5..)
            .expect("exclusive view")
            .fill_async(7, &s)
            .expect("queued fill of managed memory");
        assert_busy(managed.try_as_slice(), "managed read under a queued fill");
        assert_busy(
            managed.try_as_mut_slice(),
            "managed write under a queued fill",
        );
    }
    gate.open();
    let mut want = data.clone();
    want[10..20].copy_from_slice(&other[..10]);
    assert_eq!(pinned.as_slice().expect("waits"), &want[..]);
    if let Some(managed) = managed.as_mut() {
        let mut want = data.clone();
        want[N - 5..].fill(7);
        assert_eq!(managed.as_slice().expect("waits"), &want[..]);
    }

    // A regression check: a staged write through a shared view given no lanes ran its closure
    // and reported success instead of `ReadOnlyView` (the check sat in the per-lane `prepare`
    // only). Nothing can be written without a lane, but a refused write is refused whatever
    // the lane count.
    let no_lanes: [Stream; 0] = [];
    assert_read_only(
        pinned
            .slice(..)
            .expect("view")
            .staged_write(0, N, &no_lanes, |_| ()),
        "staged_write through a shared view with no lanes",
    );
}

// ---------------------------------------------------------------------------------------------
// Managed memory: out-of-core loop, read-mostly weights, policies, plans
// ---------------------------------------------------------------------------------------------

/// An out-of-core loop over more data than it holds at once: a ring of three 4 MiB managed
/// chunks processes 24 chunks (96 MiB of logical data). For each chunk the host writes its
/// input, the chunk is prefetched to the device (accessed-by advice keeps it mapped there),
/// two kernels increment it on one of two streams, and it is prefetched back to the host; the
/// host checks each result when its ring slot comes round again, while later chunks run. The
/// first chunk's pipeline is held behind a gate: the host is refused its slice until it opens.
#[test]
fn an_out_of_core_loop_over_a_ring_of_managed_chunks_reads_every_result_on_the_host() {
    let gpu = require_gpu!();
    let _serial = serial();
    let test = "an_out_of_core_loop_over_a_ring_of_managed_chunks_reads_every_result_on_the_host";
    if !managed_usable(gpu.device, test) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let streams = [stream(context), stream(context)];
    let device = MemLocation::Device(gpu.device.ordinal());
    const CHUNK: usize = MIB; // u32s: 4 MiB
    const RING: usize = 3;
    const CHUNKS: usize = 24;
    let input = |chunk: usize, i: usize| (chunk * CHUNK + i) as u32;
    let check = |buffer: &UnifiedBuffer<u32>, chunk: usize| {
        let host = buffer
            .as_slice()
            .expect("host read after the prefetch back");
        for (i, &got) in host.iter().enumerate() {
            assert_eq!(got, input(chunk, i) + 2, "chunk {chunk} element {i}");
        }
    };
    let mut ring: Vec<UnifiedBuffer<u32>> = (0..RING)
        .map(|_| UnifiedBuffer::new(context, CHUNK).expect("managed chunk"))
        .collect();
    for buffer in &ring {
        buffer
            .advise(MemAdvice::SetAccessedBy(device))
            .expect("accessed by the device");
    }
    let gate = Gate::new(context);
    for chunk in 0..CHUNKS {
        let s = &streams[chunk % 2];
        let buffer = &mut ring[chunk % RING];
        if chunk >= RING {
            check(buffer, chunk - RING);
        }
        for (i, x) in buffer
            .as_mut_slice()
            .expect("host write")
            .iter_mut()
            .enumerate()
        {
            *x = input(chunk, i);
        }
        if chunk == 0 {
            gate.hold(&kernels, s);
        }
        buffer
            .prefetch_to(device, s)
            .expect("prefetch to the device");
        buffer.prepare_write(s).expect("prepare");
        for _ in 0..2 {
            // SAFETY: the chunk holds CHUNK u32s of managed memory that outlive the kernels (the
            // write is recorded below; host access and the drop wait for it).
            unsafe { kernels.increment_u32(s, buffer.device_ptr(), CHUNK) }.expect("kernel");
        }
        buffer.record_write(s).expect("record");
        buffer
            .prefetch_to(MemLocation::Host, s)
            .expect("prefetch back");
        if chunk == 0 {
            assert_busy(buffer.try_as_slice(), "a chunk still in its pipeline");
            assert_busy(buffer.try_as_mut_slice(), "a chunk still in its pipeline");
            gate.open();
        }
    }
    for chunk in CHUNKS - RING..CHUNKS {
        check(&ring[chunk % RING], chunk);
    }
    for buffer in &ring {
        let hints = buffer.hints().expect("hints");
        assert_eq!(
            hints.accessed_by().expect("advice"),
            vec![device],
            "prefetches and kernels leave the advice alone"
        );
        assert_eq!(
            hints.last_prefetch_location().expect("read back"),
            Some(MemLocation::Host)
        );
    }
}

/// Model weights kept in managed memory with the read-mostly policy: prefetched to the device
/// (a read-only copy), read by checksum kernels on two request streams at once, then updated
/// by the host (an optimizer step on the CPU), which must wait for both readers; the advice
/// survives the write, and a reader after it sees the new weights.
#[test]
fn read_mostly_weights_read_on_two_streams_are_updated_by_the_host_after_both_reads() {
    let gpu = require_gpu!();
    let _serial = serial();
    let test = "read_mostly_weights_read_on_two_streams_are_updated_by_the_host_after_both_reads";
    if !managed_usable(gpu.device, test) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (a, b) = (stream(context), stream(context));
    const N: usize = 256 * KIB; // u32s: 1 MiB
    let initial: Vec<u32> = (0..N as u32).map(|i| i % 1000).collect();
    let sum: u64 = initial.iter().map(|&w| u64::from(w)).sum();
    let mut weights = UnifiedBuffer::from_slice(context, &initial).expect("weights");
    weights
        .apply_policy(&MigrationPolicy::ReadMostly)
        .expect("read mostly");
    weights
        .prefetch_to(MemLocation::Device(gpu.device.ordinal()), &a)
        .expect("prefetch a read copy");
    let checksum = |s: &Stream, weights: &UnifiedBuffer<u32>| {
        let out = DeviceBuffer::<u64>::zeroed(context, 1).expect("out");
        weights.prepare_read(s).expect("prepare read");
        out.prepare_write(s).expect("prepare out");
        // SAFETY: the weights hold N u32s and `out` one aligned u64; both outlive the kernel,
        // whose read and write are recorded right below.
        unsafe { kernels.checksum_u32(s, weights.device_ptr(), N, out.device_ptr()) }
            .expect("checksum");
        weights.record_read(s).expect("record read");
        out.record_write(s).expect("record out");
        out
    };
    let (on_a, on_b) = (checksum(&a, &weights), checksum(&b, &weights));
    assert_eq!(weights.concurrent_readers(), 2);
    for w in weights
        .as_mut_slice()
        .expect("waits for both readers")
        .iter_mut()
    {
        *w += 1;
    }
    assert_eq!(
        on_a.to_vec().expect("a")[0],
        sum,
        "reader on a saw the update"
    );
    assert_eq!(
        on_b.to_vec().expect("b")[0],
        sum,
        "reader on b saw the update"
    );
    assert!(
        weights
            .hints()
            .expect("hints")
            .read_mostly()
            .expect("advice")
    );
    let after = checksum(&b, &weights);
    assert_eq!(after.to_vec().expect("after")[0], sum + N as u64);
    assert!(
        weights
            .as_slice()
            .expect("host")
            .iter()
            .zip(&initial)
            .all(|(&w, &i)| w == i + 1)
    );
}

/// Two halves of one managed buffer get their own policies (read-mostly inputs, outputs kept
/// on the device), which read back per half; one half's policy is replaced without touching
/// the other; kernels and host reads see exact data through it all; a policy on the whole
/// buffer then replaces both.
#[test]
fn policies_on_halves_of_one_managed_buffer_combine_and_a_whole_buffer_policy_replaces_both() {
    let gpu = require_gpu!();
    let _serial = serial();
    let test =
        "policies_on_halves_of_one_managed_buffer_combine_and_a_whole_buffer_policy_replaces_both";
    if !managed_usable(gpu.device, test) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let s = stream(context);
    let device = MemLocation::Device(gpu.device.ordinal());
    const N: usize = MIB; // u32s: 4 MiB, halves of 2 MiB
    let data: Vec<u32> = (0..N as u32).collect();
    let buffer = UnifiedBuffer::from_slice(context, &data).expect("managed");
    let half = (N / 2) * 4;
    let (lo, hi) = (buffer.device_ptr(), buffer.device_ptr() + half as u64);
    let read_back = |ptr: u64| {
        (
            range_read_mostly(context, ptr, half).expect("read mostly"),
            range_preferred_location(context, ptr, half).expect("preferred"),
            range_accessed_by(context, ptr, half).expect("accessed by"),
        )
    };
    let lo_hints =
        ManagedMemoryHints::for_range(buffer.range(0, N / 2).expect("lo")).expect("lo hints");
    let hi_hints =
        ManagedMemoryHints::for_range(buffer.range(N / 2, N / 2).expect("hi")).expect("hi hints");
    lo_hints
        .apply_policy(&MigrationPolicy::ReadMostly)
        .expect("lo read mostly");
    hi_hints
        .apply_policy(&MigrationPolicy::PreferDevice(gpu.device.ordinal()))
        .expect("hi on the device");
    assert_eq!(read_back(lo), (true, None, vec![]));
    assert_eq!(read_back(hi), (false, Some(device), vec![device]));
    let whole = buffer.hints().expect("hints");
    assert!(
        !whole.read_mostly().expect("mixed"),
        "not read-mostly throughout"
    );
    assert_eq!(whole.preferred_location().expect("mixed"), None);
    assert!(whole.accessed_by().expect("mixed").is_empty());

    // Run kernels under the combined policies: both halves end up incremented.
    buffer.prefetch_range(N / 2, N / 2, device, &s).expect("hi");
    buffer.prepare_write(&s).expect("prepare");
    // SAFETY: N managed u32s that outlive the kernel (recorded below).
    unsafe { kernels.increment_u32(&s, buffer.device_ptr(), N) }.expect("kernel");
    buffer.record_write(&s).expect("record");
    assert!(
        buffer
            .as_slice()
            .expect("host")
            .iter()
            .zip(&data)
            .all(|(&got, &was)| got == was + 1)
    );

    // Replacing the low half's policy leaves the high half's alone.
    lo_hints
        .apply_policy(&MigrationPolicy::PreferHost)
        .expect("lo on the host");
    assert_eq!(read_back(lo), (false, Some(MemLocation::Host), vec![]));
    assert_eq!(read_back(hi), (false, Some(device), vec![device]));

    // A policy on the whole buffer replaces both halves' policies.
    buffer
        .apply_policy(&MigrationPolicy::ReadMostly)
        .expect("whole read mostly");
    assert_eq!(read_back(lo), (true, None, vec![]));
    assert_eq!(read_back(hi), (true, None, vec![]));
    buffer
        .apply_policy(&MigrationPolicy::Default)
        .expect("whole default");
    assert_eq!(read_back(lo), (false, None, vec![]));
    assert_eq!(read_back(hi), (false, None, vec![]));
    assert!(
        buffer
            .as_slice()
            .expect("host")
            .iter()
            .zip(&data)
            .all(|(&got, &was)| got == was + 1),
        "advice never changes the data"
    );
}

/// `apply_policy` promises to *replace* the range's policy, clearing every accessed-by first.
/// A program that keeps the host mapped on part of a buffer (`SetAccessedBy(Host)` on the half
/// the CPU post-processes) and then applies one policy to the whole buffer must find that
/// advice gone. The driver reports an accessed-by for a range only when it holds over the
/// *whole* range, and `apply_policy` added only devices to what it cleared, so a host
/// accessed-by on part of the range survived (a regression test: it now clears the host's by
/// name).
#[test]
fn a_whole_buffer_policy_clears_host_accessed_by_advice_set_on_part_of_the_buffer() {
    let gpu = require_gpu!();
    let _serial = serial();
    let test = "a_whole_buffer_policy_clears_host_accessed_by_advice_set_on_part_of_the_buffer";
    if !managed_usable(gpu.device, test) {
        return;
    }
    let context = &gpu.context;
    const N: usize = MIB; // u32s: 4 MiB
    let buffer = UnifiedBuffer::<u32>::new(context, N).expect("managed");
    let half = (N / 2) * 4;
    let tail = buffer.device_ptr() + half as u64;
    ManagedMemoryHints::for_range(buffer.range(N / 2, N / 2).expect("tail"))
        .expect("tail hints")
        .set_accessed_by(MemLocation::Host)
        .expect("host maps the tail");
    assert_eq!(
        range_accessed_by(context, tail, half).expect("tail"),
        vec![MemLocation::Host]
    );
    for policy in [
        MigrationPolicy::Default,
        MigrationPolicy::PreferDevice(gpu.device.ordinal()),
        MigrationPolicy::PreferHost,
        MigrationPolicy::ReadMostly,
    ] {
        buffer.apply_policy(&policy).expect("apply");
        let left = range_accessed_by(context, tail, half).expect("tail");
        assert!(
            !left.contains(&MemLocation::Host),
            "{policy}: the host accessed-by set on part of the buffer survived a policy that \
             replaces everything ({left:?})"
        );
        ManagedMemoryHints::for_range(buffer.range(N / 2, N / 2).expect("tail"))
            .expect("tail hints")
            .set_accessed_by(MemLocation::Host)
            .expect("again");
    }
}

/// A prefetch plan that alternates targets entry by entry over views of two buffers (each
/// change of target is a new location group for `cuMemPrefetchBatchAsync`): each range's last
/// prefetch reads back as asked, kernels then update both buffers on the device, a second plan
/// brings everything to the host, and the host reads exact data.
#[test]
fn prefetch_plans_alternating_targets_over_views_of_two_buffers_place_every_range() {
    let gpu = require_gpu!();
    let _serial = serial();
    let test = "prefetch_plans_alternating_targets_over_views_of_two_buffers_place_every_range";
    if !managed_usable(gpu.device, test) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let s = stream(context);
    let device = MemLocation::Device(gpu.device.ordinal());
    let expected_path = if cuweave_driver::driver()
        .expect("driver")
        .mem_prefetch_batch_async
        .is_available()
    {
        PrefetchPath::Batched
    } else {
        PrefetchPath::PerRange
    };
    const N: usize = MIB; // u32s: 4 MiB each
    const Q: usize = N / 4;
    let mut a = UnifiedBuffer::from_slice(context, &vec![10u32; N]).expect("a");
    let mut b = UnifiedBuffer::from_slice(context, &vec![20u32; N]).expect("b");
    let targets = [device, MemLocation::Host];
    {
        let mut plan = PrefetchPlan::new();
        for quarter in 0..4 {
            plan.add(a.range(quarter * Q, Q).expect("a"), targets[quarter % 2])
                .expect("add a")
                .add(
                    b.hints()
                        .expect("hints")
                        .subrange(quarter * Q, Q)
                        .expect("b"),
                    targets[(quarter + 1) % 2],
                )
                .expect("add b");
        }
        assert_eq!((plan.len(), plan.total_bytes()), (8, 2 * N * 4));
        assert_eq!(plan.execute(&s).expect("execute"), expected_path);
        for quarter in 0..4 {
            let at = (quarter * Q * 4) as u64;
            assert_eq!(
                range_last_prefetch_location(context, a.device_ptr() + at, Q * 4).expect("a"),
                Some(targets[quarter % 2]),
                "a quarter {quarter}"
            );
            assert_eq!(
                range_last_prefetch_location(context, b.device_ptr() + at, Q * 4).expect("b"),
                Some(targets[(quarter + 1) % 2]),
                "b quarter {quarter}"
            );
        }
    }
    for buffer in [&a, &b] {
        buffer.prepare_write(&s).expect("prepare");
        // SAFETY: N managed u32s that outlive the kernel (recorded below).
        unsafe { kernels.increment_u32(&s, buffer.device_ptr(), N) }.expect("kernel");
        buffer.record_write(&s).expect("record");
    }
    let mut back = PrefetchPlan::new();
    back.add(&a, MemLocation::Host)
        .expect("a")
        .add(&b, MemLocation::Host)
        .expect("b");
    assert_eq!(back.execute(&s).expect("execute"), expected_path);
    drop(back);
    assert_busy_or_done(&a);
    assert!(a.as_mut_slice().expect("host").iter().all(|&v| v == 11));
    assert!(b.as_mut_slice().expect("host").iter().all(|&v| v == 21));
}

/// `try_as_slice` right after a queued plan is either refused or, if the GPU already finished,
/// granted with the final data: never granted with anything else.
fn assert_busy_or_done(buffer: &UnifiedBuffer<u32>) {
    match buffer.try_as_slice() {
        Ok(host) => assert!(host.iter().all(|&v| v == 11)),
        Err(MemoryError::DeviceBusy { .. }) => {}
        Err(other) => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// non_blocking downloads into persistent pinned outputs
// ---------------------------------------------------------------------------------------------

/// Inference with persistent pinned output tensors (`out = torch.empty(.., pin_memory=True)`,
/// `out.copy_(result, non_blocking=True)`): a kernel writes each batch's result into one of two
/// device slots on a compute stream, the result is downloaded into one of three pinned outputs
/// on a copy stream, and the host reads batch `i - 2` only after batch `i` has been queued. So
/// when batch `i` is written into its slot, the download of batch `i - 2` from that slot may
/// still be queued: the compute stream must wait for the copy stream's read, or the host would
/// find batch `i`'s values in batch `i - 2`'s output. Four thousand batches, every value exact.
#[test]
fn persistent_pinned_outputs_of_non_blocking_downloads_hold_each_batchs_own_values() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (compute, copy) = (stream(context), stream(context));
    const N: usize = 16 * KIB; // u32s: 64 KiB
    const BATCHES: usize = 4000;
    const OUTPUTS: usize = 3;
    let value = |batch: usize| (batch as u32).wrapping_mul(7) + 1;
    let slots: Vec<DeviceBuffer<u32>> = (0..2)
        .map(|_| DeviceBuffer::new_on(&compute, N).expect("slot"))
        .collect();
    let mut spare: VecDeque<PinnedBuffer<u32>> = (0..OUTPUTS)
        .map(|_| PinnedBuffer::new(context, N).expect("pinned output"))
        .collect();
    let mut in_flight: VecDeque<(usize, PendingCopy<PinnedBuffer<u32>>)> = VecDeque::new();
    let read = |batch: usize, pending: PendingCopy<PinnedBuffer<u32>>| {
        let out = pending.wait().expect("downloaded");
        let host = out
            .try_as_slice()
            .expect("idle once the download was waited for");
        assert!(
            host.iter().all(|&v| v == value(batch)),
            "batch {batch}: the pinned output holds another batch's values"
        );
        out
    };
    for batch in 0..BATCHES {
        let slot = &slots[batch % 2];
        slot.prepare_write(&compute).expect("prepare");
        // SAFETY: the slot holds N u32s and outlives the kernel, whose write is recorded below.
        unsafe { kernels.fill_u32(&compute, slot.device_ptr(), value(batch), N) }.expect("produce");
        slot.record_write(&compute).expect("record");
        let out = spare.pop_front().expect("a free pinned output");
        in_flight.push_back((
            batch,
            slot.copy_to_host_async(out, &copy)
                .expect("non_blocking download"),
        ));
        if in_flight.len() == OUTPUTS {
            let (done, pending) = in_flight.pop_front().expect("oldest");
            spare.push_back(read(done, pending));
        }
    }
    for (batch, pending) in in_flight.drain(..) {
        drop(read(batch, pending));
    }
    for slot in &slots {
        assert!(slot.tracked_uses() <= 32);
    }
}

// ---------------------------------------------------------------------------------------------
// Views of pool pinned buffers and managed buffers
// ---------------------------------------------------------------------------------------------

/// Part of a pinned batch staged into parts of a managed buffer by device copies between views
/// (the pinned pool's block read in place, the managed pages written where they are), queued
/// behind a gate: the host may not write the pinned batch nor touch the managed buffer until
/// they land. Then a managed view is copied back into a view of the pinned buffer, and a view's
/// range prefetched; every element ends exactly where it was copied, the rest untouched.
#[test]
fn views_of_pool_pinned_and_managed_buffers_copy_into_each_other_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    let test = "views_of_pool_pinned_and_managed_buffers_copy_into_each_other_exactly";
    if !managed_usable(gpu.device, test) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let s = stream(context);
    let pool = PinnedPool::new(context);
    const N: usize = 64 * KIB; // u32s: 256 KiB
    let batch: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(0x9E37_79B9)).collect();
    let mut staging = pool.buffer::<u32>(N).expect("pool buffer");
    staging
        .as_mut_slice()
        .expect("fresh")
        .copy_from_slice(&batch);
    let mut managed = UnifiedBuffer::<u32>::new(context, N).expect("managed");

    let gate = Gate::new(context);
    gate.hold(&kernels, &s);
    managed
        .slice_mut(..N / 4)
        .expect("first quarter")
        .copy_from_async(&staging.slice(N / 2..3 * N / 4).expect("third quarter"), &s)
        .expect("pinned view to managed view");
    managed
        .slice_mut(N / 2..)
        .expect("upper half")
        .copy_from_async(&staging.slice(..N / 2).expect("lower half"), &s)
        .expect("pinned view to managed view");
    assert_busy(
        staging.try_as_mut_slice(),
        "pinned write under a queued read",
    );
    assert_busy(managed.try_as_slice(), "managed read under a queued write");
    gate.open();
    let mut want = vec![0u32; N];
    want[..N / 4].copy_from_slice(&batch[N / 2..3 * N / 4]);
    want[N / 2..].copy_from_slice(&batch[..N / 2]);
    assert_eq!(managed.as_slice().expect("waits"), &want[..]);

    // Back: a managed view into a pinned view, then a ranged prefetch of the managed source.
    staging
        .slice_mut(N / 4..N / 2)
        .expect("pinned second quarter")
        .copy_from_async(&managed.slice(N / 2..3 * N / 4).expect("managed"), &s)
        .expect("managed view to pinned view");
    managed
        .prefetch_range(N / 2, N / 4, MemLocation::Host, &s)
        .expect("prefetch the copied range");
    let mut back = batch.clone();
    back[N / 4..N / 2].copy_from_slice(&batch[..N / 4]);
    assert_eq!(staging.as_slice().expect("waits"), &back[..]);
    assert_eq!(managed.as_slice().expect("host"), &want[..]);
    drop(staging);
    assert_eq!(pool.stats().allocated_blocks, 0);
}

// ---------------------------------------------------------------------------------------------
// Host read-modify-write of managed memory between kernels
// ---------------------------------------------------------------------------------------------

/// The classic managed-memory program: kernels and host code take turns on one buffer with no
/// explicit copies. Kernels on two streams alternate (each must wait for the other's write, or
/// increments are lost), every third iteration prefetches to the device first, and every other
/// iteration the host adds to the even elements, half the time from another thread. Two
/// hundred iterations; every element ends exactly where the turns put it.
#[test]
fn host_and_kernels_on_two_streams_take_turns_on_managed_memory_without_losing_an_update() {
    let gpu = require_gpu!();
    let _serial = serial();
    let test =
        "host_and_kernels_on_two_streams_take_turns_on_managed_memory_without_losing_an_update";
    if !managed_usable(gpu.device, test) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let streams = [stream(context), stream(context)];
    let device = MemLocation::Device(gpu.device.ordinal());
    const N: usize = 256 * KIB; // u32s: 1 MiB
    const ITERATIONS: usize = 200;
    let mut buffer = UnifiedBuffer::<u32>::new(context, N).expect("managed");
    for iteration in 0..ITERATIONS {
        let s = &streams[iteration % 2];
        if iteration % 3 == 0 {
            buffer.prefetch_to(device, s).expect("prefetch");
        }
        buffer.prepare_write(s).expect("prepare");
        // SAFETY: N managed u32s that outlive the kernel (recorded below); the host touches
        // them only through slices, which wait for it.
        unsafe { kernels.increment_u32(s, buffer.device_ptr(), N) }.expect("kernel");
        buffer.record_write(s).expect("record");
        if iteration % 2 == 1 {
            let host_step = |buffer: &mut UnifiedBuffer<u32>| {
                for x in buffer.as_mut_slice().expect("host").iter_mut().step_by(2) {
                    *x += 10;
                }
            };
            if iteration % 4 == 1 {
                std::thread::scope(|scope| {
                    scope.spawn(|| host_step(&mut buffer));
                });
            } else {
                host_step(&mut buffer);
            }
        }
        assert!(buffer.tracked_uses() <= 32);
    }
    let host = buffer.as_slice().expect("host");
    for (i, &got) in host.iter().enumerate() {
        let want = ITERATIONS as u32
            + if i % 2 == 0 {
                10 * (ITERATIONS as u32 / 2)
            } else {
                0
            };
        assert_eq!(got, want, "element {i}");
    }
}

// ---------------------------------------------------------------------------------------------
// Variable-sized pinned batches under a cache cap
// ---------------------------------------------------------------------------------------------

/// Variable-length batches (as a collate function with padding to the longest sequence makes)
/// staged through a pinned pool whose cache is capped at 256 KiB: four size classes cannot all
/// stay cached, so the pool unpins and pins again. Three thousand batches: every upload lands
/// exactly, the ready cache never exceeds its cap, the books balance at every step, pinned
/// memory stays bounded by the cap plus what is in flight, and a final trim unpins everything.
#[test]
fn variable_sized_pinned_batches_under_a_cache_cap_stay_bounded_and_land_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let s = stream(context);
    const CAP: usize = 256 * KIB;
    const DEPTH: usize = 2;
    const LENGTHS: [usize; 5] = [100, 3_000, 20_000, 60_000, 1]; // u32s: 4, 16, 128, 256, 4 KiB
    const BATCHES: usize = 3000;
    let pool = PinnedPool::with_config(
        context,
        PinnedPoolConfig {
            max_cached_bytes: CAP,
            ..PinnedPoolConfig::default()
        },
    );
    let mut device = DeviceBuffer::<u32>::new_on(&s, 60_000).expect("device");
    let mut in_flight: VecDeque<PendingCopy<PinnedBuffer<u32>>> = VecDeque::new();
    let mut check = vec![0u32; 60_000];
    for batch in 0..BATCHES {
        if in_flight.len() == DEPTH {
            drop(
                in_flight
                    .pop_front()
                    .expect("oldest")
                    .wait()
                    .expect("upload"),
            );
        }
        let len = LENGTHS[(batch * 7 + batch / 5) % LENGTHS.len()];
        let mut staged = pool.buffer::<u32>(len).expect("pool buffer");
        for (i, x) in staged.as_mut_slice().expect("fresh").iter_mut().enumerate() {
            *x = (batch as u32) << 16 | i as u32 & 0xFFFF;
        }
        in_flight.push_back(
            device
                .copy_range_from_host_async(0, staged, &s)
                .expect("upload"),
        );
        if batch % 97 == 0 {
            device
                .copy_range_to_host(0, &mut check[..len])
                .expect("download after the upload");
            for (i, &got) in check[..len].iter().enumerate() {
                assert_eq!(got, (batch as u32) << 16 | i as u32 & 0xFFFF, "{batch}/{i}");
            }
        }
        let stats = pool.stats();
        assert_eq!(
            stats.pinned_bytes,
            stats.allocated_bytes + stats.cached_bytes
        );
        assert!(stats.pending_bytes <= stats.cached_bytes);
        assert!(stats.ready_bytes() <= CAP, "{stats:?}");
    }
    for pending in in_flight.drain(..) {
        drop(pending.wait().expect("upload"));
    }
    let stats = pool.stats();
    assert_eq!(stats.gets, BATCHES as u64);
    assert_eq!(stats.returns, stats.gets);
    assert!(
        stats.frees > 0,
        "the cap never made the pool unpin: {stats:?}"
    );
    assert!(stats.hits > 0, "{stats:?}");
    assert!(
        stats.peak_pinned_bytes <= CAP + 2 * (DEPTH + 1) * 256 * KIB,
        "pinned memory grew past the cap and the blocks in flight: {stats:?}"
    );
    pool.trim();
    let stats = pool.stats();
    assert_eq!(
        (
            stats.pinned_bytes,
            stats.cached_bytes,
            stats.allocated_bytes
        ),
        (0, 0, 0),
        "{stats:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

/// Zero lengths, ranges past the end, lengths that differ, device ordinals that do not exist,
/// devices that lack concurrent managed access, and streams of another device (when there is
/// one), through pinned and managed buffers, hints, plans and the pool: typed errors, never a
/// panic; async refusals hand their host side back; the buffers keep their data and stay idle.
#[test]
fn bad_managed_and_pinned_requests_are_typed_errors_and_change_nothing() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let s = stream(context);
    const N: usize = 1024;
    let data: Vec<u32> = (0..N as u32).map(|i| i ^ 0xA5A5).collect();
    let zero = |result: cuweave_memory::Result<()>, what: &str| {
        assert!(
            matches!(result, Err(MemoryError::ZeroLength { .. })),
            "{what}: {result:?}"
        );
    };
    let past = |result: cuweave_memory::Result<()>, what: &str| {
        assert!(
            matches!(result, Err(MemoryError::OutOfRange { .. })),
            "{what}: {result:?}"
        );
    };
    let mismatch = |result: cuweave_memory::Result<()>, what: &str| {
        assert!(
            matches!(result, Err(MemoryError::SizeMismatch { .. })),
            "{what}: {result:?}"
        );
    };

    // Pinned memory: its blocking copies are CPU copies with their own range checks.
    zero(PinnedBuffer::<u32>::new(context, 0).map(drop), "new(0)");
    zero(
        PinnedBuffer::<u32>::from_slice(context, &[]).map(drop),
        "from_slice(&[])",
    );
    let pool = PinnedPool::new(context);
    zero(pool.buffer::<u32>(0).map(drop), "pool.buffer(0)");
    zero(pool.get_typed::<u64>(0).map(drop), "pool.get_typed(0)");
    let mut pinned = PinnedBuffer::from_slice(context, &data).expect("pinned");
    past(pinned.copy_range_from_host(N, &[1]), "upload at the end");
    past(
        pinned.copy_range_from_host(usize::MAX, &[1]),
        "upload at MAX",
    );
    zero(pinned.copy_range_from_host(3, &[]), "empty upload");
    past(
        pinned.copy_range_to_host(N - 1, &mut [0; 2]),
        "download past the end",
    );
    zero(pinned.copy_range_to_host(0, &mut []), "empty download");
    mismatch(pinned.copy_from_host(&data[1..]), "short upload");
    mismatch(pinned.copy_to_host(&mut vec![0; N + 1]), "long download");
    past(pinned.slice(N..=N).map(drop), "view past the end");
    zero(pinned.slice(5..5).map(drop), "empty view");
    match pinned.copy_from_host_async(vec![0u32; N - 1], &s) {
        Err(refused) => {
            assert!(matches!(refused.error(), MemoryError::SizeMismatch { .. }));
            assert_eq!(refused.into_host().map(|host| host.len()), Some(N - 1));
        }
        Ok(_) => panic!("a short async upload into pinned memory was accepted"),
    }
    assert_eq!(pinned.as_slice().expect("untouched"), &data[..]);
    assert_eq!(pool.stats().allocated_bytes, 0);

    // Managed memory.
    zero(
        UnifiedBuffer::<u32>::new(context, 0).map(drop),
        "managed new(0)",
    );
    zero(
        UnifiedBuffer::<u32>::from_slice(context, &[]).map(drop),
        "managed from_slice(&[])",
    );
    assert!(matches!(
        UnifiedBuffer::<u64>::new(context, usize::MAX / 8 + 1),
        Err(MemoryError::Misaligned { .. })
    ));
    let capabilities = ManagedCapabilities::of(gpu.device).expect("capabilities");
    let count = Device::count().expect("device count");
    let managed = if capabilities.managed_memory && capabilities.concurrent_managed_access {
        let managed = UnifiedBuffer::from_slice(context, &data).expect("managed");
        managed
            .advise(MemAdvice::SetPreferredLocation(MemLocation::Host))
            .expect("prefer host");
        past(managed.range(N - 1, 2).map(drop), "range past the end");
        zero(managed.range(N, 0).map(drop), "empty range");
        past(
            managed.prefetch_range(N, 1, MemLocation::Host, &s),
            "prefetch past the end",
        );
        zero(
            managed.prefetch_range(0, 0, MemLocation::Host, &s),
            "empty prefetch",
        );
        let hints = managed.hints().expect("hints");
        past(hints.subrange(1, N).map(drop), "subrange past the end");
        past(
            hints.prefetch_range(usize::MAX, 2, MemLocation::Host, &s),
            "prefetch at MAX",
        );
        let missing = MemLocation::Device(count);
        assert_invalid_target(managed.prefetch_to(missing, &s), "prefetch target");
        for advice in [
            MemAdvice::SetPreferredLocation(missing),
            MemAdvice::SetAccessedBy(missing),
            MemAdvice::UnsetAccessedBy(missing),
        ] {
            assert_invalid_target(managed.advise(advice), &advice.to_string());
        }
        assert_invalid_target(
            managed.apply_policy(&MigrationPolicy::PreferDevice(count)),
            "policy for a missing device",
        );
        assert_eq!(
            hints.preferred_location().expect("read back"),
            Some(MemLocation::Host),
            "a refused policy changed the advice"
        );
        let mut plan = PrefetchPlan::new();
        assert_invalid_target(plan.add(&managed, missing).map(drop), "plan target");
        assert!(plan.is_empty());
        past(
            managed.copy_range_to_host(N - 1, &mut [0; 2]),
            "managed download past the end",
        );
        match managed.copy_range_to_host_async(N - 1, vec![0u32; 2], &s) {
            Err(refused) => {
                assert!(matches!(refused.error(), MemoryError::OutOfRange { .. }));
                assert_eq!(refused.into_host(), Some(vec![0u32; 2]), "handed back");
            }
            Ok(_) => panic!("an async download past the end was accepted"),
        }
        // Advice naming each device: accepted exactly where it has concurrent managed access,
        // a typed CapabilityMissing elsewhere.
        for ordinal in 0..count {
            let target = ManagedCapabilities::of(Device::get(ordinal).expect("device"))
                .expect("capabilities");
            let result = managed.advise(MemAdvice::SetAccessedBy(MemLocation::Device(ordinal)));
            if target.managed_memory && target.concurrent_managed_access {
                result.expect("advice for a capable device");
                managed
                    .advise(MemAdvice::UnsetAccessedBy(MemLocation::Device(ordinal)))
                    .expect("undo");
            } else {
                assert!(
                    matches!(
                        result,
                        Err(MemoryError::Driver(DriverError::CapabilityMissing { .. }))
                    ),
                    "device {ordinal}: {result:?}"
                );
            }
        }
        assert_eq!(managed.as_slice().expect("untouched"), &data[..]);
        Some(managed)
    } else {
        None
    };

    // Streams of another device.
    if count >= 2 {
        let other = Context::primary(Device::get(1).expect("device 1")).expect("context 1");
        let foreign = stream(&other);
        let wrong = |result: cuweave_memory::Result<()>, what: &str| {
            assert!(
                matches!(result, Err(MemoryError::WrongDevice { .. })),
                "{what}: {result:?}"
            );
        };
        wrong(pinned.fill_async(1, &foreign), "pinned fill on device 1");
        wrong(pinned.record_write(&foreign), "pinned use on device 1");
        if let Some(managed) = &managed {
            wrong(
                managed.prefetch_to(MemLocation::Host, &foreign),
                "prefetch on device 1",
            );
            let mut plan = PrefetchPlan::new();
            plan.add(managed, MemLocation::Host).expect("add");
            wrong(plan.execute(&foreign).map(drop), "plan on device 1");
            match managed.copy_to_host_async(vec![0u32; N], &foreign) {
                Err(refused) => {
                    assert!(matches!(refused.error(), MemoryError::WrongDevice { .. }));
                    assert!(refused.into_host().is_some(), "handed back");
                }
                Ok(_) => panic!("a download on another device's stream was accepted"),
            }
            assert_eq!(managed.as_slice().expect("untouched"), &data[..]);
        }
    }
    assert!(pinned.is_idle().expect("idle"));
    assert_eq!(pinned.as_slice().expect("untouched"), &data[..]);
}
