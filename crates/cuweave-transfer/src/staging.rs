//! Pipelined staging: pageable host memory moved through pinned blocks of the
//! [`PinnedPool`], host copies overlapped with the copy engine ([`StagingConfig`]).
//!
//! # How a pageable upload runs
//! The source is cut into chunks of [`StagingConfig::chunk_bytes`]. Worker `w` of
//! [`StagingConfig::threads`] takes chunks `w, w + threads, …`; for each it takes a pinned
//! block (its own, once the copy engine has finished with it, or a new one from the pool),
//! `memcpy`s the chunk in on the CPU, and queues `cuMemcpyHtoDAsync` from the block on its own
//! stream. Each worker keeps up to [`StagingConfig::depth`] blocks in flight, so while the copy
//! engine moves earlier chunks the workers fill the next ones: the transfer runs at the slower
//! of the host's aggregate `memcpy` bandwidth and the bus, instead of at the driver's own
//! staging speed (a pageable `cuMemcpyHtoD` copies through one small bounce buffer on one
//! thread). Downloads run the same pipeline backwards: queue copies into blocks, then copy each
//! finished block out to the destination with streaming (non-temporal) stores
//! ([`copy_streaming`]), which write the caller's memory without first reading every line of it:
//! on the H100 host ordinary copies capped downloads near 46 GB/s, streaming ones reach 114 GB/s
//! over 12 threads, above the copy engine's 54.
//!
//! A transfer of at most one chunk takes a shortcut: one pinned block, no worker thread; an
//! upload copies it on the pipeline's first stream and watches that stream's completion word, a
//! download uses the memory layer's blocking copy into it.
//!
//! Blocks travel inside the memory layer's `PendingCopy`, which gives a block back only once
//! the stream has passed its copy, so no block is refilled, and no user memory read or written,
//! while the copy engine still uses it. If any step fails, every queued copy is waited for
//! before the error is returned.

use std::collections::VecDeque;

use cuweave_driver::Stream;
use cuweave_driver::memory::CompletionWords;
use cuweave_memory::buffer::PendingCopy;
use cuweave_memory::{Buffer, Element, PinnedPool, TypedPinnedBlock, copy_streaming};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TransferError};

/// How pipelined copies are cut up and how many host threads feed them.
///
/// The defaults come from a sweep on the H100 machine (16 cores, PCIe Gen5); see
/// `docs/transfer.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagingConfig {
    /// Bytes per chunk (rounded down to whole elements; at least one element).
    pub chunk_bytes: usize,
    /// Pinned blocks each worker keeps in flight.
    pub depth: usize,
    /// Host threads copying between user memory and pinned blocks (at most one per chunk).
    pub threads: usize,
}

impl StagingConfig {
    /// The chunk length in elements of `T`.
    pub fn chunk_elements<T>(&self) -> usize {
        (self.chunk_bytes / size_of::<T>().max(1)).max(1)
    }

    /// How many workers a transfer of `chunks` chunks uses.
    pub fn workers(&self, chunks: usize) -> usize {
        self.threads.max(1).min(chunks.max(1))
    }

    /// Pinned bytes one transfer may hold at once: `threads * depth * chunk_bytes`.
    pub fn staging_bytes(&self) -> usize {
        self.threads.max(1) * self.depth.max(1) * self.chunk_bytes
    }
}

impl Default for StagingConfig {
    fn default() -> Self {
        Self {
            chunk_bytes: 4 << 20,
            depth: 2,
            threads: 12,
        }
    }
}

/// The pieces of a pipelined copy: the pool blocks come from and one stream per worker.
pub(crate) struct Pipeline<'a> {
    pub(crate) pool: &'a PinnedPool,
    pub(crate) streams: &'a [Stream],
    /// Completion words for one-chunk uploads (else they synchronise the stream).
    pub(crate) completion: Option<&'a CompletionWords>,
    pub(crate) config: StagingConfig,
}

impl Pipeline<'_> {
    fn workers(&self, chunks: usize) -> usize {
        self.config.workers(chunks).min(self.streams.len()).max(1)
    }

    /// Copies `src` into `dst` at element `dst_offset` (range already checked), pipelined.
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
                src,
                dst,
                dst_offset,
            );
        }
        let pieces: Vec<(usize, &[T])> = src
            .chunks(chunk)
            .enumerate()
            .map(|(i, piece)| (dst_offset + i * chunk, piece))
            .collect();
        let workers = self.workers(pieces.len());
        let dst = Mutex::new(dst);
        let depth = self.config.depth.max(1);
        run_workers(workers, |w| {
            let mine = pieces.iter().skip(w).step_by(workers).copied();
            upload_worker(self.pool, &self.streams[w], depth, mine, &dst)
        })
    }

    /// Copies `src` elements from `src_offset` into `dst` (range already checked), pipelined.
    pub(crate) fn download<T, B>(&self, src: &B, src_offset: usize, dst: &mut [T]) -> Result<()>
    where
        T: Element,
        B: Buffer<T> + Sync + ?Sized,
    {
        let chunk = self.config.chunk_elements::<T>();
        if dst.len() <= chunk {
            return download_one(self.pool, src, src_offset, dst);
        }
        let workers = self.workers(dst.len().div_ceil(chunk));
        let mut shares: Vec<Vec<(usize, &mut [T])>> = (0..workers).map(|_| Vec::new()).collect();
        for (i, piece) in dst.chunks_mut(chunk).enumerate() {
            shares[i % workers].push((src_offset + i * chunk, piece));
        }
        let shares: Vec<Mutex<Share<'_, T>>> = shares.into_iter().map(Mutex::new).collect();
        let depth = self.config.depth.max(1);
        run_workers(workers, |w| {
            let mine = std::mem::take(&mut *shares[w].lock());
            download_worker(self.pool, &self.streams[w], depth, mine, src)
        })
    }
}

/// A download of one chunk: nothing to overlap, so no worker and no stream. The bytes come
/// through one pinned block with the memory layer's blocking copy, a direct DMA that returns once
/// it has landed (and settles the buffer's tracking without recording an event), then one host
/// copy out: for small downloads this beats the driver's own pageable path (measured on the
/// H100: 4 KiB in 84% of a plain `cuMemcpyDtoH`'s time, 64 KiB in 77%). Uploads of one chunk
/// take [`upload_one`] instead: there a blocking DMA from pinned memory measured slower than a
/// copy queued on a stream and that stream's synchronisation.
fn download_one<T, B>(pool: &PinnedPool, src: &B, src_offset: usize, dst: &mut [T]) -> Result<()>
where
    T: Element,
    B: Buffer<T> + ?Sized,
{
    let mut block = pool.get_typed::<T>(dst.len())?;
    src.copy_range_to_host(src_offset, block.as_mut_slice())?;
    dst.copy_from_slice(block.as_slice());
    Ok(())
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
    src: &[T],
    dst: &mut B,
    dst_offset: usize,
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + ?Sized,
{
    let mut block = pool.get_typed::<T>(src.len())?;
    block.as_mut_slice().copy_from_slice(src);
    let block = match completion {
        Some(words) => dst.copy_range_from_host_watched(dst_offset, block, stream, words)?,
        None => dst.copy_range_from_host_on(dst_offset, block, stream)?,
    };
    drop(block);
    Ok(())
}

/// One download worker's chunks: (element offset in the source, destination piece).
type Share<'a, T> = Vec<(usize, &'a mut [T])>;

/// Runs `work(0..workers)` on scoped threads (the first on this thread) and returns the first
/// error. Every worker waits for its own queued copies before it returns, even on error.
fn run_workers(workers: usize, work: impl Fn(usize) -> Result<()> + Sync) -> Result<()> {
    if workers == 1 {
        return work(0);
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = (1..workers)
            .map(|w| {
                let work = &work;
                scope.spawn(move || work(w))
            })
            .collect();
        let mut outcome = work(0);
        for handle in handles {
            let joined = handle.join().unwrap_or(Err(TransferError::WorkerPanicked));
            if outcome.is_ok() {
                outcome = joined;
            }
        }
        outcome
    })
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

fn upload_worker<'a, T, B>(
    pool: &PinnedPool,
    stream: &Stream,
    depth: usize,
    pieces: impl Iterator<Item = (usize, &'a [T])>,
    dst: &Mutex<&mut B>,
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + ?Sized,
{
    // Dropping this on an error path waits for every queued copy (PendingCopy's Drop).
    let mut in_flight: VecDeque<PendingCopy<TypedPinnedBlock<T>>> = VecDeque::with_capacity(depth);
    for (offset, piece) in pieces {
        let reuse = if in_flight.len() >= depth {
            in_flight.pop_front().map(PendingCopy::wait).transpose()?
        } else {
            None
        };
        let mut block = block_of(pool, reuse, piece.len())?;
        block.as_mut_slice().copy_from_slice(piece);
        // The lock covers only queueing the copy (microseconds), never a wait.
        let pending = dst
            .lock()
            .copy_range_from_host_async(offset, block, stream)?;
        in_flight.push_back(pending);
    }
    for pending in in_flight {
        drop(pending.wait()?);
    }
    Ok(())
}

fn download_worker<T, B>(
    pool: &PinnedPool,
    stream: &Stream,
    depth: usize,
    pieces: Vec<(usize, &mut [T])>,
    src: &B,
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + ?Sized,
{
    let mut in_flight: VecDeque<(PendingCopy<TypedPinnedBlock<T>>, &mut [T])> =
        VecDeque::with_capacity(depth);
    let mut spare: Option<TypedPinnedBlock<T>> = None;
    for (offset, piece) in pieces {
        if in_flight.len() >= depth
            && let Some((pending, out)) = in_flight.pop_front()
        {
            let block = pending.wait()?;
            copy_streaming(out, block.as_slice())?;
            spare = Some(block);
        }
        let block = block_of(pool, spare.take(), piece.len())?;
        let pending = src.copy_range_to_host_async(offset, block, stream)?;
        in_flight.push_back((pending, piece));
    }
    for (pending, out) in in_flight {
        let block = pending.wait()?;
        copy_streaming(out, block.as_slice())?;
    }
    Ok(())
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

    #[test]
    fn chunks_are_whole_elements_and_workers_never_exceed_chunks() {
        let config = StagingConfig {
            chunk_bytes: 10,
            depth: 2,
            threads: 8,
        };
        assert_eq!(config.chunk_elements::<u32>(), 2);
        assert_eq!(config.chunk_elements::<[u8; 64]>(), 1);
        assert_eq!(config.workers(3), 3);
        assert_eq!(config.workers(0), 1);
        assert_eq!(config.workers(100), 8);
        assert_eq!(StagingConfig::default().staging_bytes(), 12 * 2 * (4 << 20));
    }
}
