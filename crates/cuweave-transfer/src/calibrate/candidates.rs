//! The staging configurations calibration tries at each size ([`staging_candidates`]).

use crate::location::TransferPath;
use crate::staging::{ChunkOrder, StagingConfig};

/// The largest size whose calibration also tries a single block of the whole size.
const ONE_BLOCK_MOST: usize = 1 << 20;

/// The staging configurations tried for `path` at `bytes`: the default
/// ([`StagingConfig::for_path`]) with half, the same and double its chunk, each with half, the
/// same and double its participants (at most this machine's host threads, and at most
/// [`ORDERED_MOST`](crate::ORDERED_MOST) ordered), then the default with the other
/// [`HostCopy`](crate::HostCopy) (which one wins depends on the host's cache), and, for sizes
/// that run ordered, the other [`ChunkOrder`]: beside an ordered default the
/// [`Interleaved`](ChunkOrder::Interleaved) one with its participants and half as many again,
/// beside an interleaved default the ordered one with as many participants as it takes and two
/// thirds of that, and on chunks twice as large (which order wins depends on the size and the
/// host); up to 1 MiB, one block of the whole size with each host copy.
pub fn staging_candidates(path: TransferPath, bytes: usize) -> Vec<StagingConfig> {
    let base = StagingConfig::for_path(path, bytes);
    let most = crate::staging::most_participants(bytes, base.order);
    let mut out = Vec::new();
    for chunk in [base.chunk_bytes / 2, base.chunk_bytes, base.chunk_bytes * 2] {
        if chunk < (64 << 10) || chunk >= bytes {
            continue;
        }
        for threads in [base.threads.div_ceil(2), base.threads, base.threads * 2] {
            let config = StagingConfig {
                chunk_bytes: chunk,
                threads: threads.clamp(1, most),
                ..base
            };
            if !out.contains(&config) {
                out.push(config);
            }
        }
    }
    if out.is_empty() {
        out.push(base);
    }
    // The other host copy at the default (or, when the default's chunk does not fit the size,
    // at the first candidate).
    let pivot = if out.contains(&base) { base } else { out[0] };
    let other = StagingConfig {
        host_copy: match pivot.host_copy {
            crate::HostCopy::Streaming => crate::HostCopy::Cached,
            crate::HostCopy::Cached => crate::HostCopy::Streaming,
        },
        ..pivot
    };
    out.push(other);
    // Small sizes also try one block of the whole size (no pipeline, no worker), with each host
    // copy: at 256 KiB on the H100 host it matched the plain call where two chunks lost to it.
    if bytes <= ONE_BLOCK_MOST {
        for host_copy in [crate::HostCopy::Streaming, crate::HostCopy::Cached] {
            // A chunk of at least the whole size runs as one block already.
            if !out
                .iter()
                .any(|c| c.runs_as_one_block(bytes) && c.host_copy == host_copy)
            {
                out.push(StagingConfig {
                    chunk_bytes: bytes,
                    threads: 1,
                    host_copy,
                    ..base
                });
            }
        }
    }
    // At sizes that can run ordered, the other chunk order too: beside an ordered default the
    // interleaved pipeline with its participants and half as many again; beside an interleaved
    // one the ordered pipeline with as many as it takes and two thirds of that, and with as many
    // on chunks twice as large (all participants fill each ordered chunk, so it wants larger
    // ones: at 256 MiB on the H100 host, 4 MiB x 8 ordered ran 49.2-49.9 GB/s against 46.3-46.8
    // for the interleaved default on a calm lease, and less steadily on a disturbed one).
    let (order, tried): (ChunkOrder, Vec<(usize, usize)>) = if pivot.order.runs_ordered(bytes) {
        let all = crate::staging::most_participants(bytes, ChunkOrder::Interleaved);
        let more = pivot.threads + pivot.threads / 2;
        let tried = [pivot.threads, more].map(|t| (pivot.chunk_bytes, t.clamp(1, all)));
        (ChunkOrder::Interleaved, tried.into())
    } else if ChunkOrder::Ordered.runs_ordered(bytes) {
        let most = crate::staging::most_participants(bytes, ChunkOrder::Ordered);
        let threads = pivot.threads.clamp(1, most);
        let mut tried = vec![
            (pivot.chunk_bytes, threads),
            (pivot.chunk_bytes, (threads * 2).div_ceil(3)),
        ];
        if pivot.chunk_bytes * 2 < bytes {
            tried.push((pivot.chunk_bytes * 2, threads));
        }
        (ChunkOrder::Ordered, tried)
    } else {
        (pivot.order, Vec::new())
    };
    for (chunk_bytes, threads) in tried {
        let config = StagingConfig {
            order,
            chunk_bytes,
            threads,
            ..pivot
        };
        if !out.contains(&config) {
            out.push(config);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::CALIBRATION_SIZES;

    #[test]
    fn staging_candidates_are_distinct_and_fit_the_size() {
        for (&bytes, path) in CALIBRATION_SIZES.iter().flat_map(|b| {
            [
                TransferPath::PAGEABLE_TO_DEVICE,
                TransferPath::DEVICE_TO_PAGEABLE,
            ]
            .map(|p| (b, p))
        }) {
            let candidates = staging_candidates(path, bytes);
            assert!(candidates.len() >= 2);
            let kinds = |k| candidates.iter().filter(|c| c.host_copy == k).count();
            assert!(kinds(crate::HostCopy::Streaming) >= 1 && kinds(crate::HostCopy::Cached) >= 1);
            for (i, c) in candidates.iter().enumerate() {
                assert!(c.chunk_bytes > 0 && c.threads > 0 && c.depth > 0);
                assert!(!candidates[..i].contains(c));
                if c.order.runs_ordered(bytes) {
                    assert!(c.threads <= crate::staging::ORDERED_MOST, "{c:?}");
                }
            }
            // Small sizes measure one block of the whole size, with both host copies.
            let one_block = |k| {
                candidates
                    .iter()
                    .filter(|c| c.runs_as_one_block(bytes) && c.host_copy == k)
                    .count()
            };
            for k in [crate::HostCopy::Streaming, crate::HostCopy::Cached] {
                assert_eq!(
                    one_block(k),
                    usize::from(bytes <= ONE_BLOCK_MOST),
                    "{bytes} {k:?}"
                );
            }
            // From the ordered sizes both orders are measured.
            let orders = |o| candidates.iter().filter(|c| c.order == o).count();
            if bytes >= crate::staging::ORDERED_FROM {
                assert!(orders(ChunkOrder::Ordered) >= 1 && orders(ChunkOrder::Interleaved) >= 1);
            }
            // Beside an interleaved default that could run ordered, the ordered pipeline is also
            // tried on chunks twice the default's.
            let base = StagingConfig::for_path(path, bytes);
            if base.order == ChunkOrder::Interleaved
                && ChunkOrder::Ordered.runs_ordered(bytes)
                && base.chunk_bytes * 2 < bytes
            {
                assert!(
                    candidates.iter().any(|c| c.order == ChunkOrder::Ordered
                        && c.chunk_bytes == base.chunk_bytes * 2
                        && c.host_copy == base.host_copy),
                    "{bytes} {path:?}: {candidates:?}"
                );
            }
        }
    }
}
