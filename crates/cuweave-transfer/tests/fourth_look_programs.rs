//! Fourth-look user programs for the transfer manager, written as PyTorch data loaders
//! (`pin_memory=True`, `non_blocking=True`), tokio inference servers awaiting GPU work and cudarc
//! users (`htod_copy` / `dtoh_sync_copy` into `slice_mut(a..b)`) write them, on what the crate's
//! other GPU tests leave out:
//!
//! - every report a transfer hands back (blocking, forced, borrowed, owned, views, pinned,
//!   device to device) summed per path and size class equals the manager's statistics to the
//!   nanosecond and the best bandwidth exactly, not only in counts and bytes;
//! - views of views (`buf.slice_mut(a..)?.slice_mut(b..c)?`) as both sides, at one byte and at
//!   one byte below and above the staging chunk the manager itself reports for the path;
//! - a transfer program sharing the process's `AsyncEventWaiter` with the user's own long waits
//!   (a stream wait, a timed-out event wait, a cancelled callback): the transfers' wake-ups are
//!   not held behind them, the user's waits resolve as documented;
//! - an `OperationCoordinator` ordering raw (untracked) kernels between manager transfers for
//!   hundreds of batches: exact bytes, every callback run once, every operation retired;
//! - one-byte transfers at every offset of a small buffer by every public way;
//! - the typed errors of the mistakes a loader makes (short destinations, short views, ranges
//!   that overflow, impossible methods, a device the manager does not serve), nothing counted,
//!   nothing written, the buffers usable afterwards;
//! - two thousand request iterations, each cancelling a borrowed upload and a borrowed download
//!   after a few polls (tokio's `select!` with a timeout) and then reusing both buffers: exact
//!   bytes, statistics counting only what completed, lanes and mark words flat;
//! - eight threads chaining upload, device-to-device copy into a view and owned download at odd
//!   sizes and offsets, reconciled per path;
//! - 12-byte records through a fixed staging configuration whose chunk is not a whole number of
//!   records, in both chunk orders, by every way, around the chunk in records.
//!
//! Every test skips without a GPU. No executor is a dev-dependency, so a minimal one is here
//! (and `block_on` in the common module).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use cuweave_event::{
    AsyncEventWaiter, EventError, EventPool, EventPriority, OperationCoordinator, OperationType,
};
use cuweave_memory::{Buffer, DeviceBuffer, Element, PinnedBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip_under_sanitizer};
use cuweave_transfer::{
    ChunkOrder, Destination, HostCopy, MAX_IDLE_LANES, SizeClass, Source, StagingConfig,
    TransferError, TransferManager, TransferMethod, TransferPath, TransferReport,
};

mod common;
use common::{SENTINEL, Way, assert_bytes, assert_range, block_on, bytes, user_stream, words};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Uploads `src` into `device` at element `offset` by `way` and returns the transfer's report
/// (an owned transfer takes the device buffer and gives it back).
fn up<T: Element>(
    manager: &TransferManager,
    way: Way,
    src: &[T],
    device: &mut DeviceBuffer<T>,
    offset: usize,
) -> TransferReport {
    let n = src.len();
    let report = match way {
        Way::Planned => manager
            .transfer(src, Destination::device(device, offset))
            .unwrap(),
        Way::Staged | Way::Direct => manager
            .transfer_with(
                way.forced().unwrap(),
                src,
                Destination::device(device, offset),
            )
            .unwrap(),
        Way::Borrowed => block_on(manager.upload_async(src, device, offset).unwrap()).unwrap(),
        Way::Owned => {
            let placeholder = DeviceBuffer::<T>::new(&Arc::clone(device.context()), 1).unwrap();
            let taken = std::mem::replace(device, placeholder);
            let owned = block_on(manager.upload_owned(src.to_vec(), taken, offset));
            *device = owned.device;
            assert_bytes(
                &owned.host,
                src,
                "an owned upload hands its host Vec back as it was",
            );
            owned.result.unwrap()
        }
        Way::View => {
            let view = device.slice_mut(offset..offset + n).unwrap();
            manager.transfer(src, Destination::view(view)).unwrap()
        }
    };
    assert_eq!(
        report.bytes,
        size_of_val(src),
        "{way:?} upload: bytes reported"
    );
    report
}

/// Downloads `dst.len()` elements of `device` from element `offset` into `dst` by `way` and
/// returns the transfer's report.
fn down<T: Element>(
    manager: &TransferManager,
    way: Way,
    device: &mut DeviceBuffer<T>,
    offset: usize,
    dst: &mut [T],
) -> TransferReport {
    let n = dst.len();
    let bytes = size_of_val(dst);
    let report = match way {
        Way::Planned => manager
            .transfer(Source::device(device, offset, n), &mut *dst)
            .unwrap(),
        Way::Staged | Way::Direct => manager
            .transfer_with(
                way.forced().unwrap(),
                Source::device(device, offset, n),
                &mut *dst,
            )
            .unwrap(),
        Way::Borrowed => block_on(manager.download_async(device, offset, dst).unwrap()).unwrap(),
        Way::Owned => {
            let placeholder = DeviceBuffer::<T>::new(&Arc::clone(device.context()), 1).unwrap();
            let taken = std::mem::replace(device, placeholder);
            let owned = block_on(manager.download_owned(taken, offset, vec![T::zeroed(); n]));
            *device = owned.device;
            dst.copy_from_slice(&owned.host);
            owned.result.unwrap()
        }
        Way::View => {
            let view = device.slice(offset..offset + n).unwrap();
            manager.transfer(Source::view(view), &mut *dst).unwrap()
        }
    };
    assert_eq!(report.bytes, bytes, "{way:?} download: bytes reported");
    report
}

/// Runs one transfer by `method` (`None`: the planned one).
fn try_by<T: Element>(
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

/// Completed transfers and bytes per path over every size class, and all failures.
fn per_path(manager: &TransferManager) -> (BTreeMap<TransferPath, (u64, u64)>, u64) {
    let mut tally = BTreeMap::new();
    let mut failures = 0;
    for (path, _, stats) in manager.stats().snapshot() {
        failures += stats.failures;
        if stats.count > 0 {
            let slot: &mut (u64, u64) = tally.entry(path).or_default();
            slot.0 += stats.count;
            slot.1 += stats.bytes;
        }
    }
    (tally, failures)
}

/// Adds one completed transfer of `bytes` on `path` to a test's own tally.
fn bump(tally: &mut BTreeMap<TransferPath, (u64, u64)>, path: TransferPath, bytes: usize) {
    let slot = tally.entry(path).or_default();
    slot.0 += 1;
    slot.1 += bytes as u64;
}

/// Wakes the thread that polls.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `future` at most `polls` times on this thread (a `select!` arm that lost the race after
/// that many wake-ups); its output if it finished.
fn poll_n<F: Future + Unpin>(future: &mut F, polls: usize) -> Option<F::Output> {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = TaskContext::from_waker(&waker);
    for _ in 0..polls {
        if let Poll::Ready(output) = Pin::new(&mut *future).poll(&mut cx) {
            return Some(output);
        }
    }
    None
}

/// Polls every future to completion on this thread, together (a `join_all`).
fn join_all<F: Future + ?Sized>(futures: &mut [Pin<Box<F>>]) -> Vec<F::Output> {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = TaskContext::from_waker(&waker);
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while outputs.iter().any(Option::is_none) {
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none()
                && let Poll::Ready(done) = future.as_mut().poll(&mut cx)
            {
                *output = Some(done);
            }
        }
        if outputs.iter().any(Option::is_none) {
            assert!(Instant::now() < deadline, "futures never finished");
            std::thread::park_timeout(Duration::from_millis(20));
        }
    }
    outputs.into_iter().map(Option::unwrap).collect()
}

// ---------------------------------------------------------------------------------------------
// 1. Reports and statistics agree to the nanosecond
// ---------------------------------------------------------------------------------------------

/// A loader logs every `TransferReport` (bytes, elapsed, `gbps()`) and a dashboard reads
/// `manager.stats()`: the two must tell the same story. Round trips by every public way
/// (planned, forced `HostStaged` and `DirectCopy`, borrowed and owned futures, views) plus a
/// pinned upload, a device-to-device copy and a download into a pinned buffer, at 1 byte, around
/// a page, around the `Tiny`/`Small` and `Small`/`Medium` class bounds and at 3 MiB + 5, at odd
/// offsets. Every report's size class is that of its bytes; summed per (path, size class), the
/// reports' counts, bytes and elapsed times equal the statistics exactly, and the statistics'
/// best bandwidth is the best report's `gbps()`; nothing failed; every byte round-trips.
#[test]
fn every_report_summed_per_path_and_size_class_equals_the_statistics_exactly() {
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let sizes = [
        1usize,
        4095,
        4097,
        64 * KIB,
        64 * KIB + 1,
        MIB,
        MIB + 1,
        3 * MIB + 5,
    ];
    let most = sizes.iter().max().unwrap() + 8;
    let mut dev = DeviceBuffer::<u8>::zeroed(ctx, most).unwrap();
    let mut other = DeviceBuffer::<u8>::zeroed(ctx, most).unwrap();
    let mut pinned = PinnedBuffer::<u8>::zeroed(ctx, most).unwrap();
    let mut reports: Vec<TransferReport> = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let data = bytes(n, i as u64 + 1);
        let off = (2 * i + 1) % 7;
        for way in Way::ALL {
            reports.push(up(&manager, way, &data, &mut dev, off));
            let mut back = vec![0u8; n];
            reports.push(down(&manager, way, &mut dev, off, &mut back));
            assert_bytes(&back, &data, &format!("{way:?} round trip of {n} bytes"));
        }
        pinned.as_mut_slice().unwrap()[off..off + n].copy_from_slice(&data);
        let to = 7 - off;
        reports.push(
            manager
                .transfer(
                    Source::pinned(&pinned, off, n),
                    Destination::device(&mut dev, to),
                )
                .unwrap(),
        );
        reports.push(
            manager
                .transfer(
                    Source::device(&dev, to, n),
                    Destination::device(&mut other, off),
                )
                .unwrap(),
        );
        pinned.fill(0).unwrap();
        reports.push(
            manager
                .transfer(
                    Source::device(&other, off, n),
                    Destination::pinned(&mut pinned, 1),
                )
                .unwrap(),
        );
        assert_bytes(
            &pinned.as_slice().unwrap()[1..1 + n],
            &data,
            &format!("pinned -> device -> device -> pinned of {n} bytes"),
        );
    }
    type Figures = (u64, u64, Duration, f64);
    let mut want: BTreeMap<(TransferPath, SizeClass), Figures> = BTreeMap::new();
    for report in &reports {
        assert_eq!(
            report.plan.size_class,
            SizeClass::of(report.bytes),
            "{}: the plan's size class is that of the bytes moved",
            report.plan
        );
        let slot = want
            .entry((report.plan.path, report.plan.size_class))
            .or_default();
        slot.0 += 1;
        slot.1 += report.bytes as u64;
        slot.2 += report.elapsed;
        slot.3 = slot.3.max(report.gbps());
    }
    let mut failures = 0;
    let got: BTreeMap<(TransferPath, SizeClass), Figures> = manager
        .stats()
        .snapshot()
        .into_iter()
        .map(|(path, class, s)| {
            failures += s.failures;
            ((path, class), (s.count, s.bytes, s.time, s.best_gbps))
        })
        .collect();
    assert_eq!(failures, 0, "nothing failed");
    assert_eq!(
        got, want,
        "statistics (count, bytes, time, best GB/s) per (path, size class) against the reports"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Views of views at the staging chunk's edges
// ---------------------------------------------------------------------------------------------

/// A cudarc user narrows a view twice (`dst.slice_mut(5..)?.slice_mut(off..off + n)?`, a batch
/// inside a tensor inside an arena) and copies into it, out of it, and from it into a view of a
/// second buffer. Sizes are 1 byte and one byte below, at and above the staging chunk the manager
/// reports (`staging_for`) for each direction at 256 KiB, 1 MiB and 4 MiB, and two chunks plus
/// one; the host slices start 3 bytes into a `Vec`. By the planned method, forced `HostStaged`
/// and forced `DirectCopy`: the bytes land exactly at `5 + off`, and every byte around stays the
/// sentinel.
#[test]
fn views_of_views_move_exact_bytes_around_the_reported_staging_chunk_by_every_method() {
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let mut sizes = vec![1usize, 2];
    for base in [256 * KIB, MIB, 4 * MIB] {
        for path in [
            TransferPath::PAGEABLE_TO_DEVICE,
            TransferPath::DEVICE_TO_PAGEABLE,
        ] {
            let chunk = manager.staging_for(path, 0, base).chunk_bytes;
            sizes.extend([chunk - 1, chunk, chunk + 1, 2 * chunk + 1]);
        }
    }
    sizes.sort_unstable();
    sizes.dedup();
    let most = *sizes.last().unwrap();
    let whole = most + 32;
    let mut dev = DeviceBuffer::<u8>::from_slice(ctx, &vec![SENTINEL; whole]).unwrap();
    let mut other = DeviceBuffer::<u8>::from_slice(ctx, &vec![SENTINEL; whole]).unwrap();
    let source = bytes(most + 3, 77);
    for (i, &n) in sizes.iter().enumerate() {
        let data = &source[3..3 + n];
        for method in [
            None,
            Some(TransferMethod::HostStaged),
            Some(TransferMethod::DirectCopy),
        ] {
            let what = format!("{n} bytes by {method:?}");
            let off = 1 + (i + n) % 11;
            dev.fill(SENTINEL).unwrap();
            other.fill(SENTINEL).unwrap();
            {
                let mut outer = dev.slice_mut(5..).unwrap();
                let inner = outer.slice_mut(off..off + n).unwrap();
                let report = try_by(
                    &manager,
                    method,
                    Source::Host(data),
                    Destination::view(inner),
                )
                .unwrap();
                assert_eq!(report.bytes, n, "{what}: upload bytes");
            }
            assert_range(
                &dev.to_vec().unwrap(),
                5 + off,
                data,
                &format!("{what}: upload"),
            );

            let mut back = vec![0u8; n];
            {
                let outer = dev.slice(5..).unwrap();
                let inner = outer.slice(off..off + n).unwrap();
                try_by(
                    &manager,
                    method,
                    Source::view(inner),
                    Destination::Host(&mut back),
                )
                .unwrap();
            }
            assert_bytes(&back, data, &format!("{what}: download"));

            // Device to device, view of a view to view of a view (one device: the plain copy
            // is the only method, so the forced ones are not asked for).
            if method.is_none() {
                let outer = dev.slice(5..).unwrap();
                let inner = outer.slice(off..off + n).unwrap();
                let mut to_outer = other.slice_mut(2..).unwrap();
                let to_inner = to_outer.slice_mut(off + 1..off + 1 + n).unwrap();
                manager
                    .transfer(Source::view(inner), Destination::view(to_inner))
                    .unwrap();
                assert_range(
                    &other.to_vec().unwrap(),
                    3 + off,
                    data,
                    &format!("{what}: device to device"),
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Sharing the process's waiter with the user's own long waits
// ---------------------------------------------------------------------------------------------

/// An async server keeps its own waits on the process's `AsyncEventWaiter` (the one the
/// transfers' chunks are woken by): a callback for a stream that runs a 1 s kernel, a future
/// for the same stream, and a 50 ms timed wait on an event behind that kernel. Meanwhile it
/// awaits eight borrowed uploads and downloads of odd sizes (1 byte to 3 MiB + 1) at once. The
/// transfers complete, exactly, while the user's kernel still runs (their wake-ups are not held
/// behind the user's pending waits) and the user's callback has not run; then the callback is
/// cancelled (`cancel_wait` answers `true` and it never runs), the timed wait reports
/// `TimedOut`, and the stream future resolves `Ok` once the kernel ends.
#[test]
fn transfers_woken_by_the_global_waiter_are_not_held_behind_the_users_long_waits() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "transfers_woken_by_the_global_waiter_are_not_held_behind_the_users_long_waits",
        "needs the user's kernel and the transfers' copies to run at once",
    ) {
        return;
    }
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(ctx).unwrap();
    let stream = user_stream(ctx);
    let waiter = AsyncEventWaiter::global().unwrap();
    // Warm the device state so the measured part is transfers only.
    let mut warm = DeviceBuffer::<u8>::zeroed(ctx, 1).unwrap();
    block_on(manager.upload_async(&[1u8], &mut warm, 0).unwrap()).unwrap();

    kernels.spin_ns(&stream, 1_000_000_000).unwrap();
    let fired = Arc::new(AtomicUsize::new(0));
    let fired_in_callback = Arc::clone(&fired);
    let callback = waiter
        .wait_stream_async(&stream, move |_| {
            fired_in_callback.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    let idle = waiter.stream_idle(&stream).unwrap();
    let events = EventPool::for_context(ctx).unwrap();
    let behind = events.acquire_owned(false).unwrap();
    behind.record(&stream).unwrap();
    let (timed_tx, timed_rx) = mpsc::channel();
    waiter.wait_async_timeout(behind, Duration::from_millis(50), move |result| {
        let _ = timed_tx.send(result);
    });

    let sizes = [1usize, 4097, 32 * KIB + 3, MIB - 1, MIB + 1, 3 * MIB + 1];
    let inputs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| bytes(n, 500 + i as u64))
        .collect();
    let mut devices: Vec<DeviceBuffer<u8>> = sizes
        .iter()
        .map(|&n| DeviceBuffer::<u8>::zeroed(ctx, n + 5).unwrap())
        .collect();
    let mut outputs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    {
        type Moving<'a> = Pin<Box<dyn Future<Output = Result<(), TransferError>> + 'a>>;
        let mut requests: Vec<Moving<'_>> = devices
            .iter_mut()
            .zip(outputs.iter_mut())
            .zip(inputs.iter())
            .map(|((device, output), input)| {
                let manager = &manager;
                Box::pin(async move {
                    manager.upload_async(input, device, 5)?.await?;
                    manager.download_async(device, 5, output)?.await?;
                    Ok(())
                }) as Moving<'_>
            })
            .collect();
        for outcome in join_all(&mut requests) {
            outcome.unwrap();
        }
    }
    let still_running = !stream.query().unwrap();
    let fired_early = fired.load(Ordering::SeqCst);
    let cancelled = waiter.cancel_wait(callback);
    assert!(
        still_running,
        "the transfers finished only after the user's 1 s kernel: their wake-ups waited behind \
         the user's pending waits"
    );
    assert_eq!(
        fired_early, 0,
        "the user's stream callback ran before its kernel ended"
    );
    assert!(cancelled, "cancelling a pending callback wait answers true");
    for ((input, output), n) in inputs.iter().zip(&outputs).zip(sizes) {
        assert_bytes(output, input, &format!("round trip of {n} bytes"));
    }
    match timed_rx.recv_timeout(Duration::from_secs(5)) {
        Ok(Err(EventError::TimedOut { timeout })) => {
            assert_eq!(timeout, Duration::from_millis(50));
        }
        other => panic!("the 50 ms wait on an event behind a 1 s kernel: {other:?}"),
    }
    block_on(idle).unwrap();
    assert!(
        stream.query().unwrap(),
        "the stream future resolved after the kernel"
    );
    assert_eq!(
        fired.load(Ordering::SeqCst),
        0,
        "a cancelled callback never runs"
    );
}

// ---------------------------------------------------------------------------------------------
// 4. An OperationCoordinator around manager transfers
// ---------------------------------------------------------------------------------------------

/// A training step as a coordinator program: each of 300 batches (1 to 70 000 `u32`s, at device
/// offsets 0 to 2) is uploaded by the manager (planned, borrowed or owned) inside a
/// `MemoryTransfer` operation, incremented by a raw kernel on stream A (an untracked launch, as a
/// cudarc user launches with a raw pointer), incremented again on stream B by an operation that
/// depends on the first (so B waits for A on the device), and downloaded by the manager (planned,
/// borrowed or owned) once `completion` of the last operation has been awaited. Every batch comes
/// back as input + 2; every `on_complete` callback runs exactly once with `Ok`; the coordinator
/// counts every operation registered, begun and completed, made at least one cross-stream wait
/// per batch, and retires every operation.
#[test]
fn a_coordinator_orders_raw_kernels_between_manager_transfers_for_hundreds_of_batches() {
    const BATCHES: usize = 300;
    const MOST: usize = 70_000;
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(ctx).unwrap();
    let coordinator = OperationCoordinator::new(EventPool::new(ctx, 4, 0).unwrap()).unwrap();
    let (a, b) = (Arc::new(user_stream(ctx)), Arc::new(user_stream(ctx)));
    let mut device = DeviceBuffer::<u32>::zeroed(ctx, MOST + 3).unwrap();
    let (done_tx, done_rx) = mpsc::channel();
    let ways = [Way::Planned, Way::Borrowed, Way::Owned];
    for batch in 0..BATCHES {
        let n = 1 + (batch * 7919) % MOST;
        let off = batch % 3;
        let input = words(n, batch as u64);
        let upload = coordinator
            .register_operation(
                OperationType::MemoryTransfer,
                EventPriority::High,
                Some(a.as_ref()),
                &[],
                format!("upload {batch}"),
            )
            .unwrap();
        coordinator.begin_operation(upload, &a).unwrap();
        up(&manager, ways[batch % 3], &input, &mut device, off);
        coordinator.complete_operation(upload).unwrap();

        let first = coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                Some(a.as_ref()),
                &[upload],
                format!("first {batch}"),
            )
            .unwrap();
        coordinator.begin_operation(first, &a).unwrap();
        let ptr = device.device_ptr() + (off * 4) as u64;
        // SAFETY: `ptr` addresses elements off..off + n of `device`, alive until the batch is
        // downloaded; nothing else touches them until `completion(second)` resolves.
        unsafe { kernels.increment_u32(&a, ptr, n) }.unwrap();
        coordinator.complete_operation(first).unwrap();

        let second = coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                Some(b.as_ref()),
                &[first],
                format!("second {batch}"),
            )
            .unwrap();
        coordinator.begin_operation(second, &b).unwrap();
        // SAFETY: as above; stream B waits on the device for `first` (begin_operation).
        unsafe { kernels.increment_u32(&b, ptr, n) }.unwrap();
        coordinator.complete_operation(second).unwrap();
        let tx = done_tx.clone();
        coordinator
            .on_complete(second, move |id, result| {
                let _ = tx.send((id, result.is_ok()));
            })
            .unwrap();
        block_on(coordinator.completion(second).unwrap()).unwrap();

        let mut output = vec![0u32; n];
        down(
            &manager,
            ways[(batch + 1) % 3],
            &mut device,
            off,
            &mut output,
        );
        if let Some(i) = (0..n).find(|&i| output[i] != input[i].wrapping_add(2)) {
            panic!(
                "batch {batch} ({n} u32s at {off}): element {i} is {:#x}, input {:#x} (+2 \
                 expected)",
                output[i], input[i]
            );
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..BATCHES {
        let (id, ok) = done_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("every on_complete callback runs");
        assert!(ok, "callback of {id:?} told of a failure");
        assert!(seen.insert(id), "callback of {id:?} ran twice");
    }
    coordinator.retire_finished();
    let metrics = coordinator.metrics();
    let operations = 3 * BATCHES as u64;
    assert_eq!(
        (
            metrics.registered,
            metrics.begun,
            metrics.completed,
            metrics.failed
        ),
        (operations, operations, operations, 0)
    );
    // At most one wait per batch: a first kernel the coordinator has already seen finish
    // needs none (the results above prove the order either way).
    assert!(
        metrics.cross_stream_waits <= BATCHES as u64,
        "one wait at most per batch, for the second kernel on the first's: {metrics:?}"
    );
    assert_eq!(coordinator.live_operations(), 0, "every operation retired");
    let (tally, failures) = per_path(&manager);
    assert_eq!(failures, 0);
    assert_eq!(tally[&TransferPath::PAGEABLE_TO_DEVICE].0, BATCHES as u64);
    assert_eq!(tally[&TransferPath::DEVICE_TO_PAGEABLE].0, BATCHES as u64);
}

// ---------------------------------------------------------------------------------------------
// 5. One byte at every offset by every way
// ---------------------------------------------------------------------------------------------

/// A server keeps per-request flags in one small device buffer and sets them one byte at a time
/// (as `tensor[i] = x` does): a 1-byte upload at every offset of a 67-byte buffer by every
/// public way, each followed by a 1-byte download by the same way, and then one `u64` at every
/// offset of a 9-element buffer. Each byte lands at its offset only (the rest of the buffer is
/// what the earlier writes left), each download returns it, and the statistics count each
/// transfer once, with its byte.
#[test]
fn one_byte_transfers_at_every_offset_by_every_way_touch_only_their_byte() {
    const LEN: usize = 67;
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let mut device = DeviceBuffer::<u8>::from_slice(ctx, &[SENTINEL; LEN]).unwrap();
    let mut expected = vec![SENTINEL; LEN];
    let mut moves = 0u64;
    for (w, way) in Way::ALL.into_iter().enumerate() {
        for off in 0..LEN {
            let value = [((off * 31 + w * 7) as u8) ^ 0x5A];
            up(&manager, way, &value, &mut device, off);
            expected[off] = value[0];
            assert_bytes(
                &device.to_vec().unwrap(),
                &expected,
                &format!("{way:?}: a 1-byte upload at {off}"),
            );
            let mut back = [0u8];
            down(&manager, way, &mut device, off, &mut back);
            assert_eq!(back, value, "{way:?}: a 1-byte download at {off}");
            moves += 1;
        }
    }
    let mut wide = DeviceBuffer::<u64>::zeroed(ctx, 9).unwrap();
    let mut wide_expected = [0u64; 9];
    for (w, way) in Way::ALL.into_iter().enumerate() {
        for off in 0..9 {
            let value = [0x0123_4567_89AB_CDEFu64.rotate_left((off * 8 + w) as u32)];
            up(&manager, way, &value, &mut wide, off);
            wide_expected[off] = value[0];
            assert_eq!(
                wide.to_vec().unwrap(),
                wide_expected,
                "{way:?}: a u64 at {off}"
            );
            let mut back = [0u64];
            down(&manager, way, &mut wide, off, &mut back);
            assert_eq!(back, value, "{way:?}: a u64 download at {off}");
        }
    }
    let wide_moves = (Way::ALL.len() * 9) as u64;
    let stats = manager.stats();
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        let tiny = stats.get(path, SizeClass::Tiny);
        assert_eq!(
            (tiny.count, tiny.bytes, tiny.failures),
            (moves + wide_moves, moves + 8 * wide_moves, 0),
            "{path}: every 1-element transfer counted once with its bytes"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 6. The typed errors of a loader's mistakes
// ---------------------------------------------------------------------------------------------

/// The mistakes a data loader makes, each answered with its typed error before anything moves:
/// a host destination one element short (`LengthMismatch`), a view one element short and a
/// device range that overflows `usize` (`OutOfRange` naming the side), a borrowed download
/// longer than what remains past its offset, an owned upload too long for its destination (both
/// buffers handed back untouched), methods the path has not (`PeerToPeer` within one device,
/// `ZeroCopy` and `UnifiedMemory` from pageable memory: `Unsupported`), a manager limited to no
/// device (`NoSuchDevice` on every entry point, the device never opened) and an empty
/// registration. Nothing is counted, nothing is written, and the same buffers then round-trip.
#[test]
fn a_loaders_mistakes_are_typed_errors_that_write_and_count_nothing() {
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let n = 5000usize;
    let data = words(n, 9);
    let mut dev = DeviceBuffer::<u32>::from_slice(ctx, &vec![0xEEEE_EEEE; n + 4]).unwrap();
    let mut other = DeviceBuffer::<u32>::from_slice(ctx, &vec![0xEEEE_EEEE; n + 4]).unwrap();
    let untouched = dev.to_vec().unwrap();

    let mut short = vec![0u32; n - 1];
    for method in [
        None,
        Some(TransferMethod::HostStaged),
        Some(TransferMethod::DirectCopy),
    ] {
        let error = try_by(
            &manager,
            method,
            Source::device(&dev, 0, n),
            Destination::Host(&mut short),
        )
        .unwrap_err();
        assert!(
            matches!(
                error,
                TransferError::LengthMismatch {
                    source_len,
                    destination_len
                } if source_len == n && destination_len == n - 1
            ),
            "{method:?}: a short host destination: {error}"
        );
        let view = dev.slice_mut(4..n + 3).unwrap();
        let error = try_by(
            &manager,
            method,
            Source::Host(&data),
            Destination::view(view),
        )
        .unwrap_err();
        assert!(
            matches!(
                error,
                TransferError::OutOfRange {
                    side: "destination",
                    offset: 0,
                    len,
                    capacity
                } if len == n && capacity == n - 1
            ),
            "{method:?}: a view one element short: {error}"
        );
        let error = try_by(
            &manager,
            method,
            Source::device(&dev, usize::MAX - 1, 2),
            Destination::Host(&mut [0u32; 2]),
        )
        .unwrap_err();
        assert!(
            matches!(error, TransferError::OutOfRange { side: "source", .. }),
            "{method:?}: an overflowing source range: {error}"
        );
    }
    let mut long = vec![0u32; n];
    let error = manager.download_async(&dev, 5, &mut long).unwrap_err();
    assert!(
        matches!(
            error,
            TransferError::OutOfRange {
                side: "source",
                offset: 5,
                ..
            }
        ),
        "a borrowed download past the end: {error}"
    );
    let owned = block_on(manager.upload_owned(data.clone(), other, 5));
    assert!(
        matches!(
            owned.result,
            Err(TransferError::OutOfRange {
                side: "destination",
                offset: 5,
                ..
            })
        ),
        "an owned upload too long: {:?}",
        owned.result
    );
    assert_bytes(&owned.host, &data, "the refused owned upload's host Vec");
    other = owned.device;
    assert_bytes(
        &other.to_vec().unwrap(),
        &untouched,
        "the refused owned upload's device",
    );

    for method in [
        TransferMethod::PeerToPeer,
        TransferMethod::HostStaged,
        TransferMethod::ZeroCopy,
    ] {
        let error = manager
            .transfer_with(
                method,
                Source::device(&dev, 0, n),
                Destination::device(&mut other, 0),
            )
            .unwrap_err();
        assert!(
            matches!(error, TransferError::Unsupported { method: m, .. } if m == method),
            "{method} within one device: {error}"
        );
    }
    for method in [TransferMethod::ZeroCopy, TransferMethod::UnifiedMemory] {
        let error = manager
            .transfer_with(method, &data[..], Destination::device(&mut dev, 0))
            .unwrap_err();
        assert!(
            matches!(error, TransferError::Unsupported { method: m, .. } if m == method),
            "{method} from pageable memory: {error}"
        );
    }

    let nobody = TransferManager::for_devices(&[]).unwrap();
    let no_device = |error: &TransferError| {
        matches!(
            error,
            TransferError::NoSuchDevice {
                device: 0,
                count: 0
            }
        )
    };
    let error = nobody
        .transfer(&data[..], Destination::device(&mut dev, 0))
        .unwrap_err();
    assert!(no_device(&error), "transfer: {error}");
    let error = nobody
        .transfer_with(
            TransferMethod::DirectCopy,
            Source::device(&dev, 0, n),
            &mut long[..],
        )
        .unwrap_err();
    assert!(no_device(&error), "transfer_with: {error}");
    let error = nobody.upload_async(&data, &mut dev, 0).unwrap_err();
    assert!(no_device(&error), "upload_async: {error}");
    let error = nobody.download_async(&dev, 0, &mut long).unwrap_err();
    assert!(no_device(&error), "download_async: {error}");
    let owned = block_on(nobody.download_owned(other, 0, vec![0u32; n]));
    assert!(
        owned.result.as_ref().is_err_and(no_device),
        "download_owned: {:?}",
        owned.result
    );
    other = owned.device;
    let mut host = vec![1u32; 16];
    let error = nobody.register_host(0, &mut host).unwrap_err();
    assert!(no_device(&error), "register_host: {error}");
    assert!(
        !nobody.is_open(0),
        "a manager that serves no device opened one"
    );
    assert!(
        nobody.stats().snapshot().is_empty(),
        "refusals count nothing"
    );

    // Documented as refused "before any driver call": a manager that has not opened device 0
    // must still not have opened it after refusing an empty registration.
    let fresh = TransferManager::for_devices(&[0]).unwrap();
    let error = fresh.register_host::<u32>(0, &mut []).unwrap_err();
    assert!(
        matches!(
            error,
            TransferError::EmptyRegistration {
                len: 0,
                element_bytes: 4
            }
        ),
        "an empty registration: {error}"
    );
    assert!(
        !fresh.is_open(0),
        "refusing an empty registration opened device 0 (a driver call before the refusal)"
    );

    assert!(
        manager.stats().snapshot().is_empty(),
        "refusals count nothing"
    );
    assert_bytes(
        &dev.to_vec().unwrap(),
        &untouched,
        "the refused transfers' destination",
    );
    assert_bytes(&other.to_vec().unwrap(), &untouched, "the other buffer");

    // The same buffers still work.
    manager
        .transfer(&data[..], Destination::device(&mut dev, 3))
        .unwrap();
    manager
        .transfer(
            Source::device(&dev, 3, n),
            Destination::device(&mut other, 1),
        )
        .unwrap();
    let mut back = vec![0u32; n];
    manager
        .transfer(Source::device(&other, 1, n), &mut back[..])
        .unwrap();
    assert_bytes(&back, &data, "the round trip after the refusals");
}

// ---------------------------------------------------------------------------------------------
// 7. Two thousand cancelled requests
// ---------------------------------------------------------------------------------------------

/// A tokio server wraps every transfer in `select!` with a deadline that often fires first: for
/// each of 2 000 requests (1 byte to 96 KiB, around the 32 KiB a poll copies, at device offsets
/// 0 to 12), a borrowed upload is polled 0 to 5 times and dropped, then the request's real data
/// is uploaded into the same range by a blocking transfer; a borrowed download into the reply
/// `Vec` is polled 0 to 5 times and dropped, then the reply is downloaded for real into that
/// `Vec`. Every reply is exactly the real data (no dropped upload lands late over it, no dropped
/// download writes the reply afterwards); the statistics count the blocking transfers and only
/// those futures that completed within their polls; idle lanes stay within `MAX_IDLE_LANES`
/// and the free progress-mark words end where they were after the warm-up.
#[test]
fn two_thousand_cancelled_requests_reuse_their_buffers_with_exact_bytes_and_flat_lanes() {
    const REQUESTS: usize = 2000;
    const WARM: usize = 100;
    const MOST: usize = 96 * KIB;
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let stale = bytes(MOST + 16, 1);
    let fresh = bytes(MOST + 16, 2);
    let mut device = DeviceBuffer::<u8>::zeroed(ctx, MOST + 16).unwrap();
    let (mut ups_completed, mut downs_completed) = (0u64, 0u64);
    let (mut up_bytes, mut down_bytes) = (0u64, 0u64);
    let mut warm_marks = None;
    for request in 0..REQUESTS {
        if request == WARM {
            warm_marks = Some(manager.free_mark_words(0));
        }
        let n = 1 + (request * 7919) % MOST;
        let off = request % 13;
        let polls = request % 6;
        let real = &fresh[request % 7..request % 7 + n];
        {
            let mut upload = manager.upload_async(&stale[..n], &mut device, off).unwrap();
            if let Some(done) = poll_n(&mut upload, polls) {
                done.unwrap();
                ups_completed += 1;
                up_bytes += n as u64;
            }
        }
        manager
            .transfer(real, Destination::device(&mut device, off))
            .unwrap();
        let mut reply = vec![0u8; n];
        {
            let mut download = manager.download_async(&device, off, &mut reply).unwrap();
            if let Some(done) = poll_n(&mut download, polls) {
                done.unwrap();
                downs_completed += 1;
                down_bytes += n as u64;
            }
        }
        manager
            .transfer(Source::device(&device, off, n), &mut reply[..])
            .unwrap();
        assert_bytes(
            &reply,
            real,
            &format!("request {request} ({n} bytes at {off})"),
        );
        assert!(
            manager.idle_lanes(0) <= MAX_IDLE_LANES,
            "request {request}: {} idle lanes",
            manager.idle_lanes(0)
        );
    }
    assert_eq!(
        Some(manager.free_mark_words(0)),
        warm_marks,
        "free progress-mark words after the loop against after the warm-up"
    );
    let total: u64 = (0..REQUESTS)
        .map(|request| 1 + ((request * 7919) % MOST) as u64)
        .sum();
    let (tally, failures) = per_path(&manager);
    assert_eq!(failures, 0);
    assert_eq!(
        tally[&TransferPath::PAGEABLE_TO_DEVICE],
        (REQUESTS as u64 + ups_completed, total + up_bytes),
        "uploads: the blocking ones and the futures that completed"
    );
    assert_eq!(
        tally[&TransferPath::DEVICE_TO_PAGEABLE],
        (REQUESTS as u64 + downs_completed, total + down_bytes),
        "downloads: the blocking ones and the futures that completed"
    );
}

// ---------------------------------------------------------------------------------------------
// 8. Eight threads chaining upload, device copy and owned download
// ---------------------------------------------------------------------------------------------

/// Eight loader threads share one manager; each runs 25 batches of 1 byte to 5 MiB, each a chain
/// (upload from a host slice that starts anywhere in a page into buffer A at an odd offset,
/// planned or borrowed; device-to-device from A into a `slice_mut` view of buffer B at another
/// odd offset; owned download of that range of B). Every batch comes back exactly, and the
/// statistics equal, per path, the counts and bytes of what the threads did.
#[test]
fn eight_threads_chain_upload_device_copy_and_owned_download_and_the_statistics_reconcile() {
    const THREADS: usize = 8;
    const BATCHES: usize = 25;
    const MOST: usize = 5 * MIB;
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let tallies: Vec<BTreeMap<TransferPath, (u64, u64)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let manager = &manager;
                scope.spawn(move || {
                    let mut tally = BTreeMap::new();
                    let source = bytes(MOST + 4096, t as u64 + 40);
                    let mut a = DeviceBuffer::<u8>::zeroed(ctx, MOST + 16).unwrap();
                    let mut b = DeviceBuffer::<u8>::zeroed(ctx, MOST + 16).unwrap();
                    for batch in 0..BATCHES {
                        let seed = t * BATCHES + batch;
                        let n = match seed % 5 {
                            0 => 1 + seed % 3,
                            1 => 4095 + seed % 5,
                            2 => 64 * KIB + seed,
                            3 => MIB + 2 * seed + 1,
                            _ => MOST - seed,
                        };
                        let start = (seed * 617) % 4096;
                        let data = &source[start..start + n];
                        let (off_a, off_b) = (1 + seed % 15, 3 + seed % 13);
                        if batch % 2 == 0 {
                            manager
                                .transfer(data, Destination::device(&mut a, off_a))
                                .unwrap();
                        } else {
                            block_on(manager.upload_async(data, &mut a, off_a).unwrap()).unwrap();
                        }
                        bump(&mut tally, TransferPath::PAGEABLE_TO_DEVICE, n);
                        let view = b.slice_mut(off_b..off_b + n).unwrap();
                        manager
                            .transfer(Source::device(&a, off_a, n), Destination::view(view))
                            .unwrap();
                        bump(&mut tally, TransferPath::DEVICE_TO_DEVICE, n);
                        let owned = block_on(manager.download_owned(b, off_b, vec![0u8; n]));
                        b = owned.device;
                        owned.result.unwrap();
                        bump(&mut tally, TransferPath::DEVICE_TO_PAGEABLE, n);
                        assert_bytes(
                            &owned.host,
                            data,
                            &format!("thread {t} batch {batch}: {n} bytes"),
                        );
                    }
                    tally
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut want: BTreeMap<TransferPath, (u64, u64)> = BTreeMap::new();
    for tally in &tallies {
        for (&path, &(count, bytes)) in tally {
            let slot = want.entry(path).or_default();
            slot.0 += count;
            slot.1 += bytes;
        }
    }
    let (got, failures) = per_path(&manager);
    assert_eq!(failures, 0);
    assert_eq!(
        got, want,
        "statistics per path against the threads' transfers"
    );
}

// ---------------------------------------------------------------------------------------------
// 9. Records that do not divide the staging chunk
// ---------------------------------------------------------------------------------------------

/// A 12-byte record (three `u32`s, as a loader's `(token, position, segment)` triple).
type Record = [u32; 3];

/// A loader fixes its staging (`with_staging`) at 4 100-byte chunks, which hold 341 records and
/// 8 bytes over, on three threads, two blocks deep, in each chunk order, and moves 12-byte
/// records by every public way: 1, 340, 341, 342, 682, 683 and 684 records, 100 chunks + 1 and
/// 200 chunks + 7 (past the size from which copies run ordered), at device offsets 0 and 5.
/// Every record lands whole and in place (nothing before or after the range changes) and comes
/// back exactly.
#[test]
fn records_that_do_not_divide_a_fixed_staging_chunk_round_trip_by_every_way_in_both_orders() {
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let chunk = 4100 / size_of::<Record>();
    let counts = [
        1usize,
        chunk - 1,
        chunk,
        chunk + 1,
        2 * chunk,
        2 * chunk + 1,
        2 * chunk + 2,
        100 * chunk + 1,
        200 * chunk + 7,
    ];
    let most = *counts.iter().max().unwrap();
    let marker: Record = [0xEEEE_EEEE; 3];
    for order in [ChunkOrder::Ordered, ChunkOrder::Interleaved] {
        let manager = TransferManager::with_staging(StagingConfig {
            chunk_bytes: 4100,
            depth: 2,
            threads: 3,
            host_copy: HostCopy::Streaming,
            order,
        })
        .unwrap();
        let mut device = DeviceBuffer::<Record>::from_slice(ctx, &vec![marker; most + 5]).unwrap();
        for (i, &count) in counts.iter().enumerate() {
            let flat = words(3 * count, (i * 10) as u64 + 3);
            let records: Vec<Record> = flat.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect();
            for way in Way::ALL {
                for off in [0usize, 5] {
                    let what = format!("{order:?} {way:?}: {count} records at {off}");
                    device.fill(marker).unwrap();
                    up(&manager, way, &records, &mut device, off);
                    let all = device.to_vec().unwrap();
                    assert!(
                        all[..off]
                            .iter()
                            .chain(&all[off + count..])
                            .all(|r| *r == marker),
                        "{what}: records around the range changed"
                    );
                    assert_bytes(&all[off..off + count], &records, &what);
                    let mut back = vec![[0u32; 3]; count];
                    down(&manager, way, &mut device, off, &mut back);
                    assert_bytes(&back, &records, &format!("{what}: back"));
                }
            }
        }
    }
}
