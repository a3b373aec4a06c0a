//! Adoption of dropped streams' free segments, with fake stream ends: a dropped flag, a
//! finished flag (the end event), and a process-wide count the test bumps by hand.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::super::{Engine, Release, StreamEnd, Upstream};
use crate::caching::pool::Segment;
use crate::caching::size_class::{LARGE_SEGMENT, SMALL_SEGMENT};
use crate::caching::stream_uses::StreamKey;
use crate::caching::stream_uses::fake::Flag;
use crate::error::Result;

const MIB: usize = 1 << 20;

/// A stream's end as the test drives it.
#[derive(Debug, Default)]
struct FakeEnd {
    dropped: AtomicBool,
    finished: AtomicBool,
}

impl StreamEnd for FakeEnd {
    fn dropped(&self) -> bool {
        self.dropped.load(Ordering::SeqCst)
    }

    fn finished(&self) -> bool {
        self.dropped() && self.finished.load(Ordering::SeqCst)
    }
}

/// The streams of a test program: each stream's end, and the count of dropped ones.
#[derive(Debug, Default)]
struct Streams {
    ends: Mutex<HashMap<StreamKey, Arc<FakeEnd>>>,
    generation: AtomicU64,
    /// Segments handed out by the upstream.
    allocations: AtomicUsize,
    next: AtomicU64,
}

impl Streams {
    fn end(&self, key: StreamKey) -> Arc<FakeEnd> {
        Arc::clone(self.ends.lock().entry(key).or_default())
    }

    /// The handle of `key` is dropped; its work finishes now or later (`finish`).
    fn drop_stream(&self, key: StreamKey, finished: bool) {
        let end = self.end(key);
        end.finished.store(finished, Ordering::SeqCst);
        end.dropped.store(true, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    fn finish(&self, key: StreamKey) {
        self.end(key).finished.store(true, Ordering::SeqCst);
    }

    /// The upstream as one request on `stream` sees it.
    fn on(&self, stream: StreamKey) -> Request<'_> {
        Request {
            streams: self,
            stream,
        }
    }
}

struct Request<'a> {
    streams: &'a Streams,
    stream: StreamKey,
}

impl Release for Request<'_> {
    fn release_segments(&self, _segments: &[Segment]) -> Result<()> {
        Ok(())
    }
}

impl Upstream for Request<'_> {
    fn allocate_segment(&self, bytes: usize) -> Result<u64> {
        self.streams.allocations.fetch_add(1, Ordering::SeqCst);
        Ok(0x1000_0000
            + self
                .streams
                .next
                .fetch_add(bytes as u64 + 0x10_0000, Ordering::SeqCst))
    }

    fn stream_end(&self) -> Option<Arc<dyn StreamEnd>> {
        Some(self.streams.end(self.stream))
    }

    fn ended_streams(&self) -> u64 {
        self.streams.generation.load(Ordering::SeqCst)
    }
}

fn key(raw: usize) -> StreamKey {
    StreamKey::from_raw(raw)
}

#[test]
fn a_stream_per_request_reuses_one_segment() {
    let engine = Engine::<Flag>::default();
    let streams = Streams::default();
    for request in 1..=100_000 {
        let stream = key(request);
        let grant = engine.allocate(stream, 4096, &streams.on(stream)).unwrap();
        engine.free(grant.stream, grant.id, grant.ptr).unwrap();
        // The request synchronised its stream before dropping it.
        streams.drop_stream(stream, true);
    }
    let stats = engine.stats();
    assert_eq!(streams.allocations.load(Ordering::SeqCst), 1);
    assert_eq!(stats.reserved_bytes.current, SMALL_SEGMENT);
    assert_eq!(stats.segments.current, 1);
    assert!(
        engine.watched_streams().0 + engine.watched_streams().1 <= 2,
        "dropped streams are forgotten: {:?}",
        engine.watched_streams()
    );
    engine.check_invariants();
}

#[test]
fn a_dropped_streams_segments_wait_until_its_work_has_finished() {
    let engine = Engine::<Flag>::default();
    let streams = Streams::default();
    let (a, b, c) = (key(1), key(2), key(3));
    let grant = engine.allocate(a, 4096, &streams.on(a)).unwrap();
    engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    // A is dropped with its work (which used the block) still running.
    streams.drop_stream(a, false);
    let on_b = engine.allocate(b, 4096, &streams.on(b)).unwrap();
    assert_ne!(
        on_b.ptr, grant.ptr,
        "A's segment is not handed to B while A's work may still use it"
    );
    assert_eq!(streams.allocations.load(Ordering::SeqCst), 2);
    // A's work finishes: the next miss (C's first allocation) adopts A's segment.
    streams.finish(a);
    let on_c = engine.allocate(c, 4096, &streams.on(c)).unwrap();
    assert_eq!(on_c.ptr, grant.ptr, "A's idle segment is reused");
    assert_eq!(streams.allocations.load(Ordering::SeqCst), 2);
    assert_eq!(engine.watched_streams(), (2, 0), "A is forgotten");
    engine.check_invariants();
}

#[test]
fn a_segment_still_in_use_stays_with_its_dropped_stream_until_it_is_freed() {
    let engine = Engine::<Flag>::default();
    let streams = Streams::default();
    let (a, b, c) = (key(1), key(2), key(3));
    // Two blocks in one segment of A; one outlives A's handle.
    let kept = engine.allocate(a, 4096, &streams.on(a)).unwrap();
    let freed = engine.allocate(a, 4096, &streams.on(a)).unwrap();
    engine.free(freed.stream, freed.id, freed.ptr).unwrap();
    streams.drop_stream(a, true);
    let on_b = engine.allocate(b, 4096, &streams.on(b)).unwrap();
    assert_ne!(
        on_b.ptr & !(SMALL_SEGMENT as u64 - 1),
        kept.ptr & !(SMALL_SEGMENT as u64 - 1),
        "a partly used segment is not moved"
    );
    assert_eq!(engine.watched_streams().1, 1, "A is remembered");
    engine.free(kept.stream, kept.id, kept.ptr).unwrap();
    let on_c = engine.allocate(c, 4096, &streams.on(c)).unwrap();
    assert_eq!(on_c.ptr, kept.ptr, "wholly free now: adopted");
    assert_eq!(streams.allocations.load(Ordering::SeqCst), 2);
    assert_eq!(engine.watched_streams().1, 0);
    engine.check_invariants();
}

#[test]
fn segments_that_do_not_fit_move_to_the_adopting_stream_and_serve_it_later() {
    let engine = Engine::<Flag>::default();
    let streams = Streams::default();
    let (a, b) = (key(1), key(2));
    let small = engine.allocate(a, 4096, &streams.on(a)).unwrap();
    let large = engine.allocate(a, 3 * MIB, &streams.on(a)).unwrap();
    engine.free(small.stream, small.id, small.ptr).unwrap();
    engine.free(large.stream, large.id, large.ptr).unwrap();
    streams.drop_stream(a, true);
    // B's large miss adopts both of A's segments; the small one serves B's next small request.
    let b_large = engine.allocate(b, 3 * MIB, &streams.on(b)).unwrap();
    assert_eq!(b_large.ptr, large.ptr);
    let b_small = engine.allocate(b, 4096, &streams.on(b)).unwrap();
    assert_eq!(b_small.ptr, small.ptr);
    assert_eq!(streams.allocations.load(Ordering::SeqCst), 2);
    let stats = engine.stats();
    assert_eq!(stats.reserved_bytes.current, SMALL_SEGMENT + LARGE_SEGMENT);
    assert_eq!(stats.segments_released, 0, "moved, not released");
    engine.check_invariants();
}

#[test]
fn nothing_is_looked_at_while_no_watched_stream_has_ended() {
    let engine = Engine::<Flag>::default();
    let streams = Streams::default();
    let (a, b) = (key(1), key(2));
    let grant = engine.allocate(a, 4096, &streams.on(a)).unwrap();
    engine.free(grant.stream, grant.id, grant.ptr).unwrap();
    // A's end is set but the count not bumped: misses do not look.
    streams.end(a).dropped.store(true, Ordering::SeqCst);
    streams.finish(a);
    let on_b = engine.allocate(b, 4096, &streams.on(b)).unwrap();
    assert_ne!(on_b.ptr, grant.ptr);
    assert_eq!(engine.watched_streams(), (2, 0));
}

#[test]
fn a_dropped_streams_pending_blocks_are_polled_before_its_segments_move() {
    let engine = Engine::<Flag>::default();
    let streams = Streams::default();
    let (a, b) = (key(1), key(2));
    let grant = engine.allocate(a, 4096, &streams.on(a)).unwrap();
    // Freed behind a use on another stream (a typed buffer's tracked use).
    let used_elsewhere = Flag::on(9);
    engine
        .free_after(
            grant.stream,
            grant.id,
            grant.ptr,
            vec![used_elsewhere.clone()],
        )
        .unwrap();
    streams.drop_stream(a, true);
    let on_b = engine.allocate(b, 4096, &streams.on(b)).unwrap();
    assert_ne!(on_b.ptr, grant.ptr, "still pending: not moved");
    engine.free(on_b.stream, on_b.id, on_b.ptr).unwrap();
    used_elsewhere.complete();
    // B's own list serves B; a miss on C adopts A's segment, polled on the way.
    let c = key(3);
    let on_c = engine.allocate(c, 4096, &streams.on(c)).unwrap();
    assert_eq!(on_c.ptr, grant.ptr);
    assert_eq!(engine.pending_blocks(), 0);
    assert_eq!(streams.allocations.load(Ordering::SeqCst), 2);
    engine.check_invariants();
}
