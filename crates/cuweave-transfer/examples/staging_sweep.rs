//! Sweeps the pipelined staging configuration (chunk size, participants) per transfer size on
//! device 0 and prints the pageable upload and download bandwidth of each, beside the plain
//! driver calls and the pinned copy (the bus limit); then the host's copy ceiling, and the
//! calibration the manager measures (JSON). The source of `StagingConfig::for_upload` / `for_download` and of
//! `CalibrationTable::h100_defaults` (see docs/transfer.md).
//!
//! `SWEEP_CALIBRATE=1 cargo run --release -p cuweave-transfer --example staging_sweep [SIZE...]`
//! (a size in MiB, or in KiB with a `k` suffix: `256k`; default: 1, 4, 16, 64, 256 and
//! 1024 MiB). `SWEEP_CONCURRENT=1` measures only the concurrent cases instead (median of 5): a 1 GiB upload
//! and a 1 GiB download at once, and four 256 MiB uploads at once, each transfer with the same
//! fixed participant count (the staging switches `CUWEAVE_STAGING_NO_SHARE`,
//! `CUWEAVE_STAGING_SPAWN` and `CUWEAVE_STAGING_PLAIN_COPY` apply, see `docs/transfer.md`).
//! `SWEEP_DOWN_ONLY=1` sweeps downloads alone and skips the host copy ceiling (with
//! `CUWEAVE_STAGING_UNORDERED_DOWNLOADS=1`, the downloads that queue on every participant's
//! stream); `SWEEP_UP_ONLY=1` the same for uploads (`CUWEAVE_STAGING_UNORDERED_UPLOADS=1`).
//! `SWEEP_BOTH=1` runs only a 1 GiB upload and a 1 GiB download at once with the default
//! configurations, nine times, printing each run: both together, and each side's own rate;
//! then each alone at 1 GiB, 256 MiB and 64 MiB (median of 9), 16 MiB and 4 MiB (of 51).

use std::time::{Duration, Instant};

use cuweave_driver::{Context, Device};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer, copy_streaming};
use cuweave_transfer::{
    ChunkOrder, Destination, HostCopy, Source, StagingConfig, TransferManager, TransferMethod,
    host_threads,
};

/// The median of `runs` runs after a warm-up one.
fn median(runs: usize, mut run: impl FnMut()) -> Duration {
    run();
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            run();
            start.elapsed()
        })
        .collect();
    times.sort_unstable();
    times[runs / 2]
}

fn best(runs: usize, mut run: impl FnMut()) -> Duration {
    run();
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            run();
            start.elapsed()
        })
        .min()
        .unwrap()
}

/// One pipelined pageable copy of all of `host`: an upload into the start of `device`, or a
/// download from it.
fn staged(manager: &TransferManager, up: bool, host: &mut [u8], device: &mut DeviceBuffer<u8>) {
    let bytes = host.len();
    if up {
        manager.transfer_with(
            TransferMethod::HostStaged,
            &*host,
            Destination::device(device, 0),
        )
    } else {
        manager.transfer_with(
            TransferMethod::HostStaged,
            Source::device(&*device, 0, bytes),
            host,
        )
    }
    .map(drop)
    .unwrap()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !cuweave_driver::is_available() {
        println!("no CUDA driver: nothing to sweep");
        return Ok(());
    }
    // Sizes in KiB: "256k" is 256 KiB, a plain number MiB.
    let sizes: Vec<usize> = {
        let given: Vec<usize> = std::env::args()
            .skip(1)
            .filter_map(|a| match a.strip_suffix('k') {
                Some(kib) => kib.parse().ok(),
                None => a.parse::<usize>().ok().map(|mib| mib << 10),
            })
            .collect();
        if given.is_empty() {
            vec![1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
        } else {
            given
        }
    };
    let largest = (sizes.iter().max().copied().unwrap_or(1) << 10).max(256 << 20);
    let context = Context::primary(Device::get(0)?)?;
    let mut host = vec![1u8; largest];
    let mut device = DeviceBuffer::<u8>::zeroed(&context, largest)?;
    let mut pinned = PinnedBuffer::<u8>::zeroed(&context, largest)?;
    let threads = host_threads();
    println!("host threads: {threads}");
    if std::env::var_os("SWEEP_CALIBRATE").is_some() {
        // `RUST_LOG=cuweave_transfer=debug` shows every candidate's figure in every round.
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .init();
        let manager = TransferManager::new()?;
        let start = Instant::now();
        let table = manager.calibrate()?;
        println!("calibration took {:.2} s", start.elapsed().as_secs_f64());
        println!("{}", table.to_json());
        // `SWEEP_CALIBRATE=N` (N > 1): N - 1 more calibrations, then stop.
        let again: usize = std::env::var("SWEEP_CALIBRATE")?.parse().unwrap_or(1);
        if again > 1 {
            for _ in 1..again {
                manager.recalibrate()?;
            }
            return Ok(());
        }
    }
    if std::env::var_os("SWEEP_PARALLEL_RAW").is_some() {
        parallel_raw(&context, &sizes)?;
        return Ok(());
    }
    if std::env::var_os("SWEEP_TIMES").is_some() {
        // Every run's figure, not the best: a calibrated manager's uploads and downloads at each
        // size, 15 runs each, interleaved with raw pageable calls as the bench does.
        let manager = TransferManager::new()?;
        manager.calibrate()?;
        for &kib in &sizes {
            let bytes = kib << 10;
            for up in [true, false] {
                let mut figures: Vec<f64> = (0..15)
                    .map(|_| {
                        if up {
                            device.copy_range_from_host(0, &host[..bytes]).unwrap();
                        } else {
                            device.copy_range_to_host(0, &mut host[..bytes]).unwrap();
                        }
                        let start = Instant::now();
                        staged(&manager, up, &mut host[..bytes], &mut device);
                        bytes as f64 / start.elapsed().as_secs_f64() / 1e9
                    })
                    .collect();
                let order: Vec<String> = figures.iter().map(|g| format!("{g:.1}")).collect();
                figures.sort_by(f64::total_cmp);
                println!(
                    "times {} {} KiB ({:?}): median {:.1}, min {:.1}, max {:.1}; in order {}",
                    if up { "h2d" } else { "d2h" },
                    kib,
                    manager.staging_for(
                        if up {
                            cuweave_transfer::TransferPath::PAGEABLE_TO_DEVICE
                        } else {
                            cuweave_transfer::TransferPath::DEVICE_TO_PAGEABLE
                        },
                        0,
                        bytes
                    ),
                    figures[7],
                    figures[0],
                    figures[14],
                    order.join(" ")
                );
            }
        }
        return Ok(());
    }
    if std::env::var_os("SWEEP_BOTH").is_some() {
        both_directions(&context, &host)?;
        return Ok(());
    }
    if std::env::var_os("SWEEP_CONCURRENT").is_some() {
        concurrent(&context, &host)?;
        return Ok(());
    }
    let down_only = std::env::var_os("SWEEP_DOWN_ONLY").is_some();
    let up_only = std::env::var_os("SWEEP_UP_ONLY").is_some();
    for &kib in &sizes {
        let bytes = kib << 10;
        let mib = bytes as f64 / (1 << 20) as f64;
        let runs = if bytes >= 256 << 20 { 3 } else { 7 };
        let gbps = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
        let h2d = best(runs, || {
            device.copy_range_from_host(0, &host[..bytes]).unwrap()
        });
        let d2h = best(runs, || {
            device.copy_range_to_host(0, &mut host[..bytes]).unwrap()
        });
        let ph2d = best(runs, || {
            device
                .copy_range_from_host(0, &pinned.as_slice().unwrap()[..bytes])
                .unwrap()
        });
        let pd2h = best(runs, || {
            device
                .copy_range_to_host(0, &mut pinned.as_mut_slice().unwrap()[..bytes])
                .unwrap()
        });
        println!(
            "== {mib} MiB: pageable cuMemcpyHtoD {:.2} / cuMemcpyDtoH {:.2} GB/s; pinned {:.2} / {:.2} GB/s",
            gbps(h2d),
            gbps(d2h),
            gbps(ph2d),
            gbps(pd2h)
        );
        println!("   chunk_KiB threads  h2d_stream h2d_cached  d2h_stream d2h_cached  (GB/s)");
        let mut best_up = (0.0, StagingConfig::for_upload(bytes));
        let mut best_down = (0.0, StagingConfig::for_download(bytes));
        for chunk_kib in [64usize, 128, 256, 512, 1024, 2048, 4096, 8192] {
            // At most 1024 chunks: smaller ones only cost time to sweep. One chunk of the whole
            // size is a single block (no pipeline), which small copies may want.
            if chunk_kib << 10 > bytes || bytes / (chunk_kib << 10) > 1024 {
                continue;
            }
            for t in [1usize, 2, 4, 6, 8, 12, 16] {
                if t > threads || (bytes / (chunk_kib << 10)) < t {
                    continue;
                }
                let mut row = Vec::new();
                for up in [true, false] {
                    if (up && down_only) || (!up && up_only) {
                        row.extend([0.0, 0.0]);
                        continue;
                    }
                    for host_copy in [HostCopy::Streaming, HostCopy::Cached] {
                        let config = StagingConfig {
                            chunk_bytes: chunk_kib << 10,
                            depth: 2,
                            threads: t,
                            host_copy,
                            order: ChunkOrder::Ordered,
                        };
                        let manager = TransferManager::with_staging(config)?;
                        let figure = gbps(best(runs, || {
                            staged(&manager, up, &mut host[..bytes], &mut device)
                        }));
                        let best = if up { &mut best_up } else { &mut best_down };
                        if figure > best.0 {
                            *best = (figure, config);
                        }
                        row.push(figure);
                    }
                }
                println!(
                    "   {chunk_kib:>9} {t:>7} {:>11.2} {:>10.2} {:>11.2} {:>10.2}",
                    row[0], row[1], row[2], row[3]
                );
            }
        }
        let manager = TransferManager::new()?;
        if down_only {
            let down = gbps(best(runs, || {
                staged(&manager, false, &mut host[..bytes], &mut device)
            }));
            println!(
                "   best d2h {:.2} at {:?}\n   default d2h {down:.2} ({:?})",
                best_down.0,
                best_down.1,
                StagingConfig::for_download(bytes),
            );
            continue;
        }
        let up = gbps(best(runs, || {
            staged(&manager, true, &mut host[..bytes], &mut device)
        }));
        if up_only {
            println!(
                "   best h2d {:.2} at {:?}\n   default h2d {up:.2} ({:?})",
                best_up.0,
                best_up.1,
                StagingConfig::for_upload(bytes),
            );
            continue;
        }
        let down = gbps(best(runs, || {
            staged(&manager, false, &mut host[..bytes], &mut device)
        }));
        println!(
            "   best h2d {:.2} GB/s at {:?}\n   best d2h {:.2} at {:?}\n   defaults: h2d {up:.2} ({:?}), d2h {down:.2} ({:?})",
            best_up.0,
            best_up.1,
            best_down.0,
            best_down.1,
            StagingConfig::for_upload(bytes),
            StagingConfig::for_download(bytes),
        );
    }
    if down_only || up_only {
        return Ok(());
    }
    // Host copy ceiling: threads copying disjoint parts with streaming stores.
    let bytes = largest.min(256 << 20);
    let mut other = vec![0u8; bytes];
    for t in [1usize, 2, 4, 8, 12, 16] {
        if t > threads {
            continue;
        }
        for streaming in [true, false] {
            let d = best(3, || {
                let chunk = bytes.div_ceil(t);
                std::thread::scope(|s| {
                    for (a, b) in other.chunks_mut(chunk).zip(host[..bytes].chunks(chunk)) {
                        s.spawn(move || {
                            if streaming {
                                copy_streaming(a, b).unwrap()
                            } else {
                                a.copy_from_slice(b)
                            }
                        });
                    }
                });
            });
            println!(
                "host {}, {t:>2} threads: {:.2} GB/s",
                if streaming {
                    "copy_streaming"
                } else {
                    "memcpy"
                },
                bytes as f64 / d.as_secs_f64() / 1e9
            );
        }
    }
    Ok(())
}

/// Both directions at once (1 GiB each way, two threads) and four 256 MiB uploads at once, with
/// `t` participants per transfer, then with the per-size defaults.
fn concurrent(
    context: &std::sync::Arc<Context>,
    host: &[u8],
) -> Result<(), Box<dyn std::error::Error>> {
    const GIB: usize = 1 << 30;
    let (mut up, down_src, mut down) = both_ways(context)?;
    let mut quarters: Vec<DeviceBuffer<u8>> = (0..4)
        .map(|_| DeviceBuffer::<u8>::zeroed(context, GIB / 4))
        .collect::<Result<_, _>>()?;
    let gbps = |bytes: usize, d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
    let configs: Vec<Option<StagingConfig>> = [4usize, 5, 6, 7, 8, 12]
        .iter()
        .map(|&t| {
            Some(StagingConfig {
                chunk_bytes: 4 << 20,
                depth: 2,
                threads: t,
                host_copy: HostCopy::Cached,
                order: ChunkOrder::Ordered,
            })
        })
        .chain([None])
        .collect();
    for config in configs {
        let manager = match config {
            Some(config) => TransferManager::with_staging(config)?,
            None => TransferManager::new()?,
        };
        let both = median(5, || {
            std::thread::scope(|s| {
                s.spawn(|| {
                    manager
                        .transfer(&host[..GIB], Destination::device(&mut up, 0))
                        .map(drop)
                        .unwrap()
                });
                s.spawn(|| {
                    manager
                        .transfer(Source::device(&down_src, 0, GIB), &mut down[..])
                        .map(drop)
                        .unwrap()
                });
            });
        });
        let four = median(5, || {
            std::thread::scope(|s| {
                for (i, quarter) in quarters.iter_mut().enumerate() {
                    let manager = &manager;
                    let src = &host[i * (GIB / 4)..(i + 1) * (GIB / 4)];
                    s.spawn(move || {
                        manager
                            .transfer(src, Destination::device(quarter, 0))
                            .map(drop)
                            .unwrap()
                    });
                }
            });
        });
        println!(
            "concurrent {:?}: both directions 1 GiB {:.2} GB/s together; four x 256 MiB up {:.2} GB/s together",
            config.map(|c| (c.chunk_bytes >> 10, c.threads)),
            gbps(2 * GIB, both),
            gbps(GIB, four)
        );
    }
    Ok(())
}

/// The buffers of a 1 GiB upload and a 1 GiB download at once: the upload's destination, the
/// download's source and the download's pageable destination.
type BothWays = (DeviceBuffer<u8>, DeviceBuffer<u8>, Vec<u8>);

fn both_ways(context: &std::sync::Arc<Context>) -> Result<BothWays, Box<dyn std::error::Error>> {
    const GIB: usize = 1 << 30;
    Ok((
        DeviceBuffer::<u8>::zeroed(context, GIB)?,
        DeviceBuffer::<u8>::zeroed(context, GIB)?,
        vec![0u8; GIB],
    ))
}

/// A 1 GiB upload and a 1 GiB download at once on two threads, with the default configurations:
/// each run's rate together and each side's own (bytes over that thread's own time), then the
/// medians.
fn both_directions(
    context: &std::sync::Arc<Context>,
    host: &[u8],
) -> Result<(), Box<dyn std::error::Error>> {
    const GIB: usize = 1 << 30;
    let (mut up, down_src, mut down) = both_ways(context)?;
    let manager = TransferManager::new()?;
    let gbps = |bytes: usize, d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
    let mut rows = Vec::new();
    for run in 0..10 {
        let start = Instant::now();
        let (up_time, down_time) = std::thread::scope(|s| {
            let upload = s.spawn(|| {
                let start = Instant::now();
                manager
                    .transfer(&host[..GIB], Destination::device(&mut up, 0))
                    .map(drop)
                    .unwrap();
                start.elapsed()
            });
            let download = s.spawn(|| {
                let start = Instant::now();
                manager
                    .transfer(Source::device(&down_src, 0, GIB), &mut down[..])
                    .map(drop)
                    .unwrap();
                start.elapsed()
            });
            (upload.join().unwrap(), download.join().unwrap())
        });
        let row = [
            gbps(2 * GIB, start.elapsed()),
            gbps(GIB, up_time),
            gbps(GIB, down_time),
        ];
        // The first run warms the pages and the pools.
        if run > 0 {
            println!(
                "both run {run}: {:.1} GB/s together; upload {:.1}, download {:.1}",
                row[0], row[1], row[2]
            );
            rows.push(row);
        }
    }
    let median_of = |i: usize| {
        let mut column: Vec<f64> = rows.iter().map(|row| row[i]).collect();
        column.sort_by(f64::total_cmp);
        column[column.len() / 2]
    };
    println!(
        "both median: {:.1} GB/s together; upload {:.1}, download {:.1}",
        median_of(0),
        median_of(1),
        median_of(2)
    );
    // Each direction alone with the same defaults, at this size and smaller ones (small ones
    // over more runs: a run takes a fraction of a millisecond there).
    for bytes in [GIB, 256 << 20, 64 << 20, 16 << 20, 4 << 20] {
        let runs = if bytes >= 64 << 20 { 9 } else { 51 };
        let alone_up = median(runs, || {
            manager
                .transfer(&host[..bytes], Destination::device(&mut up, 0))
                .map(drop)
                .unwrap();
        });
        let alone_down = median(runs, || {
            manager
                .transfer(Source::device(&down_src, 0, bytes), &mut down[..bytes])
                .map(drop)
                .unwrap();
        });
        println!(
            "alone median, {} MiB: upload {:.1}, download {:.1}",
            bytes >> 20,
            gbps(bytes, alone_up),
            gbps(bytes, alone_down)
        );
    }
    Ok(())
}

/// The driver's own pageable copies from `t` threads at once, each on its own stream and its own
/// part of the size: whether the driver's staging scales with the calling threads.
fn parallel_raw(
    context: &std::sync::Arc<Context>,
    sizes: &[usize],
) -> Result<(), Box<dyn std::error::Error>> {
    use cuweave_driver::{Stream, StreamFlags};
    for &kib in sizes {
        let bytes = kib << 10;
        for t in [1usize, 2, 4, 8] {
            let part = bytes / t;
            let streams: Vec<Stream> = (0..t)
                .map(|_| Stream::new(context, StreamFlags::NON_BLOCKING))
                .collect::<Result<_, _>>()?;
            let mut devices: Vec<DeviceBuffer<u8>> = (0..t)
                .map(|_| DeviceBuffer::<u8>::zeroed(context, part))
                .collect::<Result<_, _>>()?;
            let mut hosts: Vec<Vec<u8>> = (0..t).map(|_| vec![1u8; part]).collect();
            let mut figures = [0.0; 2];
            for (i, up) in [true, false].into_iter().enumerate() {
                let d = best(7, || {
                    std::thread::scope(|s| {
                        for ((device, host), stream) in
                            devices.iter_mut().zip(hosts.iter_mut()).zip(&streams)
                        {
                            s.spawn(move || {
                                let vec = std::mem::take(host);
                                let back = if up {
                                    device.copy_range_from_host_async(0, vec, stream)
                                } else {
                                    device.copy_range_to_host_async(0, vec, stream)
                                }
                                .unwrap()
                                .wait()
                                .unwrap();
                                *host = back;
                            });
                        }
                    });
                });
                figures[i] = (part * t) as f64 / d.as_secs_f64() / 1e9;
            }
            println!(
                "parallel raw pageable {kib} KiB x{t} threads: h2d {:.2}, d2h {:.2} GB/s",
                figures[0], figures[1]
            );
        }
    }
    Ok(())
}
