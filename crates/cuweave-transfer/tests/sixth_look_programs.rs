//! Sixth-look user programs for the transfer manager, written as PyTorch (`pin_memory()`,
//! `tensor.to(device, non_blocking=True)`, `torch.cuda.Stream`), RMM and cudarc users drive
//! transfers, aimed at interactions the other probe files leave out:
//!
//! - a calibration file written by another tool (extra fields, wrong types, unknown names, a
//!   truncated file, a missing path) loads or fails with `CalibrationFile` (CPU only);
//! - a table measured only on other device ordinals never decides for device 0 (CPU only);
//! - `for_devices` at the first ordinal past the machine and with repeated ordinals;
//! - host-visible pairs (pinned <-> pinned, pinned <-> unified) racing a late device writer of
//!   the source and a device reader of the destination on user streams;
//! - registered host memory into pinned, unified and device-view destinations still read by a
//!   kernel, and out of a device view and a pinned buffer written late;
//! - a borrowed upload dropped while its chunks wait behind a kernel reading the destination,
//!   then the buffer reused;
//! - 1-byte elements at a prime length into an odd-offset view by every chunk order and host
//!   copy at the smallest chunk;
//! - eight threads sharing one manager and one device buffer's overlapping views;
//! - statistics, lanes and mark words bounded over 10^5 tiny transfers;
//! - a foreign calibration file (one device more than the machine) whose staging choice and
//!   methods still move exact bytes;
//! - more owned transfers started at once than the staging pool has workers, some downloads
//!   dropped unawaited.
//!
//! Every GPU test skips without a GPU.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskContext, Waker};
use std::time::Duration;

use cuweave_driver::{Device, Stream};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{poll_until, require_gpu, serial};
use cuweave_transfer::planner::{Query, choose_for};
use cuweave_transfer::{
    CalibrationTable, ChunkOrder, Destination, HostCopy, Location, MAX_IDLE_LANES, MAX_WORKERS,
    MIN_CHUNK_BYTES, Measure, PathFacts, PlanReason, SizeClass, Source, StagingChoice,
    StagingConfig, TransferError, TransferManager, TransferMethod, TransferPath,
};

mod common;
use common::{assert_all_u32, assert_bytes, block_on, bytes, late_fill, user_stream, watch, words};

const MIB: usize = 1 << 20;

/// How long the user's kernels spin or watch: long enough that a copy not ordered behind them
/// lands while they run.
const KERNEL_NS: u64 = 50_000_000;

/// What destinations hold before a copy.
const OLD: u32 = 0x0101_0101;

/// What a late kernel writes into a source.
const WRITTEN: u32 = 0x7E57_AB1E;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Polls `future` at most `n` times with a waker that does nothing; whether it resolved.
fn poll_n<F: Future + Unpin>(future: &mut F, n: usize) -> bool {
    let mut cx = TaskContext::from_waker(Waker::noop());
    (0..n).any(|_| Pin::new(&mut *future).poll(&mut cx).is_ready())
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

/// After both user streams finished: the reader saw `OLD` throughout, and `got` holds `OLD`
/// around `offset..offset + n` and `want` inside it.
fn settled(
    writer: &Stream,
    reader: &Stream,
    mismatches: &DeviceBuffer<u32>,
    got: &[u32],
    offset: usize,
    want: &[u32],
    what: &str,
) {
    writer.synchronize().unwrap();
    reader.synchronize().unwrap();
    assert_eq!(
        mismatches.to_vec().unwrap(),
        [0],
        "{what}: the copy landed while the user's kernel still read the destination"
    );
    let n = want.len();
    assert_all_u32(&got[..offset], OLD, &format!("{what}: before the range"));
    assert_bytes(
        &got[offset..offset + n],
        want,
        &format!("{what}: the range"),
    );
    assert_all_u32(&got[offset + n..], OLD, &format!("{what}: after the range"));
}

/// A calibration table as a program that measured a machine with `devices` would save it:
/// staged copies far faster than the plain call for large pageable copies both ways, and a
/// staging choice for device 0 at 8 MiB with an unusual configuration.
fn foreign_table(devices: Vec<String>, config: StagingConfig) -> CalibrationTable {
    let mut table = CalibrationTable {
        device: devices.first().cloned(),
        devices,
        ..CalibrationTable::default()
    };
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        for class in SizeClass::ALL {
            table.record(path, class, TransferMethod::HostStaged, 50.0);
            table.record(path, class, TransferMethod::DirectCopy, 1.0);
        }
        table.record_staging(StagingChoice {
            path,
            device: 0,
            bytes: 8 * MIB,
            config,
            gbps: 50.0,
        });
    }
    table
}

// ---------------------------------------------------------------------------------------------
// CPU only
// ---------------------------------------------------------------------------------------------

/// A program loads a calibration file that a newer version (or another tool) wrote: extra
/// fields at the top and in entries and staging choices must not stop it loading (the table
/// equals the one without them), while a file that is not a table (a figure as a string, an
/// unknown method, path kind or size class, a negative size, truncated text, a missing file, a
/// directory) is `CalibrationFile` naming where it came from, never a panic.
#[test]
fn calibration_files_with_extra_fields_load_and_malformed_ones_are_typed_errors() {
    let table = foreign_table(
        vec!["NVIDIA H200".to_owned()],
        StagingConfig {
            chunk_bytes: 12 << 10,
            depth: 1,
            threads: 2,
            host_copy: HostCopy::Cached,
            order: ChunkOrder::Interleaved,
        },
    );
    let json = table.to_json();
    // Extra fields everywhere a newer writer could add them.
    let extended = json
        .replacen(
            '{',
            "{\n  \"cuda_version\": \"13.0\", \"host\": {\"cpus\": 64},",
            1,
        )
        .replace("\"gbps\":", "\"note\": \"best of 5\", \"gbps\":")
        .replace("\"depth\":", "\"prefetch\": true, \"depth\":");
    assert_ne!(extended, json, "the extra fields were not inserted");
    let loaded = CalibrationTable::from_json(&extended)
        .unwrap_or_else(|e| panic!("a table with extra fields was refused: {e}\n{extended}"));
    assert_eq!(loaded, table);

    let bad: Vec<(&str, String)> = vec![
        (
            "a figure as a string",
            json.replacen("\"gbps\": 50.0", "\"gbps\": \"fast\"", 1),
        ),
        (
            "an unknown method",
            json.replacen("\"host_staged\"", "\"teleport\"", 1),
        ),
        (
            "an unknown path kind",
            json.replacen("\"pageable\"", "\"swap\"", 1),
        ),
        (
            "an unknown size class",
            json.replacen("\"large\"", "\"enormous\"", 1),
        ),
        (
            "a negative size",
            json.replacen("\"bytes\": 8388608", "\"bytes\": -8388608", 1),
        ),
        ("truncated text", json[..json.len() / 2].to_owned()),
        ("an empty file", String::new()),
        ("a list instead of a table", "[1, 2, 3]".to_owned()),
    ];
    for (what, text) in bad {
        assert_ne!(text, json, "{what}: the edit did not apply");
        match CalibrationTable::from_json(&text) {
            Err(TransferError::CalibrationFile { path, message }) => {
                assert_eq!(path, "<json>", "{what}");
                assert!(!message.is_empty(), "{what}: no message");
            }
            other => panic!("{what}: expected CalibrationFile, got {other:?}"),
        }
    }

    let missing = std::env::temp_dir().join(format!(
        "cuweave-sixth-look-{}-never-written.json",
        std::process::id()
    ));
    match CalibrationTable::load(&missing) {
        Err(TransferError::CalibrationFile { path, .. }) => {
            assert_eq!(path, missing.display().to_string());
        }
        other => panic!("a missing file: expected CalibrationFile, got {other:?}"),
    }
    let dir = std::env::temp_dir();
    assert!(
        matches!(
            CalibrationTable::load(&dir),
            Err(TransferError::CalibrationFile { .. })
        ),
        "a directory loaded as a table"
    );
    // Saving into a directory that does not exist is the same typed error.
    let nowhere = missing.join("sub").join("table.json");
    assert!(matches!(
        table.save(&nowhere),
        Err(TransferError::CalibrationFile { .. })
    ));
}

/// A table saved on an eight-GPU node holds per-device figures for devices 3 and 5 only (the
/// program calibrated the GPUs it used there). Loaded on a machine whose transfers touch device
/// 0, those figures must not decide for device 0: the plan falls back to the labelled defaults
/// (not `Calibrated` with another device's figures), and the other devices' staging choices are
/// not applied to device 0. Once the table also holds an any-device figure, that decides; once
/// it holds device 0's own figure, that one wins over the any-device one.
#[test]
fn a_table_measured_only_on_other_device_ordinals_never_decides_for_device_0() {
    let h2d = TransferPath::PAGEABLE_TO_DEVICE;
    let bytes = 64 * MIB;
    let at = |dst: Option<usize>| Measure {
        path: h2d,
        src_device: None,
        dst_device: dst,
        bytes,
    };
    let mut table = CalibrationTable::default();
    for device in [3, 5] {
        table.record_at(at(Some(device)), TransferMethod::DirectCopy, 90.0);
        table.record_at(at(Some(device)), TransferMethod::HostStaged, 5.0);
        table.record_staging(StagingChoice {
            path: h2d,
            device,
            bytes,
            config: StagingConfig {
                chunk_bytes: 8 << 10,
                depth: 1,
                threads: 1,
                host_copy: HostCopy::Cached,
                order: ChunkOrder::Interleaved,
            },
            gbps: 5.0,
        });
    }
    let table = CalibrationTable::from_json(&table.to_json()).unwrap();
    let facts = PathFacts {
        map_host_memory: true,
        managed_prefetch: true,
        peer_access: true,
    };
    let defaults = CalibrationTable::h100_defaults();
    let query = Query::new(Location::PageableHost, Location::Device(0), bytes);
    let plan = choose_for(query, &facts, &table, Some("8x H200"), &defaults);
    assert!(
        matches!(plan.reason, PlanReason::Default { .. }),
        "device 3's and 5's figures decided for device 0: {plan}"
    );
    assert_eq!(plan.measured_on, None, "{plan}");
    assert_eq!(table.staging_for(h2d, 0, bytes), None);
    assert!(table.staging_for(h2d, 3, bytes).is_some());
    // Device 3 itself is planned by its own figures.
    let own = choose_for(
        Query::new(Location::PageableHost, Location::Device(3), bytes),
        &facts,
        &table,
        None,
        &defaults,
    );
    assert_eq!(own.method, TransferMethod::DirectCopy, "{own}");
    assert!(matches!(own.reason, PlanReason::Calibrated { gbps, .. } if gbps == 90.0));

    // An any-device figure decides for device 0 ...
    let mut with_any = table.clone();
    with_any.record_at(at(None), TransferMethod::HostStaged, 40.0);
    with_any.record_at(at(None), TransferMethod::DirectCopy, 20.0);
    let plan = choose_for(query, &facts, &with_any, None, &defaults);
    assert_eq!(plan.method, TransferMethod::HostStaged, "{plan}");
    assert!(matches!(
        plan.reason,
        PlanReason::Calibrated { gbps, runner_up: Some(r), at_bytes }
            if gbps == 40.0 && r == 20.0 && at_bytes == bytes
    ));
    // ... until device 0's own figures are there.
    with_any.record_at(at(Some(0)), TransferMethod::DirectCopy, 70.0);
    with_any.record_at(at(Some(0)), TransferMethod::HostStaged, 60.0);
    let plan = choose_for(query, &facts, &with_any, None, &defaults);
    assert_eq!(plan.method, TransferMethod::DirectCopy, "{plan}");
    assert!(matches!(plan.reason, PlanReason::Calibrated { gbps, .. } if gbps == 70.0));
}

// ---------------------------------------------------------------------------------------------
// GPU
// ---------------------------------------------------------------------------------------------

/// A launcher builds its manager from `CUDA_VISIBLE_DEVICES`-style lists: one ordinal exactly
/// past the machine's last device (the off-by-one a user makes with 1-based numbering) is
/// `NoSuchDevice` naming it and the machine's count; a list repeating device 0 serves device 0
/// once, opens nothing until a pipelined transfer, and that transfer moves exact bytes.
#[test]
fn for_devices_at_the_first_missing_ordinal_and_with_repeats() {
    let gpu = require_gpu!();
    let _serial = serial();
    let count = Device::count().unwrap();
    match TransferManager::for_devices(&[0, count]) {
        Err(TransferError::NoSuchDevice { device, count: c }) => {
            assert_eq!((device, c), (count, count));
        }
        other => panic!(
            "for_devices(&[0, {count}]): expected NoSuchDevice, got {:?}",
            other.map(|m| m.devices())
        ),
    }
    let manager = TransferManager::for_devices(&[0, 0, 0]).unwrap();
    assert_eq!(manager.devices(), vec![0]);
    assert_eq!(manager.device_count(), 1);
    assert!(!manager.is_open(0));
    assert_eq!(manager.idle_lanes(0), 0);
    if count > 1 {
        let mut other = vec![0u8; 4];
        assert!(matches!(
            manager.register_host(1, &mut other),
            Err(TransferError::NoSuchDevice {
                device: 1,
                count: 1
            })
        ));
    }
    let n = 1009;
    let data = bytes(n, 61);
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, n + 3).unwrap();
    // The pipeline takes a lane of device 0's streams: that opens it.
    manager
        .transfer_with(
            TransferMethod::HostStaged,
            &data[..],
            Destination::device(&mut device, 3),
        )
        .unwrap();
    assert!(manager.is_open(0));
    let mut back = vec![0u8; n];
    manager
        .transfer(Source::device(&device, 3, n), &mut back[..])
        .unwrap();
    assert_bytes(&back, &data, "repeated-ordinal manager");
    let total: u64 = manager
        .stats()
        .snapshot()
        .iter()
        .map(|(_, _, s)| s.count)
        .sum();
    assert_eq!(total, 2);
}

/// A `pin_memory()` loader hands batches between pinned buffers and managed tensors while the
/// user's kernels still work on them: the source was written late by a kernel on stream W
/// (through its device address, declared a write) and the destination is read by a kernel on
/// stream R (declared a read), both for 50 ms. These pairs are host-visible, so the manager
/// copies on the host: the copy must still wait for the late write and for the reader (pinned
/// -> pinned always; pinned -> unified and unified -> pinned where managed memory can be
/// touched by the host while kernels run). Prime length, odd offsets on both sides.
#[test]
fn host_visible_pairs_wait_for_a_late_device_writer_and_a_device_reader() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let managed = manager
        .facts(Location::PageableHost, Location::Unified(0))
        .managed_prefetch;
    let kernels = TestKernels::load(ctx).unwrap();
    let watcher = kernels.module().function("watch_u32").unwrap();
    let fill = kernels.module().function("fill_u32").unwrap();
    let writer = user_stream(ctx);
    let reader = user_stream(ctx);
    let n = 65_537;
    let (src_at, dst_at) = (5usize, 3usize);
    let want = vec![WRITTEN; n];
    let mut mismatches = DeviceBuffer::<u32>::zeroed(ctx, 1).unwrap();

    macro_rules! ordered {
        ($Src:ident, $Dst:ident, $source:ident, $destination:ident) => {{
            let what = format!("{} -> {}", stringify!($Src), stringify!($Dst));
            let mut src = $Src::<u32>::new(ctx, n + 9).unwrap();
            src.fill(0x5151_5151).unwrap();
            let mut dst = $Dst::<u32>::new(ctx, n + 7).unwrap();
            dst.fill(OLD).unwrap();
            mismatches.fill(0).unwrap();
            late_fill(&kernels, &fill, &writer, &mut src, WRITTEN, KERNEL_NS);
            watch(&watcher, &reader, &dst, OLD, KERNEL_NS, &mut mismatches);
            manager
                .transfer(
                    Source::$source(&src, src_at, n),
                    Destination::$destination(&mut dst, dst_at),
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            settled(
                &writer,
                &reader,
                &mismatches,
                &dst.to_vec().unwrap(),
                dst_at,
                &want,
                &what,
            );
        }};
    }
    ordered!(PinnedBuffer, PinnedBuffer, pinned, pinned);
    if managed {
        ordered!(PinnedBuffer, UnifiedBuffer, pinned, unified);
        ordered!(UnifiedBuffer, PinnedBuffer, unified, pinned);
    }
}

/// A video pipeline registers its frame ring once (`cudaHostRegister`) and feeds it to
/// buffers the user's kernels still read (a pinned staging buffer, a managed tensor, a view of
/// a device tensor), then fills other frames from a device view and a pinned buffer written
/// late by a kernel. Each copy into a destination must wait for the reader (which sees its old
/// contents throughout), each copy out of a source for the late writer; the registered
/// frames around the written range stay as they were.
#[test]
fn registered_frames_wait_for_readers_of_destinations_and_late_writers_of_sources() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let managed = manager
        .facts(Location::PageableHost, Location::Unified(0))
        .managed_prefetch;
    let kernels = TestKernels::load(ctx).unwrap();
    let watcher = kernels.module().function("watch_u32").unwrap();
    let fill = kernels.module().function("fill_u32").unwrap();
    let writer = user_stream(ctx);
    let reader = user_stream(ctx);
    let n = 131_071; // prime
    let (src_at, dst_at) = (4usize, 3usize);
    let frames = words(n + 11, 606);
    let want = frames[src_at..src_at + n].to_vec();
    let mut ring = frames.clone();
    let registered = manager.register_host(0, &mut ring).unwrap();
    let mut mismatches = DeviceBuffer::<u32>::zeroed(ctx, 1).unwrap();

    // Registered -> destinations still being read.
    {
        let mut dst = PinnedBuffer::<u32>::new(ctx, n + 7).unwrap();
        dst.fill(OLD).unwrap();
        mismatches.fill(0).unwrap();
        watch(&watcher, &reader, &dst, OLD, KERNEL_NS, &mut mismatches);
        manager
            .transfer(
                Source::registered(&registered, src_at, n),
                Destination::pinned(&mut dst, dst_at),
            )
            .unwrap();
        let got = dst.to_vec().unwrap();
        settled(
            &writer,
            &reader,
            &mismatches,
            &got,
            dst_at,
            &want,
            "to pinned",
        );
    }
    if managed {
        let mut dst = UnifiedBuffer::<u32>::new(ctx, n + 7).unwrap();
        dst.fill(OLD).unwrap();
        mismatches.fill(0).unwrap();
        watch(&watcher, &reader, &dst, OLD, KERNEL_NS, &mut mismatches);
        manager
            .transfer(
                Source::registered(&registered, src_at, n),
                Destination::unified(&mut dst, dst_at),
            )
            .unwrap();
        let got = dst.to_vec().unwrap();
        settled(
            &writer,
            &reader,
            &mismatches,
            &got,
            dst_at,
            &want,
            "to unified",
        );
    }
    {
        let mut dst = DeviceBuffer::<u32>::new(ctx, n + 7).unwrap();
        dst.fill(OLD).unwrap();
        mismatches.fill(0).unwrap();
        // The kernel reads only the view's range: the copy must wait for it.
        {
            let view = dst.slice(dst_at..dst_at + n).unwrap();
            watch(&watcher, &reader, &view, OLD, KERNEL_NS, &mut mismatches);
        }
        manager
            .transfer(
                Source::registered(&registered, src_at, n),
                Destination::view(dst.slice_mut(dst_at..dst_at + n).unwrap()),
            )
            .unwrap();
        let got = dst.to_vec().unwrap();
        settled(
            &writer,
            &reader,
            &mismatches,
            &got,
            dst_at,
            &want,
            "to a device view",
        );
    }
    drop(registered);

    // Sources written late -> registered frames.
    let mut ring = frames.clone();
    let mut registered = manager.register_host(0, &mut ring).unwrap();
    {
        let mut src = DeviceBuffer::<u32>::new(ctx, n + 9).unwrap();
        src.fill(0x5151_5151).unwrap();
        {
            let mut view = src.slice_mut(src_at..src_at + n).unwrap();
            late_fill(&kernels, &fill, &writer, &mut view, WRITTEN, KERNEL_NS);
        }
        manager
            .transfer(
                Source::view(src.slice(src_at..src_at + n).unwrap()),
                Destination::registered(&mut registered, dst_at),
            )
            .unwrap();
        let got = registered.as_slice();
        assert_bytes(
            &got[..dst_at],
            &frames[..dst_at],
            "from a device view: before",
        );
        assert_all_u32(
            &got[dst_at..dst_at + n],
            WRITTEN,
            "from a device view: range",
        );
        assert_bytes(
            &got[dst_at + n..],
            &frames[dst_at + n..],
            "from a device view: after",
        );
    }
    {
        registered.as_mut_slice().copy_from_slice(&frames);
        let mut src = PinnedBuffer::<u32>::new(ctx, n + 9).unwrap();
        src.fill(0x5151_5151).unwrap();
        late_fill(&kernels, &fill, &writer, &mut src, WRITTEN, KERNEL_NS);
        manager
            .transfer(
                Source::pinned(&src, src_at, n),
                Destination::registered(&mut registered, dst_at + 1),
            )
            .unwrap();
        let got = registered.as_slice();
        assert_bytes(
            &got[..dst_at + 1],
            &frames[..dst_at + 1],
            "from pinned: before",
        );
        assert_all_u32(
            &got[dst_at + 1..dst_at + 1 + n],
            WRITTEN,
            "from pinned: range",
        );
        assert_bytes(
            &got[dst_at + 1 + n..],
            &frames[dst_at + 1 + n..],
            "from pinned: after",
        );
    }
    writer.synchronize().unwrap();
    registered.unregister().unwrap();
}

/// An async data loader (`tensor.to(device, non_blocking=True)` cancelled when the request is
/// aborted) starts a borrowed upload into a buffer the model's kernel is still reading, polls
/// it until a chunk is queued (behind the kernel's read), and drops it. The drop waits for its
/// queued chunks, so once it returns the kernel that they waited behind has finished; the
/// kernel saw its old contents throughout; the buffer then takes a blocking upload of new data
/// exactly; and only that upload is counted.
#[test]
fn a_borrowed_upload_dropped_behind_a_reading_kernel_leaves_the_buffer_reusable() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let kernels = TestKernels::load(ctx).unwrap();
    let watcher = kernels.module().function("watch_u32").unwrap();
    let reader = user_stream(ctx);
    let n = 4 * MIB / 4 + 5;
    let mut device = DeviceBuffer::<u32>::new(ctx, n).unwrap();
    device.fill(OLD).unwrap();
    let mut mismatches = DeviceBuffer::<u32>::zeroed(ctx, 1).unwrap();
    let first = words(n, 1);
    // A long read, so the chunks are certainly queued behind it before it ends.
    watch(
        &watcher,
        &reader,
        &device,
        OLD,
        4 * KERNEL_NS,
        &mut mismatches,
    );
    {
        let mut upload = manager.upload_async(&first, &mut device, 0).unwrap();
        let reached = poll_until(Duration::from_secs(30), || {
            let resolved = poll_n(&mut upload, 1);
            resolved || in_flight(&upload) > 0
        });
        assert!(reached, "no chunk went in flight: {upload:?}");
        drop(upload);
        assert!(
            reader.query().unwrap(),
            "the dropped upload returned while its queued chunks still waited for the kernel"
        );
    }
    reader.synchronize().unwrap();
    assert_eq!(
        mismatches.to_vec().unwrap(),
        [0],
        "a chunk of the dropped upload landed while the kernel read the buffer"
    );
    let second = words(n, 2);
    manager.transfer(&second, &mut device).unwrap();
    assert_bytes(&device.to_vec().unwrap(), &second, "upload after the drop");
    let counted: u64 = manager
        .stats()
        .snapshot()
        .iter()
        .filter(|(path, ..)| *path == TransferPath::PAGEABLE_TO_DEVICE)
        .map(|(_, _, s)| s.count + s.failures)
        .sum();
    assert_eq!(counted, 1, "the dropped upload was counted");
}

/// A tokenizer uploads byte streams (`u8`, 1-byte elements) of prime length into an odd
/// offset of a device buffer through a `slice_mut` view and reads them back through a `slice`
/// view, by the pipeline at its smallest chunk (4 KiB: hundreds of chunks, the last one short),
/// in every chunk order and host-copy mode, with one and two blocks per participant and three
/// participants. Bytes round-trip exactly and the buffer's bytes around the view stay.
#[test]
fn byte_streams_of_prime_length_through_views_by_every_order_and_host_copy() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let n = 1_000_003;
    let at = 7usize;
    let around = 0xEEu8;
    let mut device = DeviceBuffer::<u8>::new(ctx, n + at + 6).unwrap();
    let mut step = 0u64;
    for order in [ChunkOrder::Ordered, ChunkOrder::Interleaved] {
        for host_copy in [HostCopy::Streaming, HostCopy::Cached] {
            for depth in [1, 2] {
                step += 1;
                let config = StagingConfig {
                    chunk_bytes: MIN_CHUNK_BYTES,
                    depth,
                    threads: 3,
                    host_copy,
                    order,
                };
                let what = format!("{order:?}, {host_copy:?}, depth {depth}");
                let manager = TransferManager::with_staging(config).unwrap();
                let data = bytes(n, step);
                device.fill(around).unwrap();
                let report = manager
                    .transfer_with(
                        TransferMethod::HostStaged,
                        &data[..],
                        Destination::view(device.slice_mut(at..at + n).unwrap()),
                    )
                    .unwrap_or_else(|e| panic!("{what}: upload: {e}"));
                assert_eq!(report.bytes, n, "{what}");
                let whole = device.to_vec().unwrap();
                assert!(
                    whole[..at].iter().all(|&b| b == around)
                        && whole[at + n..].iter().all(|&b| b == around),
                    "{what}: bytes around the view changed"
                );
                assert_bytes(&whole[at..at + n], &data, &format!("{what}: upload"));
                let mut back = vec![0u8; n];
                manager
                    .transfer_with(
                        TransferMethod::HostStaged,
                        Source::view(device.slice(at..at + n).unwrap()),
                        &mut back[..],
                    )
                    .unwrap_or_else(|e| panic!("{what}: download: {e}"));
                assert_bytes(&back, &data, &format!("{what}: download"));
            }
        }
    }
}

/// An inference server's eight request threads share one manager and one device buffer of
/// results (`u16` logits), each downloading overlapping views of it (odd offsets, lengths
/// around the pipeline's sizes) by the planned method, HostStaged and DirectCopy, while also
/// uploading its own prompt buffer. Every byte comes back exactly, and the statistics count
/// every transfer once.
#[test]
fn eight_threads_share_one_manager_and_overlapping_views_of_one_buffer() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let total = 3 * MIB + 17;
    let logits: Vec<u16> = bytes(total * 2, 88)
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    let shared = DeviceBuffer::<u16>::from_slice(ctx, &logits).unwrap();
    const THREADS: usize = 8;
    const ROUNDS: usize = 12;
    let methods = [
        None,
        Some(TransferMethod::HostStaged),
        Some(TransferMethod::DirectCopy),
    ];
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (manager, shared, logits) = (&manager, &shared, &logits);
            scope.spawn(move || {
                let mut prompt = DeviceBuffer::<u16>::new(ctx, 300_007).unwrap();
                for round in 0..ROUNDS {
                    let start = (t * 131_071 + round * 7_919) % (total / 2);
                    let len = [1, 4_099, 262_147, 1_000_003][(t + round) % 4];
                    let len = len.min(total - start);
                    let method = methods[(t + round) % 3];
                    let what = format!("thread {t} round {round}: {len} at {start} by {method:?}");
                    let view = Source::view(shared.slice(start..start + len).unwrap());
                    let mut out = vec![0u16; len];
                    match method {
                        None => manager.transfer(view, &mut out[..]),
                        Some(m) => manager.transfer_with(m, view, &mut out[..]),
                    }
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_bytes(&out, &logits[start..start + len], &what);
                    let up = &logits[start..start + len.min(300_000)];
                    manager
                        .transfer(up, Destination::device(&mut prompt, round % 7))
                        .unwrap_or_else(|e| panic!("{what}: upload: {e}"));
                    let mut check = vec![0u16; up.len()];
                    manager
                        .transfer(Source::device(&prompt, round % 7, up.len()), &mut check[..])
                        .unwrap();
                    assert_bytes(&check, up, &format!("{what}: prompt"));
                }
            });
        }
    });
    let snapshot = manager.stats().snapshot();
    let count = |path: TransferPath| -> (u64, u64) {
        snapshot
            .iter()
            .filter(|(p, ..)| *p == path)
            .fold((0, 0), |(c, f), (_, _, s)| (c + s.count, f + s.failures))
    };
    let n = (THREADS * ROUNDS) as u64;
    assert_eq!(count(TransferPath::DEVICE_TO_PAGEABLE), (2 * n, 0));
    assert_eq!(count(TransferPath::PAGEABLE_TO_DEVICE), (n, 0));
    assert!(manager.idle_lanes(0) <= MAX_IDLE_LANES);
}

/// A telemetry service uploads and downloads tiny records (1 to 61 bytes) 10^5 times through
/// one manager, into a rotating offset of one device buffer. The statistics stay a handful of
/// entries with exact counts and bytes, the lanes kept stay within `MAX_IDLE_LANES`, the free
/// mark words come back to where they were after the first transfers, and the last record
/// round-trips exactly.
#[test]
fn statistics_lanes_and_mark_words_stay_bounded_over_100k_tiny_transfers() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let mut device = DeviceBuffer::<u8>::zeroed(ctx, 4096).unwrap();
    let records = bytes(64 * 61, 5);
    let mut back = [0u8; 61];
    // Warm up both directions at every length the loop uses, so that whatever lanes (and
    // mark words) the planned methods take are taken before the baseline is read.
    for len in 1..=61 {
        manager
            .transfer(&records[..len], Destination::device(&mut device, 0))
            .unwrap();
        manager
            .transfer(Source::device(&device, 0, len), &mut back[..len])
            .unwrap();
    }
    manager.stats().reset();
    let words_after_warmup = manager.free_mark_words(0);
    const ROUNDS: usize = 50_000;
    let (mut up_bytes, mut down_bytes) = (0u64, 0u64);
    for i in 0..ROUNDS {
        let len = i % 61 + 1;
        let at = (i * 67) % (4096 - 61);
        let rec = &records[(i % 64) * 61..(i % 64) * 61 + len];
        manager
            .transfer(rec, Destination::device(&mut device, at))
            .unwrap();
        manager
            .transfer(Source::device(&device, at, len), &mut back[..len])
            .unwrap();
        up_bytes += len as u64;
        down_bytes += len as u64;
        if i == ROUNDS - 1 {
            assert_bytes(&back[..len], rec, "the last record");
        }
    }
    let snapshot = manager.stats().snapshot();
    assert!(
        snapshot.len() <= 2,
        "tiny transfers spread over {} statistics entries",
        snapshot.len()
    );
    let sum = |path: TransferPath| -> (u64, u64, u64) {
        snapshot
            .iter()
            .filter(|(p, ..)| *p == path)
            .fold((0, 0, 0), |(c, b, f), (_, _, s)| {
                (c + s.count, b + s.bytes, f + s.failures)
            })
    };
    assert_eq!(
        sum(TransferPath::PAGEABLE_TO_DEVICE),
        (ROUNDS as u64, up_bytes, 0)
    );
    assert_eq!(
        sum(TransferPath::DEVICE_TO_PAGEABLE),
        (ROUNDS as u64, down_bytes, 0)
    );
    assert!(manager.idle_lanes(0) <= MAX_IDLE_LANES);
    assert_eq!(
        manager.free_mark_words(0),
        words_after_warmup,
        "mark words leaked over one-at-a-time transfers"
    );
}

/// A program ships a calibration file from a two-GPU build machine to a host with one GPU
/// fewer (the table names every device of this machine and one more), with an extra field
/// added by a newer tool. Loaded, it is reported as foreign (the mismatch names this machine's
/// devices), plans say where their figures came from, its per-device staging choice (12 KiB
/// chunks, one block, two participants, interleaved, plain copies) is what the manager stages
/// 8 MiB copies with, and pageable copies under it move exact bytes both ways at odd offsets.
#[test]
fn a_calibration_from_a_machine_with_one_more_device_still_moves_exact_bytes() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let machine = manager.machine();
    let mut devices = machine.clone();
    devices.push("NVIDIA Imaginary GPU".to_owned());
    let config = StagingConfig {
        chunk_bytes: 12 << 10,
        depth: 1,
        threads: 2,
        host_copy: HostCopy::Cached,
        order: ChunkOrder::Interleaved,
    };
    let table = foreign_table(devices, config);
    let path = std::env::temp_dir().join(format!(
        "cuweave-sixth-look-{}-foreign.json",
        std::process::id()
    ));
    let json = table
        .to_json()
        .replacen('{', "{\n  \"written_by\": \"cuweave 9.9\",", 1);
    std::fs::write(&path, json).unwrap();
    let loaded = CalibrationTable::load(&path);
    let _ = std::fs::remove_file(&path);
    let loaded = loaded.unwrap();
    assert_eq!(loaded, table);
    let mismatch = manager
        .set_calibration(loaded)
        .expect("a table with one more device than this machine was taken as this machine's");
    assert_eq!(mismatch.machine, machine);
    let bytes_n = 8 * MIB + 5;
    let plan = manager.plan(Location::PageableHost, Location::Device(0), bytes_n);
    assert_eq!(plan.method, TransferMethod::HostStaged, "{plan}");
    assert!(plan.measured_on.is_some(), "{plan}");
    assert!(plan.to_string().contains("not this machine"), "{plan}");
    for path in [
        TransferPath::PAGEABLE_TO_DEVICE,
        TransferPath::DEVICE_TO_PAGEABLE,
    ] {
        assert_eq!(manager.staging_for(path, 0, bytes_n), config, "{path}");
    }

    let data = bytes(bytes_n, 9);
    let at = 3usize;
    let mut device = DeviceBuffer::<u8>::new(ctx, bytes_n + at + 2).unwrap();
    device.fill(0xEE).unwrap();
    let report = manager
        .transfer(
            &data[..],
            Destination::view(device.slice_mut(at..at + bytes_n).unwrap()),
        )
        .unwrap();
    assert_eq!(report.plan.method, TransferMethod::HostStaged);
    let whole = device.to_vec().unwrap();
    assert!(
        whole[..at].iter().all(|&b| b == 0xEE) && whole[at + bytes_n..].iter().all(|&b| b == 0xEE)
    );
    assert_bytes(
        &whole[at..at + bytes_n],
        &data,
        "upload under the foreign table",
    );
    let mut back = vec![0u8; bytes_n - 1];
    let report = manager
        .transfer(Source::device(&device, at + 1, bytes_n - 1), &mut back[..])
        .unwrap();
    assert_eq!(report.plan.method, TransferMethod::HostStaged);
    assert_bytes(&back, &data[1..], "download under the foreign table");
    manager.clear_cache();
}

/// A data loader that prefetches a whole epoch's shards starts far more owned uploads than the
/// staging pool has workers (`2 * MAX_WORKERS + 3`, each a prime count of `u32`, about 1 MiB,
/// at an odd offset) before awaiting any, then downloads them all back the same way, dropping
/// every third download future unawaited. Every owned transfer runs its pipeline on a worker
/// while the others hold the rest of the pool: each must still finish and hand back exact
/// bytes, the dropped downloads finish in the background and are counted, and the statistics
/// count every transfer exactly once with no failure.
#[test]
fn more_owned_transfers_at_once_than_staging_workers_all_finish_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let manager = TransferManager::new().unwrap();
    let shards = 2 * MAX_WORKERS + 3;
    let n = 262_147;
    let at = 3usize;
    let data: Vec<Vec<u32>> = (0..shards).map(|s| words(n, 700 + s as u64)).collect();
    let uploads: Vec<_> = data
        .iter()
        .map(|d| {
            let dst = DeviceBuffer::<u32>::new(ctx, n + at + 2).unwrap();
            manager.upload_owned(d.clone(), dst, at)
        })
        .collect();
    let mut devices = Vec::with_capacity(shards);
    for (s, upload) in uploads.into_iter().enumerate() {
        let owned = block_on(upload);
        let report = owned
            .result
            .unwrap_or_else(|e| panic!("upload of shard {s}: {e}"));
        assert_eq!(report.bytes, n * 4, "shard {s}");
        assert_bytes(
            &owned.host,
            &data[s],
            &format!("shard {s}: host after upload"),
        );
        devices.push(owned.device);
    }
    let mut kept = Vec::new();
    for (s, device) in devices.into_iter().enumerate() {
        let download = manager.download_owned(device, at, vec![0u32; n]);
        if s % 3 == 2 {
            drop(download);
        } else {
            kept.push((s, download));
        }
    }
    for (s, download) in kept {
        let owned = block_on(download);
        owned
            .result
            .unwrap_or_else(|e| panic!("download of shard {s}: {e}"));
        assert_bytes(&owned.host, &data[s], &format!("shard {s}: round trip"));
    }
    let counted = |path: TransferPath| -> (u64, u64) {
        manager
            .stats()
            .snapshot()
            .iter()
            .filter(|(p, ..)| *p == path)
            .fold((0, 0), |(c, f), (_, _, s)| (c + s.count, f + s.failures))
    };
    assert_eq!(
        counted(TransferPath::PAGEABLE_TO_DEVICE),
        (shards as u64, 0)
    );
    let all_downloads = poll_until(Duration::from_secs(60), || {
        counted(TransferPath::DEVICE_TO_PAGEABLE).0 >= shards as u64
    });
    assert!(
        all_downloads,
        "dropped owned downloads never finished: {:?} of {shards}",
        counted(TransferPath::DEVICE_TO_PAGEABLE)
    );
    assert_eq!(
        counted(TransferPath::DEVICE_TO_PAGEABLE),
        (shards as u64, 0)
    );
}
