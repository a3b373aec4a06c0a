//! Interleaved pipelines: every participant copies whole chunks and queues them on its own
//! stream of the lane, an event behind each.

use std::collections::VecDeque;

use cuweave_memory::buffer::PendingCopy;
use cuweave_memory::{Buffer, Element, TypedPinnedBlock};

use super::chunks::{Claims, Ramp, chunk_ranges, split_pieces};
use super::{Pipeline, block_of};
use crate::error::Result;
use crate::workers;

impl Pipeline<'_> {
    /// An upload with every participant filling its own chunks and queueing them on its own
    /// stream, an event behind each: under [`ORDERED_FROM`], for [`ChunkOrder::Interleaved`],
    /// for lanes without progress marks (and `CUWEAVE_STAGING_UNORDERED_UPLOADS`).
    ///
    /// [`ORDERED_FROM`]: crate::ORDERED_FROM
    /// [`ChunkOrder::Interleaved`]: crate::ChunkOrder::Interleaved
    pub(super) fn upload_interleaved<T, B>(
        &self,
        src: &[T],
        dst: &mut B,
        dst_offset: usize,
    ) -> Result<()>
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

    /// A download with every participant queueing its own chunks on its own stream, an event
    /// behind each: under [`ORDERED_FROM`], for [`ChunkOrder::Interleaved`], for lanes without
    /// progress marks (and `CUWEAVE_STAGING_UNORDERED_DOWNLOADS`).
    ///
    /// [`ORDERED_FROM`]: crate::ORDERED_FROM
    /// [`ChunkOrder::Interleaved`]: crate::ChunkOrder::Interleaved
    pub(super) fn download_interleaved<T, B>(
        &self,
        src: &B,
        src_offset: usize,
        dst: &mut [T],
    ) -> Result<()>
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
