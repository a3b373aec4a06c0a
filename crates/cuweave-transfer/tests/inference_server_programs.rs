//! GPU tests written as an inference server and its data loaders use a transfer manager: many
//! threads moving odd-sized, unaligned sub-slices of shared `Vec`s to and from one device at
//! once (around every chunk boundary, at offset 0 and at the end of the buffer, through views),
//! managers with odd fixed staging configurations running side by side, request handlers that
//! upload, run a kernel and download as futures on several executor threads, futures dropped or
//! forgotten at every stage of their work, statistics and lanes that stay exact and bounded,
//! calibration files that are broken or from another machine, plans that say where their
//! figures came from, and client errors that come back typed before anything moves.
//!
//! No executor is among the crate's dev-dependencies, so a minimal one (`block_on`, `join_all`)
//! is written here, as in the crate's other async tests.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use cuweave_driver::{LaunchConfig, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer, TrackedLaunch, UnifiedBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, sanitizer_active};
use cuweave_transfer::{
    CalibrationTable, ChunkOrder, DEFAULT_MACHINE, Destination, HostCopy, Location, MARKED_STREAMS,
    MAX_IDLE_LANES, MAX_WORKERS, Measure, ORDERED_FROM, POLL_BYTES, PlanReason, SizeClass, Source,
    StagingConfig, TWO_STREAMS_FROM, TransferError, TransferManager, TransferMethod, TransferPath,
};

mod common;
use common::bytes;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// What memory outside the range a transfer writes is filled with.
const SENTINEL: u8 = 0xEE;
/// A page of sentinels, to compare long ranges with `memcmp` rather than byte by byte (the
/// tests run in debug builds too).
static SENTINELS: [u8; 4096] = [SENTINEL; 4096];

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// `len` pattern `u16`s, different for each `seed`.
fn words16(len: usize, seed: u64) -> Vec<u16> {
    bytes(2 * len, seed)
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// `len` pattern `u32`s, different for each `seed`.
fn words32(len: usize, seed: u64) -> Vec<u32> {
    bytes(4 * len, seed)
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Whether every byte of `range` is [`SENTINEL`].
fn all_sentinel(range: &[u8]) -> bool {
    range
        .chunks(SENTINELS.len())
        .all(|chunk| chunk == &SENTINELS[..chunk.len()])
}

/// Asserts `got == expected`, naming the first difference instead of printing megabytes.
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

/// Asserts `whole` holds `expected` at `offset` and [`SENTINEL`] everywhere else.
fn assert_placed(whole: &[u8], offset: usize, expected: &[u8], what: &str) {
    let end = offset + expected.len();
    assert!(
        all_sentinel(&whole[..offset]),
        "{what}: bytes before the range changed"
    );
    assert!(
        all_sentinel(&whole[end..]),
        "{what}: bytes after the range changed"
    );
    assert_same(&whole[offset..end], expected, what);
}

/// Wakes the thread that polls.
struct ThreadWaker(Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls every future until all are ready, as `futures::join_all` does; parks while all wait.
/// The park has a timeout, so a lost wake-up shows as a slow test, not a hang; a future that
/// never finishes within `LIMIT` fails the test.
fn join_all<F: Future + ?Sized>(futures: &mut [Pin<Box<F>>]) -> Vec<F::Output> {
    const LIMIT: Duration = Duration::from_secs(60);
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = TaskContext::from_waker(&waker);
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    let start = Instant::now();
    while outputs.iter().any(Option::is_none) {
        for (future, output) in futures.iter_mut().zip(&mut outputs) {
            if output.is_none()
                && let Poll::Ready(value) = future.as_mut().poll(&mut cx)
            {
                *output = Some(value);
            }
        }
        if outputs.iter().any(Option::is_none) {
            assert!(
                start.elapsed() < LIMIT,
                "futures still pending after {LIMIT:?}"
            );
            std::thread::park_timeout(Duration::from_millis(20));
        }
    }
    outputs.into_iter().map(Option::unwrap).collect()
}

/// Polls one future to completion on this thread.
fn block_on<F: Future>(future: F) -> F::Output {
    let mut futures = vec![Box::pin(future)];
    join_all(&mut futures).pop().unwrap()
}

/// Polls `future` once with a waker that does nothing; whether it finished.
fn poll_once<F: Future + Unpin>(future: &mut F) -> Option<F::Output> {
    let mut cx = TaskContext::from_waker(Waker::noop());
    match Pin::new(future).poll(&mut cx) {
        Poll::Ready(output) => Some(output),
        Poll::Pending => None,
    }
}

/// Sizes around the boundaries of the planner and the stager for `manager` on device 0: the
/// one-block bound, the chunks its configuration picks per size (±1), the ordered threshold,
/// odd sizes. Capped at `most`.
fn boundary_sizes(manager: &TransferManager, most: usize) -> Vec<usize> {
    let mut sizes = vec![
        1,
        2,
        3,
        63,
        64,
        65,
        4095,
        4096,
        4097,
        64 * KIB - 1,
        64 * KIB,
        64 * KIB + 1,
        ORDERED_FROM - 1,
        ORDERED_FROM,
        ORDERED_FROM + 1,
        MIB - 1,
        MIB + 1,
        4 * MIB + 5,
    ];
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        for at in [256 * KIB, MIB, 4 * MIB] {
            let chunk = manager.staging_for(path, 0, at).chunk_bytes;
            sizes.extend([chunk - 1, chunk, chunk + 1, 2 * chunk + 1, 3 * chunk - 1]);
        }
    }
    sizes.retain(|&s| s >= 1 && s <= most);
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

// ---------------------------------------------------------------------------------------------
// Blocking transfers from many threads
// ---------------------------------------------------------------------------------------------

#[test]
fn twelve_threads_move_unaligned_sub_slices_of_shared_vecs_at_every_boundary_and_every_byte_lands()
{
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    const THREADS: usize = 12;
    let sizes = boundary_sizes(&manager, 9 * MIB);
    let most = *sizes.last().unwrap();
    // One request buffer shared by every handler thread, read through unaligned sub-slices.
    let shared = bytes(most + 4096, 0xC0FFEE);
    let moved = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (manager, context, shared, sizes, moved) =
                (&manager, &gpu.context, &shared, &sizes, &moved);
            scope.spawn(move || {
                let capacity = most + 129;
                let mut device = DeviceBuffer::<u8>::new(context, capacity).unwrap();
                // Each thread walks the sizes in its own order, so that every size meets others.
                for k in 0..sizes.len() {
                    let i = (k * 7 + t * 5) % sizes.len();
                    let len = sizes[i];
                    // Odd host starts: the source is never aligned to anything.
                    let start = 1 + (t * 37 + i * 13) % 2047;
                    let source = &shared[start..start + len];
                    // Device offset 0, the last `len` bytes, or an odd offset in between.
                    let offset = match (t + i) % 3 {
                        0 => 0,
                        1 => capacity - len,
                        _ => 17,
                    };
                    let what = format!(
                        "thread {t}: {len} bytes from host +{start} to device +{offset} ({})",
                        if (t + k) % 2 == 0 { "buffer" } else { "view" }
                    );
                    device.fill(SENTINEL).unwrap();
                    let up = if (t + k) % 2 == 0 {
                        manager.transfer(source, Destination::device(&mut device, offset))
                    } else {
                        let view = device.slice_mut(offset..offset + len).unwrap();
                        manager.transfer(source, view)
                    }
                    .unwrap_or_else(|e| panic!("{what}: upload failed: {e}"));
                    assert_eq!(up.bytes, len, "{what}");
                    // Into an odd sub-slice of a larger host Vec, guarded by sentinels.
                    let pad = 1 + (t * 11 + i) % 63;
                    let mut back = vec![SENTINEL; len + 2 * pad];
                    let into = &mut back[pad..pad + len];
                    let down = if (t + k) % 3 == 0 {
                        manager.transfer(device.slice(offset..offset + len).unwrap(), into)
                    } else {
                        manager.transfer(Source::device(&device, offset, len), into)
                    }
                    .unwrap_or_else(|e| panic!("{what}: download failed: {e}"));
                    assert_eq!(down.bytes, len, "{what}");
                    assert_placed(&back, pad, source, &format!("{what}, host side"));
                    // The device around the range: checked for the smaller sizes every time,
                    // for the larger ones now and then (a whole-buffer read is 9 MiB).
                    if len <= MIB || k % 4 == t % 4 {
                        let whole = device.to_vec().unwrap();
                        assert_placed(&whole, offset, source, &format!("{what}, device side"));
                    }
                    moved.fetch_add(2 * len, Ordering::Relaxed);
                }
            });
        }
    });
    let total: u64 = manager
        .stats()
        .snapshot()
        .iter()
        .map(|(_, _, s)| s.bytes)
        .sum();
    assert_eq!(total, moved.load(Ordering::Relaxed) as u64);
    assert!(manager.idle_lanes(0) <= MAX_IDLE_LANES);
}

#[test]
fn managers_with_odd_fixed_staging_run_side_by_side_and_move_u16_sub_slices_exactly() {
    let gpu = require_gpu!();
    let configs = [
        // One page per chunk, every participant the pool allows.
        StagingConfig {
            chunk_bytes: 4096,
            depth: 1,
            threads: MAX_WORKERS + 1,
            host_copy: HostCopy::Streaming,
            order: ChunkOrder::Ordered,
        },
        // A chunk that is no whole number of u16s.
        StagingConfig {
            chunk_bytes: 4097,
            depth: 2,
            threads: 3,
            host_copy: HostCopy::Cached,
            order: ChunkOrder::Interleaved,
        },
        StagingConfig {
            chunk_bytes: 64 * KIB + 6,
            depth: 64,
            threads: 2,
            host_copy: HostCopy::Streaming,
            order: ChunkOrder::Ordered,
        },
        StagingConfig {
            chunk_bytes: 3 * MIB + 2,
            depth: 3,
            threads: 5,
            host_copy: HostCopy::Streaming,
            order: ChunkOrder::Interleaved,
        },
        StagingConfig {
            chunk_bytes: 12 * KIB,
            depth: 2,
            threads: 1,
            host_copy: HostCopy::Cached,
            order: ChunkOrder::Ordered,
        },
        StagingConfig {
            chunk_bytes: MIB,
            depth: 1,
            threads: 8,
            host_copy: HostCopy::Cached,
            order: ChunkOrder::Ordered,
        },
    ];
    std::thread::scope(|scope| {
        for (c, config) in configs.iter().enumerate() {
            let context = &gpu.context;
            scope.spawn(move || {
                let manager = TransferManager::with_staging(*config).unwrap();
                assert_eq!(manager.fixed_staging(), Some(*config));
                let chunk = config.chunk_elements::<u16>();
                // Element counts around the chunk, the ordered threshold and the two-stream
                // threshold (where the upload's last chunk tapers), capped for the tiny chunks.
                let mut lens = vec![
                    1,
                    chunk - 1,
                    chunk,
                    chunk + 1,
                    2 * chunk + 1,
                    3 * chunk - 1,
                    ORDERED_FROM / 2 - 1,
                    ORDERED_FROM / 2 + 1,
                    TWO_STREAMS_FROM / 2 + 3,
                ];
                lens.retain(|&n| (1..=9 * MIB).contains(&n));
                for (i, &n) in lens.iter().enumerate() {
                    let what = format!("config {c} ({config:?}): {n} u16s");
                    let data = words16(n + 8, (c * 100 + i) as u64);
                    // An odd element start in the host Vec and an odd element offset on the
                    // device.
                    let source = &data[3..3 + n];
                    let mut device = DeviceBuffer::<u16>::new(context, n + 10).unwrap();
                    device.fill(0xEEEE).unwrap();
                    manager
                        .transfer(source, Destination::device(&mut device, 7))
                        .unwrap_or_else(|e| panic!("{what}: upload: {e}"));
                    let whole = device.to_vec().unwrap();
                    assert!(whole[..7].iter().all(|&x| x == 0xEEEE), "{what}: head");
                    assert!(whole[7 + n..].iter().all(|&x| x == 0xEEEE), "{what}: tail");
                    assert!(whole[7..7 + n] == *source, "{what}: device bytes differ");
                    let mut back = vec![0x1111u16; n + 5];
                    manager
                        .transfer(Source::device(&device, 7, n), &mut back[1..1 + n])
                        .unwrap_or_else(|e| panic!("{what}: download: {e}"));
                    assert_eq!(back[0], 0x1111, "{what}: before the host range");
                    assert!(back[1 + n..].iter().all(|&x| x == 0x1111), "{what}: after");
                    assert!(back[1..1 + n] == *source, "{what}: host bytes differ");
                }
                let failures: u64 = manager
                    .stats()
                    .snapshot()
                    .iter()
                    .map(|(_, _, s)| s.failures)
                    .sum();
                assert_eq!(failures, 0);
            });
        }
    });
}

#[test]
fn registered_request_buffers_are_read_by_eight_threads_at_odd_ranges_then_written_back() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let len = 5 * MIB + 3;
    let original = bytes(len, 77);
    let mut frames = original.clone();
    let mut registered = manager.register_host(0, &mut frames[..]).unwrap();
    assert_eq!(registered.location(), Location::RegisteredHost(0));
    // Eight readers of one registration at once, each at its own odd range.
    std::thread::scope(|scope| {
        for t in 0..8usize {
            let (manager, context, registered, original) =
                (&manager, &gpu.context, &registered, &original);
            scope.spawn(move || {
                for round in 0..6usize {
                    let start = ((t * 104_729 + round * 7919) % (len / 2)) | 1;
                    let n = [1, 4097, 64 * KIB + 1, MIB + 7, 2 * MIB + 1, 3][round];
                    let mut device = DeviceBuffer::<u8>::new(context, n + 2).unwrap();
                    device.fill(SENTINEL).unwrap();
                    let report = manager
                        .transfer(
                            Source::registered(registered, start, n),
                            Destination::device(&mut device, 1),
                        )
                        .unwrap();
                    assert_eq!(report.plan.method, TransferMethod::DirectCopy);
                    assert_eq!(report.plan.path, TransferPath::REGISTERED_TO_DEVICE);
                    assert_placed(
                        &device.to_vec().unwrap(),
                        1,
                        &original[start..start + n],
                        &format!("thread {t} round {round}"),
                    );
                }
            });
        }
    });
    // A download into the registration at an odd offset; the rest of it is untouched.
    let reply = bytes(MIB + 5, 78);
    let device = DeviceBuffer::<u8>::from_slice(&gpu.context, &reply).unwrap();
    manager
        .transfer(&device, Destination::registered(&mut registered, 333))
        .unwrap();
    assert_same(
        &registered.as_slice()[333..333 + reply.len()],
        &reply,
        "reply",
    );
    assert_same(&registered.as_slice()[..333], &original[..333], "before");
    let frames = registered.unregister().unwrap();
    assert_same(
        &frames[333 + reply.len()..],
        &original[333 + reply.len()..],
        "after",
    );
}

// ---------------------------------------------------------------------------------------------
// Async transfers on several executor threads
// ---------------------------------------------------------------------------------------------

type Request<'a> = Pin<Box<dyn Future<Output = Result<(), String>> + 'a>>;

#[test]
fn request_handlers_upload_run_a_kernel_and_download_as_futures_on_four_executor_threads() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let increment = kernels.module().function("increment_u32").unwrap();
    // Element counts: tiny, around a poll's budget, around the async chunk (1 MiB), a few
    // chunks with a short last one.
    let lens = [
        1usize,
        7,
        POLL_BYTES / 4 - 1,
        POLL_BYTES / 4 + 1,
        MIB / 4 - 1,
        MIB / 4 + 3,
        (3 * MIB) / 4 + 1,
    ];
    std::thread::scope(|scope| {
        for t in 0..4usize {
            let (manager, context, increment, kernels) =
                (&manager, &gpu.context, &increment, &kernels);
            scope.spawn(move || {
                // The thread's own stream for its kernels: every kernel waits behind a spin, so
                // a download that did not wait for the kernel would read the input unchanged.
                let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
                let stream = &stream;
                let mut requests: Vec<Request<'_>> = lens
                    .iter()
                    .enumerate()
                    .map(|(r, &len)| {
                        Box::pin(async move {
                            let seed = (t * 1000 + r) as u64;
                            let input = words32(len, seed);
                            let mut device = DeviceBuffer::<u32>::zeroed(context, len + 3)
                                .map_err(|e| e.to_string())?;
                            let up = manager
                                .upload_async(&input, &mut device, 3)
                                .map_err(|e| e.to_string())?
                                .await
                                .map_err(|e| format!("upload of {len}: {e}"))?;
                            if up.bytes != 4 * len {
                                return Err(format!("upload of {len} moved {}", up.bytes));
                            }
                            kernels
                                .spin_ns(stream, 2_000_000)
                                .map_err(|e| e.to_string())?;
                            let n = (len + 3) as u64;
                            let config = LaunchConfig::for_elements(len + 3, 256)
                                .map_err(|e| e.to_string())?;
                            // SAFETY: increment_u32(unsigned*, size_t) gets the buffer's address
                            // and its length; the launch is declared a write of the buffer, so
                            // every later use of it waits for the kernel.
                            unsafe {
                                TrackedLaunch::new(increment, stream, config)
                                    .write(&mut device)
                                    .arg(&n)
                                    .launch()
                            }
                            .map_err(|e| e.to_string())?;
                            let mut output = vec![0u32; len];
                            manager
                                .download_async(&device, 3, &mut output)
                                .map_err(|e| e.to_string())?
                                .await
                                .map_err(|e| format!("download of {len}: {e}"))?;
                            if let Some(i) =
                                (0..len).find(|&i| output[i] != input[i].wrapping_add(1))
                            {
                                return Err(format!(
                                    "thread {t} request {r} ({len} u32s): element {i} is {:#x}, \
                                     input {:#x} (+1 expected): the download did not wait for \
                                     the kernel, or the upload was wrong",
                                    output[i], input[i]
                                ));
                            }
                            let head = device.to_vec().map_err(|e| e.to_string())?;
                            if head[..3] != [1, 1, 1] {
                                return Err(format!("the head is {:?}", &head[..3]));
                            }
                            Ok(())
                        }) as Request<'_>
                    })
                    .collect();
                for outcome in join_all(&mut requests) {
                    outcome.unwrap();
                }
            });
        }
    });
    // Every upload and download was counted once it completed.
    let counted = |path| -> u64 {
        manager
            .stats()
            .snapshot()
            .iter()
            .filter(|(p, ..)| *p == path)
            .map(|(_, _, s)| s.count)
            .sum()
    };
    assert_eq!(
        counted(TransferPath::PAGEABLE_TO_DEVICE),
        4 * lens.len() as u64
    );
    assert_eq!(
        counted(TransferPath::DEVICE_TO_PAGEABLE),
        4 * lens.len() as u64
    );
}

type Moved<'a> = Pin<Box<dyn Future<Output = Result<usize, TransferError>> + 'a>>;

#[test]
fn borrowed_and_owned_futures_of_odd_u16_sub_slices_complete_together_on_three_executors() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let lens = [
        1usize,
        2,
        17,
        4097,
        16 * KIB + 1,
        512 * KIB - 1,
        512 * KIB + 1,
        1_300_001,
    ];
    std::thread::scope(|scope| {
        for t in 0..3usize {
            let (manager, context) = (&manager, &gpu.context);
            scope.spawn(move || {
                let sources: Vec<Vec<u16>> = lens
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| words16(n + 4, (t * 50 + i) as u64))
                    .collect();
                let mut devices: Vec<DeviceBuffer<u16>> = lens
                    .iter()
                    .map(|&n| {
                        let mut d = DeviceBuffer::<u16>::new(context, n + 4).unwrap();
                        d.fill(0xEEEE).unwrap();
                        d
                    })
                    .collect();
                // Uploads of unaligned sub-slices (element 1 on), to element offset 4 - 1 = 3.
                let mut uploads: Vec<Moved<'_>> = sources
                    .iter()
                    .zip(devices.iter_mut())
                    .zip(&lens)
                    .map(|((src, dst), &n)| {
                        let transfer = manager.upload_async(&src[1..1 + n], dst, 3);
                        Box::pin(async move { Ok(transfer?.await?.bytes) }) as Moved<'_>
                    })
                    .collect();
                for (moved, &n) in join_all(&mut uploads).into_iter().zip(&lens) {
                    assert_eq!(moved.unwrap(), 2 * n);
                }
                drop(uploads);
                // Downloads into odd sub-slices of guarded host Vecs, beside owned round trips
                // of the same sizes on the same executor.
                let mut backs: Vec<Vec<u16>> = lens.iter().map(|&n| vec![0x1111; n + 6]).collect();
                let mut futures: Vec<Moved<'_>> = devices
                    .iter()
                    .zip(backs.iter_mut())
                    .zip(&lens)
                    .map(|((src, dst), &n)| {
                        let transfer = manager.download_async(src, 3, &mut dst[5..5 + n]);
                        Box::pin(async move { Ok(transfer?.await?.bytes) }) as Moved<'_>
                    })
                    .collect();
                for (i, &n) in lens.iter().enumerate() {
                    let data = sources[i][1..1 + n].to_vec();
                    let device = DeviceBuffer::<u16>::zeroed(context, n + 1).unwrap();
                    futures.push(Box::pin(async move {
                        let owned = manager.upload_owned(data, device, 1).await;
                        let report = owned.result?;
                        let host = vec![0u16; n];
                        let back = manager.download_owned(owned.device, 1, host).await;
                        back.result?;
                        assert!(back.host == owned.host, "owned round trip of {n} u16s");
                        Ok(report.bytes)
                    }));
                }
                let outcomes = join_all(&mut futures);
                for (k, outcome) in outcomes.into_iter().enumerate() {
                    let n = lens[k % lens.len()];
                    assert_eq!(
                        outcome.unwrap_or_else(|e| panic!("future {k}: {e}")),
                        2 * n,
                        "future {k}"
                    );
                }
                drop(futures);
                for (i, &n) in lens.iter().enumerate() {
                    let back = &backs[i];
                    assert!(back[..5].iter().all(|&x| x == 0x1111), "{n}: head");
                    assert!(back[5 + n..].iter().all(|&x| x == 0x1111), "{n}: tail");
                    assert!(back[5..5 + n] == sources[i][1..1 + n], "{n}: bytes differ");
                    let whole = devices[i].to_vec().unwrap();
                    assert!(whole[..3].iter().all(|&x| x == 0xEEEE), "{n}: device head");
                    assert!(
                        whole[3 + n..].iter().all(|&x| x == 0xEEEE),
                        "{n}: device tail"
                    );
                }
            });
        }
    });
    // A borrowed future polled again after it finished says so with a typed error (not a
    // panic, not a second transfer).
    let data = vec![5u16; 100];
    let mut device = DeviceBuffer::<u16>::zeroed(&gpu.context, 100).unwrap();
    let mut transfer = manager.upload_async(&data, &mut device, 0).unwrap();
    let first = block_on(&mut transfer);
    assert_eq!(first.unwrap().bytes, 200);
    let before = manager.stats().snapshot();
    match poll_once(&mut transfer) {
        Some(Err(TransferError::AlreadyCompleted { .. })) => {}
        other => panic!("a second poll after completion gave {other:?}"),
    }
    drop(transfer);
    assert_eq!(
        manager.stats().snapshot(),
        before,
        "the extra poll counted nothing"
    );
    assert_eq!(device.to_vec().unwrap(), data);
}

#[test]
fn futures_dropped_or_forgotten_at_every_stage_never_touch_host_memory_afterwards() {
    let gpu = require_gpu!();
    // 64 KiB chunks, two in flight: each chunk takes two polls to fill or empty (POLL_BYTES is
    // 32 KiB), one to queue and one to mark, so stopping after 1..=16 polls stops the transfer
    // in every state it has (waiting for blocks, filling, filled, queued, marked, landed,
    // copying out).
    let manager = TransferManager::with_staging(StagingConfig {
        chunk_bytes: 64 * KIB,
        depth: 2,
        threads: 2,
        host_copy: HostCopy::Streaming,
        order: ChunkOrder::Ordered,
    })
    .unwrap();
    let len = 10 * 64 * KIB + 777;
    let pattern = bytes(len, 4242);
    let device = DeviceBuffer::<u8>::from_slice(&gpu.context, &pattern).unwrap();
    let forget_ok = !sanitizer_active();
    let stops: Vec<usize> = (1..=16).chain([25, 40, 80]).collect();
    // Transfers that happened to finish before their stop: those, and only those, are counted.
    let (mut downloads_done, mut uploads_done) = (0u64, 0u64);
    for &stop in &stops {
        for forget in [false, true] {
            if forget && !forget_ok {
                continue;
            }
            let what = format!(
                "download stopped after {stop} polls, then {}",
                if forget { "forgotten" } else { "dropped" }
            );
            // The destination sits between two guard bands of one Vec.
            let mut guarded = vec![0x5Au8; len + 128];
            let mut future = manager
                .download_async(&device, 0, &mut guarded[64..64 + len])
                .unwrap();
            let mut finished = false;
            for _ in 0..stop {
                if let Some(outcome) = poll_once(&mut future) {
                    outcome.unwrap();
                    finished = true;
                    downloads_done += 1;
                    break;
                }
                // Long enough for blocks to arrive and copies to land between polls.
                std::thread::sleep(Duration::from_micros(300));
            }
            if forget {
                std::mem::forget(future);
            } else {
                drop(future);
            }
            let snapshot = guarded.clone();
            // Give any stray writer (there must be none) time, and let every queued copy land.
            gpu.context.synchronize().unwrap();
            std::thread::sleep(Duration::from_millis(10));
            gpu.context.synchronize().unwrap();
            assert!(
                guarded == snapshot,
                "{what}: the host memory changed after the future was gone"
            );
            assert!(
                guarded[..64].iter().all(|&b| b == 0x5A)
                    && guarded[64 + len..].iter().all(|&b| b == 0x5A),
                "{what}: a guard band was written"
            );
            // Whatever was written is the device's bytes at their places, nothing else.
            if let Some(i) = (0..len).find(|&i| {
                let b = guarded[64 + i];
                b != 0x5A && b != pattern[i]
            }) {
                panic!(
                    "{what}: byte {i} is {:#04x}, neither untouched nor the data",
                    guarded[64 + i]
                );
            }
            if finished {
                assert_same(&guarded[64..64 + len], &pattern, &what);
            }
        }
    }
    for &stop in &stops {
        for forget in [false, true] {
            if forget && !forget_ok {
                continue;
            }
            let what = format!(
                "upload stopped after {stop} polls, then {}",
                if forget { "forgotten" } else { "dropped" }
            );
            let mut source = pattern.clone();
            let mut target = DeviceBuffer::<u8>::zeroed(&gpu.context, len).unwrap();
            let mut future = manager.upload_async(&source, &mut target, 0).unwrap();
            for _ in 0..stop {
                if let Some(outcome) = poll_once(&mut future) {
                    outcome.unwrap();
                    uploads_done += 1;
                    break;
                }
                std::thread::sleep(Duration::from_micros(300));
            }
            if forget {
                std::mem::forget(future);
            } else {
                drop(future);
            }
            // The borrow is over: the caller rewrites its buffer. Had anything kept reading
            // it, these bytes would reach the device.
            source.fill(0xC3);
            let after_drop = target.to_vec().unwrap();
            gpu.context.synchronize().unwrap();
            std::thread::sleep(Duration::from_millis(10));
            let later = target.to_vec().unwrap();
            if !forget {
                // A dropped upload waited for its chunks in flight: nothing lands later.
                assert_same(
                    &later,
                    &after_drop,
                    &format!("{what}: device changed after drop"),
                );
            }
            if let Some(i) = (0..len).find(|&i| later[i] != 0 && later[i] != pattern[i]) {
                panic!(
                    "{what}: device byte {i} is {:#04x}, neither zero nor the data",
                    later[i]
                );
            }
            drop(source);
        }
    }
    // None of the stopped transfers was counted, only those that finished; the manager still
    // works.
    let class = SizeClass::of(len);
    let counted = |path| {
        let stats = manager.stats().get(path, class);
        (stats.count, stats.failures)
    };
    assert_eq!(
        counted(TransferPath::DEVICE_TO_PAGEABLE),
        (downloads_done, 0)
    );
    assert_eq!(counted(TransferPath::PAGEABLE_TO_DEVICE), (uploads_done, 0));
    assert_eq!(
        manager.stats().snapshot().len(),
        usize::from(downloads_done > 0) + usize::from(uploads_done > 0)
    );
    let mut back = vec![0u8; len];
    block_on(manager.download_async(&device, 0, &mut back).unwrap()).unwrap();
    assert_same(&back, &pattern, "a whole download after all that");
}

// ---------------------------------------------------------------------------------------------
// Statistics, lanes and mark words over many transfers
// ---------------------------------------------------------------------------------------------

#[test]
fn statistics_count_every_kind_of_transfer_exactly_once_and_lanes_and_mark_words_stay_bounded() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let up = TransferPath::PAGEABLE_TO_DEVICE;
    let down = TransferPath::DEVICE_TO_PAGEABLE;
    let sizes = [
        1usize,
        100,
        64 * KIB,
        64 * KIB + 1,
        300 * KIB,
        MIB + 1,
        5 * MIB,
        16 * MIB + 1,
    ];
    // What each (path, class) must hold at the end: (count, bytes).
    let mut expected: std::collections::BTreeMap<(TransferPath, SizeClass), (u64, u64)> =
        Default::default();
    let mut expect = |path: TransferPath, n: usize, times: u64| {
        let entry = expected.entry((path, SizeClass::of(n))).or_default();
        entry.0 += times;
        entry.1 += times * n as u64;
    };
    // Blocking, from eight threads.
    const THREADS: usize = 8;
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (manager, context) = (&manager, &gpu.context);
            scope.spawn(move || {
                for (i, &n) in sizes.iter().enumerate() {
                    let data = bytes(n, (t * 10 + i) as u64);
                    let mut device = DeviceBuffer::<u8>::new(context, n).unwrap();
                    manager.transfer(&data, &mut device).unwrap();
                    let mut back = vec![0u8; n];
                    manager.transfer(&device, &mut back).unwrap();
                    assert_same(&back, &data, &format!("thread {t}, {n} bytes"));
                }
            });
        }
    });
    for &n in &sizes {
        expect(up, n, THREADS as u64);
        expect(down, n, THREADS as u64);
    }
    // Borrowed async: completed ones count; an empty one and ones dropped mid-way do not.
    let data = bytes(3 * MIB + 1, 5);
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, data.len()).unwrap();
    for _ in 0..3 {
        block_on(manager.upload_async(&data, &mut device, 0).unwrap()).unwrap();
        let mut back = vec![0u8; data.len()];
        block_on(manager.download_async(&device, 0, &mut back).unwrap()).unwrap();
        assert_same(&back, &data, "async round trip");
    }
    expect(up, data.len(), 3);
    expect(down, data.len(), 3);
    for stop in [1, 5, 30] {
        let mut future = manager.upload_async(&data, &mut device, 0).unwrap();
        for _ in 0..stop {
            assert!(poll_once(&mut future).is_none());
            std::thread::sleep(Duration::from_micros(200));
        }
        drop(future);
    }
    block_on(manager.upload_async(&data[..0], &mut device, 7).unwrap()).unwrap();
    // Owned: awaited ones, ones dropped without an await (counted when their workers finish),
    // an empty one and a refused one (neither counted).
    for i in 0..4 {
        let d = DeviceBuffer::<u8>::zeroed(&gpu.context, data.len()).unwrap();
        let owned = block_on(manager.upload_owned(data.clone(), d, 0));
        owned.result.unwrap();
        let back = block_on(manager.download_owned(owned.device, 0, vec![0u8; data.len()]));
        back.result.unwrap();
        assert_same(&back.host, &data, &format!("owned round trip {i}"));
    }
    expect(up, data.len(), 4);
    expect(down, data.len(), 4);
    for _ in 0..2 {
        let d = DeviceBuffer::<u8>::zeroed(&gpu.context, data.len()).unwrap();
        drop(manager.upload_owned(data.clone(), d, 0));
    }
    expect(up, data.len(), 2);
    let d = DeviceBuffer::<u8>::zeroed(&gpu.context, 4).unwrap();
    let empty = block_on(manager.upload_owned(Vec::new(), d, 4));
    assert_eq!(empty.result.unwrap().bytes, 0);
    let refused = block_on(manager.upload_owned(vec![1u8; 8], empty.device, 0));
    assert!(matches!(
        refused.result,
        Err(TransferError::OutOfRange { .. })
    ));

    // The dropped owned uploads finish in the background: wait for them to be counted.
    let total = |manager: &TransferManager| -> (u64, u64) {
        manager
            .stats()
            .snapshot()
            .iter()
            .fold((0, 0), |(c, b), (_, _, s)| (c + s.count, b + s.bytes))
    };
    let want = expected
        .values()
        .fold((0, 0), |(c, b), &(c2, b2)| (c + c2, b + b2));
    let deadline = Instant::now() + Duration::from_secs(20);
    while total(&manager) != want && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let snapshot = manager.stats().snapshot();
    for &(path, class, stats) in &snapshot {
        let (count, bytes) = expected.get(&(path, class)).copied().unwrap_or_default();
        assert_eq!(
            (stats.count, stats.bytes, stats.failures),
            (count, bytes, 0),
            "{path} {class}: {stats:?}"
        );
        assert!(
            stats.time > Duration::ZERO,
            "{path} {class}: no time recorded"
        );
        let (best, mean) = (stats.best_gbps, stats.mean_gbps());
        assert!(
            best.is_finite() && mean.is_finite() && best > 0.0 && best >= mean * (1.0 - 1e-9),
            "{path} {class}: best {best} GB/s, mean {mean} GB/s"
        );
    }
    assert_eq!(
        snapshot.len(),
        expected.len(),
        "every class with transfers is listed, and no other"
    );
    // Ten thousand one-byte requests each way: counted one by one, in the classes already
    // listed (the registry does not grow with the number of transfers).
    let one = [0xA5u8];
    let mut small = DeviceBuffer::<u8>::zeroed(&gpu.context, 1).unwrap();
    let mut back = [0u8];
    for _ in 0..10_000 {
        manager.transfer(&one[..], &mut small).unwrap();
        manager.transfer(&small, &mut back[..]).unwrap();
    }
    assert_eq!(back, one);
    let tiny_up = manager.stats().get(up, SizeClass::Tiny);
    assert_eq!(
        tiny_up.count,
        expected[&(up, SizeClass::Tiny)].0 + 10_000,
        "{tiny_up:?}"
    );
    assert_eq!(manager.stats().snapshot().len(), expected.len());

    // Bursts of twelve concurrent transfers, five times over: each burst makes more lanes than
    // the idle bound; the extras are destroyed and give their mark words back, so what is
    // idle plus what is free stays the same from one burst to the next.
    let burst = |round: usize| {
        let barrier = Barrier::new(12);
        std::thread::scope(|scope| {
            for t in 0..12usize {
                let (manager, context, barrier) = (&manager, &gpu.context, &barrier);
                scope.spawn(move || {
                    let n = 6 * MIB + t;
                    let data = bytes(n, (round * 100 + t) as u64);
                    let mut device = DeviceBuffer::<u8>::new(context, n).unwrap();
                    barrier.wait();
                    for _ in 0..2 {
                        manager.transfer(&data, &mut device).unwrap();
                        let mut back = vec![0u8; n];
                        manager.transfer(&device, &mut back).unwrap();
                        assert_same(&back, &data, &format!("burst {round}, thread {t}"));
                    }
                });
            }
        });
        let (idle, free) = (manager.idle_lanes(0), manager.free_mark_words(0));
        assert!(idle <= MAX_IDLE_LANES, "{idle} idle lanes kept");
        (idle, free)
    };
    let (idle, free) = burst(0);
    let held = free + MARKED_STREAMS * idle;
    for round in 1..5 {
        let (idle_now, free_now) = burst(round);
        assert_eq!(
            free_now + MARKED_STREAMS * idle_now,
            held,
            "burst {round}: {idle_now} idle lanes and {free_now} free mark words (after the \
             first burst: {idle} and {free}): mark words leaked"
        );
    }
    // Sixty-four borrowed futures in flight at once on one executor: each holds a lane of its
    // own until it completes, then all but the idle bound are destroyed and give their words
    // back.
    let requests: Vec<Vec<u8>> = (0..64).map(|i| bytes(64 * KIB + i, i as u64)).collect();
    let mut targets: Vec<DeviceBuffer<u8>> = requests
        .iter()
        .map(|r| DeviceBuffer::<u8>::new(&gpu.context, r.len()).unwrap())
        .collect();
    let mut futures: Vec<Moved<'_>> = requests
        .iter()
        .zip(targets.iter_mut())
        .map(|(src, dst)| {
            let transfer = manager.upload_async(src, dst, 0);
            Box::pin(async move { Ok(transfer?.await?.bytes) }) as Moved<'_>
        })
        .collect();
    for (moved, request) in join_all(&mut futures).into_iter().zip(&requests) {
        assert_eq!(moved.unwrap(), request.len());
    }
    drop(futures);
    for (target, request) in targets.iter().zip(&requests) {
        assert_same(&target.to_vec().unwrap(), request, "one of 64 at once");
    }
    let (idle_now, free_now) = (manager.idle_lanes(0), manager.free_mark_words(0));
    assert!(idle_now <= MAX_IDLE_LANES);
    assert_eq!(
        free_now + MARKED_STREAMS * idle_now,
        held,
        "after 64 futures at once: {idle_now} idle lanes and {free_now} free mark words"
    );
    manager.stats().reset();
    assert!(manager.stats().snapshot().is_empty());
}

#[test]
fn views_of_pinned_and_unified_buffers_move_exactly_to_and_from_pageable_memory_by_every_method() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let caps = gpu.device.capabilities().unwrap();
    let methods = [
        None,
        Some(TransferMethod::DirectCopy),
        Some(TransferMethod::HostStaged),
    ];
    for len in [1usize, 4097, MIB + 3, 5 * MIB + 1] {
        let data = bytes(len, len as u64 + 11);
        for method in methods {
            // A view of pinned memory, moved as memory of its device (docs/transfer.md).
            let what = format!("{len} bytes through a pinned view by {method:?}");
            let mut pinned = PinnedBuffer::<u8>::new(&gpu.context, len + 8).unwrap();
            pinned.as_mut_slice().unwrap().fill(SENTINEL);
            let into = pinned.slice_mut(3..3 + len).unwrap();
            match method {
                None => manager.transfer(&data, into),
                Some(m) => manager.transfer_with(m, &data, into),
            }
            .unwrap_or_else(|e| panic!("{what}: upload: {e}"));
            assert_placed(&pinned.as_slice().unwrap(), 3, &data, &what);
            let mut back = vec![SENTINEL; len + 2];
            let from = pinned.slice(3..3 + len).unwrap();
            match method {
                None => manager.transfer(from, &mut back[1..1 + len]),
                Some(m) => manager.transfer_with(m, from, &mut back[1..1 + len]),
            }
            .unwrap_or_else(|e| panic!("{what}: download: {e}"));
            assert_placed(&back, 1, &data, &what);

            // Host slices of managed memory need concurrent managed access.
            if !caps.managed_memory || !caps.concurrent_managed_access {
                continue;
            }
            let what = format!("{len} bytes through a unified view by {method:?}");
            let mut unified = UnifiedBuffer::<u8>::new(&gpu.context, len + 8).unwrap();
            unified.as_mut_slice().unwrap().fill(SENTINEL);
            let into = unified.slice_mut(5..5 + len).unwrap();
            match method {
                None => manager.transfer(&data, into),
                Some(m) => manager.transfer_with(m, &data, into),
            }
            .unwrap_or_else(|e| panic!("{what}: upload: {e}"));
            assert_placed(&unified.as_slice().unwrap(), 5, &data, &what);
            let mut back = vec![SENTINEL; len + 2];
            let from = unified.slice(5..5 + len).unwrap();
            match method {
                None => manager.transfer(from, &mut back[1..1 + len]),
                Some(m) => manager.transfer_with(m, from, &mut back[1..1 + len]),
            }
            .unwrap_or_else(|e| panic!("{what}: download: {e}"));
            assert_placed(&back, 1, &data, &what);
            // View to view across the three kinds: unified -> pinned -> device.
            let mut device = DeviceBuffer::<u8>::new(&gpu.context, len + 2).unwrap();
            device.fill(SENTINEL).unwrap();
            pinned.as_mut_slice().unwrap().fill(SENTINEL);
            manager
                .transfer(
                    unified.slice(5..5 + len).unwrap(),
                    pinned.slice_mut(2..2 + len).unwrap(),
                )
                .unwrap();
            manager
                .transfer(
                    pinned.slice(2..2 + len).unwrap(),
                    device.slice_mut(1..1 + len).unwrap(),
                )
                .unwrap();
            assert_placed(
                &pinned.as_slice().unwrap(),
                2,
                &data,
                "unified view -> pinned view",
            );
            assert_placed(
                &device.to_vec().unwrap(),
                1,
                &data,
                "pinned view -> device view",
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Calibration files and plans
// ---------------------------------------------------------------------------------------------

/// A fresh directory for this test's files.
fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("cuweave-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A calibration file's JSON with one staging choice of the given configuration fields.
fn staging_json(chunk: &str, depth: &str, threads: &str) -> String {
    format!(
        r#"{{ "device": "X", "entries": [],
            "staging": [ {{ "path": {{ "src": "pageable", "dst": "device", "cross_device": false }},
                           "device": 0, "bytes": 1048576,
                           "config": {{ "chunk_bytes": {chunk}, "depth": {depth}, "threads": {threads} }},
                           "gbps": 10.0 }} ] }}"#
    )
}

#[test]
fn broken_or_foreign_calibration_files_are_typed_errors_or_labelled_and_never_panic() {
    // Without a GPU first: parsing and loading need no device.
    let bad = [
        ("empty", String::new()),
        ("not json", "calibration please".to_owned()),
        ("truncated", r#"{ "device": "X", "entries": [ { "path": "#.to_owned()),
        ("a list", "[1, 2, 3]".to_owned()),
        ("entries not a list", r#"{ "device": null, "entries": 5 }"#.to_owned()),
        (
            "unknown method",
            r#"{ "device": null, "entries": [ { "path": { "src": "pageable", "dst": "device",
               "cross_device": false }, "size_class": "large", "method": "teleport",
               "gbps": 1.0 } ] }"#
                .to_owned(),
        ),
        (
            "unknown size class",
            r#"{ "device": null, "entries": [ { "path": { "src": "pageable", "dst": "device",
               "cross_device": false }, "size_class": "gigantic", "method": "direct_copy",
               "gbps": 1.0 } ] }"#
                .to_owned(),
        ),
        (
            "negative bytes",
            r#"{ "device": null, "entries": [ { "path": { "src": "pageable", "dst": "device",
               "cross_device": false }, "size_class": "large", "method": "direct_copy",
               "gbps": 1.0, "bytes": -4 } ] }"#
                .to_owned(),
        ),
        ("gbps a string", r#"{ "device": null, "entries": [ { "path": { "src": "pageable", "dst": "device", "cross_device": false }, "size_class": "large", "method": "direct_copy", "gbps": "fast" } ] }"#.to_owned()),
        ("zero threads", staging_json("1048576", "2", "0")),
        ("one-byte chunks", staging_json("1", "2", "4")),
        ("chunks past 1 GiB", staging_json("2147483648", "2", "4")),
        ("depth 65", staging_json("1048576", "65", "4")),
        ("depth 0", staging_json("1048576", "0", "4")),
        (
            "more threads than the pool",
            staging_json("1048576", "2", &(MAX_WORKERS + 2).to_string()),
        ),
        ("overflowing threads", staging_json("1048576", "2", "18446744073709551615")),
        ("chunk past u64", staging_json("1e30", "2", "4")),
    ];
    for (what, json) in &bad {
        match CalibrationTable::from_json(json) {
            Err(TransferError::CalibrationFile { path, message }) => {
                assert_eq!(path, "<json>", "{what}");
                assert!(!message.is_empty(), "{what}: an empty message");
            }
            other => panic!("{what}: expected a CalibrationFile error, got {other:?}"),
        }
    }
    let dir = scratch_dir("calibration");
    for (i, (what, json)) in bad.iter().enumerate() {
        let file = dir.join(format!("bad-{i}.json"));
        std::fs::write(&file, json).unwrap();
        match CalibrationTable::load(&file) {
            Err(TransferError::CalibrationFile { path, .. }) => {
                assert!(
                    path.contains(&format!("bad-{i}.json")),
                    "{what}: names {path}"
                );
            }
            other => panic!("{what}: loading gave {other:?}"),
        }
    }
    for missing in [dir.join("nope.json"), dir.clone()] {
        assert!(
            matches!(
                CalibrationTable::load(&missing),
                Err(TransferError::CalibrationFile { .. })
            ),
            "{}",
            missing.display()
        );
    }
    // Saving where no file can be written is a typed error too.
    assert!(matches!(
        CalibrationTable::default().save(dir.join("no-such-dir").join("x.json")),
        Err(TransferError::CalibrationFile { .. })
    ));
    // Odd but valid content loads: figures for devices this machine may not have, a staging
    // choice at the bounds, an entry whose class disagrees with its size.
    let odd = r#"{ "device": "NVIDIA A100-SXM4-40GB", "devices": ["NVIDIA A100-SXM4-40GB"],
        "entries": [
          { "path": { "src": "pageable", "dst": "device", "cross_device": false },
            "size_class": "tiny", "method": "host_staged", "gbps": 77.0, "bytes": 4194304,
            "dst_device": 7 },
          { "path": { "src": "pageable", "dst": "device", "cross_device": false },
            "size_class": "medium", "method": "direct_copy", "gbps": 0.0, "bytes": 4194304 },
          { "path": { "src": "pageable", "dst": "device", "cross_device": false },
            "size_class": "medium", "method": "host_staged", "gbps": 123456.0, "bytes": 4194304 } ],
        "staging": [ { "path": { "src": "device", "dst": "pageable", "cross_device": false },
                       "device": 9, "bytes": 0,
                       "config": { "chunk_bytes": 4096, "depth": 64, "threads": 1 },
                       "gbps": 1.0 } ] }"#;
    let foreign = CalibrationTable::from_json(odd).unwrap();
    let file = dir.join("odd.json");
    foreign.save(&file).unwrap();
    assert_eq!(CalibrationTable::load(&file).unwrap(), foreign);
    let _ = std::fs::remove_dir_all(&dir);

    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let machine = manager.machine();
    // A table from another machine: used, but every plan says where it came from.
    let mismatch = manager
        .set_calibration(foreign.clone())
        .expect("an A100 table on this machine is a mismatch");
    assert!(mismatch.to_string().contains("A100"), "{mismatch}");
    let plan = manager.plan(Location::PageableHost, Location::Device(0), 4 * MIB);
    let text = plan.to_string();
    assert_eq!(plan.method, TransferMethod::HostStaged, "{text}");
    assert!(
        text.contains("NVIDIA A100-SXM4-40GB") && text.contains("not this machine"),
        "{text}"
    );
    // The figure for a device this machine does not have was not used.
    assert!(!text.contains("77.0"), "{text}");
    // Transfers still move every byte under it, at sizes its odd staging choice (for a device
    // that does not exist) would never apply to.
    for n in [1, 4097, 4 * MIB + 1] {
        let data = bytes(n, n as u64);
        let mut device = DeviceBuffer::<u8>::new(&gpu.context, n).unwrap();
        let report = manager.transfer(&data, &mut device).unwrap();
        assert_eq!(
            report.plan.measured_on.is_some(),
            matches!(report.plan.reason, PlanReason::Calibrated { .. }),
            "{}",
            report.plan
        );
        let mut back = vec![0u8; n];
        manager.transfer(&device, &mut back).unwrap();
        assert_same(&back, &data, "under a foreign table");
    }
    // A table without any machine recorded is a mismatch as well, named as such.
    let unnamed = manager
        .set_calibration(CalibrationTable::default())
        .expect("an unrecorded machine is a mismatch");
    assert_eq!(unnamed.measured_on(), "an unrecorded machine");
    // This machine's own names: no mismatch, and plans say "measured here".
    let mut here = CalibrationTable {
        device: machine.first().cloned(),
        devices: machine.clone(),
        ..CalibrationTable::default()
    };
    here.record_at(
        Measure {
            path: TransferPath::PAGEABLE_TO_DEVICE,
            src_device: None,
            dst_device: Some(0),
            bytes: 4 * MIB,
        },
        TransferMethod::DirectCopy,
        12.5,
    );
    assert_eq!(manager.set_calibration(here), None);
    let text = manager
        .plan(Location::PageableHost, Location::Device(0), 4 * MIB)
        .to_string();
    assert!(text.contains("measured here"), "{text}");
    assert!(!text.contains("not this machine"), "{text}");
}

#[test]
fn plans_state_the_figures_and_sizes_they_chose_by_and_the_transfer_runs_that_plan() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let machine = manager.machine();
    // A measured table for device 0: the plain call wins small copies, staging large ones.
    let mut table = CalibrationTable {
        device: machine.first().cloned(),
        devices: machine,
        ..CalibrationTable::default()
    };
    for (path, bytes, direct, staged) in [
        (TransferPath::PAGEABLE_TO_DEVICE, 64 * KIB, 9.0, 3.0),
        (TransferPath::PAGEABLE_TO_DEVICE, 4 * MIB, 10.0, 30.0),
        (TransferPath::DEVICE_TO_PAGEABLE, 64 * KIB, 8.0, 2.0),
        (TransferPath::DEVICE_TO_PAGEABLE, 4 * MIB, 9.0, 25.0),
    ] {
        let at = Measure {
            path,
            src_device: (path == TransferPath::DEVICE_TO_PAGEABLE).then_some(0),
            dst_device: (path == TransferPath::PAGEABLE_TO_DEVICE).then_some(0),
            bytes,
        };
        table.record_at(at, TransferMethod::DirectCopy, direct);
        table.record_at(at, TransferMethod::HostStaged, staged);
    }
    assert_eq!(manager.set_calibration(table), None);
    let cases = [
        (100 * KIB, TransferMethod::DirectCopy, 9.0, 3.0, "64 KiB"),
        (3 * MIB, TransferMethod::HostStaged, 30.0, 10.0, "4 MiB"),
    ];
    for (n, method, gbps, runner_up, at) in cases {
        let plan = manager.plan(Location::PageableHost, Location::Device(0), n);
        let text = plan.to_string();
        assert_eq!(plan.method, method, "{text}");
        match plan.reason {
            PlanReason::Calibrated {
                gbps: g,
                runner_up: r,
                ..
            } => assert_eq!((g, r), (gbps, Some(runner_up)), "{text}"),
            other => panic!("{n} bytes: planned by {other:?}: {text}"),
        }
        assert!(
            text.contains(&format!("measured here at {gbps:.1} GB/s for {at}"))
                && text.contains(&format!("next best {runner_up:.1} GB/s")),
            "{text}"
        );
        // The transfer runs exactly the plan it was shown, and is counted under its path.
        let data = bytes(n, 3);
        let mut device = DeviceBuffer::<u8>::new(&gpu.context, n).unwrap();
        let report = manager.transfer(&data, &mut device).unwrap();
        assert_eq!(report.plan, plan);
        let mut back = vec![0u8; n];
        let report = manager.transfer(&device, &mut back).unwrap();
        assert_eq!(report.plan.method, method, "{}", report.plan);
        assert_same(&back, &data, &text);
    }
    // A forced method says it was requested.
    let data = bytes(100, 4);
    let mut device = DeviceBuffer::<u8>::new(&gpu.context, 100).unwrap();
    let report = manager
        .transfer_with(TransferMethod::HostStaged, &data, &mut device)
        .unwrap();
    assert_eq!(report.plan.reason, PlanReason::Requested);
    assert!(report.plan.to_string().contains("requested"));
    // Registered memory has one method and the plan says why.
    let text = manager
        .plan(Location::RegisteredHost(0), Location::Device(0), MIB)
        .to_string();
    assert!(
        text.contains("only method") && text.contains("page-locked"),
        "{text}"
    );
    // With the calibration forgotten, the defaults decide and say where they came from.
    manager.clear_cache();
    let plan = manager.plan(Location::PageableHost, Location::Device(0), 3 * MIB);
    let text = plan.to_string();
    assert!(
        matches!(plan.reason, PlanReason::Default { machine, .. } if machine == DEFAULT_MACHINE),
        "{text}"
    );
    assert!(text.contains("not measured here"), "{text}");
    // Every skipped method names what the device lacks, and was ranked before the choice.
    for (src, dst) in [
        (Location::PinnedHost(0), Location::Device(0)),
        (Location::Device(0), Location::PinnedHost(0)),
        (Location::PageableHost, Location::Unified(0)),
    ] {
        let plan = manager.plan(src, dst, 4 * MIB);
        for skipped in &plan.skipped {
            assert!(!skipped.why.is_empty(), "{plan}");
            assert!(plan.to_string().contains(skipped.why), "{plan}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

#[test]
fn client_errors_are_typed_before_anything_moves_and_count_nothing() {
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let host = vec![1u8; 64];
    let mut device = DeviceBuffer::<u8>::new(&gpu.context, 64).unwrap();
    device.fill(SENTINEL).unwrap();
    let mut pinned = PinnedBuffer::<u8>::zeroed(&gpu.context, 16).unwrap();
    // A host destination of the wrong length, either way.
    for len in [63, 65] {
        let mut out = vec![0u8; len];
        assert!(
            matches!(
                manager.transfer(&device, &mut out),
                Err(TransferError::LengthMismatch {
                    source_len: 64,
                    destination_len
                }) if destination_len == len
            ),
            "{len}"
        );
    }
    // Offsets whose end overflows, on every kind of side.
    let mut out = vec![0u8; 2];
    assert!(matches!(
        manager.transfer(Source::device(&device, usize::MAX, 2), &mut out),
        Err(TransferError::OutOfRange { side: "source", .. })
    ));
    assert!(matches!(
        manager.transfer(
            Source::device(&device, 1, usize::MAX),
            Destination::device(&mut DeviceBuffer::<u8>::new(&gpu.context, 1).unwrap(), 0)
        ),
        Err(TransferError::OutOfRange { side: "source", .. })
    ));
    assert!(matches!(
        manager.transfer(Source::pinned(&pinned, usize::MAX - 1, 2), &mut out),
        Err(TransferError::OutOfRange { side: "source", .. })
    ));
    assert!(matches!(
        manager.transfer(&host[..2], Destination::pinned(&mut pinned, usize::MAX)),
        Err(TransferError::OutOfRange {
            side: "destination",
            ..
        })
    ));
    assert!(matches!(
        manager.transfer(&host[..2], Destination::device(&mut device, 63)),
        Err(TransferError::OutOfRange {
            side: "destination",
            offset: 63,
            len: 2,
            capacity: 64
        })
    ));
    // Zero-length: fine at the very end, refused one past it.
    manager
        .transfer(&host[..0], Destination::device(&mut device, 64))
        .unwrap();
    assert!(matches!(
        manager.transfer(&host[..0], Destination::device(&mut device, 65)),
        Err(TransferError::OutOfRange { .. })
    ));
    // Methods that cannot serve the path name it.
    match manager.transfer_with(TransferMethod::PeerToPeer, &host, &mut device) {
        Err(TransferError::Unsupported {
            method,
            path,
            reason,
        }) => {
            assert_eq!(method, TransferMethod::PeerToPeer);
            assert!(
                path.contains("pageable host") && path.contains("device 0"),
                "{path}"
            );
            assert!(!reason.is_empty());
        }
        other => panic!("peer-to-peer from pageable memory gave {other:?}"),
    }
    let mut frames = [3u8; 64];
    {
        let registered = manager.register_host(0, &mut frames[..]).unwrap();
        for method in [TransferMethod::HostStaged, TransferMethod::ZeroCopy] {
            assert!(
                matches!(
                    manager.transfer_with(method, &registered, &mut device),
                    Err(TransferError::Unsupported { .. })
                ),
                "{method}"
            );
        }
    }
    // Registration of nothing, or on a device that is not there.
    let mut nothing: Vec<u32> = Vec::new();
    assert!(matches!(
        manager.register_host(0, &mut nothing[..]),
        Err(TransferError::EmptyRegistration {
            len: 0,
            element_bytes: 4
        })
    ));
    let mut some = [0u8; 8];
    assert!(matches!(
        manager.register_host(usize::MAX, &mut some[..]),
        Err(TransferError::NoSuchDevice { .. })
    ));
    // Managers for devices that do not exist, and configurations that cannot run.
    assert!(matches!(
        TransferManager::for_devices(&[0, usize::MAX]),
        Err(TransferError::NoSuchDevice {
            device: usize::MAX,
            ..
        })
    ));
    let invalid = StagingConfig {
        chunk_bytes: 0,
        depth: 1,
        threads: 1,
        host_copy: HostCopy::Cached,
        order: ChunkOrder::Ordered,
    };
    assert!(matches!(
        TransferManager::with_staging(invalid),
        Err(TransferError::InvalidStaging { .. })
    ));
    // A manager that serves no device refuses device memory on every entry point, the owned
    // forms handing both buffers back.
    let none = TransferManager::for_devices(&[]).unwrap();
    assert!(matches!(
        none.transfer(&host, &mut device),
        Err(TransferError::NoSuchDevice {
            device: 0,
            count: 0
        })
    ));
    assert!(matches!(
        none.upload_async(&host, &mut device, 0),
        Err(TransferError::NoSuchDevice { .. })
    ));
    let mut out = vec![0u8; 64];
    assert!(matches!(
        none.download_async(&device, 0, &mut out),
        Err(TransferError::NoSuchDevice { .. })
    ));
    let owned = block_on(none.download_owned(device, 0, vec![9u8; 64]));
    assert!(matches!(
        owned.result,
        Err(TransferError::NoSuchDevice { .. })
    ));
    assert_eq!(owned.host, vec![9u8; 64]);
    let device = owned.device;
    // Wrong devices, where there is a second one: pinned memory of device 1 into device 0's
    // buffer through a manager that serves only device 0.
    if cuweave_driver::Device::count().unwrap_or(0) >= 2 {
        let only0 = TransferManager::for_devices(&[0]).unwrap();
        let one =
            cuweave_driver::Context::primary(cuweave_driver::Device::get(1).unwrap()).unwrap();
        let mut remote = DeviceBuffer::<u8>::new(&one, 64).unwrap();
        assert!(matches!(
            only0.transfer(&host, &mut remote),
            Err(TransferError::NoSuchDevice {
                device: 1,
                count: 1
            })
        ));
        assert!(matches!(
            only0.transfer(&device, &mut remote),
            Err(TransferError::NoSuchDevice { device: 1, .. })
        ));
    }
    // Nothing was attempted, so nothing was counted; the device bytes are untouched.
    assert!(
        manager.stats().snapshot().is_empty(),
        "{:?}",
        manager.stats().snapshot()
    );
    assert!(none.stats().snapshot().is_empty());
    assert!(all_sentinel(&device.to_vec().unwrap()));
}
