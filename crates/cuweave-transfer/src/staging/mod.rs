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
//!
//! [`copy_streaming`]: cuweave_memory::copy_streaming

use cuweave_driver::Stream;
use cuweave_driver::memory::{CompletionWords, StreamMarks};
use cuweave_memory::{Buffer, Element, PinnedPool, TypedPinnedBlock};

use crate::error::Result;
use crate::workers;

mod bounce;
mod chunks;
mod config;
mod host_copy;
mod in_order;
mod interleaved;
mod one_block;
mod order;
mod ordered;
mod switches;

pub(crate) use bounce::bounce;
pub use config::{MAX_CHUNK_BYTES, MAX_DEPTH, MIN_CHUNK_BYTES, StagingConfig, host_threads};
pub use host_copy::HostCopy;
use one_block::{download_one, one_block_copy, upload_one};
pub(crate) use order::most_participants;
pub use order::{ChunkOrder, ORDERED_FROM, ORDERED_MOST, TWO_STREAMS_FROM};
use switches::{one_upload_stream, unordered_downloads, unordered_uploads};

/// Records a step in the diagnostic timeline (the `timeline` feature; nothing without it).
macro_rules! step {
    ($what:expr, $k:expr, $w:expr) => {
        #[cfg(feature = "timeline")]
        crate::timeline::mark($what, $k, $w);
    };
}
pub(crate) use step;

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
