//! The process-wide bookkeeping of captures begun through cuweave: the count of active captures
//! and the capture epoch in one atomic word ([`active_captures`], [`capture_state`]), and a
//! [`Record`] of each capture (its stream, mode, thread, context, whether its stream is blocking
//! and what it knows to be complete).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::mode::CaptureMode;

/// Captures begun through [`Stream::begin_capture`] and not yet ended (the low
/// [`COUNT_BITS`] bits), and the capture epoch (the bits above), in one word so that a hot path
/// reads both with one load ([`capture_state`]).
///
/// [`Stream::begin_capture`]: crate::Stream::begin_capture
pub(super) static STATE: AtomicU64 = AtomicU64::new(0);
/// Bits of [`STATE`] that count active captures.
pub(super) const COUNT_BITS: u32 = 24;
/// Mask of the count in [`STATE`].
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
/// Captures begun through cuweave that have ended since the process started, counted once
/// each capture's record is gone (so a reader that sees the count move and then looks at the
/// records finds the capture ended).
pub(super) static ENDED: AtomicU64 = AtomicU64::new(0);
/// Those of them in [`CaptureMode::Global`].
pub(super) static GLOBAL: AtomicUsize = AtomicUsize::new(0);
/// Those of them whose origin stream is blocking (made without `StreamFlags::NON_BLOCKING`):
/// while one is active, its context's legacy default stream may not be used at all
/// ([`refuse_legacy_stream_use`](super::refuse_legacy_stream_use)).
pub(super) static BLOCKING: AtomicUsize = AtomicUsize::new(0);

/// A capture begun here: which stream, in which mode, the failure sequence at its start, the
/// driver's capture id, its context, and the epoch before which that context's work is known to
/// have completed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Record {
    pub(super) stream: u64,
    pub(super) mode: CaptureMode,
    pub(super) first_failure: u64,
    pub(super) capture_id: u64,
    pub(super) context: usize,
    pub(super) complete_before: u64,
    /// The thread that began the capture.
    pub(super) thread: std::thread::ThreadId,
    /// A tracked buffer (of the memory layer) was used in the capture: its graph's launches
    /// leave fences (see `fences`).
    pub(super) tracked: bool,
    /// The origin stream is blocking (not `CU_STREAM_NON_BLOCKING`), asked once at the begin:
    /// the legacy default stream of `context` may not be used while the capture runs.
    pub(super) blocking: bool,
}

impl Record {
    /// The thread whose failed calls are looked at first when the capture turns out broken:
    /// its own, unless it is global, which any thread's unsafe call breaks (then the first
    /// failure anywhere is the cause).
    pub(super) fn blamed_thread(&self) -> Option<std::thread::ThreadId> {
        (self.mode != CaptureMode::Global).then_some(self.thread)
    }
}

/// Every capture begun through cuweave and not yet ended (few at a time: one per capturing
/// stream), so that `end_capture` knows its mode and where to look for the call that broke it.
pub(super) static RECORDS: Mutex<Vec<Record>> = Mutex::new(Vec::new());

/// Held exclusively while a capture begins (from before `cuStreamBeginCapture` until the
/// capture is counted in [`active_captures`]), and shared by [`while_no_capture_begins`]: a
/// background thread that checks for active captures and then synchronises a context (the
/// driver's host-retirement thread) cannot see none and then synchronise into a capture that
/// began in between, which would invalidate it.
pub(super) static CAPTURE_BEGIN: parking_lot::RwLock<()> = parking_lot::RwLock::new(());

thread_local! {
    /// How deep this thread is inside [`while_no_capture_begins`].
    static HELD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether this thread is inside [`while_no_capture_begins`]: a capture begin here would wait
/// for the begin lock this thread holds.
pub(super) fn holding_capture_begins_off() -> bool {
    HELD.with(std::cell::Cell::get) > 0
}

/// Runs `f` while no capture can begin through cuweave: for a check of [`active_captures`]
/// followed by a call that would invalidate a capture (a context synchronisation) made off the
/// thread whose program order would otherwise keep them apart. A capture about to begin waits
/// for `f` to return.
///
/// Reentrant: `f` may call what takes it again (`Context::synchronize` inside
/// [`WeakStream::with_no_capture_beginning`](crate::stream::WeakStream::with_no_capture_beginning)),
/// without deadlocking behind a capture begin that waits: a nested call on the thread that
/// holds the lock takes nothing more. The outermost call takes the fair read lock, so a waiting
/// capture begin goes ahead of new readers (a recursive read lock would let threads that
/// synchronise in a loop starve it).
pub(crate) fn while_no_capture_begins<R>(f: impl FnOnce() -> R) -> R {
    /// Counts this thread's nesting for as long as it lives (unwinding included).
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            HELD.with(|held| held.set(held.get() - 1));
        }
    }
    // Inside `outside_captures` on this thread, no capture can begin either (a begin holding
    // the lock waits for that call), and the lock must not be waited for: its holder waits for
    // this thread.
    let outermost = HELD.with(|held| {
        let depth = held.get();
        held.set(depth + 1);
        depth == 0
    }) && !super::outside::inside_on_this_thread();
    let _depth = Depth;
    let _no_begin = outermost.then(|| CAPTURE_BEGIN.read());
    f()
}

/// Signalled (under [`ENDS`]) whenever a capture begun through cuweave ends.
static ENDS: Mutex<()> = Mutex::new(());
static ENDS_SIGNAL: parking_lot::Condvar = parking_lot::Condvar::new();

/// Wakes the threads in [`wait_for_no_global_capture`]; called once a capture's counts are
/// down.
pub(super) fn signal_capture_end() {
    let _ends = ENDS.lock();
    ENDS_SIGNAL.notify_all();
}

/// Blocks until no global-mode capture begun through cuweave is active, for at most `limit`
/// (woken by each capture's end, not by polling): for work that a global capture forbids on
/// every thread and that can wait for it, such as tearing down an NCCL communicator, whose
/// threads cuweave cannot put in relaxed mode. Whether none is active on return. A capture
/// beginning right after the return is not held off.
pub fn wait_for_no_global_capture(limit: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    let mut ends = ENDS.lock();
    while GLOBAL.load(Ordering::Acquire) != 0 {
        if ENDS_SIGNAL.wait_until(&mut ends, deadline).timed_out() {
            return GLOBAL.load(Ordering::Acquire) == 0;
        }
    }
    true
}

/// How many captures begun through cuweave have ended since the process started: one atomic
/// load, for a cache of things held until their capture ends to look again only when one has.
pub(crate) fn captures_ended() -> u64 {
    ENDED.load(Ordering::Acquire)
}

/// How many captures begun through cuweave are active in the process: one relaxed atomic load,
/// for hot paths that must behave differently while any capture runs.
#[inline]
pub fn active_captures() -> usize {
    (STATE.load(Ordering::Acquire) & COUNT_MASK) as usize
}

/// How many captures are active and the capture epoch, read together with one atomic load.
///
/// The epoch grows by one each time [`Stream::begin_capture_synchronized`] is about to
/// synchronise a context. Work queued in that context *before* a load that returned an epoch
/// below the capture's [`known_complete_before`] has finished when the capture begins: so a
/// buffer tracker that stamps each recorded use with the epoch read just after recording it
/// can drop, without querying, the uses a capturing stream would otherwise have to wait on.
///
/// [`Stream::begin_capture_synchronized`]: crate::Stream::begin_capture_synchronized
#[inline]
pub fn capture_state() -> CaptureState {
    CaptureState::from_word(STATE.load(Ordering::SeqCst))
}

/// What [`capture_state`] returns: active captures and the capture epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CaptureState {
    /// Captures begun through cuweave and not yet ended.
    pub active: usize,
    /// The capture epoch (see [`capture_state`]).
    pub epoch: u64,
}

impl CaptureState {
    pub(super) fn from_word(word: u64) -> Self {
        Self {
            active: (word & COUNT_MASK) as usize,
            epoch: word >> COUNT_BITS,
        }
    }
}

/// Notes that a tracked buffer was used in the active capture `capture_id` (begun through
/// cuweave): the graph it ends in then leaves a fence behind each launch, which eager work on
/// other streams that uses such a buffer waits for
/// ([`wait_for_graph_launches`](crate::graph::wait_for_graph_launches)). The memory layer calls it;
/// cheap when already noted.
pub fn note_tracked_use(capture_id: u64) {
    if let Some(record) = RECORDS
        .lock()
        .iter_mut()
        .find(|record| record.capture_id == capture_id)
    {
        record.tracked = true;
    }
}

/// Whether the capture sequence `capture_id` (as [`CaptureStatus::id`] reports it), begun through
/// cuweave, is still active.
///
/// [`CaptureStatus::id`]: super::CaptureStatus::id
pub fn capture_is_active(capture_id: u64) -> bool {
    RECORDS
        .lock()
        .iter()
        .any(|record| record.capture_id == capture_id)
}

/// The epoch before which every use stamped by `context`'s work is known to have completed,
/// for work captured into `capture_id`: the epoch taken just before the context synchronisation
/// of [`Stream::begin_capture_synchronized`] (or of an earlier capture still active on the same
/// context). 0 (nothing known) for a capture begun without that synchronisation, outside
/// cuweave, or on another context.
///
/// [`Stream::begin_capture_synchronized`]: crate::Stream::begin_capture_synchronized
pub fn known_complete_before(capture_id: u64, context: &crate::Context) -> u64 {
    let raw = context.as_raw() as usize;
    let records = RECORDS.lock();
    let Some(record) = records
        .iter()
        .find(|record| record.capture_id == capture_id)
    else {
        return 0;
    };
    if record.context == raw {
        record.complete_before
    } else {
        0
    }
}

/// Whether a capture begun through cuweave on a blocking stream of the context `context` (its
/// raw handle) is active.
pub(super) fn blocking_capture_in(context: usize) -> bool {
    RECORDS
        .lock()
        .iter()
        .any(|record| record.blocking && record.context == context)
}

/// Whether this thread began a global or thread-local capture that is not over.
pub(super) fn this_thread_captures() -> bool {
    let thread = std::thread::current().id();
    RECORDS
        .lock()
        .iter()
        .any(|record| record.thread == thread && record.mode != CaptureMode::Relaxed)
}

/// Held by the unit tests that raise the capture count by hand, and by those that need it at
/// zero: the test harness runs them on parallel threads.
#[cfg(test)]
pub(crate) static CAPTURE_COUNT_TEST_LOCK: Mutex<()> = Mutex::new(());

#[cfg(test)]
mod no_begin_tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A nested hold on a thread that already holds the lock does not wait behind a capture
    /// begin queued meanwhile (a plain nested read would deadlock: the fair lock makes new
    /// readers wait for the queued writer, which waits for the outer read), and the begin gets
    /// the lock once the outer hold ends.
    #[test]
    fn a_nested_hold_does_not_wait_behind_a_queued_begin() {
        let held = AtomicBool::new(false);
        let begun = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while_no_capture_begins(|| {
                    held.store(true, Ordering::Release);
                    // Until the begin has queued behind this hold: the fair lock then refuses
                    // new readers, which is what a plain nested read would have waited on.
                    while CAPTURE_BEGIN.try_read().is_some() {
                        std::thread::yield_now();
                    }
                    assert!(!begun.load(Ordering::Acquire));
                    while_no_capture_begins(|| ());
                });
            });
            scope.spawn(|| {
                while !held.load(Ordering::Acquire) {
                    std::thread::yield_now();
                }
                let _beginning = CAPTURE_BEGIN.write();
                begun.store(true, Ordering::Release);
            });
        });
        assert!(begun.load(Ordering::Acquire));
    }
}
