//! GPU tests of async transfers: bytes round-trip through `upload_async` / `download_async`
//! under a minimal executor, two transfers progress together, and bad ranges are refused before
//! anything is queued.

mod common;
use common::block_on_counted;

use std::future::Future;
use std::task::{Context, Poll, Waker};

use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_test_support::{require_gpu, sanitizer_active, skip_under_sanitizer};
use cuweave_transfer::{
    ChunkOrder, HostCopy, POLL_BYTES, SizeClass, StagingConfig, TransferError, TransferManager,
    TransferMethod, TransferPath,
};

fn pattern(len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(0x9E37_79B9) ^ 0x5A5A)
        .collect()
}

#[test]
fn async_uploads_and_downloads_round_trip_through_pinned_chunks() {
    let gpu = require_gpu!();
    // Small chunks, so 9 MiB + 5 elements make many chunks and a short last one.
    let manager = TransferManager::with_staging(StagingConfig {
        chunk_bytes: 1 << 20,
        depth: 3,
        threads: 2,
        host_copy: HostCopy::Streaming,
        order: ChunkOrder::Ordered,
    })
    .unwrap();
    let data = pattern((9 << 20) / 4 + 5);
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, data.len() + 3).unwrap();
    let (report, polls) = block_on_counted(manager.upload_async(&data, &mut device, 3).unwrap());
    let report = report.unwrap();
    assert_eq!(report.bytes, data.len() * 4);
    assert_eq!(report.plan.method, TransferMethod::HostStaged);
    assert!(
        polls >= 2,
        "the upload waited for the GPU at least once ({polls} polls)"
    );
    let whole = device.to_vec().unwrap();
    assert_eq!(&whole[..3], &[0, 0, 0]);
    assert_eq!(&whole[3..], &data[..]);

    let mut back = vec![0u32; data.len()];
    let (report, _) = block_on_counted(manager.download_async(&device, 3, &mut back).unwrap());
    assert_eq!(report.unwrap().bytes, data.len() * 4);
    assert_eq!(back, data);
}

#[test]
fn two_async_transfers_progress_together() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let a = pattern(3 << 20);
    let b: Vec<u32> = a.iter().map(|x| !x).collect();
    let mut da = DeviceBuffer::<u32>::zeroed(&gpu.context, a.len()).unwrap();
    let mut db = DeviceBuffer::<u32>::zeroed(&gpu.context, b.len()).unwrap();
    let both = async {
        let first = manager.upload_async(&a, &mut da, 0)?;
        let second = manager.upload_async(&b, &mut db, 0)?;
        let (x, y) = join(first, second).await;
        Ok::<_, TransferError>((x?, y?))
    };
    let (outcome, _) = block_on_counted(both);
    let (x, y) = outcome.unwrap();
    assert_eq!(x.bytes + y.bytes, 2 * a.len() * 4);
    assert_eq!(da.to_vec().unwrap(), a);
    assert_eq!(db.to_vec().unwrap(), b);
}

/// Polls two futures until both are ready (a minimal `join`).
async fn join<A: Future + Unpin, B: Future + Unpin>(mut a: A, mut b: B) -> (A::Output, B::Output) {
    let mut ra = None;
    let mut rb = None;
    std::future::poll_fn(|cx| {
        if ra.is_none()
            && let Poll::Ready(x) = std::pin::Pin::new(&mut a).poll(cx)
        {
            ra = Some(x);
        }
        if rb.is_none()
            && let Poll::Ready(y) = std::pin::Pin::new(&mut b).poll(cx)
        {
            rb = Some(y);
        }
        if ra.is_some() && rb.is_some() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    (ra.unwrap(), rb.unwrap())
}

#[test]
fn async_transfers_refuse_bad_ranges_before_queueing() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let host = vec![1u8; 64];
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, 32).unwrap();
    assert!(matches!(
        manager.upload_async(&host, &mut device, 0),
        Err(TransferError::OutOfRange {
            side: "destination",
            ..
        })
    ));
    let mut out = vec![0u8; 16];
    assert!(matches!(
        manager.download_async(&device, 20, &mut out),
        Err(TransferError::OutOfRange { side: "source", .. })
    ));
    // An empty transfer completes at once.
    let (report, polls) =
        block_on_counted(manager.upload_async(&host[..0], &mut device, 32).unwrap());
    assert_eq!((report.unwrap().bytes, polls), (0, 1));
    assert!(device.to_vec().unwrap().iter().all(|&b| b == 0));
}

/// Polls `future` `polls` times with a waker that does nothing, a millisecond apart (so its
/// pinned blocks arrive from the staging workers and copies get queued and finish).
fn poll_a_few<F: Future + Unpin>(future: &mut F, polls: usize) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    (0..polls).any(|_| {
        let ready = std::pin::Pin::new(&mut *future).poll(&mut cx).is_ready();
        std::thread::sleep(std::time::Duration::from_millis(1));
        ready
    })
}

#[test]
fn every_poll_copies_a_bounded_amount() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let data = pattern((64 << 20) / 4);
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, data.len()).unwrap();
    let (report, polls) = block_on_counted(manager.upload_async(&data, &mut device, 0).unwrap());
    report.unwrap();
    // Each poll copies at most POLL_BYTES of host memory, so 64 MiB takes at least this many.
    assert!(polls >= (64 << 20) / POLL_BYTES, "{polls} polls");
    assert_eq!(device.to_vec().unwrap(), data);
    let mut back = vec![0u32; data.len()];
    let (report, polls) = block_on_counted(manager.download_async(&device, 0, &mut back).unwrap());
    report.unwrap();
    assert!(polls >= (64 << 20) / POLL_BYTES, "{polls} polls");
    assert_eq!(back, data);
}

#[test]
fn a_forgotten_download_never_writes_the_memory_it_borrowed() {
    let gpu = require_gpu!();
    // memcheck checks kernels' accesses, not the copy engine's, so it has nothing to add here.
    if skip_under_sanitizer(
        "a_forgotten_download_never_writes_the_memory_it_borrowed",
        "forgets a future on purpose, which leaks its pinned blocks by design",
    ) {
        return;
    }
    let manager = TransferManager::new().unwrap();
    let data = pattern((64 << 20) / 4);
    let device = DeviceBuffer::<u32>::from_slice(&gpu.context, &data).unwrap();
    let mut dst = vec![0u32; data.len()];
    let mut future = manager.download_async(&device, 0, &mut dst).unwrap();
    // Mid-transfer: blocks taken, copies in flight, part of `dst` written.
    assert!(!poll_a_few(&mut future, 40));
    std::mem::forget(future);
    // The borrow has ended: free the memory and reuse it (the allocator very likely hands the
    // same pages back), then let every queued copy finish.
    drop(dst);
    let reused = vec![0xA5A5_A5A5u32; data.len()];
    gpu.context.synchronize().unwrap();
    // Nothing but a poll writes the borrowed slice, and there will be no more polls: give any
    // stray writer (there is none) ample time, then check.
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(reused.iter().all(|&x| x == 0xA5A5_A5A5));
}

#[test]
fn a_forgotten_upload_never_reads_the_memory_it_borrowed() {
    let gpu = require_gpu!();
    // memcheck checks kernels' accesses, not the copy engine's, so it has nothing to add here.
    if skip_under_sanitizer(
        "a_forgotten_upload_never_reads_the_memory_it_borrowed",
        "forgets a future on purpose, which leaks its pinned blocks by design",
    ) {
        return;
    }
    let manager = TransferManager::new().unwrap();
    let len = (64 << 20) / 4;
    let data = vec![0x1111_1111u32; len];
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, len).unwrap();
    let mut future = manager.upload_async(&data, &mut device, 0).unwrap();
    assert!(!poll_a_few(&mut future, 40));
    std::mem::forget(future);
    drop(data);
    // Reused memory gets new bytes; had anything kept reading it, they would reach the device.
    let reused = vec![0x7777_7777u32; len];
    gpu.context.synchronize().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    gpu.context.synchronize().unwrap();
    let on_device = device.to_vec().unwrap();
    assert!(
        on_device.iter().all(|&x| x == 0 || x == 0x1111_1111),
        "the device received bytes written after the borrow ended"
    );
    assert!(on_device.contains(&0x1111_1111));
    drop(reused);
}

#[test]
fn owned_transfers_round_trip_and_hand_the_buffers_back() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let data = pattern((40 << 20) / 4 + 3);
    let device = DeviceBuffer::<u32>::zeroed(&gpu.context, data.len() + 5).unwrap();
    let (owned, _) = block_on_counted(manager.upload_owned(data.clone(), device, 5));
    let report = owned.result.unwrap();
    assert_eq!(report.bytes, data.len() * 4);
    assert_eq!(owned.host, data);
    let device = owned.device;
    assert_eq!(&device.to_vec().unwrap()[5..], &data[..]);
    let (owned, _) = block_on_counted(manager.download_owned(device, 5, vec![0u32; data.len()]));
    owned.result.unwrap();
    assert_eq!(owned.host, data);
    // Both are in the manager's statistics by the time their buffers came back.
    let class = SizeClass::of(data.len() * 4);
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        let counted = manager.stats().get(path, class);
        assert_eq!(
            (counted.count, counted.bytes),
            (1, data.len() as u64 * 4),
            "{path}"
        );
        assert_eq!(counted.failures, 0);
    }
    // A forgotten owned transfer leaks its buffers (never frees what a worker uses); a dropped
    // one finishes in the background. Later transfers are unaffected.
    // (Not under compute-sanitizer, whose leak check would report the leak this makes.)
    if !sanitizer_active() {
        let device = DeviceBuffer::<u32>::zeroed(&gpu.context, data.len()).unwrap();
        std::mem::forget(manager.upload_owned(data.clone(), device, 0));
    }
    let device = DeviceBuffer::<u32>::zeroed(&gpu.context, data.len()).unwrap();
    drop(manager.upload_owned(data.clone(), device, 0));
    let device = DeviceBuffer::<u32>::zeroed(&gpu.context, data.len()).unwrap();
    let (owned, _) = block_on_counted(manager.upload_owned(data.clone(), device, 0));
    owned.result.unwrap();
    assert_eq!(owned.device.to_vec().unwrap(), data);
    // Bad ranges are refused before anything starts, and both buffers come back untouched
    // with the error (as tokio-uring hands a buffer back with its result): nothing is lost.
    let small = DeviceBuffer::<u32>::from_slice(&gpu.context, &[1, 2, 3, 4]).unwrap();
    let (owned, _) = block_on_counted(manager.upload_owned(vec![9u32; 8], small, 0));
    assert!(matches!(
        owned.result,
        Err(TransferError::OutOfRange { .. })
    ));
    assert_eq!(owned.host, vec![9u32; 8]);
    assert_eq!(owned.device.to_vec().unwrap(), vec![1, 2, 3, 4]);
    let (owned, _) = block_on_counted(manager.download_owned(owned.device, 1, vec![7u32; 4]));
    assert!(matches!(
        owned.result,
        Err(TransferError::OutOfRange { .. })
    ));
    assert_eq!(owned.host, vec![7u32; 4]);
    assert_eq!(owned.device.to_vec().unwrap(), vec![1, 2, 3, 4]);
    // Empty ones finish at once, as an empty `transfer` does, and hand both buffers back
    // untouched.
    let (owned, _) = block_on_counted(manager.upload_owned(Vec::new(), owned.device, 4));
    assert_eq!(owned.result.unwrap().bytes, 0);
    assert!(owned.host.is_empty());
    let (owned, _) = block_on_counted(manager.download_owned(owned.device, 2, Vec::new()));
    assert_eq!(owned.result.unwrap().bytes, 0);
    assert_eq!(owned.device.to_vec().unwrap(), vec![1, 2, 3, 4]);
    let (owned, _) = block_on_counted(manager.upload_owned(Vec::new(), owned.device, 5));
    assert!(matches!(
        owned.result,
        Err(TransferError::OutOfRange { .. })
    ));
    assert_eq!(owned.device.to_vec().unwrap(), vec![1, 2, 3, 4]);
    // Refusals are not counted: the two transfers above are still the only ones.
    let class = SizeClass::of(data.len() * 4);
    assert_eq!(
        manager
            .stats()
            .get(TransferPath::PAGEABLE_TO_DEVICE, class)
            .failures,
        0
    );
}
