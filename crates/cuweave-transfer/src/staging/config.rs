//! [`StagingConfig`]: how one pipelined copy is cut up and how many host threads feed it, its
//! bounds, and the defaults per direction and size from the staging sweep.

use serde::{Deserialize, Serialize};

use super::{ChunkOrder, HostCopy};
use crate::error::{Result, TransferError};
use crate::workers;

/// How one pipelined copy is cut up and how many host threads feed it.
///
/// The manager picks one per direction and size from its calibration
/// ([`for_path`](Self::for_path) until one is measured);
/// [`TransferManager::with_staging`](crate::TransferManager::with_staging) fixes one for every
/// size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagingConfig {
    /// Bytes per chunk (rounded down to whole elements; at least one element).
    pub chunk_bytes: usize,
    /// Pinned blocks each participant keeps in flight.
    pub depth: usize,
    /// Host threads copying between user memory and pinned blocks (the caller included; at most
    /// one per chunk, and at most the staging pool's workers plus the caller).
    pub threads: usize,
    /// How the host side of each chunk is copied.
    #[serde(default)]
    pub host_copy: HostCopy,
    /// How the chunks of a copy of [`ORDERED_FROM`] bytes or more reach the bus (smaller copies
    /// always run [`Interleaved`](ChunkOrder::Interleaved)).
    ///
    /// [`ORDERED_FROM`]: crate::ORDERED_FROM
    #[serde(default)]
    pub order: ChunkOrder,
}

/// The smallest chunk a [`StagingConfig`] may name: one page. Smaller chunks only multiply the
/// driver calls (a 1 GiB copy in 1-byte chunks would queue 2^30 of them).
pub const MIN_CHUNK_BYTES: usize = 4 << 10;

/// The largest chunk a [`StagingConfig`] may name: each participant pins `depth` blocks of it.
pub const MAX_CHUNK_BYTES: usize = 1 << 30;

/// The most pinned blocks a [`StagingConfig`] may keep in flight per participant.
pub const MAX_DEPTH: usize = 64;

impl StagingConfig {
    /// Checks that the configuration can run: a chunk of [`MIN_CHUNK_BYTES`] to
    /// [`MAX_CHUNK_BYTES`], a depth of 1 to [`MAX_DEPTH`], and 1 to [`MAX_WORKERS`] + 1 host
    /// threads (the staging pool's most workers and the caller). Every configuration the manager
    /// measures or ships passes; one given to
    /// [`with_staging`](crate::TransferManager::with_staging) or read from a calibration file
    /// is checked with it.
    ///
    /// # Errors
    /// [`TransferError::InvalidStaging`] naming the first bound it breaks.
    ///
    /// [`MAX_WORKERS`]: crate::MAX_WORKERS
    pub fn validate(&self) -> Result<()> {
        let reason = if !(MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES).contains(&self.chunk_bytes) {
            "chunk_bytes must be 4 KiB to 1 GiB"
        } else if !(1..=MAX_DEPTH).contains(&self.depth) {
            "depth must be 1 to 64"
        } else if !(1..=workers::MAX_WORKERS + 1).contains(&self.threads) {
            "threads must be 1 to MAX_WORKERS + 1"
        } else {
            return Ok(());
        };
        Err(TransferError::InvalidStaging {
            config: *self,
            reason,
        })
    }

    /// The chunk length in elements of `T`.
    pub fn chunk_elements<T>(&self) -> usize {
        (self.chunk_bytes / size_of::<T>().max(1)).max(1)
    }

    /// Whether a copy of `bytes` runs as one block in this configuration (its chunk holds the
    /// whole copy): on the calling thread, whatever the participants, depth and order.
    pub(crate) fn runs_as_one_block(&self, bytes: usize) -> bool {
        self.chunk_bytes >= bytes
    }

    /// How many participants a transfer of `chunks` chunks uses.
    pub fn workers(&self, chunks: usize) -> usize {
        self.threads.max(1).min(chunks.max(1))
    }

    /// Pinned bytes one transfer may hold at once: `threads * depth * chunk_bytes`.
    pub fn staging_bytes(&self) -> usize {
        self.threads
            .max(1)
            .saturating_mul(self.depth.max(1))
            .saturating_mul(self.chunk_bytes)
    }

    /// The configuration an upload (pageable host to device, and the peer bounce) of `bytes`
    /// uses until calibration measured one: the fastest of the staging sweep on the H100 host
    /// (16 host threads; see `docs/transfer.md`) at the nearest swept size, with no more
    /// participants than this machine has host threads.
    pub fn for_upload(bytes: usize) -> Self {
        Self::nearest(&SWEPT_UPLOADS, bytes)
    }

    /// The configuration a download (device to pageable host) of `bytes` uses until calibration
    /// measured one; as [`for_upload`](Self::for_upload), from the sweep's downloads.
    pub fn for_download(bytes: usize) -> Self {
        Self::nearest(&SWEPT_DOWNLOADS, bytes)
    }

    /// The default for a pipelined copy of `bytes` on `path`: [`for_download`](Self::for_download)
    /// when the pipeline writes pageable host memory, [`for_upload`](Self::for_upload) otherwise
    /// (uploads, and the peer bounce, whose chunks are uploaded from the blocks they were
    /// downloaded into).
    pub fn for_path(path: crate::TransferPath, bytes: usize) -> Self {
        if path.dst == crate::LocationKind::Pageable {
            Self::for_download(bytes)
        } else {
            Self::for_upload(bytes)
        }
    }

    fn nearest(swept: &[Swept], bytes: usize) -> Self {
        let ratio = |at: usize| crate::calibration::size_distance(at, bytes);
        let row = swept
            .iter()
            .min_by(|a, b| ratio(a.bytes).total_cmp(&ratio(b.bytes)))
            .expect("the sweep has rows");
        Self {
            chunk_bytes: row.chunk_bytes,
            depth: row.depth,
            threads: row.threads.min(host_threads()).max(1),
            host_copy: row.host_copy,
            order: row.order,
        }
    }
}

/// One row of the staging sweep: at `bytes`, the fastest chunk size, participant count, host
/// copy, chunk order and blocks in flight per participant.
struct Swept {
    bytes: usize,
    chunk_bytes: usize,
    threads: usize,
    host_copy: HostCopy,
    order: ChunkOrder,
    depth: usize,
}

/// A row of the staging sweep that ran ordered with two blocks per participant.
const fn swept(bytes: usize, chunk_bytes: usize, threads: usize, host_copy: HostCopy) -> Swept {
    Swept {
        bytes,
        chunk_bytes,
        threads,
        host_copy,
        order: ChunkOrder::Ordered,
        depth: 2,
    }
}

impl Swept {
    /// The same row with `depth` blocks per participant.
    const fn with_depth(self, depth: usize) -> Swept {
        Swept { depth, ..self }
    }
}

/// The fastest pageable uploads of the staging sweep on the H100 host
/// (`examples/staging_sweep.rs`, `examples/upload_timeline.rs`; see `docs/transfer.md`): at
/// 1 MiB the interleaved pipeline's (issue 15, run 3, before the ordered pipeline existed; run
/// ordered since [`ORDERED_FROM`] moved to 512 KiB), from 4 MiB the ordered pipeline's
/// (`upload_ordered`). Mid sizes want few
/// participants on 1-4 MiB chunks, since each chunk is filled by all of them and the copy
/// engine reads host memory more slowly the harder the host's threads load it
/// (`docs/probes/ce.c`); large uploads copy with cached stores into a 32 MiB ring (one 4 MiB
/// block per participant) that stays in the 300 MiB L3, where the copy engine reads it back.
/// The fourteenth pass, with resident workers, re-measured 16 MiB-1 GiB (four rounds of each
/// configuration on each of three leases, the median of the twelve rounds' medians): 64 MiB
/// 4 MiB x 5 at 42.5 GB/s against 42.3 for 2 MiB x 8, 256 MiB ordered 4 MiB x 8 cached at 49.4
/// against 45.2 interleaved (2 MiB x 12), 16 MiB 2 MiB x 4 at 37.1 against 38.3 for x 6
/// (kept); at 1 GiB ordered 4 MiB x 8 cached and interleaved 4 MiB x 12 were within the noise
/// (50.8 against 51.5 on one lease, 51.4 / 52.0 against 50.8 / 50.8 in the bench on another),
/// as were both directions at once beside it. Where two rows were within the noise, the one
/// with fewer participants, which leaves host threads to concurrent transfers, except where a
/// slow lease separated them: at 64 MiB the sixteenth pass found 2 MiB x 8 at 32.2-38.4 GB/s
/// against 27.4-29.9 for 4 MiB x 5 (three alternating rounds of a median of 9, on a lease whose
/// 1 GiB uploads ran 34-37; the staging sweep there, best of 7: 41.0 against 31.7), so 64 MiB
/// takes 2 MiB x 8, which had tied with 4 MiB x 5 on the calm leases.
///
/// [`ORDERED_FROM`]: crate::ORDERED_FROM
const SWEPT_UPLOADS: [Swept; 6] = [
    swept(1 << 20, 256 << 10, 2, HostCopy::Streaming),
    swept(4 << 20, 1 << 20, 4, HostCopy::Streaming),
    swept(16 << 20, 2 << 20, 6, HostCopy::Streaming),
    swept(64 << 20, 2 << 20, 8, HostCopy::Streaming),
    swept(256 << 20, 4 << 20, 8, HostCopy::Cached).with_depth(1),
    swept(1 << 30, 4 << 20, 8, HostCopy::Cached).with_depth(1),
];

/// The fastest pageable downloads of the staging sweep on the H100 host: at 1 MiB the
/// interleaved pipeline's (run 3), from 4 MiB the ordered pipeline's (`download_ordered`;
/// issue 15, fourth pass): chunks on one stream, so the queuing thread stays ahead of the bus.
/// From 64 MiB, 4 MiB chunks on eight participants (sixteenth pass): on a lease with slow host
/// memory the 1 GiB download ran 51.6-51.9 GB/s in three rounds of three, where the earlier
/// 8 MiB x 6 ran 21-40 and 8 MiB x 8 22-52; beside a 1 GiB upload both directions ran 43-49
/// against 35-38, and on two calmer leases 65-71 against 54-70 (the download's own rate steady
/// at 43 against 27-47). Alone on the calm leases the two were within 2 %: 1 GiB 52.0 against
/// 53.1-53.3, 256 MiB 50.7-51.0 against 51.6-52.0, 64 MiB 47.2-48.0 against 45.2-46.7. At
/// 4 MiB, 1 MiB chunks with streaming stores (sixteenth pass): 21.3-24.1 GB/s against 17.0-19.1
/// for 512 KiB x 4 cached, four alternating rounds of a median of 51 (the sweep before it: 29.2
/// against 23.2, best of 7). From 64 MiB one block per participant (a 32 MiB ring; seventeenth
/// pass): alone the same speed as two (1 GiB 52.1-52.2 GB/s against 51.8-51.9, 256 MiB 50.4-51.2
/// against 45.4-51.0 in three alternating bench runs), beside a 1 GiB upload both directions
/// ran 79.5 / 71.8 / 76.7 against 67.9 / 67.4 / 75.6 in those runs, but level (72.4 / 74.2 /
/// 49.1 against 68.4 / 70.8 / 55.3) once the order of the builds was balanced: as fast, with
/// half the pinned memory.
const SWEPT_DOWNLOADS: [Swept; 6] = [
    swept(1 << 20, 256 << 10, 2, HostCopy::Cached),
    swept(4 << 20, 1 << 20, 4, HostCopy::Streaming),
    swept(16 << 20, 2 << 20, 6, HostCopy::Cached),
    swept(64 << 20, 4 << 20, 8, HostCopy::Streaming).with_depth(1),
    swept(256 << 20, 4 << 20, 8, HostCopy::Streaming).with_depth(1),
    swept(1 << 30, 4 << 20, 8, HostCopy::Streaming).with_depth(1),
];

/// Logical host threads this process may run on: what the staging pool is sized from.
pub fn host_threads() -> usize {
    workers::host_threads()
}

impl Default for StagingConfig {
    /// The configuration for a 1 GiB upload on this machine ([`for_upload`](Self::for_upload)).
    fn default() -> Self {
        Self::for_upload(1 << 30)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_whole_elements_and_workers_never_exceed_chunks() {
        let config = StagingConfig {
            chunk_bytes: 10,
            depth: 2,
            threads: 8,
            host_copy: HostCopy::Streaming,
            order: ChunkOrder::Ordered,
        };
        assert_eq!(config.chunk_elements::<u32>(), 2);
        assert_eq!(config.chunk_elements::<[u8; 64]>(), 1);
        assert_eq!(config.workers(3), 3);
        assert_eq!(config.workers(0), 1);
        assert_eq!(config.workers(100), 8);
        let default = StagingConfig::default();
        assert_eq!(
            default.staging_bytes(),
            default.threads * default.depth * default.chunk_bytes
        );
    }

    #[test]
    fn sizes_get_the_swept_configuration_capped_by_the_machine() {
        type ForSize = fn(usize) -> StagingConfig;
        let tables: [(&[Swept], ForSize); 2] = [
            (&SWEPT_UPLOADS, StagingConfig::for_upload),
            (&SWEPT_DOWNLOADS, StagingConfig::for_download),
        ];
        for (swept, for_size) in tables {
            for row in swept {
                let bytes = row.bytes;
                for probe in [bytes, bytes + bytes / 4, bytes - bytes / 4] {
                    let config = for_size(probe);
                    assert_eq!(config.chunk_bytes, row.chunk_bytes, "{probe}");
                    assert_eq!(config.threads, row.threads.min(host_threads()));
                    assert_eq!(config.host_copy, row.host_copy);
                    assert_eq!(config.order, row.order);
                    assert_eq!(config.depth, row.depth);
                }
            }
            assert_eq!(for_size(0).chunk_bytes, swept[0].chunk_bytes);
            assert_eq!(
                for_size(64 << 30).chunk_bytes,
                swept[swept.len() - 1].chunk_bytes
            );
            // Larger transfers never get smaller chunks, and a chunk never exceeds the size it
            // was swept at.
            let mut last = 0;
            for shift in 10..=34 {
                let chunk = for_size(1 << shift).chunk_bytes;
                assert!(chunk >= last);
                last = chunk;
            }
            for row in swept {
                assert!(row.chunk_bytes < row.bytes);
            }
        }
    }
}
