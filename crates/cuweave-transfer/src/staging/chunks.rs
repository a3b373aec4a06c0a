//! How a pipelined copy is cut into chunks ([`chunk_ranges`], with short ones where the
//! pipeline fills or drains) and how its participants claim them ([`Claims`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::switches::no_ramp;
use crate::error::Result;
use crate::workers;

/// `dst` cut at `ranges` (consecutive, covering it), each piece for the participant that claims
/// its chunk.
pub(super) fn split_pieces<'d, T>(
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
pub(super) enum Ramp {
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
pub(super) fn chunk_ranges(
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

/// Marks a transfer failed when dropped during a panic.
pub(super) struct FailOnUnwind<'c>(pub(super) &'c Claims);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.failed.store(true, Ordering::Relaxed);
        }
    }
}

/// Chunks handed out to participants one at a time; after a failure nobody claims more.
pub(super) struct Claims {
    next: AtomicUsize,
    chunks: usize,
    failed: AtomicBool,
}

impl Claims {
    pub(super) fn new(chunks: usize) -> Self {
        Self {
            next: AtomicUsize::new(0),
            chunks,
            failed: AtomicBool::new(false),
        }
    }

    /// The next chunk for participant `w`, unless the transfer failed or `w` is over its
    /// transfer's share of the host threads (`workers::Workers::keeps`).
    pub(super) fn next_for(&self, w: usize) -> Option<usize> {
        if self.failed.load(Ordering::Relaxed) || !workers::shared().keeps(w) {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        (i < self.chunks).then_some(i)
    }

    pub(super) fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    pub(super) fn settle(&self, outcome: Result<()>) -> Result<()> {
        if outcome.is_err() {
            self.failed.store(true, Ordering::Relaxed);
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
