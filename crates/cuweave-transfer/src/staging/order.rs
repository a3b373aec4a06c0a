//! [`ChunkOrder`]: whether a pipelined copy's chunks reach the bus in order on one stream or on
//! every participant's own, and the sizes and participant counts the ordered pipelines use.

use serde::{Deserialize, Serialize};

use super::host_threads;

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
