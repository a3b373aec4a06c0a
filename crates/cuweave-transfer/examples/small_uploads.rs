//! Times the ways a small pageable upload can go on device 0, each on its own and round-robin
//! (as calibration measures), and prints each way's percentiles (GB/s): the plain driver call
//! (`cuMemcpyHtoD` + the legacy stream's synchronisation), the manager's `DirectCopy`, and the
//! staged pipeline with one block or with chunks, right after a pipelined transfer or not.
//!
//! `cargo run --release -p cuweave-transfer --example small_uploads [KIB...]` (default 256).

use std::time::Instant;

use cuweave_driver::{Context, Device};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_transfer::{
    ChunkOrder, Destination, HostCopy, Location, StagingConfig, TransferManager, TransferMethod,
};

const RUNS: usize = 201;

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
    if std::env::var_os("SMALL_CALIBRATE").is_some() {
        // With RUST_LOG=cuweave_transfer=debug: every staging candidate's median.
        let manager = TransferManager::new()?;
        manager.calibrate()?;
        for bytes in [64 << 10, 256 << 10, 1 << 20, 4 << 20] {
            for (src, dst) in [
                (Location::PageableHost, Location::Device(0)),
                (Location::Device(0), Location::PageableHost),
            ] {
                println!("plan: {}", manager.plan(src, dst, bytes));
            }
        }
    }
    let context = Context::primary(Device::get(0)?)?;
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
        type Way<'a> = (&'a str, Box<dyn Fn(&mut DeviceBuffer<u8>) + 'a>);
        let ways: Vec<Way<'_>> = vec![
            (
                "raw cuMemcpyHtoD + sync",
                Box::new(|d: &mut DeviceBuffer<u8>| {
                    d.copy_range_from_host(0, &host[..bytes]).unwrap()
                }),
            ),
            (
                "manager DirectCopy",
                Box::new(|d: &mut DeviceBuffer<u8>| {
                    plain
                        .transfer_with(
                            TransferMethod::DirectCopy,
                            &host[..bytes],
                            Destination::device(d, 0),
                        )
                        .map(drop)
                        .unwrap()
                }),
            ),
            (
                "staged one block",
                Box::new(|d: &mut DeviceBuffer<u8>| {
                    one_block
                        .transfer_with(
                            TransferMethod::HostStaged,
                            &host[..bytes],
                            Destination::device(d, 0),
                        )
                        .map(drop)
                        .unwrap()
                }),
            ),
            (
                "staged two chunks x 2",
                Box::new(|d: &mut DeviceBuffer<u8>| {
                    halves
                        .transfer_with(
                            TransferMethod::HostStaged,
                            &host[..bytes],
                            Destination::device(d, 0),
                        )
                        .map(drop)
                        .unwrap()
                }),
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
