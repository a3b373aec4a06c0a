//! Ordered pipelines: chunks go to or from the device in order, one copy each with a
//! [`StreamMarks`] mark behind it (downloads on the lane's first stream, uploads alternating
//! between its marked streams), while every participant copies pieces of them between the
//! caller's memory and their pinned blocks.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cuweave_driver::memory::{Mark, StreamMarks};
use cuweave_memory::buffer::MarkedCopy;
use cuweave_memory::parts::SharedParts;
use cuweave_memory::{Buffer, Element, TypedPinnedBlock};
use parking_lot::Mutex;

use super::in_order::InOrder;
use super::{
    Claims, FailOnUnwind, ORDERED_MOST, Pipeline, Ramp, block_of, chunk_ranges, split_pieces,
};
use crate::error::Result;
use crate::workers;

/// How long a participant waits for a chunk's mark with atomic loads alone before it waits on
/// the stream ([`MarkedCopy::wait`], which asks the driver and reports a failed stream's error).
/// A waiter that calls the driver while the queuing participant queues copies on the same stream
/// delays that queuing, and the bus with it, so the driver is asked only when a chunk is
/// overdue by far more than the bus needs for a ring of them.
const STALLED: Duration = Duration::from_millis(20);

/// How an ordered pipeline of `total` elements is cut up: its participants, its chunks (one
/// short one at the ramp's end), their pieces, and how many blocks may be out at once.
struct Layout {
    participants: usize,
    ranges: Vec<std::ops::Range<usize>>,
    pieces: Pieces,
    ring: usize,
}

impl Pipeline<'_> {
    fn ordered_layout<T>(&self, total: usize, ramp: Ramp) -> Layout {
        let chunk = self.config.chunk_elements::<T>();
        let participants = self.participants(total.div_ceil(chunk)).min(ORDERED_MOST);
        let mut ranges = chunk_ranges(total, chunk, 1, ramp);
        if ramp == Ramp::First
            && total * size_of::<T>() >= super::TWO_STREAMS_FROM
            && !super::no_taper()
        {
            taper_last(&mut ranges);
        }
        let pieces = Pieces::new(&ranges, piece_elements::<T>);
        Layout {
            participants,
            ranges,
            pieces,
            ring: participants.saturating_mul(self.config.depth.max(1)),
        }
    }

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
    pub(super) fn download_ordered<T, B>(
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
            super::step!("piece", k, _w);
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
                super::step!("join", 0, w);
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
                            super::step!("block", k, 0);
                            let block = self.pool.get_typed_cold::<T>(range.len())?;
                            super::step!("queue", k, 0);
                            let copy = staged.copy_out_marked(0, range.start, block, marks)?;
                            in_flight.fetch_add(1, Ordering::AcqRel);
                            slots[k].queue(copy);
                            super::step!("queued", k, 0);
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
                super::step!("leave", 0, w);
                claims.settle(outcome)
            })
        })?
    }

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
    pub(super) fn upload_ordered<T, B>(
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
        super::step!("start", 0, 0);
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
        super::step!("laid out", 0, 0);
        let lanes = marks.len().clamp(1, self.streams.len());
        dst.staged_write(dst_offset, total, &self.streams[..lanes], |staged| {
            super::step!("staged", 0, 0);
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
                            super::step!("reuse", k, 0);
                            break Some(copy.wait()?);
                        }
                    }
                    backoff.snooze();
                };
                let block = block_of(self.pool, block, ranges[k].len())?;
                let parts = Arc::new(SharedParts::new(block, pieces.piece_of[k]));
                *filling.parts.lock() = Some(Arc::clone(&parts));
                super::step!("block", k, 0);
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
                super::step!("queue", k, 0);
                let copy =
                    staged.copy_in_marked(k % lanes, ranges[k].start, block, &marks[k % lanes])?;
                super::step!("queued", k, 0);
                queued.lock().push_back(copy);
                Ok(())
            };
            super::step!("run", 0, 0);
            let outcome = workers::shared().run(participants, |w| {
                let _unwinding = FailOnUnwind(&claims);
                super::step!("join", 0, w);
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
                            super::step!("filled", k, w);
                            in_order.drain(filled, queue)?;
                        }
                    }
                    Ok(())
                })();
                super::step!("leave", 0, w);
                claims.settle(outcome)
            });
            super::step!("all queued", 0, 0);
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
            super::step!("landed", 0, 0);
            outcome.and(landed)
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

/// Cuts an ordered upload's last chunk into a half and two quarters: its chunks are queued as
/// the participants finish filling them, so the bus's work left after the last piece is filled
/// is a quarter chunk's instead of a whole one's. Only when there are three or more chunks and
/// the last is at least four elements.
fn taper_last(ranges: &mut Vec<std::ops::Range<usize>>) {
    let Some(last) = ranges.last().cloned() else {
        return;
    };
    if ranges.len() < 3 || last.len() < 4 {
        return;
    }
    let (half, quarter) = (last.len() / 2, last.len() / 4);
    ranges.pop();
    ranges.push(last.start..last.start + half);
    ranges.push(last.start + half..last.start + half + quarter);
    ranges.push(last.start + half + quarter..last.end);
}

/// The pieces an ordered pipeline's chunks are cut into: piece q is elements `ranges[q]` of the
/// transfer, within chunk `chunk_of[q]`; chunk k's pieces are `piece_of[k]` elements each but
/// its last, `count_of[k]` of them. Each chunk is cut by its own length, so the short chunks at
/// a ramp's end and a tapered upload's last ones are shared by every participant too, not by
/// the one or two that a full chunk's piece size would leave them (the start of a 256 MiB
/// upload waited 160 µs for two participants to fill its first, short, chunk).
struct Pieces {
    chunk_of: Vec<usize>,
    ranges: Vec<std::ops::Range<usize>>,
    piece_of: Vec<usize>,
    count_of: Vec<usize>,
}

impl Pieces {
    fn new(chunks: &[std::ops::Range<usize>], piece_for: impl Fn(usize) -> usize) -> Self {
        let (mut chunk_of, mut ranges) = (Vec::new(), Vec::new());
        let (mut piece_of, mut count_of) = (Vec::new(), Vec::new());
        for (k, chunk) in chunks.iter().enumerate() {
            let piece = piece_for(chunk.len()).max(1);
            piece_of.push(piece);
            count_of.push(chunk.len().div_ceil(piece));
            let mut start = chunk.start;
            while start < chunk.end {
                let end = (start + piece).min(chunk.end);
                chunk_of.push(k);
                ranges.push(start..end);
                start = end;
            }
        }
        Self {
            chunk_of,
            ranges,
            piece_of,
            count_of,
        }
    }

    /// How many pieces chunk `k` is cut into.
    fn in_chunk(&self, k: usize) -> usize {
        self.count_of[k]
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

/// Elements per piece an ordered pipeline's chunk is copied in or out in: an eighth of the chunk,
/// between 64 KiB and 512 KiB, so every participant shares each chunk's host copy.
fn piece_elements<T>(chunk: usize) -> usize {
    let element = size_of::<T>().max(1);
    let bytes = (chunk * element / 8).clamp(64 << 10, 512 << 10);
    (bytes / element).clamp(1, chunk.max(1))
}

/// Spins briefly, then yields: for participants waiting on one another for a few microseconds.
#[derive(Default)]
struct Backoff {
    step: u32,
}

impl Backoff {
    fn snooze(&mut self) {
        if self.step < 64 {
            self.step += 1;
            for _ in 0..(1 << self.step.min(6)) {
                std::hint::spin_loop();
            }
        } else {
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_is_cut_into_pieces_by_its_own_length() {
        // A 256 MiB upload's layout: a quarter-chunk ramp first, 4 MiB chunks, a tapered end.
        let mut ranges = chunk_ranges(256 << 20, 4 << 20, 1, Ramp::First);
        taper_last(&mut ranges);
        let pieces = Pieces::new(&ranges, piece_elements::<u8>);
        let mut next = 0;
        for (q, range) in pieces.ranges.iter().enumerate() {
            assert_eq!(range.start, next, "pieces cover the copy in order, once");
            next = range.end;
            let k = pieces.chunk_of[q];
            assert!(ranges[k].start <= range.start && range.end <= ranges[k].end);
        }
        assert_eq!(next, 256 << 20);
        for (k, chunk) in ranges.iter().enumerate() {
            let count = pieces.chunk_of.iter().filter(|&&c| c == k).count();
            assert_eq!(pieces.in_chunk(k), count);
            assert_eq!(pieces.piece_of[k], piece_elements::<u8>(chunk.len()));
        }
        // The short first chunk (1 MiB) and the tapered quarters are shared by eight, like the
        // full chunks, instead of by the two that 512 KiB pieces would give them.
        assert_eq!(ranges[0].len(), 1 << 20);
        assert_eq!(pieces.in_chunk(0), 8);
        assert_eq!(pieces.in_chunk(1), 8);
        assert_eq!(pieces.in_chunk(ranges.len() - 1), 8);
    }

    #[rstest::rstest]
    // A short first chunk, then full ones: the last becomes a half and two quarters.
    #[case::ramped(vec![0..4, 4..20, 20..36], vec![0..4, 4..20, 20..28, 28..32, 32..36])]
    // An odd last chunk: the second quarter takes the remainder, nothing is lost.
    #[case::odd(vec![0..8, 8..16, 16..23], vec![0..8, 8..16, 16..19, 19..20, 20..23])]
    // Fewer than three chunks, or a last chunk under four elements: left alone.
    #[case::two_chunks(vec![0..8, 8..16], vec![0..8, 8..16])]
    #[case::tiny_last(vec![0..8, 8..16, 16..19], vec![0..8, 8..16, 16..19])]
    #[case::empty(vec![], vec![])]
    fn the_last_chunk_tapers_into_a_half_and_two_quarters(
        #[case] mut ranges: Vec<std::ops::Range<usize>>,
        #[case] expected: Vec<std::ops::Range<usize>>,
    ) {
        let end = ranges.last().map_or(0, |r| r.end);
        taper_last(&mut ranges);
        assert_eq!(ranges, expected);
        // Still contiguous from 0 to the same end.
        let mut next = 0;
        for range in &ranges {
            assert_eq!(range.start, next);
            assert!(!range.is_empty());
            next = range.end;
        }
        assert_eq!(next, end);
    }

    #[rstest::rstest]
    #[case::u8_1mib(1 << 20, 1, 128 << 10)]
    #[case::u8_4mib(4 << 20, 1, 512 << 10)]
    #[case::u8_64mib_capped(64 << 20, 1, 512 << 10)]
    #[case::u8_256kib_floored(256 << 10, 1, 64 << 10)]
    #[case::u8_tiny_chunk(1000, 1, 1000)]
    #[case::u64_1mib(128 << 10, 8, 16 << 10)]
    #[case::huge_elements(3, 1 << 20, 1)]
    fn pieces_are_an_eighth_of_a_chunk_within_bounds(
        #[case] chunk: usize,
        #[case] element: usize,
        #[case] expected: usize,
    ) {
        let pieces = match element {
            1 => piece_elements::<u8>(chunk),
            8 => piece_elements::<u64>(chunk),
            _ => piece_elements::<[u8; 1 << 20]>(chunk),
        };
        assert_eq!(pieces, expected);
        assert!(pieces >= 1 && pieces <= chunk);
    }
}
