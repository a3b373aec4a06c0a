//! Completion words: per-context slabs of mapped pinned words that streams write sequence
//! numbers into, and the leases the reactor watches.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam::queue::SegQueue;
use cuweave_driver::memory::MappedWords;
use cuweave_driver::{Context, DriverError, EventPool, OwnedPooledEvent, Stream, StreamFlags};

/// Words per chunk: one 4 KiB page.
const CHUNK_WORDS: usize = 512;

/// The completion words of one context: chunks of [`MappedWords`], a free list of words, a
/// sequence counter, and a private stream whose query reveals a dead context.
#[derive(Debug)]
pub(crate) struct WordSlab {
    context: Arc<Context>,
    /// The context's event pool, for the blocking-sync event behind each word.
    events: EventPool,
    free: SegQueue<(Arc<MappedWords>, usize)>,
    sequence: AtomicU64,
    probe: Stream,
}

/// One word lent to one wait: the stream writes `target` into it behind the awaited work, and
/// records a blocking-sync event right after, which the reactor's sleeper thread waits on
/// (asleep in the driver) once the reactor stops spinning.
#[derive(Debug)]
pub(crate) struct Lease {
    pub(crate) slab: Arc<WordSlab>,
    words: Arc<MappedWords>,
    index: usize,
    target: u64,
    pub(crate) wake: Option<Arc<OwnedPooledEvent>>,
}

impl WordSlab {
    pub(crate) fn new(context: &Arc<Context>) -> Result<Self, DriverError> {
        Ok(Self {
            context: Arc::clone(context),
            events: EventPool::for_context(context)?,
            free: SegQueue::new(),
            sequence: AtomicU64::new(0),
            probe: Stream::new(context, StreamFlags::NON_BLOCKING)?,
        })
    }

    /// Lends a word and queues the write of a fresh sequence number into it on `stream`.
    pub(crate) fn lease(self: &Arc<Self>, stream: &Stream) -> Result<Lease, DriverError> {
        let (words, index) = match self.free.pop() {
            Some(free) => free,
            None => self.grow()?,
        };
        // Sequence numbers only grow, and a word is lent again only after its last target
        // was seen, so a word never already holds a newer lease's target.
        let target = self.sequence.fetch_add(1, Ordering::Relaxed) + 1;
        if let Err(error) = words.enqueue_write(stream, index, target) {
            self.free.push((words, index));
            return Err(error);
        }
        // The word's write is queued, so from here on the lease must be watched until it
        // lands; a failed wake event only costs the reactor its sleep (it naps instead).
        let wake = self
            .events
            .acquire_blocking_owned()
            .and_then(|event| event.record(stream).map(|()| Arc::new(event)))
            .map_err(|error| tracing::debug!(%error, "no wake event behind a completion word"))
            .ok();
        Ok(Lease {
            slab: Arc::clone(self),
            words,
            index,
            target,
            wake,
        })
    }

    fn grow(&self) -> Result<(Arc<MappedWords>, usize), DriverError> {
        tracing::debug!(
            words = CHUNK_WORDS,
            "allocating a chunk of completion words"
        );
        let words = Arc::new(MappedWords::new(&self.context, CHUNK_WORDS)?);
        for index in 1..CHUNK_WORDS {
            self.free.push((Arc::clone(&words), index));
        }
        Ok((words, 0))
    }

    /// `Err` with the driver's sticky error once the context has died (a kernel fault); the
    /// reactor asks this only now and then, while words stay unwritten.
    pub(crate) fn probe(&self) -> Result<(), DriverError> {
        self.probe.query().map(drop)
    }
}

impl Lease {
    /// Whether the stream has written the target (one atomic load; no driver call).
    pub(crate) fn is_reached(&self) -> bool {
        self.words
            .load(self.index)
            .is_some_and(|value| value >= self.target)
    }

    /// Gives up on the word without waiting for the stream's write (a dead context, or a waiter
    /// shutting down): its chunk is leaked, so the write can still land, whenever it does,
    /// in memory that stays mapped for the life of the process (4 KiB per chunk at most once).
    pub(crate) fn abandon(self) {
        std::mem::forget(self.words);
    }

    /// Gives the word back; only call once [`is_reached`](Self::is_reached), so that the
    /// stream's write has landed and cannot hit a later lease.
    pub(crate) fn recycle(self) {
        self.slab.free.push((self.words, self.index));
    }
}
