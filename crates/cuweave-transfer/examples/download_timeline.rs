//! Prints, for each of several pageable downloads (the `timeline` feature), who took part and
//! when: each participant's join, pieces copied out and leave, and how long the queuing
//! participant spent getting blocks, for telling a participant that never came from a slow
//! copy or a block that was slow to get.
//!
//! `cargo run --release -p cuweave-transfer --features timeline --example download_timeline [MiB] [runs]`
//! (defaults 1024, 5). Without `TIMELINE_CONFIG` the download default for the size
//! (`StagingConfig::for_download`) runs. `TIMELINE_CONFIG=chunk_kib,depth,threads,cached|streaming`
//! fixes the staging configuration (ordered; missing fields from that default), as in
//! `upload_timeline`; several, separated by `;`, run in turn, round after round.

use std::collections::BTreeMap;
use std::time::Instant;

use cuweave_driver::{Context, Device};
use cuweave_memory::DeviceBuffer;
use cuweave_transfer::{
    ChunkOrder, Source, StagingConfig, TransferManager, TransferMethod, timeline,
};

mod timeline_args;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(args) = timeline_args::numbers() else {
        return Ok(());
    };
    let bytes = args.first().copied().unwrap_or(1024) << 20;
    let runs = args.get(1).copied().unwrap_or(5).max(1);
    let context = Context::primary(Device::get(0)?)?;
    // Without TIMELINE_CONFIG, and for its missing fields, the download default for the size
    // (`StagingConfig::for_download`); downloads run ordered here.
    let default = StagingConfig::for_download(bytes);
    let ordered = |config| StagingConfig {
        order: ChunkOrder::Ordered,
        ..config
    };
    let configs: Vec<StagingConfig> = match std::env::var("TIMELINE_CONFIG") {
        Ok(configs) => configs
            .split(';')
            .map(|config| ordered(timeline_args::staging(config, default)))
            .collect(),
        Err(_) => vec![ordered(default)],
    };
    let managers: Vec<TransferManager> = configs
        .iter()
        .map(|&c| TransferManager::with_staging(c))
        .collect::<Result<_, _>>()?;
    let mut host = vec![3u8; bytes];
    let device = DeviceBuffer::<u8>::zeroed(&context, bytes)?;
    for round in 0..=runs {
        for (config, manager) in configs.iter().zip(&managers) {
            timeline::take();
            let start = Instant::now();
            manager.transfer_with(
                TransferMethod::HostStaged,
                Source::device(&device, 0, bytes),
                &mut host[..],
            )?;
            let elapsed = start.elapsed();
            let events = timeline::take();
            if round == 0 {
                continue;
            }
            let at = |t: Instant| (t - start).as_secs_f64() * 1e3;
            // Per participant: join, pieces, leave (ms after the call).
            let mut who: BTreeMap<usize, (f64, usize, f64)> = BTreeMap::new();
            let mut block_wait = 0.0;
            let mut asked = None;
            for &(t, what, _k, w) in &events {
                match what {
                    "join" => who.entry(w).or_default().0 = at(t),
                    "piece" => who.entry(w).or_default().1 += 1,
                    "leave" => who.entry(w).or_default().2 = at(t),
                    "block" => asked = Some(t),
                    "queue" => {
                        if let Some(a) = asked.take() {
                            block_wait += (t - a).as_secs_f64() * 1e3;
                        }
                    }
                    _ => {}
                }
            }
            let list: Vec<String> = who
                .iter()
                .map(|(w, (join, pieces, leave))| format!("{w}:{join:.2}/{pieces}/{leave:.2}"))
                .collect();
            println!(
                "x{} {} KiB: {:.1} GB/s in {:.2} ms; blocks {:.2} ms; w:join/pieces/leave {}",
                config.threads,
                config.chunk_bytes >> 10,
                bytes as f64 / elapsed.as_secs_f64() / 1e9,
                elapsed.as_secs_f64() * 1e3,
                block_wait,
                list.join(" ")
            );
        }
    }
    Ok(())
}
