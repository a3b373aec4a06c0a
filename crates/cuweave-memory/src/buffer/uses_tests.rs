//! The read/write rules with fake streams and events: who waits for what, which event is
//! recorded, when a wait is skipped, and when finished reads are dropped. The fake events come
//! from a fake pool, as the real ones come from the context's event pool: a retired event goes
//! back there, and the pool makes a new one only when every one it made is held.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::*;
use crate::error::MemoryError;

thread_local! {
    /// The fake capture epoch (what `capture_state().epoch` reads).
    pub(super) static EPOCH: Cell<u64> = const { Cell::new(0) };
    /// The ids of the fake captures still active.
    pub(super) static ACTIVE: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// How many events were queried.
    pub(super) static QUERIES: Cell<usize> = const { Cell::new(0) };
    /// The fake graph pools that have died (a capture's pool tag is its id, or `POOL_OF`).
    pub(super) static DEAD: RefCell<std::collections::HashSet<u64>> =
        RefCell::new(std::collections::HashSet::new());
    /// When set, the pool every capture is bound to.
    pub(super) static POOL_OF: Cell<Option<u64>> = const { Cell::new(None) };
}

/// An event with a number, completed by hand; its number goes back to its pool on drop.
#[derive(Debug)]
pub(super) struct FakeEvent {
    pub(super) number: usize,
    pub(super) complete: AtomicBool,
    free: Arc<Mutex<Vec<usize>>>,
}

impl Drop for FakeEvent {
    fn drop(&mut self) {
        self.free.lock().push(self.number);
    }
}

impl UseEvent for FakeEvent {
    fn is_complete(&self) -> Result<bool> {
        QUERIES.with(|queries| queries.set(queries.get() + 1));
        Ok(self.complete.load(Ordering::SeqCst))
    }
}

/// A stream that logs the events it waits for and records.
#[derive(Debug)]
pub(super) struct FakeStream {
    raw: usize,
    id: u64,
    pub(super) waited: RefCell<Vec<usize>>,
    pub(super) recorded: RefCell<Vec<usize>>,
    fail_records: Cell<bool>,
}

impl FakeStream {
    fn new(raw: usize, id: u64) -> Self {
        Self {
            raw,
            id,
            waited: RefCell::default(),
            recorded: RefCell::default(),
            fail_records: Cell::new(false),
        }
    }

    /// A stream of its own (raw handle and id both unique).
    pub(super) fn own(id: u64) -> Self {
        Self::new(0x1000 + id as usize, id)
    }

    pub(super) fn take_waits(&self) -> Vec<usize> {
        let mut waits = std::mem::take(&mut *self.waited.borrow_mut());
        waits.sort_unstable();
        waits
    }
}

impl UseStream for FakeStream {
    type Event = FakeEvent;

    fn raw(&self) -> usize {
        self.raw
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn wait_for(&self, event: &FakeEvent) -> Result<()> {
        self.waited.borrow_mut().push(event.number);
        Ok(())
    }

    fn record(&self, event: &FakeEvent) -> Result<()> {
        if self.fail_records.get() {
            return Err(MemoryError::ZeroLength {
                operation: "fake record failure",
            });
        }
        event.complete.store(false, Ordering::SeqCst);
        self.recorded.borrow_mut().push(event.number);
        Ok(())
    }

    fn capture_epoch(&self) -> u64 {
        EPOCH.with(Cell::get)
    }

    fn capture_is_active(&self, id: u64) -> bool {
        ACTIVE.with(|active| active.borrow().contains(&id))
    }

    fn graph_pool_of(&self, capture: u64) -> u64 {
        POOL_OF.with(Cell::get).unwrap_or(capture)
    }

    fn graph_pool_is_live(&self, tag: u64) -> bool {
        !DEAD.with(|dead| dead.borrow().contains(&tag))
    }
}

/// A fake event pool: lends a free numbered event, or makes one (and counts it) when none is
/// free.
#[derive(Default)]
pub(super) struct Events {
    pub(super) made: Cell<usize>,
    free: Arc<Mutex<Vec<usize>>>,
}

impl Events {
    pub(super) fn make(&self) -> impl FnOnce() -> Result<Arc<FakeEvent>> + '_ {
        || {
            let reused = self.free.lock().pop();
            let number = reused.unwrap_or_else(|| {
                self.made.set(self.made.get() + 1);
                self.made.get()
            });
            Ok(Arc::new(FakeEvent {
                number,
                complete: AtomicBool::new(false),
                free: Arc::clone(&self.free),
            }))
        }
    }

    /// Events lent out now.
    pub(super) fn held(&self) -> usize {
        self.made.get() - self.free.lock().len()
    }
}

/// Waits as a tracked operation would, then records.
fn use_on(
    state: &mut UseState<FakeEvent>,
    events: &Events,
    stream: &FakeStream,
    access: Access,
) -> Vec<usize> {
    state.wait_on(stream, access).unwrap();
    state.record(stream, access, events.make()).unwrap();
    stream.take_waits()
}

fn last_recorded(stream: &FakeStream) -> usize {
    *stream.recorded.borrow().last().expect("recorded something")
}

#[test]
fn readers_on_two_streams_wait_for_the_writer_only() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (w, a, b) = (FakeStream::own(1), FakeStream::own(2), FakeStream::own(3));
    assert!(
        use_on(&mut state, &events, &w, Access::Write).is_empty(),
        "first use waits for nothing"
    );
    let write_event = last_recorded(&w);
    assert_eq!(use_on(&mut state, &events, &a, Access::Read), [write_event]);
    assert_eq!(
        use_on(&mut state, &events, &b, Access::Read),
        [write_event],
        "the second reader does not wait for the first"
    );
    assert_eq!(state.readers(), 2);
    assert_ne!(
        last_recorded(&a),
        last_recorded(&b),
        "one event per reading stream"
    );
}

#[test]
fn a_writer_waits_for_every_reader_since_the_last_write() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (w, a, b, c) = (
        FakeStream::own(1),
        FakeStream::own(2),
        FakeStream::own(3),
        FakeStream::own(4),
    );
    use_on(&mut state, &events, &w, Access::Write);
    use_on(&mut state, &events, &a, Access::Read);
    use_on(&mut state, &events, &b, Access::Read);
    let mut expected = vec![last_recorded(&w), last_recorded(&a), last_recorded(&b)];
    expected.sort_unstable();
    assert_eq!(use_on(&mut state, &events, &c, Access::Write), expected);
    assert_eq!(state.readers(), 0, "the reads are behind the new write");
    // The next reader waits for the new write only.
    assert_eq!(
        use_on(&mut state, &events, &a, Access::Read),
        [last_recorded(&c)]
    );
    // Host access waits for the write and the read.
    assert_eq!(state.all_events("test", |_| false).unwrap().len(), 2);
}

#[test]
fn a_writer_on_a_reading_stream_skips_that_streams_read() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (w, a) = (FakeStream::own(1), FakeStream::own(2));
    use_on(&mut state, &events, &w, Access::Write);
    use_on(&mut state, &events, &a, Access::Read);
    assert_eq!(
        use_on(&mut state, &events, &a, Access::Write),
        [last_recorded(&w)],
        "its own read is ordered by the stream"
    );
}

#[test]
fn repeated_uses_on_the_last_stream_skip_the_wait_and_reuse_the_event() {
    let (mut state, events) = (UseState::default(), Events::default());
    let a = FakeStream::own(7);
    for _ in 0..5 {
        assert!(use_on(&mut state, &events, &a, Access::Write).is_empty());
    }
    assert_eq!(events.made.get(), 1, "one event, re-recorded");
    assert_eq!(*a.recorded.borrow(), [1; 5]);
    for _ in 0..5 {
        assert!(use_on(&mut state, &events, &a, Access::Read).is_empty());
    }
    assert_eq!(state.readers(), 1, "a stream's reads share one entry");
    assert_eq!(events.made.get(), 2);
}

#[test]
fn events_of_finished_reads_are_reused_after_a_write() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (a, b, c) = (FakeStream::own(1), FakeStream::own(2), FakeStream::own(3));
    use_on(&mut state, &events, &a, Access::Read);
    use_on(&mut state, &events, &b, Access::Read);
    use_on(&mut state, &events, &c, Access::Write);
    use_on(&mut state, &events, &a, Access::Read);
    use_on(&mut state, &events, &b, Access::Read);
    assert_eq!(
        events.made.get(),
        3,
        "the two read events went back to the pool and were lent again"
    );
}

#[test]
fn default_streams_never_skip_a_wait() {
    let (mut state, events) = (UseState::default(), Events::default());
    // Blocking operations make a fresh handle of the legacy stream each time.
    let (legacy_1, legacy_2) = (FakeStream::new(0, 100), FakeStream::new(0, 101));
    let per_thread = FakeStream::new(2, 102);
    use_on(&mut state, &events, &legacy_1, Access::Write);
    let write_event = last_recorded(&legacy_1);
    assert_eq!(
        use_on(&mut state, &events, &legacy_1, Access::Write),
        [write_event]
    );
    assert_eq!(
        use_on(&mut state, &events, &per_thread, Access::Write),
        [write_event]
    );
    let write_event = last_recorded(&per_thread);
    assert_eq!(
        use_on(&mut state, &events, &per_thread, Access::Read),
        [write_event]
    );
    assert_eq!(
        use_on(&mut state, &events, &legacy_2, Access::Read),
        [write_event]
    );
}

#[test]
fn legacy_reads_share_one_entry_and_per_thread_reads_are_pruned_once_finished() {
    let (mut state, events) = (UseState::default(), Events::default());
    for id in 0..20 {
        use_on(
            &mut state,
            &events,
            &FakeStream::new(0, 100 + id),
            Access::Read,
        );
    }
    assert_eq!(state.readers(), 1, "the legacy stream is one stream");
    let per_thread: Vec<FakeStream> = (0..20).map(|id| FakeStream::new(2, 200 + id)).collect();
    for stream in &per_thread[..PRUNE_READS_AT] {
        use_on(&mut state, &events, stream, Access::Read);
    }
    assert_eq!(state.readers(), PRUNE_READS_AT + 1);
    // Nothing has finished: nothing is pruned.
    use_on(
        &mut state,
        &events,
        &per_thread[PRUNE_READS_AT],
        Access::Read,
    );
    assert_eq!(state.readers(), PRUNE_READS_AT + 2);
    for event in state.all_events("test", |_| false).unwrap() {
        event.complete.store(true, Ordering::SeqCst);
    }
    use_on(
        &mut state,
        &events,
        &per_thread[PRUNE_READS_AT + 1],
        Access::Read,
    );
    assert_eq!(state.readers(), 1, "finished reads were dropped");
}

#[test]
fn a_failed_write_record_keeps_the_earlier_uses() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (w, a, c) = (FakeStream::own(1), FakeStream::own(2), FakeStream::own(3));
    use_on(&mut state, &events, &w, Access::Write);
    use_on(&mut state, &events, &a, Access::Read);
    c.fail_records.set(true);
    state.wait_on(&c, Access::Write).unwrap();
    assert!(state.record(&c, Access::Write, events.make()).is_err());
    assert_eq!(state.readers(), 1);
    assert_eq!(
        state.all_events("test", |_| false).unwrap().len(),
        2,
        "the write and the read are still tracked"
    );
    let next = FakeStream::own(4);
    let mut expected = vec![last_recorded(&w), last_recorded(&a)];
    expected.sort_unstable();
    assert_eq!(use_on(&mut state, &events, &next, Access::Write), expected);
}

#[test]
fn a_completed_blocking_write_leaves_nothing_to_wait_for() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (w, a, legacy) = (
        FakeStream::own(1),
        FakeStream::own(2),
        FakeStream::new(0, 99),
    );
    use_on(&mut state, &events, &w, Access::Write);
    use_on(&mut state, &events, &a, Access::Read);
    let mut expected = vec![last_recorded(&w), last_recorded(&a)];
    expected.sort_unstable();
    // A blocking write: the legacy stream waits for both, runs, is synchronized, settles.
    state.wait_on(&legacy, Access::Write).unwrap();
    assert_eq!(legacy.take_waits(), expected);
    state.settle_completed(&legacy, Access::Write);
    assert!(
        state.all_events("test", |_| false).unwrap().is_empty(),
        "everything before it has finished"
    );
    assert!(
        legacy.recorded.borrow().is_empty(),
        "a finished use records nothing"
    );
    assert_eq!(events.held(), 0, "their events went back to the pool");
    // The next use on any stream waits for nothing, and reuses a pooled event.
    assert!(use_on(&mut state, &events, &a, Access::Read).is_empty());
    assert_eq!(
        events.made.get(),
        2,
        "no new event: a pooled one was reused"
    );
}

#[test]
fn a_completed_blocking_read_forgets_the_write_but_keeps_other_readers() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (w, a, legacy) = (
        FakeStream::own(1),
        FakeStream::own(2),
        FakeStream::new(0, 99),
    );
    use_on(&mut state, &events, &w, Access::Write);
    use_on(&mut state, &events, &a, Access::Read);
    let read_event = last_recorded(&a);
    state.wait_on(&legacy, Access::Read).unwrap();
    assert_eq!(
        legacy.take_waits(),
        [last_recorded(&w)],
        "a read waits for the write only"
    );
    state.settle_completed(&legacy, Access::Read);
    assert_eq!(state.readers(), 1, "the other stream's read may still run");
    // A later writer still waits for that read, and for nothing else.
    assert_eq!(use_on(&mut state, &events, &w, Access::Write), [read_event]);
}

/// Waits as a tracked operation on `range` would, then records.
fn use_range(
    state: &mut UseState<FakeEvent>,
    events: &Events,
    stream: &FakeStream,
    range: (usize, usize),
    access: Access,
) -> Vec<usize> {
    let range = ByteRange::new(range.0, range.1 - range.0);
    state
        .wait_on_range("test", stream, range, access, &CaptureView::NONE)
        .unwrap();
    state
        .record_range(stream, range, access, &CaptureView::NONE, events.make())
        .unwrap();
    stream.take_waits()
}

#[test]
fn writers_of_disjoint_ranges_do_not_wait_for_each_other() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (a, b, c) = (FakeStream::own(1), FakeStream::own(2), FakeStream::own(3));
    assert!(use_range(&mut state, &events, &a, (0, 512), Access::Write).is_empty());
    assert!(
        use_range(&mut state, &events, &b, (512, 1024), Access::Write).is_empty(),
        "the other half is not ordered after the first"
    );
    let (first, second) = (last_recorded(&a), last_recorded(&b));
    // Overlapping both halves: waits for both writers.
    assert_eq!(
        use_range(&mut state, &events, &c, (256, 768), Access::Read),
        [first, second]
    );
    // A read of the first half only waits for its writer.
    assert_eq!(
        use_range(&mut state, &events, &b, (0, 100), Access::Read),
        [first]
    );
    // A writer of the whole buffer waits for everything and retires it all.
    let all = [first, second, last_recorded(&c)];
    let d = FakeStream::own(4);
    let waits = use_range(&mut state, &events, &d, (0, 1024), Access::Write);
    assert!(all.iter().all(|event| waits.contains(event)), "{waits:?}");
    assert_eq!(state.tracked(), 1, "one write stands for the whole buffer");
}

#[test]
fn a_partly_overwritten_range_stays_tracked_for_its_other_bytes() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (a, b, c) = (FakeStream::own(1), FakeStream::own(2), FakeStream::own(3));
    use_range(&mut state, &events, &a, (0, 1000), Access::Write);
    let old = last_recorded(&a);
    use_range(&mut state, &events, &b, (0, 500), Access::Write);
    assert_eq!(
        use_range(&mut state, &events, &c, (600, 700), Access::Read),
        [old],
        "bytes the second write did not cover still wait for the first"
    );
}

#[test]
fn chunks_written_in_turn_on_one_stream_are_pruned_with_a_few_queries() {
    let (mut state, events) = (UseState::default(), Events::default());
    let a = FakeStream::own(1);
    // Every event made, in order; the "GPU" runs three chunks behind the host.
    let made: RefCell<Vec<Arc<FakeEvent>>> = RefCell::default();
    QUERIES.with(|queries| queries.set(0));
    for chunk in 0..1000usize {
        let range = ByteRange::new(chunk * 64, 64);
        state
            .wait_on_range("test", &a, range, Access::Write, &CaptureView::NONE)
            .unwrap();
        let make = events.make();
        state
            .record_range(&a, range, Access::Write, &CaptureView::NONE, || {
                let event = make()?;
                made.borrow_mut().push(Arc::clone(&event));
                Ok(event)
            })
            .unwrap();
        assert!(state.tracked() <= MAX_USES, "{} uses", state.tracked());
        let made = made.borrow();
        for event in &made[..made.len().saturating_sub(3)] {
            event.complete.store(true, Ordering::SeqCst);
        }
    }
    // One query per use at each prune would be about 33 every 30 chunks (over 1,000 here).
    let queries = QUERIES.with(Cell::get);
    assert!(queries <= 250, "{queries} queries for 1000 chunks");
    assert!(
        a.take_waits().is_empty(),
        "nothing to wait for on its own stream"
    );
}

#[test]
fn a_consumer_of_an_early_chunk_waits_for_that_chunk_only() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (a, b) = (FakeStream::own(1), FakeStream::own(2));
    // The producer queues every chunk first, the consumer reads them afterwards.
    let written: Vec<usize> = (0..4usize)
        .map(|chunk| {
            use_range(
                &mut state,
                &events,
                &a,
                (chunk * 64, (chunk + 1) * 64),
                Access::Write,
            );
            last_recorded(&a)
        })
        .collect();
    for (chunk, event) in written.iter().enumerate() {
        assert_eq!(
            use_range(
                &mut state,
                &events,
                &b,
                (chunk * 64, (chunk + 1) * 64),
                Access::Read
            ),
            [*event],
            "chunk {chunk} waits for its own write, not for the chunks after it"
        );
    }
    // Overwriting chunk 0 waits for its read only, not for the read of chunk 1 after it.
    let read_of_first = {
        let recorded = b.recorded.borrow();
        recorded[recorded.len() - 4]
    };
    assert_eq!(
        use_range(&mut state, &events, &a, (0, 64), Access::Write),
        [read_of_first]
    );
}

#[test]
fn adjacent_writes_on_two_streams_stay_apart() {
    let (mut state, events) = (UseState::default(), Events::default());
    let (a, b, c) = (FakeStream::own(1), FakeStream::own(2), FakeStream::own(3));
    use_range(&mut state, &events, &a, (0, 100), Access::Write);
    use_range(&mut state, &events, &b, (100, 200), Access::Write);
    assert_eq!(state.tracked(), 2, "no stream order between them");
    assert_eq!(
        use_range(&mut state, &events, &c, (0, 50), Access::Read),
        [last_recorded(&a)],
        "the first half waits for its own writer only"
    );
}

#[test]
fn a_buffer_written_in_ever_new_ranges_keeps_a_bounded_number_of_uses() {
    let (mut state, events) = (UseState::default(), Events::default());
    let streams: Vec<FakeStream> = (0..7).map(|id| FakeStream::own(id + 1)).collect();
    for index in 0..100_000usize {
        let stream = &streams[index % streams.len()];
        let start = (index * 64) % (1 << 30);
        let access = if index % 3 == 0 {
            Access::Read
        } else {
            Access::Write
        };
        use_range(&mut state, &events, stream, (start, start + 64), access);
        assert!(
            state.tracked() <= MAX_USES,
            "{} uses at {index}",
            state.tracked()
        );
    }
    assert!(
        events.made.get() <= MAX_USES + 2,
        "events are reused: {} made",
        events.made.get()
    );
    assert_eq!(
        events.held(),
        state.tracked(),
        "the state holds no spare events"
    );
    // Nothing was forgotten: a writer of everything waits for what is left.
    let last = FakeStream::own(99);
    let waits = use_range(&mut state, &events, &last, (0, 1 << 31), Access::Write);
    assert!(!waits.is_empty());
}

#[test]
fn a_free_hands_on_every_eager_uses_event_its_own_streams_too() {
    // The next buffer made from a freed block starts with an empty tracker and may be used on
    // any stream: stream order on the block's own stream covers nothing for it, so the events of
    // uses there travel with the block like any other stream's.
    let events = Events::default();
    let (home, other) = (FakeStream::own(1), FakeStream::own(2));
    let mut state = UseState::default();
    use_on(&mut state, &events, &home, Access::Write);
    use_on(&mut state, &events, &home, Access::Read);
    let taken = state.take_all(|_| true);
    assert_eq!(
        taken.events.len(),
        2,
        "the home stream's uses are handed on"
    );
    assert!(state.is_empty());
    drop(taken);
    use_on(&mut state, &events, &home, Access::Write);
    use_on(&mut state, &events, &other, Access::Read);
    assert_eq!(state.take_all(|_| true).events.len(), 2);
    assert_eq!(
        events.held(),
        0,
        "the events went back to the pool once dropped"
    );
}

#[test]
fn buffers_made_used_and_freed_in_a_loop_hold_their_events_only_while_tracked() {
    // A buffer's state per cycle, as a typed buffer's tracker sees it: written on one stream,
    // read on another, its events taken out for the free (`take_all`), which hands them on
    // until the uses complete, then drops them. A new state per cycle, 10^5 times: the pool
    // makes only the events held at once.
    let events = Events::default();
    let (w, r) = (FakeStream::own(1), FakeStream::own(2));
    let mut freed: std::collections::VecDeque<Vec<(Arc<FakeEvent>, Option<u64>)>> =
        Default::default();
    for _ in 0..100_000 {
        let mut state = UseState::default();
        use_on(&mut state, &events, &w, Access::Write);
        use_on(&mut state, &events, &r, Access::Read);
        freed.push_back(state.take_all(|_| true).events);
        assert!(state.is_empty());
        if freed.len() > 4 {
            // The uses of the oldest freed buffer have completed: its events go back.
            drop(freed.pop_front());
        }
    }
    assert!(
        events.made.get() <= 2 * 5,
        "{} events made",
        events.made.get()
    );
    drop(freed);
    assert_eq!(events.held(), 0);
    // A buffer nothing was queued on takes no event at all.
    let mut untouched = UseState::<FakeEvent>::default();
    assert!(untouched.take_all(|_| true).events.is_empty());
}
