//! GPU tests of async transfers: bytes round-trip through `upload_async` / `download_async`
//! under a minimal executor, two transfers progress together, and bad ranges are refused before
//! anything is queued.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_test_support::require_gpu;
use cuweave_transfer::{StagingConfig, TransferError, TransferManager, TransferMethod};

/// Wakes the thread that polls.
struct ThreadWaker(Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `future` to completion on this thread, parking between polls; counts the polls.
fn block_on<F: Future>(future: F) -> (F::Output, usize) {
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    let mut polls = 0;
    loop {
        polls += 1;
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return (output, polls);
        }
        std::thread::park();
    }
}

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
    })
    .unwrap();
    let data = pattern((9 << 20) / 4 + 5);
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, data.len() + 3).unwrap();
    let (report, polls) = block_on(manager.upload_async(&data, &mut device, 3).unwrap());
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
    let (report, _) = block_on(manager.download_async(&device, 3, &mut back).unwrap());
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
    let (outcome, _) = block_on(both);
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
    let (report, polls) = block_on(manager.upload_async(&host[..0], &mut device, 32).unwrap());
    assert_eq!((report.unwrap().bytes, polls), (0, 1));
    assert!(device.to_vec().unwrap().iter().all(|&b| b == 0));
}
