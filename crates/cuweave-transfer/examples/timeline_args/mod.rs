//! What the timeline examples (`upload_timeline`, `download_timeline`) share: the driver check,
//! their numeric arguments, and `TIMELINE_CONFIG`'s format.

use cuweave_transfer::{ChunkOrder, HostCopy, StagingConfig};

/// The example's numeric arguments, in order (others skipped), or `None` (after saying so) when
/// no CUDA driver is loaded.
pub fn numbers() -> Option<Vec<usize>> {
    if !cuweave_driver::is_available() {
        println!("no CUDA driver: nothing to time");
        return None;
    }
    Some(
        std::env::args()
            .skip(1)
            .filter_map(|a| a.parse().ok())
            .collect(),
    )
}

/// One `TIMELINE_CONFIG` entry, `chunk_kib,depth,threads,cached|streaming[,interleaved|ordered]`:
/// each field missing or unreadable is `default`'s.
pub fn staging(config: &str, default: StagingConfig) -> StagingConfig {
    let parts: Vec<&str> = config.split(',').collect();
    let number = |i: usize| parts.get(i).and_then(|p| p.parse::<usize>().ok());
    StagingConfig {
        chunk_bytes: number(0).map_or(default.chunk_bytes, |kib| kib << 10),
        depth: number(1).unwrap_or(default.depth),
        threads: number(2).unwrap_or(default.threads),
        host_copy: match parts.get(3) {
            Some(&"cached") => HostCopy::Cached,
            Some(&"streaming") => HostCopy::Streaming,
            _ => default.host_copy,
        },
        order: match parts.get(4) {
            Some(&"interleaved") => ChunkOrder::Interleaved,
            Some(&"ordered") => ChunkOrder::Ordered,
            _ => default.order,
        },
    }
}
