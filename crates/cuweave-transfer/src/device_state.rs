//! What the manager keeps per device, made on first use: facts about the device (no context
//! needed to read them) and, once a transfer touches it, its context, pinned pool, completion
//! words and lanes of streams.

use std::sync::{Arc, OnceLock};

use cuweave_driver::memory::{CompletionWords, MappedWords, StreamMarks};
use cuweave_driver::{Context, Device, DeviceCapabilities, Stream, StreamFlags};
use cuweave_memory::PinnedPool;
use parking_lot::Mutex;

use crate::error::Result;
use crate::workers;

/// Idle lanes a device keeps for reuse; a lane handed back while this many wait is dropped
/// (its streams destroyed), so concurrency bursts leave no unbounded set of streams behind.
/// Enough for a server's request threads, each with a transfer in flight, to reuse lanes
/// rather than make one per transfer.
pub const MAX_IDLE_LANES: usize = 16;

/// Facts about one device that need no context: read with attribute queries on first use.
#[derive(Debug, Clone)]
pub(crate) struct DeviceInfo {
    /// `None` when the attributes could not be read: then nothing optional is assumed.
    pub(crate) capabilities: Option<DeviceCapabilities>,
    /// `can_access_peer[j]`: this device can access device `j`'s memory.
    pub(crate) can_access_peer: Vec<bool>,
}

/// One device the manager serves: its facts and its state, each made on first use.
pub(crate) struct DeviceSlot {
    pub(crate) device: Device,
    info: OnceLock<DeviceInfo>,
    state: OnceLock<Arc<DeviceState>>,
}

impl DeviceSlot {
    pub(crate) fn new(device: Device) -> Self {
        Self {
            device,
            info: OnceLock::new(),
            state: OnceLock::new(),
        }
    }

    /// The device's facts, read on first call (no context is made). A device whose attributes
    /// cannot be read is treated as able to do nothing optional.
    pub(crate) fn info(&self) -> &DeviceInfo {
        self.info.get_or_init(|| {
            let capabilities = self
                .device
                .capabilities()
                .inspect_err(|error| {
                    tracing::warn!(%error, device = self.device.ordinal(), "device capabilities unreadable");
                })
                .ok();
            let can_access_peer = Device::all()
                .unwrap_or_default()
                .iter()
                .map(|peer| self.device.can_access_peer(peer).unwrap_or(false))
                .collect();
            DeviceInfo {
                capabilities,
                can_access_peer,
            }
        })
    }

    /// Whether this manager has made the device's state (retained its context).
    pub(crate) fn is_open(&self) -> bool {
        self.state.get().is_some()
    }

    /// The device's state, made on first call: its primary context retained, a pinned pool,
    /// completion words. Two threads racing here may both build one; the loser's is dropped.
    pub(crate) fn state(&self) -> Result<&Arc<DeviceState>> {
        if let Some(state) = self.state.get() {
            return Ok(state);
        }
        let built = Arc::new(DeviceState::open(self.device)?);
        tracing::debug!(device = self.device.ordinal(), "transfer state made");
        Ok(self.state.get_or_init(|| built))
    }
}

/// Words of the page that lanes' first streams write their progress marks into: one per marked
/// stream of each lane alive at once (lanes past these run their copies interleaved, without
/// marks).
const MARK_WORDS: usize = 512;

/// How many of a lane's streams have progress marks: ordered uploads alternate their chunks
/// between these, so two copy engines read host memory at once (see `upload_ordered`).
pub const MARKED_STREAMS: usize = 2;

/// A device's transfer state: context, staging pool, completion words and idle lanes.
pub(crate) struct DeviceState {
    pub(crate) context: Arc<Context>,
    pub(crate) pool: PinnedPool,
    /// Words for learning that a small upload landed without a driver call (`None` when the
    /// device cannot map host memory).
    pub(crate) completion: Option<CompletionWords>,
    /// The page lanes' progress marks live in (`None` when the device cannot map host memory).
    mark_words: Option<Arc<MappedWords>>,
    /// Words of `mark_words` no lane holds, each with the last number written into it.
    free_marks: Mutex<Vec<(usize, u64)>>,
    lanes: Mutex<Vec<(Vec<Stream>, Vec<StreamMarks>)>>,
}

impl DeviceState {
    fn open(device: Device) -> Result<Self> {
        let context = Context::primary(device)?;
        // Without mapped host memory the small uploads synchronise their stream instead.
        let completion = CompletionWords::new(&context)
            .inspect_err(|error| {
                tracing::debug!(%error, "no completion words: small uploads use cuStreamSynchronize");
            })
            .ok();
        let mark_words = MappedWords::new(&context, MARK_WORDS)
            .inspect_err(|error| {
                tracing::debug!(%error, "no mark words: pipelined copies run interleaved");
            })
            .ok()
            .map(Arc::new);
        let free_marks = match mark_words {
            Some(_) => (0..MARK_WORDS).rev().map(|index| (index, 0)).collect(),
            None => Vec::new(),
        };
        Ok(Self {
            pool: PinnedPool::new(&context),
            context,
            completion,
            mark_words,
            free_marks: Mutex::new(free_marks),
            lanes: Mutex::new(Vec::new()),
        })
    }

    /// Progress marks for `stream` (one of a new lane's first streams) in a free word, if any is
    /// left.
    fn marks_for(&self, stream: &Stream) -> Option<StreamMarks> {
        let words = self.mark_words.as_ref()?;
        let (index, last) = self.free_marks.lock().pop()?;
        match StreamMarks::new(Arc::clone(words), index, stream, last) {
            Ok(marks) => Some(marks),
            Err(error) => {
                tracing::debug!(%error, "no progress marks for a new lane");
                self.free_marks.lock().push((index, last));
                None
            }
        }
    }

    /// A lane this caller holds alone until it drops it: its marked streams, and the others
    /// earlier pipelined transfers grew it to ([`Lane::grow`]). An idle lane is reused;
    /// otherwise one is made (the first transfer of each concurrent caller pays for its
    /// streams once).
    pub(crate) fn lane(self: &Arc<Self>) -> Result<Lane> {
        let idle = self.lanes.lock().pop();
        let (streams, marks) = match idle {
            Some(lane) => lane,
            None => {
                // The marked streams only: a pipelined transfer adds the others it needs
                // ([`Lane::grow`]), so a lane that serves single-stream work (small and async
                // copies, peer copies, prefetches) costs two streams, not one per participant.
                let streams = (0..MARKED_STREAMS.min(workers::shared().participants()))
                    .map(|_| Stream::new(&self.context, StreamFlags::NON_BLOCKING))
                    .collect::<cuweave_driver::Result<Vec<_>>>()?;
                // All of the first streams marked, or none: a word left alone goes back.
                let mut marks: Vec<StreamMarks> = streams
                    .iter()
                    .take(MARKED_STREAMS)
                    .map_while(|stream| self.marks_for(stream))
                    .collect();
                if marks.len() < MARKED_STREAMS.min(streams.len()) {
                    self.give_back_marks(&mut marks);
                }
                (streams, marks)
            }
        };
        Ok(Lane {
            streams,
            marks,
            state: Arc::clone(self),
        })
    }

    /// Gives `marks`' words back, each with its last number, so the next lane's marks on them
    /// start above anything their streams may still write.
    fn give_back_marks(&self, marks: &mut Vec<StreamMarks>) {
        let mut free = self.free_marks.lock();
        for marks in marks.drain(..) {
            let (_, index, last) = marks.into_parts();
            free.push((index, last));
        }
    }

    /// Progress-mark words no lane holds.
    pub(crate) fn free_mark_words(&self) -> usize {
        self.free_marks.lock().len()
    }

    /// Idle lanes kept for reuse (at most [`MAX_IDLE_LANES`]).
    pub(crate) fn idle_lanes(&self) -> usize {
        self.lanes.lock().len()
    }
}

/// Streams one transfer holds alone; back to the device's idle lanes on drop.
pub(crate) struct Lane {
    pub(crate) streams: Vec<Stream>,
    /// Progress marks of the first [`MARKED_STREAMS`] streams, for ordered copies (empty: none
    /// were free, or the device cannot map host memory).
    pub(crate) marks: Vec<StreamMarks>,
    pub(crate) state: Arc<DeviceState>,
}

impl Lane {
    /// The lane's first stream (single-stream work: peer copies, prefetches, small copies).
    pub(crate) fn stream(&self) -> &Stream {
        &self.streams[0]
    }

    /// Gives the lane `streams` streams (at most one per staging participant) for a pipelined
    /// transfer with that many participants; an idle lane keeps them. Best effort: when the
    /// driver refuses a stream, the transfer runs with the participants the lane has.
    pub(crate) fn grow(&mut self, streams: usize) {
        let wanted = streams.min(workers::shared().participants());
        while self.streams.len() < wanted {
            match Stream::new(&self.state.context, StreamFlags::NON_BLOCKING) {
                Ok(stream) => self.streams.push(stream),
                Err(error) => {
                    tracing::debug!(%error, have = self.streams.len(), wanted, "a lane could not grow");
                    return;
                }
            }
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        let streams = std::mem::take(&mut self.streams);
        let mut marks = std::mem::take(&mut self.marks);
        let mut idle = self.state.lanes.lock();
        if idle.len() < MAX_IDLE_LANES {
            idle.push((streams, marks));
            return;
        }
        drop(idle);
        // The streams are destroyed; their words go back.
        self.state.give_back_marks(&mut marks);
    }
}
