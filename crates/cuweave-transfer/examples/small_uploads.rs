//! Times the ways a small pageable upload can go on device 0, each on its own and round-robin
//! (as calibration measures), and prints each way's percentiles (GB/s): the plain driver call
//! (`cuMemcpyHtoD` + the legacy stream's synchronisation), the manager's `DirectCopy`, and the
//! staged pipeline with one block or with chunks, right after a pipelined transfer or not.
//!
//! `cargo run --release -p cuweave-transfer --example small_uploads [KIB...]` (default 256).
//! `SMALL_CALIBRATE=1` first calibrates a manager (with `RUST_LOG=cuweave_transfer=debug`, every
//! staging candidate's median is logged) and times its planned pageable transfers from 64 KiB to
//! 4 MiB against the plain calls, as the transfer bench's summary does; `SMALL_PLANNED_ONLY=1`
//! stops there.

use std::time::Instant;

use cuweave_driver::{Context, Device};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_transfer::{
    ChunkOrder, Destination, HostCopy, Location, StagingConfig, TransferManager, TransferMethod,
};

const RUNS: usize = 201;

/// A way of uploading, by name: a closure that uploads into the start of a device buffer.
type Way<'a> = (&'a str, Box<dyn Fn(&mut DeviceBuffer<u8>) + 'a>);

/// The upload of `host` by `manager` with `method`.
fn upload_with<'a>(
    name: &'a str,
    manager: &'a TransferManager,
    method: TransferMethod,
    host: &'a [u8],
) -> Way<'a> {
    (
        name,
        Box::new(move |device: &mut DeviceBuffer<u8>| {
            manager
                .transfer_with(method, host, Destination::device(device, 0))
                .map(drop)
                .unwrap()
        }),
    )
}

fn percentiles(bytes: usize, mut times: Vec<f64>) -> String {
    times.sort_by(f64::total_cmp);
    let at = |q: f64| bytes as f64 / times[((times.len() - 1) as f64 * q) as usize] / 1e9;
    format!(
        "p90 {:5.2}  median {:5.2}  p10 {:5.2}",
        at(0.1),
        at(0.5),
        at(0.9)
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !cuweave_driver::is_available() {
        println!("no CUDA driver: nothing to time");
        return Ok(());
    }
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() { vec![256] } else { sizes };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let context = Context::primary(Device::get(0)?)?;
    if std::env::var_os("SMALL_CALIBRATE").is_some() {
        // With RUST_LOG=cuweave_transfer=debug: every staging candidate's median.
        let manager = TransferManager::new()?;
        manager.calibrate()?;
        // The planned transfers as the transfer bench's summary times them: the plain call 21
        // times, then the manager's 21 times, medians.
        let mut host = vec![1u8; 4 << 20];
        let mut device = DeviceBuffer::<u8>::zeroed(&context, 4 << 20)?;
        let median = |op: &mut dyn FnMut()| {
            op();
            let mut times: Vec<f64> = (0..21)
                .map(|_| {
                    let start = Instant::now();
                    op();
                    start.elapsed().as_secs_f64()
                })
                .collect();
            times.sort_by(f64::total_cmp);
            times[10]
        };
        for bytes in [64 << 10, 256 << 10, 1 << 20, 4 << 20] {
            for up in [true, false] {
                let (src, dst) = if up {
                    (Location::PageableHost, Location::Device(0))
                } else {
                    (Location::Device(0), Location::PageableHost)
                };
                let raw = if up {
                    median(&mut || device.copy_range_from_host(0, &host[..bytes]).unwrap())
                } else {
                    median(&mut || device.copy_range_to_host(0, &mut host[..bytes]).unwrap())
                };
                let ours = if up {
                    median(&mut || {
                        manager
                            .transfer(&host[..bytes], Destination::device(&mut device, 0))
                            .map(drop)
                            .unwrap()
                    })
                } else {
                    median(&mut || {
                        manager
                            .transfer(
                                cuweave_transfer::Source::device(&device, 0, bytes),
                                &mut host[..bytes],
                            )
                            .map(drop)
                            .unwrap()
                    })
                };
                let path = cuweave_transfer::TransferPath::between(src, dst);
                println!(
                    "planned {} {:>5} KiB: raw {:6.2}, cuweave {:6.2} GB/s ({:.2}x): {} {:?}",
                    if up { "h2d" } else { "d2h" },
                    bytes >> 10,
                    bytes as f64 / raw / 1e9,
                    bytes as f64 / ours / 1e9,
                    raw / ours,
                    manager.plan(src, dst, bytes).method,
                    manager.staging_for(path, 0, bytes),
                );
            }
        }
        if std::env::var_os("SMALL_PLANNED_ONLY").is_some() {
            return Ok(());
        }
    }
    let largest = 64 << 20;
    let host = vec![1u8; largest];
    let mut device = DeviceBuffer::<u8>::zeroed(&context, largest)?;
    let staged = |chunk_bytes: usize, threads: usize| {
        TransferManager::with_staging(StagingConfig {
            chunk_bytes,
            depth: 2,
            threads,
            host_copy: HostCopy::Streaming,
            order: ChunkOrder::Ordered,
        })
    };
    for kib in sizes {
        let bytes = kib << 10;
        let one_block = staged(bytes, 1)?;
        let halves = staged(bytes / 2, 2)?;
        let plain = TransferManager::new()?;
        let big = staged(2 << 20, 8)?;
        let ways: Vec<Way<'_>> = vec![
            (
                "raw cuMemcpyHtoD + sync",
                Box::new(|d: &mut DeviceBuffer<u8>| {
                    d.copy_range_from_host(0, &host[..bytes]).unwrap()
                }),
            ),
            upload_with(
                "manager DirectCopy",
                &plain,
                TransferMethod::DirectCopy,
                &host[..bytes],
            ),
            upload_with(
                "staged one block",
                &one_block,
                TransferMethod::HostStaged,
                &host[..bytes],
            ),
            upload_with(
                "staged two chunks x 2",
                &halves,
                TransferMethod::HostStaged,
                &host[..bytes],
            ),
        ];
        println!("== {kib} KiB upload, {RUNS} runs each (GB/s)");
        for (name, way) in &ways {
            way(&mut device);
            let times: Vec<f64> = (0..RUNS)
                .map(|_| {
                    let start = Instant::now();
                    way(&mut device);
                    start.elapsed().as_secs_f64()
                })
                .collect();
            println!("   alone        {name:<26} {}", percentiles(bytes, times));
        }
        let mut rounds = vec![Vec::new(); ways.len()];
        for _ in 0..RUNS {
            for (i, (_, way)) in ways.iter().enumerate() {
                let start = Instant::now();
                way(&mut device);
                rounds[i].push(start.elapsed().as_secs_f64());
            }
        }
        for ((name, _), times) in ways.iter().zip(rounds) {
            println!("   round-robin  {name:<26} {}", percentiles(bytes, times));
        }
        // Each timed run right after a pipelined 16 MiB upload (its workers hot).
        for (name, way) in &ways {
            let times: Vec<f64> = (0..RUNS / 4)
                .map(|_| {
                    big.transfer_with(
                        TransferMethod::HostStaged,
                        &host[..16 << 20],
                        Destination::device(&mut device, 0),
                    )
                    .unwrap();
                    let start = Instant::now();
                    way(&mut device);
                    start.elapsed().as_secs_f64()
                })
                .collect();
            println!("   after 16 MiB {name:<26} {}", percentiles(bytes, times));
        }
    }
    Ok(())
}
