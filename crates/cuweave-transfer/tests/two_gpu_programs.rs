//! GPU tests of what programs with two GPUs in one process do with the transfer manager: a
//! tensor moved to the other device (`tensor.to('cuda:1')`) at odd sizes, element types,
//! offsets and views; model-parallel stages moving activations both ways at once from two
//! threads; a thousand ping-pongs with kernels on both devices and flat memory; a kernel on one
//! device writing late while a kernel on the other still reads the destination; peer-to-peer
//! forced with and without peer access; a manager limited to device 1 that must never open
//! device 0 (checked in a child process, where nothing else made a context); per-pair
//! calibration deciding each direction; statistics by path; per-device caching allocators
//! feeding a two-stage pipeline; data-parallel loaders on threads whose current device is the
//! other one; views of pinned and unified memory crossing devices.
//!
//! Every test skips (printing `SKIPPED <test>: needs two GPUs, ...`) on a machine with fewer
//! than two GPUs, and where there is no GPU at all.

// Loops over device ordinals index several per-device arrays at once: the index is the device.
#![allow(clippy::needless_range_loop)]

mod common;

use std::sync::{Arc, Barrier};

use common::{
    SENTINEL, assert_all_u32, assert_bytes, block_on, bytes, grid, late_fill, user_stream, watch,
};
use cuweave_driver::{Context, Device, Kernel, Stream};
use cuweave_memory::{
    Buffer, CachingAllocator, DeviceBuffer, Element, PinnedBuffer, TrackedLaunch, UnifiedBuffer,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{serial, skip};
use cuweave_transfer::{
    CalibrationTable, Destination, Location, MAX_IDLE_LANES, MIN_CHUNK_BYTES, PlanReason, Query,
    SizeClass, Source, StagingConfig, TransferError, TransferManager, TransferMethod, TransferPath,
};

const MIB: usize = 1 << 20;
/// How long the late writer and the reader of the ordering tests keep their devices busy.
const KERNEL_NS: u64 = 20_000_000;
const OLD: u32 = 0x0101_0101;
const WRITTEN: u32 = 0x7E57_AB1E;

/// The binary's serial guard.
type Serial = std::sync::MutexGuard<'static, ()>;

/// What every two-GPU test starts from: the binary's serial guard, device 0's and device 1's
/// primary contexts and a fresh manager; or `None` after printing why the test skips (no GPU,
/// or fewer than two). The guard comes first so that it is dropped last.
fn two_gpus(test: &str) -> Option<(Serial, [Arc<Context>; 2], TransferManager)> {
    let gpu = cuweave_test_support::gpu(test)?;
    let count = Device::count().unwrap_or(0);
    if count < 2 {
        skip(test, &format!("needs two GPUs, found {count}"));
        return None;
    }
    let other = Context::primary(Device::get(1).unwrap()).unwrap();
    let serial = serial();
    Some((
        serial,
        [gpu.context, other],
        TransferManager::new().unwrap(),
    ))
}

/// The test kernels loaded on each device.
fn kernels_on(contexts: &[Arc<Context>; 2]) -> [TestKernels; 2] {
    contexts.each_ref().map(|c| TestKernels::load(c).unwrap())
}

/// The kernel `name` of each device's test kernels.
fn function_on(kernels: &[TestKernels; 2], name: &str) -> [Kernel; 2] {
    kernels
        .each_ref()
        .map(|k| k.module().function(name).unwrap())
}

/// Each device's default caching allocator.
fn caches_of(contexts: &[Arc<Context>; 2]) -> [CachingAllocator; 2] {
    contexts
        .each_ref()
        .map(|c| CachingAllocator::for_device(c.device()).unwrap())
}

/// The methods a forced transfer from device `a` to device `b` may use on this machine, with
/// `None` for the planned one.
fn peer_methods(manager: &TransferManager, a: usize, b: usize) -> Vec<Option<TransferMethod>> {
    let mut methods = vec![
        None,
        Some(TransferMethod::DirectCopy),
        Some(TransferMethod::HostStaged),
    ];
    if manager
        .facts(Location::Device(a), Location::Device(b))
        .peer_access
    {
        methods.push(Some(TransferMethod::PeerToPeer));
    }
    methods
}

/// What a transfer returns.
type Moved = Result<cuweave_transfer::TransferReport, TransferError>;

/// Runs the planned transfer (`None`) or the forced one.
fn move_by<'s, 'd, T: Element>(
    manager: &TransferManager,
    method: Option<TransferMethod>,
    src: impl Into<Source<'s, T>>,
    dst: impl Into<Destination<'d, T>>,
) -> Moved {
    match method {
        None => manager.transfer(src, dst),
        Some(m) => manager.transfer_with(m, src, dst),
    }
}

/// `len` elements of `T` built from bytes with no short period.
fn elements<T: Element>(len: usize, seed: u64) -> Vec<T> {
    bytes(len * size_of::<T>(), seed)
        .chunks_exact(size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

/// The element whose bytes are all [`SENTINEL`].
fn sentinel<T: Element>() -> T {
    bytemuck::pod_read_unaligned(&vec![SENTINEL; size_of::<T>()])
}

/// Queues `data[i] += 1` on `stream`, declared a write of `data` (of its range, for a view).
fn increment(kernel: &Kernel, stream: &Stream, data: &mut impl Buffer<u32>) {
    let n = data.len() as u64;
    let config = grid(data.len(), 4096);
    // SAFETY: increment_u32(unsigned* data, size_t n) gets the buffer's address and length; it
    // reads and writes only `data`, declared a write.
    unsafe {
        TrackedLaunch::new(kernel, stream, config)
            .write(data)
            .arg(&n)
            .launch()
    }
    .unwrap();
}

/// Sums the statistics of `path` over every size class: (count, bytes, failures).
fn on_path(manager: &TransferManager, path: TransferPath) -> (u64, u64, u64) {
    manager
        .stats()
        .snapshot()
        .iter()
        .filter(|(p, _, _)| *p == path)
        .fold((0, 0, 0), |(c, b, f), (_, _, s)| {
            (c + s.count, b + s.bytes, f + s.failures)
        })
}

// ---------------------------------------------------------------------------------------------
// 1. tensor.to('cuda:1') and back at odd sizes, element types, offsets and views
// ---------------------------------------------------------------------------------------------

/// Moves `T` elements between the devices, both ways, at lengths around the staging chunk
/// (whole, one short, one over, several and a tail) from an odd element offset of the source
/// (a view) into an odd offset of the destination (a view or a buffer offset), by every method
/// the pair offers; every element of the destination is checked, the ones around the range too.
/// Returns the transfers made and the bytes they moved.
fn exchange<T: Element>(
    manager: &TransferManager,
    contexts: &[Arc<Context>; 2],
    what: &str,
) -> (u64, u64) {
    let (mut count, mut moved) = (0u64, 0u64);
    let chunk = manager
        .staging_for(TransferPath::PEER, 0, 4 * MIB)
        .chunk_elements::<T>();
    let lens = [
        1,
        chunk - 1,
        chunk,
        chunk + 1,
        3 * chunk + 7,
        MIB / size_of::<T>() + 5,
    ];
    let (src_at, dst_at) = (7usize, 5usize);
    for (a, b) in [(0usize, 1usize), (1, 0)] {
        let methods = peer_methods(manager, a, b);
        for &len in &lens {
            let data: Vec<T> = elements(len + src_at + 3, (len * 31 + a) as u64);
            let src = DeviceBuffer::from_slice(&contexts[a], &data).unwrap();
            let around = vec![sentinel::<T>(); len + dst_at + 9];
            let mut dst = DeviceBuffer::from_slice(&contexts[b], &around).unwrap();
            for (i, &method) in methods.iter().enumerate() {
                dst.copy_from_host(&around).unwrap();
                let from = Source::view(src.slice(src_at..src_at + len).unwrap());
                let report = if i % 2 == 0 {
                    let into = Destination::view(dst.slice_mut(dst_at..dst_at + len).unwrap());
                    move_by(manager, method, from, into)
                } else {
                    move_by(manager, method, from, Destination::device(&mut dst, dst_at))
                }
                .unwrap_or_else(|e| panic!("{what}: {len} elements {a} -> {b} by {method:?}: {e}"));
                assert_eq!(report.bytes, len * size_of::<T>());
                assert_eq!(report.plan.path, TransferPath::PEER);
                count += 1;
                moved += report.bytes as u64;
                if let Some(m) = method {
                    assert_eq!(report.plan.method, m);
                }
                let got = dst.to_vec().unwrap();
                let label = format!(
                    "{what}: {len} elements {a} -> {b} by {}",
                    report.plan.method
                );
                assert_bytes(
                    &got[..dst_at],
                    &around[..dst_at],
                    &format!("{label}: before"),
                );
                assert_bytes(
                    &got[dst_at..dst_at + len],
                    &data[src_at..src_at + len],
                    &label,
                );
                assert_bytes(
                    &got[dst_at + len..],
                    &around[dst_at + len..],
                    &format!("{label}: after"),
                );
            }
        }
    }
    (count, moved)
}

/// A model's tensors moved to the other device and back: `u16` (half precision), 3-byte
/// records whose size divides no staging chunk, and `f64`, with the default staging and with
/// the smallest chunk (so a 1 MiB copy bounces through hundreds of pinned blocks), every
/// transfer counted once on the peer path.
#[test]
fn tensors_move_between_devices_at_odd_lengths_offsets_and_views_by_every_method() {
    const TEST: &str =
        "tensors_move_between_devices_at_odd_lengths_offsets_and_views_by_every_method";
    let Some((_serial, contexts, manager)) = two_gpus(TEST) else {
        return;
    };
    let tiny = TransferManager::with_staging(StagingConfig {
        chunk_bytes: MIN_CHUNK_BYTES,
        depth: 2,
        ..StagingConfig::for_upload(MIB)
    })
    .unwrap();
    for manager in [&manager, &tiny] {
        manager.stats().reset();
        let moved = [
            exchange::<u16>(manager, &contexts, "u16"),
            exchange::<[u8; 3]>(manager, &contexts, "[u8; 3]"),
            exchange::<f64>(manager, &contexts, "f64"),
        ];
        let total = moved
            .iter()
            .fold((0, 0), |(c, b), &(c2, b2)| (c + c2, b + b2));
        assert_eq!(
            on_path(manager, TransferPath::PEER),
            (total.0, total.1, 0),
            "every transfer counted once on the peer path"
        );
        assert!(
            manager
                .stats()
                .snapshot()
                .iter()
                .all(|(path, _, _)| *path == TransferPath::PEER),
            "a copy between devices was counted on another path: {:?}",
            manager.stats().snapshot()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Both directions at once from two threads, beside host traffic to each device
// ---------------------------------------------------------------------------------------------

/// Pipeline stages on two threads send activations 0 -> 1 and gradients 1 -> 0 at the same
/// moments through one fresh manager (so their first transfers race to open both devices and
/// to enable peer access), while two more threads load batches into and out of each device.
/// Every byte lands, nothing fails, the statistics count each transfer on its path exactly
/// and the devices keep at most their idle lanes.
#[test]
fn both_directions_at_once_from_two_threads_on_one_fresh_manager() {
    const TEST: &str = "both_directions_at_once_from_two_threads_on_one_fresh_manager";
    let Some((_serial, contexts, manager)) = two_gpus(TEST) else {
        return;
    };
    const ROUNDS: usize = 24;
    let barrier = Barrier::new(4);
    let (manager, contexts, barrier) = (&manager, &contexts, &barrier);
    std::thread::scope(|scope| {
        for (a, b) in [(0usize, 1usize), (1, 0)] {
            scope.spawn(move || {
                let methods = peer_methods(manager, a, b);
                barrier.wait();
                for round in 0..ROUNDS {
                    let n = 3 * MIB / 4 + round * 977 + a;
                    let data = bytes(n, (round * 2 + a) as u64);
                    let src = DeviceBuffer::from_slice(&contexts[a], &data).unwrap();
                    let mut dst = DeviceBuffer::<u8>::new(&contexts[b], n).unwrap();
                    let method = methods[round % methods.len()];
                    move_by(manager, method, &src, &mut dst)
                        .unwrap_or_else(|e| panic!("round {round} {a} -> {b} {method:?}: {e}"));
                    assert_bytes(
                        &dst.to_vec().unwrap(),
                        &data,
                        &format!("round {round}, {n} bytes {a} -> {b} by {method:?}"),
                    );
                }
            });
        }
        for d in 0..2usize {
            scope.spawn(move || {
                barrier.wait();
                for round in 0..ROUNDS {
                    let n = MIB + round * 4099 + d;
                    let data = bytes(n, 1000 + (round * 2 + d) as u64);
                    let mut device = DeviceBuffer::<u8>::new(&contexts[d], n).unwrap();
                    manager.transfer(&data, &mut device).unwrap();
                    let mut back = vec![0u8; n];
                    manager.transfer(&device, &mut back).unwrap();
                    assert_bytes(&back, &data, &format!("round {round} through device {d}"));
                }
            });
        }
    });
    let expected = |n: &dyn Fn(usize) -> usize| (0..ROUNDS).map(n).sum::<usize>() as u64;
    let peer = expected(&|r| 3 * MIB / 4 + r * 977) * 2 + ROUNDS as u64;
    let host = expected(&|r| MIB + r * 4099) * 2 + ROUNDS as u64;
    let rounds = ROUNDS as u64;
    assert_eq!(on_path(manager, TransferPath::PEER), (2 * rounds, peer, 0));
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        assert_eq!(on_path(manager, path), (2 * rounds, host, 0), "{path}");
    }
    for d in 0..2 {
        assert!(manager.is_open(d), "device {d} was used");
        assert!(manager.idle_lanes(d) <= MAX_IDLE_LANES);
    }
}

// ---------------------------------------------------------------------------------------------
// 3. A thousand ping-pongs with kernels on both devices, memory flat
// ---------------------------------------------------------------------------------------------

/// Pipeline parallelism's steady state: each step increments the activations on device 0, moves
/// them into a fresh buffer of device 1's caching allocator (`.to('cuda:1')`), increments them
/// there and moves them back; the kernels are queued without any host synchronisation, so only
/// the buffers' recorded uses order the copies. A thousand steps cycling through every method:
/// every element ends incremented exactly 2000 times, and nothing grows: device memory reserved
/// by each device's cache, free device memory, the manager's idle lanes and progress-mark
/// words, the pinned staging pool.
#[test]
fn a_thousand_ping_pongs_with_kernels_on_both_devices_keep_memory_flat() {
    const TEST: &str = "a_thousand_ping_pongs_with_kernels_on_both_devices_keep_memory_flat";
    let Some((_serial, contexts, manager)) = two_gpus(TEST) else {
        return;
    };
    let kernels = kernels_on(&contexts);
    let inc = function_on(&kernels, "increment_u32");
    let streams = contexts.each_ref().map(user_stream);
    let allocators = caches_of(&contexts);
    let methods = peer_methods(&manager, 0, 1);
    let n = 64 * 1024 + 3;
    let start = common::words(n, 77);
    let mut a0 = DeviceBuffer::<u32>::new_on(&streams[0], n).unwrap();
    a0.copy_from_host(&start).unwrap();
    const STEPS: usize = 1000;
    const WARM: usize = 20;
    let mut warm = None;
    for step in 0..STEPS {
        if step == WARM {
            warm = Some((
                allocators
                    .each_ref()
                    .map(|a| a.stats().reserved_bytes.current),
                allocators.each_ref().map(|a| a.stats().cache_hits),
                contexts.each_ref().map(|c| c.memory_info().unwrap().free),
                [manager.free_mark_words(0), manager.free_mark_words(1)],
            ));
        }
        increment(&inc[0], &streams[0], &mut a0);
        let mut a1 = DeviceBuffer::<u32>::new_on(&streams[1], n).unwrap();
        let there = methods[step % methods.len()];
        let back = methods[(step / methods.len()) % methods.len()];
        move_by(&manager, there, &a0, &mut a1)
            .unwrap_or_else(|e| panic!("step {step}: 0 -> 1 by {there:?}: {e}"));
        increment(&inc[1], &streams[1], &mut a1);
        move_by(&manager, back, &a1, &mut a0)
            .unwrap_or_else(|e| panic!("step {step}: 1 -> 0 by {back:?}: {e}"));
        drop(a1);
    }
    let got = a0.to_vec().unwrap();
    if let Some(i) = (0..n).find(|&i| got[i] != start[i].wrapping_add(2 * STEPS as u32)) {
        panic!(
            "element {i} was incremented {} times, expected {}",
            got[i].wrapping_sub(start[i]),
            2 * STEPS
        );
    }
    let (reserved, hits, free, marks) = warm.unwrap();
    for d in 0..2 {
        let stats = allocators[d].stats();
        assert!(
            stats.reserved_bytes.current <= reserved[d] + 2 * MIB,
            "device {d}'s cache grew from {} to {} bytes over the steps",
            reserved[d],
            stats.reserved_bytes.current
        );
        let free_now = contexts[d].memory_info().unwrap().free;
        assert!(
            free_now + 64 * MIB >= free[d],
            "device {d}: free memory fell from {} to {free_now}",
            free[d]
        );
        assert!(manager.idle_lanes(d) <= MAX_IDLE_LANES);
        assert_eq!(
            manager.free_mark_words(d),
            marks[d],
            "device {d}: progress-mark words not given back"
        );
    }
    assert!(
        allocators[1].stats().cache_hits >= hits[1] + (STEPS - WARM) as u64,
        "device 1's fresh activations did not come from its cache"
    );
    let (count, moved, failures) = on_path(&manager, TransferPath::PEER);
    assert_eq!((count, failures), (2 * STEPS as u64, 0));
    assert_eq!(moved, (2 * STEPS * n * 4) as u64);
    let pinned = manager.clear_cache();
    assert!(
        pinned <= 32 * MIB,
        "the staging pools held {pinned} pinned bytes after a thousand 256 KiB bounces"
    );
}

// ---------------------------------------------------------------------------------------------
// 4. A late writer on one device, a reader on the other
// ---------------------------------------------------------------------------------------------

/// A buffer on device `a` written by a kernel on device `a` that starts late (a 20 ms spin
/// first), copied at once to device `b` whose destination a kernel on device `b` still reads
/// for 20 ms (expecting its old contents): by every method and with views on both sides, the
/// copy carries the late write and lands only after the reader is done; nothing outside the
/// range changes. Both directions.
#[test]
fn a_late_kernel_write_on_one_device_reaches_the_other_after_its_reader() {
    const TEST: &str = "a_late_kernel_write_on_one_device_reaches_the_other_after_its_reader";
    let Some((_serial, contexts, manager)) = two_gpus(TEST) else {
        return;
    };
    if cuweave_test_support::skip_under_sanitizer(TEST, "needs kernels on two streams at once") {
        return;
    }
    let kernels = kernels_on(&contexts);
    let fill = function_on(&kernels, "fill_u32");
    let watcher = function_on(&kernels, "watch_u32");
    let streams = contexts.each_ref().map(user_stream);
    let n = MIB / 4 + 3;
    let (src_at, dst_at) = (2usize, 3usize);
    for (a, b) in [(1usize, 0usize), (0, 1)] {
        for method in peer_methods(&manager, a, b) {
            for views in [false, true] {
                let what = format!("{a} -> {b} by {method:?}, views: {views}");
                let mut src = DeviceBuffer::<u32>::new(&contexts[a], n + 5).unwrap();
                src.fill(0x5151_5151).unwrap();
                let mut dst = DeviceBuffer::<u32>::new(&contexts[b], n + 7).unwrap();
                dst.fill(OLD).unwrap();
                let mut mismatches = DeviceBuffer::<u32>::zeroed(&contexts[b], 1).unwrap();
                {
                    let mut range = src.slice_mut(src_at..src_at + n).unwrap();
                    late_fill(
                        &kernels[a],
                        &fill[a],
                        &streams[a],
                        &mut range,
                        WRITTEN,
                        KERNEL_NS,
                    );
                }
                watch(
                    &watcher[b],
                    &streams[b],
                    &dst.slice(dst_at..dst_at + n).unwrap(),
                    OLD,
                    KERNEL_NS,
                    &mut mismatches,
                );
                let report = if views {
                    move_by(
                        &manager,
                        method,
                        src.slice(src_at..src_at + n).unwrap(),
                        dst.slice_mut(dst_at..dst_at + n).unwrap(),
                    )
                } else {
                    move_by(
                        &manager,
                        method,
                        Source::device(&src, src_at, n),
                        Destination::device(&mut dst, dst_at),
                    )
                }
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                streams[b].synchronize().unwrap();
                assert_eq!(
                    mismatches.to_vec().unwrap(),
                    [0],
                    "{what}: the copy by {} landed while device {b}'s kernel still read it",
                    report.plan.method
                );
                let got = dst.to_vec().unwrap();
                assert_all_u32(
                    &got[dst_at..dst_at + n],
                    WRITTEN,
                    &format!("{what}: the copy missed device {a}'s late write"),
                );
                assert_all_u32(&got[..dst_at], OLD, &format!("{what}: before the range"));
                assert_all_u32(&got[dst_at + n..], OLD, &format!("{what}: after the range"));
                streams[a].synchronize().unwrap();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Forcing peer-to-peer; methods the peer path lacks; lazy per-device state
// ---------------------------------------------------------------------------------------------

/// `PeerToPeer` forced between the devices runs exactly where the devices have peer access (also
/// when the user or another manager enabled it first) and is a typed `Unsupported` naming the
/// method where they have not, writing and counting nothing; the plan then skips it for a method
/// that works. `ZeroCopy` and `UnifiedMemory` are never methods of a device pair, nor `ZeroCopy`
/// of pinned memory of the other device. A fresh manager opens a device only when a transfer
/// uses it.
#[test]
fn forced_peer_to_peer_follows_peer_access_and_foreign_methods_are_typed_errors() {
    const TEST: &str =
        "forced_peer_to_peer_follows_peer_access_and_foreign_methods_are_typed_errors";
    let Some((_serial, contexts, manager)) = two_gpus(TEST) else {
        return;
    };
    let devices = [Device::get(0).unwrap(), Device::get(1).unwrap()];
    assert!(!manager.is_open(0) && !manager.is_open(1));
    // An upload to device 1 opens device 1 alone.
    let n = MIB + 13;
    let data = bytes(n + 4, 5);
    let mut on1 = DeviceBuffer::<u8>::new(&contexts[1], n + 4).unwrap();
    manager
        .transfer_with(TransferMethod::HostStaged, &data, &mut on1)
        .unwrap();
    assert!(manager.is_open(1) && !manager.is_open(0));
    assert_eq!((manager.idle_lanes(0), manager.free_mark_words(0)), (0, 0));

    for (a, b) in [(1usize, 0usize), (0, 1)] {
        let facts = manager.facts(Location::Device(a), Location::Device(b));
        assert_eq!(
            facts.peer_access,
            devices[b].can_access_peer(&devices[a]).unwrap(),
            "{a} -> {b}: the facts disagree with cuDeviceCanAccessPeer"
        );
        let src = DeviceBuffer::from_slice(&contexts[a], &data).unwrap();
        let mut dst = DeviceBuffer::<u8>::new(&contexts[b], n + 4).unwrap();
        dst.fill(SENTINEL).unwrap();
        let before = manager.stats().snapshot();
        let forced = manager.transfer_with(
            TransferMethod::PeerToPeer,
            Source::device(&src, 1, n),
            Destination::device(&mut dst, 3),
        );
        let plan = manager.plan(Location::Device(a), Location::Device(b), n);
        if facts.peer_access {
            let report = forced.unwrap_or_else(|e| panic!("{a} -> {b} by PeerToPeer: {e}"));
            assert_eq!(
                (report.plan.method, report.plan.reason),
                (TransferMethod::PeerToPeer, PlanReason::Requested)
            );
            let got = dst.to_vec().unwrap();
            assert_bytes(&got[3..3 + n], &data[1..1 + n], "forced peer-to-peer");
            assert!(got[..3].iter().chain(&got[3 + n..]).all(|&x| x == SENTINEL));
            // Both devices are open now: peer access is enabled in both contexts.
            assert!(manager.is_open(0) && manager.is_open(1));
        } else {
            match forced {
                Err(TransferError::Unsupported { method, .. }) => {
                    assert_eq!(method, TransferMethod::PeerToPeer);
                }
                other => panic!("{a} -> {b}: PeerToPeer without peer access gave {other:?}"),
            }
            assert!(dst.to_vec().unwrap().iter().all(|&x| x == SENTINEL));
            assert_eq!(
                manager.stats().snapshot(),
                before,
                "a refused transfer counted"
            );
            assert_ne!(plan.method, TransferMethod::PeerToPeer, "{plan}");
            assert!(
                plan.skipped
                    .iter()
                    .any(|s| s.method == TransferMethod::PeerToPeer),
                "{plan}"
            );
            // The plan's own method works.
            manager
                .transfer(Source::device(&src, 1, n), Destination::device(&mut dst, 3))
                .unwrap();
            assert_bytes(&dst.to_vec().unwrap()[3..3 + n], &data[1..1 + n], "planned");
        }
        for method in [TransferMethod::ZeroCopy, TransferMethod::UnifiedMemory] {
            dst.fill(SENTINEL).unwrap();
            match manager.transfer_with(method, &src, Destination::device(&mut dst, 0)) {
                Err(TransferError::Unsupported { method: m, .. }) => assert_eq!(m, method),
                other => panic!("{a} -> {b} by {method}: {other:?}"),
            }
            assert!(dst.to_vec().unwrap().iter().all(|&x| x == SENTINEL));
        }
        // Pinned memory of device `a` into device `b`: the plain DMA; ZeroCopy is not offered.
        let pinned = PinnedBuffer::from_slice(&contexts[a], &data).unwrap();
        match manager.transfer_with(
            TransferMethod::ZeroCopy,
            Source::pinned(&pinned, 0, n),
            Destination::device(&mut dst, 4),
        ) {
            Err(TransferError::Unsupported { .. }) => {}
            Ok(_) => assert_bytes(&dst.to_vec().unwrap()[4..], &data[..n], "zero copy"),
            Err(other) => panic!("pinned({a}) -> device {b} by ZeroCopy: {other}"),
        }
        manager
            .transfer(
                Source::pinned(&pinned, 2, n),
                Destination::device(&mut dst, 1),
            )
            .unwrap();
        assert_bytes(
            &dst.to_vec().unwrap()[1..1 + n],
            &data[2..2 + n],
            "pinned across",
        );
    }

    // Peer access the user enabled first, then a second manager enabling it again: still fine.
    let can = [
        devices[0].can_access_peer(&devices[1]).unwrap(),
        devices[1].can_access_peer(&devices[0]).unwrap(),
    ];
    if can[0] {
        contexts[0].enable_peer_access(&contexts[1]).unwrap();
    }
    if can[1] {
        contexts[1].enable_peer_access(&contexts[0]).unwrap();
    }
    let second = TransferManager::new().unwrap();
    for (a, b) in [(0usize, 1usize), (1, 0)] {
        if !second
            .facts(Location::Device(a), Location::Device(b))
            .peer_access
        {
            continue;
        }
        let src = DeviceBuffer::from_slice(&contexts[a], &data).unwrap();
        let mut dst = DeviceBuffer::<u8>::zeroed(&contexts[b], data.len()).unwrap();
        second
            .transfer_with(TransferMethod::PeerToPeer, &src, &mut dst)
            .unwrap_or_else(|e| panic!("{a} -> {b} with peer access already on: {e}"));
        assert_bytes(&dst.to_vec().unwrap(), &data, "peer access already enabled");
    }
}

// ---------------------------------------------------------------------------------------------
// 6. A manager for device 1 only never opens device 0 (in a child process)
// ---------------------------------------------------------------------------------------------

/// The environment variable that tells a re-run of this binary it is the child of test 6.
const CHILD_VAR: &str = "CUWEAVE_TWO_GPU_CHILD";

/// A process that drives only GPU 1 (`CUDA_VISIBLE_DEVICES` not set, as under a launcher that
/// pins ranks by `torch.cuda.set_device(1)`): a manager limited to device 1 moves pageable,
/// pinned, registered and device memory of device 1 by every method, blocking and as futures,
/// and device 0's primary context is never made. Run in a child process (this binary again,
/// only this test), where nothing else has touched device 0.
#[test]
fn a_manager_for_device_one_only_never_opens_device_zero() {
    const TEST: &str = "a_manager_for_device_one_only_never_opens_device_zero";
    if std::env::var_os(CHILD_VAR).is_some() {
        device_one_only_child();
        return;
    }
    let count = if cuweave_driver::is_available() {
        Device::count().unwrap_or(0)
    } else {
        0
    };
    if count < 2 {
        // Says why (no GPU at all, or fails under CUWEAVE_REQUIRE_GPU=1) when there is none.
        if cuweave_test_support::gpu(TEST).is_some() {
            skip(TEST, &format!("needs two GPUs, found {count}"));
        }
        return;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, "1")
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(
        output.status.success(),
        "the child process failed ({}):\n{out}\n{err}",
        output.status
    );
    assert!(
        out.contains("1 passed"),
        "the child ran no test:\n{out}\n{err}"
    );
}

fn device_one_only_child() {
    let zero = Device::get(0).unwrap();
    let one = Device::get(1).unwrap();
    assert!(
        !zero.primary_context_active().unwrap(),
        "device 0's context was active before the child did anything"
    );
    let manager = TransferManager::for_devices(&[1]).unwrap();
    assert_eq!((manager.devices(), manager.device_count()), (vec![1], 1));
    let _ = manager.plan(Location::PageableHost, Location::Device(1), 64 * MIB);
    let _ = manager.facts(Location::Device(1), Location::Device(0));
    assert!(!manager.is_open(1) && !manager.is_open(0));

    let context = Context::primary(one).unwrap();
    let n = 9 * MIB + 7;
    let data = bytes(n, 1);
    let mut device = DeviceBuffer::<u8>::new(&context, n + 3).unwrap();
    let mut back = vec![0u8; n];
    for method in [
        None,
        Some(TransferMethod::HostStaged),
        Some(TransferMethod::DirectCopy),
    ] {
        move_by(&manager, method, &data, Destination::device(&mut device, 3)).unwrap();
        move_by(
            &manager,
            method,
            Source::device(&device, 3, n),
            &mut back[..],
        )
        .unwrap();
        assert_bytes(&back, &data, &format!("device 1 by {method:?}"));
    }
    // Pinned memory of device 1, by every method its path offers.
    let pinned = PinnedBuffer::from_slice(&context, &data).unwrap();
    let mut pinned_back = PinnedBuffer::<u8>::zeroed(&context, n).unwrap();
    for method in [TransferMethod::DirectCopy, TransferMethod::ZeroCopy] {
        match manager.transfer_with(method, &pinned, Destination::device(&mut device, 3)) {
            Ok(_) => {
                manager
                    .transfer_with(method, Source::device(&device, 3, n), &mut pinned_back)
                    .unwrap();
                assert_bytes(&pinned_back.as_slice().unwrap()[..], &data, "pinned");
            }
            Err(TransferError::Unsupported { .. }) => {}
            Err(error) => panic!("pinned by {method}: {error}"),
        }
    }
    // Registered host memory, a copy within device 1, futures and owned transfers.
    let mut host = data.clone();
    let registered = manager.register_host(1, &mut host).unwrap();
    let mut other = DeviceBuffer::<u8>::new(&context, n).unwrap();
    manager.transfer(&registered, &mut other).unwrap();
    drop(registered);
    let mut copy = DeviceBuffer::<u8>::new(&context, n).unwrap();
    manager.transfer(&other, &mut copy).unwrap();
    let mut out = vec![0u8; n];
    block_on(manager.download_async(&copy, 0, &mut out).unwrap()).unwrap();
    assert_bytes(&out, &data, "registered, copied and downloaded as a future");
    block_on(manager.upload_async(&data[1..], &mut copy, 0).unwrap()).unwrap();
    let owned = block_on(manager.download_owned(copy, 0, vec![0u8; n - 1]));
    owned.result.unwrap();
    assert_bytes(&owned.host, &data[1..], "owned download");

    assert!(manager.is_open(1));
    assert!(
        !manager.is_open(0),
        "a manager for device 1 opened device 0"
    );
    assert!(
        !zero.primary_context_active().unwrap(),
        "device 0's primary context was made by a program that only used device 1"
    );
}

// ---------------------------------------------------------------------------------------------
// 7. Per-pair calibration decides each direction; statistics by path
// ---------------------------------------------------------------------------------------------

/// A calibration measured on this machine in which 0 -> 1 is fastest by peer access and 1 -> 0
/// by staging (a PCIe switch that is slow one way): each direction runs its own measured
/// method (or the next measured one where the devices lack peer access), says so in its plan,
/// and moves exact bytes. Then a mixed schedule of transfers is counted per path and size class
/// exactly: both directions on the one peer path, never on the same-device or host paths.
#[test]
fn per_pair_calibration_decides_each_direction_and_statistics_count_by_path() {
    const TEST: &str = "per_pair_calibration_decides_each_direction_and_statistics_count_by_path";
    let Some((_serial, contexts, manager)) = two_gpus(TEST) else {
        return;
    };
    let machine = manager.machine();
    let mut table = CalibrationTable {
        device: machine.first().cloned(),
        devices: machine,
        ..CalibrationTable::default()
    };
    let at = |a: usize, b: usize| Query::new(Location::Device(a), Location::Device(b), 16 * MIB);
    let methods = [
        TransferMethod::PeerToPeer,
        TransferMethod::DirectCopy,
        TransferMethod::HostStaged,
    ];
    // GB/s of each method, 0 -> 1 and 1 -> 0.
    for (a, b, gbps) in [(0, 1, [300.0, 250.0, 20.0]), (1, 0, [10.0, 5.0, 40.0])] {
        for (m, g) in methods.into_iter().zip(gbps) {
            table.record_at(at(a, b).measure, m, g);
        }
    }
    assert!(
        manager.set_calibration(table).is_none(),
        "this machine's table"
    );
    let peer01 = manager
        .facts(Location::Device(0), Location::Device(1))
        .peer_access;
    let expected = [
        (
            0usize,
            1usize,
            if peer01 {
                (TransferMethod::PeerToPeer, 300.0)
            } else {
                (TransferMethod::DirectCopy, 250.0)
            },
        ),
        (1, 0, (TransferMethod::HostStaged, 40.0)),
    ];
    let n = 16 * MIB - 5;
    let data = bytes(n + 2, 9);
    for (a, b, (method, gbps)) in expected {
        let plan = manager.plan(Location::Device(a), Location::Device(b), n);
        assert_eq!(plan.method, method, "{a} -> {b}: {plan}");
        assert!(plan.measured_on.is_none(), "{plan}");
        match plan.reason {
            PlanReason::Calibrated {
                gbps: g, at_bytes, ..
            } => assert_eq!((g, at_bytes), (gbps, 16 * MIB), "{plan}"),
            other => panic!("{a} -> {b}: {other:?}"),
        }
        let src = DeviceBuffer::from_slice(&contexts[a], &data).unwrap();
        let mut dst = DeviceBuffer::<u8>::zeroed(&contexts[b], n).unwrap();
        let report = manager
            .transfer(Source::device(&src, 2, n), &mut dst)
            .unwrap();
        assert_eq!(report.plan, plan);
        assert_bytes(&dst.to_vec().unwrap(), &data[2..], &format!("{a} -> {b}"));
    }

    // A mixed schedule, counted exactly.
    manager.stats().reset();
    let sizes = [1usize, 65_537, 3 * MIB + 1, 17 * MIB + 3];
    let data = bytes(17 * MIB + 3, 10);
    let mut peer = std::collections::BTreeMap::<SizeClass, (u64, u64)>::new();
    for &len in &sizes {
        for (a, b) in [(0usize, 1usize), (1, 0)] {
            let src = DeviceBuffer::from_slice(&contexts[a], &data[..len]).unwrap();
            let mut dst = DeviceBuffer::<u8>::new(&contexts[b], src.len()).unwrap();
            manager.transfer(&src, &mut dst).unwrap();
            let slot = peer.entry(SizeClass::of(src.len())).or_default();
            slot.0 += 1;
            slot.1 += src.len() as u64;
        }
    }
    let mut on1 = DeviceBuffer::<u8>::new(&contexts[1], 4097).unwrap();
    manager.transfer(&data[..4097], &mut on1).unwrap();
    let mut copy = DeviceBuffer::<u8>::new(&contexts[1], 4097).unwrap();
    manager.transfer(&on1, &mut copy).unwrap();
    let mut out = vec![0u8; 4097];
    manager.transfer(&copy, &mut out[..]).unwrap();
    assert_bytes(&out, &data[..4097], "host -> 1 -> 1 -> host");
    for class in SizeClass::ALL {
        let stats = manager.stats().get(TransferPath::PEER, class);
        let want = peer.get(&class).copied().unwrap_or_default();
        assert_eq!(
            (stats.count, stats.bytes, stats.failures),
            (want.0, want.1, 0),
            "peer path, {class}"
        );
        if stats.count > 0 {
            assert!(stats.best_gbps > 0.0 && stats.mean_gbps() > 0.0);
        }
    }
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        assert_eq!(
            manager.stats().get(path, SizeClass::Tiny).count,
            1,
            "{path}"
        );
    }
    assert_eq!(manager.stats().snapshot().len(), peer.len() + 3);
}

// ---------------------------------------------------------------------------------------------
// 8. Two pipeline stages on two devices, each allocating from its device's cache
// ---------------------------------------------------------------------------------------------

/// GPipe-style microbatches: stage 0 on device 0 writes each microbatch into a fresh buffer of
/// device 0's cache with a kernel (no host synchronisation), the manager moves it into a fresh
/// buffer of device 1's cache, stage 1 increments it there, and the result comes back into a
/// fresh device-0 buffer; four microbatches stay in flight. Every result is its microbatch's
/// value plus one; each buffer comes from its own device's default allocator (served from its
/// cache once warm) and neither cache grows past the microbatches in flight.
#[test]
fn pipeline_stages_on_two_devices_draw_from_each_devices_cache_in_order() {
    const TEST: &str = "pipeline_stages_on_two_devices_draw_from_each_devices_cache_in_order";
    let Some((_serial, contexts, manager)) = two_gpus(TEST) else {
        return;
    };
    let kernels = kernels_on(&contexts);
    let fill = kernels[0].module().function("fill_u32").unwrap();
    let inc = kernels[1].module().function("increment_u32").unwrap();
    let streams = contexts.each_ref().map(user_stream);
    let allocators = caches_of(&contexts);
    assert_eq!(allocators[1].device().ordinal(), 1);
    let n = 300_001usize;
    const MICROBATCHES: u32 = 64;
    const IN_FLIGHT: usize = 4;
    let before = allocators.each_ref().map(CachingAllocator::stats);
    let mut flight = std::collections::VecDeque::new();
    let mut hits_at_warm = None;
    for m in 0..MICROBATCHES {
        if m == 8 {
            hits_at_warm = Some(allocators.each_ref().map(|a| a.stats().cache_hits));
        }
        let mut x = DeviceBuffer::<u32>::new_on(&streams[0], n).unwrap();
        let value = 1000 + m * 7;
        let len = n as u64;
        // SAFETY: fill_u32(unsigned* dst, unsigned value, size_t n) gets the buffer's address, a
        // value and its length; it writes only `x`, declared a write.
        unsafe {
            TrackedLaunch::new(&fill, &streams[0], grid(n, 4096))
                .write(&mut x)
                .arg(&value)
                .arg(&len)
                .launch()
        }
        .unwrap();
        let mut h = DeviceBuffer::<u32>::new_on(&streams[1], n).unwrap();
        assert_eq!(h.device().ordinal(), 1);
        assert!(h.allocated_for().is_some(), "from device 1's cache");
        manager.transfer(&x, &mut h).unwrap();
        increment(&inc, &streams[1], &mut h);
        let mut out = DeviceBuffer::<u32>::new_on(&streams[0], n).unwrap();
        manager.transfer(&h, &mut out).unwrap();
        flight.push_back((value, x, h, out));
        if flight.len() > IN_FLIGHT {
            let (value, x, h, out) = flight.pop_front().unwrap();
            assert_all_u32(
                &out.to_vec().unwrap(),
                value + 1,
                &format!("microbatch of value {value}"),
            );
            drop((x, h, out));
        }
    }
    for (value, _, _, out) in &flight {
        assert_all_u32(&out.to_vec().unwrap(), value + 1, "the last microbatches");
    }
    drop(flight);
    let after = allocators.each_ref().map(CachingAllocator::stats);
    let hits = hits_at_warm.unwrap();
    let per = |d: usize| (MICROBATCHES as u64) * if d == 0 { 2 } else { 1 };
    for d in 0..2 {
        assert!(
            after[d].allocations >= before[d].allocations + per(d),
            "device {d}: {} allocations for {} buffers",
            after[d].allocations - before[d].allocations,
            per(d)
        );
        assert!(
            after[d].cache_hits >= hits[d] + per(d) - per(d) / 8 - 4,
            "device {d}: warm microbatches did not reuse cached blocks ({} hits)",
            after[d].cache_hits - hits[d]
        );
        let blocks = (IN_FLIGHT as u64 + 2) * per(d) / MICROBATCHES as u64;
        let grown = after[d]
            .reserved_bytes
            .current
            .saturating_sub(before[d].reserved_bytes.current);
        // Blocks of 1-10 MiB come from 20 MiB segments (PyTorch's large pool), so the first
        // segment holds all of them.
        const LARGE_SEGMENT: u64 = 20 << 20;
        assert!(
            grown as u64 <= (blocks * (2 * MIB as u64)).next_multiple_of(LARGE_SEGMENT),
            "device {d}'s cache grew by {grown} bytes for {blocks} buffers in flight"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 9. Data-parallel loaders on threads whose current device is the other one
// ---------------------------------------------------------------------------------------------

/// One loader thread per device, as DataParallel replicas run, each having last made the
/// *other* device current (a `torch.cuda.device(...)` block of another library left it so):
/// borrowed futures, owned transfers and blocking transfers of odd-sized batches into and out
/// of its device, with views at odd offsets. Bytes are exact, each transfer is counted once on
/// its path, and a scoped current-context guard taken around the work restores the thread's
/// previous context whatever the transfers bound meanwhile.
#[test]
fn loaders_on_threads_with_the_other_device_current_move_exact_batches() {
    const TEST: &str = "loaders_on_threads_with_the_other_device_current_move_exact_batches";
    let Some((_serial, contexts, manager)) = two_gpus(TEST) else {
        return;
    };
    const ROUNDS: usize = 6;
    let barrier = Barrier::new(2);
    let (manager, contexts, barrier) = (&manager, &contexts, &barrier);
    std::thread::scope(|scope| {
        for d in 0..2usize {
            scope.spawn(move || {
                // The thread's own device is current; a scoped switch makes the other one
                // current for the whole loader (the transfers must not care).
                contexts[d].bind_to_thread().unwrap();
                let outer = Context::current_raw().unwrap();
                assert_eq!(outer, contexts[d].as_raw());
                let guard = contexts[1 - d].make_current_scoped().unwrap();
                barrier.wait();
                for round in 0..ROUNDS {
                    let n = 300_001 + round * 4099 + d;
                    let batch: Vec<u32> = common::words(n, (round * 2 + d) as u64);
                    let what = format!("device {d}, round {round}, {n} u32");
                    let mut device = DeviceBuffer::<u32>::new(&contexts[d], n + 3).unwrap();
                    block_on(manager.upload_async(&batch, &mut device, 3).unwrap()).unwrap();
                    let mut back = vec![0u32; n];
                    block_on(manager.download_async(&device, 3, &mut back).unwrap()).unwrap();
                    assert_bytes(&back, &batch, &format!("{what}: futures"));
                    let owned = block_on(manager.upload_owned(batch.clone(), device, 1));
                    owned.result.unwrap();
                    let owned = block_on(manager.download_owned(owned.device, 1, vec![0; n]));
                    owned.result.unwrap();
                    assert_bytes(&owned.host, &batch, &format!("{what}: owned"));
                    let mut device = owned.device;
                    let mut out = vec![0u32; n - 10];
                    manager
                        .transfer(&batch[10..], device.slice_mut(2..n - 8).unwrap())
                        .unwrap();
                    manager
                        .transfer(device.slice(2..n - 8).unwrap(), &mut out[..])
                        .unwrap();
                    assert_bytes(&out, &batch[10..], &format!("{what}: views"));
                }
                drop(guard);
                assert_eq!(
                    Context::current_raw().unwrap(),
                    outer,
                    "device {d}'s loader: the guard did not restore the thread's context"
                );
            });
        }
    });
    let rounds = 3 * 2 * ROUNDS as u64;
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        assert_eq!(on_path(manager, path).0, rounds, "{path}");
    }
    assert_eq!(on_path(manager, TransferPath::PAGEABLE_TO_DEVICE).2, 0);
}

// ---------------------------------------------------------------------------------------------
// 10. Views of pinned and unified memory crossing devices
// ---------------------------------------------------------------------------------------------

/// A view of a pinned buffer of device 0 (an input batch already page-locked) moved into a
/// buffer of device 1, a view of a unified buffer of device 1 moved into device 0, and back
/// into views of them: a view is planned as memory of its buffer's device, so these are the
/// peer path. The planned transfer must move exact bytes; each forced method either moves
/// exact bytes or is a typed `Unsupported`, never a driver error from a copy the method cannot
/// do with host or managed memory.
#[test]
fn views_of_pinned_and_unified_memory_cross_devices_by_every_method() {
    const TEST: &str = "views_of_pinned_and_unified_memory_cross_devices_by_every_method";
    let Some((_serial, contexts, manager)) = two_gpus(TEST) else {
        return;
    };
    let n = MIB + 5;
    let data = bytes(n + 8, 21);
    let managed = Device::get(1).unwrap().supports_managed_memory().unwrap();
    // Runs `run` (which clears the destination, moves the bytes and reads the destination
    // back) by every method from device `a` to device `b` and checks what it moved.
    let across =
        |a: usize,
         b: usize,
         what: &str,
         run: &mut dyn FnMut(Option<TransferMethod>) -> (Moved, Vec<u8>)| {
            for method in peer_methods(&manager, a, b) {
                let (result, got) = run(method);
                let what = format!("{what} by {method:?}");
                match result {
                    Ok(report) => {
                        assert_eq!(report.plan.path, TransferPath::PEER, "{what}");
                        assert_bytes(&got[4..4 + n], &data[3..3 + n], &what);
                        assert!(got[..4].iter().all(|&x| x == SENTINEL), "{what}: before");
                        assert!(got[4 + n..].iter().all(|&x| x == SENTINEL), "{what}: after");
                    }
                    Err(TransferError::Unsupported { .. }) if method.is_some() => {
                        eprintln!("{what}: Unsupported");
                    }
                    Err(error) => panic!("{what}: {error:?}"),
                }
            }
        };
    let pinned = PinnedBuffer::from_slice(&contexts[0], &data).unwrap();
    let mut on1 = DeviceBuffer::<u8>::new(&contexts[1], n + 8).unwrap();
    across(0, 1, "pinned(0) view -> 1", &mut |method| {
        on1.fill(SENTINEL).unwrap();
        let result = move_by(
            &manager,
            method,
            pinned.slice(3..3 + n).unwrap(),
            Destination::device(&mut on1, 4),
        );
        (result, on1.to_vec().unwrap())
    });
    // Device 1 back into a view of a pinned buffer of device 0.
    let source = DeviceBuffer::from_slice(&contexts[1], &data).unwrap();
    let mut pinned_out = PinnedBuffer::<u8>::new(&contexts[0], n + 8).unwrap();
    across(1, 0, "1 -> pinned(0) view", &mut |method| {
        pinned_out.fill(SENTINEL).unwrap();
        let result = move_by(
            &manager,
            method,
            Source::device(&source, 3, n),
            pinned_out.slice_mut(4..4 + n).unwrap(),
        );
        (result, pinned_out.as_slice().unwrap().to_vec())
    });
    if !managed {
        skip(TEST, "the unified part: device 1 has no managed memory");
        return;
    }
    let unified = UnifiedBuffer::from_slice(&contexts[1], &data).unwrap();
    let mut on0 = DeviceBuffer::<u8>::new(&contexts[0], n + 8).unwrap();
    across(1, 0, "unified(1) view -> 0", &mut |method| {
        on0.fill(SENTINEL).unwrap();
        let result = move_by(
            &manager,
            method,
            unified.slice(3..3 + n).unwrap(),
            on0.slice_mut(4..4 + n).unwrap(),
        );
        (result, on0.to_vec().unwrap())
    });
    let source = DeviceBuffer::from_slice(&contexts[0], &data).unwrap();
    let mut unified_out = UnifiedBuffer::<u8>::new(&contexts[1], n + 8).unwrap();
    across(0, 1, "0 -> unified(1) view", &mut |method| {
        unified_out.fill(SENTINEL).unwrap();
        let result = move_by(
            &manager,
            method,
            source.slice(3..3 + n).unwrap(),
            unified_out.slice_mut(4..4 + n).unwrap(),
        );
        (result, unified_out.to_vec().unwrap())
    });
}
