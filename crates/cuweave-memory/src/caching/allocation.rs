//! [`CachedAllocation`]: a block handed out by the caching allocator, returned on drop.

use std::fmt;
use std::sync::Arc;

use cuweave_driver::memory::DevicePtr;
use cuweave_driver::stream::WeakStream;
use cuweave_driver::{Device, Stream};

use super::allocator::ShardHandle;
use super::block::BlockId;
use super::pool::Grant;
use super::stream_uses::{StreamKey, borrowed_home_marker, record_use, record_uses};
use crate::buffer::tracker::FreeMarkers;
use crate::error::Result;
use crate::resource::check_stream;

/// Device memory from a [`CachingAllocator`](super::CachingAllocator), returned to its cache
/// when dropped (or by [`free`](Self::free), which reports errors).
///
/// The memory belongs to the stream it was allocated on: returned to that stream's free list,
/// it is handed out again only for that stream, after the work queued there so far. Using it on
/// another stream needs that stream ordered after the allocating one (an event wait) *and*
/// [`record_stream`](Self::record_stream), so that it is not reused while that stream still
/// works on it.
///
/// Device memory is a raw address ([`ptr`](Self::ptr)): what is written there is up to the
/// kernels and copies the caller queues (which are `unsafe` for that reason). Dropping the handle
/// while such work is queued on the allocating stream, or on recorded streams, is fine.
#[must_use = "dropping the allocation frees it at once"]
pub struct CachedAllocation {
    shard: Arc<ShardHandle>,
    id: BlockId,
    ptr: DevicePtr,
    size: usize,
    block_size: usize,
    stream: StreamKey,
    /// Other streams the memory is used on; kept alive until events are recorded on them.
    uses: Vec<Arc<Stream>>,
    /// For a borrowed stream's key, the handle it was allocated on: the free waits for an event
    /// on its stream too ([`borrowed_home_marker`]).
    home: Option<WeakStream>,
    freed: bool,
}

impl CachedAllocation {
    /// The allocation of `grant`, made on `stream` (whose key the grant carries).
    #[inline]
    pub(super) fn new(shard: Arc<ShardHandle>, grant: Grant, size: usize, stream: &Stream) -> Self {
        Self {
            shard,
            id: grant.id,
            ptr: grant.ptr,
            size,
            block_size: grant.size,
            stream: grant.stream,
            uses: Vec::new(),
            home: borrowed_home(grant.stream, stream),
            freed: false,
        }
    }

    /// The device address of the first byte.
    #[inline]
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The bytes asked for.
    #[inline]
    pub fn size(&self) -> usize {
        self.size
    }

    /// Always `false`: allocations are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes of the block behind it (the request rounded up to 512 B, or more when the rest
    /// of a block was too small to split off); all of them are usable.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The stream it was allocated on, whose free list it returns to.
    pub fn stream(&self) -> StreamKey {
        self.stream
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.shard.shared.device
    }

    /// The other streams recorded with [`record_stream`](Self::record_stream).
    pub fn recorded_streams(&self) -> &[Arc<Stream>] {
        &self.uses
    }

    /// Marks the memory as used on `stream` too (PyTorch's `record_stream`): when freed, it is
    /// not handed out again until all work queued on `stream` up to the free has finished.
    ///
    /// An event is recorded on `stream` at free time (not now), so work queued there after this
    /// call is covered as well; the handle keeps `stream` alive until then. Recording the
    /// allocating stream, or a stream twice, does nothing.
    ///
    /// The list stays bounded when a long-lived block is recorded on a new stream per request:
    /// recording a stream not yet recorded first lets go of every recorded stream that nobody
    /// else holds (this handle owns its stream and has its last `Arc`, so no more work can be
    /// queued on it; borrowed and context-relative handles are always kept) and
    /// whose queued work has all finished (`cuStreamQuery`): no use of the memory on it is left
    /// for the free to wait for. Streams held elsewhere are kept without a driver call. Nothing
    /// is let go while a capture is active, and no capture begins during the queries (one
    /// would break it).
    ///
    /// # Errors
    /// [`MemoryError::WrongDevice`](crate::MemoryError::WrongDevice) for a stream of another
    /// device.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use cuweave_driver::{Context, Device, Event, EventFlags, Stream, StreamFlags};
    /// use cuweave_memory::caching::CachingAllocator;
    ///
    /// # fn main() -> cuweave_memory::Result<()> {
    /// let context = Context::primary(Device::get(0)?)?;
    /// let compute = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
    /// let copy = Arc::new(Stream::new(&context, StreamFlags::NON_BLOCKING)?);
    /// let allocator = CachingAllocator::with_driver(&context);
    /// let mut block = allocator.allocate(1 << 20, &compute)?;
    /// // ... fill it on `compute`, then let `copy` read it after that:
    /// let filled = Event::new(&context, EventFlags::DISABLE_TIMING)?;
    /// filled.record(&compute)?;
    /// copy.wait_event(&filled)?;
    /// // ... queue the reads on `copy` ...
    /// block.record_stream(&copy)?;
    /// drop(block); // reused on `compute` only once `copy` has passed its reads
    /// # Ok(())
    /// # }
    /// ```
    pub fn record_stream(&mut self, stream: &Arc<Stream>) -> Result<()> {
        const OPERATION: &str = "CachedAllocation::record_stream";
        check_stream(self.shard.shared.device, stream, OPERATION)?;
        let key = StreamKey::checked(stream, OPERATION)?;
        if key != self.stream && !self.uses.iter().any(|used| StreamKey::of(used) == key) {
            // Only while no capture is active or beginning: these queries are cuweave's own,
            // and one would break another thread's global-mode capture begun between a check
            // and it. Skipped, every recorded stream is kept, as during a capture.
            let mut retired = Vec::new();
            let _ = cuweave_driver::graph::outside_captures(|| {
                // Only a handle that owns its stream can be its last: a borrowed or
                // context-relative handle's stream takes more work through other handles.
                retire_finished_uses(&mut self.uses, &mut retired, |stream| {
                    stream.owns_its_stream() && matches!(stream.query(), Ok(true))
                });
            });
            // Dropped once out of `outside_captures`, which a capture begin waits for: a
            // stream's drop waits for its weak handles' closures and takes the capture records.
            drop(retired);
            self.uses.push(Arc::clone(stream));
        }
        Ok(())
    }

    /// Returns the memory to the cache now, reporting what dropping would only log.
    ///
    /// # Errors
    /// The driver's error when an event could not be recorded on a recorded stream and the
    /// stream could not be synchronised either; the block is then never reused.
    pub fn free(mut self) -> Result<()> {
        self.release()
    }

    #[inline]
    fn release(&mut self) -> Result<()> {
        self.freed = true;
        if cuweave_driver::graph::active_captures() != 0 {
            let uses = std::mem::take(&mut self.uses);
            return super::graph_pool::release_during_capture(
                &self.shard,
                self.id,
                self.ptr,
                self.stream,
                uses,
            );
        }
        if self.uses.is_empty() && self.home.is_none() {
            return self
                .shard
                .shared
                .engine
                .free(self.stream, self.id, self.ptr);
        }
        self.release_recorded()
    }

    /// The slow path of a free: record events on the other streams the memory was used on (and
    /// on a borrowed allocation stream).
    #[cold]
    fn release_recorded(&mut self) -> Result<()> {
        self.free_after_uses(None)
    }

    /// Returns the memory to its stream's cache behind events recorded on every stream it was
    /// used on, on `also` (a stream the free is ordered on), and on a borrowed allocation stream;
    /// when one cannot be recorded (nor its stream synchronised), the block is never reused.
    fn free_after_uses(&mut self, also: Option<&Stream>) -> Result<()> {
        let shared = &self.shard.shared;
        let engine = &shared.engine;
        let uses = std::mem::take(&mut self.uses);
        let recorded =
            record_uses(&uses, shared.context(), &shared.events).and_then(|mut events| {
                if let Some(stream) = also {
                    events.extend(record_use(stream, shared.context(), &shared.events)?);
                }
                if let Some(home) = &self.home {
                    events.extend(borrowed_home_marker(home, shared)?);
                }
                Ok(events)
            });
        match recorded {
            Ok(events) => engine.free_after(self.stream, self.id, self.ptr, events),
            Err(error) => {
                engine.free_never_reuse(self.stream, self.id, self.ptr)?;
                Err(error)
            }
        }
    }
}

/// Moves from `uses` into `retired` the streams whose every use of the memory has finished:
/// those of which `uses` holds the only `Arc` and whose queued work is done. The caller drops
/// `retired` (destroying those streams) when it sees fit.
///
/// A stream that looks done is taken out of its last `Arc` ([`Arc::try_unwrap`]) and asked
/// once more: between the first query and the unwrap another thread could have upgraded a
/// `Weak` of it and queued work; after the unwrap nobody can. In that rare case it is kept, in
/// a new `Arc` (it was nobody else's, so no other handle of it keeps the old identity).
///
/// `finished` says whether a stream's queued work is all done (`cuStreamQuery`; an error
/// counts as not done).
fn retire_finished_uses<S>(
    uses: &mut Vec<Arc<S>>,
    retired: &mut Vec<S>,
    finished: impl Fn(&S) -> bool,
) {
    let recorded = std::mem::take(uses);
    uses.reserve(recorded.len() + 1);
    for used in recorded {
        if Arc::strong_count(&used) != 1 || !finished(&used) {
            uses.push(used);
            continue;
        }
        match Arc::try_unwrap(used) {
            Ok(stream) => {
                if finished(&stream) {
                    retired.push(stream);
                } else {
                    uses.push(Arc::new(stream));
                }
            }
            Err(shared) => uses.push(shared),
        }
    }
}

impl CachedAllocation {
    /// Returns the memory to its stream's cache, to be handed out again only once the work
    /// queued on `stream` so far (and on every recorded stream up to now) has finished: a free
    /// ordered on another stream than the allocating one (what
    /// [`CachingResource::deallocate`](super::CachingResource) needs).
    ///
    /// The caller has checked that no capture is active: an event is recorded on `stream`.
    ///
    /// # Errors
    /// As [`free`](Self::free): the driver's error when no event could be recorded on a stream
    /// and the stream could not be synchronised either; the block is then never reused.
    pub(super) fn free_after_stream(mut self, stream: &Stream) -> Result<()> {
        self.freed = true;
        self.free_after_uses(Some(stream))
    }
}

impl Drop for CachedAllocation {
    #[inline]
    fn drop(&mut self) {
        if self.freed {
            return;
        }
        if let Err(error) = self.release() {
            tracing::error!(%error, ptr = self.ptr, "freeing a cached allocation failed");
        }
    }
}

impl fmt::Debug for CachedAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedAllocation")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("block_size", &self.block_size)
            .field("stream", &self.stream)
            .field("recorded_streams", &self.uses.len())
            .finish()
    }
}

/// A block of a caching allocator held by a typed buffer, whose tracker holds the shard handle
/// (one reference count per buffer instead of two).
#[derive(Debug)]
pub(crate) struct CachedBlock {
    id: BlockId,
    ptr: DevicePtr,
    block_size: usize,
    stream: StreamKey,
    /// For a borrowed stream's key, the handle it was allocated on (see
    /// [`CachedAllocation`]'s).
    home: Option<WeakStream>,
}

impl CachedBlock {
    /// The block of `grant`, allocated on `stream`.
    #[inline]
    pub(crate) fn new(grant: Grant, stream: &Stream) -> Self {
        Self {
            id: grant.id,
            ptr: grant.ptr,
            block_size: grant.size,
            stream: grant.stream,
            home: borrowed_home(grant.stream, stream),
        }
    }

    /// The device address of the first byte.
    #[inline]
    pub(crate) fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The bytes of the block (the request rounded up).
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// The stream it was allocated for.
    pub(crate) fn stream(&self) -> StreamKey {
        self.stream
    }

    /// Returns the block to `shard`'s cache, to be handed out again only once every one of
    /// `markers.events` (recorded behind the uses a typed buffer's tracker saw, on any stream) has
    /// completed; the events then go back to their pool. With no events this is the plain
    /// lock-protected free.
    #[inline]
    pub(crate) fn free(self, shard: &ShardHandle, markers: FreeMarkers) -> Result<()> {
        if markers.during_capture() {
            return super::graph_pool::release_block_during_capture(
                shard,
                self.id,
                self.ptr,
                self.block_size,
                self.stream,
                markers,
            );
        }
        let engine = &shard.shared.engine;
        let mut events = markers.events;
        if let Some(home) = &self.home {
            match borrowed_home_marker(home, &shard.shared) {
                Ok(marker) => events.extend(marker),
                Err(error) => {
                    engine.free_never_reuse(self.stream, self.id, self.ptr)?;
                    return Err(error);
                }
            }
        }
        if events.is_empty() {
            return engine.free(self.stream, self.id, self.ptr);
        }
        engine.free_after(self.stream, self.id, self.ptr, events)
    }
}

/// The handle to keep for a block of `key` allocated on `stream`: `stream`'s weak handle when
/// the key is a borrowed stream's (shared by all its borrowed handles), `None` otherwise.
#[inline]
fn borrowed_home(key: StreamKey, stream: &Stream) -> Option<WeakStream> {
    if key.is_borrowed() {
        stream.downgrade()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Weak};

    use super::retire_finished_uses;

    /// A stand-in for a stream: its queued work is done when `done` is set.
    #[derive(Debug)]
    struct FakeStream {
        name: u32,
        done: AtomicBool,
    }

    impl FakeStream {
        fn is_done(&self) -> bool {
            self.done.load(Ordering::Relaxed)
        }

        fn finish(&self) {
            self.done.store(true, Ordering::Relaxed);
        }
    }

    fn stream(name: u32, done: bool) -> Arc<FakeStream> {
        Arc::new(FakeStream {
            name,
            done: AtomicBool::new(done),
        })
    }

    fn names(uses: &[Arc<FakeStream>]) -> Vec<u32> {
        let mut names: Vec<u32> = uses.iter().map(|s| s.name).collect();
        names.sort_unstable();
        names
    }

    #[test]
    fn only_finished_streams_nobody_else_holds_are_let_go() {
        let held_elsewhere = stream(1, true);
        let mut uses = vec![
            Arc::clone(&held_elsewhere),
            stream(2, true),
            stream(3, false),
            stream(4, true),
        ];
        let weak: Weak<FakeStream> = Arc::downgrade(&uses[1]);
        let mut retired = Vec::new();
        retire_finished_uses(&mut uses, &mut retired, |s| s.is_done());
        assert_eq!(names(&uses), vec![1, 3], "2 and 4 were done and only ours");
        let mut let_go: Vec<u32> = retired.iter().map(|s| s.name).collect();
        let_go.sort_unstable();
        assert_eq!(
            let_go,
            vec![2, 4],
            "let-go streams are handed to the caller to drop"
        );
        assert!(weak.upgrade().is_none(), "a let-go stream has no Arc left");
        // Once the busy one finishes it goes too; the one held elsewhere stays.
        uses.iter().for_each(|s| s.finish());
        retire_finished_uses(&mut uses, &mut retired, |s| s.is_done());
        assert_eq!(names(&uses), vec![1]);
        assert_eq!(retired.len(), 3);
    }

    #[test]
    fn a_stream_that_gets_work_between_the_two_queries_is_kept() {
        // The first query says done, the second (after the last Arc was taken) says busy: work
        // was queued in between through a handle that has gone since.
        let mut uses = vec![stream(7, true)];
        let asked = Cell::new(0);
        let mut retired = Vec::new();
        retire_finished_uses(&mut uses, &mut retired, |_| {
            asked.set(asked.get() + 1);
            asked.get() == 1
        });
        assert_eq!(names(&uses), vec![7]);
        assert!(retired.is_empty());
        assert_eq!(asked.get(), 2);
    }

    #[test]
    fn recording_a_new_stream_per_request_keeps_the_list_bounded() {
        let mut uses = Vec::new();
        let mut most = 0;
        for request in 0..100_000 {
            retire_finished_uses(&mut uses, &mut Vec::new(), |s: &FakeStream| s.is_done());
            // The previous request's stream finished before this one began.
            let new = stream(request, false);
            uses.push(Arc::clone(&new));
            new.finish();
            most = most.max(uses.len());
        }
        assert!(most <= 2, "{most} streams recorded at once");
    }
}
