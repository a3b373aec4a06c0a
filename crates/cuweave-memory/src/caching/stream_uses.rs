//! Streams as the allocator sees them: the key of a free list, the uses recorded on other
//! streams, and the events that must complete before a block used there may be handed out again.

use std::sync::Arc;

use cuweave_driver::stream::WeakStream;
use cuweave_driver::{Context, Stream};

use crate::error::{MemoryError, Result};
use crate::events::{ContextEvents, StreamEvent};

/// The identity of a stream for the caching allocator: the handle's process-unique
/// [`Stream::id`] for a handle that owns its stream, not its raw `CUstream` value, which the
/// driver recycles after a stream is destroyed (a new stream must never inherit a dead stream's
/// free list while the dead stream's last work may still be running).
///
/// Each stream has its own free lists; a block freed on a stream is handed out again only on that
/// stream, where the work queued after the reuse is ordered after the work that used it before.
///
/// The legacy default stream (`NULL` or `CU_STREAM_LEGACY`), one stream per context whatever the
/// handle, has one key, [`StreamKey::LEGACY`]. The per-thread default stream
/// (`CU_STREAM_PER_THREAD`) is refused by the allocator
/// ([`crate::MemoryError::InvalidStream`]): its one handle names a
/// different stream on each thread, so a free list keyed by it would hand a block to a thread
/// whose stream is not ordered after the last user.
///
/// **Borrowed handles share their stream's key.** Every borrowed handle of one raw stream
/// ([`Stream::from_raw`] without `owned`; [`Stream::is_borrowed`]) has the same key, made from
/// the raw handle ([`is_borrowed`](Self::is_borrowed)), as PyTorch keys an `ExternalStream`: a
/// library that wraps its caller's stream afresh for every call finds the blocks the previous
/// call freed, instead of taking a new segment each time (a borrowed handle's own id would key
/// a free list that nobody allocates from once the handle is gone). The raw value may name a
/// new stream once its owner has destroyed the old one (allowed once no borrowed handle of it
/// is left), so a free on a borrowed key never relies on stream order alone: it waits for an
/// event recorded on the stream at the free (or, when the handle the memory was allocated on is
/// gone, for the end its drop recorded), and during a capture it is deferred until the device
/// has finished. A new stream at the old address so never gets a block under the old stream's
/// work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamKey(usize);

/// Marks a borrowed stream's key (bit 62; bit 63 marks a graph pool's private key).
const BORROWED_BIT: u64 = 1 << 62;
/// The top bit, which marks a graph pool's private key.
const TOP_BIT: u64 = 1 << 63;

impl StreamKey {
    /// The key of the context's legacy default stream (stream ids start at 1).
    pub const LEGACY: Self = Self(0);

    /// The key of `stream`.
    #[inline]
    pub fn of(stream: &Stream) -> Self {
        match stream.as_raw() as usize {
            0 | 1 => Self::LEGACY,
            raw if stream.is_borrowed() => {
                Self::borrowed(raw).unwrap_or(Self(stream.id() as usize))
            }
            _ => Self(stream.id() as usize),
        }
    }

    /// The key of a borrowed handle of the raw stream `raw`: its address, with the low four
    /// bits (zero for an aligned handle) moved up so that the shard index (the key's low bits)
    /// spreads streams over the shards; `None` for an address past 48 bits (then the handle's
    /// own id keys it).
    fn borrowed(raw: usize) -> Option<Self> {
        let raw = raw as u64;
        if raw >> 48 != 0 {
            return None;
        }
        usize::try_from(BORROWED_BIT | (raw >> 4) | ((raw & 0xf) << 44))
            .ok()
            .map(Self)
    }

    /// Whether this is the key of a borrowed stream (shared by all its borrowed handles; see
    /// the type's docs).
    #[inline]
    pub fn is_borrowed(self) -> bool {
        (self.0 as u64) & (TOP_BIT | BORROWED_BIT) == BORROWED_BIT
    }

    /// `Err(InvalidStream)` for the per-thread default stream, which cannot key a free list.
    #[inline]
    pub(crate) fn checked(stream: &Stream, operation: &'static str) -> Result<Self> {
        if stream.is_per_thread_default() {
            return Err(MemoryError::InvalidStream {
                operation,
                reason: "the per-thread default stream (CU_STREAM_PER_THREAD) names a different \
                         stream on each thread; use a created stream",
            });
        }
        Ok(Self::of(stream))
    }

    /// The key as an integer (the stream's [`Stream::id`], or for a borrowed stream a value made
    /// from its raw handle).
    pub fn as_usize(self) -> usize {
        self.0
    }

    pub(crate) const fn from_raw(raw: usize) -> Self {
        Self(raw)
    }
}

impl From<&Stream> for StreamKey {
    fn from(stream: &Stream) -> Self {
        Self::of(stream)
    }
}

/// A marker of queued work that can be polled and waited for: a pooled CUDA event in the
/// allocator (dropping it returns it to its pool), a flag in the unit tests.
pub(crate) trait Marker: Send + 'static {
    /// Whether the marked work has finished; never blocks.
    fn is_complete(&self) -> Result<bool>;
    /// Blocks until the marked work has finished.
    fn wait(&self) -> Result<()>;
    /// The identity of the stream the marker was recorded on, when it is known: markers of one
    /// stream complete in the order they were recorded, which lets a poll of many stop at a
    /// stream's first unfinished one ([`super::pending`]).
    fn stream(&self) -> Option<u64> {
        None
    }
}

impl Marker for StreamEvent {
    fn is_complete(&self) -> Result<bool> {
        Ok(self.event.query()?)
    }

    fn wait(&self) -> Result<()> {
        Ok(self.event.synchronize()?)
    }

    fn stream(&self) -> Option<u64> {
        self.stream
    }
}

/// Records, on each of `streams`, an event that completes when the work queued there so far has;
/// events come from the event pool of the stream's context (`events`, the allocator's, for
/// streams of `context`).
///
/// When an event cannot be taken or recorded on a stream, that stream is synchronised instead
/// (its work is then done, so no event is needed); only if that fails too is the error returned,
/// and the caller must then never hand the block out again.
pub(crate) fn record_uses(
    streams: &[Arc<Stream>],
    context: &Arc<Context>,
    events: &ContextEvents,
) -> Result<Vec<StreamEvent>> {
    let mut recorded = Vec::with_capacity(streams.len());
    for stream in streams {
        recorded.extend(record_use(stream, context, events)?);
    }
    Ok(recorded)
}

/// [`record_uses`] for one stream: an event behind the work queued on `stream` so far, or `None`
/// when no event could be recorded and the stream was synchronised instead.
pub(crate) fn record_use(
    stream: &Stream,
    context: &Arc<Context>,
    events: &ContextEvents,
) -> Result<Option<StreamEvent>> {
    match record_one(stream, context, events) {
        Ok(event) => Ok(Some(StreamEvent::recorded_on(event, stream))),
        Err(error) => {
            tracing::warn!(%error, "recording a stream-use event failed; synchronising the stream");
            stream.synchronize()?;
            Ok(None)
        }
    }
}

/// What a free on a borrowed stream's key waits for besides the memory's recorded uses: an
/// event behind the work queued so far on the stream of `home`, the handle the memory was
/// allocated on, while that handle lives; once it is gone, the end its drop recorded (behind
/// every piece of work queued on the stream until then), made into an event of the
/// allocator's release stream when it has not yet completed. `None` when nothing is left to
/// wait for (or the stream or device was synchronised instead).
///
/// A borrowed key is shared by every borrowed handle of one raw stream, and the raw value may
/// name a new stream once its owner destroyed the old one: so the free cannot rely on stream
/// order alone (see [`StreamKey`]).
///
/// The caller has checked that no capture is active.
///
/// # Errors
/// The driver's error when nothing could be recorded and no synchronisation stood in for it:
/// the caller must never hand the block out again.
#[cold]
pub(crate) fn borrowed_home_marker(
    home: &WeakStream,
    shared: &super::allocator::Shared,
) -> Result<Option<StreamEvent>> {
    let context = shared.context();
    if let Some(marker) = home.with(|stream| record_use(stream, context, &shared.events)) {
        return marker;
    }
    let end = home.end();
    // The caller's check of `active_captures` leaves a window in which another thread's
    // global-mode capture could begin, which this query (cuweave's own) would break: asked only
    // while none is active or beginning. Skipped, the end is waited for below, as when it has
    // not finished.
    if cuweave_driver::graph::outside_captures(|| matches!(end.is_finished(), Ok(true)))
        == Some(true)
    {
        return Ok(None);
    }
    if end.is_recorded() {
        let stream = shared.release_stream()?;
        if end.wait_on(stream)? {
            return record_use(stream, context, &shared.events);
        }
    }
    // The handle dropped without an end event: only the device's end covers its work.
    context.synchronize()?;
    Ok(None)
}

fn record_one(
    stream: &Stream,
    context: &Arc<Context>,
    events: &ContextEvents,
) -> Result<cuweave_driver::OwnedPooledEvent> {
    let event = events.for_stream(context, stream)?;
    event.record(stream)?;
    Ok(event)
}

#[cfg(test)]
pub(crate) mod fake {
    //! Markers the tests complete by hand: a bare flag, and flags lent by a CUDA-free stand-in
    //! for the driver's event pool, which takes them back when dropped and counts what it made.

    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use parking_lot::Mutex;

    use super::Marker;
    use crate::error::Result;

    /// A marker that completes when its flag is set (or on `wait`, which sets it), recorded on
    /// the stream of identity `.1` when that is known.
    #[derive(Debug, Clone, Default)]
    pub struct Flag(pub Arc<AtomicBool>, pub Option<u64>);

    impl Flag {
        /// A flag recorded on the stream of identity `stream`.
        pub fn on(stream: u64) -> Self {
            Self(Arc::default(), Some(stream))
        }

        pub fn complete(&self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    impl Marker for Flag {
        fn is_complete(&self) -> Result<bool> {
            Ok(self.0.load(Ordering::SeqCst))
        }

        fn wait(&self) -> Result<()> {
            self.complete();
            Ok(())
        }

        fn stream(&self) -> Option<u64> {
            self.1
        }
    }

    #[derive(Debug, Default)]
    struct PoolState {
        /// Numbers of the "events" free in the pool.
        free: Vec<usize>,
        created: usize,
        held: usize,
        peak_held: usize,
    }

    /// The pool's rules without CUDA: hands out a free item or, when none is free, a new one;
    /// an item comes back when its handle is dropped. Each lending is a fresh recording (a new
    /// [`Flag`]) of a reused item, as re-recording a pooled event is.
    #[derive(Debug, Clone, Default)]
    pub struct FakePool(Arc<Mutex<PoolState>>);

    impl FakePool {
        /// An item of the pool, recorded afresh (not complete).
        pub fn acquire(&self) -> Pooled {
            let mut state = self.0.lock();
            let number = state.free.pop().unwrap_or_else(|| {
                state.created += 1;
                state.created
            });
            state.held += 1;
            state.peak_held = state.peak_held.max(state.held);
            Pooled {
                number,
                flag: Flag::default(),
                pool: self.clone(),
            }
        }

        /// Items made so far.
        pub fn created(&self) -> usize {
            self.0.lock().created
        }

        /// Items lent out now.
        pub fn held(&self) -> usize {
            self.0.lock().held
        }

        /// The most items lent out at once.
        pub fn peak_held(&self) -> usize {
            self.0.lock().peak_held
        }
    }

    /// An item lent by a [`FakePool`]: a marker that completes when its flag is set, and goes
    /// back to the pool when dropped.
    #[derive(Debug)]
    pub struct Pooled {
        number: usize,
        flag: Flag,
        pool: FakePool,
    }

    impl Pooled {
        /// The flag of this lending (a test completes it by hand).
        pub fn flag(&self) -> Flag {
            self.flag.clone()
        }
    }

    impl Drop for Pooled {
        fn drop(&mut self) {
            let mut state = self.pool.0.lock();
            state.held -= 1;
            state.free.push(self.number);
        }
    }

    impl Marker for Pooled {
        fn is_complete(&self) -> Result<bool> {
            self.flag.is_complete()
        }

        fn wait(&self) -> Result<()> {
            self.flag.wait()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_keys_order_by_raw_handle() {
        assert!(StreamKey::from_raw(1) < StreamKey::from_raw(2));
        assert_eq!(StreamKey::from_raw(3).as_usize(), 3);
    }

    #[test]
    fn borrowed_keys_are_one_per_raw_handle_and_apart_from_ids_and_private_keys() {
        let raws = [
            0x5555_0000_1000usize,
            0x5555_0000_1010,
            0x5555_0000_1008,
            0x7fff_ffff_fff0,
        ];
        let keys: Vec<StreamKey> = raws
            .iter()
            .map(|&raw| StreamKey::borrowed(raw).expect("a 48-bit address"))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            assert!(key.is_borrowed());
            assert_eq!(
                StreamKey::borrowed(raws[i]),
                Some(*key),
                "one key per raw handle"
            );
            for other in &keys[i + 1..] {
                assert_ne!(key, other, "two raw handles, two keys");
            }
        }
        // Handles 16 bytes apart land on consecutive shards.
        assert_eq!(keys[1].as_usize() - keys[0].as_usize(), 1);
        assert!(StreamKey::borrowed(1 << 48).is_none());
        // Stream ids and graph pools' private keys are never borrowed keys.
        assert!(!StreamKey::from_raw(42).is_borrowed());
        assert!(!StreamKey::LEGACY.is_borrowed());
        let private = (1usize << 63) | (0x7fff_ffff << 32) | 5;
        assert!(!StreamKey::from_raw(private).is_borrowed());
    }
}
