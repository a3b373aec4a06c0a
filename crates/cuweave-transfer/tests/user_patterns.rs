//! GPU tests written as the programs users of cudarc, PyTorch data loaders and async inference
//! servers write: round trips at every size boundary of the planner and the stager (pageable
//! and pinned sources, typed elements, Pod structs, into ranges of device buffers at offsets),
//! many threads sharing one manager with exact statistics, transfers ordered after a user's
//! queued work, async and owned transfers under a plain executor (dropped mid-way, then the
//! buffers reused), bad input as typed errors, unified memory, zero-copy, and two-GPU paths.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::thread::Thread;

use cuweave_driver::{Context, Device, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;
use cuweave_transfer::{
    ChunkOrder, Destination, HostCopy, Location, ORDERED_FROM, POLL_BYTES, SizeClass, Source,
    StagingConfig, TWO_STREAMS_FROM, TransferError, TransferManager, TransferMethod, TransferPath,
};

mod common;
use common::{SENTINEL, bytes};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Asserts `whole` is `SENTINEL` outside `offset..offset + len` without printing megabytes.
fn assert_untouched_around(whole: &[u8], offset: usize, len: usize, what: &str) {
    assert!(
        whole[..offset].iter().all(|&b| b == SENTINEL),
        "{what}: bytes before the range changed"
    );
    assert!(
        whole[offset + len..].iter().all(|&b| b == SENTINEL),
        "{what}: bytes after the range changed"
    );
}

/// Asserts two byte slices are equal, naming the first difference instead of printing them.
fn assert_same(got: &[u8], expected: &[u8], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths differ");
    if got != expected {
        let first = (0..got.len()).find(|&i| got[i] != expected[i]).unwrap();
        panic!(
            "{what}: first wrong byte at {first} of {} ({:#04x}, expected {:#04x})",
            got.len(),
            got[first],
            expected[first]
        );
    }
}

/// Uploads `len` pattern bytes into a sentinel-filled device buffer at `offset` (by the plan,
/// or by `method`), downloads the range again the same way, and checks both the bytes and the
/// sentinel around them.
fn round_trip(
    manager: &TransferManager,
    context: &Arc<Context>,
    len: usize,
    offset: usize,
    method: Option<TransferMethod>,
) {
    let what = format!("{len} bytes at offset {offset} by {method:?}");
    let data = bytes(len, len as u64 ^ offset as u64);
    let mut device = DeviceBuffer::<u8>::new(context, offset + len + 9).unwrap();
    device.fill(SENTINEL).unwrap();
    let up = match method {
        None => manager.transfer(&data, Destination::device(&mut device, offset)),
        Some(m) => manager.transfer_with(m, &data, Destination::device(&mut device, offset)),
    }
    .unwrap_or_else(|e| panic!("{what}: upload failed: {e}"));
    assert_eq!(up.bytes, len, "{what}");
    let mut back = vec![0u8; len];
    let down = match method {
        None => manager.transfer(Source::device(&device, offset, len), &mut back),
        Some(m) => manager.transfer_with(m, Source::device(&device, offset, len), &mut back),
    }
    .unwrap_or_else(|e| panic!("{what}: download failed: {e}"));
    assert_eq!(down.bytes, len, "{what}");
    assert_same(&back, &data, &what);
    assert_untouched_around(&device.to_vec().unwrap(), offset, len, &what);
}

/// Sizes around every boundary of the planner and the stager: the size classes, the one-block
/// shortcut's bound and the chunk sizes the manager would use (±1), the ordered pipeline's
/// threshold, the two-stream threshold, odd sizes that are no multiple of 4.
fn boundary_sizes(manager: &TransferManager) -> Vec<usize> {
    let mut sizes = vec![
        1,
        3,
        4095,
        4097,
        64 * KIB - 1,
        64 * KIB,
        64 * KIB + 1,
        ORDERED_FROM - 1,
        ORDERED_FROM,
        ORDERED_FROM + 1,
        MIB - 1,
        MIB + 1,
        4 * MIB + 3,
        TWO_STREAMS_FROM - 1,
        TWO_STREAMS_FROM + 1,
    ];
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        for at in [256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB] {
            let chunk = manager.staging_for(path, 0, at).chunk_bytes;
            sizes.extend([chunk - 1, chunk, chunk + 1, 2 * chunk + 1, 3 * chunk - 1]);
        }
    }
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

#[test]
fn pageable_round_trips_are_exact_at_every_boundary_size_and_offset() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    for len in boundary_sizes(&manager) {
        // An offset that is no multiple of 4, as a cudarc user's `dst.slice_mut(3..)` has.
        round_trip(&manager, &gpu.context, len, 3, None);
        if len <= 4 * MIB + 3 {
            round_trip(
                &manager,
                &gpu.context,
                len,
                0,
                Some(TransferMethod::HostStaged),
            );
            round_trip(
                &manager,
                &gpu.context,
                len,
                1,
                Some(TransferMethod::DirectCopy),
            );
        }
    }
    // The largest class a data loader sends, once.
    let free = gpu.context.memory_info().unwrap().free;
    if free > 1 << 30 {
        round_trip(&manager, &gpu.context, 256 * MIB + 5, 7, None);
    }
}

#[test]
fn small_fixed_chunks_cut_odd_sizes_into_many_chunks_in_both_orders() {
    let gpu = require_gpu!();
    for order in [ChunkOrder::Ordered, ChunkOrder::Interleaved] {
        for host_copy in [HostCopy::Streaming, HostCopy::Cached] {
            let manager = TransferManager::with_staging(StagingConfig {
                chunk_bytes: 4 * KIB,
                depth: 2,
                threads: 3,
                host_copy,
                order,
            })
            .unwrap();
            for len in [
                4095,
                4096,
                4097,
                3 * 4096 + 1,
                ORDERED_FROM - 1,
                ORDERED_FROM + 4097,
                2 * MIB + 13,
            ] {
                round_trip(
                    &manager,
                    &gpu.context,
                    len,
                    5,
                    Some(TransferMethod::HostStaged),
                );
            }
        }
    }
}

#[test]
fn pinned_sources_and_destinations_round_trip_at_offsets() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    for len in [1, 4097, 64 * KIB + 1, MIB + 3, 9 * MIB + 1] {
        let data = bytes(len + 4, len as u64);
        let pinned = PinnedBuffer::from_slice(&gpu.context, &data).unwrap();
        let mut device = DeviceBuffer::<u8>::new(&gpu.context, len + 2).unwrap();
        device.fill(SENTINEL).unwrap();
        // From elements 3.. of the pinned buffer into elements 1.. of the device buffer.
        manager
            .transfer(
                Source::pinned(&pinned, 3, len),
                Destination::device(&mut device, 1),
            )
            .unwrap();
        let mut out = PinnedBuffer::<u8>::zeroed(&gpu.context, len + 6).unwrap();
        manager
            .transfer(
                Source::device(&device, 1, len),
                Destination::pinned(&mut out, 6),
            )
            .unwrap();
        let out = out.as_slice().unwrap();
        assert!(
            out[..6].iter().all(|&b| b == 0),
            "{len}: pinned head changed"
        );
        assert_same(&out[6..], &data[3..3 + len], &format!("pinned {len}"));
        assert_untouched_around(&device.to_vec().unwrap(), 1, len, "pinned -> device");
    }
}

/// A Pod struct with no padding, as a data loader's records are.
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Point {
    x: f32,
    y: f32,
    id: u32,
}

/// A 3-byte Pod struct: chunk sizes in bytes are no multiple of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Rgb {
    r: u8,
    g: u8,
    b: u8,
}

/// Uploads `data` into a fresh device buffer at element `offset` and downloads it again.
fn typed_round_trip<T>(manager: &TransferManager, context: &Arc<Context>, data: &[T], offset: usize)
where
    T: cuweave_memory::Element + PartialEq + std::fmt::Debug,
{
    let mut device = DeviceBuffer::<T>::zeroed(context, data.len() + offset + 1).unwrap();
    manager
        .transfer(data, Destination::device(&mut device, offset))
        .unwrap();
    let mut back = vec![T::zeroed(); data.len()];
    manager
        .transfer(Source::device(&device, offset, data.len()), &mut back)
        .unwrap();
    assert!(
        back == data,
        "{} elements of {} bytes at offset {offset} differ",
        data.len(),
        size_of::<T>()
    );
    let whole = device.to_vec().unwrap();
    assert!(whole[..offset].iter().all(|e| *e == T::zeroed()));
    assert_eq!(whole[offset + data.len()], T::zeroed());
}

#[test]
fn typed_elements_and_pod_structs_round_trip_through_every_pipeline() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    for n in [1, 1023, 65_537, 262_147, 1_048_579, 5_000_001] {
        let floats: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 7.0).collect();
        typed_round_trip(&manager, &gpu.context, &floats, 3);
        let doubles: Vec<f64> = (0..n).map(|i| (i as f64).sqrt()).collect();
        typed_round_trip(&manager, &gpu.context, &doubles, 1);
        let points: Vec<Point> = (0..n)
            .map(|i| Point {
                x: i as f32,
                y: -(i as f32),
                id: i as u32 ^ 0xA5A5,
            })
            .collect();
        typed_round_trip(&manager, &gpu.context, &points, 2);
        let pixels: Vec<Rgb> = (0..n)
            .map(|i| Rgb {
                r: i as u8,
                g: (i >> 8) as u8,
                b: (i >> 16) as u8,
            })
            .collect();
        typed_round_trip(&manager, &gpu.context, &pixels, 5);
    }
}

#[test]
fn eight_threads_share_one_manager_and_the_statistics_add_up_exactly() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    const THREADS: usize = 8;
    const ROUNDS: usize = 50;
    // Sizes of every class up to 2 MiB, most of them odd.
    let size_for = |thread: usize, round: usize| -> usize {
        let h = (thread * 7919 + round * 104_729) as u64;
        let h = h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        let exponent = (h % 22) as u32; // 1 B .. 2 MiB
        ((1usize << exponent) + (h as usize >> 5) % 977).max(1)
    };
    let expected_bytes: u64 = (0..THREADS)
        .flat_map(|t| (0..ROUNDS).map(move |r| (t, r)))
        .map(|(t, r)| size_for(t, r) as u64)
        .sum();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (manager, context) = (&manager, &gpu.context);
            scope.spawn(move || {
                for r in 0..ROUNDS {
                    let len = size_for(t, r);
                    let data = bytes(len, (t * 1000 + r) as u64);
                    let mut device = DeviceBuffer::<u8>::new(context, len + 4).unwrap();
                    manager
                        .transfer(&data, Destination::device(&mut device, 4))
                        .unwrap();
                    let mut back = vec![0u8; len];
                    manager
                        .transfer(Source::device(&device, 4, len), &mut back)
                        .unwrap();
                    assert_same(&back, &data, &format!("thread {t} round {r}"));
                }
            });
        }
    });
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        let (count, total, failures) = manager
            .stats()
            .snapshot()
            .into_iter()
            .filter(|(p, ..)| *p == path)
            .fold((0, 0, 0), |(c, b, f), (_, _, s)| {
                (c + s.count, b + s.bytes, f + s.failures)
            });
        assert_eq!(count, (THREADS * ROUNDS) as u64, "{path}");
        assert_eq!(total, expected_bytes, "{path}");
        assert_eq!(failures, 0, "{path}");
    }
    // Each class holds exactly the transfers of its sizes.
    let tiny = (0..THREADS)
        .flat_map(|t| (0..ROUNDS).map(move |r| size_for(t, r)))
        .filter(|&len| SizeClass::of(len) == SizeClass::Tiny)
        .count() as u64;
    assert_eq!(
        manager
            .stats()
            .get(TransferPath::PAGEABLE_TO_DEVICE, SizeClass::Tiny)
            .count,
        tiny
    );
    // Every transfer's lane went back: no more than the idle bound kept.
    assert!(manager.idle_lanes(0) <= cuweave_transfer::MAX_IDLE_LANES);
    manager.stats().reset();
    assert!(manager.stats().snapshot().is_empty());
}

#[test]
fn plans_name_the_path_and_size_class_a_transfer_then_records() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    for len in [1, 64 * KIB, 64 * KIB + 1, MIB, 16 * MIB + 1] {
        let plan = manager.plan(Location::PageableHost, Location::Device(0), len);
        assert_eq!(plan.path, TransferPath::PAGEABLE_TO_DEVICE);
        assert_eq!(plan.size_class, SizeClass::of(len));
        assert!(!plan.to_string().is_empty());
        let data = bytes(len, 1);
        let mut device = DeviceBuffer::<u8>::new(&gpu.context, len).unwrap();
        let report = manager.transfer(&data, &mut device).unwrap();
        assert_eq!(report.plan, plan, "the transfer ran the plan it was shown");
        assert_eq!(report.bytes, len);
        let stats = manager
            .stats()
            .get(TransferPath::PAGEABLE_TO_DEVICE, SizeClass::of(len));
        assert!(stats.count >= 1 && stats.bytes >= len as u64);
    }
    // A plan for pinned memory, and one forced: the report says what ran.
    let pinned = PinnedBuffer::from_slice(&gpu.context, &[1u32, 2, 3]).unwrap();
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, 3).unwrap();
    let report = manager
        .transfer_with(TransferMethod::DirectCopy, &pinned, &mut device)
        .unwrap();
    assert_eq!(report.plan.method, TransferMethod::DirectCopy);
    assert_eq!(report.plan.path, TransferPath::PINNED_TO_DEVICE);
    assert_eq!(device.to_vec().unwrap(), [1, 2, 3]);
    assert_eq!(
        manager
            .stats()
            .get(TransferPath::PINNED_TO_DEVICE, SizeClass::Tiny)
            .count,
        1
    );
}

#[test]
fn transfers_wait_for_work_the_user_queued_on_the_buffer() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    for len in [4 * KIB + 1, 8 * MIB + 1] {
        // Downloads: the user's fill lands only after a spin; the copy must wait for it.
        let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, len).unwrap();
        kernels.spin_ns(&stream, 20_000_000).unwrap();
        device.fill_async(0xAB, &stream).unwrap();
        let mut back = vec![0u8; len];
        manager.transfer(&device, &mut back).unwrap();
        assert!(
            back.iter().all(|&b| b == 0xAB),
            "{len}: the download read before the user's fill landed"
        );
        // Uploads: a write queued behind a spin comes first, the upload's bytes last.
        kernels.spin_ns(&stream, 20_000_000).unwrap();
        device.fill_async(0x11, &stream).unwrap();
        let data = bytes(len, 9);
        manager.transfer(&data, &mut device).unwrap();
        stream.synchronize().unwrap();
        assert_same(
            &device.to_vec().unwrap(),
            &data,
            &format!("{len}: upload after a queued fill"),
        );
    }
    // An async download waits for the queued fill too.
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, 3 * MIB / 4 + 1).unwrap();
    kernels.spin_ns(&stream, 20_000_000).unwrap();
    device.fill_async(0xDEAD_BEEF, &stream).unwrap();
    let mut back = vec![0u32; device.len()];
    block_on(manager.download_async(&device, 0, &mut back).unwrap()).unwrap();
    assert!(back.iter().all(|&v| v == 0xDEAD_BEEF));
}

#[test]
fn bad_input_is_a_typed_error_and_counts_nothing() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let host = vec![1u8; 100];
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, 64).unwrap();
    // cudarc's `htod_copy_into` with a destination too short.
    assert!(matches!(
        manager.transfer(&host, &mut device),
        Err(TransferError::OutOfRange {
            side: "destination",
            offset: 0,
            len: 100,
            capacity: 64
        })
    ));
    // `dtoh_sync_copy_into` with a host slice of the wrong length.
    let mut short = vec![0u8; 63];
    assert!(matches!(
        manager.transfer(&device, &mut short),
        Err(TransferError::LengthMismatch {
            source_len: 64,
            destination_len: 63
        })
    ));
    // A view past the end, and one whose end overflows.
    let mut out = vec![0u8; 8];
    assert!(matches!(
        manager.transfer(Source::device(&device, 60, 8), &mut out),
        Err(TransferError::OutOfRange { side: "source", .. })
    ));
    assert!(matches!(
        manager.transfer(Source::device(&device, usize::MAX - 2, 8), &mut out),
        Err(TransferError::OutOfRange { side: "source", .. })
    ));
    assert!(matches!(
        manager.transfer(&host[..8], Destination::device(&mut device, 57)),
        Err(TransferError::OutOfRange {
            side: "destination",
            ..
        })
    ));
    // Zero-length transfers: fine at any offset up to the end, refused past it.
    let empty: &[u8] = &[];
    let report = manager
        .transfer(empty, Destination::device(&mut device, 64))
        .unwrap();
    assert_eq!((report.bytes, report.gbps()), (0, 0.0));
    manager
        .transfer(Source::device(&device, 64, 0), &mut [0u8; 0][..])
        .unwrap();
    assert!(matches!(
        manager.transfer(empty, Destination::device(&mut device, 65)),
        Err(TransferError::OutOfRange { .. })
    ));
    // A method the path cannot use.
    assert!(matches!(
        manager.transfer_with(TransferMethod::PeerToPeer, &host[..64], &mut device),
        Err(TransferError::Unsupported { .. })
    ));
    assert!(matches!(
        manager.transfer_with(TransferMethod::ZeroCopy, &host[..64], &mut device),
        Err(TransferError::Unsupported { .. })
    ));
    // The async forms refuse the same ranges before queueing anything.
    assert!(matches!(
        manager.upload_async(&host, &mut device, 0),
        Err(TransferError::OutOfRange { .. })
    ));
    let mut long = vec![0u8; 65];
    assert!(matches!(
        manager.download_async(&device, 0, &mut long),
        Err(TransferError::OutOfRange { .. })
    ));
    // Nothing was counted, not even as a failure, and the device is untouched.
    assert!(
        manager
            .stats()
            .snapshot()
            .iter()
            .all(|(_, _, s)| s.count == 0 && s.failures == 0)
    );
    assert!(device.to_vec().unwrap().iter().all(|&b| b == 0));
}

#[test]
fn a_manager_refuses_devices_it_does_not_serve_on_every_entry_point() {
    let gpu = require_gpu!();
    // Serving no device at all: host copies still work, anything on device 0 is refused.
    let manager = TransferManager::for_devices(&[]).unwrap();
    assert_eq!(manager.device_count(), 0);
    let src = [1u8, 2, 3];
    let mut dst = [0u8; 3];
    manager.transfer(&src[..], &mut dst[..]).unwrap();
    assert_eq!(dst, src);
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, 3).unwrap();
    let unserved = |result: Result<_, TransferError>| {
        matches!(
            result,
            Err(TransferError::NoSuchDevice {
                device: 0,
                count: 0
            })
        )
    };
    assert!(unserved(manager.transfer(&src[..], &mut device).map(drop)));
    assert!(unserved(manager.transfer(&device, &mut dst[..]).map(drop)));
    assert!(unserved(
        manager
            .transfer_with(TransferMethod::HostStaged, &src[..], &mut device)
            .map(drop)
    ));
    // Even an empty transfer names the device.
    assert!(unserved(
        manager
            .transfer(&src[..0], Destination::device(&mut device, 0))
            .map(drop)
    ));
    assert!(unserved(
        manager.upload_async(&src, &mut device, 0).map(drop)
    ));
    assert!(unserved(
        manager.download_async(&device, 0, &mut dst).map(drop)
    ));
    // The owned forms hand both buffers back with the refusal.
    let owned = DeviceBuffer::<u8>::zeroed(&gpu.context, 3).unwrap();
    let refused = block_on(manager.upload_owned(src.to_vec(), owned, 0));
    assert!(unserved(refused.result.map(drop)));
    assert_eq!(refused.host, src);
    let refused = block_on(manager.download_owned(refused.device, 0, vec![5; 3]));
    assert!(unserved(refused.result.map(drop)));
    assert_eq!(refused.host, [5; 3]);
    assert_eq!(refused.device.to_vec().unwrap(), [0; 3]);
    let mut host = vec![0u8; 4096];
    assert!(unserved(manager.register_host(0, &mut host).map(drop)));
    assert!(!manager.is_open(0));
    assert_eq!(manager.idle_lanes(0), 0);
    // An ordinal past the driver's devices.
    let count = Device::count().unwrap();
    assert!(matches!(
        TransferManager::for_devices(&[0, count]),
        Err(TransferError::NoSuchDevice { device, .. }) if device == count
    ));
}

#[test]
fn managers_built_planned_and_dropped_open_no_device() {
    let _gpu = require_gpu!();
    for _ in 0..3 {
        let manager = TransferManager::for_devices(&[0]).unwrap();
        let _ = manager.plan(Location::PageableHost, Location::Device(0), 64 * MIB);
        let _ = manager.facts(Location::Unified(0), Location::Device(0));
        let _ = manager.registration_advice(
            cuweave_transfer::TransferDirection::HostToDevice,
            64 * MIB,
            10,
        );
        assert!(manager.stats().snapshot().is_empty());
        assert!(!manager.is_open(0));
        assert_eq!((manager.idle_lanes(0), manager.free_mark_words(0)), (0, 0));
        assert_eq!(manager.clear_cache(), 0);
    }
}

/// Wakes the thread that polls.
struct ThreadWaker(Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `future` to completion on this thread, parking between polls.
fn block_on<F: Future>(future: F) -> F::Output {
    let mut futures = vec![Box::pin(future)];
    join_all(&mut futures).pop().unwrap()
}

/// Polls every future until all are ready, as `futures::join_all` does; parks while all wait.
fn join_all<F: Future + ?Sized>(futures: &mut [Pin<Box<F>>]) -> Vec<F::Output> {
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = TaskContext::from_waker(&waker);
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    while outputs.iter().any(Option::is_none) {
        for (future, output) in futures.iter_mut().zip(&mut outputs) {
            if output.is_none()
                && let Poll::Ready(value) = future.as_mut().poll(&mut cx)
            {
                *output = Some(value);
            }
        }
        if outputs.iter().any(Option::is_none) {
            std::thread::park_timeout(std::time::Duration::from_millis(50));
        }
    }
    outputs.into_iter().map(Option::unwrap).collect()
}

/// Polls `future` `polls` times (it must still be pending after them).
fn poll_a_few<F: Future + Unpin>(future: &mut F, polls: usize) {
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = TaskContext::from_waker(&waker);
    for _ in 0..polls {
        assert!(
            Pin::new(&mut *future).poll(&mut cx).is_pending(),
            "finished too soon to drop mid-way"
        );
    }
}

type Boxed<'a> = Pin<Box<dyn Future<Output = cuweave_transfer::Result<usize>> + 'a>>;

#[test]
fn concurrent_async_uploads_and_downloads_of_every_size_round_trip() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let sizes = [
        0,
        1,
        5,
        POLL_BYTES - 1,
        POLL_BYTES + 1,
        MIB - 1,
        MIB,
        MIB + 1,
        3 * MIB + 5,
    ];
    let data: Vec<Vec<u8>> = sizes.iter().map(|&n| bytes(n, n as u64 + 3)).collect();
    let mut devices: Vec<DeviceBuffer<u8>> = sizes
        .iter()
        .map(|&n| {
            let mut d = DeviceBuffer::<u8>::new(&gpu.context, n + 2).unwrap();
            d.fill(SENTINEL).unwrap();
            d
        })
        .collect();
    // An inference server's tasks, all in flight at once on one executor thread.
    let mut uploads: Vec<Boxed<'_>> = data
        .iter()
        .zip(devices.iter_mut())
        .map(|(src, dst)| {
            let transfer = manager.upload_async(src, dst, 1).unwrap();
            Box::pin(async move { transfer.await.map(|report| report.bytes) }) as Boxed<'_>
        })
        .collect();
    for (moved, &n) in join_all(&mut uploads).into_iter().zip(&sizes) {
        assert_eq!(moved.unwrap(), n);
    }
    drop(uploads);
    let mut backs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    let mut downloads: Vec<Boxed<'_>> = devices
        .iter()
        .zip(backs.iter_mut())
        .map(|(src, dst)| {
            let transfer = manager.download_async(src, 1, dst).unwrap();
            Box::pin(async move { transfer.await.map(|report| report.bytes) }) as Boxed<'_>
        })
        .collect();
    for (moved, &n) in join_all(&mut downloads).into_iter().zip(&sizes) {
        assert_eq!(moved.unwrap(), n);
    }
    drop(downloads);
    for ((back, expected), device) in backs.iter().zip(&data).zip(&devices) {
        let what = format!("async {} bytes", expected.len());
        assert_same(back, expected, &what);
        assert_untouched_around(&device.to_vec().unwrap(), 1, expected.len(), &what);
    }
    // Typed: f64 with a short last chunk.
    let doubles: Vec<f64> = (0..(MIB / 8) * 3 + 7).map(|i| i as f64 * 1.5).collect();
    let mut device = DeviceBuffer::<f64>::zeroed(&gpu.context, doubles.len()).unwrap();
    block_on(manager.upload_async(&doubles, &mut device, 0).unwrap()).unwrap();
    let mut back = vec![0f64; doubles.len()];
    block_on(manager.download_async(&device, 0, &mut back).unwrap()).unwrap();
    assert!(back == doubles);
}

#[test]
fn dropping_async_transfers_mid_way_leaves_the_buffers_reusable() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let len = 8 * MIB + 3;
    let first = bytes(len, 1);
    let second = bytes(len, 2);
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, len).unwrap();
    for _ in 0..3 {
        // A request cancelled by its client: the upload future is dropped after a few polls.
        let mut upload = manager.upload_async(&first, &mut device, 0).unwrap();
        poll_a_few(&mut upload, 40);
        drop(upload);
        // The same buffers serve the next request, which must see only its own bytes.
        manager.transfer(&second, &mut device).unwrap();
        let mut back = vec![0u8; len];
        manager.transfer(&device, &mut back).unwrap();
        assert_same(&back, &second, "after a dropped upload");
        // A cancelled download, then the host buffer reused for a whole one.
        let mut download = manager.download_async(&device, 0, &mut back).unwrap();
        poll_a_few(&mut download, 40);
        drop(download);
        back.fill(0);
        block_on(manager.download_async(&device, 0, &mut back).unwrap()).unwrap();
        assert_same(&back, &second, "after a dropped download");
        // Polled before dropping not at all: nothing happens.
        drop(manager.upload_async(&first, &mut device, 0).unwrap());
        assert_same(
            &device.to_vec().unwrap(),
            &second,
            "after an unpolled upload",
        );
    }
}

#[test]
fn owned_transfers_run_concurrently_and_hand_every_buffer_back() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let sizes = [1usize, 4097, MIB + 1, 6 * MIB + 7, 17 * MIB + 3];
    let mut uploads: Vec<_> = sizes
        .iter()
        .map(|&n| {
            let device = DeviceBuffer::<u8>::zeroed(&gpu.context, n + 3).unwrap();
            Box::pin(manager.upload_owned(bytes(n, n as u64), device, 3))
        })
        .collect();
    let returned = join_all(&mut uploads);
    let mut downloads: Vec<_> = returned
        .into_iter()
        .zip(&sizes)
        .map(|(owned, &n)| {
            assert_eq!(owned.result.unwrap().bytes, n);
            assert_same(&owned.host, &bytes(n, n as u64), "the upload's host vec");
            // The host vec is reused for the download, as a server reuses its batch buffers.
            let mut host = owned.host;
            host.fill(0);
            Box::pin(manager.download_owned(owned.device, 3, host))
        })
        .collect();
    for (owned, &n) in join_all(&mut downloads).into_iter().zip(&sizes) {
        assert_eq!(owned.result.unwrap().bytes, n);
        assert_same(&owned.host, &bytes(n, n as u64), "owned round trip");
        assert_eq!(owned.device.len(), n + 3);
        assert_eq!(owned.device.to_vec().unwrap()[..3], [0, 0, 0]);
    }
    // Typed, and a dropped one: it finishes in the background, later ones are unaffected.
    let data: Vec<f32> = (0..MIB + 1).map(|i| i as f32).collect();
    let device = DeviceBuffer::<f32>::zeroed(&gpu.context, data.len()).unwrap();
    drop(manager.upload_owned(data.clone(), device, 0));
    let device = DeviceBuffer::<f32>::zeroed(&gpu.context, data.len()).unwrap();
    let owned = block_on(manager.upload_owned(data.clone(), device, 0));
    owned.result.unwrap();
    assert!(owned.device.to_vec().unwrap() == data);
}

#[test]
fn registered_host_memory_serves_repeated_uploads_then_unregisters() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let len = 2 * MIB + 1;
    let mut backing = bytes(len, 4);
    // What the registered memory should hold after each step.
    let mut model = backing.clone();
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, len).unwrap();
    {
        let mut registered = manager.register_host(0, &mut backing).unwrap();
        for round in 0..3u8 {
            registered.as_mut_slice()[0] = round;
            model[0] = round;
            manager.transfer(&registered, &mut device).unwrap();
            let mut back = vec![0u8; len];
            manager.transfer(&device, &mut back).unwrap();
            assert_same(&back, &model, "registered upload");
            // Device bytes 1..11 back into the registered memory at 100.
            manager
                .transfer(
                    Source::device(&device, 1, 10),
                    Destination::registered(&mut registered, 100),
                )
                .unwrap();
            model.copy_within(1..11, 100);
            assert_same(registered.as_slice(), &model, "registered download");
        }
        registered.unregister().unwrap();
    }
    assert_same(&backing, &model, "after unregistering");
}

#[test]
fn unified_memory_round_trips_where_the_device_supports_it() {
    let gpu = require_gpu!();
    let caps = gpu.device.capabilities().unwrap();
    if !caps.managed_memory {
        cuweave_test_support::skip(
            "unified_memory_round_trips_where_the_device_supports_it",
            "the device has no managed memory",
        );
        return;
    }
    let manager = TransferManager::new().unwrap();
    let facts = manager.facts(Location::PageableHost, Location::Unified(0));
    assert_eq!(facts.managed_prefetch, caps.concurrent_managed_access);
    let len = MIB + 3;
    assert!(gpu.context.memory_info().unwrap().free > 64 * MIB);
    let data = bytes(len, 6);
    let mut unified = UnifiedBuffer::<u8>::zeroed(&gpu.context, len + 4).unwrap();
    let mut methods = vec![None, Some(TransferMethod::DirectCopy)];
    if caps.concurrent_managed_access {
        methods.push(Some(TransferMethod::UnifiedMemory));
    } else {
        assert!(matches!(
            manager.transfer_with(
                TransferMethod::UnifiedMemory,
                &data,
                Destination::unified(&mut unified, 4)
            ),
            Err(TransferError::Unsupported { .. })
        ));
    }
    for method in methods {
        unified.fill(0).unwrap();
        let into = Destination::unified(&mut unified, 4);
        match method {
            None => manager.transfer(&data, into),
            Some(m) => manager.transfer_with(m, &data, into),
        }
        .unwrap();
        let mut back = vec![0u8; len];
        let from = Source::unified(&unified, 4, len);
        match method {
            None => manager.transfer(from, &mut back),
            Some(m) => manager.transfer_with(m, from, &mut back),
        }
        .unwrap();
        assert_same(&back, &data, &format!("unified by {method:?}"));
        // Unified to device and back to unified at other offsets.
        let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, len).unwrap();
        manager
            .transfer(Source::unified(&unified, 4, len), &mut device)
            .unwrap();
        assert_same(&device.to_vec().unwrap(), &data, "unified -> device");
        let mut other = UnifiedBuffer::<u8>::zeroed(&gpu.context, len + 1).unwrap();
        manager
            .transfer(&device, Destination::unified(&mut other, 1))
            .unwrap();
        let mut whole = vec![0u8; len + 1];
        manager.transfer(&other, &mut whole).unwrap();
        assert_eq!(whole[0], 0);
        assert_same(&whole[1..], &data, "device -> unified");
    }
}

#[test]
fn zero_copy_moves_pinned_ranges_where_the_device_maps_host_memory() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let facts = manager.facts(Location::PinnedHost(0), Location::Device(0));
    let data = bytes(MIB + 5, 8);
    let pinned = PinnedBuffer::from_slice(&gpu.context, &data).unwrap();
    let mut device = DeviceBuffer::<u8>::new(&gpu.context, data.len()).unwrap();
    device.fill(SENTINEL).unwrap();
    let forced = manager.transfer_with(
        TransferMethod::ZeroCopy,
        Source::pinned(&pinned, 1, MIB + 1),
        Destination::device(&mut device, 2),
    );
    if !facts.map_host_memory {
        assert!(matches!(forced, Err(TransferError::Unsupported { .. })));
        return;
    }
    forced.unwrap();
    let whole = device.to_vec().unwrap();
    assert_same(&whole[2..MIB + 3], &data[1..MIB + 2], "zero-copy upload");
    assert_untouched_around(&whole, 2, MIB + 1, "zero-copy upload");
    let mut out = PinnedBuffer::<u8>::zeroed(&gpu.context, MIB + 4).unwrap();
    manager
        .transfer_with(
            TransferMethod::ZeroCopy,
            Source::device(&device, 2, MIB + 1),
            Destination::pinned(&mut out, 3),
        )
        .unwrap();
    assert_same(
        &out.as_slice().unwrap()[3..],
        &data[1..MIB + 2],
        "zero-copy download",
    );
}

#[test]
fn two_devices_exchange_bytes_by_every_path_they_offer() {
    let gpu = require_gpu!();
    let count = Device::count().unwrap();
    if count < 2 {
        cuweave_test_support::skip(
            "two_devices_exchange_bytes_by_every_path_they_offer",
            "needs two GPUs, this machine has one",
        );
        return;
    }
    let other = Context::primary(Device::get(1).unwrap()).unwrap();
    let manager = TransferManager::new().unwrap();
    let facts = manager.facts(Location::Device(0), Location::Device(1));
    let mut methods = vec![
        None,
        Some(TransferMethod::DirectCopy),
        Some(TransferMethod::HostStaged),
    ];
    if facts.peer_access {
        methods.push(Some(TransferMethod::PeerToPeer));
    }
    for len in [1, 4097, MIB + 3, 9 * MIB + 1] {
        let data = bytes(len, len as u64);
        let source = DeviceBuffer::from_slice(&gpu.context, &data).unwrap();
        for &method in &methods {
            let mut target = DeviceBuffer::<u8>::new(&other, len + 3).unwrap();
            target.fill(SENTINEL).unwrap();
            let into = Destination::device(&mut target, 3);
            let report = match method {
                None => manager.transfer(&source, into),
                Some(m) => manager.transfer_with(m, &source, into),
            }
            .unwrap();
            assert!(report.plan.path.cross_device);
            let whole = target.to_vec().unwrap();
            let what = format!("{len} bytes 0 -> 1 by {method:?}");
            assert_same(&whole[3..], &data, &what);
            assert_untouched_around(&whole, 3, len, &what);
            // The same between views of the two devices' buffers.
            target.fill(SENTINEL).unwrap();
            let (from, into) = (source.slice(..).unwrap(), target.slice_mut(3..).unwrap());
            match method {
                None => manager.transfer(from, into),
                Some(m) => manager.transfer_with(m, from, into),
            }
            .unwrap();
            let whole = target.to_vec().unwrap();
            assert_same(&whole[3..], &data, &format!("views: {what}"));
            assert_untouched_around(&whole, 3, len, &what);
        }
    }
    // A manager limited to device 1 refuses device 0's buffers.
    let limited = TransferManager::for_devices(&[1]).unwrap();
    let source = DeviceBuffer::<u8>::zeroed(&gpu.context, 4).unwrap();
    let mut target = DeviceBuffer::<u8>::zeroed(&other, 4).unwrap();
    assert!(matches!(
        limited.transfer(&source, &mut target),
        Err(TransferError::NoSuchDevice { device: 0, .. })
    ));
}

#[test]
fn async_transfers_are_counted_in_the_statistics_when_they_complete() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let sizes = [1usize, POLL_BYTES + 3, MIB + 1];
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, MIB + 1).unwrap();
    for &n in &sizes {
        let data = bytes(n, 11);
        let report = block_on(manager.upload_async(&data, &mut device, 0).unwrap()).unwrap();
        assert_eq!(report.bytes, n);
        let mut back = vec![0u8; n];
        block_on(manager.download_async(&device, 0, &mut back).unwrap()).unwrap();
        assert_same(&back, &data, "counted async round trip");
    }
    // An empty one is not counted, as an empty blocking transfer is not.
    block_on(manager.upload_async(&[], &mut device, 0).unwrap()).unwrap();
    // Nor is one dropped before it completes.
    let data = bytes(MIB + 1, 12);
    let mut cancelled = manager.upload_async(&data, &mut device, 0).unwrap();
    poll_a_few(&mut cancelled, 3);
    drop(cancelled);
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        let (count, total) = manager
            .stats()
            .snapshot()
            .into_iter()
            .filter(|(p, ..)| *p == path)
            .fold((0, 0), |(c, b), (_, _, s)| (c + s.count, b + s.bytes));
        assert_eq!(
            count,
            sizes.len() as u64,
            "{path}: every async transfer counted"
        );
        assert_eq!(total, sizes.iter().sum::<usize>() as u64, "{path}");
        for &n in &sizes {
            let stats = manager.stats().get(path, SizeClass::of(n));
            assert!(stats.count >= 1 && stats.failures == 0 && stats.best_gbps > 0.0);
        }
    }
}

#[test]
fn views_of_buffers_are_sources_and_destinations_as_cudarc_slices_are() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    for len in [1usize, 4097, MIB + 3, 9 * MIB + 1] {
        let data = bytes(len, 21);
        let methods = [
            None,
            Some(TransferMethod::DirectCopy),
            Some(TransferMethod::HostStaged),
        ];
        for method in methods {
            let what = format!("{len} bytes through views by {method:?}");
            let mut device = DeviceBuffer::<u8>::new(&gpu.context, len + 8).unwrap();
            device.fill(SENTINEL).unwrap();
            // `htod_copy_into(&host, &mut device.slice_mut(3..3 + len))`.
            let into = device.slice_mut(3..3 + len).unwrap();
            match method {
                None => manager.transfer(&data, into),
                Some(m) => manager.transfer_with(m, &data, into),
            }
            .unwrap();
            assert_untouched_around(&device.to_vec().unwrap(), 3, len, &what);
            // `dtoh_sync_copy_into(&device.slice(3..3 + len), &mut host)`.
            let mut back = vec![0u8; len];
            let from = device.slice(3..3 + len).unwrap();
            let report = match method {
                None => manager.transfer(from, &mut back),
                Some(m) => manager.transfer_with(m, from, &mut back),
            }
            .unwrap();
            assert_eq!(report.bytes, len);
            assert_eq!(report.plan.path, TransferPath::DEVICE_TO_PAGEABLE);
            assert_same(&back, &data, &what);
        }
        // View to buffer, buffer to view and view to view on one device.
        let mut device = DeviceBuffer::<u8>::new(&gpu.context, len + 8).unwrap();
        device.fill(SENTINEL).unwrap();
        manager
            .transfer(&data, Destination::device(&mut device, 3))
            .unwrap();
        let mut copy = DeviceBuffer::<u8>::new(&gpu.context, len + 2).unwrap();
        copy.fill(SENTINEL).unwrap();
        manager
            .transfer(
                device.slice(3..3 + len).unwrap(),
                Destination::device(&mut copy, 2),
            )
            .unwrap();
        let mut other = DeviceBuffer::<u8>::new(&gpu.context, len + 1).unwrap();
        other.fill(SENTINEL).unwrap();
        manager
            .transfer(Source::device(&copy, 2, len), other.slice_mut(1..).unwrap())
            .unwrap();
        let mut last = DeviceBuffer::<u8>::new(&gpu.context, len).unwrap();
        manager
            .transfer(other.slice(1..).unwrap(), last.slice_mut(..).unwrap())
            .unwrap();
        assert_same(
            &last.to_vec().unwrap(),
            &data,
            "view -> buffer -> view -> view",
        );
        assert_untouched_around(&copy.to_vec().unwrap(), 2, len, "view -> buffer");
        assert_untouched_around(&other.to_vec().unwrap(), 1, len, "buffer -> view");
        // Pinned memory to a view and a view to pinned memory.
        let pinned = PinnedBuffer::from_slice(&gpu.context, &data).unwrap();
        let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, len + 1).unwrap();
        manager
            .transfer(&pinned, device.slice_mut(1..).unwrap())
            .unwrap();
        let mut out = PinnedBuffer::<u8>::zeroed(&gpu.context, len).unwrap();
        manager
            .transfer(device.slice(1..).unwrap(), &mut out)
            .unwrap();
        assert_same(&out.as_slice().unwrap(), &data, "pinned <-> view");
    }
    // A view longer than the source is written from its start; a shorter one is refused.
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, 10).unwrap();
    manager
        .transfer(&[7u32, 8, 9][..], device.slice_mut(2..8).unwrap())
        .unwrap();
    assert_eq!(device.to_vec().unwrap(), [0, 0, 7, 8, 9, 0, 0, 0, 0, 0]);
    assert!(matches!(
        manager.transfer(&[1u32; 4][..], device.slice_mut(8..).unwrap()),
        Err(TransferError::OutOfRange {
            side: "destination",
            len: 4,
            capacity: 2,
            ..
        })
    ));
    let mut short = [0u32; 2];
    assert!(matches!(
        manager.transfer(device.slice(..3).unwrap(), &mut short[..]),
        Err(TransferError::LengthMismatch {
            source_len: 3,
            destination_len: 2
        })
    ));
    // A typed view of f32 at an offset, into a host Vec.
    let floats: Vec<f32> = (0..1000).map(|i| i as f32 / 3.0).collect();
    let mut device = DeviceBuffer::<f32>::from_slice(&gpu.context, &floats).unwrap();
    let mut back = vec![0f32; 500];
    manager
        .transfer(device.slice(250..750).unwrap(), &mut back)
        .unwrap();
    assert!(back[..] == floats[250..750]);
    // A manager that does not serve the view's device refuses it.
    let none = TransferManager::for_devices(&[]).unwrap();
    assert!(matches!(
        none.transfer(&floats[..4], device.slice_mut(..4).unwrap()),
        Err(TransferError::NoSuchDevice { device: 0, .. })
    ));
}

#[test]
fn a_data_loader_moves_large_and_small_batches_both_ways_at_once() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let sizes = [
        1usize,
        300_001,
        5 * MIB + 3,
        17 * MIB + 1,
        33 * MIB + 5,
        70 * MIB + 7,
    ];
    let batches: Vec<Vec<u8>> = sizes.iter().map(|&n| bytes(n, n as u64 * 3)).collect();
    // Device copies of every batch, for the downloads that run beside the uploads.
    let resident: Vec<DeviceBuffer<u8>> = batches
        .iter()
        .map(|b| DeviceBuffer::from_slice(&gpu.context, b).unwrap())
        .collect();
    for round in 0..2 {
        std::thread::scope(|scope| {
            for (i, batch) in batches.iter().enumerate() {
                let (manager, context, resident) = (&manager, &gpu.context, &resident[i]);
                // Blocking uploads on the loader threads...
                scope.spawn(move || {
                    let mut device = DeviceBuffer::<u8>::new(context, batch.len()).unwrap();
                    manager.transfer(batch, &mut device).unwrap();
                    assert_same(&device.to_vec().unwrap(), batch, "loader upload");
                });
                // ...blocking downloads of other batches beside them...
                scope.spawn(move || {
                    let mut back = vec![0u8; resident.len()];
                    manager.transfer(resident, &mut back).unwrap();
                    assert_same(&back, batch, "loader download");
                });
                // ...and owned uploads, which run their pipelines on the staging workers.
                if round == 1 {
                    scope.spawn(move || {
                        let device = DeviceBuffer::<u8>::new(context, batch.len()).unwrap();
                        let owned = block_on(manager.upload_owned(batch.clone(), device, 0));
                        owned.result.unwrap();
                        assert_same(&owned.device.to_vec().unwrap(), batch, "owned upload");
                    });
                }
            }
        });
    }
    let (count, total) = manager
        .stats()
        .snapshot()
        .into_iter()
        .fold((0, 0), |(c, b), (_, _, s)| (c + s.count, b + s.bytes));
    // Every blocking transfer is counted once (two rounds, both ways), and every owned upload
    // (the second round's) once its buffers came back.
    assert_eq!(count, (2 * 2 + 1) * sizes.len() as u64);
    assert_eq!(total, (2 * 2 + 1) * sizes.iter().sum::<usize>() as u64);
}
