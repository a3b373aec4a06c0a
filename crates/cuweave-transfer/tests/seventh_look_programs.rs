//! Seventh-look user programs for the transfer manager, written as inference servers and data
//! loaders write them beside CUDA graphs, on what the crate's other tests leave out:
//!
//! - borrowed `AsyncTransfer` futures polled on a loader thread while another thread holds a
//!   global-mode capture (PyTorch's default `torch.cuda.graph` mode): the event layer's reactor
//!   resolves waits during such a capture, so a future woken by it must complete, not fail on
//!   a host synchronisation it does not need;
//! - borrowed futures dropped mid-flight during a global capture, a hundred times: their pinned
//!   blocks must not be leaked for good;
//! - staged transfers on a loader thread while another thread holds a thread-local capture
//!   open (a long capture of a large model): pinned staging memory must stay bounded;
//! - transfers into and out of a buffer that a tracked graph increments, queued right behind
//!   each replay, by every public way (planned, interleaved staging on four participants,
//!   borrowed and owned futures, views): each must be ordered after the replay;
//! - ten thousand small transfers beside a thread-local capture / instantiate / replay loop:
//!   exact bytes, lanes, mark words, statistics and resident memory bounded;
//! - a manager made lazily (`OnceLock`) by eight request threads at once: made once, every
//!   transfer counted once; and, without a driver, managers made by sixteen threads at once all
//!   answer the same typed error.
//!
//! Every GPU test skips without a GPU and takes the binary's serial guard: several begin global
//! captures or measure process-wide figures (resident memory), which any other test of this
//! binary running at the same time would disturb.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, OnceLock, mpsc};
use std::task::{Context as TaskContext, Waker};
use std::time::Duration;

use cuweave_driver::{CaptureMode, Device, DriverError, InstantiateOptions};
use cuweave_memory::{Buffer, DeviceBuffer, TrackedLaunch};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{Gpu, poll_until, require_gpu, resident_bytes, serial};
use cuweave_transfer::{
    ChunkOrder, Destination, HostCopy, MARKED_STREAMS, MAX_IDLE_LANES, SizeClass, Source,
    StagingConfig, TransferError, TransferManager, TransferMethod, TransferPath,
};

mod common;
use common::{assert_all_u32, assert_bytes, block_on, bytes, grid, user_stream, words};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Elements of the capturing thread's own graph output.
const G: usize = 1024;

/// How long a captured spin keeps a replay busy in the graph-ordering probe: far longer than a
/// transfer of a few MiB that is not ordered behind it takes.
const REPLAY_SPIN_NS: u64 = 20_000_000;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Polls `future` with a waker that does nothing until `done` holds of it (or 10 s pass);
/// whether it resolved on the way (then `done` was never reached).
fn poll_until_state<F: Future + Unpin + std::fmt::Debug>(
    future: &mut F,
    done: impl Fn(&F) -> bool,
) -> bool {
    let mut cx = TaskContext::from_waker(Waker::noop());
    let mut resolved = false;
    let reached = poll_until(Duration::from_secs(10), || {
        if done(future) {
            return true;
        }
        if Pin::new(&mut *future).poll(&mut cx).is_ready() {
            resolved = true;
            return true;
        }
        false
    });
    assert!(
        reached,
        "the future neither resolved nor reached the state within 10 s"
    );
    resolved
}

/// The number after `in_flight: ` in a borrowed future's `Debug` text.
fn in_flight<F: std::fmt::Debug>(future: &F) -> usize {
    format!("{future:?}")
        .split("in_flight: ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|digits| digits.parse::<usize>().ok())
        .unwrap_or(0)
}

/// Sets its flag when dropped (also when the test fails), so a helper thread looping until the
/// flag is set never outlives the test's failure.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// What came of the capture a test held open while a loader worked beside it.
#[derive(Debug)]
enum Captured {
    /// It ended in a graph whose replay wrote 8 into every element of its output.
    Replayed,
    /// Ending it failed (the loader broke it), with the error.
    Broken(String),
}

/// Fails the test, naming `what` and the error, unless the capture ended and replayed.
fn assert_replayed(captured: &Captured, what: &str) {
    if let Captured::Broken(error) = captured {
        panic!("{what}: ending the capture failed: {error}");
    }
}

/// Begins a capture in `mode` on a fresh non-blocking stream of this thread, records a fill of
/// 7 into a buffer of its own, runs `loader` on another thread while the capture is open (a
/// loader that takes more than 60 s fails the test), then records an increment, ends the
/// capture and replays the graph once if it ended. Returns the loader's result and what came
/// of the capture.
fn beside_capture<R: Send + 'static>(
    gpu: &Gpu,
    kernels: &TestKernels,
    mode: CaptureMode,
    loader: impl FnOnce() -> R + Send + 'static,
) -> (R, Captured) {
    let stream = user_stream(&gpu.context);
    let out = DeviceBuffer::<u32>::zeroed(&gpu.context, G).unwrap();
    let ptr = out.device_ptr();
    stream.begin_capture(mode).unwrap();
    // SAFETY: `out` holds G u32s and outlives every launch of the captured graph (synchronised
    // below before it is read or dropped); the captured kernels are its only writers.
    unsafe { kernels.fill_u32(&stream, ptr, 7, G) }.unwrap();
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let _ = tx.send(loader());
    });
    let result = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(handle.join().unwrap_err())
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{mode:?}: the loader did not finish within 60 s of the capture's begin")
        }
    };
    handle.join().unwrap();
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&stream, ptr, G) }.unwrap();
    let captured = match stream.end_capture() {
        Ok(graph) => {
            let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
            exec.launch(&stream).unwrap();
            stream.synchronize().unwrap();
            assert_all_u32(
                &out.to_vec().unwrap(),
                8,
                &format!("{mode:?}: the replay of the capture held beside the loader"),
            );
            Captured::Replayed
        }
        Err(error) => Captured::Broken(error.to_string()),
    };
    (result, captured)
}

/// A borrowed round trip of `data` through `device`: the bytes that came back.
fn borrowed_round_trip(
    manager: &TransferManager,
    data: &[u8],
    device: &mut DeviceBuffer<u8>,
) -> Result<Vec<u8>, TransferError> {
    let mut back = vec![0u8; data.len()];
    block_on(manager.upload_async(data, device, 0)?)?;
    block_on(manager.download_async(device, 0, &mut back)?)?;
    Ok(back)
}

// ---------------------------------------------------------------------------------------------
// 1. Borrowed futures beside another thread's global capture
// ---------------------------------------------------------------------------------------------

/// An async inference server (tokio-style executor threads polling `upload_async` /
/// `download_async`) keeps serving requests while its model thread captures a CUDA graph in
/// global mode, PyTorch's default. The futures are woken by the event layer's reactor, which
/// resolves waits during another thread's global capture (in relaxed mode); a landed chunk
/// needs no host synchronisation. So a round trip of 3 MiB + 5 bytes (four chunks each way),
/// its lane, blocks and reactor warmed up before the capture, must complete with exact bytes
/// on the loader thread, and the capture must end valid and replay (fill 7, increment: 8).
#[test]
fn a_borrowed_round_trip_beside_another_threads_global_capture_completes_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let manager = Arc::new(TransferManager::new().unwrap());
    let n = 3 * MIB + 5;
    let data = bytes(n, 71);
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    // Warm up: lane, pinned blocks, completion words and the reactor exist before the capture.
    let warm = borrowed_round_trip(&manager, &bytes(n, 70), &mut device).unwrap();
    assert_bytes(&warm, &bytes(n, 70), "the warm-up round trip");
    manager.stats().reset();

    let (outcome, captured) = beside_capture(&gpu, &kernels, CaptureMode::Global, {
        let manager = Arc::clone(&manager);
        let data = data.clone();
        move || {
            let outcome = borrowed_round_trip(&manager, &data, &mut device);
            (outcome, device)
        }
    });
    let (outcome, device) = outcome;
    let back = outcome.unwrap_or_else(|error| {
        panic!(
            "a borrowed round trip on a loader thread failed during another thread's global \
             capture: {error} (the chunk had landed; the poll's host synchronisation of its \
             copy was refused)"
        )
    });
    assert_bytes(&back, &data, "the round trip during the global capture");
    assert_replayed(&captured, "the global capture beside the borrowed futures");
    let up = manager
        .stats()
        .get(TransferPath::PAGEABLE_TO_DEVICE, SizeClass::of(n));
    let down = manager
        .stats()
        .get(TransferPath::DEVICE_TO_PAGEABLE, SizeClass::of(n));
    assert_eq!((up.count, up.failures), (1, 0), "uploads: {up:?}");
    assert_eq!((down.count, down.failures), (1, 0), "downloads: {down:?}");
    drop(device);
}

/// A server cancels requests (drops their `AsyncTransfer`s mid-flight) while its model thread
/// holds a global-mode capture open. Each of 120 borrowed uploads of 3 MiB (three 1 MiB chunks)
/// is polled until two chunks are in flight, then dropped. Once the capture has ended and the manager is
/// dropped, every pinned block those transfers held must have gone back to the driver: the
/// process's resident memory (pinned blocks are resident) ends within 96 MiB of where it was
/// before the manager was made, where 240 leaked in-flight chunks would be 240 MiB.
#[test]
#[cfg(target_os = "linux")]
fn borrowed_uploads_dropped_mid_flight_during_a_global_capture_leak_no_pinned_memory() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    const DROPS: usize = 120;
    let n = 3 * MIB;
    let data = Arc::new(bytes(n, 81));
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    // A first manager warms up what stays for the process (the reactor, the staging workers,
    // the driver's own pinned memory), then goes.
    {
        let manager = TransferManager::new().unwrap();
        let back = borrowed_round_trip(&manager, &data, &mut device).unwrap();
        assert_bytes(&back, &data, "the warm-up round trip");
    }
    let before = resident_bytes();
    if before == 0 {
        return;
    }
    let manager = Arc::new(TransferManager::new().unwrap());
    let back = borrowed_round_trip(&manager, &data, &mut device).unwrap();
    assert_bytes(&back, &data, "the manager's warm-up round trip");

    let (device, captured) = beside_capture(&gpu, &kernels, CaptureMode::Global, {
        let manager = Arc::clone(&manager);
        let data = Arc::clone(&data);
        move || {
            for _ in 0..DROPS {
                let Ok(mut upload) = manager.upload_async(&data[..], &mut device, 0) else {
                    continue;
                };
                // Resolved early (an error, or a very fast completion): nothing in flight.
                let _ = poll_until_state(&mut upload, |u| in_flight(u) >= 2);
                drop(upload);
            }
            device
        }
    });
    eprintln!("the global capture beside {DROPS} dropped uploads: {captured:?}");
    // After the capture: the manager still moves exact bytes, then goes with its pool.
    let mut device = device;
    let back = borrowed_round_trip(&manager, &data, &mut device).unwrap();
    assert_bytes(&back, &data, "a round trip after the capture");
    match Arc::try_unwrap(manager) {
        Ok(manager) => drop(manager),
        Err(_) => panic!("the loader's handle on the manager is still alive"),
    }
    let after = resident_bytes();
    assert!(
        after <= before + 96 * MIB as u64,
        "resident memory grew from {before} to {after} bytes over {DROPS} borrowed uploads \
         dropped during a global capture, with their manager gone: their in-flight pinned \
         blocks were leaked (a dropped PendingCopy whose synchronize is refused forgets its \
         block)"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Staged transfers beside a long thread-local capture
// ---------------------------------------------------------------------------------------------

/// A serving process captures a large model on one thread in thread-local mode (the capture
/// stays open for seconds) while its data-loader thread keeps moving 2 MiB + 1 byte batches by
/// the staged pipeline, 150 round trips. Thread-local mode lets other threads query events, so
/// the loader's pinned staging blocks can be recycled as before: every round trip is exact,
/// resident memory grows by at most 128 MiB during the capture (fresh blocks for every transfer
/// would be 600 MiB or more), and the capture ends valid.
#[test]
#[cfg(target_os = "linux")]
fn staged_round_trips_beside_a_long_thread_local_capture_reuse_their_pinned_blocks() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    const ROUNDS: usize = 150;
    let n = 2 * MIB + 1;
    let manager = Arc::new(TransferManager::new().unwrap());
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    let staged = TransferMethod::HostStaged;
    for round in 0..20 {
        let data = bytes(n, round);
        let mut back = vec![0u8; n];
        manager.transfer_with(staged, &data, &mut device).unwrap();
        manager
            .transfer_with(staged, &device, &mut back[..])
            .unwrap();
        assert_bytes(&back, &data, "a warm-up round trip");
    }
    let before = resident_bytes();
    if before == 0 {
        return;
    }
    let ((wrong, after), captured) = beside_capture(&gpu, &kernels, CaptureMode::ThreadLocal, {
        let manager = Arc::clone(&manager);
        move || {
            let mut wrong = Vec::new();
            let mut back = vec![0u8; n];
            for round in 0..ROUNDS {
                let data = bytes(n, 100 + round as u64);
                back.fill(0);
                manager.transfer_with(staged, &data, &mut device).unwrap();
                manager
                    .transfer_with(staged, &device, &mut back[..])
                    .unwrap();
                if back != data {
                    wrong.push(round);
                }
            }
            (wrong, resident_bytes())
        }
    });
    assert!(
        wrong.is_empty(),
        "round trips that changed bytes: {wrong:?}"
    );
    assert_replayed(&captured, "the thread-local capture beside the loader");
    assert!(
        after <= before + 128 * MIB as u64,
        "resident memory grew from {before} to {after} bytes over {ROUNDS} staged round trips \
         of {n} bytes beside another thread's thread-local capture: the pinned pool pinned \
         fresh blocks instead of reusing finished ones (its fence queries are skipped while any \
         capture is active, though a query breaks no thread-local capture of another thread)"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Transfers queued right behind replays of a graph that writes the buffer
// ---------------------------------------------------------------------------------------------

/// How the graph-ordering probe moves a buffer's contents.
#[derive(Debug, Clone, Copy)]
enum GraphWay {
    /// `transfer`, the planned method.
    Planned,
    /// `transfer` on a manager fixed to interleaved staging, four participants, 64 KiB chunks
    /// (each participant queues on its own stream of the lane).
    Interleaved,
    /// `upload_async` / `download_async`, awaited.
    Borrowed,
    /// `upload_owned` / `download_owned`, awaited.
    Owned,
    /// `transfer` through `slice_mut` / `slice` views of the whole buffer.
    View,
}

fn upload_by(
    way: GraphWay,
    manager: &TransferManager,
    interleaved: &TransferManager,
    data: &[u32],
    x: DeviceBuffer<u32>,
) -> DeviceBuffer<u32> {
    let mut x = x;
    match way {
        GraphWay::Planned => {
            manager.transfer(data, &mut x).unwrap();
        }
        GraphWay::Interleaved => {
            interleaved.transfer(data, &mut x).unwrap();
        }
        GraphWay::Borrowed => {
            block_on(manager.upload_async(data, &mut x, 0).unwrap()).unwrap();
        }
        GraphWay::Owned => {
            let up = block_on(manager.upload_owned(data.to_vec(), x, 0));
            up.result.unwrap();
            return up.device;
        }
        GraphWay::View => {
            let len = x.len();
            manager
                .transfer(data, Destination::view(x.slice_mut(0..len).unwrap()))
                .unwrap();
        }
    }
    x
}

fn download_by(
    way: GraphWay,
    manager: &TransferManager,
    interleaved: &TransferManager,
    x: DeviceBuffer<u32>,
) -> (DeviceBuffer<u32>, Vec<u32>) {
    let mut back = vec![0u32; x.len()];
    match way {
        GraphWay::Planned => {
            manager.transfer(&x, &mut back[..]).unwrap();
        }
        GraphWay::Interleaved => {
            interleaved.transfer(&x, &mut back[..]).unwrap();
        }
        GraphWay::Borrowed => {
            block_on(manager.download_async(&x, 0, &mut back).unwrap()).unwrap();
        }
        GraphWay::Owned => {
            let down = block_on(manager.download_owned(x, 0, back));
            down.result.unwrap();
            return (down.device, down.host);
        }
        GraphWay::View => {
            let len = x.len();
            manager
                .transfer(Source::view(x.slice(0..len).unwrap()), &mut back[..])
                .unwrap();
        }
    }
    (x, back)
}

/// A PyTorch-style static-input graph (`g.replay()` with `static_input.copy_(batch)` around it),
/// except that the copies go through the transfer manager's own streams: the graph, captured
/// with a tracked launch, spins 20 ms and then increments every element of `x` (1 Mi `u32`).
/// Each round, by every way: a replay, then at once an upload of a new batch into `x` (it must
/// land after the replay's increment: downloading then gives the batch exactly, not batch + 1);
/// then a replay and at once a download (it must wait for the replay: batch + 1).
#[test]
fn transfers_queued_right_behind_a_tracked_graph_replay_are_ordered_after_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let increment = kernels.module().function("increment_u32").unwrap();
    const N: usize = 1 << 20;
    let manager = TransferManager::new().unwrap();
    let interleaved = TransferManager::with_staging(StagingConfig {
        chunk_bytes: 64 * KIB,
        depth: 2,
        threads: 4,
        host_copy: HostCopy::Streaming,
        order: ChunkOrder::Interleaved,
    })
    .unwrap();
    let mut x = DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap();
    let stream = user_stream(&gpu.context);
    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    kernels.spin_ns(&stream, REPLAY_SPIN_NS).unwrap();
    let n = N as u64;
    // SAFETY: increment_u32(unsigned* data, size_t n) gets x's address and length; it reads
    // and writes only x, declared a write.
    unsafe {
        TrackedLaunch::new(&increment, &stream, grid(N, 4096))
            .write(&mut x)
            .arg(&n)
            .launch()
    }
    .unwrap();
    let graph = stream.end_capture().unwrap();
    assert!(
        graph.tracked_capture().is_some(),
        "the capture used a tracked buffer, so its graph is tracked"
    );
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    let ways = [
        GraphWay::Planned,
        GraphWay::Interleaved,
        GraphWay::Borrowed,
        GraphWay::Owned,
        GraphWay::View,
    ];
    for (w, way) in ways.into_iter().enumerate() {
        for round in 0..2u64 {
            let batch = words(N, 1000 + 10 * w as u64 + round);
            exec.launch(&stream).unwrap();
            x = upload_by(way, &manager, &interleaved, &batch, x);
            let (back, got) = download_by(way, &manager, &interleaved, x);
            x = back;
            assert_bytes(
                &got,
                &batch,
                &format!("{way:?} round {round}: an upload right behind a replay"),
            );
            exec.launch(&stream).unwrap();
            let (back, got) = download_by(way, &manager, &interleaved, x);
            x = back;
            let plus: Vec<u32> = batch.iter().map(|v| v.wrapping_add(1)).collect();
            assert_bytes(
                &got,
                &plus,
                &format!("{way:?} round {round}: a download right behind a replay"),
            );
        }
    }
    stream.synchronize().unwrap();
}

// ---------------------------------------------------------------------------------------------
// 4. Ten thousand small transfers beside a capture / replay loop
// ---------------------------------------------------------------------------------------------

/// A serving loop's request thread moves small tensors (4 KiB to 4 KiB + 6 bytes, up and back,
/// 10^4 transfers) while its model thread keeps capturing a small graph in thread-local mode,
/// instantiating it, replaying it and checking its output, over and over. Every transfer is
/// exact; idle lanes stay within `MAX_IDLE_LANES` and every mark word not held by an idle lane
/// is free; the statistics count each transfer exactly once; resident memory grows by at most
/// 128 MiB; every replay of the model thread wrote 8 everywhere.
#[test]
#[cfg(target_os = "linux")]
fn ten_thousand_small_transfers_beside_a_capture_replay_loop_stay_exact_and_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    const ROUND_TRIPS: usize = 5000;
    let manager = TransferManager::new().unwrap();
    let ordinal = gpu.device.ordinal();
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, 4 * KIB + 8).unwrap();
    for _ in 0..50 {
        let data = bytes(4 * KIB, 1);
        let mut back = vec![0u8; data.len()];
        manager
            .transfer(&data, Destination::device(&mut device, 0))
            .unwrap();
        manager
            .transfer(Source::device(&device, 0, data.len()), &mut back[..])
            .unwrap();
    }
    manager.stats().reset();
    let before = resident_bytes();
    let stop = Arc::new(AtomicBool::new(false));
    // Stops the model thread also when this thread fails part way.
    let _stop_on_exit = StopOnDrop(Arc::clone(&stop));
    let replays = Arc::new(AtomicUsize::new(0));
    let model = std::thread::spawn({
        let (stop, replays) = (Arc::clone(&stop), Arc::clone(&replays));
        let context = Arc::clone(&gpu.context);
        move || {
            let kernels = TestKernels::load(&context).unwrap();
            let stream = user_stream(&context);
            let out = DeviceBuffer::<u32>::zeroed(&context, G).unwrap();
            let ptr = out.device_ptr();
            while !stop.load(Ordering::Acquire) || replays.load(Ordering::Relaxed) == 0 {
                stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
                // SAFETY: `out` holds G u32s and outlives every launch (synchronised below);
                // the captured kernels are its only writers.
                unsafe { kernels.fill_u32(&stream, ptr, 7, G) }.unwrap();
                // SAFETY: as above.
                unsafe { kernels.increment_u32(&stream, ptr, G) }.unwrap();
                let graph = stream.end_capture().unwrap();
                let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
                exec.launch(&stream).unwrap();
                stream.synchronize().unwrap();
                assert_all_u32(&out.to_vec().unwrap(), 8, "a replay beside the transfers");
                replays.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    let mut sizes = Vec::new();
    let mut most_idle = 0;
    for i in 0..ROUND_TRIPS {
        let len = 4 * KIB + i % 7;
        let data = bytes(len, i as u64);
        let mut back = vec![0u8; len];
        manager
            .transfer(&data, Destination::device(&mut device, 0))
            .unwrap();
        manager
            .transfer(Source::device(&device, 0, len), &mut back[..])
            .unwrap();
        if back != data {
            stop.store(true, Ordering::Release);
            let _ = model.join();
            panic!("round trip {i} of {len} bytes changed bytes");
        }
        sizes.push(len);
        if i % 100 == 0 {
            most_idle = most_idle.max(manager.idle_lanes(ordinal));
        }
    }
    stop.store(true, Ordering::Release);
    model
        .join()
        .expect("the model thread's captures and replays");
    assert!(replays.load(Ordering::Relaxed) >= 1);
    let idle = manager.idle_lanes(ordinal);
    assert!(
        most_idle.max(idle) <= MAX_IDLE_LANES,
        "{most_idle} idle lanes kept (at most {MAX_IDLE_LANES})"
    );
    let free_marks = manager.free_mark_words(ordinal);
    assert!(
        free_marks + idle * MARKED_STREAMS >= 512,
        "{free_marks} mark words free with {idle} idle lanes after {ROUND_TRIPS} round trips"
    );
    let class = SizeClass::of(4 * KIB);
    let up = manager.stats().get(TransferPath::PAGEABLE_TO_DEVICE, class);
    let down = manager.stats().get(TransferPath::DEVICE_TO_PAGEABLE, class);
    let total: u64 = sizes.iter().map(|&s| s as u64).sum();
    assert_eq!(
        (up.count, up.bytes, up.failures),
        (ROUND_TRIPS as u64, total, 0),
        "uploads counted: {up:?}"
    );
    assert_eq!(
        (down.count, down.bytes, down.failures),
        (ROUND_TRIPS as u64, total, 0),
        "downloads counted: {down:?}"
    );
    let after = resident_bytes();
    if before > 0 {
        assert!(
            after <= before + 128 * MIB as u64,
            "resident memory grew from {before} to {after} bytes over {ROUND_TRIPS} round \
             trips beside a capture/replay loop"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 5. A manager made lazily by many threads at once
// ---------------------------------------------------------------------------------------------

/// A server keeps one `static MANAGER: OnceLock<TransferManager>` made on first use; eight
/// request threads released together all reach it first. It must be made once, serve all
/// eight (each a round trip of 1 MiB + 1 + t bytes, exact), open device 0, and count exactly
/// eight uploads and eight downloads.
#[test]
fn a_manager_made_lazily_by_eight_threads_at_once_is_made_once_and_counts_every_transfer() {
    let gpu = require_gpu!();
    let _serial = serial();
    const THREADS: usize = 8;
    let lazy: OnceLock<TransferManager> = OnceLock::new();
    let made = AtomicUsize::new(0);
    let start = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (lazy, made, start, context) = (&lazy, &made, &start, &gpu.context);
            scope.spawn(move || {
                // Past 1 MiB for every thread: all eight fall in `SizeClass::of(MIB + 1)`.
                let n = MIB + 1 + t;
                let data = bytes(n, 300 + t as u64);
                let mut device = DeviceBuffer::<u8>::zeroed(context, n).unwrap();
                start.wait();
                let manager = lazy.get_or_init(|| {
                    made.fetch_add(1, Ordering::Relaxed);
                    TransferManager::new().unwrap()
                });
                let mut back = vec![0u8; n];
                manager.transfer(&data, &mut device).unwrap();
                manager.transfer(&device, &mut back[..]).unwrap();
                assert_bytes(&back, &data, &format!("thread {t}'s round trip"));
            });
        }
    });
    assert_eq!(
        made.load(Ordering::Relaxed),
        1,
        "the manager was made more than once"
    );
    let manager = lazy.get().expect("made");
    assert!(manager.is_open(gpu.device.ordinal()));
    let class = SizeClass::of(MIB + 1);
    let up = manager.stats().get(TransferPath::PAGEABLE_TO_DEVICE, class);
    let down = manager.stats().get(TransferPath::DEVICE_TO_PAGEABLE, class);
    assert_eq!(
        (up.count, up.failures),
        (THREADS as u64, 0),
        "uploads: {up:?}"
    );
    assert_eq!(
        (down.count, down.failures),
        (THREADS as u64, 0),
        "downloads: {down:?}"
    );
    let bytes_moved: u64 = (0..THREADS).map(|t| (MIB + 1 + t) as u64).sum();
    assert_eq!((up.bytes, down.bytes), (bytes_moved, bytes_moved));
}

/// Sixteen worker threads of a program that may run without a GPU each make a manager at the
/// same moment. They must all agree: with a driver, each serves `Device::count()` devices and
/// has opened none; without one, each gets the driver's typed `NotFound`, never a panic or a
/// different error on some thread. Needs no GPU: it runs everywhere.
#[test]
fn managers_made_by_sixteen_threads_at_once_agree_with_or_without_a_driver() {
    const THREADS: usize = 16;
    let start = Barrier::new(THREADS);
    let outcomes: Vec<Result<TransferManager, TransferError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    TransferManager::new()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    match Device::count() {
        Ok(count) => {
            for (t, outcome) in outcomes.iter().enumerate() {
                let manager = outcome
                    .as_ref()
                    .unwrap_or_else(|e| panic!("thread {t}: {e} with a driver present"));
                assert_eq!(manager.device_count(), count, "thread {t}");
                assert!(
                    (0..count).all(|d| !manager.is_open(d)),
                    "thread {t}: a new manager opened a device"
                );
            }
        }
        Err(error) => {
            assert!(error.is_not_found(), "no driver here, but: {error}");
            for (t, outcome) in outcomes.iter().enumerate() {
                match outcome {
                    Err(TransferError::Driver(e @ DriverError::NotFound { .. })) => {
                        assert!(e.is_not_found());
                    }
                    Err(other) => panic!("thread {t}: {other} instead of NotFound"),
                    Ok(_) => panic!("thread {t}: a manager without a driver"),
                }
            }
        }
    }
}

/// A loader thread hands a slice of work (`Source::device` / `Destination::device` with an
/// offset past the end) to a manager during another thread's global capture: the refusals of
/// bad ranges come before any driver call, so they answer `OutOfRange` at once (not
/// `Capturing`, not a broken capture), and the capture ends valid.
#[test]
fn bad_ranges_during_another_threads_global_capture_are_out_of_range_and_break_nothing() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let manager = Arc::new(TransferManager::new().unwrap());
    let n = 64 * KIB + 3;
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    manager.transfer(&bytes(n, 5), &mut device).unwrap();
    manager.stats().reset();
    let (outcomes, captured) = beside_capture(&gpu, &kernels, CaptureMode::Global, {
        let manager = Arc::clone(&manager);
        move || {
            let data = bytes(n, 6);
            let mut back = [0u8; 8];
            let upload = manager
                .transfer(&data[..8], Destination::device(&mut device, n - 7))
                .map(|_| ());
            let download = manager
                .transfer(Source::device(&device, n, 8), &mut back[..])
                .map(|_| ());
            let borrowed = manager.upload_async(&data[..], &mut device, 1).map(|_| ());
            let owned = block_on(manager.upload_owned(data.clone(), device, 2));
            vec![upload, download, borrowed, owned.result.map(|_| ())]
        }
    });
    for (i, outcome) in outcomes.iter().enumerate() {
        assert!(
            matches!(outcome, Err(TransferError::OutOfRange { .. })),
            "refusal {i} during the global capture: {outcome:?}"
        );
    }
    assert_replayed(&captured, "the global capture beside refused transfers");
    assert_eq!(
        manager
            .stats()
            .snapshot()
            .iter()
            .map(|(_, _, s)| s.count)
            .sum::<u64>(),
        0,
        "refused transfers are not counted"
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Transfers from the capturing thread itself, and forgotten futures
// ---------------------------------------------------------------------------------------------

/// A PyTorch user's classic slip: `x.to(device)` (and `.cpu()`) called inside their own
/// `torch.cuda.graph` block, here a thread-local capture on a non-blocking stream of this very
/// thread. Each way of moving 1 MiB + 3 bytes (planned, `DirectCopy` and `HostStaged` pageable,
/// pinned, device to device, borrowed and owned futures) must either move exact bytes or
/// return a typed error (never `Ok` with other bytes); none may break the user's capture, which
/// must end valid and replay (fill 7, increment: 8); afterwards every way works exactly.
#[test]
fn transfers_made_from_inside_the_callers_own_thread_local_capture_break_nothing() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let manager = TransferManager::new().unwrap();
    let n = MIB + 3;
    let data = bytes(n, 404);
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    let mut spare = DeviceBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    let pinned = cuweave_memory::PinnedBuffer::from_slice(&gpu.context, &data).unwrap();
    // Every way once before the capture: lanes, blocks and the reactor exist.
    let every_way = |device: &mut DeviceBuffer<u8>,
                     spare: &mut DeviceBuffer<u8>|
     -> Vec<(&'static str, Result<bool, TransferError>)> {
        let mut out = Vec::new();
        for (name, method) in [
            ("planned", None),
            ("DirectCopy", Some(TransferMethod::DirectCopy)),
            ("HostStaged", Some(TransferMethod::HostStaged)),
        ] {
            let mut back = vec![0u8; n];
            let result = (|| {
                match method {
                    None => manager.transfer(&data, &mut *device)?,
                    Some(m) => manager.transfer_with(m, &data, &mut *device)?,
                };
                match method {
                    None => manager.transfer(&*device, &mut back[..])?,
                    Some(m) => manager.transfer_with(m, &*device, &mut back[..])?,
                };
                Ok(back == data)
            })();
            out.push((name, result));
        }
        let result = (|| {
            let mut back = vec![0u8; n];
            manager.transfer(&pinned, &mut *device)?;
            manager.transfer(&*device, &mut *spare)?;
            manager.transfer(&*spare, &mut back[..])?;
            Ok(back == data)
        })();
        out.push(("pinned, then device to device", result));
        out.push((
            "borrowed",
            borrowed_round_trip(&manager, &data, device).map(|b| b == data),
        ));
        let context = Arc::clone(device.context());
        let taken = std::mem::replace(device, DeviceBuffer::new(&context, 1).unwrap());
        let up = block_on(manager.upload_owned(data.clone(), taken, 0));
        let result = up.result.map(|_| ());
        let down = block_on(manager.download_owned(up.device, 0, vec![0u8; n]));
        *device = down.device;
        out.push((
            "owned",
            result
                .and(down.result.map(|_| ()))
                .map(|()| down.host == data),
        ));
        out
    };
    let before = every_way(&mut device, &mut spare);
    assert!(
        before.iter().all(|(_, r)| matches!(r, Ok(true))),
        "before the capture: {before:?}"
    );

    let stream = user_stream(&gpu.context);
    let out = DeviceBuffer::<u32>::zeroed(&gpu.context, G).unwrap();
    let ptr = out.device_ptr();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: `out` holds G u32s and outlives every launch of the graph (synchronised below);
    // the captured kernels are its only writers.
    unsafe { kernels.fill_u32(&stream, ptr, 7, G) }.unwrap();
    let during = every_way(&mut device, &mut spare);
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&stream, ptr, G) }.unwrap();
    let ended = stream.end_capture();
    eprintln!("transfers from inside the thread's own capture: {during:?}");
    assert!(
        !during.iter().any(|(_, r)| matches!(r, Ok(false))),
        "Ok with wrong bytes from inside a capture: {during:?}"
    );
    let graph = ended.unwrap_or_else(|error| {
        panic!("the user's capture was broken by transfers made inside it: {error} ({during:?})")
    });
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    assert_all_u32(&out.to_vec().unwrap(), 8, "the replay");
    let after = every_way(&mut device, &mut spare);
    assert!(
        after.iter().all(|(_, r)| matches!(r, Ok(true))),
        "after the capture: {after:?}"
    );
}

/// A careless async client `mem::forget`s its borrowed downloads (64 KiB + 1 byte each,
/// polled until a chunk is in flight) 300 times, beside another thread's thread-local capture:
/// each forgotten future keeps its lane, so the device's 512 progress-mark words (two a lane)
/// run out on the way. Forgetting is safe (the copy engine writes only the future's own pinned
/// block), so afterwards the manager must still move 4 MiB + 1 byte both ways exactly (ordered
/// copies fall back to the interleaved pipeline without a mark word), a borrowed round trip
/// still works, no forgotten transfer is counted, and the capture ends valid.
#[test]
fn three_hundred_forgotten_borrowed_downloads_leave_the_manager_working() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    const FORGOTTEN: usize = 300;
    let manager = Arc::new(TransferManager::new().unwrap());
    let small = 64 * KIB + 1;
    let big = 4 * MIB + 1;
    let mut source = DeviceBuffer::<u8>::from_slice(&gpu.context, &bytes(small, 9)).unwrap();
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, big).unwrap();
    let warm = borrowed_round_trip(&manager, &bytes(small, 9), &mut source).unwrap();
    assert_bytes(&warm, &bytes(small, 9), "the warm-up");
    manager.stats().reset();
    let ordinal = gpu.device.ordinal();

    let ((resolved, marks_left), captured) =
        beside_capture(&gpu, &kernels, CaptureMode::ThreadLocal, {
            let manager = Arc::clone(&manager);
            move || {
                let mut resolved = 0;
                let mut host = vec![0u8; small];
                for _ in 0..FORGOTTEN {
                    let mut download = manager.download_async(&source, 0, &mut host).unwrap();
                    if poll_until_state(&mut download, |d| in_flight(d) >= 1) {
                        resolved += 1;
                    }
                    std::mem::forget(download);
                }
                // The host memory is the caller's again: nothing touches it any more.
                host.fill(0xAB);
                assert!(host.iter().all(|&b| b == 0xAB));
                (resolved, manager.free_mark_words(ordinal))
            }
        });
    assert_replayed(
        &captured,
        "the thread-local capture beside forgotten downloads",
    );
    eprintln!(
        "{resolved} of {FORGOTTEN} resolved before they were forgotten; {marks_left} mark words left"
    );
    for round in 0..3u64 {
        let data = bytes(big, 500 + round);
        let mut back = vec![0u8; big];
        manager.transfer(&data, &mut device).unwrap();
        manager.transfer(&device, &mut back[..]).unwrap();
        assert_bytes(
            &back,
            &data,
            &format!("round {round} after {FORGOTTEN} forgotten futures"),
        );
    }
    let data = bytes(big, 600);
    let back = borrowed_round_trip(&manager, &data, &mut device).unwrap();
    assert_bytes(
        &back,
        &data,
        "a borrowed round trip after the forgotten futures",
    );
    let forgotten = manager
        .stats()
        .get(TransferPath::DEVICE_TO_PAGEABLE, SizeClass::of(small));
    assert_eq!(
        forgotten.count + forgotten.failures,
        resolved as u64,
        "only the downloads that resolved before they were forgotten are counted: {forgotten:?}"
    );
}
