//! A freed block's home-stream event: kept apart at the free (only the newest use there), and
//! seeded into the next buffer's state as a write on that stream, which other streams, the
//! default streams and the host wait for, and the home stream does not.

use super::tests::{Events, FakeEvent, FakeStream};
use super::*;

const HOME: u64 = 1;

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

/// A state seeded with a fresh event of `events` (not complete), and that event's number.
fn seeded(events: &Events) -> (UseState<FakeEvent>, usize) {
    let event = events.make()().unwrap();
    let number = event.number;
    let mut state = UseState::default();
    state.seed_home_write(event, HOME, 0);
    (state, number)
}

#[test]
fn a_free_keeps_only_the_newest_home_use_apart_and_hands_on_the_others() {
    let events = Events::default();
    let (home, other) = (FakeStream::own(HOME), FakeStream::own(2));
    let legacy = FakeStream::new(0, 100);
    let mut state = UseState::default();
    use_on(&mut state, &events, &home, Access::Write);
    use_on(&mut state, &events, &home, Access::Read);
    let newest = last_recorded(&home);
    let taken = state.take_for_reuse_on(Some(HOME), |_| true);
    assert!(taken.events.is_empty(), "used on its home stream only");
    let (event, _) = taken.home.expect("the newest home use");
    assert_eq!(event.number, newest, "the read, recorded after the write");
    assert_eq!(
        events.held(),
        1,
        "the write's event, covered by the read's, went back"
    );
    drop(event);

    use_on(&mut state, &events, &home, Access::Write);
    use_on(&mut state, &events, &other, Access::Read);
    use_on(&mut state, &events, &legacy, Access::Read);
    let taken = state.take_for_reuse_on(Some(HOME), |_| true);
    assert_eq!(
        taken.events.len(),
        2,
        "another stream's and the legacy stream's"
    );
    assert!(taken.home.is_some());
    drop(taken);

    use_on(&mut state, &events, &home, Access::Write);
    let taken = state.take_for_reuse_on(None, |_| true);
    assert_eq!(
        taken.events.len(),
        1,
        "no home stream: every event is handed on"
    );
    assert!(taken.home.is_none());
    drop(taken);
    assert_eq!(events.held(), 0);
}

#[test]
fn a_seeded_write_needs_no_wait_on_its_stream_and_re_records_there() {
    let events = Events::default();
    let home = FakeStream::own(HOME);
    let (mut state, seed) = seeded(&events);
    assert!(use_on(&mut state, &events, &home, Access::Write).is_empty());
    assert_eq!(
        last_recorded(&home),
        seed,
        "the carried event is re-recorded"
    );
    assert_eq!(events.made.get(), 1, "no new event");
    let (mut state, _) = seeded(&events);
    assert!(use_on(&mut state, &events, &home, Access::Read).is_empty());
}

#[rstest::rstest]
#[case::write_on_another_stream(FakeStream::own(2), Access::Write)]
#[case::read_on_another_stream(FakeStream::own(2), Access::Read)]
#[case::blocking_write_on_the_legacy_stream(FakeStream::new(0, 100), Access::Write)]
#[case::blocking_read_on_the_legacy_stream(FakeStream::new(1, 101), Access::Read)]
#[case::per_thread_default_stream(FakeStream::new(2, 102), Access::Write)]
fn a_seeded_write_is_waited_for_everywhere_else(
    #[case] stream: FakeStream,
    #[case] access: Access,
) {
    let events = Events::default();
    let (mut state, seed) = seeded(&events);
    assert_eq!(use_on(&mut state, &events, &stream, access), [seed]);
}

#[test]
fn the_host_waits_for_a_seeded_write() {
    let events = Events::default();
    let (state, seed) = seeded(&events);
    let all = state.all_events("test", |_| false).unwrap();
    assert_eq!(
        all.iter().map(|event| event.number).collect::<Vec<_>>(),
        [seed]
    );
}

#[test]
fn a_seeded_write_goes_on_with_the_next_free_only_until_a_newer_home_use() {
    let events = Events::default();
    let home = FakeStream::own(HOME);
    // Nothing new: the seed itself is handed on.
    let (mut state, seed) = seeded(&events);
    let taken = state.take_for_reuse_on(Some(HOME), |_| true);
    assert_eq!(taken.home.expect("still the newest").0.number, seed);
    // A read of part of the buffer on the home stream: newer, so the seed is dropped.
    let (mut state, seed) = seeded(&events);
    state
        .wait_on_range(
            "test",
            &home,
            ByteRange::new(0, 64),
            Access::Read,
            &CaptureView::NONE,
        )
        .unwrap();
    state
        .record_range(
            &home,
            ByteRange::new(0, 64),
            Access::Read,
            &CaptureView::NONE,
            events.make(),
        )
        .unwrap();
    let taken = state.take_for_reuse_on(Some(HOME), |_| true);
    let (newest, _) = taken.home.expect("the read");
    assert_ne!(newest.number, seed);
    drop(newest);
    assert_eq!(events.held(), 0);
    // Written on another stream after the seed: that stream waited; every event waits again.
    let (mut state, seed) = seeded(&events);
    let other = FakeStream::own(2);
    assert_eq!(use_on(&mut state, &events, &other, Access::Write), [seed]);
    let taken = state.take_for_reuse_on(Some(HOME), |_| true);
    assert!(taken.home.is_none(), "re-recorded on the other stream");
    assert_eq!(taken.events.len(), 1);
}

#[test]
fn buffers_reusing_one_block_without_a_wait_hold_one_event() {
    // The allocator's loop, as the states see it: a buffer seeded with what the block carries,
    // written and read on its home stream, freed; the GPU never catches up (no event
    // completes). The events never pile up: the newest home use's event goes on, the others
    // go back to the pool.
    let events = Events::default();
    let home = FakeStream::own(HOME);
    let mut carried: Option<(Arc<FakeEvent>, u64)> = None;
    for round in 0..100_000 {
        let mut state = UseState::default();
        if let Some((event, epoch)) = carried.take() {
            state.seed_home_write(event, HOME, epoch);
        }
        use_on(&mut state, &events, &home, Access::Write);
        if round % 3 == 0 {
            use_on(&mut state, &events, &home, Access::Read);
        }
        let taken = state.take_for_reuse_on(Some(HOME), |_| true);
        assert!(taken.events.is_empty());
        carried = taken.home;
        assert!(carried.is_some());
    }
    assert!(events.made.get() <= 2, "{} events made", events.made.get());
    drop(carried);
    assert_eq!(events.held(), 0);
}
