//! The measurements behind `cuweave bench`: each direction and method at each size, on device 0
//! (and device 0 to 1 when there are two), the raw driver calls beside cuweave's methods.
//!
//! The raw rows are the driver's copies through cuweave-memory's blocking buffer copies (this
//! command has no `unsafe`): `cuMemcpyHtoD` / `cuMemcpyDtoH` / `cuMemcpyDtoD` / `cuMemcpyPeerAsync`
//! plus a completion wait, with about a microsecond of bookkeeping around them, which shows only
//! at the smallest sizes. The criterion bench `benches/benches/transfer.rs` times the bare entry
//! points.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuweave::driver::{Context, Device, Stream, StreamFlags};
use cuweave::memory::buffer::copy_peer;
use cuweave::memory::{Buffer, DeviceBuffer, PinnedBuffer};
use cuweave::transfer::{Destination, Source, TransferManager, TransferMethod, TransferPath};

use super::report::{BenchReport, Concurrent, Latency, Point, Series, Staging, size_label};

/// Why a bench run stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BenchError {
    /// No usable driver or device: said, and the command exits 0.
    NoGpu(String),
    /// The sizes asked for do not fit this machine's free memory.
    DoesNotFit(String),
    /// A measurement failed.
    Failed(String),
}

fn failed(what: &str) -> impl FnOnce(cuweave::transfer::TransferError) -> BenchError + '_ {
    move |error| BenchError::Failed(format!("{what}: {error}"))
}

/// Whether the largest size fits: two device buffers of it in `device_free` bytes, and the
/// pageable buffer, a pinned one and the staging blocks in `host_available` (when known).
/// 256 MiB of device memory is left for the driver and the staging copies' contexts.
pub fn check_fit(
    largest: usize,
    device_free: u64,
    host_available: Option<u64>,
    staging_bytes: usize,
    device: &str,
) -> Result<(), String> {
    const DEVICE_RESERVE: u64 = 256 << 20;
    let device_need = 2 * largest as u64 + DEVICE_RESERVE;
    if device_need > device_free {
        return Err(format!(
            "size {} does not fit: it needs {:.2} GiB of free memory on {device} (two buffers of it and \
             256 MiB of headroom), and {:.2} GiB are free; pass smaller --sizes",
            size_label(largest),
            device_need as f64 / f64::from(1 << 30),
            device_free as f64 / f64::from(1 << 30)
        ));
    }
    if let Some(available) = host_available {
        let host_need = 2 * largest as u64 + staging_bytes as u64;
        if host_need > available {
            return Err(format!(
                "size {} does not fit: it needs {:.2} GiB of host memory (a pageable and a pinned \
                 buffer of it, and {} of staging blocks), and {:.2} GiB are available; pass smaller --sizes",
                size_label(largest),
                host_need as f64 / f64::from(1 << 30),
                size_label(staging_bytes),
                available as f64 / f64::from(1 << 30)
            ));
        }
    }
    Ok(())
}

/// `MemAvailable` from `/proc/meminfo`, in bytes, where the system has it.
fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Median of `iterations` timed runs of `op` (after one warm-up run).
fn median(
    iterations: usize,
    mut op: impl FnMut() -> Result<(), BenchError>,
) -> Result<Duration, BenchError> {
    op()?;
    let mut times = Vec::with_capacity(iterations);
    for _ in 0..iterations.max(1) {
        let start = Instant::now();
        op()?;
        times.push(start.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2])
}

fn gbps(bytes: usize, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64().max(1e-12) / 1e9
}

/// The buffers one device's rows run on.
struct Buffers {
    host: Vec<u8>,
    pinned: PinnedBuffer<u8>,
    a: DeviceBuffer<u8>,
    b: DeviceBuffer<u8>,
}

/// A row being measured: where its points go.
struct Row {
    direction: &'static str,
    method: &'static str,
    cuweave: bool,
}

const H2D_ROWS: [Row; 5] = [
    Row {
        direction: "H2D",
        method: "raw pinned (cuMemcpyHtoD)",
        cuweave: false,
    },
    Row {
        direction: "H2D",
        method: "raw pageable (cuMemcpyHtoD)",
        cuweave: false,
    },
    Row {
        direction: "H2D",
        method: "cuweave staged (pageable)",
        cuweave: true,
    },
    Row {
        direction: "H2D",
        method: "cuweave planned (pageable)",
        cuweave: true,
    },
    Row {
        direction: "H2D",
        method: "cuweave planned (pinned)",
        cuweave: true,
    },
];
const D2H_ROWS: [Row; 5] = [
    Row {
        direction: "D2H",
        method: "raw pinned (cuMemcpyDtoH)",
        cuweave: false,
    },
    Row {
        direction: "D2H",
        method: "raw pageable (cuMemcpyDtoH)",
        cuweave: false,
    },
    Row {
        direction: "D2H",
        method: "cuweave staged (pageable)",
        cuweave: true,
    },
    Row {
        direction: "D2H",
        method: "cuweave planned (pageable)",
        cuweave: true,
    },
    Row {
        direction: "D2H",
        method: "cuweave planned (pinned)",
        cuweave: true,
    },
];
const D2D_ROWS: [Row; 2] = [
    Row {
        direction: "D2D",
        method: "raw (cuMemcpyDtoD)",
        cuweave: false,
    },
    Row {
        direction: "D2D",
        method: "cuweave planned",
        cuweave: true,
    },
];
const P2P_ROWS: [Row; 3] = [
    Row {
        direction: "P2P 0->1",
        method: "raw (cuMemcpyPeerAsync)",
        cuweave: false,
    },
    Row {
        direction: "P2P 0->1",
        method: "cuweave p2p",
        cuweave: true,
    },
    Row {
        direction: "P2P 0->1",
        method: "cuweave staged",
        cuweave: true,
    },
];

/// How many measurements a run makes, for the progress bar.
pub fn steps(sizes: usize, devices: usize) -> u64 {
    let per_size = H2D_ROWS.len()
        + D2H_ROWS.len()
        + D2D_ROWS.len()
        + if devices > 1 { P2P_ROWS.len() } else { 0 };
    (sizes * per_size + 4 + 2) as u64
}

/// Runs every measurement; `progress` is told each step's name after it finishes.
pub fn run(
    sizes: &[usize],
    iterations: usize,
    mut progress: impl FnMut(String),
) -> Result<BenchReport, BenchError> {
    if let Err(error) = cuweave::driver::driver() {
        return Err(BenchError::NoGpu(error.to_string()));
    }
    let count = Device::count().map_err(|e| BenchError::NoGpu(e.to_string()))?;
    if count == 0 {
        return Err(BenchError::NoGpu(
            "the CUDA driver found no device".to_owned(),
        ));
    }
    let gpu = |e: cuweave::driver::DriverError| BenchError::Failed(e.to_string());
    let device = Device::get(0).map_err(gpu)?;
    let name = device.name().map_err(gpu)?;
    let context = Context::primary(device).map_err(gpu)?;
    let manager = TransferManager::new().map_err(failed("creating the transfer manager"))?;
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let staging = manager.staging_for(TransferPath::PAGEABLE_TO_DEVICE, 0, largest);
    let free = context.memory_info().map_err(gpu)?.free as u64;
    check_fit(
        largest,
        free,
        host_available(),
        staging.staging_bytes(),
        &format!("device 0 ({name})"),
    )
    .map_err(BenchError::DoesNotFit)?;

    let alloc =
        |e: cuweave::memory::MemoryError| BenchError::Failed(format!("allocating buffers: {e}"));
    let mut buffers = Buffers {
        host: vec![0x5A; largest],
        pinned: PinnedBuffer::zeroed(&context, largest).map_err(alloc)?,
        a: DeviceBuffer::zeroed(&context, largest).map_err(alloc)?,
        b: DeviceBuffer::zeroed(&context, largest).map_err(alloc)?,
    };
    let mut series: Vec<Series> = Vec::new();
    let mut push = |row: &Row, bytes: usize, gbps: f64| match series
        .iter_mut()
        .find(|s| s.direction == row.direction && s.method == row.method)
    {
        Some(s) => s.points.push(Point { bytes, gbps }),
        None => series.push(Series {
            direction: row.direction.to_owned(),
            method: row.method.to_owned(),
            cuweave: row.cuweave,
            points: vec![Point { bytes, gbps }],
        }),
    };
    for &bytes in sizes {
        for (i, row) in H2D_ROWS.iter().enumerate() {
            let t = median(iterations, || h2d(&manager, &mut buffers, i, bytes))?;
            push(row, bytes, gbps(bytes, t));
            progress(format!(
                "{} {} {}",
                row.direction,
                row.method,
                size_label(bytes)
            ));
        }
        for (i, row) in D2H_ROWS.iter().enumerate() {
            let t = median(iterations, || d2h(&manager, &mut buffers, i, bytes))?;
            push(row, bytes, gbps(bytes, t));
            progress(format!(
                "{} {} {}",
                row.direction,
                row.method,
                size_label(bytes)
            ));
        }
        for (i, row) in D2D_ROWS.iter().enumerate() {
            let Buffers { a, b, .. } = &mut buffers;
            let t = median(iterations, || {
                if i == 0 {
                    b.copy_range_from(0, a, 0, bytes)
                        .map_err(|e| BenchError::Failed(e.to_string()))
                } else {
                    manager
                        .transfer(Source::device(a, 0, bytes), Destination::device(b, 0))
                        .map(drop)
                        .map_err(failed("D2D"))
                }
            })?;
            push(row, bytes, gbps(bytes, t));
            progress(format!(
                "{} {} {}",
                row.direction,
                row.method,
                size_label(bytes)
            ));
        }
    }
    if count > 1 {
        let second = Context::primary(Device::get(1).map_err(gpu)?).map_err(gpu)?;
        let free = second.memory_info().map_err(gpu)?.free as u64;
        check_fit(largest / 2, free, None, 0, "device 1").map_err(BenchError::DoesNotFit)?;
        peer_rows(
            &manager,
            &context,
            &second,
            &buffers.a,
            sizes,
            iterations,
            &mut push,
            &mut progress,
        )?;
    }
    let latency = latencies(&manager, &mut buffers, &mut progress)?;
    let concurrent = concurrent(&manager, &context, &mut buffers, iterations, &mut progress)?;
    Ok(BenchReport {
        concurrent,
        device: name,
        sizes: sizes.to_vec(),
        iterations,
        series,
        latency,
        staging: Staging {
            chunk_bytes: staging.chunk_bytes,
            depth: staging.depth,
            threads: staging.threads,
        },
    })
}

/// The cases of several host threads at once, at the largest size: an upload and a download
/// together (raw: pinned memory on two threads, each its own stream; cuweave: pageable), and
/// four threads each uploading a quarter.
fn concurrent(
    manager: &TransferManager,
    context: &Arc<Context>,
    buffers: &mut Buffers,
    iterations: usize,
    progress: &mut impl FnMut(String),
) -> Result<Vec<Concurrent>, BenchError> {
    let bytes = buffers.host.len();
    let alloc =
        |e: cuweave::memory::MemoryError| BenchError::Failed(format!("allocating buffers: {e}"));
    let memory = |e: cuweave::memory::MemoryError| BenchError::Failed(format!("concurrent: {e}"));
    let mut host2 = vec![0u8; bytes];
    let mut pinned2 = PinnedBuffer::<u8>::zeroed(context, bytes).map_err(alloc)?;
    let Buffers { host, pinned, a, b } = buffers;
    let mut out = Vec::new();
    let label = size_label(bytes);
    let raw = median(iterations, || {
        let up_src = pinned.as_slice().map_err(memory)?;
        let mut down_dst = pinned2.as_mut_slice().map_err(memory)?;
        let (a, b) = (&mut *a, &*b);
        std::thread::scope(|s| {
            let up = s.spawn(|| a.copy_range_from_host(0, &up_src));
            let down = b.copy_range_to_host(0, &mut down_dst);
            up.join()
                .map_err(|_| BenchError::Failed("upload thread panicked".to_owned()))?
                .map_err(memory)?;
            down.map_err(memory)
        })
    })?;
    let ours = median(iterations, || {
        let (a, b, host, host2) = (&mut *a, &*b, &*host, &mut host2);
        std::thread::scope(|s| {
            let up = s.spawn(|| manager.transfer(&host[..], Destination::device(a, 0)));
            let down = manager.transfer(Source::device(b, 0, bytes), &mut host2[..]);
            up.join()
                .map_err(|_| BenchError::Failed("upload thread panicked".to_owned()))?
                .map_err(failed("upload"))?;
            down.map(drop).map_err(failed("download"))
        })
    })?;
    out.push(Concurrent {
        case: format!("{label} up + {label} down, 2 threads"),
        raw: "raw pinned (blocking calls)".to_owned(),
        raw_gbps: gbps(2 * bytes, raw),
        cuweave_gbps: gbps(2 * bytes, ours),
    });
    progress("both directions".to_owned());
    let quarter = bytes / 4;
    let mut quarters: Vec<DeviceBuffer<u8>> = (0..4)
        .map(|_| DeviceBuffer::zeroed(context, quarter).map_err(alloc))
        .collect::<Result<_, _>>()?;
    let mut four = |ours: bool| {
        median(iterations, || {
            std::thread::scope(|s| {
                let handles: Vec<_> = host
                    .chunks(quarter)
                    .zip(quarters.iter_mut())
                    .map(|(src, dst)| {
                        s.spawn(move || {
                            if ours {
                                manager
                                    .transfer(src, Destination::device(dst, 0))
                                    .map(drop)
                                    .map_err(failed("upload"))
                            } else {
                                dst.copy_range_from_host(0, src).map_err(memory)
                            }
                        })
                    })
                    .collect();
                handles.into_iter().try_for_each(|h| {
                    h.join()
                        .map_err(|_| BenchError::Failed("upload thread panicked".to_owned()))?
                })
            })
        })
    };
    let (raw, ours) = (four(false)?, four(true)?);
    out.push(Concurrent {
        case: format!("4 threads x {} up", size_label(quarter)),
        raw: "raw pageable".to_owned(),
        raw_gbps: gbps(4 * quarter, raw),
        cuweave_gbps: gbps(4 * quarter, ours),
    });
    progress("four uploads".to_owned());
    Ok(out)
}

fn h2d(
    manager: &TransferManager,
    buffers: &mut Buffers,
    row: usize,
    bytes: usize,
) -> Result<(), BenchError> {
    let Buffers {
        host, pinned, a, ..
    } = buffers;
    let memory = |e: cuweave::memory::MemoryError| BenchError::Failed(format!("H2D: {e}"));
    match row {
        0 => a
            .copy_range_from_host(0, &pinned.as_slice().map_err(memory)?[..bytes])
            .map_err(memory),
        1 => a.copy_range_from_host(0, &host[..bytes]).map_err(memory),
        2 => manager
            .transfer_with(
                TransferMethod::HostStaged,
                &host[..bytes],
                Destination::device(a, 0),
            )
            .map(drop)
            .map_err(failed("H2D staged")),
        3 => manager
            .transfer(&host[..bytes], Destination::device(a, 0))
            .map(drop)
            .map_err(failed("H2D")),
        _ => manager
            .transfer(Source::pinned(pinned, 0, bytes), Destination::device(a, 0))
            .map(drop)
            .map_err(failed("H2D pinned")),
    }
}

fn d2h(
    manager: &TransferManager,
    buffers: &mut Buffers,
    row: usize,
    bytes: usize,
) -> Result<(), BenchError> {
    let Buffers {
        host, pinned, a, ..
    } = buffers;
    let memory = |e: cuweave::memory::MemoryError| BenchError::Failed(format!("D2H: {e}"));
    match row {
        0 => a
            .copy_range_to_host(0, &mut pinned.as_mut_slice().map_err(memory)?[..bytes])
            .map_err(memory),
        1 => a.copy_range_to_host(0, &mut host[..bytes]).map_err(memory),
        2 => manager
            .transfer_with(
                TransferMethod::HostStaged,
                Source::device(a, 0, bytes),
                &mut host[..bytes],
            )
            .map(drop)
            .map_err(failed("D2H staged")),
        3 => manager
            .transfer(Source::device(a, 0, bytes), &mut host[..bytes])
            .map(drop)
            .map_err(failed("D2H")),
        _ => manager
            .transfer(Source::device(a, 0, bytes), Destination::pinned(pinned, 0))
            .map(drop)
            .map_err(failed("D2H pinned")),
    }
}

#[allow(clippy::too_many_arguments)]
fn peer_rows(
    manager: &TransferManager,
    first: &Arc<Context>,
    second: &Arc<Context>,
    src: &DeviceBuffer<u8>,
    sizes: &[usize],
    iterations: usize,
    push: &mut impl FnMut(&Row, usize, f64),
    progress: &mut impl FnMut(String),
) -> Result<(), BenchError> {
    let driver = |e: cuweave::driver::DriverError| BenchError::Failed(format!("P2P: {e}"));
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let mut dst = DeviceBuffer::<u8>::zeroed(second, largest)
        .map_err(|e| BenchError::Failed(format!("allocating on device 1: {e}")))?;
    let stream = Stream::new(second, StreamFlags::NON_BLOCKING).map_err(driver)?;
    if first
        .device()
        .can_access_peer(&second.device())
        .map_err(driver)?
    {
        first.enable_peer_access(second).map_err(driver)?;
        second.enable_peer_access(first).map_err(driver)?;
    }
    for &bytes in sizes {
        for (i, row) in P2P_ROWS.iter().enumerate() {
            let t = median(iterations, || match i {
                0 => copy_peer(&mut dst, 0, src, 0, bytes, &stream)
                    .map_err(|e| BenchError::Failed(e.to_string())),
                1 => manager
                    .transfer(
                        Source::device(src, 0, bytes),
                        Destination::device(&mut dst, 0),
                    )
                    .map(drop)
                    .map_err(failed("P2P")),
                _ => manager
                    .transfer_with(
                        TransferMethod::HostStaged,
                        Source::device(src, 0, bytes),
                        Destination::device(&mut dst, 0),
                    )
                    .map(drop)
                    .map_err(failed("P2P staged")),
            })?;
            push(row, bytes, gbps(bytes, t));
            progress(format!(
                "{} {} {}",
                row.direction,
                row.method,
                size_label(bytes)
            ));
        }
    }
    Ok(())
}

/// Median host-observed time of 4-byte copies: the copy engine's latency plus the call's.
fn latencies(
    manager: &TransferManager,
    buffers: &mut Buffers,
    progress: &mut impl FnMut(String),
) -> Result<Vec<Latency>, BenchError> {
    const RUNS: usize = 101;
    let mut out = Vec::new();
    for (name, h2d_row, d2h_row) in [
        ("raw pinned cuMemcpyHtoD / DtoH", 0, 0),
        ("cuweave planned, pinned", 4, 4),
        ("raw pageable cuMemcpyHtoD / DtoH", 1, 1),
        ("cuweave planned, pageable", 3, 3),
    ] {
        let up = median(RUNS, || h2d(manager, buffers, h2d_row, 4))?;
        let down = median(RUNS, || d2h(manager, buffers, d2h_row, 4))?;
        out.push(Latency {
            name: format!("H2D {name}"),
            micros: up.as_secs_f64() * 1e6,
        });
        out.push(Latency {
            name: format!("D2H {name}"),
            micros: down.as_secs_f64() * 1e6,
        });
        progress(format!("latency {name}"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_that_do_not_fit_are_refused_with_the_numbers() {
        let gib = 1u64 << 30;
        assert!(check_fit(1 << 30, 80 * gib, Some(100 * gib), 96 << 20, "device 0").is_ok());
        let error = check_fit(
            1 << 30,
            2 * gib,
            Some(100 * gib),
            96 << 20,
            "device 0 (H100)",
        )
        .unwrap_err();
        assert!(error.starts_with("size 1GiB does not fit"), "{error}");
        assert!(
            error.contains("2.25 GiB") && error.contains("2.00 GiB are free"),
            "{error}"
        );
        let error = check_fit(1 << 30, 80 * gib, Some(gib), 96 << 20, "device 0").unwrap_err();
        assert!(
            error.contains("host memory") && error.contains("96MiB"),
            "{error}"
        );
        // Unknown host memory is not checked.
        assert!(check_fit(1 << 30, 80 * gib, None, 0, "device 0").is_ok());
    }

    #[test]
    fn steps_count_every_row_at_every_size_and_the_latencies() {
        // Rows per size, four latencies, the two concurrent cases.
        assert_eq!(steps(8, 1), 8 * 12 + 4 + 2);
        assert_eq!(steps(8, 2), 8 * 15 + 4 + 2);
    }
}
