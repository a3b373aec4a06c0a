//! Sweeps the pipelined staging configuration (chunk size, participants) per transfer size on
//! device 0 and prints the pageable upload and download bandwidth of each, beside the plain
//! driver calls and the pinned copy (the bus limit); then the host's copy ceiling, and the
//! calibration the manager measures (JSON). The source of `StagingConfig::for_size` and of
//! `CalibrationTable::h100_defaults` (see docs/transfer.md).
//!
//! `SWEEP_CALIBRATE=1 cargo run --release -p cuweave-transfer --example staging_sweep [MiB...]`
//! (default: 1, 4,
//! 16, 64, 256 and 1024 MiB).

use std::time::{Duration, Instant};

use cuweave_driver::{Context, Device};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer, copy_streaming};
use cuweave_transfer::{
    Destination, Source, StagingConfig, TransferManager, TransferMethod, host_threads,
};

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !cuweave_driver::is_available() {
        println!("no CUDA driver: nothing to sweep");
        return Ok(());
    }
    let sizes: Vec<usize> = {
        let given: Vec<usize> = std::env::args()
            .skip(1)
            .filter_map(|a| a.parse().ok())
            .collect();
        if given.is_empty() {
            vec![1, 4, 16, 64, 256, 1024]
        } else {
            given
        }
    };
    let largest = sizes.iter().max().copied().unwrap_or(1) << 20;
    let context = Context::primary(Device::get(0)?)?;
    let mut host = vec![1u8; largest];
    let mut device = DeviceBuffer::<u8>::zeroed(&context, largest)?;
    let mut pinned = PinnedBuffer::<u8>::zeroed(&context, largest)?;
    let threads = host_threads();
    println!("host threads: {threads}");
    if std::env::var_os("SWEEP_CALIBRATE").is_some() {
        let manager = TransferManager::new()?;
        let start = Instant::now();
        let table = manager.calibrate()?;
        println!("calibration took {:.2} s", start.elapsed().as_secs_f64());
        println!("{}", table.to_json());
    }
    for &mib in &sizes {
        let bytes = mib << 20;
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
        println!("   chunk_KiB threads   h2d_GB/s  d2h_GB/s");
        let mut best_up = (0.0, StagingConfig::for_size(bytes));
        let mut best_down = best_up;
        for chunk_kib in [128usize, 256, 512, 1024, 2048, 4096, 8192] {
            if chunk_kib << 10 >= bytes {
                continue;
            }
            for t in [2usize, 4, 6, 8, 12, 16] {
                if t > threads || (bytes / (chunk_kib << 10)) < t {
                    continue;
                }
                let config = StagingConfig {
                    chunk_bytes: chunk_kib << 10,
                    depth: 2,
                    threads: t,
                };
                let manager = TransferManager::with_staging(config)?;
                let up = gbps(best(runs, || {
                    manager
                        .transfer_with(
                            TransferMethod::HostStaged,
                            &host[..bytes],
                            Destination::device(&mut device, 0),
                        )
                        .map(drop)
                        .unwrap()
                }));
                let down = gbps(best(runs, || {
                    manager
                        .transfer_with(
                            TransferMethod::HostStaged,
                            Source::device(&device, 0, bytes),
                            &mut host[..bytes],
                        )
                        .map(drop)
                        .unwrap()
                }));
                if up > best_up.0 {
                    best_up = (up, config);
                }
                if down > best_down.0 {
                    best_down = (down, config);
                }
                println!("   {chunk_kib:>9} {t:>7} {up:>10.2} {down:>9.2}");
            }
        }
        let default = StagingConfig::for_size(bytes);
        let manager = TransferManager::new()?;
        let up = gbps(best(runs, || {
            manager
                .transfer_with(
                    TransferMethod::HostStaged,
                    &host[..bytes],
                    Destination::device(&mut device, 0),
                )
                .map(drop)
                .unwrap()
        }));
        println!(
            "   best h2d {:.2} GB/s at {:?}; best d2h {:.2} at {:?}; for_size {:?}: h2d {up:.2}",
            best_up.0, best_up.1, best_down.0, best_down.1, default
        );
    }
    // Host copy ceiling: threads copying disjoint parts with streaming stores.
    let bytes = largest.min(256 << 20);
    let mut other = vec![0u8; bytes];
    for t in [1usize, 2, 4, 8, 12, 16] {
        if t > threads {
            continue;
        }
        let d = best(3, || {
            let chunk = bytes.div_ceil(t);
            std::thread::scope(|s| {
                for (a, b) in other.chunks_mut(chunk).zip(host[..bytes].chunks(chunk)) {
                    s.spawn(move || copy_streaming(a, b).unwrap());
                }
            });
        });
        println!(
            "host copy_streaming, {t:>2} threads: {:.2} GB/s",
            bytes as f64 / d.as_secs_f64() / 1e9
        );
    }
    Ok(())
}
