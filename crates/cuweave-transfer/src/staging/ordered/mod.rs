//! Ordered pipelines: chunks go to or from the device in order, one copy each with a
//! [`StreamMarks`] mark behind it (downloads on the lane's first stream, uploads alternating
//! between its marked streams), while every participant copies pieces of them between the
//! caller's memory and their pinned blocks.
//!
//! [`StreamMarks`]: cuweave_driver::memory::StreamMarks

use std::time::Duration;

use super::chunks::{Ramp, chunk_ranges};
use super::{ORDERED_MOST, Pipeline};

mod download;
mod upload;

/// How long a participant waits for a chunk's mark with atomic loads alone before it waits on
/// the stream ([`MarkedCopy::wait`], which asks the driver and reports a failed stream's error).
/// A waiter that calls the driver while the queuing participant queues copies on the same stream
/// delays that queuing, and the bus with it, so the driver is asked only when a chunk is
/// overdue by far more than the bus needs for a ring of them.
///
/// [`MarkedCopy::wait`]: cuweave_memory::buffer::MarkedCopy::wait
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
            && !super::switches::no_taper()
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
