//! Sweeps the pipelined staging configuration (chunk size, depth, threads) on device 0 and
//! prints the pageable upload and download bandwidth of each, beside the plain driver calls.
//! The source of the defaults in `StagingConfig::default` (see docs/transfer.md).
//!
//! `cargo run --release -p cuweave-transfer --example staging_sweep [MiB]` (default 256 MiB).

use std::time::{Duration, Instant};

use cuweave_driver::{Context, Device};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_transfer::{Destination, Source, StagingConfig, TransferManager, TransferMethod};

fn best(mut run: impl FnMut()) -> Duration {
    run();
    (0..3)
        .map(|_| {
            let start = Instant::now();
            run();
            start.elapsed()
        })
        .min()
        .unwrap()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !cuweave_driver::is_available() {
        println!("no CUDA driver: nothing to sweep");
        return Ok(());
    }
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(256);
    let bytes = mib << 20;
    let context = Context::primary(Device::get(0)?)?;
    let mut host = vec![1u8; bytes];
    let mut device = DeviceBuffer::<u8>::zeroed(&context, bytes)?;
    let gbps = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
    let h2d = best(|| device.copy_from_host(&host).unwrap());
    let d2h = best(|| device.copy_to_host(&mut host).unwrap());
    println!(
        "{mib} MiB pageable, plain cuMemcpyHtoD {:.2} GB/s, cuMemcpyDtoH {:.2} GB/s",
        gbps(h2d),
        gbps(d2h)
    );
    println!("chunk_MiB depth threads   h2d_GB/s  d2h_GB/s");
    for chunk in [1usize, 2, 4, 8, 16] {
        for depth in [2usize, 3] {
            for threads in [2usize, 4, 6, 8, 12] {
                let config = StagingConfig {
                    chunk_bytes: chunk << 20,
                    depth,
                    threads,
                };
                let manager = TransferManager::with_staging(config)?;
                let up = best(|| {
                    manager
                        .transfer_with(
                            TransferMethod::HostStaged,
                            &host,
                            Destination::device(&mut device, 0),
                        )
                        .map(drop)
                        .unwrap()
                });
                let down = best(|| {
                    manager
                        .transfer_with(
                            TransferMethod::HostStaged,
                            Source::device(&device, 0, bytes),
                            &mut host,
                        )
                        .map(drop)
                        .unwrap()
                });
                println!(
                    "{chunk:>9} {depth:>5} {threads:>7} {:>10.2} {:>9.2}",
                    gbps(up),
                    gbps(down)
                );
            }
        }
    }
    // Host memcpy ceiling, for reference: threads copying disjoint halves of the same buffers.
    let mut other = vec![0u8; bytes];
    for threads in [1usize, 4, 8, 12] {
        let d = best(|| {
            let chunk = bytes.div_ceil(threads);
            std::thread::scope(|s| {
                for (a, b) in other.chunks_mut(chunk).zip(host.chunks(chunk)) {
                    s.spawn(move || a.copy_from_slice(b));
                }
            });
        });
        println!("host memcpy, {threads:>2} threads: {:.2} GB/s", gbps(d));
    }
    Ok(())
}
