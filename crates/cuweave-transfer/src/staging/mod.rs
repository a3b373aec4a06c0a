//! Pipelined staging: pageable host memory moved through pinned blocks of the
//! [`PinnedPool`], host copies overlapped with the copy engine ([`StagingConfig`]).
//!
//! # How a pageable upload runs
//! The source is cut into chunks of [`StagingConfig::chunk_bytes`]. Up to
//! [`StagingConfig::threads`] participants (the calling thread and workers of the process's
//! persistent staging pool, which is sized from the machine) claim chunks from a shared counter;
//! for each, a participant takes a pinned block (its own, once the copy engine has finished
//! with it, or one from the pool), copies the chunk in ([`HostCopy`]: streaming stores,
//! [`copy_streaming`], or a cached `memcpy`), and queues `cuMemcpyHtoDAsync` from the block on
//! its own stream of the transfer's *lane*.
//! Each participant keeps up to [`StagingConfig::depth`] blocks in flight, so while the copy
//! engine moves earlier chunks the participants fill the next ones: the transfer runs at the
//! slower of the host's aggregate copy bandwidth and the bus, instead of at the driver's own
//! staging speed (a pageable `cuMemcpyHtoD` copies through one small bounce buffer on one
//! thread). Downloads run the same pipeline backwards: queue copies into blocks, then copy each
//! finished block out.
//!
//! That is the *interleaved* order. Copies of [`ORDERED_FROM`] (512 KiB) or more run *ordered* by default
//! ([`ChunkOrder`], part of the configuration, so calibration can pick either): the chunks go
//! in order, one copy each with a [`StreamMarks`] mark behind it (a download's on the lane's
//! first stream; an upload's alternating between its first two, so two copy engines read host
//! memory), so they move one after another, and every participant copies pieces of them
//! (`ordered::upload_ordered`, `ordered::download_ordered`). An upload's chunk is filled by all
//! participants at once and queued by whichever completes it in order; a download's chunks are
//! queued by the caller and copied out by all. Waiting for a chunk is an atomic load of the mark
//! word.
//!
//! The destination (or, for downloads, the source) range is ordered once per stream for the
//! whole transfer, through the memory layer's `Buffer::staged_write` / `staged_read`: each lane
//! stream waits once for the uses the range conflicts with, the chunks are plain copies with no
//! use tracking and no shared lock, and the range's use is recorded once per stream at the end.
//! Concurrent transfers share the host threads (`workers::Workers::keeps`).
//!
//! A lane is a set of streams (one per participant) that one transfer holds alone: concurrent
//! transfers from different threads, to one device or in opposite directions, queue on
//! different streams and never wait behind each other's copies.
//!
//! The chunk size, participant count and host copy come per direction and size from the
//! calibration (or from [`StagingConfig::for_path`] until measured): mid-size copies use small
//! chunks so that every participant has work at once, large ones bigger chunks to amortise the
//! per-copy overhead.
//!
//! A transfer of at most one chunk takes a shortcut: one pinned block, no worker; an upload
//! copies it on the lane's first stream and watches that stream's completion word, a download
//! uses the memory layer's blocking copy into it.
//!
//! Blocks travel inside the memory layer's `PendingCopy`, which gives a block back only once
//! the stream has passed its copy, so no block is refilled, and no user memory read or written,
//! while the copy engine still uses it. If any step fails, every queued copy is waited for
//! before the error is returned.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cuweave_driver::Stream;
use cuweave_driver::memory::{CompletionWords, StreamMarks};
use cuweave_memory::buffer::PendingCopy;
use cuweave_memory::{Buffer, Element, PinnedPool, TypedPinnedBlock, copy_streaming};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TransferError};
use crate::workers;

mod in_order;
mod ordered;

/// Records a step in the diagnostic timeline (the `timeline` feature; nothing without it).
macro_rules! step {
    ($what:expr, $k:expr, $w:expr) => {
        #[cfg(feature = "timeline")]
        crate::timeline::mark($what, $k, $w);
    };
}
pub(crate) use step;

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
    #[serde(default)]
    pub order: ChunkOrder,
}

/// How the chunks of a pipelined copy reach the bus: one after another on one stream, or on
/// every participant's own stream.
///
/// Which one wins depends on the size and the host, so it is part of the calibrated
/// configuration. On the H100 host [`Ordered`](Self::Ordered) won clearly at 4-16 MiB in both
/// directions (uploads 27-28 against 22.6 GB/s at 4 MiB), while from 256 MiB the two were
/// within the host's run-to-run noise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ChunkOrder {
    /// Chunks go in order, one copy each with a progress mark behind it (on the lane's marked
    /// streams), while every participant copies pieces of them in or out
    /// (`Pipeline::upload_ordered` / `download_ordered`); at most [`ORDERED_MOST`] participants.
    /// Needs a lane with progress marks (else the copy runs interleaved).
    #[default]
    Ordered,
    /// Each participant copies whole chunks and queues them on its own stream of the lane, an
    /// event behind each.
    Interleaved,
}

impl ChunkOrder {
    /// Whether a pipelined copy of `bytes` in this order runs ordered (on a lane with progress
    /// marks): from [`ORDERED_FROM`] bytes, when the order is [`Ordered`](Self::Ordered).
    pub(crate) fn runs_ordered(self, bytes: usize) -> bool {
        bytes >= ORDERED_FROM && self == Self::Ordered
    }
}

/// How a participant copies a chunk between user memory and its pinned block.
///
/// Which one wins depends on the direction and on the host's last-level cache, so it is part of
/// the swept and calibrated configuration: on the H100 host (300 MiB of L3) large uploads ran at
/// 51 GB/s with [`Cached`](Self::Cached) stores, where the copy engine reads the chunk back from
/// the cache, against 43 GB/s with streaming stores, which send every chunk through DRAM first;
/// downloads, which write the caller's memory, are faster with [`Streaming`](Self::Streaming).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum HostCopy {
    /// Non-temporal stores ([`copy_streaming`]): the destination's lines are written without
    /// being read first and bypass the caches.
    #[default]
    Streaming,
    /// A plain `memcpy`: the destination's lines go through the caches.
    Cached,
}

impl HostCopy {
    /// Copies `src` into `dst` (equal lengths) this way; `CUWEAVE_STAGING_PLAIN_COPY` in the
    /// environment forces [`Cached`](Self::Cached) (for sweeps).
    pub(crate) fn copy<T: Element>(self, dst: &mut [T], src: &[T]) -> Result<()> {
        if self == Self::Cached || plain_copy() {
            dst.copy_from_slice(src);
        } else {
            copy_streaming(dst, src)?;
        }
        Ok(())
    }
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

/// Pipelined copies from this size run in their configuration's [`ChunkOrder`] (smaller ones
/// always interleaved). Until the nineteenth pass of issue 15 it was 3 MiB, between the swept
/// 1 MiB (interleaved) and 4 MiB (ordered) rows, from before the ordered pipelines existed: in
/// bench runs on the H100 host alternating the two thresholds (new, old, old, new; medians of
/// 24, as multiples of the plain call), ordering from 256 KiB ran 512 KiB uploads at 1.20 /
/// 1.11x against 0.88 / 0.97x, 2 MiB uploads at 21.6 / 22.4 GB/s against 17.9 / 16.3 and 2 MiB
/// downloads at 18.9 / 18.5 against 12.8 / 12.0, 768 KiB-1.5 MiB 1.3-2.4x against 1.1-1.8x;
/// at 384 KiB it measured 1.10 / 0.95x against 1.07 / 1.06x, so the order starts at 512 KiB,
/// the smallest measured size where it won.
pub const ORDERED_FROM: usize = 512 << 10;

/// Ordered uploads from this size alternate their chunks between the lane's two marked streams
/// and taper their last chunk (`ordered::taper_last`). Below it, with a handful of 1 MiB chunks,
/// both measured slower on the H100 host (4 MiB: 25.8 GB/s with them, 27.9 without; 8 MiB: 29.6
/// against 31.2, three runs each), from it faster (16 MiB: 34.8 against 32.9 on one stream and
/// 33.5 untapered; 256 MiB: 44.3 against 43.2 and 41.1); see docs/transfer.md.
pub const TWO_STREAMS_FROM: usize = 16 << 20;

/// The most participants an ordered pipeline uses: every chunk waits for all of its pieces (or,
/// downloading, for the one participant queueing), so one participant the scheduler stalls
/// stalls the whole transfer, and on the H100 host runs with more than eight scattered widely
/// (1 GiB uploads with 16: a median of 30 GB/s against a best of 40; with 8: 46-49).
pub const ORDERED_MOST: usize = 8;

/// The most participants a pipelined copy of `bytes` in `order` uses on this machine: the host
/// threads, and [`ORDERED_MOST`] when it runs ordered.
pub(crate) fn most_participants(bytes: usize, order: ChunkOrder) -> usize {
    let threads = host_threads();
    if order.runs_ordered(bytes) {
        threads.min(ORDERED_MOST)
    } else {
        threads
    }
}

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

/// The pieces of a pipelined copy: the pool blocks come from and the lane's streams, one per
/// participant.
pub(crate) struct Pipeline<'a> {
    pub(crate) pool: &'a PinnedPool,
    pub(crate) streams: &'a [Stream],
    /// Completion words for one-chunk uploads (else they synchronise the stream).
    pub(crate) completion: Option<&'a CompletionWords>,
    /// Progress marks of the first streams, one each, for ordered copies (without them every
    /// copy runs interleaved, an event per chunk on every participant's stream).
    pub(crate) marks: &'a [StreamMarks],
    pub(crate) config: StagingConfig,
}

impl Pipeline<'_> {
    fn participants(&self, chunks: usize) -> usize {
        self.config
            .workers(chunks)
            .min(self.streams.len())
            .min(workers::shared().participants())
            .max(1)
    }

    /// Copies `src` into `dst` at element `dst_offset` (range already checked), pipelined:
    /// from [`ORDERED_FROM`] bytes in the configuration's [`ChunkOrder`] when the lane has
    /// progress marks ([`upload_ordered`](Self::upload_ordered)), else on every participant's
    /// stream with an event per chunk.
    pub(crate) fn upload<T, B>(&self, src: &[T], dst: &mut B, dst_offset: usize) -> Result<()>
    where
        T: Element,
        B: Buffer<T> + Send + ?Sized,
    {
        let chunk = self.config.chunk_elements::<T>();
        if src.len() <= chunk {
            return upload_one(
                self.pool,
                &self.streams[0],
                self.completion,
                one_block_copy(self.config.host_copy, size_of_val(src)),
                src,
                dst,
                dst_offset,
            );
        }
        let outcome = match self.marks {
            [first, ..]
                if self.config.order.runs_ordered(size_of_val(src)) && !unordered_uploads() =>
            {
                // Chunks alternate between the marked streams from `TWO_STREAMS_FROM` (the
                // first alone with `CUWEAVE_STAGING_ONE_STREAM`, a tuning switch).
                let marks = if one_upload_stream() || size_of_val(src) < TWO_STREAMS_FROM {
                    std::slice::from_ref(first)
                } else {
                    self.marks
                };
                self.upload_ordered(marks, src, dst, dst_offset)
            }
            _ => self.upload_interleaved(src, dst, dst_offset),
        };
        // The workers stay hot from here, not from when they finished: the wait for the copy
        // engine to drain the last chunks is part of the transfer.
        workers::shared().extend_hot();
        outcome
    }

    /// An upload with every participant filling its own chunks and queueing them on its own
    /// stream, an event behind each: under [`ORDERED_FROM`], for [`ChunkOrder::Interleaved`],
    /// for lanes without progress marks (and `CUWEAVE_STAGING_UNORDERED_UPLOADS`).
    fn upload_interleaved<T, B>(&self, src: &[T], dst: &mut B, dst_offset: usize) -> Result<()>
    where
        T: Element,
        B: Buffer<T> + Send + ?Sized,
    {
        let chunk = self.config.chunk_elements::<T>();
        let participants = self.participants(src.len().div_ceil(chunk));
        let ranges = chunk_ranges(src.len(), chunk, participants, Ramp::First);
        let claims = Claims::new(ranges.len());
        let depth = self.config.depth.max(1);
        // The destination range is ordered once per stream and its write recorded once per
        // stream at the end (`Buffer::staged_write`); the chunks in between are plain copies.
        dst.staged_write(
            dst_offset,
            src.len(),
            &self.streams[..participants],
            |staged| {
                workers::shared().run(participants, |w| {
                    // Dropping this on an error path waits for every queued copy (PendingCopy's
                    // Drop). The participant's blocks form its ring: each is refilled once the
                    // copy engine has finished with it, with no pool round trip per chunk.
                    let mut in_flight: VecDeque<PendingCopy<TypedPinnedBlock<T>>> =
                        VecDeque::with_capacity(depth);
                    let mut spare: Option<TypedPinnedBlock<T>> = None;
                    let outcome = (|| {
                        while let Some(i) = claims.next_for(w) {
                            let start = ranges[i].start;
                            let piece = &src[ranges[i].clone()];
                            if in_flight.len() >= depth
                                && let Some(pending) = in_flight.pop_front()
                            {
                                spare = Some(pending.wait()?);
                            }
                            let mut block = block_of(self.pool, spare.take(), piece.len())?;
                            self.config.host_copy.copy(block.as_mut_slice(), piece)?;
                            in_flight.push_back(staged.copy_in(w, start, block)?);
                        }
                        for pending in in_flight.drain(..) {
                            drop(pending.wait()?);
                        }
                        Ok(())
                    })();
                    claims.settle(outcome)
                })
            },
        )?
    }

    /// Copies `src` elements from `src_offset` into `dst` (range already checked), pipelined:
    /// from [`ORDERED_FROM`] bytes in the configuration's [`ChunkOrder`] when the lane has
    /// progress marks ([`download_ordered`](Self::download_ordered)), else on every
    /// participant's stream with an event per chunk.
    pub(crate) fn download<T, B>(&self, src: &B, src_offset: usize, dst: &mut [T]) -> Result<()>
    where
        T: Element,
        B: Buffer<T> + Sync + ?Sized,
    {
        let chunk = self.config.chunk_elements::<T>();
        if dst.len() <= chunk {
            let host_copy = one_block_copy(self.config.host_copy, size_of_val(dst));
            return download_one(self.pool, host_copy, src, src_offset, dst);
        }
        let outcome = match self.marks {
            [marks, ..]
                if self.config.order.runs_ordered(size_of_val(dst)) && !unordered_downloads() =>
            {
                self.download_ordered(marks, src, src_offset, dst)
            }
            _ => self.download_interleaved(src, src_offset, dst),
        };
        workers::shared().extend_hot();
        outcome
    }

    /// A download with every participant queueing its own chunks on its own stream, an event
    /// behind each: under [`ORDERED_FROM`], for [`ChunkOrder::Interleaved`], for lanes without
    /// progress marks (and `CUWEAVE_STAGING_UNORDERED_DOWNLOADS`).
    fn download_interleaved<T, B>(&self, src: &B, src_offset: usize, dst: &mut [T]) -> Result<()>
    where
        T: Element,
        B: Buffer<T> + Sync + ?Sized,
    {
        let chunk = self.config.chunk_elements::<T>();
        let total = dst.len();
        let participants = self.participants(total.div_ceil(chunk));
        let ranges = chunk_ranges(total, chunk, participants, Ramp::Last);
        let pieces = split_pieces(dst, &ranges);
        let claims = Claims::new(pieces.len());
        let depth = self.config.depth.max(1);
        src.staged_read(src_offset, total, &self.streams[..participants], |staged| {
            workers::shared().run(participants, |w| {
                let mut in_flight: VecDeque<(PendingCopy<TypedPinnedBlock<T>>, usize)> =
                    VecDeque::with_capacity(depth);
                // A block copied out goes back to the pool, and each chunk lands in the pool's
                // coldest block (`PinnedPool::get_cold`): one this participant just read would
                // take the copy engine's writes at half speed.
                let drain = |pending: PendingCopy<TypedPinnedBlock<T>>, i: usize| -> Result<()> {
                    let block = pending.wait()?;
                    let out = pieces[i].lock().take().expect("each chunk is claimed once");
                    self.config.host_copy.copy(out, block.as_slice())
                };
                let outcome = (|| {
                    while let Some(i) = claims.next_for(w) {
                        if in_flight.len() >= depth
                            && let Some((pending, j)) = in_flight.pop_front()
                        {
                            drain(pending, j)?;
                        }
                        let range = ranges[i].clone();
                        let block = self.pool.get_typed_cold::<T>(range.len())?;
                        in_flight.push_back((staged.copy_out(w, range.start, block)?, i));
                    }
                    for (pending, j) in in_flight.drain(..) {
                        drain(pending, j)?;
                    }
                    Ok(())
                })();
                claims.settle(outcome)
            })
        })?
    }
}

/// `dst` cut at `ranges` (consecutive, covering it), each piece for the participant that claims
/// its chunk.
fn split_pieces<'d, T>(
    dst: &'d mut [T],
    ranges: &[std::ops::Range<usize>],
) -> Vec<Mutex<Option<&'d mut [T]>>> {
    let mut pieces = Vec::with_capacity(ranges.len());
    let mut rest = dst;
    for range in ranges {
        let (piece, tail) = rest.split_at_mut(range.len());
        pieces.push(Mutex::new(Some(piece)));
        rest = tail;
    }
    pieces
}

/// Where a pipelined copy's short chunks go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ramp {
    /// At the start (uploads): the copy engine waits for the first host copies, so the first
    /// chunk of each participant is short and the bus starts sooner.
    First,
    /// At the end (downloads): the last host copies wait for the copy engine, so the last chunk
    /// of each participant is short and the transfer ends sooner.
    Last,
}

/// The element ranges a pipelined copy of `total` elements is cut into: chunks of `chunk`,
/// except that when there is more than one chunk per participant, `participants` of them (at
/// the `ramp` end) are cut to a quarter, so the pipeline fills (or drains) four times faster.
/// `CUWEAVE_STAGING_NO_RAMP` turns the short chunks off (for measuring).
fn chunk_ranges(
    total: usize,
    chunk: usize,
    participants: usize,
    ramp: Ramp,
) -> Vec<std::ops::Range<usize>> {
    let chunk = chunk.max(1);
    let short = (chunk / 4).max(1);
    let ramped = if total.div_ceil(chunk) > participants && short < chunk && !no_ramp() {
        participants.min(total / short)
    } else {
        0
    };
    let mut lengths = vec![short; ramped];
    let mut left = total - ramped * short;
    while left > 0 {
        let len = chunk.min(left);
        lengths.push(len);
        left -= len;
    }
    if ramp == Ramp::Last {
        lengths.reverse();
    }
    let mut start = 0;
    lengths
        .into_iter()
        .map(|len| {
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

fn no_taper() -> bool {
    static NO_TAPER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&NO_TAPER, "CUWEAVE_STAGING_NO_TAPER")
}

fn no_ramp() -> bool {
    static NO_RAMP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&NO_RAMP, "CUWEAVE_STAGING_NO_RAMP")
}

fn unordered_downloads() -> bool {
    static UNORDERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&UNORDERED, "CUWEAVE_STAGING_UNORDERED_DOWNLOADS")
}

fn unordered_uploads() -> bool {
    static UNORDERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&UNORDERED, "CUWEAVE_STAGING_UNORDERED_UPLOADS")
}

fn one_upload_stream() -> bool {
    static ONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&ONE, "CUWEAVE_STAGING_ONE_STREAM")
}

fn plain_copy() -> bool {
    static PLAIN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&PLAIN, "CUWEAVE_STAGING_PLAIN_COPY")
}

/// Marks a transfer failed when dropped during a panic.
struct FailOnUnwind<'c>(&'c Claims);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.failed.store(true, Ordering::Relaxed);
        }
    }
}

/// Chunks handed out to participants one at a time; after a failure nobody claims more.
struct Claims {
    next: AtomicUsize,
    chunks: usize,
    failed: AtomicBool,
}

impl Claims {
    fn new(chunks: usize) -> Self {
        Self {
            next: AtomicUsize::new(0),
            chunks,
            failed: AtomicBool::new(false),
        }
    }

    /// The next chunk for participant `w`, unless the transfer failed or `w` is over its
    /// transfer's share of the host threads (`workers::Workers::keeps`).
    fn next_for(&self, w: usize) -> Option<usize> {
        if self.failed.load(Ordering::Relaxed) || !workers::shared().keeps(w) {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        (i < self.chunks).then_some(i)
    }

    fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    fn settle(&self, outcome: Result<()>) -> Result<()> {
        if outcome.is_err() {
            self.failed.store(true, Ordering::Relaxed);
        }
        outcome
    }
}

/// A download of one chunk: nothing to overlap, so no worker and no stream. The bytes come
/// through one pinned block with the memory layer's blocking copy, a direct DMA that returns once
/// it has landed (and settles the buffer's tracking without recording an event), then one host
/// copy out: for small downloads this beats the driver's own pageable path (measured on the
/// H100: 4 KiB in 84% of a plain `cuMemcpyDtoH`'s time, 64 KiB in 77%). Uploads of one chunk
/// take [`upload_one`] instead: there a blocking DMA from pinned memory measured slower than a
/// copy queued on a stream and that stream's synchronisation.
fn download_one<T, B>(
    pool: &PinnedPool,
    host_copy: HostCopy,
    src: &B,
    src_offset: usize,
    dst: &mut [T],
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + ?Sized,
{
    let mut block = pool.get_typed_cold::<T>(dst.len())?;
    src.copy_range_to_host(src_offset, block.as_mut_slice())?;
    host_copy.copy(dst, block.as_slice())
}

/// Up to this many bytes a one-block copy is latency, not bandwidth, and its host copy is a plain
/// `memcpy` whatever the configuration says. It was 128 KiB (exclusive) until the nineteenth
/// pass of issue 15: in bench runs on the H100 host alternating the two (new, old, old, new;
/// medians of 24), 96 KiB uploads with the configuration's streaming stores ran 1.12 / 1.08x
/// the plain call against 0.95 / 0.97x with `memcpy`, while 64 KiB kept 1.5-1.6x with `memcpy`.
const SMALL_BLOCK: usize = 64 << 10;

/// The host copy of a one-block transfer of `bytes`: the configuration's above [`SMALL_BLOCK`].
/// An upload's block filled with `memcpy` is dirty in the filling core's cache, and the copy
/// engine reads such lines slowly (docs/probes/upload.c, 512 KiB: 15.5 GB/s after `memcpy`, 27
/// after streaming stores), so the streaming stores calibration may choose matter here too.
fn one_block_copy(configured: HostCopy, bytes: usize) -> HostCopy {
    if bytes <= SMALL_BLOCK {
        HostCopy::Cached
    } else {
        configured
    }
}

/// An upload of one chunk: nothing to overlap, so no worker. The bytes go into one pinned
/// block and are copied on the pipeline's first stream, and the stream's completion word says
/// when they have landed (the memory layer's `copy_range_from_host_watched`, which records no
/// event; `cuStreamSynchronize` without words). The quickest way found to land a small upload
/// (`benches/benches/small_upload.rs`, H100, 4 KiB / 64 KiB of raw calls: pinned block and
/// completion word 7.0 / 14.8 µs, with `cuStreamSynchronize` 7.4–8.0 / 15.6–16.1 µs, with an
/// event 7.7–7.8 / 15.7–15.9 µs, `cuMemcpyHtoD` and the legacy stream's synchronisation
/// 7.6–8.5 / 17.7–19.1 µs).
fn upload_one<T, B>(
    pool: &PinnedPool,
    stream: &Stream,
    completion: Option<&CompletionWords>,
    host_copy: HostCopy,
    src: &[T],
    dst: &mut B,
    dst_offset: usize,
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + ?Sized,
{
    let mut block = pool.get_typed::<T>(src.len())?;
    host_copy.copy(block.as_mut_slice(), src)?;
    let block = match completion {
        Some(words) => dst.copy_range_from_host_watched(dst_offset, block, stream, words)?,
        None => dst.copy_range_from_host_on(dst_offset, block, stream)?,
    };
    drop(block);
    Ok(())
}

/// A block of exactly `len` elements: `reuse` if it has that length, else a fresh pool block.
fn block_of<T: Element>(
    pool: &PinnedPool,
    reuse: Option<TypedPinnedBlock<T>>,
    len: usize,
) -> Result<TypedPinnedBlock<T>> {
    match reuse {
        Some(block) if block.len() == len => Ok(block),
        _ => Ok(pool.get_typed::<T>(len)?),
    }
}

/// Copies `len` elements between buffers of two devices through pinned blocks: each chunk is
/// downloaded on `src_stream`, then uploaded on `dst_stream` while the next chunk downloads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bounce<T, D, S>(
    pool: &PinnedPool,
    config: StagingConfig,
    src: &S,
    src_offset: usize,
    src_stream: &Stream,
    dst: &mut D,
    dst_offset: usize,
    dst_stream: &Stream,
    len: usize,
) -> Result<()>
where
    T: Element,
    D: Buffer<T> + ?Sized,
    S: Buffer<T> + ?Sized,
{
    let chunk = config.chunk_elements::<T>();
    let depth = config.depth.max(1);
    let mut uploads: VecDeque<PendingCopy<TypedPinnedBlock<T>>> = VecDeque::with_capacity(depth);
    let mut done = 0;
    while done < len {
        let n = chunk.min(len - done);
        let reuse = if uploads.len() >= depth {
            uploads.pop_front().map(PendingCopy::wait).transpose()?
        } else {
            None
        };
        let block = block_of(pool, reuse, n)?;
        let block = src
            .copy_range_to_host_async(src_offset + done, block, src_stream)?
            .wait()?;
        uploads.push_back(dst.copy_range_from_host_async(dst_offset + done, block, dst_stream)?);
        done += n;
    }
    for pending in uploads {
        drop(pending.wait()?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[rstest::rstest]
    #[case::tiny(4 << 10, HostCopy::Cached)]
    #[case::at_the_bound(64 << 10, HostCopy::Cached)]
    #[case::just_past_it(64 << 10 | 1, HostCopy::Streaming)]
    #[case::between_64_and_128_kib(96 << 10, HostCopy::Streaming)]
    #[case::larger(1 << 20, HostCopy::Streaming)]
    fn one_block_copies_take_the_configured_host_copy_above_64_kib(
        #[case] bytes: usize,
        #[case] expected: HostCopy,
    ) {
        assert_eq!(one_block_copy(HostCopy::Streaming, bytes), expected);
        // A configuration that says `memcpy` gets it at every size.
        assert_eq!(one_block_copy(HostCopy::Cached, bytes), HostCopy::Cached);
    }

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

    #[rstest::rstest]
    #[case(16 << 20, 1 << 20, 8)]
    #[case(16 << 20, 1 << 20, 16)]
    #[case((4 << 20) + 7, 512 << 10, 6)]
    #[case(1000, 300, 2)]
    #[case(1000, 1, 3)]
    #[case(10, 3, 1)]
    fn chunk_ranges_cover_the_copy_once_with_short_chunks_at_the_ramp_end(
        #[case] total: usize,
        #[case] chunk: usize,
        #[case] participants: usize,
    ) {
        for ramp in [Ramp::First, Ramp::Last] {
            let ranges = chunk_ranges(total, chunk, participants, ramp);
            let mut next = 0;
            for range in &ranges {
                assert_eq!(range.start, next);
                assert!(!range.is_empty() && range.len() <= chunk);
                next = range.end;
            }
            assert_eq!(next, total);
            let waves = total.div_ceil(chunk) > participants;
            let short = ranges.iter().filter(|r| r.len() == chunk / 4).count();
            if waves && chunk >= 4 && !no_ramp() {
                assert!(short >= participants, "{ranges:?}");
                let at_ramp_end = match ramp {
                    Ramp::First => &ranges[..participants],
                    Ramp::Last => &ranges[ranges.len() - participants..],
                };
                assert!(at_ramp_end.iter().all(|r| r.len() == chunk / 4));
            } else if !waves {
                assert_eq!(ranges.len(), total.div_ceil(chunk));
            }
        }
    }

    #[test]
    fn a_participant_that_panics_marks_the_transfer_failed_and_one_that_returns_does_not() {
        let claims = Claims::new(4);
        {
            let _guard = FailOnUnwind(&claims);
        }
        assert!(!claims.has_failed());
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _guard = FailOnUnwind(&claims);
            panic!("a participant's bug");
        }));
        assert!(unwound.is_err());
        assert!(claims.has_failed());
        assert_eq!(claims.next_for(0), None);
    }

    #[test]
    fn both_host_copies_move_the_bytes_and_old_configurations_default_to_streaming() {
        let src: Vec<u32> = (0..10_000).collect();
        for way in [HostCopy::Streaming, HostCopy::Cached] {
            let mut dst = vec![0u32; src.len()];
            way.copy(&mut dst, &src).unwrap();
            assert_eq!(dst, src);
        }
        let old = r#"{"chunk_bytes":1048576,"depth":2,"threads":4}"#;
        let config: StagingConfig = serde_json::from_str(old).unwrap();
        assert_eq!(config.host_copy, HostCopy::Streaming);
        assert_eq!(config.order, ChunkOrder::Ordered);
        assert_eq!(config.chunk_bytes, 1 << 20);
    }
}
