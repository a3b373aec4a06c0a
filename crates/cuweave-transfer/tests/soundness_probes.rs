//! Adversarial soundness probes of the transfer manager's safe API: every probe races a
//! transfer against device work queued on a user's non-blocking stream behind a spin (so a
//! wrong order shows up as wrong bytes), or feeds it input that must be a typed error, and
//! checks real bytes.
//!
//! `cuweave-stream` is not a dev-dependency of this crate, so the stream-layer probes (pools,
//! the stream-ordered allocator, coordinator dependencies, capture) cannot live here; only what
//! the transfer, memory and driver crates expose is used.
//!
//! Tests named for what they expect and preceded by `SUSPECTED TO FAIL` are probes whose library
//! path looked fragile on reading (the comment says which sequence and which code).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::Duration;

use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip_under_sanitizer};
use cuweave_transfer::{
    CalibrationTable, ChunkOrder, Destination, HostCopy, Location, ORDERED_FROM, RegistrationCost,
    SizeClass, Source, StagingConfig, TWO_STREAMS_FROM, TransferDirection, TransferError,
    TransferManager, TransferMethod, TransferPath,
};

mod common;
use common::block_on;
use common::bytes;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// How long the user's stream spins before the work a probe races against: far longer than the
/// host needs to queue the transfer and let a wrongly ordered copy land.
const SPIN_NS: u64 = 150_000_000;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn words16(len: usize, seed: u64) -> Vec<u16> {
    bytes(len * 2, seed)
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn words32(len: usize, seed: u64) -> Vec<u32> {
    bytes(len * 4, seed)
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn words64(len: usize, seed: u64) -> Vec<u64> {
    bytes(len * 8, seed)
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// 16-byte elements.
type Wide = [u64; 2];

fn wides(len: usize, seed: u64) -> Vec<Wide> {
    words64(len * 2, seed)
        .chunks_exact(2)
        .map(|c| [c[0], c[1]])
        .collect()
}

/// Asserts equality, naming the first differing element instead of printing megabytes.
fn assert_same<T: PartialEq + std::fmt::Debug>(got: &[T], expected: &[T], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths differ");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != expected[i]) {
        panic!(
            "{what}: first wrong element at {i} of {} ({:?}, expected {:?})",
            got.len(),
            got[i],
            expected[i]
        );
    }
}

/// Asserts every element of `got` is `value`.
fn assert_all<T: PartialEq + std::fmt::Debug + Copy>(got: &[T], value: T, what: &str) {
    if let Some(i) = got.iter().position(|&x| x != value) {
        panic!(
            "{what}: element {i} of {} is {:?}, expected {:?}",
            got.len(),
            got[i],
            value
        );
    }
}

/// One poll, with a waker that does nothing.
fn poll_once<F: Future + Unpin>(future: &mut F) -> Option<F::Output> {
    let waker = Waker::noop();
    let mut cx = TaskContext::from_waker(waker);
    match Pin::new(future).poll(&mut cx) {
        Poll::Ready(output) => Some(output),
        Poll::Pending => None,
    }
}

fn user_stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).unwrap()
}

fn fixed(chunk_bytes: usize, depth: usize, threads: usize, order: ChunkOrder) -> TransferManager {
    TransferManager::with_staging(StagingConfig {
        chunk_bytes,
        depth,
        threads: threads.min(cuweave_transfer::host_threads()).max(1),
        host_copy: HostCopy::Streaming,
        order,
    })
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// (a) Registered host memory and queued device work
// ---------------------------------------------------------------------------------------------

/// Registered memory is read and written by the copy engine directly. An upload from it must
/// land after a fill the user queued on the destination (behind a spin), and the memory must be
/// settled when `unregister` hands it back: rewriting it then must not reach the device. A
/// download into it must have landed (after the queued fill) when `transfer` returns.
#[test]
fn registered_memory_moves_after_queued_device_work_and_is_settled_when_handed_back() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = user_stream(&gpu.context);
    // u16 elements, an odd count, at odd offsets on both sides.
    let n = (3 * MIB) / 2 + 7;
    let data = words16(n, 1);
    let mut host = data.clone();
    let mut device = DeviceBuffer::<u16>::zeroed(&gpu.context, n + 16).unwrap();

    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    device.fill_async(0x1111, &stream).unwrap();
    let registered = manager.register_host(0, &mut host).unwrap();
    manager
        .transfer(
            Source::registered(&registered, 3, n - 3),
            Destination::device(&mut device, 5),
        )
        .unwrap();
    let back = registered.unregister().unwrap();
    // Had the copy engine still been reading the pages, these bytes would reach the device.
    back.fill(0xCCCC);
    gpu.context.synchronize().unwrap();
    let got = device.to_vec().unwrap();
    assert_all(
        &got[..5],
        0x1111,
        "upload: before the range (the queued fill)",
    );
    assert_same(
        &got[5..5 + n - 3],
        &data[3..],
        "upload from registered memory",
    );
    assert_all(&got[5 + n - 3..], 0x1111, "upload: after the range");

    // Download: a fill queued behind a spin must be what lands in the registered memory, and it
    // must be there when `transfer` returns (no synchronisation in between).
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    device.fill_async(0x2222, &stream).unwrap();
    let mut registered = manager.register_host(0, &mut host).unwrap();
    manager
        .transfer(
            Source::device(&device, 1, n - 9),
            Destination::registered(&mut registered, 4),
        )
        .unwrap();
    let seen = registered.as_slice().to_vec();
    assert_all(&seen[..4], 0xCCCC, "download: before the range");
    assert_all(
        &seen[4..4 + n - 9],
        0x2222,
        "download into registered memory",
    );
    assert_all(&seen[4 + n - 9..], 0xCCCC, "download: after the range");
    registered.unregister().unwrap();
    gpu.context.synchronize().unwrap();
    assert_all(&host[4..4 + n - 9], 0x2222, "after unregistering");
}

/// Two parts of one Vec that share a page: registering the second while the first is
/// registered is the driver's choice (refused with a typed error, or accepted); either way no
/// panic, both registrations move exact bytes, and dropping one leaves the other usable.
#[test]
fn registrations_that_share_a_page_are_typed_errors_or_move_exact_bytes() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let mut host = bytes(3 * 64 * KIB, 5);
    let expected = host.clone();
    let (a, b) = host.split_at_mut(64 * KIB + 100);
    let reg_a = manager.register_host(0, a).unwrap();
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, 3 * 64 * KIB).unwrap();
    match manager.register_host(0, b) {
        Err(TransferError::Driver(_) | TransferError::Memory(_)) => {
            manager.transfer(&reg_a, &mut device).unwrap();
        }
        Err(other) => panic!("an overlapping registration gave an unexpected error: {other}"),
        Ok(reg_b) => {
            manager.transfer(&reg_a, &mut device).unwrap();
            drop(reg_a);
            // The other registration still moves exact bytes after its neighbour is gone.
            manager
                .transfer(&reg_b, Destination::device(&mut device, 64 * KIB + 100))
                .unwrap();
            assert_same(&device.to_vec().unwrap(), &expected, "both halves");
            return;
        }
    }
    let got = device.to_vec().unwrap();
    assert_same(
        &got[..64 * KIB + 100],
        &expected[..64 * KIB + 100],
        "first half",
    );
}

/// Threads register page-aligned, disjoint parts of one Vec at once, upload from them, download
/// into them and unregister, all concurrently: every part comes back exactly, and no thread's
/// registration disturbs another's.
#[test]
fn threads_registering_disjoint_parts_of_one_vec_at_once_move_exact_bytes() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    // 64 KiB alignment: parts never share a page, whatever the host's page size.
    const ALIGN: usize = 64 * KIB;
    const PART: usize = MIB;
    const PARTS: usize = 8;
    let mut host = vec![0u8; PARTS * PART + ALIGN];
    let skip = (ALIGN - host.as_ptr() as usize % ALIGN) % ALIGN;
    let parts: Vec<&mut [u8]> = host[skip..skip + PARTS * PART].chunks_mut(PART).collect();
    std::thread::scope(|scope| {
        for (i, part) in parts.into_iter().enumerate() {
            let (manager, context) = (&manager, &gpu.context);
            scope.spawn(move || {
                for round in 0..4u64 {
                    let seed = i as u64 * 100 + round;
                    let data = bytes(PART, seed);
                    part.copy_from_slice(&data);
                    let mut registered = manager.register_host(0, part).unwrap();
                    let mut device = DeviceBuffer::<u8>::zeroed(context, PART + 3).unwrap();
                    manager
                        .transfer(&registered, Destination::device(&mut device, 3))
                        .unwrap();
                    let device_bytes = device.to_vec().unwrap();
                    assert_same(&device_bytes[3..], &data, &format!("part {i} up"));
                    registered.as_mut_slice().fill(0);
                    manager
                        .transfer(
                            Source::device(&device, 3, PART),
                            Destination::registered(&mut registered, 0),
                        )
                        .unwrap();
                    let part = registered.unregister().unwrap();
                    assert_same(part, &data, &format!("part {i} down"));
                }
            });
        }
    });
}

// ---------------------------------------------------------------------------------------------
// (a) Device buffers another stream is using
// ---------------------------------------------------------------------------------------------

/// Write after read: a copy the user queued (behind a spin) reads the destination; an upload
/// into it must wait for that read, by every entry point (one block, the pipeline, the borrowed
/// future, the owned future), or the queued copy would read the new bytes.
#[test]
fn uploads_wait_for_a_queued_read_of_their_destination() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = user_stream(&gpu.context);
    for len in [4 * KIB + 3, 8 * MIB + 5] {
        for way in ["blocking", "async", "owned"] {
            let what = format!("{way} upload of {len} bytes");
            let old = bytes(len, 11);
            let new = bytes(len, 12);
            let mut buffer = DeviceBuffer::<u8>::from_slice(&gpu.context, &old).unwrap();
            let mut copy = DeviceBuffer::<u8>::zeroed(&gpu.context, len).unwrap();
            kernels.spin_ns(&stream, SPIN_NS).unwrap();
            copy.copy_from_async(&buffer, &stream).unwrap();
            match way {
                "blocking" => drop(manager.transfer(&new, &mut buffer).unwrap()),
                "async" => {
                    block_on(manager.upload_async(&new, &mut buffer, 0).unwrap()).unwrap();
                }
                _ => {
                    let owned = block_on(manager.upload_owned(new.clone(), buffer, 0));
                    owned.result.unwrap();
                    buffer = owned.device;
                }
            }
            stream.synchronize().unwrap();
            assert_same(
                &copy.to_vec().unwrap(),
                &old,
                &format!("{what}: the queued read"),
            );
            assert_same(
                &buffer.to_vec().unwrap(),
                &new,
                &format!("{what}: the upload"),
            );
        }
    }
}

/// Views are tracked per range: a transfer into a view that overlaps part of a range a fill was
/// queued on (behind a spin) must land after the fill there, and leave the rest alone; a
/// download from a view overlapping a queued fill must see it. At a one-block size and at a
/// pipelined (ordered, two streams) size.
#[test]
fn transfers_through_views_wait_for_queued_writes_to_overlapping_ranges() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = user_stream(&gpu.context);
    for m in [1000usize, TWO_STREAMS_FROM / 4 + 3] {
        let mut buffer = DeviceBuffer::<u32>::zeroed(&gpu.context, 3 * m).unwrap();
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        buffer
            .slice_mut(0..2 * m)
            .unwrap()
            .fill_async(0xAAAA_AAAA, &stream)
            .unwrap();
        let data = words32(m, m as u64);
        manager
            .transfer(
                &data,
                Destination::view(buffer.slice_mut(m + 1..2 * m + 1).unwrap()),
            )
            .unwrap();
        stream.synchronize().unwrap();
        let got = buffer.to_vec().unwrap();
        assert_all(&got[..m + 1], 0xAAAA_AAAA, &format!("{m}: the fill"));
        assert_same(
            &got[m + 1..2 * m + 1],
            &data,
            &format!("{m}: upload to view"),
        );
        assert_all(&got[2 * m + 1..], 0, &format!("{m}: past the view"));

        // Download from a view half covered by a fill queued behind a spin.
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        buffer
            .slice_mut(m / 2..m + m / 2)
            .unwrap()
            .fill_async(0x5555_5555, &stream)
            .unwrap();
        let mut out = vec![0u32; m];
        manager
            .transfer(Source::view(buffer.slice(m..2 * m).unwrap()), &mut out)
            .unwrap();
        assert_all(
            &out[..m / 2],
            0x5555_5555,
            &format!("{m}: download saw the fill"),
        );
        assert_same(
            &out[m / 2 + 1..],
            &data[m / 2..m - 1],
            &format!("{m}: rest"),
        );
    }
}

// SUSPECTED TO FAIL (the memory layer's blocking copies, reached through the transfer paths
// that write or read a `PinnedBuffer` with a host pointer). `(S::Host, D::Pinned)`,
// `(S::Pinned, D::Host)`, `(S::Registered, D::Pinned)` and `DirectCopy` into a pinned buffer
// (the `(S::Host, D::Pinned)`, `(S::Pinned, D::Host)` and `(S::Registered, _)` arms of `execute`,
// and `pinned_down`, in crates/cuweave-transfer/src/execute.rs) call
// `Buffer::copy_range_from_host` / `copy_range_to_host` on the pinned buffer, i.e.
// `raw::write_blocking` / `raw::read_blocking` (crates/cuweave-memory/src/buffer/raw.rs):
// the legacy stream is made to wait (`cuStreamWaitEvent`) for the pinned buffer's queued uses,
// then `cuMemcpyHtoD` / `cuMemcpyDtoH` run with a *host* address on the device side. A
// host-to-host `cuMemcpy` is "fully synchronous with respect to the host" and may be done by the
// CPU at once, without honouring the wait queued on the legacy stream: then the bytes land
// before a device fill queued (behind a spin) on another stream, which overwrites them after
// `transfer` returned, or a download reads the pinned bytes before that fill lands.
#[test]
fn transfers_into_and_out_of_pinned_buffers_are_ordered_with_their_queued_device_work() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = user_stream(&gpu.context);
    let n = 256 * KIB + 3;
    let data = bytes(n, 21);
    let mut pinned = PinnedBuffer::<u8>::zeroed(&gpu.context, n).unwrap();

    // Write after write: pageable host -> pinned.
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    pinned.fill_async(0xAB, &stream).unwrap();
    manager.transfer(&data, &mut pinned).unwrap();
    gpu.context.synchronize().unwrap();
    assert_same(
        &pinned.to_vec().unwrap(),
        &data,
        "host -> pinned after a fill",
    );

    // Read after write: pinned -> pageable host sees the fill.
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    pinned.fill_async(0xCD, &stream).unwrap();
    let mut out = vec![0u8; n];
    manager.transfer(&pinned, &mut out).unwrap();
    assert_all(&out, 0xCD, "pinned -> host after a fill");

    // Write after read: a device copy reads the pinned buffer, then host -> pinned.
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    device.copy_from_async(&pinned, &stream).unwrap();
    manager.transfer(&data, &mut pinned).unwrap();
    stream.synchronize().unwrap();
    assert_all(
        &device.to_vec().unwrap(),
        0xCD,
        "the queued read of the pinned buffer",
    );
    assert_same(
        &pinned.to_vec().unwrap(),
        &data,
        "host -> pinned after a read",
    );

    // Device -> pinned by every method the path offers, after a queued fill of the pinned buffer.
    let source = DeviceBuffer::<u8>::from_slice(&gpu.context, &bytes(n, 22)).unwrap();
    let source_bytes = source.to_vec().unwrap();
    for method in TransferMethod::candidates(TransferPath::DEVICE_TO_PINNED) {
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        pinned.fill_async(0xEE, &stream).unwrap();
        match manager.transfer_with(*method, &source, &mut pinned) {
            Ok(_) => {}
            Err(TransferError::Unsupported { .. }) => continue,
            Err(error) => panic!("{method}: {error}"),
        }
        gpu.context.synchronize().unwrap();
        assert_same(
            &pinned.to_vec().unwrap(),
            &source_bytes,
            &format!("device -> pinned by {method} after a fill"),
        );
    }

    // Registered -> pinned after a queued fill.
    let mut host = bytes(n, 23);
    let expected = host.clone();
    let registered = manager.register_host(0, &mut host).unwrap();
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    pinned.fill_async(0x77, &stream).unwrap();
    manager.transfer(&registered, &mut pinned).unwrap();
    gpu.context.synchronize().unwrap();
    drop(registered);
    assert_same(&pinned.to_vec().unwrap(), &expected, "registered -> pinned");
}

// SUSPECTED TO FAIL (same mechanism as the pinned probe, with managed memory).
// `DirectCopy` between pageable host memory and a unified buffer
// (the `(S::Host, D::Unified)` and `(S::Unified, D::Host)` arms of `execute` in
// crates/cuweave-transfer/src/execute.rs, `u.copy_range_from_host` / `u.copy_range_to_host`) runs
// `cuMemcpyHtoD` / `cuMemcpyDtoH` on managed memory after only a `cuStreamWaitEvent` on the legacy
// stream (raw.rs `write_blocking` / `read_blocking`); if the driver copies managed memory with the
// CPU at once, the ordering with a fill queued on another stream is lost. The `UnifiedMemory`
// method takes a host slice (`as_slice` / `as_mut_slice`, which host-wait for the device) and must
// be ordered either way.
#[test]
fn unified_transfers_are_ordered_with_a_queued_device_fill_by_every_method() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let caps = gpu.device.capabilities().unwrap();
    if !caps.concurrent_managed_access {
        cuweave_test_support::skip(
            "unified_transfers_are_ordered_with_a_queued_device_fill_by_every_method",
            "no concurrent managed access",
        );
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = user_stream(&gpu.context);
    let n = 4 * MIB + 5;
    let mut unified = UnifiedBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    let up = TransferPath::between(Location::PageableHost, Location::Unified(0));
    for (round, method) in TransferMethod::candidates(up).iter().enumerate() {
        let data = bytes(n - 2, 30 + round as u64);
        // Write after write: host -> unified lands after the fill.
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        unified.fill_async(0x3C, &stream).unwrap();
        match manager.transfer_with(*method, &data, Destination::unified(&mut unified, 1)) {
            Ok(_) => {}
            Err(TransferError::Unsupported { .. }) => continue,
            Err(error) => panic!("{method}: {error}"),
        }
        gpu.context.synchronize().unwrap();
        let got = unified.to_vec().unwrap();
        assert_eq!(got[0], 0x3C, "{method}: byte before the range");
        assert_same(
            &got[1..n - 1],
            &data,
            &format!("host -> unified by {method}"),
        );
        assert_eq!(got[n - 1], 0x3C, "{method}: byte after the range");

        // Read after write: unified -> host sees the fill.
        kernels.spin_ns(&stream, SPIN_NS).unwrap();
        unified.fill_async(0xC3, &stream).unwrap();
        let mut out = vec![0u8; n - 7];
        manager
            .transfer_with(*method, Source::unified(&unified, 7, n - 7), &mut out)
            .unwrap();
        assert_all(&out, 0xC3, &format!("unified -> host by {method}"));
    }
}

// ---------------------------------------------------------------------------------------------
// (b) Memory reused while queued work may still use it
// ---------------------------------------------------------------------------------------------

/// A borrowed upload is forgotten with its chunks queued behind a fill that waits for a spin;
/// the device buffer is then dropped and a buffer of the same size (very likely the same cached
/// block) is allocated and written. The forgotten chunks land later: they must land before the
/// new owner's write (the block is not reused before its recorded uses finish), never over it.
#[test]
fn a_forgotten_upload_never_lands_in_the_buffer_that_reuses_its_memory() {
    let gpu = require_gpu!();
    if skip_under_sanitizer(
        "a_forgotten_upload_never_lands_in_the_buffer_that_reuses_its_memory",
        "forgets a future on purpose, which leaks its pinned blocks by design",
    ) {
        return;
    }
    let _serial = serial();
    let manager = fixed(64 * KIB, 2, 2, ChunkOrder::Ordered);
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = user_stream(&gpu.context);
    let len = 16 * 64 * KIB;
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, len).unwrap();
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    device.fill_async(0x11, &stream).unwrap();
    let source = vec![0xA7u8; len];
    let mut future = manager.upload_async(&source, &mut device, 0).unwrap();
    let mut queued = false;
    for _ in 0..2000 {
        if let Some(outcome) = poll_once(&mut future) {
            panic!("the upload finished behind a {SPIN_NS} ns spin: {outcome:?}");
        }
        if format!("{future:?}").contains("in_flight: 2") {
            queued = true;
            break;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    assert!(queued, "no chunk was queued: {future:?}");
    std::mem::forget(future);
    drop(device);
    let fresh = bytes(len, 99);
    let mut reused = DeviceBuffer::<u8>::new(&gpu.context, len).unwrap();
    reused.copy_from_host(&fresh).unwrap();
    gpu.context.synchronize().unwrap();
    assert_same(&reused.to_vec().unwrap(), &fresh, "the new owner's bytes");
    drop(source);
}

/// `clear_cache` releases idle pinned blocks and forgets the calibration while other threads
/// run pipelined, async and owned transfers on the same manager: no block in use is released
/// (that would corrupt data or crash), and every byte arrives.
#[test]
fn clearing_the_cache_while_other_threads_transfer_corrupts_nothing() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                manager.clear_cache();
                std::thread::yield_now();
            }
        });
        let workers: Vec<_> = (0..3u64)
            .map(|t| {
                let (manager, context) = (&manager, &gpu.context);
                scope.spawn(move || {
                    for round in 0..6u64 {
                        let len = 4 * MIB + 3 + (t * 7 + round) as usize * 4099;
                        let data = words16(len / 2, t * 10 + round);
                        let mut device = DeviceBuffer::<u16>::zeroed(context, data.len()).unwrap();
                        let mut back = vec![0u16; data.len()];
                        match (t + round) % 3 {
                            0 => {
                                manager.transfer(&data, &mut device).unwrap();
                                manager.transfer(&device, &mut back).unwrap();
                            }
                            1 => {
                                block_on(manager.upload_async(&data, &mut device, 0).unwrap())
                                    .unwrap();
                                block_on(manager.download_async(&device, 0, &mut back).unwrap())
                                    .unwrap();
                            }
                            _ => {
                                let up = block_on(manager.upload_owned(data.clone(), device, 0));
                                up.result.unwrap();
                                let down = block_on(manager.download_owned(up.device, 0, back));
                                down.result.unwrap();
                                back = down.host;
                            }
                        }
                        assert_same(&back, &data, &format!("thread {t} round {round}"));
                    }
                })
            })
            .collect();
        for worker in workers {
            let outcome = worker.join();
            done.store(true, Ordering::Relaxed);
            if let Err(panic) = outcome {
                std::panic::resume_unwind(panic);
            }
        }
        done.store(true, Ordering::Relaxed);
    });
}

// ---------------------------------------------------------------------------------------------
// (c) Exact bytes: element sizes 2, 8 and 16, offsets, short last chunks
// ---------------------------------------------------------------------------------------------

/// Async and owned transfers of 16-byte elements (and 2-byte ones) with a chunk size that is
/// not a multiple of the element size, a length with a short last chunk, at odd offsets of a
/// sentinel-filled buffer: the range holds the data, everything around it is untouched.
#[test]
fn async_and_owned_transfers_of_wide_and_narrow_elements_at_odd_offsets_are_exact() {
    let gpu = require_gpu!();
    // 4104 bytes: 256 elements of 16 bytes (8 bytes left over), 2052 of 2 bytes.
    let manager = fixed(4 * KIB + 8, 2, 3, ChunkOrder::Ordered);
    const SENTINEL: Wide = [0xEEEE_EEEE_EEEE_EEEE, 0xDDDD_DDDD_DDDD_DDDD];
    let n = 256 * 5 + 3;
    let offset = 7;
    let data = wides(n, 40);
    let whole = n + 13;
    for way in ["async", "owned", "blocking"] {
        let mut device =
            DeviceBuffer::<Wide>::from_slice(&gpu.context, &vec![SENTINEL; whole]).unwrap();
        match way {
            "async" => {
                block_on(manager.upload_async(&data, &mut device, offset).unwrap()).unwrap();
            }
            "owned" => {
                let owned = block_on(manager.upload_owned(data.clone(), device, offset));
                owned.result.unwrap();
                device = owned.device;
            }
            _ => drop(
                manager
                    .transfer(&data, Destination::device(&mut device, offset))
                    .unwrap(),
            ),
        }
        let got = device.to_vec().unwrap();
        assert_all(&got[..offset], SENTINEL, &format!("{way}: before"));
        assert_same(&got[offset..offset + n], &data, &format!("{way}: upload"));
        assert_all(&got[offset + n..], SENTINEL, &format!("{way}: after"));

        // Download a range starting at an odd element, into the middle of a guarded Vec.
        let mut guarded = vec![SENTINEL; n + 4];
        match way {
            "async" => {
                let dst = &mut guarded[2..n + 1];
                block_on(manager.download_async(&device, offset + 1, dst).unwrap()).unwrap();
            }
            "owned" => {
                let owned =
                    block_on(manager.download_owned(device, offset + 1, vec![SENTINEL; n - 1]));
                owned.result.unwrap();
                guarded[2..n + 1].copy_from_slice(&owned.host);
            }
            _ => drop(
                manager
                    .transfer(
                        Source::device(&device, offset + 1, n - 1),
                        Destination::Host(&mut guarded[2..n + 1]),
                    )
                    .unwrap(),
            ),
        }
        assert_all(&guarded[..2], SENTINEL, &format!("{way}: guard before"));
        assert_same(&guarded[2..n + 1], &data[1..], &format!("{way}: download"));
        assert_all(&guarded[n + 1..], SENTINEL, &format!("{way}: guard after"));
    }

    // 2-byte elements: 4104 bytes is 2052 elements, an odd-looking chunk.
    let n16 = 2052 * 4 + 1;
    let data16 = words16(n16, 41);
    let mut device = DeviceBuffer::<u16>::zeroed(&gpu.context, n16 + 3).unwrap();
    block_on(manager.upload_async(&data16, &mut device, 3).unwrap()).unwrap();
    let mut back = vec![0u16; n16];
    block_on(manager.download_async(&device, 3, &mut back).unwrap()).unwrap();
    assert_same(&back, &data16, "u16 async round trip");
}

/// The blocking pipeline with 2- and 8-byte elements, at sizes that are no multiple of the
/// chunk (ordered from `ORDERED_FROM`, two streams and a tapered last chunk from
/// `TWO_STREAMS_FROM`), in both chunk orders and with the default configuration, at odd
/// offsets: exact bytes, nothing around the range touched.
#[test]
fn pipelined_transfers_of_2_and_8_byte_elements_cut_into_uneven_chunks_are_exact() {
    let gpu = require_gpu!();
    let managers = [
        ("default", TransferManager::new().unwrap()),
        ("ordered", fixed(64 * KIB + 2, 2, 4, ChunkOrder::Ordered)),
        (
            "interleaved",
            fixed(64 * KIB + 6, 3, 4, ChunkOrder::Interleaved),
        ),
    ];
    let sizes = [ORDERED_FROM + 6, TWO_STREAMS_FROM + 8 * 4099];
    for (name, manager) in &managers {
        for &bytes_len in &sizes {
            let n16 = bytes_len / 2 + 1;
            let data16 = words16(n16, bytes_len as u64);
            let mut device16 = DeviceBuffer::<u16>::zeroed(&gpu.context, n16 + 5).unwrap();
            manager
                .transfer_with(
                    TransferMethod::HostStaged,
                    &data16,
                    Destination::device(&mut device16, 3),
                )
                .unwrap();
            let got = device16.to_vec().unwrap();
            assert_all(&got[..3], 0, &format!("{name} u16 {bytes_len}: before"));
            assert_same(
                &got[3..3 + n16],
                &data16,
                &format!("{name} u16 {bytes_len}"),
            );
            assert_all(
                &got[3 + n16..],
                0,
                &format!("{name} u16 {bytes_len}: after"),
            );
            let mut back16 = vec![0u16; n16 - 1];
            manager
                .transfer_with(
                    TransferMethod::HostStaged,
                    Source::device(&device16, 4, n16 - 1),
                    &mut back16,
                )
                .unwrap();
            assert_same(
                &back16,
                &data16[1..],
                &format!("{name} u16 {bytes_len}: down"),
            );

            let n64 = bytes_len / 8 + 1;
            let data64 = words64(n64, bytes_len as u64 + 1);
            let mut device64 = DeviceBuffer::<u64>::zeroed(&gpu.context, n64 + 2).unwrap();
            manager
                .transfer_with(
                    TransferMethod::HostStaged,
                    &data64,
                    Destination::device(&mut device64, 1),
                )
                .unwrap();
            let mut back64 = vec![0u64; n64 + 2];
            manager
                .transfer_with(TransferMethod::HostStaged, &device64, &mut back64)
                .unwrap();
            assert_eq!(back64[0], 0, "{name} u64 {bytes_len}: before");
            assert_same(
                &back64[1..n64 + 1],
                &data64,
                &format!("{name} u64 {bytes_len}"),
            );
            assert_eq!(back64[n64 + 1], 0, "{name} u64 {bytes_len}: after");
        }
    }
}

/// A writable view longer than the source is written from its first element for the source's
/// length only (`Destination::View` checks `len <= view.len()`); views of pinned and unified
/// buffers as sources into registered memory move exact bytes.
#[test]
fn views_longer_than_the_source_and_views_into_registered_memory_move_exact_bytes() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let m = 2 * MIB / 2 + 9;
    let data = words16(m, 50);
    let mut device = DeviceBuffer::<u16>::zeroed(&gpu.context, 2 * m + 10).unwrap();
    manager
        .transfer(
            &data,
            Destination::view(device.slice_mut(5..5 + 2 * m).unwrap()),
        )
        .unwrap();
    let got = device.to_vec().unwrap();
    assert_all(&got[..5], 0, "before the view");
    assert_same(&got[5..5 + m], &data, "the view's first elements");
    assert_all(&got[5 + m..], 0, "the rest of the view and after it");

    // A view of a pinned buffer and of a unified buffer into registered memory at an offset.
    let pinned = PinnedBuffer::<u16>::from_slice(&gpu.context, &data).unwrap();
    let mut host = vec![0u16; m + 4];
    {
        let mut registered = manager.register_host(0, &mut host).unwrap();
        manager
            .transfer(
                Source::view(pinned.slice(3..m).unwrap()),
                Destination::registered(&mut registered, 2),
            )
            .unwrap();
        registered.unregister().unwrap();
    }
    assert_all(&host[..2], 0, "registered: before");
    assert_same(&host[2..m - 1], &data[3..], "pinned view -> registered");
    assert_all(&host[m - 1..], 0, "registered: after");
    if gpu.device.capabilities().unwrap().concurrent_managed_access {
        let unified = UnifiedBuffer::<u16>::from_slice(&gpu.context, &data).unwrap();
        let mut host = vec![0u16; m];
        let mut registered = manager.register_host(0, &mut host).unwrap();
        manager
            .transfer(
                Source::view(unified.slice(1..m).unwrap()),
                Destination::registered(&mut registered, 0),
            )
            .unwrap();
        let got = registered.unregister().unwrap();
        assert_same(&got[..m - 1], &data[1..], "unified view -> registered");
        assert_eq!(got[m - 1], 0, "unified view -> registered: after");
    }
}

// ---------------------------------------------------------------------------------------------
// (d) Bad input
// ---------------------------------------------------------------------------------------------

fn out_of_range<T: std::fmt::Debug>(result: Result<T, TransferError>, what: &str) {
    match result {
        Err(TransferError::OutOfRange { .. } | TransferError::LengthMismatch { .. }) => {}
        other => panic!("{what}: expected a range error, got {other:?}"),
    }
}

/// Zero lengths at the end, offsets at `usize::MAX`, ranges that overflow: a typed error (or
/// an empty success) on every entry point, never a panic, and nothing counted.
#[test]
fn zero_lengths_and_overflowing_ranges_are_typed_errors_on_every_entry_point() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let len = 64;
    let mut device = DeviceBuffer::<u32>::from_slice(&gpu.context, &[7u32; 64]).unwrap();
    let mut host = vec![0u32; 2];

    out_of_range(
        manager.transfer(Source::device(&device, usize::MAX, 2), &mut host),
        "device source at usize::MAX",
    );
    out_of_range(
        manager.transfer(&host, Destination::device(&mut device, usize::MAX)),
        "device destination at usize::MAX",
    );
    out_of_range(
        manager.transfer(&host, Destination::device(&mut device, len - 1)),
        "destination one short",
    );
    // Empty at the end: fine, nothing moves.
    let report = manager
        .transfer(&[] as &[u32], Destination::device(&mut device, len))
        .unwrap();
    assert_eq!(report.bytes, 0);
    out_of_range(
        manager.transfer(&[] as &[u32], Destination::device(&mut device, len + 1)),
        "empty past the end",
    );

    // Async: an empty upload at the end completes; past it, or overflowing, is refused.
    let report = block_on(manager.upload_async(&[], &mut device, len).unwrap()).unwrap();
    assert_eq!(report.bytes, 0);
    out_of_range(
        manager.upload_async(&[], &mut device, len + 1),
        "empty async upload past the end",
    );
    out_of_range(
        manager.upload_async(&[1, 2], &mut device, usize::MAX),
        "async upload at usize::MAX",
    );
    out_of_range(
        manager.download_async(&device, usize::MAX - 1, &mut host),
        "async download overflowing",
    );

    // Owned: refused ones hand both buffers back untouched.
    let owned = block_on(manager.upload_owned(vec![1u32, 2], device, usize::MAX));
    out_of_range(owned.result, "owned upload at usize::MAX");
    assert_eq!(owned.host, vec![1, 2]);
    let owned = block_on(manager.download_owned(owned.device, len + 1, Vec::new()));
    out_of_range(owned.result, "empty owned download past the end");
    assert_eq!(owned.device.to_vec().unwrap(), vec![7u32; 64]);

    // Registration.
    assert!(matches!(
        manager.register_host::<u32>(0, &mut []),
        Err(TransferError::EmptyRegistration { .. })
    ));
    assert!(matches!(
        manager.register_host(usize::MAX, &mut host),
        Err(TransferError::NoSuchDevice { .. })
    ));
    let mut registered = manager.register_host(0, &mut host).unwrap();
    out_of_range(
        manager.transfer(Source::registered(&registered, 2, 1), &mut vec![0u32; 1]),
        "registered source past the end",
    );
    out_of_range(
        manager.transfer(
            &[1u32][..],
            Destination::registered(&mut registered, usize::MAX),
        ),
        "registered destination at usize::MAX",
    );
    drop(registered);
    assert_eq!(host, vec![0, 0], "refused transfers wrote nothing");

    // Nothing refused was counted, as failure or as success.
    for (path, class, stats) in manager.stats().snapshot() {
        assert_eq!(stats.failures, 0, "{path} {class:?}");
    }
}

/// A calibration table built in code may hold NaN, infinite or negative figures (no file check
/// runs on it): plans, registration advice and transfers must neither panic nor pick a method
/// the path cannot run, and the bytes still arrive.
#[test]
fn nonsense_calibration_figures_neither_panic_nor_misroute_a_transfer() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let len = 3 * MIB + 1;
    let class = SizeClass::of(len);
    let mut table = CalibrationTable::default();
    table.record(
        TransferPath::PAGEABLE_TO_DEVICE,
        class,
        TransferMethod::HostStaged,
        f64::NAN,
    );
    table.record(
        TransferPath::PAGEABLE_TO_DEVICE,
        class,
        TransferMethod::DirectCopy,
        -5.0,
    );
    table.record(
        TransferPath::DEVICE_TO_PAGEABLE,
        class,
        TransferMethod::HostStaged,
        f64::INFINITY,
    );
    table.record(
        TransferPath::PINNED_TO_DEVICE,
        class,
        TransferMethod::ZeroCopy,
        f64::NAN,
    );
    table.registration = Some(RegistrationCost {
        fixed_ms: f64::NAN,
        ms_per_mib: -1.0,
    });
    drop(manager.set_calibration(table));
    for (src, dst) in [
        (Location::PageableHost, Location::Device(0)),
        (Location::Device(0), Location::PageableHost),
        (Location::PinnedHost(0), Location::Device(0)),
    ] {
        let plan = manager.plan(src, dst, len);
        assert!(
            TransferMethod::candidates(plan.path).contains(&plan.method),
            "{plan}"
        );
        let _ = plan.to_string();
    }
    for direction in [
        TransferDirection::HostToDevice,
        TransferDirection::DeviceToHost,
    ] {
        for transfers in [0, 1, u64::MAX] {
            let advice = manager.registration_advice(direction, len, transfers);
            let _ = advice.reason.len();
        }
    }
    let data = bytes(len, 60);
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, len).unwrap();
    manager.transfer(&data, &mut device).unwrap();
    let mut back = vec![0u8; len];
    manager.transfer(&device, &mut back).unwrap();
    assert_same(&back, &data, "round trip under a nonsense calibration");
    let pinned = PinnedBuffer::<u8>::from_slice(&gpu.context, &data).unwrap();
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, len).unwrap();
    manager.transfer(&pinned, &mut device).unwrap();
    assert_same(&device.to_vec().unwrap(), &data, "pinned upload");
}
