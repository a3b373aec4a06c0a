//! The bookkeeping checked against a model of the GPU: random reads, writes and completions on
//! a few streams, where each stream carries a vector clock (a wait on an event joins the clock
//! the event was recorded with). Every use must be ordered after each earlier conflicting use
//! (overlapping bytes, one of them a write) that had not finished: whatever the state merged,
//! re-recorded or pruned, no wait it owed was lost.

use std::cell::RefCell;
use std::sync::Arc;

use parking_lot::Mutex;
use proptest::prelude::*;

use super::*;
use crate::proptest_config::config;

const STREAMS: usize = 4;
type Clock = [u64; STREAMS];

/// How far each stream's work has finished on the "GPU".
type Finished = Arc<Mutex<Clock>>;

/// An event: the clock of the stream it was last recorded on, and that stream's position.
#[derive(Debug)]
struct ClockEvent {
    recorded: Mutex<Option<(usize, Clock)>>,
    finished: Finished,
}

impl UseEvent for ClockEvent {
    fn is_complete(&self) -> Result<bool> {
        Ok(match *self.recorded.lock() {
            Some((stream, clock)) => self.finished.lock()[stream] >= clock[stream],
            None => true,
        })
    }
}

#[derive(Debug)]
struct ClockStream {
    index: usize,
    raw: usize,
    clock: RefCell<Clock>,
}

impl UseStream for ClockStream {
    type Event = ClockEvent;

    fn raw(&self) -> usize {
        self.raw
    }

    fn id(&self) -> u64 {
        self.index as u64 + 1
    }

    fn wait_for(&self, event: &ClockEvent) -> Result<()> {
        if let Some((_, clock)) = *event.recorded.lock() {
            let mut own = self.clock.borrow_mut();
            for (mine, theirs) in own.iter_mut().zip(clock) {
                *mine = (*mine).max(theirs);
            }
        }
        Ok(())
    }

    fn record(&self, event: &ClockEvent) -> Result<()> {
        *event.recorded.lock() = Some((self.index, *self.clock.borrow()));
        Ok(())
    }

    fn capture_epoch(&self) -> u64 {
        0
    }

    fn capture_is_active(&self, _: u64) -> bool {
        false
    }
}

#[derive(Debug, Clone, Copy)]
enum Step {
    Use {
        stream: usize,
        start: usize,
        len: usize,
        write: bool,
    },
    /// Everything queued so far on `stream` finishes.
    Finish { stream: usize },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (0..STREAMS, 0usize..48, 1usize..5, any::<bool>()).prop_map(|(stream, start, len, write)| {
            Step::Use { stream, start, len, write }
        }),
        1 => (0..STREAMS).prop_map(|stream| Step::Finish { stream }),
    ]
}

/// A use done so far: its stream, its position there, its bytes and whether it wrote.
struct Done {
    stream: usize,
    position: u64,
    range: ByteRange,
    write: bool,
}

fn run(steps: &[Step]) -> std::result::Result<(), TestCaseError> {
    let finished: Finished = Arc::new(Mutex::new([0; STREAMS]));
    // Three streams of their own and the legacy default stream (raw handle 1).
    let streams: Vec<ClockStream> = (0..STREAMS)
        .map(|index| ClockStream {
            index,
            raw: if index == STREAMS - 1 {
                1
            } else {
                0x1000 + index
            },
            clock: RefCell::new([0; STREAMS]),
        })
        .collect();
    let mut state: UseState<ClockEvent> = UseState::default();
    let mut done: Vec<Done> = Vec::new();
    for (at, step) in steps.iter().enumerate() {
        match *step {
            Step::Finish { stream } => {
                // A stream finishes only what it was ordered after has finished too.
                let clock = *streams[stream].clock.borrow();
                let mut finished = finished.lock();
                for (reached, needed) in finished.iter_mut().zip(clock) {
                    *reached = (*reached).max(needed);
                }
            }
            Step::Use {
                stream,
                start,
                len,
                write,
            } => {
                let on = &streams[stream];
                let range = ByteRange::new(start * 64, len * 64);
                let access = if write { Access::Write } else { Access::Read };
                state
                    .wait_on_range("model", on, range, access, &CaptureView::NONE)
                    .expect("no capture");
                let position = {
                    let mut clock = on.clock.borrow_mut();
                    clock[stream] += 1;
                    clock[stream]
                };
                let clock = *on.clock.borrow();
                let reached = *finished.lock();
                for earlier in &done {
                    let conflicts = earlier.range.overlaps(range) && (write || earlier.write);
                    let over = reached[earlier.stream] >= earlier.position;
                    prop_assert!(
                        !conflicts || over || clock[earlier.stream] >= earlier.position,
                        "step {at}: a use of {range:?} on stream {stream} is not ordered after \
                         the unfinished use of {:?} on stream {} (position {})",
                        earlier.range,
                        earlier.stream,
                        earlier.position
                    );
                }
                let make = || {
                    Ok(Arc::new(ClockEvent {
                        recorded: Mutex::new(None),
                        finished: Arc::clone(&finished),
                    }))
                };
                state
                    .record_range(on, range, access, &CaptureView::NONE, make)
                    .expect("records succeed");
                prop_assert!(state.tracked() <= MAX_USES, "{} uses", state.tracked());
                done.push(Done {
                    stream,
                    position,
                    range,
                    write,
                });
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn every_use_is_ordered_after_the_unfinished_uses_it_conflicts_with(
        steps in prop::collection::vec(step(), 1..300)
    ) {
        run(&steps)?;
    }
}
