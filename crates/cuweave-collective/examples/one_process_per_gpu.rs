//! One process per GPU, the NCCL unique id handed over through a file.
//!
//! ```sh
//! cargo run --release -p cuweave-collective --example one_process_per_gpu            # every GPU
//! cargo run --release -p cuweave-collective --example one_process_per_gpu -- 2       # two ranks
//! ```
//!
//! The launcher (no arguments but the rank count) starts one copy of itself per rank with
//! `--rank R --ranks N --id-file PATH`. Rank 0 makes the id and writes it as hex to a temporary
//! name, then renames it into place (so a reader never sees half an id); the other ranks wait
//! for the file. Across hosts, put the file on a shared filesystem or send the hex over TCP. Each
//! rank then all-reduces a buffer of `rank + 1` and checks that every element is
//! `N (N + 1) / 2`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cuweave_collective::{CommConfig, Communicator, ReduceOp, UniqueId};
use cuweave_driver::{Device, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(at) = args.iter().position(|a| a == "--rank") {
        let rank: usize = args[at + 1].parse()?;
        let ranks: usize = value(&args, "--ranks")?.parse()?;
        let id_file = PathBuf::from(value(&args, "--id-file")?);
        return run_rank(rank, ranks, &id_file);
    }
    let ranks = match args.first() {
        Some(n) => n.parse()?,
        None => Device::count()?,
    };
    let id_file = std::env::temp_dir().join(format!("cuweave-nccl-id-{}", std::process::id()));
    let exe = std::env::current_exe()?;
    let children: Vec<_> = (0..ranks)
        .map(|rank| {
            Command::new(&exe)
                .args(["--rank", &rank.to_string(), "--ranks", &ranks.to_string()])
                .arg("--id-file")
                .arg(&id_file)
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut failed = 0;
    for mut child in children {
        if !child.wait()?.success() {
            failed += 1;
        }
    }
    let _ = std::fs::remove_file(&id_file);
    if failed > 0 {
        return Err(format!("{failed} of {ranks} ranks failed").into());
    }
    println!("all {ranks} ranks agree");
    Ok(())
}

fn value<'a>(args: &'a [String], flag: &str) -> Result<&'a String, String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|at| args.get(at + 1))
        .ok_or_else(|| format!("missing {flag}"))
}

fn run_rank(rank: usize, ranks: usize, id_file: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let id = if rank == 0 {
        let id = UniqueId::new()?;
        let partial = id_file.with_extension("partial");
        std::fs::write(&partial, id.to_hex())?;
        std::fs::rename(&partial, id_file)?;
        id
    } else {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(text) = std::fs::read_to_string(id_file) {
                break UniqueId::from_hex(&text)?;
            }
            if Instant::now() > deadline {
                return Err("rank 0 never wrote the id".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let device = Device::get(rank % Device::count()?)?;
    let config = CommConfig::default().with_timeout(Duration::from_secs(60));
    let comm = Communicator::init_rank(ranks, rank, &id, device, &config)?;
    let stream = Stream::new(comm.context(), StreamFlags::NON_BLOCKING)?;
    let mut values =
        DeviceBuffer::<f32>::from_slice(comm.context(), &vec![(rank + 1) as f32; 1 << 20])?;
    comm.all_reduce_in_place(&mut values, ReduceOp::Sum, &stream)?;
    comm.synchronize(&stream)?;
    let expected = (ranks * (ranks + 1) / 2) as f32;
    let got = values.to_vec()?;
    if got.iter().any(|&x| x != expected) {
        return Err(format!("rank {rank}: expected {expected}, got {}", got[0]).into());
    }
    println!(
        "rank {rank} of {ranks} on device {}: all_reduce = {expected}",
        device.ordinal()
    );
    Ok(())
}
