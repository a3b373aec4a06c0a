//! Third-look user programs for the transfer manager, written as PyTorch users
//! (`tensor.to(device, non_blocking=True)`, `pin_memory()`, `torch.cuda.graph`), data loaders and
//! async inference servers write them, on what the crate's other GPU tests leave out:
//!
//! - a transfer into (or out of) one half of a device buffer while the user's kernel still reads
//!   (or is about to write) the other half: disjoint ranges must not wait for each other, by any
//!   public way, and every byte must be exact;
//! - futures handed to another executor thread at every poll (tokio's work stealing): each poll's
//!   waker, never an earlier one, must be woken, and a future dropped on yet another thread
//!   mid-flight leaves its buffers reusable;
//! - `recalibrate` on one thread (and `calibrate` on another manager) while four threads
//!   transfer: every byte exact, and the manager's statistics count the threads' transfers only;
//! - calibration tables with different methods and staging configurations swapped (and the cache
//!   cleared) under running transfers;
//! - ten thousand small transfers by every way on one manager: lanes, mark words, threads,
//!   pinned staging memory, device and resident memory stay flat, statistics exact;
//! - a host registration that outlives the manager that made it and serves another manager on
//!   another thread;
//! - a CUDA graph captured on one thread (thread-local and global capture modes) while a loader
//!   thread transfers by every way;
//! - device-to-device and device/unified copies ordered after a late writer of the source and a
//!   reader of the destination, on two different user streams;
//! - refused requests (bad ranges, impossible methods, unserved devices) answering at once while
//!   the GPU is still busy with their buffers.
//!
//! Every test skips without a GPU. Every test takes the binary's serial guard: several race
//! kernels, measure process-wide figures, or begin a global capture, which would disturb any
//! other test of this binary running at the same time.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use cuweave_driver::{CaptureMode, Context, DriverError, GraphError, InstantiateOptions, Stream};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip, skip_under_sanitizer};
use cuweave_transfer::{
    CalibrationTable, ChunkOrder, Destination, HostCopy, Location, MARKED_STREAMS, MAX_IDLE_LANES,
    MIN_CHUNK_BYTES, PlanReason, SizeClass, Source, StagingChoice, StagingConfig, TransferError,
    TransferManager, TransferMethod, TransferPath, TransferReport,
};

mod common;
use common::{
    Way, assert_all_u32, assert_bytes, block_on, bytes, late_fill, user_stream, watch, words,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// How long a user's kernel keeps reading (or spins before it writes) in the ordering probes:
/// far longer than the host needs to queue a transfer and let a wrongly ordered copy land, and
/// far longer than a transfer of a few MiB that does not wait takes.
const KERNEL_NS: u64 = 50_000_000;

/// How long a thread that polled a future and got `Pending` waits for that poll's waker before
/// the wake-up counts as lost (the transfers woken here land in milliseconds).
const LOST_WAKE: Duration = Duration::from_secs(2);

/// What device memory holds before a probe's transfer or kernel changes it.
const OLD: u32 = 0x0101_0101;
/// What a user's kernel writes in the probes.
const WRITTEN: u32 = 0x7E57_AB1E;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Completed transfers and their bytes per path, as a test counts them.
type Tally = BTreeMap<TransferPath, (u64, u64)>;

fn bump(tally: &mut Tally, path: TransferPath, bytes: usize) {
    let slot = tally.entry(path).or_default();
    slot.0 += 1;
    slot.1 += bytes as u64;
}

fn merge(into: &mut Tally, other: &Tally) {
    for (&path, &(count, bytes)) in other {
        let slot = into.entry(path).or_default();
        slot.0 += count;
        slot.1 += bytes;
    }
}

/// The manager's completed transfers and bytes per path, over every size class (paths with
/// nothing completed left out).
fn counted(manager: &TransferManager) -> Tally {
    let mut tally = Tally::new();
    for (path, _, stats) in manager.stats().snapshot() {
        if stats.count > 0 {
            let slot = tally.entry(path).or_default();
            slot.0 += stats.count;
            slot.1 += stats.bytes;
        }
    }
    tally
}

/// Failed transfers over every path and size class.
fn failures(manager: &TransferManager) -> u64 {
    manager
        .stats()
        .snapshot()
        .iter()
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
    let bytes = size_of_val(src);
    let moved = match way {
        Way::Planned => {
            manager
                .transfer(src, Destination::device(device, offset))
                .unwrap()
                .bytes
        }
        Way::Staged | Way::Direct => {
            manager
                .transfer_with(
                    way.forced().unwrap(),
                    src,
                    Destination::device(device, offset),
                )
                .unwrap()
                .bytes
        }
        Way::Borrowed => {
            block_on(manager.upload_async(src, device, offset).unwrap())
                .unwrap()
                .bytes
        }
        Way::Owned => {
            let placeholder = DeviceBuffer::<T>::new(&Arc::clone(device.context()), 1).unwrap();
            let taken = std::mem::replace(device, placeholder);
            let owned = block_on(manager.upload_owned(src.to_vec(), taken, offset));
            *device = owned.device;
            owned.result.unwrap().bytes
        }
        Way::View => {
            let view = device.slice_mut(offset..offset + n).unwrap();
            manager
                .transfer(src, Destination::view(view))
                .unwrap()
                .bytes
        }
    };
    assert_eq!(moved, bytes, "{way:?} upload: bytes reported");
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
    let bytes = size_of_val(dst);
    let moved = match way {
        Way::Planned => {
            manager
                .transfer(Source::device(device, offset, n), &mut *dst)
                .unwrap()
                .bytes
        }
        Way::Staged | Way::Direct => {
            manager
                .transfer_with(
                    way.forced().unwrap(),
                    Source::device(device, offset, n),
                    &mut *dst,
                )
                .unwrap()
                .bytes
        }
        Way::Borrowed => {
            block_on(manager.download_async(device, offset, dst).unwrap())
                .unwrap()
                .bytes
        }
        Way::Owned => {
            let placeholder = DeviceBuffer::<T>::new(&Arc::clone(device.context()), 1).unwrap();
            let taken = std::mem::replace(device, placeholder);
            let owned = block_on(manager.download_owned(taken, offset, vec![T::zeroed(); n]));
            *device = owned.device;
            dst.copy_from_slice(&owned.host);
            owned.result.unwrap().bytes
        }
        Way::View => {
            let view = device.slice(offset..offset + n).unwrap();
            manager
                .transfer(Source::view(view), &mut *dst)
                .unwrap()
                .bytes
        }
    };
    assert_eq!(moved, bytes, "{way:?} download: bytes reported");
}

/// Runs one transfer by `method` (`None`: the planned one).
fn try_by<T: cuweave_memory::Element>(
    manager: &TransferManager,
    method: Option<TransferMethod>,
    src: Source<'_, T>,
    dst: Destination<'_, T>,
) -> Result<TransferReport, TransferError> {
    match method {
        None => manager.transfer(src, dst),
        Some(method) => manager.transfer_with(method, src, dst),
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Disjoint halves of one buffer: a transfer and the user's kernel overlap
// ---------------------------------------------------------------------------------------------

/// A model server keeps a request's input and output in two halves of one device tensor. The
/// user's kernel still reads the first half (declared a read of that view, for 50 ms) when the
/// next input is uploaded into the second half, by every public way (planned, forced
/// `HostStaged` and `DirectCopy`, borrowed and owned futures, a `slice_mut` view); then a kernel
/// writes the first half after a 50 ms spin (declared a write of that view) while the second
/// half is downloaded by the same way. Buffers are tracked per range, so neither transfer may
/// wait for a kernel that uses only the other half: each must return while the kernel still
/// runs. And the bytes: the reader sees its half unchanged, the upload lands exactly in its
/// half, the download returns the second half as it was, and the kernel's write lands in its
/// half only. At a one-block size (1000 `u32`) and a pipelined one (1 MiB + 12 bytes).
#[test]
fn transfers_into_one_half_of_a_buffer_overlap_a_kernel_using_the_other_half_by_every_way() {
    const NAME: &str =
        "transfers_into_one_half_of_a_buffer_overlap_a_kernel_using_the_other_half_by_every_way";
    let gpu = require_gpu!();
    if skip_under_sanitizer(NAME, "needs a copy to run while a kernel runs") {
        return;
    }
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let watcher = kernels.module().function("watch_u32").unwrap();
    let fill = kernels.module().function("fill_u32").unwrap();
    let stream = user_stream(&gpu.context);
    let mut waited = Vec::new();
    for half in [1000usize, MIB / 4 + 3] {
        let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, 2 * half).unwrap();
        let mut mismatches = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
        // Every way once at this size first: its pinned blocks, lanes, workers and the
        // placeholder the owned way swaps in are made here, not while the kernel runs.
        let warm = words(half, 0);
        let mut out = vec![0u32; half];
        for way in Way::ALL {
            upload_by(&manager, way, &warm, &mut device, half);
            download_by(&manager, way, &mut device, half, &mut out);
            assert_bytes(&out, &warm, &format!("{way:?}: warm-up round trip"));
        }
        for (i, way) in Way::ALL.into_iter().enumerate() {
            let what = format!("{way:?}, halves of {half} u32");
            let new = words(half, (half * 7 + i) as u64);
            device.fill(OLD).unwrap();
            mismatches.fill(0).unwrap();
            watch(
                &watcher,
                &stream,
                &device.slice(..half).unwrap(),
                OLD,
                KERNEL_NS,
                &mut mismatches,
            );
            let started = Instant::now();
            upload_by(&manager, way, &new, &mut device, half);
            let took = started.elapsed();
            if stream.query().unwrap() {
                waited.push(format!(
                    "{what}: the upload returned after the reader of the other half ({took:?})"
                ));
            }
            stream.synchronize().unwrap();
            assert_eq!(
                mismatches.to_vec().unwrap(),
                [0],
                "{what}: the upload changed the half the kernel was reading"
            );
            let whole = device.to_vec().unwrap();
            assert_all_u32(&whole[..half], OLD, &format!("{what}: the kernel's half"));
            assert_bytes(&whole[half..], &new, &format!("{what}: the upload"));

            late_fill(
                &kernels,
                &fill,
                &stream,
                &mut device.slice_mut(..half).unwrap(),
                WRITTEN,
                KERNEL_NS,
            );
            let mut back = vec![0u32; half];
            let started = Instant::now();
            download_by(&manager, way, &mut device, half, &mut back);
            let took = started.elapsed();
            if stream.query().unwrap() {
                waited.push(format!(
                    "{what}: the download returned after the late writer of the other half \
                     ({took:?})"
                ));
            }
            assert_bytes(&back, &new, &format!("{what}: the download"));
            stream.synchronize().unwrap();
            let whole = device.to_vec().unwrap();
            assert_all_u32(
                &whole[..half],
                WRITTEN,
                &format!("{what}: the kernel's write"),
            );
            assert_bytes(
                &whole[half..],
                &new,
                &format!("{what}: the downloaded half after the kernel's write"),
            );
        }
    }
    assert!(
        waited.is_empty(),
        "transfers waited for kernels that use only the other half of their buffer (the kernel \
         runs {} ms): {waited:#?}",
        KERNEL_NS / 1_000_000
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Futures handed to another executor thread at every poll
// ---------------------------------------------------------------------------------------------

/// The waker of one poll on one thread: records that it was woken and unparks that thread.
struct HopWaker {
    woken: AtomicBool,
    thread: std::thread::Thread,
}

impl Wake for HopWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        self.thread.unpark();
    }
}

/// Polls `future` once on a new thread, with that thread's own waker. `Ok` with its output when
/// it finished; otherwise that thread waits (at most [`LOST_WAKE`]) until the waker of *this*
/// poll is woken, as a work-stealing executor parks a worker until its task's waker fires, and
/// hands the future back. Panics when the wake never comes.
fn poll_on_a_new_thread<F>(future: F, what: &str, hop: usize) -> Result<F::Output, F>
where
    F: Future + Unpin + Send,
    F::Output: Send,
{
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                let mut future = future;
                let hop_waker = Arc::new(HopWaker {
                    woken: AtomicBool::new(false),
                    thread: std::thread::current(),
                });
                let waker = Waker::from(Arc::clone(&hop_waker));
                let mut cx = TaskContext::from_waker(&waker);
                if let Poll::Ready(output) = Pin::new(&mut future).poll(&mut cx) {
                    return Ok(output);
                }
                let deadline = Instant::now() + LOST_WAKE;
                while !hop_waker.woken.load(Ordering::SeqCst) {
                    let left = deadline.saturating_duration_since(Instant::now());
                    assert!(
                        !left.is_zero(),
                        "{what}: poll {hop} returned Pending on a new thread and its waker was \
                         not woken within {LOST_WAKE:?} (the wake went to an earlier poll's \
                         waker on another thread, or was lost)"
                    );
                    std::thread::park_timeout(left);
                }
                Err(future)
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Polls `future` to completion, each poll on a thread of its own; its output and the polls.
fn drive_hopping<F>(mut future: F, what: &str) -> (F::Output, usize)
where
    F: Future + Unpin + Send,
    F::Output: Send,
{
    for hop in 1..=100_000 {
        match poll_on_a_new_thread(future, what, hop) {
            Ok(output) => return (output, hop),
            Err(pending) => future = pending,
        }
    }
    panic!("{what}: not finished after 100 000 polls");
}

/// tokio's multi-threaded runtime moves a task to whichever worker steals it: a transfer future
/// is polled on one thread, then on another, each poll with that thread's waker. A borrowed
/// upload and download of 4 MiB + 5 bytes (hundreds of polls: waiting for blocks, copying,
/// queueing, waiting for marks) and an owned upload and download are each polled on a new
/// thread every time; after every `Pending`, the waker of that very poll must be woken (within
/// 2 s; the chunks land in milliseconds). The bytes land exactly, nothing around the range is
/// written, each transfer is counted once. A borrowed upload polled on five threads and then
/// dropped mid-flight on a sixth leaves the buffer reusable at once.
#[test]
fn futures_moved_between_executor_threads_at_every_poll_wake_the_thread_that_polled_last() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let n = 4 * MIB + 5;
    let data = bytes(n, 21);
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n + 9).unwrap();

    let up = manager.upload_async(&data, &mut device, 7).unwrap();
    let (report, hops) = drive_hopping(up, "borrowed upload");
    assert_eq!(report.unwrap().bytes, n);
    assert!(hops > 2, "the borrowed upload finished in {hops} polls");
    let whole = device.to_vec().unwrap();
    assert!(whole[..7].iter().all(|&b| b == 0), "before the range");
    assert_bytes(&whole[7..7 + n], &data, "borrowed upload");
    assert!(whole[7 + n..].iter().all(|&b| b == 0), "after the range");

    let mut back = vec![0u8; n];
    let down = manager.download_async(&device, 7, &mut back).unwrap();
    let (report, hops) = drive_hopping(down, "borrowed download");
    assert_eq!(report.unwrap().bytes, n);
    assert!(hops > 2, "the borrowed download finished in {hops} polls");
    assert_bytes(&back, &data, "borrowed download");

    let other = bytes(n, 22);
    let (owned, _) = drive_hopping(
        manager.upload_owned(other.clone(), device, 1),
        "owned upload",
    );
    assert_eq!(owned.result.unwrap().bytes, n);
    let mut device = owned.device;
    assert_bytes(&device.to_vec().unwrap()[1..1 + n], &other, "owned upload");
    let (owned, _) = drive_hopping(
        manager.download_owned(device, 1, vec![0u8; n]),
        "owned download",
    );
    assert_eq!(owned.result.unwrap().bytes, n);
    assert_bytes(&owned.host, &other, "owned download");
    device = owned.device;

    // Cancelled on another thread than any that polled it.
    let dropped = bytes(n, 23);
    let mut finished_early = 0u64;
    {
        let mut pending = Some(manager.upload_async(&dropped, &mut device, 0).unwrap());
        for hop in 1..=5 {
            let future = pending.take().unwrap();
            match poll_on_a_new_thread(future, "upload dropped mid-flight", hop) {
                Ok(result) => {
                    assert_eq!(result.unwrap().bytes, n);
                    finished_early = 1;
                    break;
                }
                Err(future) => pending = Some(future),
            }
        }
        if let Some(future) = pending {
            std::thread::scope(|scope| {
                scope.spawn(move || drop(future));
            });
        }
    }
    let last = bytes(n, 24);
    manager.transfer(&last, &mut device).unwrap();
    assert_bytes(
        &device.to_vec().unwrap()[..n],
        &last,
        "an upload after a future dropped on another thread",
    );

    let tally = counted(&manager);
    let up = 3 + finished_early;
    assert_eq!(
        tally.get(&TransferPath::PAGEABLE_TO_DEVICE).copied(),
        Some((up, up * n as u64)),
        "uploads counted: borrowed, owned, blocking{}",
        if finished_early == 1 {
            ", and the one that finished before it was dropped"
        } else {
            ""
        }
    );
    assert_eq!(
        tally.get(&TransferPath::DEVICE_TO_PAGEABLE).copied(),
        Some((2, 2 * n as u64)),
        "downloads counted"
    );
    assert_eq!(failures(&manager), 0);
}

// ---------------------------------------------------------------------------------------------
// 3. Recalibrating while other threads transfer
// ---------------------------------------------------------------------------------------------

/// A server calls `recalibrate()` at run time (after a driver update, or on a schedule) while
/// four request threads keep moving data through the same manager (planned, borrowed and owned
/// pageable round trips, and pinned round trips, 1 byte to 17 MiB), and a second manager calls
/// `calibrate()` at the same time. Every request's bytes are exact; the second manager's table
/// covers device 0 (it waited for, or reused, a complete measurement); the manager uses the
/// table it measured, and plans from it (measured here); and its statistics equal, per path, the
/// requests' transfers exactly: calibration's own transfers, run by the same manager meanwhile,
/// are not among them, and nothing failed.
#[test]
fn recalibrating_while_four_threads_transfer_moves_every_byte_and_counts_only_their_transfers() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ordinal = gpu.device.ordinal();
    let manager = TransferManager::for_devices(&[ordinal]).unwrap();
    let sizes = [
        1usize,
        4097,
        64 * KIB + 1,
        MIB + 3,
        4 * MIB + 1,
        17 * MIB + 5,
    ];
    let most = sizes[sizes.len() - 1];
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let (table, other, results) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..4usize)
            .map(|t| {
                let (manager, context, stop) = (&manager, &gpu.context, &stop);
                scope.spawn(move || {
                    let source = bytes(most + 8, 300 + t as u64);
                    let mut device = DeviceBuffer::<u8>::zeroed(context, most + 8).unwrap();
                    let mut pinned = PinnedBuffer::<u8>::zeroed(context, most + 8).unwrap();
                    let mut tally = Tally::new();
                    let mut round = 0usize;
                    while round < 6 || !stop.load(Ordering::Acquire) {
                        let n = sizes[(t + round) % sizes.len()];
                        let start = round % 8;
                        let src = &source[start..start + n];
                        let offset = t + 1;
                        let what = format!("thread {t}, round {round}: {n} bytes");
                        if round % 4 < 3 {
                            let way = [Way::Planned, Way::Borrowed, Way::Owned][round % 4];
                            upload_by(manager, way, src, &mut device, offset);
                            let mut back = vec![0u8; n];
                            download_by(manager, way, &mut device, offset, &mut back);
                            assert_bytes(&back, src, &format!("{what} by {way:?}"));
                            bump(&mut tally, TransferPath::PAGEABLE_TO_DEVICE, n);
                            bump(&mut tally, TransferPath::DEVICE_TO_PAGEABLE, n);
                        } else {
                            pinned.as_mut_slice().unwrap()[..n].copy_from_slice(src);
                            manager
                                .transfer(
                                    Source::pinned(&pinned, 0, n),
                                    Destination::device(&mut device, offset),
                                )
                                .unwrap();
                            pinned.as_mut_slice().unwrap().fill(0);
                            manager
                                .transfer(
                                    Source::device(&device, offset, n),
                                    Destination::pinned(&mut pinned, 0),
                                )
                                .unwrap();
                            assert_bytes(
                                &pinned.as_slice().unwrap()[..n],
                                src,
                                &format!("{what} through pinned memory"),
                            );
                            bump(&mut tally, TransferPath::PINNED_TO_DEVICE, n);
                            bump(&mut tally, TransferPath::DEVICE_TO_PINNED, n);
                        }
                        round += 1;
                    }
                    (tally, round)
                })
            })
            .collect();
        let other = scope.spawn(|| {
            TransferManager::for_devices(&[ordinal])
                .unwrap()
                .calibrate()
        });
        let table = manager.recalibrate();
        stop.store(true, Ordering::Release);
        let results: Vec<(Tally, usize)> = workers
            .into_iter()
            .map(|worker| worker.join().unwrap())
            .collect();
        (table, other.join().unwrap(), results)
    });
    eprintln!(
        "recalibrated in {:?} under {} request rounds",
        started.elapsed(),
        results.iter().map(|(_, rounds)| rounds).sum::<usize>()
    );
    let table = table.unwrap();
    let other = other.unwrap();
    let covers = |t: &CalibrationTable| {
        t.entries
            .iter()
            .any(|e| e.path == TransferPath::PAGEABLE_TO_DEVICE && e.dst_device == Some(ordinal))
    };
    assert!(covers(&table), "the recalibration measured no uploads");
    assert!(
        covers(&other),
        "a calibrate() that ran during the recalibration returned a table without device \
         {ordinal}'s uploads"
    );
    assert_eq!(
        manager.calibration(),
        table,
        "the manager uses the table it measured"
    );
    let plan = manager.plan(Location::PageableHost, Location::Device(ordinal), 4 * MIB);
    assert!(
        matches!(plan.reason, PlanReason::Calibrated { .. }) && plan.measured_on.is_none(),
        "after recalibrating: {plan}"
    );
    let mut expected = Tally::new();
    for (tally, _) in &results {
        merge(&mut expected, tally);
    }
    assert_eq!(
        counted(&manager),
        expected,
        "the statistics per path (count, bytes) against the requests' own transfers"
    );
    assert_eq!(failures(&manager), 0);
}

// ---------------------------------------------------------------------------------------------
// 4. Calibration tables swapped under running transfers
// ---------------------------------------------------------------------------------------------

/// A table of this machine in which `fast` beats the other pageable method on both pageable
/// paths at every size class, with `staging` chosen for pipelined copies on `device`.
fn table_choosing(
    manager: &TransferManager,
    device: usize,
    fast: TransferMethod,
    staging: Option<StagingConfig>,
) -> CalibrationTable {
    let machine = manager.machine();
    let mut table = CalibrationTable {
        device: machine.first().cloned(),
        devices: machine,
        ..CalibrationTable::default()
    };
    let slow = if fast == TransferMethod::HostStaged {
        TransferMethod::DirectCopy
    } else {
        TransferMethod::HostStaged
    };
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        for class in SizeClass::ALL {
            table.record(path, class, fast, 30.0);
            table.record(path, class, slow, 10.0);
        }
        if let Some(config) = staging {
            for bytes in [64 * KIB, MIB, 4 * MIB, 16 * MIB] {
                table.record_staging(StagingChoice {
                    path,
                    device,
                    bytes,
                    config,
                    gbps: 30.0,
                });
            }
        }
    }
    table
}

/// A service reloads its calibration (`set_calibration` from a file, `clear_cache` on memory
/// pressure) while requests run. One thread keeps swapping three tables of this machine (the
/// pipeline with 4 KiB ordered chunks on two threads; the pipeline with 2 MiB interleaved chunks
/// on up to four; `DirectCopy`) and clearing the cache; three request threads move 3 bytes to
/// 9 MiB up and down by the planned method at odd offsets. Lanes are shared by transfers
/// planned under different configurations. Every byte is exact, both methods ran, nothing
/// failed, the statistics equal the requests', and at most `MAX_IDLE_LANES` lanes stay idle.
/// Once quiet, each table decides the plan, the staging configuration and the transfer that
/// runs; after `clear_cache` the defaults decide again.
#[test]
fn swapping_calibration_tables_under_running_transfers_changes_methods_but_no_byte() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ordinal = gpu.device.ordinal();
    let manager = TransferManager::for_devices(&[ordinal]).unwrap();
    let threads = cuweave_transfer::host_threads();
    let tiny_chunks = StagingConfig {
        chunk_bytes: MIN_CHUNK_BYTES,
        depth: 2,
        threads: threads.clamp(1, 2),
        host_copy: HostCopy::Cached,
        order: ChunkOrder::Ordered,
    };
    let wide_chunks = StagingConfig {
        chunk_bytes: 2 * MIB,
        depth: 3,
        threads: threads.clamp(1, 4),
        host_copy: HostCopy::Streaming,
        order: ChunkOrder::Interleaved,
    };
    let tables = [
        table_choosing(
            &manager,
            ordinal,
            TransferMethod::HostStaged,
            Some(tiny_chunks),
        ),
        table_choosing(
            &manager,
            ordinal,
            TransferMethod::HostStaged,
            Some(wide_chunks),
        ),
        table_choosing(&manager, ordinal, TransferMethod::DirectCopy, None),
    ];
    let sizes = [
        3usize,
        4097,
        64 * KIB + 1,
        MIB + 3,
        3 * MIB + 7,
        9 * MIB + 1,
    ];
    let most = sizes[sizes.len() - 1];
    let stop = AtomicBool::new(false);
    let swaps = AtomicUsize::new(0);
    // Transfers finished so far. Each state stays until one more transfer has finished: the
    // states take very different times to set (`clear_cache` trims the pinned pool after it
    // forgets the table, `set_calibration` reads the device names first), so swapping at the
    // swapper's own pace gave the table set just before `clear_cache` almost no time at all.
    let finished = AtomicUsize::new(0);
    let results: Vec<(Tally, BTreeSet<TransferMethod>)> = std::thread::scope(|scope| {
        let swapper = scope.spawn(|| {
            let mut k = 0usize;
            while !stop.load(Ordering::Acquire) {
                if k % 4 == 3 {
                    manager.clear_cache();
                } else {
                    let mismatch = manager.set_calibration(tables[k % 4].clone());
                    assert!(mismatch.is_none(), "a table of this machine: {mismatch:?}");
                }
                k += 1;
                swaps.store(k, Ordering::Relaxed);
                let seen = finished.load(Ordering::Acquire);
                while finished.load(Ordering::Acquire) == seen && !stop.load(Ordering::Acquire) {
                    std::thread::yield_now();
                }
            }
        });
        let workers: Vec<_> = (0..3usize)
            .map(|t| {
                let (manager, context, finished) = (&manager, &gpu.context, &finished);
                scope.spawn(move || {
                    let source = bytes(most + 8, 700 + t as u64);
                    let mut device = DeviceBuffer::<u8>::zeroed(context, most + 8).unwrap();
                    let mut tally = Tally::new();
                    let mut methods = BTreeSet::new();
                    for round in 0..18 {
                        let n = sizes[(t * 5 + round) % sizes.len()];
                        let start = (t + round) % 5;
                        let src = &source[start..start + n];
                        let offset = t + 2;
                        let up = manager
                            .transfer(src, Destination::device(&mut device, offset))
                            .unwrap();
                        let mut back = vec![0u8; n];
                        let down = manager
                            .transfer(Source::device(&device, offset, n), &mut back)
                            .unwrap();
                        finished.fetch_add(1, Ordering::Release);
                        assert_bytes(
                            &back,
                            src,
                            &format!(
                                "thread {t}, round {round}: {n} bytes up by {} and down by {}",
                                up.plan.method, down.plan.method
                            ),
                        );
                        methods.insert(up.plan.method);
                        methods.insert(down.plan.method);
                        bump(&mut tally, TransferPath::PAGEABLE_TO_DEVICE, n);
                        bump(&mut tally, TransferPath::DEVICE_TO_PAGEABLE, n);
                    }
                    (tally, methods)
                })
            })
            .collect();
        let results = workers
            .into_iter()
            .map(|worker| worker.join().unwrap())
            .collect();
        stop.store(true, Ordering::Release);
        swapper.join().unwrap();
        results
    });
    let swaps = swaps.load(Ordering::Relaxed);
    assert!(
        swaps >= 4,
        "only {swaps} swaps happened during the requests"
    );
    let mut expected = Tally::new();
    let mut methods = BTreeSet::new();
    for (tally, seen) in &results {
        merge(&mut expected, tally);
        methods.extend(seen.iter().copied());
    }
    assert!(
        methods.contains(&TransferMethod::HostStaged)
            && methods.contains(&TransferMethod::DirectCopy),
        "the swapped tables decided the running transfers' methods: only {methods:?} ran over \
         {swaps} swaps"
    );
    assert_eq!(counted(&manager), expected, "statistics per path");
    assert_eq!(failures(&manager), 0);
    assert!(manager.idle_lanes(ordinal) <= MAX_IDLE_LANES);

    let n = 3 * MIB + 7;
    let data = bytes(n, 99);
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    for (table, method, staging) in [
        (&tables[0], TransferMethod::HostStaged, Some(tiny_chunks)),
        (&tables[1], TransferMethod::HostStaged, Some(wide_chunks)),
        (&tables[2], TransferMethod::DirectCopy, None),
    ] {
        assert!(manager.set_calibration(table.clone()).is_none());
        assert_eq!(manager.calibration(), *table);
        let plan = manager.plan(Location::PageableHost, Location::Device(ordinal), n);
        assert_eq!(plan.method, method, "{plan}");
        assert!(
            matches!(plan.reason, PlanReason::Calibrated { gbps, .. } if (gbps - 30.0).abs() < 1e-9),
            "{plan}"
        );
        if let Some(config) = staging {
            assert_eq!(
                manager.staging_for(TransferPath::PAGEABLE_TO_DEVICE, ordinal, n),
                config
            );
        }
        let report = manager.transfer(&data, &mut device).unwrap();
        assert_eq!(report.plan.method, method, "{}", report.plan);
        let mut back = vec![0u8; n];
        manager.transfer(&device, &mut back).unwrap();
        assert_bytes(&back, &data, &format!("quiet, by {method}"));
    }
    manager.clear_cache();
    assert!(manager.calibration().is_empty());
    let plan = manager.plan(Location::PageableHost, Location::Device(ordinal), n);
    assert!(
        !matches!(plan.reason, PlanReason::Calibrated { .. }),
        "after clear_cache the defaults decide: {plan}"
    );
}

// ---------------------------------------------------------------------------------------------
// 5. Ten thousand small transfers on one manager
// ---------------------------------------------------------------------------------------------

/// What the long loop measures after its warm-up.
#[cfg(target_os = "linux")]
struct Baseline {
    threads: usize,
    free: usize,
    resident: u64,
    marks: usize,
    pinned: usize,
}

/// A data loader's steady state: 5 000 round trips (10 000 transfers) of 1 byte to 64 KiB, at
/// device offsets 0 to 12 and host slices starting anywhere in a page, cycling through every way
/// (planned, forced `HostStaged` and `DirectCopy`, borrowed and owned futures, views, a pinned
/// buffer by the planned method and by `ZeroCopy` where the device maps host memory, a host
/// registration). Every byte is checked. Between the warm-up (500 round trips) and the end:
/// the pinned staging memory `clear_cache` gives back does not grow past the warm-up's working
/// set (+32 MiB), threads come back, device free memory and resident memory stay flat, at most
/// `MAX_IDLE_LANES` lanes were ever idle, every mark word a lane does not hold is free, and the
/// statistics count each transfer once, per path, with its bytes.
#[test]
#[cfg(target_os = "linux")]
fn ten_thousand_small_transfers_by_every_way_leave_lanes_threads_and_memory_flat() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ordinal = gpu.device.ordinal();
    let context = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let zero_copy = manager
        .facts(Location::PinnedHost(ordinal), Location::Device(ordinal))
        .missing(TransferMethod::ZeroCopy)
        .is_none();
    const MOST: usize = 64 * KIB;
    const ROUND_TRIPS: usize = 5_000;
    const WARM: usize = 500;
    let pool = bytes(MOST + 4096, 5);
    let mut device = DeviceBuffer::<u8>::zeroed(context, MOST + 16).unwrap();
    let mut pinned = PinnedBuffer::<u8>::zeroed(context, MOST + 16).unwrap();
    let mut backing = vec![0u8; MOST + 16];
    let mut registered = manager.register_host(ordinal, &mut backing).unwrap();
    let mut back = vec![0u8; MOST];
    let mut tally = Tally::new();
    let mut baseline = None;
    let mut most_idle = 0;
    let started = Instant::now();
    for i in 0..ROUND_TRIPS {
        let n = 1 + (i * 7919) % MOST;
        let start = (i * 31) % 4096;
        let offset = i % 13;
        let src = &pool[start..start + n];
        let way = i % 9;
        let what = format!("round trip {i}: {n} bytes at device offset {offset}, way {way}");
        match way {
            0..=5 => {
                let way = Way::ALL[way];
                upload_by(&manager, way, src, &mut device, offset);
                download_by(&manager, way, &mut device, offset, &mut back[..n]);
                assert_bytes(&back[..n], src, &format!("{what} ({way:?})"));
                bump(&mut tally, TransferPath::PAGEABLE_TO_DEVICE, n);
                bump(&mut tally, TransferPath::DEVICE_TO_PAGEABLE, n);
            }
            6 | 7 => {
                let method = (way == 7 && zero_copy).then_some(TransferMethod::ZeroCopy);
                pinned.as_mut_slice().unwrap()[offset..offset + n].copy_from_slice(src);
                try_by(
                    &manager,
                    method,
                    Source::pinned(&pinned, offset, n),
                    Destination::device(&mut device, offset),
                )
                .unwrap_or_else(|e| panic!("{what}: pinned up by {method:?}: {e}"));
                try_by(
                    &manager,
                    method,
                    Source::device(&device, offset, n),
                    Destination::pinned(&mut pinned, 0),
                )
                .unwrap_or_else(|e| panic!("{what}: pinned down by {method:?}: {e}"));
                assert_bytes(
                    &pinned.as_slice().unwrap()[..n],
                    src,
                    &format!("{what} (pinned, {method:?})"),
                );
                bump(&mut tally, TransferPath::PINNED_TO_DEVICE, n);
                bump(&mut tally, TransferPath::DEVICE_TO_PINNED, n);
            }
            _ => {
                registered.as_mut_slice()[offset..offset + n].copy_from_slice(src);
                manager
                    .transfer(
                        Source::registered(&registered, offset, n),
                        Destination::device(&mut device, offset),
                    )
                    .unwrap();
                manager
                    .transfer(
                        Source::device(&device, offset, n),
                        Destination::registered(&mut registered, 0),
                    )
                    .unwrap();
                assert_bytes(
                    &registered.as_slice()[..n],
                    src,
                    &format!("{what} (registered)"),
                );
                bump(&mut tally, TransferPath::REGISTERED_TO_DEVICE, n);
                bump(&mut tally, TransferPath::DEVICE_TO_REGISTERED, n);
            }
        }
        most_idle = most_idle.max(manager.idle_lanes(ordinal));
        if i == WARM {
            baseline = Some(Baseline {
                threads: cuweave_test_support::process_threads(),
                free: context.memory_info().unwrap().free,
                resident: cuweave_test_support::resident_bytes(),
                marks: manager.free_mark_words(ordinal),
                pinned: manager.clear_cache(),
            });
        }
    }
    eprintln!("{} transfers in {:?}", 2 * ROUND_TRIPS, started.elapsed());
    let base = baseline.unwrap();
    let pinned_now = manager.clear_cache();
    assert!(
        pinned_now <= base.pinned + 32 * MIB,
        "the staging pools held {} pinned bytes after the warm-up and {pinned_now} after {} \
         more round trips",
        base.pinned,
        ROUND_TRIPS - WARM
    );
    assert!(
        most_idle <= MAX_IDLE_LANES,
        "{most_idle} idle lanes kept (at most {MAX_IDLE_LANES})"
    );
    let idle = manager.idle_lanes(ordinal);
    let marks = manager.free_mark_words(ordinal);
    assert!(
        marks + idle * MARKED_STREAMS >= base.marks,
        "{} mark words free after the warm-up, {marks} at the end with {idle} idle lanes: words \
         of finished transfers were not given back",
        base.marks
    );
    cuweave_test_support::poll_until(Duration::from_secs(5), || {
        cuweave_test_support::process_threads() <= base.threads + 2
    });
    let threads = cuweave_test_support::process_threads();
    assert!(
        threads <= base.threads + 2,
        "{} threads after the warm-up, {threads} at the end",
        base.threads
    );
    let free = context.memory_info().unwrap().free;
    assert!(
        free + 64 * MIB >= base.free,
        "device free memory fell from {} to {free} bytes",
        base.free
    );
    let resident = cuweave_test_support::resident_bytes();
    if base.resident > 0 {
        assert!(
            resident <= base.resident + 96 * MIB as u64,
            "resident memory grew from {} to {resident} bytes",
            base.resident
        );
    }
    assert_eq!(
        counted(&manager),
        tally,
        "statistics per path (count, bytes)"
    );
    assert_eq!(failures(&manager), 0);
    registered.unregister().unwrap();
}

// ---------------------------------------------------------------------------------------------
// 6. A registration outliving the manager that made it
// ---------------------------------------------------------------------------------------------

/// A service registers a long-lived frame buffer once (`register_host`) through a manager made
/// for start-up, drops that manager, and hands the registration to a request thread with a
/// manager of its own (the registration borrows only the caller's memory, not the manager, so
/// this compiles). The second manager reads it and writes it (blocking, and as the host side of
/// a borrowed download future), counted under the registered paths; after both managers are
/// gone the registration still unregisters cleanly and hands back the bytes last written.
#[test]
fn a_registration_outlives_the_manager_that_made_it_and_serves_another_on_another_thread() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ordinal = gpu.device.ordinal();
    let n = 3 * MIB + 5;
    let first_data = bytes(n, 61);
    let second_data = bytes(n, 62);
    let mut backing = first_data.clone();
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n + 2).unwrap();
    let registered = {
        let first = TransferManager::new().unwrap();
        let registered = first.register_host(ordinal, &mut backing).unwrap();
        let report = first
            .transfer(&registered, Destination::device(&mut device, 1))
            .unwrap();
        assert_eq!(report.plan.path, TransferPath::REGISTERED_TO_DEVICE);
        registered
    };
    assert_bytes(
        &device.to_vec().unwrap()[1..1 + n],
        &first_data,
        "through the manager that registered it",
    );
    let device_ref = &mut device;
    let second_ref = &second_data;
    let (registered, counts) = std::thread::scope(|scope| {
        scope
            .spawn(move || {
                let mut registered = registered;
                let device = device_ref;
                let second = TransferManager::new().unwrap();
                second
                    .transfer(second_ref, Destination::device(device, 1))
                    .unwrap();
                let report = second
                    .transfer(
                        Source::device(device, 1, n),
                        Destination::registered(&mut registered, 0),
                    )
                    .unwrap();
                assert_eq!(report.plan.path, TransferPath::DEVICE_TO_REGISTERED);
                assert_bytes(registered.as_slice(), second_ref, "downloaded into it");
                {
                    let host = registered.as_mut_slice();
                    host.fill(0);
                    let report = block_on(second.download_async(device, 1, host).unwrap()).unwrap();
                    assert_eq!(report.bytes, n);
                }
                assert_bytes(
                    registered.as_slice(),
                    second_ref,
                    "downloaded into it by a borrowed future",
                );
                device.fill(0).unwrap();
                second.transfer(&registered, &mut *device).unwrap();
                assert_bytes(
                    &device.to_vec().unwrap()[..n],
                    second_ref,
                    "uploaded from it by the second manager",
                );
                let tally = counted(&second);
                let counts = (
                    tally.get(&TransferPath::REGISTERED_TO_DEVICE).copied(),
                    tally.get(&TransferPath::DEVICE_TO_REGISTERED).copied(),
                );
                (registered, counts)
            })
            .join()
            .unwrap()
    });
    assert_eq!(
        counts,
        (Some((1, n as u64)), Some((1, n as u64))),
        "the second manager's registered paths"
    );
    let memory = registered.unregister().unwrap();
    assert_bytes(memory, &second_data, "handed back by unregister");
    assert_bytes(&backing, &second_data, "the caller's Vec");
}

// ---------------------------------------------------------------------------------------------
// 7. A graph captured on one thread while a loader thread transfers
// ---------------------------------------------------------------------------------------------

/// What came of one loader transfer made while another thread captured.
#[derive(Debug)]
enum Outcome {
    /// It moved exact bytes.
    Exact,
    /// It returned a typed error.
    Refused(String),
    /// It returned `Ok` with other bytes than it was given.
    Wrong,
}

impl Outcome {
    fn of(result: Result<bool, TransferError>) -> Self {
        match result {
            Ok(true) => Self::Exact,
            Ok(false) => Self::Wrong,
            Err(error) => Self::Refused(error.to_string()),
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Exact => "exact".to_owned(),
            Self::Refused(error) => format!("refused: {error}"),
            Self::Wrong => "Ok with WRONG BYTES".to_owned(),
        }
    }
}

/// `(way, what came of it)` for each transfer, described.
fn described(outcomes: &[(&'static str, Outcome)]) -> Vec<String> {
    outcomes
        .iter()
        .map(|(name, outcome)| format!("{name}: {}", outcome.describe()))
        .collect()
}

/// A loader's buffers, allocated before the capture begins.
struct LoaderBuffers {
    data: Vec<u8>,
    back: Vec<u8>,
    device: DeviceBuffer<u8>,
    spare: DeviceBuffer<u8>,
    pinned: PinnedBuffer<u8>,
    pinned_out: PinnedBuffer<u8>,
}

impl LoaderBuffers {
    fn new(context: &Arc<Context>, n: usize, seed: u64) -> Self {
        let data = bytes(n, seed);
        Self {
            back: vec![0; n],
            device: DeviceBuffer::zeroed(context, n).unwrap(),
            spare: DeviceBuffer::zeroed(context, n).unwrap(),
            pinned: PinnedBuffer::from_slice(context, &data).unwrap(),
            pinned_out: PinnedBuffer::zeroed(context, n).unwrap(),
            data,
        }
    }

    /// Pageable up and down by `method` (`None`: planned).
    fn pageable(
        &mut self,
        manager: &TransferManager,
        method: Option<TransferMethod>,
    ) -> Result<bool, TransferError> {
        self.back.fill(0);
        try_by(
            manager,
            method,
            Source::from(&self.data),
            (&mut self.device).into(),
        )?;
        try_by(
            manager,
            method,
            (&self.device).into(),
            (&mut self.back).into(),
        )?;
        Ok(self.back == self.data)
    }

    fn pinned(&mut self, manager: &TransferManager) -> Result<bool, TransferError> {
        manager.transfer(&self.pinned, &mut self.device)?;
        manager.transfer(&self.device, &mut self.pinned_out)?;
        Ok(*self.pinned_out.as_slice()? == *self.data)
    }

    fn borrowed(&mut self, manager: &TransferManager) -> Result<bool, TransferError> {
        self.back.fill(0);
        block_on(manager.upload_async(&self.data, &mut self.device, 0)?)?;
        block_on(manager.download_async(&self.device, 0, &mut self.back)?)?;
        Ok(self.back == self.data)
    }

    fn owned(&mut self, manager: &TransferManager) -> Result<bool, TransferError> {
        let context = Arc::clone(self.device.context());
        let taken = std::mem::replace(&mut self.device, DeviceBuffer::new(&context, 1)?);
        let up = block_on(manager.upload_owned(self.data.clone(), taken, 0));
        self.device = up.device;
        up.result?;
        let taken = std::mem::replace(&mut self.device, DeviceBuffer::new(&context, 1)?);
        let down = block_on(manager.download_owned(taken, 0, vec![0u8; self.data.len()]));
        self.device = down.device;
        down.result?;
        Ok(down.host == self.data)
    }

    fn device_to_device(&mut self, manager: &TransferManager) -> Result<bool, TransferError> {
        self.back.fill(0);
        manager.transfer(&self.data, &mut self.device)?;
        manager.transfer(&self.device, &mut self.spare)?;
        manager.transfer(&self.spare, &mut self.back)?;
        Ok(self.back == self.data)
    }

    fn views(&mut self, manager: &TransferManager) -> Result<bool, TransferError> {
        let half = self.data.len() / 2;
        self.back.fill(0);
        manager.transfer(
            &self.data[..half],
            Destination::view(self.spare.slice_mut(1..1 + half)?),
        )?;
        manager.transfer(
            Source::view(self.spare.slice(1..1 + half)?),
            &mut self.back[..half],
        )?;
        Ok(self.back[..half] == self.data[..half])
    }

    /// One round trip by every way: its name and what came of it.
    fn every_way(&mut self, manager: &TransferManager) -> Vec<(&'static str, Outcome)> {
        vec![
            (
                "pageable, planned",
                Outcome::of(self.pageable(manager, None)),
            ),
            (
                "pageable, DirectCopy",
                Outcome::of(self.pageable(manager, Some(TransferMethod::DirectCopy))),
            ),
            (
                "pageable, HostStaged",
                Outcome::of(self.pageable(manager, Some(TransferMethod::HostStaged))),
            ),
            ("pinned, planned", Outcome::of(self.pinned(manager))),
            ("borrowed futures", Outcome::of(self.borrowed(manager))),
            ("owned futures", Outcome::of(self.owned(manager))),
            (
                "device to device",
                Outcome::of(self.device_to_device(manager)),
            ),
            ("views", Outcome::of(self.views(manager))),
        ]
    }
}

/// A PyTorch program warms up a CUDA graph (`torch.cuda.graph`) on its side stream while its
/// data-loader thread keeps moving batches: thread A begins a capture on a non-blocking stream,
/// queues a fill kernel, and while the capture is open thread B (its buffers allocated before)
/// makes a round trip of 1 MiB + 3 bytes by every way (planned and `DirectCopy` pageable,
/// pinned, borrowed and owned futures, device to device, views) through a manager it opens
/// then; then A queues an increment and ends the capture.
///
/// In thread-local mode (cuweave's default, and what a multi-threaded PyTorch program should
/// use) B's calls are none of the capture's business: every transfer moves exact bytes and the
/// graph replays to 8 everywhere. In global mode (PyTorch's default) the driver forbids other
/// threads "unsafe" calls during the capture: each transfer must then either move exact bytes
/// or return a typed error (never `Ok` with wrong bytes, never a hang: a loader that does not
/// finish within 30 s fails the test), and the capture either ends in a graph that replays
/// correctly or reports `CaptureInvalidated`. Either way, afterwards the manager moves exact
/// bytes and the stream runs kernels. What global mode did is printed.
#[test]
fn a_graph_captured_on_one_thread_while_a_loader_thread_transfers_stays_consistent() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    const G: usize = 1024;
    let n = MIB + 3;
    for (round, mode) in [CaptureMode::ThreadLocal, CaptureMode::Global]
        .into_iter()
        .enumerate()
    {
        let manager = Arc::new(TransferManager::new().unwrap());
        let (ready_tx, ready_rx) = mpsc::channel::<()>();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel();
        let loader = std::thread::spawn({
            let manager = Arc::clone(&manager);
            let context = Arc::clone(&gpu.context);
            move || {
                let mut buffers = LoaderBuffers::new(&context, n, 40 + round as u64);
                ready_tx.send(()).unwrap();
                go_rx.recv().unwrap();
                let outcomes = buffers.every_way(&manager);
                done_tx.send(outcomes).unwrap();
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the loader never allocated its buffers");
        let stream = user_stream(&gpu.context);
        let graph_out = DeviceBuffer::<u32>::zeroed(&gpu.context, G).unwrap();
        let out = graph_out.device_ptr();
        stream.begin_capture(mode).unwrap();
        // SAFETY: `graph_out` holds G u32s and outlives every launch of the captured graph
        // (synchronised below before it is read or dropped); the captured kernels are its only
        // writers and nothing reads it meanwhile.
        let filled = unsafe { kernels.fill_u32(&stream, out, 7, G) };
        go_tx.send(()).unwrap();
        let outcomes = match done_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(outcomes) => outcomes,
            // The loader panicked: its panic is the failure.
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                std::panic::resume_unwind(loader.join().unwrap_err())
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("{mode:?}: the loader's transfers did not finish within 30 s of the capture")
            }
        };
        // SAFETY: as above.
        let incremented = unsafe { kernels.increment_u32(&stream, out, G) };
        let ended = stream.end_capture();
        loader.join().unwrap();

        assert!(
            !outcomes.iter().any(|(_, o)| matches!(o, Outcome::Wrong)),
            "{mode:?}: transfers returned Ok with wrong bytes: {:#?}",
            described(&outcomes)
        );
        let replay = |graph: cuweave_driver::Graph| {
            let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
            exec.launch(&stream).unwrap();
            stream.synchronize().unwrap();
            assert_all_u32(
                &graph_out.to_vec().unwrap(),
                8,
                &format!("{mode:?}: the graph's replay"),
            );
        };
        match mode {
            CaptureMode::ThreadLocal => {
                assert!(
                    outcomes.iter().all(|(_, o)| matches!(o, Outcome::Exact)),
                    "thread-local capture on another thread: {:#?}",
                    described(&outcomes)
                );
                filled.unwrap();
                incremented.unwrap();
                replay(ended.unwrap());
            }
            _ => {
                eprintln!(
                    "{mode:?} capture on another thread, the loader's transfers: {:#?}",
                    described(&outcomes)
                );
                match ended {
                    Ok(graph) => {
                        filled.unwrap();
                        incremented.unwrap();
                        replay(graph);
                        eprintln!("{mode:?}: the capture ended valid");
                    }
                    Err(DriverError::Graph(GraphError::CaptureInvalidated {
                        broken_by,
                        code_name,
                    })) => eprintln!(
                        "{mode:?}: the capture was invalidated by {broken_by:?} ({code_name:?})"
                    ),
                    Err(error) => panic!("{mode:?}: ending the capture: {error}"),
                }
            }
        }
        // The manager and the stream work afterwards.
        let mut buffers = LoaderBuffers::new(&gpu.context, n, 90 + round as u64);
        let after = buffers.every_way(&manager);
        assert!(
            after.iter().all(|(_, o)| matches!(o, Outcome::Exact)),
            "{mode:?}: after the capture: {:#?}",
            described(&after)
        );
        // SAFETY: as above; the graph is no longer launched.
        unsafe { kernels.fill_u32(&stream, out, 9, G) }.unwrap();
        stream.synchronize().unwrap();
        assert_all_u32(
            &graph_out.to_vec().unwrap(),
            9,
            &format!("{mode:?}: the stream after the capture"),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 8. Device copies after a late writer of the source and a reader of the destination
// ---------------------------------------------------------------------------------------------

/// How a device-to-device copy is asked for.
#[derive(Debug, Clone, Copy)]
enum DeviceCopy {
    Planned,
    Direct,
    ViewToView,
    ViewToBuffer,
    BufferToView,
}

/// Waits for both user streams and checks that the reader saw its buffer unchanged and that
/// `got` holds `WRITTEN` in `offset..offset + n` and `OLD` around it.
fn check_settled(
    writer: &Stream,
    reader: &Stream,
    mismatches: &DeviceBuffer<u32>,
    got: impl FnOnce() -> Vec<u32>,
    offset: usize,
    n: usize,
    what: &str,
) {
    writer.synchronize().unwrap();
    reader.synchronize().unwrap();
    assert_eq!(
        mismatches.to_vec().unwrap(),
        [0],
        "{what}: the copy landed while the user's kernel still read the destination"
    );
    let got = got();
    assert_all_u32(&got[..offset], OLD, &format!("{what}: before the range"));
    assert_all_u32(
        &got[offset..offset + n],
        WRITTEN,
        &format!("{what}: the copy did not carry the source's late write"),
    );
    assert_all_u32(&got[offset + n..], OLD, &format!("{what}: after the range"));
}

/// A pipeline stage copies one layer's output (written late by the user's kernel on stream W,
/// declared a write) into the next stage's input (still read by the user's kernel on stream R,
/// declared a read), both for 50 ms: the copy must wait for both, by the planned method,
/// `DirectCopy`, and views on either side; the same between device and unified memory (by every
/// method the path offers) and between two unified buffers, where the device has concurrent
/// managed access. The reader sees its old contents throughout, the destination gets the late
/// write exactly in its range and nothing around it, and the copies are counted on their paths.
#[test]
fn device_copies_wait_for_a_late_writer_of_the_source_and_a_reader_of_the_destination() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(ctx).unwrap();
    let watcher = kernels.module().function("watch_u32").unwrap();
    let fill = kernels.module().function("fill_u32").unwrap();
    let writer = user_stream(ctx);
    let reader = user_stream(ctx);
    let n = MIB / 4 + 3;
    let (src_at, dst_at) = (2usize, 3usize);
    let mut mismatches = DeviceBuffer::<u32>::zeroed(ctx, 1).unwrap();
    for how in [
        DeviceCopy::Planned,
        DeviceCopy::Direct,
        DeviceCopy::ViewToView,
        DeviceCopy::ViewToBuffer,
        DeviceCopy::BufferToView,
    ] {
        let what = format!("device to device, {how:?}");
        let mut src = DeviceBuffer::<u32>::new(ctx, n + 5).unwrap();
        src.fill(0x5151_5151).unwrap();
        let mut dst = DeviceBuffer::<u32>::new(ctx, n + 7).unwrap();
        dst.fill(OLD).unwrap();
        mismatches.fill(0).unwrap();
        late_fill(&kernels, &fill, &writer, &mut src, WRITTEN, KERNEL_NS);
        watch(&watcher, &reader, &dst, OLD, KERNEL_NS, &mut mismatches);
        let report = match how {
            DeviceCopy::Planned => manager.transfer(
                Source::device(&src, src_at, n),
                Destination::device(&mut dst, dst_at),
            ),
            DeviceCopy::Direct => manager.transfer_with(
                TransferMethod::DirectCopy,
                Source::device(&src, src_at, n),
                Destination::device(&mut dst, dst_at),
            ),
            DeviceCopy::ViewToView => manager.transfer(
                Source::view(src.slice(src_at..src_at + n).unwrap()),
                Destination::view(dst.slice_mut(dst_at..dst_at + n).unwrap()),
            ),
            DeviceCopy::ViewToBuffer => manager.transfer(
                Source::view(src.slice(src_at..src_at + n).unwrap()),
                Destination::device(&mut dst, dst_at),
            ),
            DeviceCopy::BufferToView => manager.transfer(
                Source::device(&src, src_at, n),
                Destination::view(dst.slice_mut(dst_at..dst_at + n).unwrap()),
            ),
        }
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(report.plan.path, TransferPath::DEVICE_TO_DEVICE, "{what}");
        assert_eq!(report.bytes, 4 * n, "{what}");
        check_settled(
            &writer,
            &reader,
            &mismatches,
            || dst.to_vec().unwrap(),
            dst_at,
            n,
            &what,
        );
    }
    assert_eq!(
        counted(&manager)
            .get(&TransferPath::DEVICE_TO_DEVICE)
            .copied(),
        Some((5, 5 * 4 * n as u64))
    );

    if !gpu.device.capabilities().unwrap().concurrent_managed_access {
        skip(
            "device_copies_wait_for_a_late_writer_of_the_source_and_a_reader_of_the_destination",
            "the unified part: no concurrent managed access",
        );
        return;
    }
    let ordinal = gpu.device.ordinal();
    let methods = |from: Location, to: Location| -> Vec<Option<TransferMethod>> {
        let facts = manager.facts(from, to);
        std::iter::once(None)
            .chain(
                TransferMethod::candidates(TransferPath::between(from, to))
                    .iter()
                    .filter(|m| facts.missing(**m).is_none())
                    .map(|m| Some(*m)),
            )
            .collect()
    };
    // One late writer of the source and one reader of the destination per method, for each
    // pair of kinds: the copy must wait for both.
    macro_rules! ordered_copies {
        ($from:expr, $to:expr, $Src:ident, $Dst:ident, $source:ident, $destination:ident) => {
            for method in methods($from, $to) {
                let what = format!("{:?} to {:?} by {method:?}", $from, $to);
                let mut src = $Src::<u32>::new(ctx, n + 5).unwrap();
                src.fill(0x5151_5151).unwrap();
                let mut dst = $Dst::<u32>::new(ctx, n + 7).unwrap();
                dst.fill(OLD).unwrap();
                mismatches.fill(0).unwrap();
                late_fill(&kernels, &fill, &writer, &mut src, WRITTEN, KERNEL_NS);
                watch(&watcher, &reader, &dst, OLD, KERNEL_NS, &mut mismatches);
                try_by(
                    &manager,
                    method,
                    Source::$source(&src, src_at, n),
                    Destination::$destination(&mut dst, dst_at),
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                check_settled(
                    &writer,
                    &reader,
                    &mismatches,
                    || dst.to_vec().unwrap(),
                    dst_at,
                    n,
                    &what,
                );
            }
        };
    }
    let (device, unified) = (Location::Device(ordinal), Location::Unified(ordinal));
    ordered_copies!(
        device,
        unified,
        DeviceBuffer,
        UnifiedBuffer,
        device,
        unified
    );
    ordered_copies!(
        unified,
        device,
        UnifiedBuffer,
        DeviceBuffer,
        unified,
        device
    );
    ordered_copies!(
        unified,
        unified,
        UnifiedBuffer,
        UnifiedBuffer,
        unified,
        unified
    );
}

// ---------------------------------------------------------------------------------------------
// 9. Refused requests answer at once while the GPU still uses their buffers
// ---------------------------------------------------------------------------------------------

/// Asserts `result` is `OutOfRange` on `side`.
fn out_of_range<T: std::fmt::Debug>(result: Result<T, TransferError>, side: &str, what: &str) {
    match result {
        Err(TransferError::OutOfRange { side: s, .. }) if s == side => {}
        other => panic!("{what}: expected OutOfRange on the {side}, got {other:?}"),
    }
}

/// An inference server rejects malformed requests while the GPU is busy with the very buffers
/// they name: the user's kernel reads the destination buffer for 50 ms (declared a read), and
/// meanwhile a dozen bad requests come in: ranges past the end on either side (blocking,
/// borrowed and owned, views, pinned), a host destination of the wrong length, methods the path
/// cannot take (`ZeroCopy` from pageable memory, `PeerToPeer` on one device), a device the
/// manager does not serve, an empty registration, and a zero-length transfer at the end of the
/// buffer (fine, moves nothing). Each gets its typed error (or its empty report) without
/// waiting for the kernel: all of them are answered while it still runs. The kernel sees its
/// buffer unchanged, the buffer holds its old contents, and the statistics count nothing.
#[test]
fn refused_requests_are_typed_errors_answered_while_the_gpu_still_uses_their_buffers() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let unserved = TransferManager::for_devices(&[]).unwrap();
    let kernels = TestKernels::load(ctx).unwrap();
    let watcher = kernels.module().function("watch_u32").unwrap();
    let stream = user_stream(ctx);
    let n = MIB / 4;
    let host = vec![0x2222_2222u32; n + 1];
    let mut device = DeviceBuffer::<u32>::new(ctx, n).unwrap();
    let mut other = DeviceBuffer::<u32>::zeroed(ctx, 16).unwrap();
    let mut pinned = PinnedBuffer::<u32>::zeroed(ctx, n).unwrap();
    let mut short = vec![0u32; n - 1];
    let mut too_long = vec![0u32; n];
    // Made before the kernel: nothing but refusals runs while it reads.
    let placeholder = DeviceBuffer::<u32>::new(ctx, 1).unwrap();
    // Opens the device and warms what a refusal might otherwise be blamed for.
    manager.transfer(&host[..n], &mut device).unwrap();
    manager.stats().reset();
    device.fill(OLD).unwrap();
    let mut mismatches = DeviceBuffer::<u32>::zeroed(ctx, 1).unwrap();
    watch(&watcher, &stream, &device, OLD, KERNEL_NS, &mut mismatches);

    let started = Instant::now();
    out_of_range(
        manager.transfer(&host[..], &mut device),
        "destination",
        "one element too many",
    );
    out_of_range(
        manager.transfer(&host[..4], Destination::device(&mut device, n - 3)),
        "destination",
        "past the end from an offset",
    );
    out_of_range(
        manager.transfer(Source::device(&device, n - 3, 4), &mut short[..4]),
        "source",
        "a source range past the end",
    );
    match manager.transfer(Source::device(&device, 0, n), &mut short[..]) {
        Err(TransferError::LengthMismatch {
            source_len,
            destination_len,
        }) => assert_eq!((source_len, destination_len), (n, n - 1)),
        other => panic!("a host destination one short: {other:?}"),
    }
    out_of_range(
        manager.transfer(
            &host[..10],
            Destination::view(device.slice_mut(0..9).unwrap()),
        ),
        "destination",
        "a view one short",
    );
    out_of_range(
        manager.transfer(Source::pinned(&pinned, 5, n), &mut device),
        "source",
        "a pinned range past the end",
    );
    out_of_range(
        manager.transfer(
            Source::device(&device, 1, n),
            Destination::pinned(&mut pinned, 0),
        ),
        "source",
        "a device range past the end into pinned memory",
    );
    match manager.upload_async(&host[..], &mut device, 0) {
        Err(TransferError::OutOfRange { .. }) => {}
        other => panic!("a borrowed upload too long: {other:?}"),
    }
    match manager.download_async(&device, 1, &mut too_long) {
        Err(TransferError::OutOfRange { .. }) => {}
        other => panic!("a borrowed download past the end: {other:?}"),
    }
    let taken = std::mem::replace(&mut device, placeholder);
    let mut owned = manager.upload_owned(host.clone(), taken, 0);
    let refused = match Pin::new(&mut owned).poll(&mut TaskContext::from_waker(Waker::noop())) {
        Poll::Ready(refused) => refused,
        Poll::Pending => panic!("a refused owned upload was not ready at its first poll"),
    };
    device = refused.device;
    assert_eq!(refused.host.len(), n + 1, "the host Vec came back");
    assert!(matches!(
        refused.result,
        Err(TransferError::OutOfRange { .. })
    ));
    match manager.transfer_with(TransferMethod::ZeroCopy, &host[..16], &mut other) {
        Err(TransferError::Unsupported { method, .. }) => {
            assert_eq!(method, TransferMethod::ZeroCopy);
        }
        other => panic!("ZeroCopy from pageable memory: {other:?}"),
    }
    match manager.transfer_with(
        TransferMethod::PeerToPeer,
        Source::device(&device, 0, 16),
        &mut other,
    ) {
        Err(TransferError::Unsupported { method, .. }) => {
            assert_eq!(method, TransferMethod::PeerToPeer);
        }
        other => panic!("PeerToPeer on one device: {other:?}"),
    }
    match unserved.transfer(&host[..16], &mut other) {
        Err(TransferError::NoSuchDevice {
            device: 0,
            count: 0,
        }) => {}
        other => panic!("a manager serving no device: {other:?}"),
    }
    let mut nothing: [u32; 0] = [];
    match manager.register_host(gpu.device.ordinal(), &mut nothing) {
        Err(TransferError::EmptyRegistration { len: 0, .. }) => {}
        other => panic!("an empty registration: {:?}", other.map(|r| r.len())),
    }
    let empty = manager
        .transfer(&[] as &[u32], Destination::device(&mut device, n))
        .unwrap();
    assert_eq!(empty.bytes, 0);
    out_of_range(
        manager.transfer(&[] as &[u32], Destination::device(&mut device, n + 1)),
        "destination",
        "an empty transfer past the end",
    );
    let took = started.elapsed();
    let still_running = !stream.query().unwrap();
    assert!(
        still_running,
        "the refusals took {took:?}: some waited for the kernel (it runs {} ms) reading the \
         buffer they named",
        KERNEL_NS / 1_000_000
    );
    stream.synchronize().unwrap();
    assert_eq!(
        mismatches.to_vec().unwrap(),
        [0],
        "a refused request wrote the buffer the kernel read"
    );
    assert_all_u32(&device.to_vec().unwrap(), OLD, "the named buffer");
    assert!(
        manager
            .stats()
            .snapshot()
            .iter()
            .all(|(_, _, s)| s.count == 0 && s.failures == 0),
        "refusals counted: {:?}",
        manager.stats().snapshot()
    );
    assert!(unserved.stats().snapshot().is_empty());
}

/// Compile-time: what a work-stealing executor needs of the futures and the registration.
#[allow(dead_code)]
fn moved_between_threads() {
    fn send<T: Send>() {}
    send::<cuweave_transfer::AsyncTransfer<'static, u8>>();
    send::<cuweave_transfer::OwnedTransfer<u8>>();
    send::<cuweave_transfer::RegisteredHost<'static, u8>>();
}
