//! Fifth-look user programs for the transfer manager, written as PyTorch (`tensor.to(device,
//! non_blocking=True)` from pageable and pinned memory, `pin_memory()` loaders), RMM and cudarc
//! (`htod_copy`, `dtoh_sync_copy`) users drive transfers, on what the crate's other tests leave
//! out:
//!
//! - a calibration table saved to a file and loaded back plans every query with the same
//!   method and the same text (per-device figures, staging choices, registration cost), and a
//!   plan's text names the figure, the size and the machine it chose by (CPU only);
//! - a measured calibration saved to disk and loaded into a manager that forgot it plans as
//!   before, where the cleared manager fell back to the labelled defaults;
//! - a manager limited with `for_devices` opens its device only for work that moves bytes
//!   (planning, advice, empty and refused transfers, empty owned transfers open nothing);
//! - registered host memory read and written by borrowed futures at odd sub-ranges, a future
//!   forgotten mid-flight, then unregister and re-register of the same range;
//! - registering memory that is already pinned (a `PinnedBuffer`'s own host slice);
//! - statistics per path after six threads of mixed traffic (pageable, pinned into views,
//!   registered, unified) and owned transfers dropped before they finish;
//! - views of unified and pinned buffers as pipelined (HostStaged) destinations and sources at
//!   the staging chunk the manager reports, one element either side;
//! - borrowed futures at the async chunk's edges polled round-robin on one thread;
//! - a `pin_memory()` loader: pageable batch -> pinned buffer -> device view and back, by
//!   DirectCopy and (where the device maps host memory) ZeroCopy.
//!
//! Every GPU test skips without a GPU; no executor is a dev-dependency (tokio is not), so a
//! minimal round-robin one is here and `block_on` comes from the common module.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::Duration;

use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer};
use cuweave_test_support::{poll_until, require_gpu, serial};
use cuweave_transfer::planner::{Query, choose_for};
use cuweave_transfer::{
    CalibrationTable, ChunkOrder, DEFAULT_MACHINE, Destination, HostCopy, LocationKind,
    MARKED_STREAMS, MAX_IDLE_LANES, Measure, PathFacts, PathStats, PlanReason, RegistrationCost,
    SizeClass, Source, StagingChoice, StagingConfig, TransferDirection, TransferError,
    TransferManager, TransferMethod, TransferPath, TransferReport,
};
use cuweave_transfer::{Location, MAX_WORKERS};

mod common;
use common::{assert_bytes, block_on, bytes, words};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// The elements one poll-driven chunk of a borrowed future moves for `u32` (its 1 MiB chunk).
const ASYNC_CHUNK_U32: usize = MIB / 4;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Wakes the thread that runs the round-robin executor.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls every future round-robin on this thread (one poll each per round, parking when a
/// whole round made no future ready), as a single-threaded executor interleaves tasks; returns
/// the outputs in order.
fn round_robin<'a, O>(mut futures: Vec<Pin<Box<dyn Future<Output = O> + 'a>>>) -> Vec<O> {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = TaskContext::from_waker(&waker);
    let mut outputs: Vec<Option<O>> = futures.iter().map(|_| None).collect();
    let mut left = futures.len();
    while left > 0 {
        let mut progressed = false;
        for (i, future) in futures.iter_mut().enumerate() {
            if outputs[i].is_some() {
                continue;
            }
            if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
                outputs[i] = Some(output);
                left -= 1;
                progressed = true;
            }
        }
        if !progressed && left > 0 {
            // A wake that came during the round has already unparked us: this returns at once.
            std::thread::park_timeout(Duration::from_millis(50));
        }
    }
    outputs.into_iter().map(Option::unwrap).collect()
}

/// Polls `future` at most `n` times with a waker that does nothing; whether it resolved.
fn poll_n<F: Future + Unpin>(future: &mut F, n: usize) -> bool {
    let mut cx = TaskContext::from_waker(Waker::noop());
    (0..n).any(|_| Pin::new(&mut *future).poll(&mut cx).is_ready())
}

/// Polls a borrowed `future` (with a waker that does nothing) until a chunk of it is in
/// flight on the copy engine, as its `Debug` reports, or it resolved; whether it resolved.
/// Gives up after a generous limit (the first poll waits for a staging worker to pin blocks).
fn poll_into_flight<F: Future + Unpin + std::fmt::Debug>(future: &mut F) -> bool {
    let mut resolved = false;
    let reached = poll_until(Duration::from_secs(30), || {
        resolved = poll_n(future, 1);
        let text = format!("{future:?}");
        let in_flight = text
            .split("in_flight: ")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|digits| digits.parse::<usize>().ok())
            .unwrap_or(0);
        resolved || in_flight > 0
    });
    assert!(reached, "no chunk ever went in flight: {future:?}");
    resolved
}

/// A scratch file path unique to this process and `name`.
fn scratch(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "cuweave-fifth-look-{}-{name}.json",
        std::process::id()
    ))
}

/// Every (path, size class) of `stats` with its figures, for exact comparisons.
fn by_path(manager: &TransferManager) -> BTreeMap<(TransferPath, SizeClass), PathStats> {
    manager
        .stats()
        .snapshot()
        .into_iter()
        .map(|(path, class, stats)| ((path, class), stats))
        .collect()
}

/// Every location of one device a plan can be asked about.
fn locations(device: usize) -> [Location; 5] {
    [
        Location::PageableHost,
        Location::PinnedHost(device),
        Location::Device(device),
        Location::Unified(device),
        Location::RegisteredHost(device),
    ]
}

/// The sizes the planning tests ask about: inside every size class and between the
/// calibration sizes.
const PLAN_SIZES: [usize; 8] = [
    1,
    4 * KIB + 3,
    64 * KIB,
    MIB + 1,
    7 * MIB + 1,
    64 * MIB,
    100 * MIB,
    300 * MIB,
];

// ---------------------------------------------------------------------------------------------
// CPU: calibration files and plan text
// ---------------------------------------------------------------------------------------------

/// A table like the one a user saves after `calibrate()` on one machine and loads at the next
/// start: global and per-device figures at several sizes, staging choices, a registration cost.
fn hand_made_table() -> CalibrationTable {
    let mut table = CalibrationTable {
        device: Some("NVIDIA H200".to_owned()),
        devices: vec!["NVIDIA H200".to_owned()],
        registration: Some(RegistrationCost {
            fixed_ms: 0.37,
            ms_per_mib: 0.041,
        }),
        ..CalibrationTable::default()
    };
    let h2d = TransferPath::PAGEABLE_TO_DEVICE;
    let d2h = TransferPath::DEVICE_TO_PAGEABLE;
    let at = |path, dst_device: Option<usize>, src_device: Option<usize>, bytes| Measure {
        path,
        src_device,
        dst_device,
        bytes,
    };
    // Any device: direct wins small copies, the pipeline large ones.
    for (bytes, staged, direct) in [
        (4 * KIB, 1.0, 5.0),
        (4 * MIB, 20.0, 10.0),
        (64 * MIB, 25.0, 12.5),
    ] {
        table.record_at(
            at(h2d, None, None, bytes),
            TransferMethod::HostStaged,
            staged,
        );
        table.record_at(
            at(h2d, None, None, bytes),
            TransferMethod::DirectCopy,
            direct,
        );
        table.record_at(
            at(d2h, None, None, bytes),
            TransferMethod::HostStaged,
            staged * 0.9,
        );
        table.record_at(
            at(d2h, None, None, bytes),
            TransferMethod::DirectCopy,
            direct,
        );
    }
    // Device 0 measured on its own: direct just ahead at 4 MiB.
    table.record_at(
        at(h2d, Some(0), None, 4 * MIB),
        TransferMethod::HostStaged,
        30.0,
    );
    table.record_at(
        at(h2d, Some(0), None, 4 * MIB),
        TransferMethod::DirectCopy,
        31.0,
    );
    // Pinned: zero-copy wins tiny copies only; unified: prefetch wins large ones.
    let pinned = TransferPath::PINNED_TO_DEVICE;
    table.record_at(
        at(pinned, None, None, 4 * KIB),
        TransferMethod::ZeroCopy,
        6.0,
    );
    table.record_at(
        at(pinned, None, None, 4 * KIB),
        TransferMethod::DirectCopy,
        3.0,
    );
    table.record_at(
        at(pinned, None, None, 64 * MIB),
        TransferMethod::ZeroCopy,
        20.0,
    );
    table.record_at(
        at(pinned, None, None, 64 * MIB),
        TransferMethod::DirectCopy,
        50.123_456,
    );
    let unified = TransferPath::local(LocationKind::Pageable, LocationKind::Unified);
    table.record_at(
        at(unified, None, None, 64 * MIB),
        TransferMethod::UnifiedMemory,
        14.0,
    );
    table.record_at(
        at(unified, None, None, 64 * MIB),
        TransferMethod::DirectCopy,
        9.0,
    );
    table.record(
        TransferPath::REGISTERED_TO_DEVICE,
        SizeClass::Large,
        TransferMethod::DirectCopy,
        53.1,
    );
    for bytes in [4 * MIB, 64 * MIB] {
        table.record_staging(StagingChoice {
            path: h2d,
            device: 0,
            bytes,
            config: StagingConfig {
                chunk_bytes: bytes / 8,
                depth: 3,
                threads: MAX_WORKERS.min(4),
                host_copy: HostCopy::Streaming,
                order: ChunkOrder::Ordered,
            },
            gbps: 22.5,
        });
    }
    table
}

/// The facts of a machine that can do everything (so every method is a candidate), and of one
/// that can do nothing but copy.
const ALL_FACTS: PathFacts = PathFacts {
    map_host_memory: true,
    managed_prefetch: true,
    peer_access: true,
};
const NO_FACTS: PathFacts = PathFacts {
    map_host_memory: false,
    managed_prefetch: false,
    peer_access: false,
};

/// A program that calibrates once, saves the table to a file and loads it at its next start:
/// the loaded table equals the saved one, and every query (every pair of locations of two
/// devices, sizes inside every class and between the calibration sizes, both fact sets) gets
/// the same plan with the same text from it; the staging choice per size is the same. A
/// missing file and a file in a missing directory are `CalibrationFile` errors naming the path.
#[test]
fn a_calibration_table_saved_and_loaded_plans_every_query_with_the_same_text() {
    let table = hand_made_table();
    let path = scratch("saved-table");
    table.save(&path).unwrap();
    let loaded = CalibrationTable::load(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(loaded, table, "the table round-trips through its file");
    // Saved again, the file is the same text: nothing drifts across save/load cycles.
    assert_eq!(loaded.to_json(), table.to_json());

    let defaults = CalibrationTable::h100_defaults();
    let mut queries = 0;
    for facts in [ALL_FACTS, NO_FACTS] {
        for src in locations(0).into_iter().chain(locations(1)) {
            for dst in locations(0).into_iter().chain(locations(1)) {
                for bytes in PLAN_SIZES {
                    let query = Query::new(src, dst, bytes);
                    let before = choose_for(query, &facts, &table, None, &defaults);
                    let after = choose_for(query, &facts, &loaded, None, &defaults);
                    assert_eq!(after, before, "{src} -> {dst}, {bytes} bytes");
                    assert_eq!(after.to_string(), before.to_string());
                    assert!(
                        TransferMethod::candidates(before.path).contains(&before.method),
                        "{before}: not a candidate of its path"
                    );
                    queries += 1;
                }
            }
        }
    }
    assert_eq!(queries, 2 * 10 * 10 * PLAN_SIZES.len());
    for bytes in PLAN_SIZES {
        for device in [0, 1] {
            assert_eq!(
                loaded.staging_for(TransferPath::PAGEABLE_TO_DEVICE, device, bytes),
                table.staging_for(TransferPath::PAGEABLE_TO_DEVICE, device, bytes),
                "staging for {bytes} bytes on device {device}"
            );
        }
    }

    let missing = scratch("never-written");
    match CalibrationTable::load(&missing) {
        Err(TransferError::CalibrationFile { path, .. }) => {
            assert!(path.contains("never-written"), "{path}");
        }
        other => panic!("loading a missing file: {other:?}"),
    }
    let nowhere = std::env::temp_dir()
        .join(format!("cuweave-no-such-dir-{}", std::process::id()))
        .join("table.json");
    match table.save(&nowhere) {
        Err(TransferError::CalibrationFile { path, .. }) => {
            assert!(path.contains("no-such-dir"), "{path}");
        }
        other => panic!("saving into a missing directory: {other:?}"),
    }
}

/// What a user reads in `println!("{}", manager.plan(...))`: the chosen method, the path, the
/// figure and the calibration size it was chosen by, the runner-up, the per-device figure
/// where the device was measured on its own, the machine a foreign table came from, the
/// labelled defaults when nothing was measured, and the method skipped for what the devices
/// lack.
#[test]
fn plan_text_names_the_figure_size_runner_up_machine_and_skips_it_chose_by() {
    let table = hand_made_table();
    let defaults = CalibrationTable::h100_defaults();
    let empty = CalibrationTable::default();
    let plan = |src, dst, bytes, facts: &PathFacts, measured, foreign| {
        choose_for(
            Query::new(src, dst, bytes),
            facts,
            measured,
            foreign,
            &defaults,
        )
    };
    let (host, d0, d1) = (
        Location::PageableHost,
        Location::Device(0),
        Location::Device(1),
    );

    // Device 1 has no figures of its own: the any-device ones, nearest size 4 MiB.
    let p = plan(host, d1, 5 * MIB, &ALL_FACTS, &table, None);
    assert_eq!(p.method, TransferMethod::HostStaged, "{p}");
    let text = p.to_string();
    for part in [
        "HostStaged",
        "pageable -> device",
        "measured here at 20.0 GB/s",
        "for 4 MiB",
        "next best 10.0 GB/s",
    ] {
        assert!(text.contains(part), "{part:?} missing from: {text}");
    }
    // Nearest 64 MiB from 48 MiB.
    let p = plan(host, d1, 48 * MIB, &ALL_FACTS, &table, None);
    let text = p.to_string();
    assert!(
        text.contains("25.0 GB/s") && text.contains("for 64 MiB") && text.contains("12.5"),
        "{text}"
    );
    // A tiny copy: direct, chosen at 4 KiB.
    let p = plan(host, d1, 1000, &ALL_FACTS, &table, None);
    assert_eq!(p.method, TransferMethod::DirectCopy, "{p}");
    assert!(p.to_string().contains("for 4 KiB"), "{p}");

    // Device 0 was measured on its own at 4 MiB: its figures decide there.
    let p = plan(host, d0, 4 * MIB, &ALL_FACTS, &table, None);
    assert_eq!(p.method, TransferMethod::DirectCopy, "{p}");
    assert!(
        matches!(p.reason, PlanReason::Calibrated { gbps, runner_up: Some(next), at_bytes }
            if gbps == 31.0 && next == 30.0 && at_bytes == 4 * MIB),
        "{p:?}"
    );

    // A table from another machine still decides, and says where it came from.
    let p = plan(
        host,
        d1,
        5 * MIB,
        &ALL_FACTS,
        &table,
        Some("NVIDIA A100-SXM4-40GB"),
    );
    assert_eq!(p.method, TransferMethod::HostStaged);
    assert!(
        p.to_string()
            .contains("measured on NVIDIA A100-SXM4-40GB (not this machine)"),
        "{p}"
    );
    assert_eq!(p.measured_on.as_deref(), Some("NVIDIA A100-SXM4-40GB"));

    // Nothing measured: the defaults, labelled with their machine.
    let p = plan(host, d0, 64 * MIB, &ALL_FACTS, &empty, None);
    assert!(
        matches!(p.reason, PlanReason::Default { machine, .. } if machine == DEFAULT_MACHINE),
        "{p:?}"
    );
    assert!(
        p.to_string()
            .contains(&format!("default from {DEFAULT_MACHINE}")),
        "{p}"
    );

    // Pinned memory at 64 MiB: the DMA at its full two decimals (50.12), zero-copy next.
    let p = plan(
        Location::PinnedHost(0),
        d0,
        64 * MIB,
        &ALL_FACTS,
        &table,
        None,
    );
    assert_eq!(p.method, TransferMethod::DirectCopy, "{p}");
    assert!(
        p.to_string().contains("50.1 GB/s") && p.to_string().contains("next best 20.0"),
        "{p}"
    );
    // Tiny pinned copies: zero-copy where the device maps host memory, else the DMA.
    let p = plan(
        Location::PinnedHost(0),
        d0,
        4 * KIB,
        &ALL_FACTS,
        &table,
        None,
    );
    assert_eq!(p.method, TransferMethod::ZeroCopy, "{p}");
    let p = plan(
        Location::PinnedHost(0),
        d0,
        4 * KIB,
        &NO_FACTS,
        &table,
        None,
    );
    assert_eq!(p.method, TransferMethod::DirectCopy, "{p}");

    // Unified memory on a device without managed prefetch: the prefetch is skipped, and the
    // plan says why.
    let unified = Location::Unified(0);
    let p = plan(host, unified, 64 * MIB, &ALL_FACTS, &table, None);
    assert_eq!(p.method, TransferMethod::UnifiedMemory, "{p}");
    let p = plan(host, unified, 64 * MIB, &NO_FACTS, &table, None);
    assert_eq!(p.method, TransferMethod::DirectCopy, "{p}");
    assert!(
        p.skipped
            .iter()
            .any(|s| s.method == TransferMethod::UnifiedMemory),
        "{p:?}"
    );
    assert!(p.to_string().contains("skipped UnifiedMemory"), "{p}");

    // Registered memory: the only method, and the text says why.
    let p = plan(
        Location::RegisteredHost(0),
        d0,
        64 * MIB,
        &ALL_FACTS,
        &table,
        None,
    );
    assert_eq!(
        (p.method, p.reason),
        (TransferMethod::DirectCopy, PlanReason::OnlyChoice)
    );
    assert!(p.to_string().contains("page-locked"), "{p}");
}

// ---------------------------------------------------------------------------------------------
// GPU programs
// ---------------------------------------------------------------------------------------------

/// A service that builds its manager for one GPU at start-up (`for_devices(&[0])`) and plans,
/// reads advice and facts before any request: none of that, nor an empty or refused transfer,
/// nor an empty owned transfer, opens the device (no lanes, no mark words, nothing counted).
/// Registering host memory opens it; after concurrent staged traffic the idle lanes are
/// bounded and every mark word is either free or held by an idle lane.
#[test]
fn a_limited_manager_opens_its_device_only_for_work_that_moves_bytes() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::for_devices(&[0]).unwrap();
    assert_eq!(manager.devices(), vec![0]);

    for src in locations(0) {
        for dst in locations(0) {
            let plan = manager.plan(src, dst, 7 * MIB + 1);
            assert!(!plan.to_string().is_empty());
            let _ = manager.facts(src, dst);
        }
    }
    let advice = manager.registration_advice(TransferDirection::HostToDevice, 64 * MIB, 100);
    assert!(!advice.reason.is_empty());
    let _ = manager.staging_for(TransferPath::PAGEABLE_TO_DEVICE, 0, 64 * MIB);
    let _ = manager.calibration();
    let _ = manager.machine();
    let _ = format!("{manager:?}");
    assert_eq!(
        manager.clear_cache(),
        0,
        "nothing opened, nothing to release"
    );
    assert_eq!((manager.idle_lanes(0), manager.free_mark_words(0)), (0, 0));
    assert!(!manager.is_open(0), "planning and reading opened device 0");

    // Empty transfers return at once, without a driver call; refused ones before any.
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, 1024).unwrap();
    let report = manager
        .transfer(&[] as &[u32], Destination::device(&mut device, 1024))
        .unwrap();
    assert_eq!(report.bytes, 0);
    let mut nothing: Vec<u32> = Vec::new();
    manager
        .transfer(Source::device(&device, 1024, 0), &mut nothing)
        .unwrap();
    assert!(matches!(
        manager.transfer(&[1u32; 4][..], Destination::device(&mut device, 1022)),
        Err(TransferError::OutOfRange { .. })
    ));
    let owned = block_on(manager.upload_owned(Vec::new(), device, 1024));
    assert_eq!(owned.result.unwrap().bytes, 0);
    let owned = block_on(manager.download_owned(owned.device, 1024, Vec::new()));
    assert_eq!(owned.result.unwrap().bytes, 0);
    let mut device = owned.device;
    assert!(
        !manager.is_open(0),
        "an empty or refused transfer opened device 0"
    );
    assert!(
        manager.stats().snapshot().is_empty(),
        "empty or refused transfers were counted"
    );

    // Registration opens the device (its context registers the memory).
    let data = words(3 * KIB + 5, 8);
    let mut host = data.clone();
    let registered = manager.register_host(0, &mut host).unwrap();
    assert!(manager.is_open(0));
    let free_at_open = manager.free_mark_words(0);
    manager
        .transfer(
            Source::registered(&registered, 5, 1000),
            Destination::device(&mut device, 17),
        )
        .unwrap();
    drop(registered);
    let got = device.to_vec().unwrap();
    assert_bytes(&got[17..1017], &data[5..1005], "registered upload");

    // Concurrent staged traffic: lanes come back bounded, mark words are all accounted for.
    let n = 3 * MIB + 3;
    std::thread::scope(|scope| {
        for t in 0..6u64 {
            let manager = &manager;
            let context = &gpu.context;
            scope.spawn(move || {
                let data = bytes(n, 100 + t);
                let mut device = DeviceBuffer::<u8>::zeroed(context, n).unwrap();
                for _ in 0..3 {
                    manager
                        .transfer_with(TransferMethod::HostStaged, &data, &mut device)
                        .unwrap();
                    let mut back = vec![0u8; n];
                    manager
                        .transfer_with(TransferMethod::HostStaged, &device, &mut back)
                        .unwrap();
                    assert_bytes(&back, &data, "staged round trip");
                }
            });
        }
    });
    let (idle, free) = (manager.idle_lanes(0), manager.free_mark_words(0));
    assert!((1..=MAX_IDLE_LANES).contains(&idle), "{idle} idle lanes");
    assert!(
        free <= free_at_open,
        "{free} free mark words of {free_at_open}"
    );
    assert!(
        free + idle * MARKED_STREAMS >= free_at_open,
        "mark words lost: {free} free + {idle} idle lanes of {MARKED_STREAMS} < {free_at_open}"
    );
}

/// A frame server that registers its frame buffer once and moves frames through borrowed
/// futures (`upload_async` from an odd sub-range of the registered slice, `download_async`
/// into another), then cancels a request mid-flight by forgetting its future, unregisters the
/// buffer and registers the same range again: every byte lands where it should, the forgotten
/// future never touches the memory again, and a later upload into the buffer the forgotten one
/// was writing is what the buffer holds.
#[test]
fn registered_memory_feeds_borrowed_futures_and_survives_a_forgotten_one_and_reregistration() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    // Three async chunks and a bit, of u32.
    let n = 3 * ASYNC_CHUNK_U32 + 5;
    let data = words(n, 41);
    let mut host = data.clone();
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, n + 8).unwrap();

    let mut registered = manager.register_host(0, &mut host).unwrap();
    let m = n - 8;
    block_on(
        manager
            .upload_async(&registered.as_slice()[3..3 + m], &mut device, 7)
            .unwrap(),
    )
    .unwrap();
    let got = device.to_vec().unwrap();
    assert!(got[..7].iter().all(|&w| w == 0), "before the range");
    assert_bytes(&got[7..7 + m], &data[3..3 + m], "upload from registered");
    assert!(got[7 + m..].iter().all(|&w| w == 0), "after the range");

    let report = block_on(
        manager
            .download_async(&device, 7, &mut registered.as_mut_slice()[1..1 + m])
            .unwrap(),
    )
    .unwrap();
    assert_eq!(report.bytes, m * 4);
    let mut expected = data.clone();
    expected[1..1 + m].copy_from_slice(&data[3..3 + m]);
    assert_bytes(registered.as_slice(), &expected, "download into registered");

    // A request cancelled mid-flight: an upload polled into its second chunk, then forgotten.
    let mut second = DeviceBuffer::<u32>::zeroed(&gpu.context, n).unwrap();
    let mut pending = manager
        .upload_async(registered.as_slice(), &mut second, 0)
        .unwrap();
    let resolved = poll_into_flight(&mut pending);
    std::mem::forget(pending);
    // And a download forgotten likewise, after some of its polls wrote host memory.
    let mut download = manager
        .download_async(&device, 0, registered.as_mut_slice())
        .unwrap();
    let _ = poll_into_flight(&mut download);
    let _ = poll_n(&mut download, 50);
    std::mem::forget(download);
    let snapshot = registered.as_slice().to_vec();
    gpu.context.synchronize().unwrap();
    assert_bytes(
        registered.as_slice(),
        &snapshot,
        "host memory after its futures were forgotten and the device went idle",
    );

    // Unregister while the forgotten upload's copies may still be queued, then register the
    // same range again.
    let back = registered.unregister().unwrap();
    assert_eq!(back.len(), n);
    let fresh = words(n, 42);
    back.copy_from_slice(&fresh);
    let mut again = manager.register_host(0, back).unwrap();
    manager.transfer(&again, &mut second).unwrap();
    gpu.context.synchronize().unwrap();
    assert_bytes(
        &second.to_vec().unwrap(),
        &fresh,
        &format!("the buffer a forgotten upload (resolved: {resolved}) was writing"),
    );
    again.as_mut_slice().fill(0);
    manager
        .transfer(
            Source::device(&second, 2, n - 2),
            Destination::registered(&mut again, 1),
        )
        .unwrap();
    assert_eq!(again.as_slice()[0], 0);
    assert_bytes(
        &again.as_slice()[1..n - 1],
        &fresh[2..],
        "download after re-register",
    );
    assert_eq!(again.as_slice()[n - 1], 0);
    let back = again.unregister().unwrap();
    assert_eq!(back[1], fresh[2]);
}

/// A user who calls `cudaHostRegister` on memory that is already pinned (a `PinnedBuffer`'s
/// own host slice, as PyTorch users do on a `pin_memory()` tensor): the driver's choice, a
/// typed error or a registration that moves exact bytes; no panic, and the pinned buffer
/// still moves exact bytes both ways afterwards.
#[test]
fn registering_memory_that_is_already_pinned_is_a_typed_error_or_moves_exact_bytes() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let n = 256 * KIB + 3;
    let data = bytes(n, 7);
    let mut pinned = PinnedBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    pinned.as_mut_slice().unwrap().copy_from_slice(&data);
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n).unwrap();
    {
        let mut slice = pinned.as_mut_slice().unwrap();
        match manager.register_host(0, &mut slice[..]) {
            Err(TransferError::Driver(_) | TransferError::Memory(_)) => {}
            Err(other) => panic!("registering pinned memory: unexpected error {other}"),
            Ok(registered) => {
                manager.transfer(&registered, &mut device).unwrap();
                assert_bytes(&device.to_vec().unwrap(), &data, "from a double pin");
                registered.unregister().unwrap();
            }
        }
    }
    // The pinned buffer is still pinned memory that moves exact bytes.
    device.fill(0).unwrap();
    manager
        .transfer(
            Source::pinned(&pinned, 1, n - 1),
            Destination::device(&mut device, 0),
        )
        .unwrap();
    assert_bytes(
        &device.to_vec().unwrap()[..n - 1],
        &data[1..],
        "pinned upload",
    );
    pinned.as_mut_slice().unwrap().fill(0);
    manager
        .transfer(
            Source::device(&device, 0, n - 1),
            Destination::pinned(&mut pinned, 1),
        )
        .unwrap();
    let got = pinned.as_slice().unwrap().to_vec();
    assert_eq!(got[0], 0);
    assert_bytes(&got[1..], &data[1..], "pinned download");
}

/// Six loader threads on one manager, each on its own path (pageable up, pageable down,
/// pinned into device views, registered up and down, pageable into unified memory), plus owned
/// uploads dropped the moment they start and owned downloads awaited: once the dropped ones
/// finish, the statistics hold exactly the expected count and bytes per path and size class,
/// no failure, and nothing else.
#[test]
fn statistics_per_path_after_mixed_threads_and_dropped_owned_transfers_are_exact() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let unified_ok = manager
        .facts(Location::PageableHost, Location::Unified(0))
        .managed_prefetch;
    let context = &gpu.context;
    let mut expected: BTreeMap<(TransferPath, SizeClass), (u64, u64)> = BTreeMap::new();
    let mut expect = |path, bytes: usize, times: u64| {
        let entry = expected
            .entry((path, SizeClass::of(bytes)))
            .or_insert((0, 0));
        entry.0 += times;
        entry.1 += times * bytes as u64;
    };

    const UP: usize = 300_001;
    const DOWN: usize = 2 * MIB + 3;
    const PINNED: usize = 70_000;
    const REGISTERED: usize = MIB + 1;
    const UNIFIED: usize = 64 * KIB;
    const OWNED: usize = 3 * MIB;
    const DROPPED: u64 = 8;
    const AWAITED: u64 = 4;
    expect(TransferPath::PAGEABLE_TO_DEVICE, UP, 20);
    expect(TransferPath::DEVICE_TO_PAGEABLE, DOWN, 10);
    expect(TransferPath::PINNED_TO_DEVICE, PINNED, 20);
    expect(TransferPath::REGISTERED_TO_DEVICE, REGISTERED, 10);
    expect(TransferPath::DEVICE_TO_REGISTERED, REGISTERED, 10);
    if unified_ok {
        expect(
            TransferPath::local(LocationKind::Pageable, LocationKind::Unified),
            UNIFIED,
            20,
        );
    }
    expect(TransferPath::PAGEABLE_TO_DEVICE, OWNED, DROPPED);
    expect(TransferPath::DEVICE_TO_PAGEABLE, OWNED, AWAITED);

    std::thread::scope(|scope| {
        let manager = &manager;
        scope.spawn(move || {
            let data = bytes(UP, 1);
            let mut device = DeviceBuffer::<u8>::zeroed(context, UP + 9).unwrap();
            for _ in 0..20 {
                manager
                    .transfer(&data, Destination::device(&mut device, 9))
                    .unwrap();
            }
            assert_bytes(&device.to_vec().unwrap()[9..], &data, "pageable up");
        });
        scope.spawn(move || {
            let data = bytes(DOWN, 2);
            let device = DeviceBuffer::<u8>::from_slice(context, &data).unwrap();
            let mut back = vec![0u8; DOWN];
            for _ in 0..10 {
                back.fill(0);
                manager.transfer(&device, &mut back).unwrap();
            }
            assert_bytes(&back, &data, "pageable down");
        });
        scope.spawn(move || {
            let data = bytes(PINNED + 5, 3);
            let pinned = PinnedBuffer::<u8>::from_slice(context, &data).unwrap();
            let mut device = DeviceBuffer::<u8>::zeroed(context, PINNED + 20).unwrap();
            for _ in 0..20 {
                let view = device.slice_mut(9..9 + PINNED).unwrap();
                manager
                    .transfer(Source::pinned(&pinned, 5, PINNED), Destination::view(view))
                    .unwrap();
            }
            let got = device.to_vec().unwrap();
            assert_bytes(&got[9..9 + PINNED], &data[5..], "pinned into a view");
        });
        scope.spawn(move || {
            let data = bytes(REGISTERED, 4);
            let mut host = data.clone();
            let mut registered = manager.register_host(0, &mut host).unwrap();
            let mut device = DeviceBuffer::<u8>::zeroed(context, REGISTERED).unwrap();
            for _ in 0..10 {
                manager.transfer(&registered, &mut device).unwrap();
                registered.as_mut_slice().fill(0);
                manager.transfer(&device, &mut registered).unwrap();
            }
            assert_bytes(registered.as_slice(), &data, "registered round trips");
        });
        if unified_ok {
            scope.spawn(move || {
                let data = bytes(UNIFIED, 5);
                let mut unified = UnifiedBuffer::<u8>::zeroed(context, UNIFIED).unwrap();
                for _ in 0..20 {
                    manager.transfer(&data, &mut unified).unwrap();
                }
                assert_bytes(
                    &unified.as_slice().unwrap()[..],
                    &data,
                    "pageable into unified",
                );
            });
        }
        scope.spawn(move || {
            for i in 0..DROPPED {
                let device = DeviceBuffer::<u8>::zeroed(context, OWNED).unwrap();
                drop(manager.upload_owned(bytes(OWNED, 10 + i), device, 0));
            }
            for i in 0..AWAITED {
                let data = bytes(OWNED, 20 + i);
                let device = DeviceBuffer::<u8>::from_slice(context, &data).unwrap();
                let owned = block_on(manager.download_owned(device, 0, vec![0u8; OWNED]));
                owned.result.unwrap();
                assert_bytes(&owned.host, &data, "owned download");
            }
        });
    });

    // The dropped owned uploads finish in the background and are counted then.
    let owned_up = (TransferPath::PAGEABLE_TO_DEVICE, SizeClass::of(OWNED));
    let want = expected[&owned_up].0;
    assert!(
        poll_until(Duration::from_secs(60), || {
            by_path(&manager).get(&owned_up).map_or(0, |s| s.count) >= want
        }),
        "dropped owned uploads never counted: {:?}",
        by_path(&manager).get(&owned_up)
    );
    let stats = by_path(&manager);
    let got: BTreeMap<_, _> = stats
        .iter()
        .map(|(key, s)| (*key, (s.count, s.bytes)))
        .collect();
    assert_eq!(got, expected, "statistics per path and size class");
    for (key, s) in &stats {
        assert_eq!(s.failures, 0, "{key:?}");
        assert!(
            s.best_gbps > 0.0 && s.time > Duration::ZERO,
            "{key:?}: {s:?}"
        );
    }
}

/// A loader that pipelines (HostStaged) pageable `u16` batches straight into a view of a
/// unified or pinned buffer (`managed[a..b].copy_(batch)`) and back out of one, at the staging
/// chunk the manager reports for the size and one element either side, at odd offsets: the
/// view's range holds the batch, every element outside it keeps its sentinel, the download
/// returns the batch exactly.
#[test]
fn views_of_unified_and_pinned_buffers_take_pipelined_copies_at_the_reported_chunk_edges() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let unified_ok = manager
        .facts(Location::PageableHost, Location::Unified(0))
        .managed_prefetch;
    const SENTINEL: u16 = 0xEEEE;
    let chunk = manager
        .staging_for(TransferPath::PAGEABLE_TO_DEVICE, 0, 8 * MIB)
        .chunk_bytes
        .min(16 * MIB);
    let chunk_elements = chunk / 2;
    let sizes = [
        chunk_elements - 1,
        chunk_elements,
        chunk_elements + 1,
        2 * chunk_elements + 1,
    ];
    let capacity = 2 * chunk_elements + 64;
    let mut unified = if unified_ok {
        Some(UnifiedBuffer::<u16>::zeroed(&gpu.context, capacity).unwrap())
    } else {
        None
    };
    let mut pinned = PinnedBuffer::<u16>::zeroed(&gpu.context, capacity).unwrap();

    for (i, &n) in sizes.iter().enumerate() {
        let offset = 2 * i + 3;
        let batch: Vec<u16> = bytes(2 * n, i as u64 + 50)
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        for method in [TransferMethod::HostStaged, TransferMethod::DirectCopy] {
            let what = format!("{n} u16 at {offset} by {method}");
            // Unified.
            if let Some(unified) = unified.as_mut() {
                unified.as_mut_slice().unwrap().fill(SENTINEL);
                let view = unified.slice_mut(offset..offset + n).unwrap();
                manager
                    .transfer_with(method, &batch, Destination::view(view))
                    .unwrap();
                let got = unified.as_slice().unwrap().to_vec();
                assert!(
                    got[..offset].iter().all(|&x| x == SENTINEL),
                    "{what}: before"
                );
                assert_bytes(
                    &got[offset..offset + n],
                    &batch,
                    &format!("{what}: unified"),
                );
                assert!(
                    got[offset + n..].iter().all(|&x| x == SENTINEL),
                    "{what}: after"
                );
                let mut back = vec![0u16; n];
                let view = unified.slice(offset..offset + n).unwrap();
                manager
                    .transfer_with(method, Source::view(view), &mut back)
                    .unwrap();
                assert_bytes(&back, &batch, &format!("{what}: unified download"));
            }
            // Pinned.
            pinned.as_mut_slice().unwrap().fill(SENTINEL);
            let view = pinned.slice_mut(offset..offset + n).unwrap();
            manager
                .transfer_with(method, &batch, Destination::view(view))
                .unwrap();
            let got = pinned.as_slice().unwrap().to_vec();
            assert!(
                got[..offset].iter().all(|&x| x == SENTINEL),
                "{what}: before"
            );
            assert_bytes(&got[offset..offset + n], &batch, &format!("{what}: pinned"));
            assert!(
                got[offset + n..].iter().all(|&x| x == SENTINEL),
                "{what}: after"
            );
            let mut back = vec![0u16; n];
            let view = pinned.slice(offset..offset + n).unwrap();
            manager
                .transfer_with(method, Source::view(view), &mut back)
                .unwrap();
            assert_bytes(&back, &batch, &format!("{what}: pinned download"));
        }
    }
}

/// An async inference server on a single-threaded executor: borrowed uploads of `u32` and
/// `u64` tensors one element below, at and above the borrowed future's 1 MiB chunk (and three
/// chunks and one), at odd offsets, all polled round-robin, then the downloads likewise: every
/// byte round-trips, the bytes outside each range stay zero, and each completed future is
/// counted once on its path.
#[test]
fn borrowed_futures_at_the_async_chunk_edges_polled_round_robin_on_one_thread_round_trip() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let sizes = [
        ASYNC_CHUNK_U32 - 1,
        ASYNC_CHUNK_U32,
        ASYNC_CHUNK_U32 + 1,
        3 * ASYNC_CHUNK_U32 + 1,
    ];
    let wide_sizes = [ASYNC_CHUNK_U32 / 2 - 1, ASYNC_CHUNK_U32 / 2 + 1];
    let narrow: Vec<Vec<u32>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| words(n, 60 + i as u64))
        .collect();
    let wide: Vec<Vec<u64>> = wide_sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            words(2 * n, 70 + i as u64)
                .chunks_exact(2)
                .map(|c| u64::from(c[0]) | (u64::from(c[1]) << 32))
                .collect()
        })
        .collect();
    let mut narrow_dev: Vec<DeviceBuffer<u32>> = sizes
        .iter()
        .map(|&n| DeviceBuffer::zeroed(&gpu.context, n + 10).unwrap())
        .collect();
    let mut wide_dev: Vec<DeviceBuffer<u64>> = wide_sizes
        .iter()
        .map(|&n| DeviceBuffer::zeroed(&gpu.context, n + 10).unwrap())
        .collect();

    type Boxed<'a> = Pin<Box<dyn Future<Output = cuweave_transfer::Result<TransferReport>> + 'a>>;
    {
        let mut futures: Vec<Boxed<'_>> = Vec::new();
        for (i, (data, device)) in narrow.iter().zip(narrow_dev.iter_mut()).enumerate() {
            futures.push(Box::pin(manager.upload_async(data, device, i + 1).unwrap()));
        }
        for (i, (data, device)) in wide.iter().zip(wide_dev.iter_mut()).enumerate() {
            futures.push(Box::pin(manager.upload_async(data, device, 9 - i).unwrap()));
        }
        for report in round_robin(futures) {
            assert!(report.unwrap().bytes > 0);
        }
    }
    let mut narrow_back: Vec<Vec<u32>> = sizes.iter().map(|&n| vec![0; n + 2]).collect();
    let mut wide_back: Vec<Vec<u64>> = wide_sizes.iter().map(|&n| vec![0; n]).collect();
    {
        let mut futures: Vec<Boxed<'_>> = Vec::new();
        // Each narrow download also reads the zero before and after its range.
        for (i, (device, back)) in narrow_dev.iter().zip(narrow_back.iter_mut()).enumerate() {
            futures.push(Box::pin(manager.download_async(device, i, back).unwrap()));
        }
        for (i, (device, back)) in wide_dev.iter().zip(wide_back.iter_mut()).enumerate() {
            futures.push(Box::pin(
                manager.download_async(device, 9 - i, back).unwrap(),
            ));
        }
        for report in round_robin(futures) {
            assert!(report.unwrap().bytes > 0);
        }
    }
    for (i, (data, back)) in narrow.iter().zip(&narrow_back).enumerate() {
        let n = data.len();
        assert_eq!((back[0], back[n + 1]), (0, 0), "u32 #{i}: around the range");
        assert_bytes(&back[1..=n], data, &format!("{n} u32 at {}", i + 1));
    }
    for (data, back) in wide.iter().zip(&wide_back) {
        assert_bytes(back, data, &format!("{} u64", data.len()));
    }
    let stats = by_path(&manager);
    let count = |path| -> u64 {
        stats
            .iter()
            .filter(|((p, _), _)| *p == path)
            .map(|(_, s)| s.count)
            .sum()
    };
    let futures = (sizes.len() + wide_sizes.len()) as u64;
    assert_eq!(count(TransferPath::PAGEABLE_TO_DEVICE), futures);
    assert_eq!(count(TransferPath::DEVICE_TO_PAGEABLE), futures);
}

/// A `pin_memory=True` data loader: each pageable batch is copied into one of two pinned
/// buffers (at an odd offset), moved into a view of the device tensor with
/// `to(device, non_blocking=True)` semantics by DirectCopy and, where the device maps host
/// memory, ZeroCopy, then read back out of a view into the other pinned buffer and to pageable
/// memory: every batch exact, the bytes around each view untouched.
#[test]
fn a_pin_memory_loader_moves_batches_through_pinned_buffers_and_device_views_by_both_methods() {
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::new().unwrap();
    let zero_copy = manager
        .facts(Location::PinnedHost(0), Location::Device(0))
        .map_host_memory;
    let mut methods = vec![TransferMethod::DirectCopy];
    if zero_copy {
        methods.push(TransferMethod::ZeroCopy);
    }
    let sizes = [1, 1023, 65_537, 262_145, 1_000_003];
    let capacity = 1_000_003 + 32;
    let mut pinned = [
        PinnedBuffer::<u32>::zeroed(&gpu.context, capacity).unwrap(),
        PinnedBuffer::<u32>::zeroed(&gpu.context, capacity).unwrap(),
    ];
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, capacity).unwrap();
    const AROUND: u32 = 0xDEAD_BEEF;
    let mut step = 0usize;
    for &n in &sizes {
        for &method in &methods {
            step += 1;
            let batch = words(n, 200 + step as u64);
            let (a, b) = (step % 2, 1 - step % 2);
            let (pin_off, dev_off) = (step % 5 + 1, step % 7 + 3);
            let what = format!("{n} u32 by {method}");
            // The loader's worker: pageable -> pinned.
            manager
                .transfer(&batch, Destination::pinned(&mut pinned[a], pin_off))
                .unwrap();
            // The training step: pinned -> device view.
            device.fill(AROUND).unwrap();
            let view = device.slice_mut(dev_off..dev_off + n).unwrap();
            manager
                .transfer_with(
                    method,
                    Source::pinned(&pinned[a], pin_off, n),
                    Destination::view(view),
                )
                .unwrap();
            // And back: device view -> the other pinned buffer -> pageable.
            let view = device.slice(dev_off..dev_off + n).unwrap();
            manager
                .transfer_with(
                    method,
                    Source::view(view),
                    Destination::pinned(&mut pinned[b], pin_off + 1),
                )
                .unwrap();
            let mut back = vec![0u32; n];
            manager
                .transfer(Source::pinned(&pinned[b], pin_off + 1, n), &mut back)
                .unwrap();
            assert_bytes(&back, &batch, &what);
            let got = device.to_vec().unwrap();
            assert!(
                got[..dev_off].iter().all(|&x| x == AROUND)
                    && got[dev_off + n..].iter().all(|&x| x == AROUND),
                "{what}: the device view's neighbours changed"
            );
        }
    }
}

/// A program that calibrates once, saves `manager.calibration()` to disk, and at the next
/// start (here: after `clear_cache`, which forgets the measured table, so plans fall back to
/// the labelled defaults) loads it with `set_calibration`: the table is accepted as this
/// machine's, and every plan and staging choice is what it was before the save.
#[test]
fn a_measured_calibration_saved_to_disk_and_loaded_into_a_cleared_manager_plans_the_same() {
    let _gpu = require_gpu!();
    let _serial = serial();
    let manager = TransferManager::for_devices(&[0]).unwrap();
    manager.calibrate().unwrap();
    let table = manager.calibration();
    assert!(!table.is_empty(), "calibration measured nothing");
    let queries: Vec<(Location, Location, usize)> = locations(0)
        .into_iter()
        .flat_map(|src| locations(0).into_iter().map(move |dst| (src, dst)))
        .flat_map(|(src, dst)| PLAN_SIZES.into_iter().map(move |n| (src, dst, n)))
        .collect();
    let plans: Vec<String> = queries
        .iter()
        .map(|&(s, d, n)| manager.plan(s, d, n).to_string())
        .collect();
    let staging: Vec<StagingConfig> = PLAN_SIZES
        .iter()
        .map(|&n| manager.staging_for(TransferPath::PAGEABLE_TO_DEVICE, 0, n))
        .collect();
    let path = scratch("measured");
    table.save(&path).unwrap();

    manager.clear_cache();
    assert!(manager.calibration().is_empty());
    let cleared = manager.plan(Location::PageableHost, Location::Device(0), 64 * MIB);
    assert!(
        !matches!(cleared.reason, PlanReason::Calibrated { .. }),
        "a cleared manager still plans by the measured table: {cleared}"
    );

    let loaded = CalibrationTable::load(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(loaded, table);
    assert!(
        manager.set_calibration(loaded).is_none(),
        "this machine's own table reported as foreign"
    );
    for (i, &(s, d, n)) in queries.iter().enumerate() {
        let plan = manager.plan(s, d, n);
        assert_eq!(plan.to_string(), plans[i], "{s} -> {d}, {n} bytes");
        assert!(!plan.to_string().contains("not this machine"), "{plan}");
    }
    for (i, &n) in PLAN_SIZES.iter().enumerate() {
        assert_eq!(
            manager.staging_for(TransferPath::PAGEABLE_TO_DEVICE, 0, n),
            staging[i],
            "staging for {n} bytes"
        );
    }
}
