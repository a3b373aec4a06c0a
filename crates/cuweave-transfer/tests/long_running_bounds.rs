//! Long-running bounds of the transfer layer under what a server that runs for days makes per
//! request: a `TransferManager` per request (each opens its own per-device state: pinned staging
//! pool, completion words, progress-mark words, lanes of streams), and one shared manager used
//! from a new thread per request (idle lanes, progress-mark words, per-thread worker state).
//!
//! Each test runs its loop hundreds to thousands of times and asserts what is public: the
//! process's thread count (`/proc/self/task`, Linux only) and resident memory, the device's free
//! memory (`Context::memory_info`), `TransferManager::idle_lanes` / `free_mark_words`, and the
//! statistics' counts. Each test takes a few seconds at most on an H200.

mod common;

use cuweave_memory::DeviceBuffer;
use cuweave_test_support::{require_gpu, resident_bytes, serial};
use cuweave_transfer::{MAX_IDLE_LANES, SizeClass, TransferManager, TransferPath};

const MIB: usize = 1 << 20;

/// Structure: a manager's per-device state (`device_state.rs`, `DeviceSlot` / `DeviceState`:
/// pinned staging pool, a page of completion words, a page of mark words, idle lanes of
/// streams), made on a manager's first transfer to a device and owned by the manager. Loop: 300
/// requests each make a manager, move 1 MiB + 1 of pageable memory to the device and back through
/// it, and drop it. Expected bound: what a dropped manager opened goes with it, so device
/// memory, resident host memory (pinned staging blocks are resident) and threads stay flat.
#[test]
#[cfg(target_os = "linux")]
fn a_transfer_manager_per_request_releases_what_it_opened() {
    let gpu = require_gpu!();
    let _serial = serial();
    const REQUESTS: usize = 300;
    const WARMUP: usize = 20;
    let n = MIB + 1;
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n).expect("device buffer");
    let mut baseline = None;
    let mut most_threads = 0;
    for request in 0..REQUESTS {
        let manager = TransferManager::new().expect("manager");
        let data = common::bytes(n, request as u64);
        manager.transfer(&data, &mut device).expect("upload");
        let mut back = vec![0u8; n];
        manager.transfer(&device, &mut back).expect("download");
        assert!(
            back == data,
            "request {request}: the round trip changed bytes"
        );
        drop(manager);
        if request == WARMUP {
            baseline = Some((
                gpu.context.memory_info().expect("memory info").free,
                resident_bytes(),
                cuweave_test_support::process_threads(),
            ));
        }
        if request > WARMUP && request % 20 == 0 {
            most_threads = most_threads.max(cuweave_test_support::process_threads());
        }
    }
    let (free_before, resident_before, threads_before) = baseline.expect("warmed up");
    let free_after = gpu.context.memory_info().expect("memory info").free;
    let resident_after = resident_bytes();
    assert!(
        free_after + 64 * MIB >= free_before,
        "device free memory fell from {free_before} to {free_after} bytes over {REQUESTS} \
         managers"
    );
    if resident_before > 0 {
        assert!(
            resident_after <= resident_before + 128 * MIB as u64,
            "resident memory grew from {resident_before} to {resident_after} bytes over \
             {REQUESTS} managers"
        );
    }
    assert!(
        most_threads <= threads_before + 8,
        "{most_threads} threads during the loop, {threads_before} after the warm-up"
    );
}

/// Structure: one manager's idle lanes (`device_state.rs`, `DeviceState::lanes`, at most
/// `MAX_IDLE_LANES`), its free progress-mark words (`free_marks`, 512 words shared by the lanes
/// alive), the worker pool's per-thread state (`workers/mod.rs`, `LAST_RUN`), and the statistics
/// per (path, size class). Loop: 2000 requests, each on a thread of its own that uploads and
/// downloads 64 KiB + 1 through the shared manager and exits, four at a time. Expected bound:
/// idle lanes stay at most `MAX_IDLE_LANES`, every mark word a lane does not hold is free again,
/// threads come back to where they were, and the statistics count each transfer once.
#[test]
#[cfg(target_os = "linux")]
fn one_manager_used_from_a_new_thread_per_request_stays_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    const REQUESTS: usize = 2000;
    const AT_ONCE: usize = 4;
    let n = 64 * 1024 + 1;
    let manager = TransferManager::new().expect("manager");
    // Warm the device state and the worker pool.
    {
        let data = common::bytes(n, 0);
        let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n).expect("device buffer");
        manager
            .transfer(&data, &mut device)
            .expect("warm-up upload");
    }
    manager.stats().reset();
    let threads_before = cuweave_test_support::process_threads();
    let mut most_idle = 0;
    for round in 0..REQUESTS / AT_ONCE {
        std::thread::scope(|scope| {
            for t in 0..AT_ONCE {
                let (manager, context) = (&manager, &gpu.context);
                scope.spawn(move || {
                    let seed = (round * AT_ONCE + t) as u64;
                    let data = common::bytes(n, seed);
                    let mut device = DeviceBuffer::<u8>::zeroed(context, n).expect("buffer");
                    manager.transfer(&data, &mut device).expect("upload");
                    let mut back = vec![0u8; n];
                    manager.transfer(&device, &mut back).expect("download");
                    assert!(back == data, "request {seed}: the round trip changed bytes");
                });
            }
        });
        most_idle = most_idle.max(manager.idle_lanes(gpu.device.ordinal()));
    }
    let ordinal = gpu.device.ordinal();
    let idle = manager.idle_lanes(ordinal);
    assert!(
        most_idle <= MAX_IDLE_LANES,
        "{most_idle} idle lanes kept (at most {MAX_IDLE_LANES})"
    );
    // Only idle lanes hold mark words now (at most MARKED_STREAMS each).
    let free_marks = manager.free_mark_words(ordinal);
    assert!(
        free_marks + idle * cuweave_transfer::MARKED_STREAMS >= 512,
        "{free_marks} mark words free with {idle} idle lanes: words of finished transfers \
         were not given back"
    );
    let up = manager
        .stats()
        .get(TransferPath::PAGEABLE_TO_DEVICE, SizeClass::of(n));
    let down = manager
        .stats()
        .get(TransferPath::DEVICE_TO_PAGEABLE, SizeClass::of(n));
    assert_eq!(up.count, REQUESTS as u64, "uploads counted: {up:?}");
    assert_eq!(down.count, REQUESTS as u64, "downloads counted: {down:?}");
    assert_eq!(
        manager.stats().snapshot().len(),
        2,
        "one entry per path and class used"
    );
    let threads_after = cuweave_test_support::process_threads();
    assert!(
        threads_after <= threads_before + 4,
        "{threads_before} threads before, {threads_after} after {REQUESTS} request threads"
    );
}
