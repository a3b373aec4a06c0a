//! The ordered download: chunks queued in order on the lane's first stream, each landed chunk
//! copied out in pieces by every participant ([`ChunkSlot`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use cuweave_driver::memory::{Mark, StreamMarks};
use cuweave_memory::buffer::MarkedCopy;
use cuweave_memory::{Buffer, Element, TypedPinnedBlock};
use parking_lot::Mutex;

use super::{Backoff, Layout, Pieces, STALLED};
use crate::error::Result;
use crate::staging::Pipeline;
use crate::staging::chunks::{Claims, FailOnUnwind, Ramp, split_pieces};
use crate::workers;

impl Pipeline<'_> {
    /// A download whose chunks are queued by one participant, in order, on the lane's first
    /// stream, each with a progress mark behind it, while every participant (the queuing one
    /// too, whenever it waits for a block, and once all is queued) copies landed chunks out in
    /// pieces.
    ///
    /// Chunks queued on one stream land one after another at the bus's speed, so the first is
    /// ready after one chunk's bus time and the copies out overlap the bus from there on (on
    /// the participants' own streams, the interleaved pipeline, the copy engine serves every
    /// stream's first chunk at once and none lands before most of them have). The chunks stay
    /// large, so one thread queues them faster than the bus moves them (a copy and a mark cost
    /// the queuing thread a few microseconds each), while each landed chunk is copied out in
    /// [`piece_elements`] pieces claimed by all participants, so the last chunk's copy out is
    /// shared too and the download ends a piece's copy after the bus. Waiting is an atomic load
    /// of the marks' word: no `cuEventRecord` per chunk, and no waiting thread inside the driver
    /// while the queuing one calls it. At most `participants * depth` blocks are in flight.
    ///
    /// [`piece_elements`]: super::piece_elements
    pub(in crate::staging) fn download_ordered<T, B>(
        &self,
        marks: &StreamMarks,
        src: &B,
        src_offset: usize,
        dst: &mut [T],
    ) -> Result<()>
    where
        T: Element,
        B: Buffer<T> + Sync + ?Sized,
    {
        let total = dst.len();
        // One short chunk at the end: the bus time the last pieces wait for is cut to a quarter.
        let Layout {
            participants,
            ranges,
            pieces,
            ring,
        } = self.ordered_layout::<T>(total, Ramp::Last);
        let Pieces {
            chunk_of,
            ranges: piece_ranges,
            ..
        } = &pieces;
        let outs = split_pieces(dst, piece_ranges);
        let pieces_in = |k: usize| pieces.in_chunk(k);
        let claims = Claims::new(piece_ranges.len());
        let slots: Vec<ChunkSlot<'_, T>> = (0..ranges.len()).map(|_| ChunkSlot::new()).collect();
        let copied: Vec<AtomicUsize> = (0..ranges.len()).map(|_| AtomicUsize::new(0)).collect();
        // Chunks queued and not yet copied out: the blocks in use.
        let in_flight = AtomicUsize::new(0);
        // Copies piece q out once its chunk has landed; `false` when the transfer failed first.
        // `_w`, the participant copying, is only recorded (the `timeline` feature).
        let copy_piece = |q: usize, _w: usize| -> Result<bool> {
            let k = chunk_of[q];
            let Some(block) = slots[k].landed(marks, &claims)? else {
                return Ok(false);
            };
            let within =
                piece_ranges[q].start - ranges[k].start..piece_ranges[q].end - ranges[k].start;
            let out = outs[q].lock().take().expect("each piece is claimed once");
            let copied_out = self.config.host_copy.copy(out, &block.as_slice()[within]);
            drop(block);
            copied_out?;
            crate::staging::step!("piece", k, _w);
            // The participant that copies a chunk's last piece out gives its block back to the
            // pool (every other one has dropped its handle on the block by then). Not to this
            // transfer: the block's lines are in the copying cores' caches, and a download into
            // it now would run at half speed (`PinnedPool::get_cold`).
            if copied[k].fetch_add(1, Ordering::AcqRel) + 1 == pieces_in(k) {
                let slot = std::mem::replace(&mut *slots[k].state.lock(), Slot::Empty);
                drop(slot);
                in_flight.fetch_sub(1, Ordering::AcqRel);
            }
            Ok(true)
        };
        src.staged_read(src_offset, total, &self.streams[..1], |staged| {
            workers::shared().run(participants, |w| {
                // A participant that panics (a bug) marks the transfer failed as it unwinds, so
                // the queuing one does not wait forever for the blocks of its pieces.
                let _unwinding = FailOnUnwind(&claims);
                crate::staging::step!("join", 0, w);
                let outcome = (|| {
                    // A piece this participant claimed before its chunk was queued.
                    let mut owed = None;
                    if w == 0 {
                        for (k, range) in ranges.iter().enumerate() {
                            let mut backoff = Backoff::default();
                            loop {
                                if claims.has_failed() {
                                    return Ok(());
                                }
                                if in_flight.load(Ordering::Acquire) < ring {
                                    break;
                                }
                                // Every block is in flight: copy a piece out meanwhile (one this
                                // participant claims; one of a chunk not queued yet is owed until
                                // it is). Chunks below `k` are all queued, so whoever claimed
                                // their pieces frees their blocks.
                                match owed {
                                    Some(q) if chunk_of[q] < k => {
                                        owed = None;
                                        copy_piece(q, w)?;
                                    }
                                    Some(_) => backoff.snooze(),
                                    None => match claims.next_for(w) {
                                        Some(q) => owed = Some(q),
                                        None => backoff.snooze(),
                                    },
                                }
                            }
                            crate::staging::step!("block", k, 0);
                            let block = self.pool.get_typed_cold::<T>(range.len())?;
                            crate::staging::step!("queue", k, 0);
                            let copy = staged.copy_out_marked(0, range.start, block, marks)?;
                            in_flight.fetch_add(1, Ordering::AcqRel);
                            slots[k].queue(copy);
                            crate::staging::step!("queued", k, 0);
                        }
                    }
                    if let Some(q) = owed
                        && !copy_piece(q, w)?
                    {
                        return Ok(());
                    }
                    while let Some(q) = claims.next_for(w) {
                        if !copy_piece(q, w)? {
                            break;
                        }
                    }
                    Ok(())
                })();
                crate::staging::step!("leave", 0, w);
                claims.settle(outcome)
            })
        })?
    }
}

/// A chunk of an ordered download: not queued yet, queued (its copy, until a participant waits
/// for it), being waited for, or landed (its block, shared by the participants copying its pieces out).
enum Slot<'s, T: Element> {
    Empty,
    Queued(MarkedCopy<'s, TypedPinnedBlock<T>>),
    /// A participant is waiting for the chunk's mark.
    Waiting,
    Landed(Arc<TypedPinnedBlock<T>>),
}

/// One chunk of an ordered download: its state, and its mark once queued (read without the
/// lock, so the participants waiting for the chunk spin on the marks' word, not on the lock).
struct ChunkSlot<'s, T: Element> {
    state: Mutex<Slot<'s, T>>,
    mark: std::sync::OnceLock<Mark>,
}

impl<'s, T: Element> ChunkSlot<'s, T> {
    fn new() -> Self {
        Self {
            state: Mutex::new(Slot::Empty),
            mark: std::sync::OnceLock::new(),
        }
    }

    fn queue(&self, copy: MarkedCopy<'s, TypedPinnedBlock<T>>) {
        let mark = copy.mark();
        *self.state.lock() = Slot::Queued(copy);
        let _ = self.mark.set(mark);
    }

    /// The chunk's block once it has landed: participants spin on the chunk's mark, then the
    /// first to take the lock waits for the copy (which returns at once, or reports the
    /// stream's error) and shares the block; `None` when the transfer failed before the chunk
    /// was queued or landed.
    fn landed(
        &self,
        marks: &StreamMarks,
        claims: &Claims,
    ) -> Result<Option<Arc<TypedPinnedBlock<T>>>> {
        let mut backoff = Backoff::default();
        let started = Instant::now();
        loop {
            // Without the lock: not queued yet, or queued and still on the bus (atomic loads
            // alone until `STALLED`).
            let ready = self
                .mark
                .get()
                .is_some_and(|mark| marks.is_reached(*mark) || started.elapsed() >= STALLED);
            if !ready {
                if claims.has_failed() {
                    return Ok(None);
                }
                backoff.snooze();
                continue;
            }
            let mut state = self.state.lock();
            match std::mem::replace(&mut *state, Slot::Waiting) {
                Slot::Landed(block) => {
                    *state = Slot::Landed(Arc::clone(&block));
                    return Ok(Some(block));
                }
                Slot::Queued(copy) => {
                    // Waited for outside the lock (the others see `Waiting` and spin): at once
                    // when the mark is reached, else the marks' wait with its fallback to the
                    // stream, which reports a failed stream's error.
                    drop(state);
                    let block = Arc::new(copy.wait()?);
                    *self.state.lock() = Slot::Landed(Arc::clone(&block));
                    return Ok(Some(block));
                }
                other => *state = other,
            }
            drop(state);
            if claims.has_failed() {
                return Ok(None);
            }
            backoff.snooze();
        }
    }
}
