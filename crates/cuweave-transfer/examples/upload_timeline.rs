//! Prints the staging pipeline's timeline of a pageable upload (the `timeline` feature): when
//! each participant joined, when each chunk got its block, was filled, queued and its block
//! reused, for the median of several uploads, beside the pinned copy of the same size.
//!
//! `cargo run --release -p cuweave-transfer --features timeline --example upload_timeline [MiB] [runs] [gap_us]`
//! (defaults 64, 15, 0: `gap_us` sleeps between uploads, so the workers have parked).
//! `TIMELINE_CONFIG=chunk_kib,depth,threads,cached|streaming[,interleaved]` fixes the staging
//! configuration (an interleaved upload records no steps).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cuweave_driver::{Context, Device};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer};
use cuweave_transfer::{
    ChunkOrder, Destination, HostCopy, StagingConfig, TransferManager, TransferMethod, timeline,
};

mod timeline_args;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(args) = timeline_args::numbers() else {
        return Ok(());
    };
    let bytes = args.first().copied().unwrap_or(64) << 20;
    let runs = args.get(1).copied().unwrap_or(15).max(1);
    let gap = Duration::from_micros(args.get(2).copied().unwrap_or(0) as u64);
    let context = Context::primary(Device::get(0)?)?;
    // TIMELINE_CONFIG fixes the staging configuration; its missing fields are 2 MiB x 8,
    // depth 2.
    let manager = match std::env::var("TIMELINE_CONFIG") {
        Ok(config) => {
            let fields = StagingConfig {
                chunk_bytes: 2048 << 10,
                depth: 2,
                threads: 8,
                host_copy: HostCopy::Streaming,
                order: ChunkOrder::Ordered,
            };
            let config = timeline_args::staging(&config, fields);
            println!("staging {config:?}");
            TransferManager::with_staging(config)?
        }
        Err(_) => TransferManager::new()?,
    };
    let host = vec![3u8; bytes];
    let mut device = DeviceBuffer::<u8>::new(&context, bytes)?;
    let pinned = PinnedBuffer::<u8>::zeroed(&context, bytes)?;
    let mut pinned_times = Vec::new();
    for _ in 0..7 {
        let start = Instant::now();
        device.copy_range_from_host(0, &pinned.as_slice().unwrap())?;
        pinned_times.push(start.elapsed());
    }
    pinned_times.sort_unstable();
    let gbps = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
    println!(
        "{} MiB: pinned copy {:.1} GB/s",
        bytes >> 20,
        gbps(pinned_times[3])
    );
    let mut timed = Vec::new();
    for run in 0..=runs {
        std::thread::sleep(gap);
        timeline::take();
        let start = Instant::now();
        manager.transfer_with(
            TransferMethod::HostStaged,
            &host[..],
            Destination::device(&mut device, 0),
        )?;
        let end = Instant::now();
        if run > 0 {
            timed.push((end - start, start, end, timeline::take()));
        }
    }
    let mut order: Vec<usize> = (0..timed.len()).collect();
    order.sort_by_key(|&i| timed[i].0);
    let speeds: Vec<String> = order
        .iter()
        .map(|&i| format!("{:.1}", gbps(timed[i].0)))
        .collect();
    println!("runs, fastest first (GB/s): {}", speeds.join(" "));
    // How long after the caller's first step the last participant joined, per run.
    let mut lags: Vec<f64> = timed
        .iter()
        .filter_map(|(_, start, _, events)| {
            let last = events.iter().filter(|e| e.1 == "join").map(|e| e.0).max()?;
            Some((last - *start).as_secs_f64() * 1e6)
        })
        .collect();
    lags.sort_by(f64::total_cmp);
    let lags: Vec<String> = lags.iter().map(|l| format!("{l:.0}")).collect();
    println!(
        "last participant joined (µs after the call), per run: {}",
        lags.join(" ")
    );
    // The runs whose last participant joined late (after 300 µs): who joined when.
    for (_, start, _, events) in &timed {
        let joins: Vec<(usize, f64)> = events
            .iter()
            .filter(|e| e.1 == "join")
            .map(|e| (e.3, (e.0 - *start).as_secs_f64() * 1e6))
            .collect();
        if joins.iter().any(|j| j.1 > 300.0) {
            let list: Vec<String> = joins.iter().map(|(w, t)| format!("{w}@{t:.0}")).collect();
            println!("late join: {}", list.join(" "));
        }
    }
    let (elapsed, start, end, events) = &timed[order[order.len() / 2]];
    let at = |t: Instant| (t - *start).as_secs_f64() * 1e6;
    println!(
        "median run {:.1} GB/s, {:.0} µs; times in µs from the call",
        gbps(*elapsed),
        elapsed.as_secs_f64() * 1e6
    );
    let mut chunks: BTreeMap<usize, BTreeMap<&str, f64>> = BTreeMap::new();
    let mut joins = Vec::new();
    let mut leaves = Vec::new();
    for &(t, what, k, w) in events {
        match what {
            "join" => joins.push((w, at(t))),
            "leave" => leaves.push((w, at(t))),
            "start" | "laid out" | "staged" | "run" | "all queued" | "landed" => {
                println!("  {what:<10} {:8.1}", at(t))
            }
            _ => {
                chunks.entry(k).or_default().insert(what, at(t));
            }
        }
    }
    joins.sort_by(|a, b| a.1.total_cmp(&b.1));
    leaves.sort_by(|a, b| a.1.total_cmp(&b.1));
    let list = |v: &[(usize, f64)]| {
        v.iter()
            .map(|(w, t)| format!("{w}@{t:.1}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!("  joined: {}", list(&joins));
    println!("  left:   {}", list(&leaves));
    println!("  return     {:8.1}", at(*end));
    println!("  chunk    block    reuse   filled    queue   queued");
    let show = |m: &BTreeMap<&str, f64>, key: &str| {
        m.get(key)
            .map_or("       -".to_owned(), |t| format!("{t:8.1}"))
    };
    for (k, m) in &chunks {
        println!(
            "  {k:5} {} {} {} {} {}",
            show(m, "block"),
            show(m, "reuse"),
            show(m, "filled"),
            show(m, "queue"),
            show(m, "queued")
        );
    }
    Ok(())
}
