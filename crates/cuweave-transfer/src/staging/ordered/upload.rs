//! The ordered upload: every participant fills pieces of each chunk's shared pinned block
//! ([`Filling`]), and the chunks go to the device in order, queued by whichever participant
//! completes the next one.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use cuweave_driver::memory::StreamMarks;
use cuweave_memory::buffer::MarkedCopy;
use cuweave_memory::parts::SharedParts;
use cuweave_memory::{Buffer, Element, TypedPinnedBlock};
use parking_lot::Mutex;

use super::{Backoff, Layout, STALLED};
use crate::error::Result;
use crate::staging::chunks::{Claims, FailOnUnwind, Ramp};
use crate::staging::in_order::InOrder;
use crate::staging::{Pipeline, block_of};
use crate::workers;

impl Pipeline<'_> {
    /// An upload whose chunks every participant fills in pieces, each chunk's pinned block
    /// shared as [`SharedParts`], and which go to the device in order, one copy per chunk with
    /// a progress mark behind it, queued by whichever participant completes the next chunk in
    /// order. Chunk k goes on marked stream `k % marks.len()`: with two, two copy engines read
    /// host memory at once, which kept the bus faster while the participants' own copies load
    /// the host's memory (H100 host: 1 GiB at 49.5-49.7 GB/s against 47.8-48.1 on one stream,
    /// 256 MiB 44.3 against 43.2 over three runs; see docs/transfer.md). The last chunk is cut
    /// into a half and two quarters ([`taper_last`]), so the bus's work after the last fill is
    /// short.
    ///
    /// The mirror of [`download_ordered`](Self::download_ordered): on the participants' own
    /// streams (the interleaved pipeline) each chunk waits for one thread's `memcpy` of it and
    /// the copy engine for the first wave of them, while here the first chunk is filled by every
    /// participant at once and the copy engine starts after a fraction of a chunk's host copy,
    /// then moves chunks back to back, each one large, so no per-copy gap caps the bus. Blocks
    /// are handed to chunks in order, at most `participants * depth` at a time; a chunk that
    /// needs one when all are out takes the oldest queued chunk's, once its mark has passed.
    /// Chunks are queued through [`InOrder`], by whichever participant completes the next one.
    ///
    /// [`taper_last`]: super::taper_last
    pub(in crate::staging) fn upload_ordered<T, B>(
        &self,
        marks: &[StreamMarks],
        src: &[T],
        dst: &mut B,
        dst_offset: usize,
    ) -> Result<()>
    where
        T: Element,
        B: Buffer<T> + Send + ?Sized,
    {
        let total = src.len();
        crate::staging::step!("start", 0, 0);
        // One short chunk at the start: the copy engine starts after a quarter chunk's fill.
        let Layout {
            participants,
            ranges,
            pieces,
            ring,
        } = self.ordered_layout::<T>(total, Ramp::First);
        let claims = Claims::new(pieces.ranges.len());
        let chunks: Vec<Filling<T>> = (0..ranges.len()).map(|_| Filling::new()).collect();
        // Chunks that have had a block (blocks go to chunks in order), and blocks out of the pool.
        let assigned = AtomicUsize::new(0);
        let blocks_out = AtomicUsize::new(0);
        let in_order = InOrder::default();
        let filled = |k: usize| {
            k < ranges.len() && chunks[k].filled.load(Ordering::SeqCst) == pieces.in_chunk(k)
        };
        crate::staging::step!("laid out", 0, 0);
        let lanes = marks.len().clamp(1, self.streams.len());
        dst.staged_write(dst_offset, total, &self.streams[..lanes], |staged| {
            crate::staging::step!("staged", 0, 0);
            let queued: Mutex<VecDeque<MarkedCopy<'_, TypedPinnedBlock<T>>>> =
                Mutex::new(VecDeque::with_capacity(ring));
            // Chunk k's block, shared by the participants filling its pieces: the first one to
            // need it takes one, after every earlier chunk has had its own, while the others spin
            // (no lock is held while a block is waited for: parked waiters woken one by one
            // would stall every participant behind the bus); `None` when the transfer failed.
            let block_for = |k: usize| -> Result<Option<Arc<BlockParts<T>>>> {
                let filling = &chunks[k];
                let mut backoff = Backoff::default();
                if filling.taker.swap(true, Ordering::AcqRel) {
                    loop {
                        if let Some(parts) = &*filling.parts.lock() {
                            return Ok(Some(Arc::clone(parts)));
                        }
                        if claims.has_failed() {
                            return Ok(None);
                        }
                        backoff.snooze();
                    }
                }
                let started = Instant::now();
                let block = loop {
                    if claims.has_failed() {
                        return Ok(None);
                    }
                    if assigned.load(Ordering::Acquire) == k {
                        if blocks_out.load(Ordering::Acquire) < ring {
                            blocks_out.fetch_add(1, Ordering::AcqRel);
                            break None;
                        }
                        // The oldest queued chunk's block once its mark has passed: atomic loads
                        // until then, no driver call (see `STALLED`).
                        let oldest = {
                            let mut queued = queued.lock();
                            let landed = queued.front().is_some_and(|copy| {
                                copy.is_complete() || started.elapsed() >= STALLED
                            });
                            if landed { queued.pop_front() } else { None }
                        };
                        if let Some(copy) = oldest {
                            crate::staging::step!("reuse", k, 0);
                            break Some(copy.wait()?);
                        }
                    }
                    backoff.snooze();
                };
                let block = block_of(self.pool, block, ranges[k].len())?;
                let parts = Arc::new(SharedParts::new(block, pieces.piece_of[k]));
                *filling.parts.lock() = Some(Arc::clone(&parts));
                crate::staging::step!("block", k, 0);
                assigned.store(k + 1, Ordering::Release);
                Ok(Some(parts))
            };
            // Queues chunk k: its block, no longer shared (every participant dropped its handle
            // before counting its piece), as one copy with a mark behind it.
            let queue = |k: usize| -> Result<()> {
                let parts = chunks[k].parts.lock().take();
                let parts = parts.expect("a filled chunk has its block");
                let block = Arc::into_inner(parts)
                    .expect("a filled chunk's block is no longer shared")
                    .into_inner();
                crate::staging::step!("queue", k, 0);
                let copy =
                    staged.copy_in_marked(k % lanes, ranges[k].start, block, &marks[k % lanes])?;
                crate::staging::step!("queued", k, 0);
                queued.lock().push_back(copy);
                Ok(())
            };
            crate::staging::step!("run", 0, 0);
            let outcome = workers::shared().run(participants, |w| {
                let _unwinding = FailOnUnwind(&claims);
                crate::staging::step!("join", 0, w);
                let outcome = (|| {
                    while let Some(q) = claims.next_for(w) {
                        let k = pieces.chunk_of[q];
                        let Some(parts) = block_for(k)? else {
                            return Ok(());
                        };
                        let range = pieces.ranges[q].clone();
                        let index = (range.start - ranges[k].start) / pieces.piece_of[k];
                        let into = parts.take(index).expect("each piece is claimed once");
                        let copied = self.config.host_copy.copy(into, &src[range]);
                        drop(parts);
                        copied?;
                        // The participant that fills a chunk's last piece has made it ready.
                        let done = chunks[k].filled.fetch_add(1, Ordering::SeqCst) + 1;
                        if done == pieces.in_chunk(k) {
                            crate::staging::step!("filled", k, w);
                            in_order.drain(filled, queue)?;
                        }
                    }
                    Ok(())
                })();
                crate::staging::step!("leave", 0, w);
                claims.settle(outcome)
            });
            crate::staging::step!("all queued", 0, 0);
            // Every chunk is queued (or the transfer failed): the upload is done when the last
            // has landed; the blocks go back to the pool then (on failure, as each copy drops).
            let mut landed = Ok(());
            for copy in queued.into_inner() {
                // The workers stay hot while the copy engine drains the ring: the next transfer
                // may start as soon as this one returns.
                workers::shared().extend_hot();
                if let Err(error) = copy.wait()
                    && landed.is_ok()
                {
                    landed = Err(error.into());
                }
            }
            crate::staging::step!("landed", 0, 0);
            outcome.and(landed)
        })?
    }
}

/// A pinned block whose pieces several participants fill at once.
type BlockParts<T> = SharedParts<TypedPinnedBlock<T>, T>;

/// A chunk of an ordered upload being filled: its block, shared while participants write its
/// pieces, and how many pieces are written.
struct Filling<T: Element> {
    parts: Mutex<Option<Arc<BlockParts<T>>>>,
    /// Whether a participant has set out to take the chunk's block.
    taker: AtomicBool,
    filled: AtomicUsize,
}

impl<T: Element> Filling<T> {
    fn new() -> Self {
        Self {
            parts: Mutex::new(None),
            taker: AtomicBool::new(false),
            filled: AtomicUsize::new(0),
        }
    }
}
