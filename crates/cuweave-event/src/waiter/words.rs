//! Completion words: per-context slabs of mapped pinned words that streams write sequence
//! numbers into, and the leases the reactor watches.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crossbeam::queue::SegQueue;
use cuweave_driver::graph::outside_captures;
use cuweave_driver::memory::MappedWords;
use cuweave_driver::{Context, DriverError, EventPool, OwnedPooledEvent, Stream, StreamFlags};
use parking_lot::Mutex;

/// Words per chunk: one 4 KiB page.
const CHUNK_WORDS: usize = 512;

/// The completion words of one context: chunks of [`MappedWords`], a free list of words, a
/// sequence counter, and a private stream whose query reveals a dead context.
#[derive(Debug)]
pub(crate) struct WordSlab {
    context: Arc<Context>,
    /// The context's event pool, for the blocking-sync events behind words.
    events: EventPool,
    /// Per stream id, the last blocking-sync event recorded behind a word, while a lease holds
    /// it: a stream gets a new one only when it has none pending, so a burst of waits on one
    /// stream adds one operation to its queue, not one per wait.
    wakes: Mutex<HashMap<u64, Weak<OwnedPooledEvent>>>,
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
    wake: Wake,
}

/// The blocking-sync event behind a lease's word, if it got one: kept by the lease (a callback
/// wait, which the reactor owns), or by the wait's future, the lease only watching it, so that
/// a dropped future lets it go at once however far behind the reactor is.
#[derive(Debug)]
enum Wake {
    None,
    Kept(Arc<OwnedPooledEvent>),
    Watched(Weak<OwnedPooledEvent>),
}

impl Lease {
    /// The wake event, while someone keeps it.
    pub(crate) fn wake(&self) -> Option<Arc<OwnedPooledEvent>> {
        match &self.wake {
            Wake::None => None,
            Wake::Kept(event) => Some(Arc::clone(event)),
            Wake::Watched(event) => event.upgrade(),
        }
    }

    /// Hands the wake event to the caller (a future) to keep; the lease only watches it.
    pub(crate) fn hand_over_wake(&mut self) -> Option<Arc<OwnedPooledEvent>> {
        let Wake::Kept(event) = &self.wake else {
            return None;
        };
        let event = Arc::clone(event);
        self.wake = Wake::Watched(Arc::downgrade(&event));
        Some(event)
    }
}

impl WordSlab {
    pub(crate) fn new(context: &Arc<Context>) -> Result<Self, DriverError> {
        Ok(Self {
            context: Arc::clone(context),
            events: EventPool::for_context(context)?,
            wakes: Mutex::new(HashMap::new()),
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
        let wake = self.wake_event(stream).map_or(Wake::None, Wake::Kept);
        Ok(Lease {
            slab: Arc::clone(self),
            words,
            index,
            target,
            wake,
        })
    }

    /// A blocking-sync event recorded on `stream` now, unless the stream's last one is still
    /// pending (the reactor sleeps on that one; the waits queued behind it are seen within
    /// the reactor's spin or nap once it wakes). The word's write is already queued, so the
    /// lease must be watched whatever happens here: a failure only costs the reactor its sleep
    /// (it naps instead).
    ///
    /// Whether the last one is still pending is a query of cuweave's own, made on the caller's
    /// thread (not in relaxed mode): only inside [`outside_captures`], so that it cannot break
    /// a global-mode capture another thread begins meanwhile. While a capture is active or
    /// beginning it is not asked, and a fresh event is recorded, as when the driver refused it.
    fn wake_event(&self, stream: &Stream) -> Option<Arc<OwnedPooledEvent>> {
        let mut wakes = self.wakes.lock();
        if let Some(pending) = wakes.get(&stream.id()).and_then(Weak::upgrade)
            && outside_captures(|| pending.query().ok()).flatten() == Some(false)
        {
            return None;
        }
        let event = self
            .events
            .acquire_blocking_owned()
            .and_then(|event| event.record(stream).map(|()| Arc::new(event)))
            .map_err(|error| tracing::debug!(%error, "no wake event behind a completion word"))
            .ok()?;
        if wakes.len() >= 256 {
            wakes.retain(|_, wake| wake.strong_count() > 0);
        }
        wakes.insert(stream.id(), Arc::downgrade(&event));
        Some(event)
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

    /// Frees every chunk whose words are all back on the free list (nothing lent, nothing
    /// abandoned); returns the bytes freed. A lease taken meanwhile grows a new chunk.
    pub(crate) fn release_free_chunks(&self) -> usize {
        let mut taken = Vec::new();
        while let Some(entry) = self.free.pop() {
            taken.push(entry);
        }
        let mut free_words: HashMap<*const MappedWords, usize> = HashMap::new();
        for (words, _) in &taken {
            *free_words.entry(Arc::as_ptr(words)).or_default() += 1;
        }
        let mut released = 0;
        for (words, index) in taken {
            let key = Arc::as_ptr(&words);
            if free_words[&key] == CHUNK_WORDS {
                // The chunk's last free entry drops its last reference: MappedWords' drop
                // waits for any queued write, then frees the page.
                if Arc::strong_count(&words) == 1 {
                    released += CHUNK_WORDS * size_of::<u64>();
                }
                drop(words);
            } else {
                self.free.push((words, index));
            }
        }
        released
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
    /// shutting down): the word never returns to the free list, so no later lease can see the
    /// late write. Freeing its chunk is the driver's one rule for completion words
    /// ([`MappedWords`]' drop frees the chunk, off the dropping thread, once the context's
    /// queued writes have landed, or leaks it when the context is dead), so this crate keeps no freeing logic of its own.
    pub(crate) fn abandon(self) {
        drop(self.words);
    }

    /// Gives the word back; only call once [`is_reached`](Self::is_reached), so that the
    /// stream's write has landed and cannot hit a later lease.
    pub(crate) fn recycle(self) {
        self.slab.free.push((self.words, self.index));
    }
}
