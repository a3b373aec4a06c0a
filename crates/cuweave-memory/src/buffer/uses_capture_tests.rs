//! The capture rules of the read/write bookkeeping, with fake streams and events: which uses a
//! capturing stream drops (stamped before its capture's known-complete bound), which it refuses
//! to wait for, when captured uses are forgotten, and that nothing is queried while a capture
//! is active.

use cuweave_driver::DriverError;

use std::sync::atomic::Ordering;

use super::tests::{ACTIVE, DEAD, EPOCH, Events, FakeEvent, FakeStream, POOL_OF, QUERIES};
use super::*;
use crate::error::MemoryError;

const CAPTURE: u64 = 7;

/// What the tracker sees on a stream that does not capture while some capture is active.
const EAGER_DURING: CaptureView = CaptureView {
    any_active: true,
    capture: None,
};

fn capturing(id: u64, complete_before: u64) -> CaptureView {
    CaptureView {
        any_active: true,
        capture: Some(Capturing {
            id,
            complete_before,
        }),
    }
}

/// A capture `id` begins: the epoch is bumped (as `begin_capture_synchronized` does before
/// synchronising) and the capture is active. Returns its known-complete bound.
fn begin(id: u64) -> u64 {
    let bound = EPOCH.with(|epoch| {
        epoch.set(epoch.get() + 1);
        epoch.get()
    });
    ACTIVE.with(|active| active.borrow_mut().push(id));
    bound
}

fn end(id: u64) {
    ACTIVE.with(|active| active.borrow_mut().retain(|other| *other != id));
}

fn queries() -> usize {
    QUERIES.with(std::cell::Cell::get)
}

impl UseState<FakeEvent> {
    /// A tracked operation seen through `view`: waits, then records; the events waited for.
    fn op(
        &mut self,
        events: &Events,
        stream: &FakeStream,
        access: Access,
        view: &CaptureView,
    ) -> Result<Vec<usize>> {
        self.op_on(events, stream, ByteRange::WHOLE, access, view)
    }

    /// [`op`](Self::op) on `range` alone.
    fn op_on(
        &mut self,
        events: &Events,
        stream: &FakeStream,
        range: ByteRange,
        access: Access,
        view: &CaptureView,
    ) -> Result<Vec<usize>> {
        self.wait_on_range("test", stream, range, access, view)?;
        self.record_range(stream, range, access, view, events.make())?;
        Ok(stream.take_waits())
    }
}

fn assert_capturing(result: Result<Vec<usize>>) {
    match result {
        Err(MemoryError::Driver(DriverError::Graph(GraphError::Capturing { .. }))) => {}
        other => panic!("expected a Capturing refusal, got {other:?}"),
    }
}

/// A buffer written eagerly on stream 1, and a stream 2 to capture on.
fn written_eagerly() -> (UseState<FakeEvent>, Events, FakeStream, FakeStream) {
    let (mut state, events) = (UseState::default(), Events::default());
    let (eager, cap) = (FakeStream::own(1), FakeStream::own(2));
    state
        .op(&events, &eager, Access::Write, &CaptureView::NONE)
        .unwrap();
    (state, events, eager, cap)
}

#[test]
fn eager_uses_before_the_capture_are_dropped_unwaited_and_unqueried() {
    let (mut state, events, eager, cap) = written_eagerly();
    state
        .op(&events, &eager, Access::Read, &CaptureView::NONE)
        .unwrap();
    let bound = begin(CAPTURE);
    let before = queries();
    // A write inside the capture would wait for the eager write and read: both are known done.
    let waits = state
        .op(&events, &cap, Access::Write, &capturing(CAPTURE, bound))
        .unwrap();
    assert!(waits.is_empty(), "waited on pre-capture events {waits:?}");
    assert_eq!(queries(), before, "an event was queried during the capture");
    assert_eq!(state.tracked(), 1, "only the captured write is tracked");
    end(CAPTURE);
}

#[test]
fn an_eager_use_on_the_stream_that_then_captures_is_refused_not_forgotten() {
    // A capture begun without synchronising (raw `begin_capture`): the bound knows nothing.
    let (mut state, events) = (UseState::default(), Events::default());
    let stream = FakeStream::own(1);
    state
        .op(&events, &stream, Access::Write, &CaptureView::NONE)
        .unwrap();
    begin(CAPTURE);
    let view = capturing(CAPTURE, 0);
    // Stream order does not order a graph after the eager write: refused, nothing queued.
    assert_capturing(state.op(&events, &stream, Access::Write, &view));
    assert_capturing(state.op(&events, &stream, Access::Read, &view));
    assert!(
        stream.take_waits().is_empty(),
        "a refused use queued a wait"
    );
    end(CAPTURE);
    // The eager write is still tracked: another stream still waits for it.
    let other = FakeStream::own(2);
    let waits = state
        .op(&events, &other, Access::Read, &CaptureView::NONE)
        .unwrap();
    assert_eq!(waits.len(), 1, "the eager write's record was lost");
}

#[test]
fn eager_work_after_the_capture_began_is_refused_for_the_capturing_stream() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (other_thread, cap) = (FakeStream::own(1), FakeStream::own(2));
    let bound = begin(CAPTURE);
    // Another thread's eager write, recorded after the epoch was bumped: maybe still running.
    state
        .op(&events, &other_thread, Access::Write, &EAGER_DURING)
        .unwrap();
    let view = capturing(CAPTURE, bound);
    assert_capturing(state.op(&events, &cap, Access::Read, &view));
    assert!(cap.take_waits().is_empty(), "a refused use queued a wait");
    assert!(cap.recorded.borrow().is_empty(), "a refused use recorded");
    // An eager *read* does not conflict with a captured read: both proceed.
    let mut reads = UseState::default();
    reads
        .op(&events, &other_thread, Access::Read, &EAGER_DURING)
        .unwrap();
    assert!(reads.op(&events, &cap, Access::Read, &view).is_ok());
    // Once the capture is over the eager write is an ordinary use again.
    end(CAPTURE);
    let waits = state
        .op(&events, &cap, Access::Read, &CaptureView::NONE)
        .unwrap();
    assert_eq!(waits.len(), 1);
}

#[test]
fn captured_uses_order_the_capture_and_are_forgotten_when_it_ends() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (cap, fork, eager) = (FakeStream::own(1), FakeStream::own(2), FakeStream::own(3));
    let view = capturing(CAPTURE, begin(CAPTURE));
    state.op(&events, &cap, Access::Write, &view).unwrap();
    let written = *cap.recorded.borrow().last().unwrap();
    // A stream forked into the same capture waits for the captured write: a graph edge.
    assert_eq!(
        state.op(&events, &fork, Access::Read, &view).unwrap(),
        vec![written]
    );
    // Eager work during the capture cannot wait for captured work: refused, nothing queued.
    assert_capturing(state.op(&events, &eager, Access::Write, &EAGER_DURING));
    assert_capturing(state.op(&events, &eager, Access::Read, &EAGER_DURING));
    assert!(eager.take_waits().is_empty());
    // The host cannot wait for it either.
    assert!(state.all_events("test", |id| id == CAPTURE).is_err());
    end(CAPTURE);
    // Afterwards the captured uses are forgotten: eager work waits for nothing and succeeds.
    assert!(state.all_events("test", |_| false).unwrap().is_empty());
    let waits = state
        .op(&events, &eager, Access::Write, &CaptureView::NONE)
        .unwrap();
    assert!(waits.is_empty(), "waited on captured events {waits:?}");
    assert_eq!(state.tracked(), 1);
}

#[test]
fn a_use_captured_by_another_active_capture_is_refused() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (a, b) = (FakeStream::own(1), FakeStream::own(2));
    let first = capturing(CAPTURE, begin(CAPTURE));
    state.op(&events, &a, Access::Write, &first).unwrap();
    let second = capturing(CAPTURE + 1, begin(CAPTURE + 1));
    assert_capturing(state.op(&events, &b, Access::Read, &second));
    end(CAPTURE);
    // The first capture ended: its use is forgotten and the second capture proceeds.
    assert!(
        state
            .op(&events, &b, Access::Read, &second)
            .unwrap()
            .is_empty()
    );
    end(CAPTURE + 1);
}

#[test]
fn a_capture_without_a_known_bound_drops_nothing() {
    // Begun without the synchronisation (raw `begin_capture`, or another context): bound 0.
    let (mut state, events, _eager, cap) = written_eagerly();
    begin(CAPTURE);
    assert_capturing(state.op(&events, &cap, Access::Read, &capturing(CAPTURE, 0)));
    end(CAPTURE);
}

#[test]
fn nothing_is_queried_while_a_capture_is_active_and_the_bound_holds() {
    let events = Events::default();
    let view = capturing(CAPTURE, begin(CAPTURE));
    let before = queries();
    // Reads on ever new streams, eager (while the capture runs) and captured: pruning would
    // query, merging does not.
    for seen in [EAGER_DURING, view] {
        let mut state = UseState::default();
        for id in 0..1000 {
            let stream = FakeStream::own(10 + id);
            state.op(&events, &stream, Access::Read, &seen).unwrap();
            assert!(
                state.tracked() <= MAX_USES + 1,
                "tracked {}",
                state.tracked()
            );
        }
    }
    assert_eq!(queries(), before, "an event was queried during a capture");
    end(CAPTURE);
}

#[test]
fn freeing_after_a_capture_never_hands_captured_events_to_be_polled() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (eager, cap) = (FakeStream::own(1), FakeStream::own(2));
    let view = capturing(CAPTURE, begin(CAPTURE));
    state.op(&events, &cap, Access::Write, &view).unwrap();
    state
        .op(&events, &eager, Access::Read, &EAGER_DURING)
        .unwrap_err();
    end(CAPTURE);
    let recorded = state.take_all(|_| true);
    assert!(
        recorded.events.is_empty(),
        "a captured event would be polled"
    );
    assert_eq!(
        recorded.graph_pools,
        vec![CAPTURE],
        "the graph may replay with the memory: the free names its capture"
    );
    assert_eq!(events.held(), 0, "the captured event went back to the pool");
}

#[test]
fn freeing_during_a_capture_names_the_captures_that_used_the_buffer() {
    // The free reads the captures from the uses themselves, so a capture that ends
    // between this hand-off and the block's release cannot send a captured event to be polled,
    // and the block is held for the capture that wrote it, not guessed from the bindings.
    const OTHER: u64 = CAPTURE + 1;
    let (mut state, events) = (UseState::default(), Events::default());
    let (cap, cap2) = (FakeStream::own(2), FakeStream::own(3));
    let view = capturing(CAPTURE, begin(CAPTURE));
    begin(OTHER);
    state.op(&events, &cap, Access::Write, &view).unwrap();
    state.op(&events, &cap, Access::Read, &view).unwrap();
    let taken = state.take_all(|_| false);
    assert_eq!(
        taken.graph_pools,
        vec![CAPTURE],
        "only the capture that used it, once"
    );
    assert!(!taken.events.is_empty());
    drop(taken);
    // Read by two captures after an eager write both know complete: both are named.
    let (mut shared, events2, _eager, cap) = written_eagerly();
    let first = capturing(CAPTURE, begin(CAPTURE));
    let second = capturing(OTHER, begin(OTHER));
    shared.op(&events2, &cap, Access::Read, &first).unwrap();
    shared.op(&events2, &cap2, Access::Read, &second).unwrap();
    let mut named = shared.take_all(|_| false).graph_pools;
    named.sort_unstable();
    assert_eq!(named, vec![CAPTURE, OTHER]);
    // The capture ended before the free: its event is not kept, its id is.
    let mut ended = UseState::default();
    ended.op(&events, &cap, Access::Write, &view).unwrap();
    let taken = ended.take_all(|id| id == CAPTURE);
    assert!(taken.events.is_empty());
    assert_eq!(taken.graph_pools, vec![CAPTURE]);
    end(OTHER);
    end(OTHER);
    end(CAPTURE);
}

#[test]
fn captures_begun_and_ended_many_times_keep_the_state_bounded() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (eager, cap, fork) = (FakeStream::own(1), FakeStream::own(2), FakeStream::own(3));
    // Recaptured into one graph pool, as a serving loop does.
    POOL_OF.with(|pool| pool.set(Some(CAPTURE)));
    for id in 1..=100_000u64 {
        state
            .op(&events, &eager, Access::Write, &CaptureView::NONE)
            .unwrap();
        state
            .op(&events, &eager, Access::Read, &CaptureView::NONE)
            .unwrap();
        let view = capturing(id, begin(id));
        assert!(
            state
                .op(&events, &cap, Access::Read, &view)
                .unwrap()
                .is_empty()
        );
        state.op(&events, &fork, Access::Write, &view).unwrap();
        end(id);
        assert!(state.tracked() <= 2);
        assert_eq!(state.graphs_remembered(), 1);
    }
    POOL_OF.with(|pool| pool.set(None));
    assert!(
        events.made.get() <= 8,
        "{} events made: they are not reused",
        events.made.get()
    );
}

#[test]
fn eager_work_waits_for_the_launches_of_the_captures_that_used_the_buffer_and_stays_bounded() {
    const WHOLE: ByteRange = ByteRange::WHOLE;
    let (mut state, events, _eager, cap) = written_eagerly();
    assert!(
        !state.waits_for_capture(CAPTURE, WHOLE, Access::Write),
        "no capture used it yet"
    );
    assert_eq!(state.launches_after(WHOLE, Access::Write), None);
    let first = 1_000u64;
    for id in first..first + CAPTURES_KEPT as u64 {
        let view = capturing(id, begin(id));
        state.op(&events, &cap, Access::Read, &view).unwrap();
        end(id);
    }
    for id in first..first + CAPTURES_KEPT as u64 {
        assert!(
            state.waits_for_capture(id, WHOLE, Access::Write),
            "capture {id} read the buffer: an eager write waits for its launches"
        );
        assert!(
            !state.waits_for_capture(id, WHOLE, Access::Read),
            "capture {id} only read the buffer: an eager read overlaps its launches"
        );
    }
    assert!(
        !state.waits_for_capture(first - 1, WHOLE, Access::Write),
        "a capture that never used the buffer: its graphs' launches are not waited for"
    );
    // Launches wait for an eager write (all the captures read it), not for an eager read.
    let kept: Vec<u64> = (first..first + CAPTURES_KEPT as u64).collect();
    assert_eq!(
        state.launches_after(WHOLE, Access::Write),
        Some(FencedCaptures::These(kept))
    );
    assert_eq!(state.launches_after(WHOLE, Access::Read), None);
    // A capture that writes it: eager reads wait for its launches too, and its launches for
    // eager reads.
    let writer = first + 1;
    let view = capturing(writer, begin(writer));
    state.op(&events, &cap, Access::Write, &view).unwrap();
    end(writer);
    assert!(state.waits_for_capture(writer, WHOLE, Access::Read));
    assert!(!state.waits_for_capture(first, WHOLE, Access::Read));
    assert_eq!(
        state.launches_after(WHOLE, Access::Read),
        Some(FencedCaptures::These(vec![writer]))
    );
    // One capture more than are kept: every fenced launch is waited for (more, never less).
    let id = first + CAPTURES_KEPT as u64;
    let view = capturing(id, begin(id));
    state.op(&events, &cap, Access::Read, &view).unwrap();
    end(id);
    assert!(
        state.waits_for_capture(id, WHOLE, Access::Write)
            && state.waits_for_capture(first - 1, WHOLE, Access::Write)
    );
    assert!(
        state.waits_for_capture(first - 1, WHOLE, Access::Read),
        "a capture wrote the buffer: past the kept ones, reads wait for every launch"
    );
    assert_eq!(
        state.launches_after(WHOLE, Access::Read),
        Some(FencedCaptures::Any)
    );
    assert_eq!(
        state.launches_after(WHOLE, Access::Write),
        Some(FencedCaptures::Any)
    );
}

#[test]
fn graph_launches_and_eager_work_on_disjoint_bytes_are_not_ordered() {
    // A capture writes bytes 0..1024 and reads 4096..8192 (a KV cache's slots, say).
    let (mut state, events, _eager, cap) = written_eagerly();
    let view = capturing(CAPTURE, begin(CAPTURE));
    state
        .op_on(&events, &cap, ByteRange::new(0, 1024), Access::Write, &view)
        .unwrap();
    state
        .op_on(
            &events,
            &cap,
            ByteRange::new(4096, 4096),
            Access::Read,
            &view,
        )
        .unwrap();
    end(CAPTURE);
    let cases = [
        // (eager range, access, ordered with the capture's launches)
        (ByteRange::new(512, 16), Access::Read, true),
        (ByteRange::new(512, 16), Access::Write, true),
        (ByteRange::new(5000, 16), Access::Write, true),
        (ByteRange::new(5000, 16), Access::Read, false),
        (ByteRange::new(1 << 20, 64), Access::Write, false),
        (ByteRange::new(1 << 20, 64), Access::Read, false),
    ];
    for (range, access, ordered) in cases {
        assert_eq!(
            state.waits_for_capture(CAPTURE, range, access),
            ordered,
            "eager {access:?} of {range:?} waiting for the launches"
        );
        assert_eq!(
            state.launches_after(range, access).is_some(),
            ordered,
            "launches waiting for an eager {access:?} of {range:?}"
        );
    }
}

#[test]
fn fenced_captures_merge_without_repeats_and_any_absorbs_the_rest() {
    let mut fenced = FencedCaptures::These(vec![1, 2]);
    fenced.merge(FencedCaptures::These(vec![2, 3]));
    assert_eq!(fenced, FencedCaptures::These(vec![1, 2, 3]));
    fenced.merge(FencedCaptures::Any);
    assert_eq!(fenced, FencedCaptures::Any);
    fenced.merge(FencedCaptures::These(vec![4]));
    assert_eq!(fenced, FencedCaptures::Any);
}

#[test]
fn a_buffer_used_in_a_capture_is_remembered_after_the_capture_ended() {
    // Allocated and written eagerly, used inside a capture, then used eagerly again after the
    // capture ended (which forgets the captured use): the free still names the capture, whose
    // graph may replay with the memory.
    let (mut state, events, eager, cap) = written_eagerly();
    let view = capturing(CAPTURE, begin(CAPTURE));
    state.op(&events, &cap, Access::Read, &view).unwrap();
    end(CAPTURE);
    state
        .op(&events, &eager, Access::Write, &CaptureView::NONE)
        .unwrap();
    let taken = state.take_all(|_| true);
    assert_eq!(taken.graph_pools, vec![CAPTURE]);
    assert!(!state.used_in_graphs(), "taken out with the events");
    // Never used in a capture: nothing to name (the free's plain path).
    let (mut eager_only, _, _, _) = written_eagerly();
    assert!(eager_only.take_all(|_| true).graph_pools.is_empty());
}

#[test]
fn the_pools_remembered_per_buffer_stay_bounded_and_name_every_live_one() {
    // Used by capture after capture, each into its own pool; every pool but the last 20 has
    // died by the free (in this fake a capture's pool tag is its id).
    let (mut state, events) = (UseState::default(), Events::default());
    let cap = FakeStream::own(2);
    for id in 1_000..101_000u64 {
        let view = capturing(id, begin(id));
        state.op(&events, &cap, Access::Write, &view).unwrap();
        end(id);
        if id >= 20 {
            DEAD.with(|dead| dead.borrow_mut().insert(id - 20));
        }
        assert!(state.graphs_remembered() <= 2 * PRUNE_GRAPHS_AT + 20);
    }
    let taken = state.take_all(|_| true);
    assert!(!taken.graph_pools.contains(&NO_POOL), "nothing stands in");
    for live in 100_980..101_000u64 {
        assert!(taken.graph_pools.contains(&live), "pool {live} is alive");
    }
    // Recaptured into one pool: one entry.
    let mut one = UseState::default();
    for id in 200_000..300_000u64 {
        let view = capturing(id, begin(id));
        POOL_OF.with(|pool| pool.set(Some(7)));
        one.op(&events, &cap, Access::Write, &view).unwrap();
        end(id);
    }
    POOL_OF.with(|pool| pool.set(None));
    assert_eq!(one.take_all(|_| true).graph_pools, vec![7]);
}

/// A stream whose captures are bound in the real graph-pool registry.
struct RegistryStream(FakeStream);

impl UseStream for RegistryStream {
    type Event = FakeEvent;

    fn raw(&self) -> usize {
        self.0.raw()
    }

    fn id(&self) -> u64 {
        self.0.id()
    }

    fn wait_for(&self, event: &FakeEvent) -> Result<()> {
        self.0.wait_for(event)
    }

    fn record(&self, event: &FakeEvent) -> Result<()> {
        self.0.record(event)
    }

    fn capture_epoch(&self) -> u64 {
        self.0.capture_epoch()
    }

    fn capture_is_active(&self, id: u64) -> bool {
        self.0.capture_is_active(id)
    }
}

#[rstest::rstest]
#[case::recaptured_into_one_pool(true)]
#[case::a_new_pool_per_capture(false)]
fn a_buffer_recaptured_many_times_is_held_while_a_pool_lives_then_returned(#[case] one_pool: bool) {
    // A serving loop: one buffer used by capture after capture (past the 16 ids a buffer once
    // kept, and past the 1024 ended bindings once remembered), then freed. It is held while a
    // pool of those captures lives, returned when none does, never stranded.
    use crate::caching::GraphPool;
    use crate::caching::graph_pool_test_support::{bind, hold, returned_eventually};
    let (mut state, events) = (UseState::default(), Events::default());
    let stream = RegistryStream(FakeStream::own(2));
    let shared = GraphPool::new();
    let mut current = GraphPool::new();
    let base = if one_pool { 1 << 40 } else { 2 << 40 };
    for round in 0..3_000u64 {
        if !one_pool {
            // The previous graph, and with it its pool, is replaced.
            current = GraphPool::new();
        }
        let id = base + round;
        let guard = bind(id, if one_pool { &shared } else { &current });
        let view = capturing(id, begin(id));
        state
            .record_range(
                &stream,
                ByteRange::WHOLE,
                Access::Write,
                &view,
                events.make(),
            )
            .unwrap();
        end(id);
        drop(guard);
    }
    let taken = state.take_all(|_| true);
    assert!(
        taken.graph_pools.len() <= 2 * PRUNE_GRAPHS_AT,
        "{} pools remembered",
        taken.graph_pools.len()
    );
    assert!(!taken.graph_pools.contains(&NO_POOL));
    let returned = hold(&taken.graph_pools, 512);
    assert_eq!(
        returned.load(Ordering::SeqCst),
        0,
        "the last graph may still replay"
    );
    drop((shared, current));
    assert_eq!(
        returned_eventually(&returned, 1),
        1,
        "returned once every pool of its captures died"
    );
}

#[test]
fn a_use_recorded_before_its_capture_was_bound_names_the_pool_bound_later() {
    // A capture is bound to its pool only once it has begun: a use recorded in between found
    // no pool. Looked up again later (next record, or the free), it names the pool, in a
    // recapture loop too, instead of stranding the buffer for good.
    use crate::caching::GraphPool;
    use crate::caching::graph_pool_test_support::{bind, hold, returned_eventually};
    let (mut state, events) = (UseState::default(), Events::default());
    let stream = RegistryStream(FakeStream::own(2));
    let pool = GraphPool::new();
    let base = 3 << 40;
    let mut tag = NO_POOL;
    for round in 0..3_000u64 {
        let id = base + round;
        let view = capturing(id, begin(id));
        state
            .record_range(
                &stream,
                ByteRange::WHOLE,
                Access::Write,
                &view,
                events.make(),
            )
            .unwrap();
        let guard = bind(id, &pool);
        tag = crate::caching::pool_tag_of_capture(id);
        end(id);
        drop(guard);
        assert!(state.unbound.len() <= 1, "settled once ended");
    }
    let taken = state.take_all(|_| true);
    assert_eq!(taken.graph_pools, vec![tag], "the pool, never NO_POOL");
    let returned = hold(&taken.graph_pools, 512);
    assert_eq!(returned.load(Ordering::SeqCst), 0, "the graph may replay");
    drop(pool);
    assert_eq!(
        returned_eventually(&returned, 1),
        1,
        "returned, not stranded"
    );
}

#[test]
fn rebinding_a_capture_to_another_pool_is_refused_and_its_buffers_stay_with_the_first() {
    // The capture's graph keeps only the pool it was bound to: a rebind to another pool would
    // tag later uses with a pool the graph does not keep alive (freed under a replaying
    // graph). The rebind is refused, the binding stays, and later uses name the first pool.
    use crate::caching::GraphPool;
    use crate::caching::graph_pool_test_support::{bind, hold, returned_eventually, try_bind};
    let (mut state, events) = (UseState::default(), Events::default());
    let stream = RegistryStream(FakeStream::own(2));
    let (old, new) = (GraphPool::new(), GraphPool::new());
    let id = 4 << 40;
    let view = capturing(id, begin(id));
    let first = bind(id, &old);
    let old_tag = crate::caching::pool_tag_of_capture(id);
    let record = |state: &mut UseState<FakeEvent>| {
        state
            .record_range(
                &stream,
                ByteRange::WHOLE,
                Access::Write,
                &view,
                events.make(),
            )
            .unwrap();
    };
    record(&mut state);
    match try_bind(id, &new) {
        Err(MemoryError::CaptureBoundToAnotherPool {
            capture,
            bound,
            requested,
            ..
        }) => assert_eq!((capture, bound, requested), (id, old.id(), new.id())),
        other => panic!("expected the rebind to be refused, got {other:?}"),
    }
    assert_eq!(
        crate::caching::pool_tag_of_capture(id),
        old_tag,
        "the binding to the first pool is intact"
    );
    // Binding the same pool again is fine.
    let again = bind(id, &old);
    record(&mut state);
    end(id);
    drop((first, again));
    let taken = state.take_all(|_| true);
    assert_eq!(
        taken.graph_pools,
        vec![old_tag],
        "only the graph's own pool"
    );
    let returned = hold(&taken.graph_pools, 512);
    drop(new);
    assert_eq!(
        returned.load(Ordering::SeqCst),
        0,
        "the first pool's graph may replay into it"
    );
    drop(old);
    assert_eq!(returned_eventually(&returned, 1), 1);
}
