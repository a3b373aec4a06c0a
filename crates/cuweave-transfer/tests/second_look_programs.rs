//! Second-look user programs for the transfer manager, written as PyTorch users
//! (`tensor.to(device)`, `non_blocking=True`, `pin_memory()`), inference servers and cudarc users
//! write them, on what the other GPU tests of this crate leave out or cover only in part:
//!
//! - every public method (blocking, forced methods, borrowed futures, owned futures, views) at
//!   awkward sizes from host slices that start 1, 3 or 7 bytes into a `Vec`, with the statistics
//!   reconciled to the byte;
//! - eight threads mixing every method for seconds, every byte checked, the statistics
//!   reconciled per path while another thread clears the cache;
//! - transfers racing *kernels* (not copies or memsets) the user launched through
//!   `TrackedLaunch` on another stream: a kernel still reading the destination for tens of
//!   milliseconds, a kernel writing the source late, on device, pinned, unified and registered
//!   memory;
//! - borrowed futures dropped after every number of polls, then the buffers reused, the
//!   statistics counting only what completed, and a future polled after it completed;
//! - 2-, 8-, 3- and 65 544-byte elements (larger than a poll's budget and than a staging chunk)
//!   by every method;
//! - a `pin_memory` data loader double-buffering batches into two device slots that a checksum
//!   kernel consumes late: no batch overwritten while a kernel still reads it;
//! - owned transfers that outlive the manager that started them;
//! - 300 borrowed futures pending at once (more lanes than there are progress-mark words for)
//!   with a pipelined blocking transfer among them;
//! - host slices of pinned and managed memory used as plain pageable memory, and a device buffer
//!   from a stream-ordered pool allocated on a busy stream as a destination.
//!
//! Every test skips without a GPU. Tests that measure process-wide things or race kernels take
//! the binary's serial guard.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use cuweave_driver::Context;
use cuweave_memory::{
    AsyncPoolResource, Buffer, DeviceBuffer, MemoryResource, PinnedBuffer, TrackedLaunch,
    UnifiedBuffer,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip};
use cuweave_transfer::{
    AsyncTransfer, ChunkOrder, Destination, HostCopy, MAX_IDLE_LANES, MIN_CHUNK_BYTES,
    OwnedTransfer, Source, StagingConfig, TransferError, TransferManager, TransferMethod,
    TransferPath,
};

mod common;
use common::{
    SENTINEL, Way, assert_all_u32, assert_bytes, assert_range, block_on, bytes, grid, late_fill,
    user_stream, watch, words,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// How long a user's kernel keeps reading (or waits before writing) in the ordering probes:
/// far longer than the host needs to queue a transfer and let a wrongly ordered copy land.
const KERNEL_NS: u64 = 60_000_000;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Polls `future` up to `polls` times with a waker that does nothing; its output if it finished.
fn poll_n<F: Future + Unpin>(future: &mut F, polls: usize) -> Option<F::Output> {
    let mut cx = TaskContext::from_waker(Waker::noop());
    for _ in 0..polls {
        if let Poll::Ready(output) = Pin::new(&mut *future).poll(&mut cx) {
            return Some(output);
        }
    }
    None
}

/// Wakes the thread that polls a set of futures.
struct Unpark(std::thread::Thread, AtomicBool);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.1.store(true, Ordering::Release);
        self.0.unpark();
    }
}

/// Polls every future to completion on this thread (one task: any wake polls them all again).
fn join_all<F: Future + Unpin>(futures: &mut [F]) -> Vec<F::Output> {
    let unpark = Arc::new(Unpark(std::thread::current(), AtomicBool::new(true)));
    let waker = Waker::from(Arc::clone(&unpark));
    let mut cx = TaskContext::from_waker(&waker);
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    let mut left = futures.len();
    let deadline = Instant::now() + Duration::from_secs(120);
    while left > 0 {
        unpark.1.store(false, Ordering::Release);
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_some() {
                continue;
            }
            if let Poll::Ready(done) = Pin::new(future).poll(&mut cx) {
                *output = Some(done);
                left -= 1;
            }
        }
        if left > 0 && !unpark.1.load(Ordering::Acquire) {
            assert!(Instant::now() < deadline, "{left} futures never finished");
            std::thread::park_timeout(Duration::from_millis(50));
        }
    }
    outputs.into_iter().map(Option::unwrap).collect()
}

/// Completed transfers and their bytes on `path`, over every size class.
fn counted(manager: &TransferManager, path: TransferPath) -> (u64, u64) {
    manager
        .stats()
        .snapshot()
        .iter()
        .filter(|(p, ..)| *p == path)
        .fold((0, 0), |(c, b), (_, _, s)| (c + s.count, b + s.bytes))
}

/// Failed transfers on `path`, over every size class.
fn failures(manager: &TransferManager, path: TransferPath) -> u64 {
    manager
        .stats()
        .snapshot()
        .iter()
        .filter(|(p, ..)| *p == path)
        .map(|(_, _, s)| s.failures)
        .sum()
}

/// Uploads `src` into `device` at element `offset` by `way` (an owned transfer takes the device
/// buffer and gives it back).
fn upload_by<T: cuweave_memory::Element>(
    manager: &TransferManager,
    way: Way,
    src: &[T],
    device: &mut DeviceBuffer<T>,
    offset: usize,
) {
    let n = src.len();
    match way {
        Way::Planned => drop(
            manager
                .transfer(src, Destination::device(device, offset))
                .unwrap(),
        ),
        Way::Staged | Way::Direct => {
            let method = if way == Way::Staged {
                TransferMethod::HostStaged
            } else {
                TransferMethod::DirectCopy
            };
            manager
                .transfer_with(method, src, Destination::device(device, offset))
                .unwrap();
        }
        Way::Borrowed => {
            let report = block_on(manager.upload_async(src, device, offset).unwrap()).unwrap();
            assert_eq!(report.bytes, size_of_val(src));
        }
        Way::Owned => {
            let taken = std::mem::replace(
                device,
                DeviceBuffer::<T>::new(&Arc::clone(device.context()), 1).unwrap(),
            );
            let owned = block_on(manager.upload_owned(src.to_vec(), taken, offset));
            *device = owned.device;
            assert_eq!(owned.result.unwrap().bytes, size_of_val(src));
        }
        Way::View => {
            let view = device.slice_mut(offset..offset + n).unwrap();
            manager.transfer(src, Destination::view(view)).unwrap();
        }
    }
}

/// Downloads `dst.len()` elements of `device` from element `offset` into `dst` by `way`.
fn download_by<T: cuweave_memory::Element>(
    manager: &TransferManager,
    way: Way,
    device: &mut DeviceBuffer<T>,
    offset: usize,
    dst: &mut [T],
) {
    let n = dst.len();
    match way {
        Way::Planned => drop(
            manager
                .transfer(Source::device(device, offset, n), &mut *dst)
                .unwrap(),
        ),
        Way::Staged | Way::Direct => {
            let method = if way == Way::Staged {
                TransferMethod::HostStaged
            } else {
                TransferMethod::DirectCopy
            };
            manager
                .transfer_with(method, Source::device(device, offset, n), &mut *dst)
                .unwrap();
        }
        Way::Borrowed => {
            let report = block_on(manager.download_async(device, offset, dst).unwrap()).unwrap();
            assert_eq!(report.bytes, size_of_val(dst));
        }
        Way::Owned => {
            let taken = std::mem::replace(
                device,
                DeviceBuffer::<T>::new(&Arc::clone(device.context()), 1).unwrap(),
            );
            let owned = block_on(manager.download_owned(taken, offset, vec![T::zeroed(); n]));
            *device = owned.device;
            assert_eq!(owned.result.unwrap().bytes, size_of_val(dst));
            dst.copy_from_slice(&owned.host);
        }
        Way::View => {
            let view = device.slice(offset..offset + n).unwrap();
            manager.transfer(Source::view(view), &mut *dst).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Awkward sizes from unaligned host slices, every public method, statistics to the byte
// ---------------------------------------------------------------------------------------------

/// A loader cutting records out of one big `Vec<u8>` hands the manager slices that start 1, 3
/// or 7 bytes into it (never 16-byte aligned, as streaming stores would like), at sizes around
/// every boundary (1 byte, a page either side, just past the tiny class, 1 MiB + 1, 4 MiB + 3),
/// into device offsets 0, 5 and 4093. Every public method must move them byte-exact, write
/// nothing around them on the device or the host, and be counted once, with its bytes, under
/// the pageable paths (a view is device memory too).
#[test]
fn awkward_sizes_from_unaligned_host_slices_round_trip_by_every_public_method() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let sizes = [1usize, 3, 4095, 4097, 64 * KIB + 1, MIB + 1, 4 * MIB + 3];
    let starts = [1usize, 3, 7];
    let offsets = [0usize, 5, 4093];
    let mut moved = (0u64, 0u64);
    for (si, &n) in sizes.iter().enumerate() {
        for (oi, &start) in starts.iter().enumerate() {
            let offset = offsets[(si + oi) % offsets.len()];
            let backing = bytes(start + n + 9, (si * 16 + oi) as u64);
            let src = &backing[start..start + n];
            let mut device = DeviceBuffer::<u8>::new(&gpu.context, offset + n + 11).unwrap();
            for way in Way::ALL {
                let what = format!("{way:?}: {n} bytes from host byte {start}, device {offset}");
                device.fill(SENTINEL).unwrap();
                upload_by(&manager, way, src, &mut device, offset);
                assert_range(
                    &device.to_vec().unwrap(),
                    offset,
                    src,
                    &format!("{what} up"),
                );
                let mut back = vec![SENTINEL; start + n + 9];
                download_by(
                    &manager,
                    way,
                    &mut device,
                    offset,
                    &mut back[start..start + n],
                );
                assert_range(&back, start, src, &format!("{what} down"));
                moved.0 += 1;
                moved.1 += n as u64;
            }
        }
    }
    assert_eq!(
        counted(&manager, TransferPath::PAGEABLE_TO_DEVICE),
        moved,
        "uploads counted (count, bytes)"
    );
    assert_eq!(
        counted(&manager, TransferPath::DEVICE_TO_PAGEABLE),
        moved,
        "downloads counted (count, bytes)"
    );
    assert_eq!(failures(&manager, TransferPath::PAGEABLE_TO_DEVICE), 0);
    assert_eq!(failures(&manager, TransferPath::DEVICE_TO_PAGEABLE), 0);
}

// ---------------------------------------------------------------------------------------------
// 2. Eight threads mixing every method for seconds
// ---------------------------------------------------------------------------------------------

/// Per-path tallies a thread keeps of what it moved.
#[derive(Default, Clone, Copy)]
struct Tally {
    up: (u64, u64),
    down: (u64, u64),
    pinned_up: (u64, u64),
    pinned_down: (u64, u64),
}

impl Tally {
    fn add(&mut self, other: &Tally) {
        for (a, b) in [
            (&mut self.up, other.up),
            (&mut self.down, other.down),
            (&mut self.pinned_up, other.pinned_up),
            (&mut self.pinned_down, other.pinned_down),
        ] {
            a.0 += b.0;
            a.1 += b.1;
        }
    }
}

fn bump(slot: &mut (u64, u64), bytes: usize) {
    slot.0 += 1;
    slot.1 += bytes as u64;
}

/// An inference server's eight request threads share one manager for three seconds: each
/// request picks a size (1 byte to 3 MiB, mostly odd) and a way (planned, forced methods,
/// borrowed future, owned future, views, a pinned staging buffer by `DirectCopy` and
/// `ZeroCopy`), uploads at an odd device offset, downloads, and checks every byte. Meanwhile a
/// ninth thread calls `clear_cache` every few milliseconds (it forgets the calibration and trims
/// pinned blocks, never the statistics). Afterwards the statistics equal, per path, the sum of
/// what the threads counted (transfers and bytes), nothing failed, and the device keeps at most
/// `MAX_IDLE_LANES` idle lanes.
#[test]
fn eight_threads_mix_every_method_for_seconds_and_the_statistics_reconcile() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let stop = AtomicBool::new(false);
    let budget = Duration::from_secs(3);
    let total = std::thread::scope(|scope| {
        let clearer = scope.spawn(|| {
            let mut clears = 0u32;
            while !stop.load(Ordering::Acquire) {
                manager.clear_cache();
                clears += 1;
                std::thread::sleep(Duration::from_millis(7));
            }
            clears
        });
        let workers: Vec<_> = (0..8u64)
            .map(|t| {
                let (manager, context) = (&manager, &gpu.context);
                scope.spawn(move || {
                    let mut tally = Tally::default();
                    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1).wrapping_mul(0xD1B5_4A32);
                    let mut next = || {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        state
                    };
                    let started = Instant::now();
                    let mut round = 0usize;
                    while round < 24 || started.elapsed() < budget {
                        let r = next();
                        let n = match r % 4 {
                            0 => (r >> 8) as usize % 64 + 1,
                            1 => (r >> 8) as usize % (64 * KIB) + 1,
                            2 => (r >> 8) as usize % MIB + 1,
                            _ => (r >> 8) as usize % (3 * MIB) + 1,
                        } | 1;
                        let offset = (r >> 40) as usize % 13;
                        let data = bytes(n, r);
                        let what = format!("thread {t} round {round}: {n} bytes at {offset}");
                        let mut device = DeviceBuffer::<u8>::new(context, offset + n + 3).unwrap();
                        device.fill(SENTINEL).unwrap();
                        let choice = round % 8;
                        if choice < 6 {
                            let way = Way::ALL[choice];
                            upload_by(manager, way, &data, &mut device, offset);
                            let mut back = vec![0u8; n];
                            download_by(manager, way, &mut device, offset, &mut back);
                            assert!(back == data, "{what}: {way:?} round trip differs");
                            bump(&mut tally.up, n);
                            bump(&mut tally.down, n);
                        } else {
                            let method = if choice == 6 {
                                TransferMethod::DirectCopy
                            } else {
                                TransferMethod::ZeroCopy
                            };
                            let pinned = PinnedBuffer::from_slice(context, &data).unwrap();
                            let up = manager.transfer_with(
                                method,
                                &pinned,
                                Destination::device(&mut device, offset),
                            );
                            let method = match up {
                                Ok(_) => method,
                                // No host mapping on this device: the plain DMA instead.
                                Err(TransferError::Unsupported { .. }) => {
                                    manager
                                        .transfer_with(
                                            TransferMethod::DirectCopy,
                                            &pinned,
                                            Destination::device(&mut device, offset),
                                        )
                                        .unwrap();
                                    TransferMethod::DirectCopy
                                }
                                Err(error) => panic!("{what}: {method}: {error}"),
                            };
                            bump(&mut tally.pinned_up, n);
                            let mut back = PinnedBuffer::<u8>::zeroed(context, n).unwrap();
                            manager
                                .transfer_with(
                                    method,
                                    Source::device(&device, offset, n),
                                    &mut back,
                                )
                                .unwrap();
                            bump(&mut tally.pinned_down, n);
                            assert!(
                                *back.as_slice().unwrap() == *data,
                                "{what}: pinned by {method} differs"
                            );
                        }
                        let whole = device.to_vec().unwrap();
                        assert_range(&whole, offset, &data, &format!("{what}: device"));
                        round += 1;
                    }
                    tally
                })
            })
            .collect();
        let mut total = Tally::default();
        for worker in workers {
            total.add(&worker.join().unwrap());
        }
        stop.store(true, Ordering::Release);
        assert!(clearer.join().unwrap() > 0);
        total
    });
    for (path, want) in [
        (TransferPath::PAGEABLE_TO_DEVICE, total.up),
        (TransferPath::DEVICE_TO_PAGEABLE, total.down),
        (TransferPath::PINNED_TO_DEVICE, total.pinned_up),
        (TransferPath::DEVICE_TO_PINNED, total.pinned_down),
    ] {
        assert_eq!(
            counted(&manager, path),
            want,
            "{path}: (count, bytes) recorded against what the threads moved"
        );
        assert_eq!(failures(&manager, path), 0, "{path}: failures");
    }
    assert!(
        manager.idle_lanes(0) <= MAX_IDLE_LANES,
        "{} idle lanes kept",
        manager.idle_lanes(0)
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Transfers racing the user's own kernels on another stream
// ---------------------------------------------------------------------------------------------

/// Where a probe's device side lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Way(Way),
    Pinned(TransferMethod),
    Registered,
}

const UPLOAD_SIDES: [Side; 9] = [
    Side::Way(Way::Planned),
    Side::Way(Way::Staged),
    Side::Way(Way::Direct),
    Side::Way(Way::Borrowed),
    Side::Way(Way::Owned),
    Side::Way(Way::View),
    Side::Pinned(TransferMethod::DirectCopy),
    Side::Pinned(TransferMethod::ZeroCopy),
    Side::Registered,
];

/// A cudarc user's program: a kernel of theirs (`TrackedLaunch`, declared a read) keeps reading
/// a device buffer on their own stream for 60 ms, expecting its old contents; meanwhile they
/// transfer new contents into it by every public way (pageable by each method, borrowed and
/// owned futures, a view, a pinned buffer by `DirectCopy` and `ZeroCopy`, registered memory).
/// The transfer must land only once the kernel is done: the kernel counts no changed element,
/// and the buffer ends with the new contents. Then the other way round: their kernel writes the
/// buffer after a 60 ms spin (declared a write), and a download by every way must return what
/// the kernel wrote. At a one-block size (4000 bytes) and a pipelined one (4 MiB + 12).
/// The same for a unified buffer by `UnifiedMemory` and `DirectCopy`, where the device has
/// concurrent managed access.
#[test]
fn transfers_wait_for_the_users_kernels_still_reading_or_about_to_write_by_every_way() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let watcher = kernels.module().function("watch_u32").unwrap();
    let fill = kernels.module().function("fill_u32").unwrap();
    let stream = user_stream(&gpu.context);
    const OLD: u32 = 0x0101_0101;
    const WRITTEN: u32 = 0x7E57_AB1E;
    for n in [1000usize, MIB + 3] {
        for (i, side) in UPLOAD_SIDES.iter().enumerate() {
            let what = format!("{side:?}, {n} u32");
            let new = words(n, (n + i) as u64);
            let mut device = DeviceBuffer::<u32>::new(&gpu.context, n).unwrap();
            device.fill(OLD).unwrap();
            let mut mismatches = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
            watch(&watcher, &stream, &device, OLD, KERNEL_NS, &mut mismatches);
            match *side {
                Side::Way(way) => upload_by(&manager, way, &new, &mut device, 0),
                Side::Pinned(method) => {
                    let pinned = PinnedBuffer::from_slice(&gpu.context, &new).unwrap();
                    match manager.transfer_with(method, &pinned, &mut device) {
                        Ok(_) => {}
                        // No host mapping: the plain DMA, so the checks below still hold.
                        Err(TransferError::Unsupported { .. }) => drop(
                            manager
                                .transfer_with(TransferMethod::DirectCopy, &pinned, &mut device)
                                .unwrap(),
                        ),
                        Err(error) => panic!("{what}: {error}"),
                    }
                }
                Side::Registered => {
                    let mut host = new.clone();
                    let registered = manager.register_host(0, &mut host).unwrap();
                    manager.transfer(&registered, &mut device).unwrap();
                    drop(registered);
                }
            }
            stream.synchronize().unwrap();
            assert_eq!(
                mismatches.to_vec().unwrap(),
                [0],
                "{what}: the upload landed while the user's kernel still read the buffer"
            );
            assert_bytes(&device.to_vec().unwrap(), &new, &format!("{what}: upload"));

            // Read after the kernel's late write.
            late_fill(&kernels, &fill, &stream, &mut device, WRITTEN, KERNEL_NS);
            let mut out = vec![0u32; n];
            match *side {
                Side::Way(way) => download_by(&manager, way, &mut device, 0, &mut out),
                Side::Pinned(method) => {
                    let mut pinned = PinnedBuffer::<u32>::zeroed(&gpu.context, n).unwrap();
                    let method = match manager.transfer_with(method, &device, &mut pinned) {
                        Ok(_) => method,
                        Err(TransferError::Unsupported { .. }) => {
                            manager
                                .transfer_with(TransferMethod::DirectCopy, &device, &mut pinned)
                                .unwrap();
                            TransferMethod::DirectCopy
                        }
                        Err(error) => panic!("{what}: {error}"),
                    };
                    out.copy_from_slice(&pinned.as_slice().unwrap()[..]);
                    eprintln!("{what}: download into pinned memory by {method}");
                }
                Side::Registered => {
                    let mut registered = manager.register_host(0, &mut out).unwrap();
                    manager.transfer(&device, &mut registered).unwrap();
                    drop(registered);
                }
            }
            assert_all_u32(
                &out,
                WRITTEN,
                &format!("{what}: the download did not see the user's kernel's write"),
            );
            stream.synchronize().unwrap();
        }
    }

    if !gpu.device.capabilities().unwrap().concurrent_managed_access {
        skip(
            "transfers_wait_for_the_users_kernels_still_reading_or_about_to_write_by_every_way",
            "the unified part: no concurrent managed access",
        );
        return;
    }
    for n in [1000usize, MIB + 3] {
        for method in [TransferMethod::UnifiedMemory, TransferMethod::DirectCopy] {
            let what = format!("unified by {method}, {n} u32");
            let new = words(n, n as u64 ^ 0x55);
            let mut unified = UnifiedBuffer::<u32>::new(&gpu.context, n).unwrap();
            unified.fill(OLD).unwrap();
            let mut mismatches = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
            watch(&watcher, &stream, &unified, OLD, KERNEL_NS, &mut mismatches);
            manager
                .transfer_with(method, &new, &mut unified)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            stream.synchronize().unwrap();
            assert_eq!(
                mismatches.to_vec().unwrap(),
                [0],
                "{what}: the upload landed while the user's kernel still read the buffer"
            );
            assert_bytes(&unified.to_vec().unwrap(), &new, &format!("{what}: up"));

            late_fill(&kernels, &fill, &stream, &mut unified, WRITTEN, KERNEL_NS);
            let mut out = vec![0u32; n];
            manager
                .transfer_with(method, &unified, &mut out)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_all_u32(&out, WRITTEN, &format!("{what}: the download"));
            stream.synchronize().unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Borrowed futures dropped after every number of polls
// ---------------------------------------------------------------------------------------------

/// A request whose client disconnects drops its transfer future wherever it is: after 0, 1,
/// 2, 3, 5, 8, 13, 40 or 200 polls (with a waker that does nothing, as a cancelled task's last
/// polls). The device buffer and host vector are then reused at once by blocking transfers,
/// which must move exact bytes; only transfers that completed are counted (a dropped one not
/// at all, a finished one once). A future polled again after it completed is a typed error and
/// is not counted twice.
#[test]
fn futures_dropped_after_any_number_of_polls_leave_buffers_reusable_and_count_only_completions() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let n = 3 * MIB + 5;
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n + 8).unwrap();
    let mut host = vec![0u8; n];
    let (mut blocking, mut finished_up, mut finished_down) = (0u64, 0u64, 0u64);
    for (round, polls) in [0usize, 1, 2, 3, 5, 8, 13, 40, 200].into_iter().enumerate() {
        let dropped = bytes(n, round as u64);
        {
            let mut up = manager.upload_async(&dropped, &mut device, 4).unwrap();
            if let Some(result) = poll_n(&mut up, polls) {
                assert_eq!(result.unwrap().bytes, n);
                finished_up += 1;
            }
        }
        let data = bytes(n, 100 + round as u64);
        manager
            .transfer(&data, Destination::device(&mut device, 4))
            .unwrap();
        blocking += 1;
        let whole = device.to_vec().unwrap();
        assert_bytes(
            &whole[4..4 + n],
            &data,
            &format!("{polls} polls: upload after a dropped one"),
        );
        {
            let mut down = manager.download_async(&device, 4, &mut host).unwrap();
            if let Some(result) = poll_n(&mut down, polls) {
                assert_eq!(result.unwrap().bytes, n);
                finished_down += 1;
            }
        }
        host.fill(0);
        manager
            .transfer(Source::device(&device, 4, n), &mut host)
            .unwrap();
        assert_bytes(
            &host,
            &data,
            &format!("{polls} polls: download after a dropped one"),
        );
    }
    assert_eq!(
        counted(&manager, TransferPath::PAGEABLE_TO_DEVICE).0,
        blocking + finished_up,
        "uploads counted: {blocking} blocking and {finished_up} futures that finished"
    );
    assert_eq!(
        counted(&manager, TransferPath::DEVICE_TO_PAGEABLE).0,
        blocking + finished_down,
        "downloads counted"
    );

    // Polled after it completed: a typed error, counted once.
    let before = counted(&manager, TransferPath::PAGEABLE_TO_DEVICE);
    let data = bytes(n, 999);
    let mut up: AsyncTransfer<'_, u8> = manager.upload_async(&data, &mut device, 1).unwrap();
    let first = block_on(&mut up).unwrap();
    assert_eq!(first.bytes, n);
    match poll_n(&mut up, 1) {
        Some(Err(TransferError::AlreadyCompleted { .. })) => {}
        other => panic!("a second poll after completion: {other:?}"),
    }
    drop(up);
    let after = counted(&manager, TransferPath::PAGEABLE_TO_DEVICE);
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, n as u64));
}

// ---------------------------------------------------------------------------------------------
// 5. Element types of 2, 8, 3 and 65 544 bytes by every method
// ---------------------------------------------------------------------------------------------

/// A record larger than a borrowed future's poll budget (32 KiB) and than the smallest staging
/// chunk (4 KiB), with an odd tail so its size is no power of two.
#[derive(Clone, Copy, PartialEq, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Record {
    a: [u64; 4096],
    b: [u64; 4096],
    tag: u64,
}

fn records(len: usize, seed: u64) -> Vec<Record> {
    let mut out = vec![<Record as bytemuck::Zeroable>::zeroed(); len];
    bytemuck::cast_slice_mut::<Record, u8>(&mut out)
        .copy_from_slice(&bytes(len * size_of::<Record>(), seed));
    out
}

fn every_way_round_trips<T: cuweave_memory::Element>(
    manager: &TransferManager,
    context: &Arc<Context>,
    data: &[T],
    offset: usize,
    what: &str,
) {
    let n = data.len();
    let mut device = DeviceBuffer::<T>::zeroed(context, offset + n + 1).unwrap();
    for way in Way::ALL {
        let what = format!("{what}, {way:?}");
        // Zeroed again, so that each way's upload is seen landing, not the previous way's.
        device.fill(T::zeroed()).unwrap();
        upload_by(manager, way, data, &mut device, offset);
        let whole = device.to_vec().unwrap();
        assert_bytes(&whole[offset..offset + n], data, &format!("{what}: up"));
        assert_bytes(&whole[..offset], &vec![T::zeroed(); offset], &what);
        assert_bytes(
            &whole[offset + n..],
            &[T::zeroed()],
            &format!("{what}: past"),
        );
        let mut back = vec![T::zeroed(); n];
        download_by(manager, way, &mut device, offset, &mut back);
        assert_bytes(&back, data, &format!("{what}: down"));
    }
}

/// fp16 activations (`u16`), `f64` with NaN payloads, -0.0, infinities and subnormals, packed
/// RGB pixels (`[u8; 3]`), and 65 544-byte records, by every public way, with the planned
/// staging and with a fixed configuration whose 4 KiB chunks are smaller than one record
/// (interleaved and ordered): byte-exact, nothing written around the destination.
#[test]
fn elements_of_2_8_3_and_65544_bytes_round_trip_by_every_way_and_staging() {
    let gpu = require_gpu!();
    let planned = TransferManager::new().unwrap();
    let threads = cuweave_transfer::host_threads().clamp(1, 3);
    let fixed = |order| {
        TransferManager::with_staging(StagingConfig {
            chunk_bytes: MIN_CHUNK_BYTES,
            depth: 2,
            threads,
            host_copy: HostCopy::Streaming,
            order,
        })
        .unwrap()
    };
    let managers = [
        ("planned", planned),
        ("4 KiB interleaved", fixed(ChunkOrder::Interleaved)),
        ("4 KiB ordered", fixed(ChunkOrder::Ordered)),
    ];
    let halves: Vec<u16> = bytes(2 * (MIB + 1), 1)
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    let mut doubles: Vec<f64> = bytes(8 * 300_001, 2)
        .chunks_exact(8)
        .map(|c| f64::from_bits(u64::from_le_bytes(c.try_into().unwrap())))
        .collect();
    let specials = [
        f64::from_bits(0x7FF0_0000_0000_0001), // signalling NaN payload
        f64::from_bits(0xFFF8_0000_DEAD_BEEF), // negative quiet NaN payload
        -0.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::from_bits(1), // smallest subnormal
        f64::MAX,
    ];
    for (i, special) in specials.iter().enumerate() {
        doubles[i * 40_000 + 7] = *special;
    }
    let pixels: Vec<[u8; 3]> = bytes(3 * 1_000_003, 3)
        .chunks_exact(3)
        .map(|c| [c[0], c[1], c[2]])
        .collect();
    let many_records = records(67, 4);
    let one_record = records(1, 5);
    for (name, manager) in &managers {
        let context = &gpu.context;
        every_way_round_trips(manager, context, &halves, 3, &format!("{name}: u16"));
        every_way_round_trips(manager, context, &doubles, 1, &format!("{name}: f64"));
        every_way_round_trips(manager, context, &pixels, 5, &format!("{name}: [u8; 3]"));
        every_way_round_trips(
            manager,
            context,
            &many_records,
            2,
            &format!("{name}: 67 records"),
        );
        every_way_round_trips(
            manager,
            context,
            &one_record,
            0,
            &format!("{name}: 1 record"),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 6. A pin_memory data loader double-buffering into slots a kernel consumes late
// ---------------------------------------------------------------------------------------------

/// PyTorch's `DataLoader(pin_memory=True)` with `x.to(device, non_blocking=True)` into two
/// device slots used in turn: batch k is written into pinned buffer k % 2 (the host waits for
/// the device to be done with it), moved into slot k % 2 (planned, `DirectCopy`, `ZeroCopy`,
/// or a borrowed future from the pinned slice, in turn), and consumed by a checksum kernel on
/// the compute stream, each behind a 20 ms spin, so the kernels lag many batches behind the
/// host. Moving batch k into its slot must wait for the kernel still to read batch k - 2 there:
/// every batch's checksum must be its own.
#[test]
fn a_pinned_double_buffered_loader_never_overwrites_a_batch_its_kernel_still_reads() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let checksum = kernels.module().function("checksum_u32").unwrap();
    let compute = user_stream(&gpu.context);
    const BATCHES: usize = 16;
    const N: usize = MIB;
    let mut pinned = [
        PinnedBuffer::<u32>::zeroed(&gpu.context, N).unwrap(),
        PinnedBuffer::<u32>::zeroed(&gpu.context, N).unwrap(),
    ];
    let mut slots = [
        DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap(),
        DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap(),
    ];
    let mut sums = DeviceBuffer::<u64>::zeroed(&gpu.context, BATCHES).unwrap();
    let mut expected = Vec::new();
    let n64 = N as u64;
    for k in 0..BATCHES {
        let batch = words(N, 1000 + k as u64);
        expected.push(batch.iter().map(|&w| u64::from(w)).sum::<u64>());
        let (host, slot) = (&mut pinned[k % 2], &mut slots[k % 2]);
        host.as_mut_slice().unwrap().copy_from_slice(&batch);
        match k % 4 {
            0 => drop(manager.transfer(&*host, &mut *slot).unwrap()),
            1 => drop(
                manager
                    .transfer_with(TransferMethod::DirectCopy, &*host, &mut *slot)
                    .unwrap(),
            ),
            2 => match manager.transfer_with(TransferMethod::ZeroCopy, &*host, &mut *slot) {
                Ok(_) => {}
                Err(TransferError::Unsupported { .. }) => {
                    manager.transfer(&*host, &mut *slot).unwrap();
                }
                Err(error) => panic!("batch {k}: {error}"),
            },
            _ => {
                let view = host.as_slice().unwrap();
                block_on(manager.upload_async(&view[..], slot, 0).unwrap()).unwrap();
            }
        }
        kernels.spin_ns(&compute, 20_000_000).unwrap();
        let mut out = sums.slice_mut(k..k + 1).unwrap();
        // SAFETY: checksum_u32(const unsigned* data, size_t n, unsigned long long* out) gets the
        // slot's address and length (declared a read) and one zeroed u64 of `sums` (declared a
        // write); it reads only the slot and adds only to that word.
        unsafe {
            TrackedLaunch::new(&checksum, &compute, grid(N, 1024))
                .read(&slots[k % 2])
                .arg(&n64)
                .write(&mut out)
                .launch()
        }
        .unwrap();
    }
    compute.synchronize().unwrap();
    let got = sums.to_vec().unwrap();
    for k in 0..BATCHES {
        assert_eq!(
            got[k],
            expected[k],
            "batch {k}: its kernel read other bytes than its own (batch {} is {})",
            k + 2,
            expected.get(k + 2).copied().unwrap_or_default()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 7. Owned transfers outliving their manager
// ---------------------------------------------------------------------------------------------

/// A handler makes a manager, starts a 64 MiB owned upload and an owned download, drops the
/// manager (it goes out of scope before the futures are awaited) and awaits them: both must
/// finish with exact bytes and hand both buffers back. Over five rounds the device's free
/// memory and the process's threads come back (the dropped managers' lanes, pools and streams
/// go once the transfers are done).
#[test]
fn owned_transfers_outlive_the_manager_that_started_them() {
    let gpu = require_gpu!();
    let _serial = serial();
    let n = 64 * MIB;
    let data = bytes(n, 77);
    let other = bytes(n, 78);
    let mut baseline = None;
    for round in 0..5 {
        let (up, down): (OwnedTransfer<u8>, OwnedTransfer<u8>) = {
            let manager = TransferManager::new().unwrap();
            let device = DeviceBuffer::<u8>::zeroed(&gpu.context, n + 3).unwrap();
            let source = DeviceBuffer::<u8>::from_slice(&gpu.context, &other).unwrap();
            let up = manager.upload_owned(data.clone(), device, 3);
            let down = manager.download_owned(source, 0, vec![0u8; n]);
            (up, down)
        };
        let up = block_on(up);
        assert_eq!(up.result.unwrap().bytes, n, "round {round}");
        let whole = up.device.to_vec().unwrap();
        assert_eq!(&whole[..3], &[0, 0, 0], "round {round}: before the offset");
        assert!(whole[3..] == data[..], "round {round}: the upload");
        let down = block_on(down);
        assert_eq!(down.result.unwrap().bytes, n, "round {round}");
        assert!(down.host == other, "round {round}: the download");
        drop((whole, up.device, down.device, down.host));
        if round == 1 {
            baseline = Some((
                cuweave_test_support::process_threads(),
                gpu.context.memory_info().unwrap().free,
            ));
        }
    }
    let (threads, free) = baseline.unwrap();
    cuweave_test_support::poll_until(Duration::from_secs(5), || {
        cuweave_test_support::process_threads() <= threads + 2
    });
    let now = cuweave_test_support::process_threads();
    assert!(
        now <= threads + 2,
        "{threads} threads after two rounds, {now} after five"
    );
    let free_now = gpu.context.memory_info().unwrap().free;
    assert!(
        free_now + (128 << 20) >= free,
        "device free memory fell from {free} to {free_now} bytes over three more rounds"
    );
}

// ---------------------------------------------------------------------------------------------
// 8. Hundreds of borrowed futures pending at once
// ---------------------------------------------------------------------------------------------

/// An inference server with 300 requests in flight: 300 borrowed uploads (64 KiB to 370 KiB,
/// into device offset 1) pending at once hold 300 lanes, more than the device has progress-mark
/// words for (512, two per lane), and a pipelined 16 MiB blocking upload and download runs
/// among them on a lane that gets none. Every request's bytes land exactly, the blocking
/// transfer round-trips exactly, and once all is done at most `MAX_IDLE_LANES` lanes stay idle
/// and the mark words and threads are back.
#[test]
fn three_hundred_pending_borrowed_uploads_and_a_pipelined_transfer_among_them_are_exact() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    // Open the device and warm the workers.
    let warm = bytes(4 * MIB, 1);
    let mut scratch = DeviceBuffer::<u8>::zeroed(&gpu.context, 4 * MIB).unwrap();
    manager.transfer(&warm, &mut scratch).unwrap();
    let marks_before = manager.free_mark_words(0);
    let threads_before = cuweave_test_support::process_threads();
    const PENDING: usize = 300;
    let sources: Vec<Vec<u8>> = (0..PENDING)
        .map(|i| bytes(64 * KIB + 1021 * i + 1, i as u64))
        .collect();
    let mut devices: Vec<DeviceBuffer<u8>> = sources
        .iter()
        .map(|s| DeviceBuffer::<u8>::zeroed(&gpu.context, s.len() + 2).unwrap())
        .collect();
    let big = bytes(16 * MIB + 5, 2);
    let mut big_device = DeviceBuffer::<u8>::zeroed(&gpu.context, big.len()).unwrap();
    let mut big_back = vec![0u8; big.len()];
    {
        let mut futures: Vec<AsyncTransfer<'_, u8>> = sources
            .iter()
            .zip(devices.iter_mut())
            .map(|(source, device)| manager.upload_async(source, device, 1).unwrap())
            .collect();
        // A few polls each: every one holds its lane and starts its copy.
        for future in &mut futures {
            if let Some(outcome) = poll_n(future, 3) {
                outcome.unwrap();
            }
        }
        manager.transfer(&big, &mut big_device).unwrap();
        manager.transfer(&big_device, &mut big_back).unwrap();
        assert!(big_back == big, "the pipelined transfer among 300 pending");
        for (i, outcome) in join_all(&mut futures).into_iter().enumerate() {
            let report = outcome.unwrap_or_else(|e| panic!("request {i}: {e}"));
            assert_eq!(report.bytes, sources[i].len(), "request {i}");
        }
    }
    for (i, (source, device)) in sources.iter().zip(&devices).enumerate() {
        let whole = device.to_vec().unwrap();
        assert_eq!(whole[0], 0, "request {i}: byte before");
        assert_eq!(whole[whole.len() - 1], 0, "request {i}: byte after");
        assert!(whole[1..1 + source.len()] == source[..], "request {i}");
    }
    assert!(manager.idle_lanes(0) <= MAX_IDLE_LANES);
    assert!(
        manager.free_mark_words(0) + 2 * MAX_IDLE_LANES >= marks_before,
        "mark words: {} free before the burst, {} after",
        marks_before,
        manager.free_mark_words(0)
    );
    cuweave_test_support::poll_until(Duration::from_secs(5), || {
        cuweave_test_support::process_threads() <= threads_before + 2
    });
    assert!(cuweave_test_support::process_threads() <= threads_before + 2);
    assert_eq!(
        counted(&manager, TransferPath::PAGEABLE_TO_DEVICE).0,
        PENDING as u64 + 2
    );
}

// ---------------------------------------------------------------------------------------------
// 9. Host slices of pinned and managed memory as plain host memory; pool memory on a busy stream
// ---------------------------------------------------------------------------------------------

/// A PyTorch user's pinned tensor reaches the manager as a plain slice (`&pinned[..]`), and a
/// managed tensor's host view too: both are pageable host memory to the manager (`Source::Host`,
/// `Destination::Host`), read and written by the staging workers on other threads, by every
/// public way, at odd sizes and offsets. Byte-exact both ways.
#[test]
fn host_slices_of_pinned_and_managed_memory_move_as_plain_host_memory() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let managed_ok = gpu.device.capabilities().unwrap().concurrent_managed_access;
    for n in [4097usize, 2 * MIB + 3, 9 * MIB + 1] {
        let data = bytes(n, n as u64);
        let pinned_in = PinnedBuffer::from_slice(&gpu.context, &data).unwrap();
        let mut pinned_out = PinnedBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
        let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n + 7).unwrap();
        for way in Way::ALL {
            let what = format!("{way:?}, {n} bytes, pinned host slices");
            device.fill(0).unwrap();
            {
                let src = pinned_in.as_slice().unwrap();
                upload_by(&manager, way, &src[..], &mut device, 7);
            }
            assert_bytes(
                &device.to_vec().unwrap()[7..7 + n],
                &data,
                &format!("{what}: up"),
            );
            {
                let mut dst = pinned_out.as_mut_slice().unwrap();
                dst.fill(0);
                download_by(&manager, way, &mut device, 7, &mut dst[..]);
            }
            assert_bytes(&pinned_out.as_slice().unwrap()[..], &data, &what);
        }
        if !managed_ok {
            continue;
        }
        let managed_in = UnifiedBuffer::from_slice(&gpu.context, &data).unwrap();
        let mut managed_out = UnifiedBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
        for way in Way::ALL {
            let what = format!("{way:?}, {n} bytes, managed host slices");
            device.fill(0).unwrap();
            {
                let src = managed_in.as_slice().unwrap();
                upload_by(&manager, way, &src[..], &mut device, 3);
            }
            assert_bytes(
                &device.to_vec().unwrap()[3..3 + n],
                &data,
                &format!("{what}: up"),
            );
            {
                let mut dst = managed_out.as_mut_slice().unwrap();
                dst.fill(0);
                download_by(&manager, way, &mut device, 3, &mut dst[..]);
            }
            assert_bytes(&managed_out.to_vec().unwrap(), &data, &what);
        }
    }
    if !managed_ok {
        skip(
            "host_slices_of_pinned_and_managed_memory_move_as_plain_host_memory",
            "the managed part: no concurrent managed access",
        );
    }
}

/// RMM's `device_buffer(size, stream, mr)` with a stream-ordered pool: on the user's stream, a
/// buffer X is filled, a spin runs, a device copy reads X into Z, X is dropped and a buffer Y is
/// allocated from the pool on that stream (most likely X's memory, reused in the stream's
/// order). An upload into Y by every public way (blocking, forced, borrowed, owned, view) must
/// land only where Y exists, after the spin and the copy: Z holds X's contents, Y the upload.
#[test]
fn uploads_into_pool_memory_allocated_on_a_busy_stream_wait_for_the_allocation() {
    let gpu = require_gpu!();
    let _serial = serial();
    let resource: Arc<dyn MemoryResource> = match AsyncPoolResource::new(&gpu.context) {
        Ok(resource) => Arc::new(resource),
        Err(error) => {
            skip(
                "uploads_into_pool_memory_allocated_on_a_busy_stream_wait_for_the_allocation",
                &format!("no stream-ordered pool: {error}"),
            );
            return;
        }
    };
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = user_stream(&gpu.context);
    const N: usize = MIB + 7;
    const OLD: u32 = 0x0BAD_F00D;
    for (i, way) in Way::ALL.into_iter().enumerate() {
        let mut x = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &stream).unwrap();
        x.fill_async(OLD, &stream).unwrap();
        let mut z = DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap();
        kernels.spin_ns(&stream, KERNEL_NS).unwrap();
        z.copy_from_async(&x, &stream).unwrap();
        let reused = x.device_ptr();
        drop(x);
        let mut y = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &stream).unwrap();
        eprintln!(
            "{way:?}: the pool {} X's memory for Y",
            if y.device_ptr() == reused {
                "reused"
            } else {
                "did not reuse"
            }
        );
        let new = words(N, 500 + i as u64);
        upload_by(&manager, way, &new, &mut y, 0);
        stream.synchronize().unwrap();
        assert_all_u32(
            &z.to_vec().unwrap(),
            OLD,
            &format!("{way:?}: the copy of X queued before Y existed"),
        );
        assert_bytes(&y.to_vec().unwrap(), &new, &format!("{way:?}: Y"));
    }
}

/// Compile-time: what an async server needs of the futures (moved to executor threads).
#[allow(dead_code)]
fn futures_are_send() {
    fn send<T: Send>() {}
    send::<AsyncTransfer<'static, u8>>();
    send::<OwnedTransfer<u8>>();
}
