//! Work that must never run while a capture is active or beginning: the queries cuweave makes
//! of its own accord (a stream pruning its finished markers at a submission, an allocator
//! settling pending frees, the event reactor's scan), which would invalidate a global-mode
//! capture another thread begins between a check of [`active_captures`] and the query.
//!
//! A check then a query is not enough: the capture can begin in between. [`outside_captures`]
//! closes that window without a lock shared by every caller: each caller counts itself into a
//! counter of its own shard (one of [`SHARDS`], cache-padded, chosen per thread), then reads
//! whether a capture is beginning or active; a capture begin announces itself first
//! ([`announce_capture_begin`]), then waits until no shard counts a caller. All of these
//! operations are sequentially consistent, so of a caller and a begin racing, either the caller
//! sees the announcement (and skips its work) or the begin sees the caller's count (and waits
//! for it to finish). Callers arriving after the announcement skip at once, so a begin waits
//! only for work already under way (a few queries), and callers never wait at all.
//!
//! No CUDA here: the protocol's core ([`Gate`]) is model-checked with loom (`loom_tests`), and
//! the whole is tested with plain threads.

use std::cell::Cell;

#[cfg(all(loom, test))]
use loom::sync::atomic::{AtomicUsize, Ordering, fence};
#[cfg(not(all(loom, test)))]
use std::sync::atomic::{AtomicUsize, Ordering, fence};

use crossbeam::utils::{Backoff, CachePadded};

use super::registry::active_captures;

/// Shards of the count of callers inside [`outside_captures`]: threads spread over them, so
/// concurrent callers seldom share a cache line.
const SHARDS: usize = 64;

/// The protocol's core, free of CUDA and of thread-locals (callers pass their shard), so that
/// loom can check it with a few shards (`loom_tests`).
pub(super) struct Gate<const N: usize> {
    /// Callers inside (entered and not yet left), per shard.
    inside: [CachePadded<AtomicUsize>; N],
    /// Capture begins announced and not yet over.
    beginning: AtomicUsize,
}

impl<const N: usize> Gate<N> {
    #[cfg(not(all(loom, test)))]
    const fn new() -> Self {
        Self {
            inside: [const { CachePadded::new(AtomicUsize::new(0)) }; N],
            beginning: AtomicUsize::new(0),
        }
    }

    #[cfg(all(loom, test))]
    fn new() -> Self {
        Self {
            inside: std::array::from_fn(|_| CachePadded::new(AtomicUsize::new(0))),
            beginning: AtomicUsize::new(0),
        }
    }

    /// Counts a caller into `shard`; whether it may run its work (no begin announced). Either
    /// way the caller must [`leave`](Self::leave) after.
    ///
    /// The count, then a full fence, then the read of the announcements; a begin announces,
    /// fences, then reads the counts. Of a caller and a begin racing, one of the two reads sees
    /// the other's write (the fences' total order), so either the caller skips or the begin
    /// waits for it. Acquire: a caller that reads an announcement's end sees what the begin did
    /// before it.
    fn enter(&self, shard: usize) -> bool {
        self.inside[shard].fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        self.beginning.load(Ordering::Acquire) == 0
    }

    /// Counts a caller out of `shard`; what its work did happens before a begin that sees it
    /// gone.
    fn leave(&self, shard: usize) {
        self.inside[shard].fetch_sub(1, Ordering::Release);
    }

    /// Whether a begin is announced and not yet over.
    fn is_beginning(&self) -> bool {
        self.beginning.load(Ordering::Acquire) != 0
    }

    /// Announces a begin, then waits (calling `wait` between looks) until no caller is inside
    /// running its work, other than the `own` counts of the announcing thread in `own_shard`.
    fn announce(&self, own_shard: usize, own: usize, mut wait: impl FnMut()) {
        self.beginning.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        // Callers that enter after the announcement leave without working; those inside before
        // it finish their (short) work. So once a shard reads 0 (the announcing thread's own
        // shard: its own count), no working caller is left in it: each shard is waited for on
        // its own, not the sum of all at one moment, which callers entering and leaving in a
        // loop would keep above 0.
        for (index, shard) in self.inside.iter().enumerate() {
            let allowed = if index == own_shard { own } else { 0 };
            while shard.load(Ordering::Acquire) > allowed {
                wait();
            }
        }
    }

    /// Ends an announcement.
    fn end_announcement(&self) {
        self.beginning.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(not(all(loom, test)))]
static GATE: Gate<SHARDS> = Gate::new();
#[cfg(all(loom, test))]
static GATE: std::sync::LazyLock<Gate<SHARDS>> = std::sync::LazyLock::new(Gate::new);

/// The next thread's shard.
static NEXT_SHARD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

thread_local! {
    /// This thread's shard of [`GATE`].
    static SHARD: usize = NEXT_SHARD.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SHARDS;
    /// How deep this thread is inside [`outside_captures`]. Only the outermost call counts
    /// itself into the shard (a nested one runs at once), so a begin made inside, against its
    /// contract, waits for no count of its own thread.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Runs `f` unless a capture begun through cuweave is active or beginning, and no such capture
/// begins while `f` runs: `Some(f())`, or `None` without running `f`.
///
/// For a query cuweave makes of its own accord, which a user did not ask for and which would
/// break another thread's global-mode capture (an event or stream query of work queued before
/// it). A check of [`active_captures`] followed by the query leaves a window in which such a
/// capture can begin; this closes it. Callers never wait: an atomic add, a fence and two loads
/// on the way in, an atomic subtract on the way out (a call nested in another of its thread:
/// nothing). A capture begin waits for the callers already
/// inside, so `f` must be short and must not wait for another thread, nor begin a capture (a
/// begin inside is refused with `GraphError::Capturing`, since it could wait for itself). In
/// particular `f` must not wait for a lock that another thread may hold across an
/// [`Event::query`](crate::Event::query) or [`Stream::query`](crate::Stream::query) (which wait
/// out a capture begin): take such a lock before the call, or wrap each query instead.
///
/// ```
/// # use cuweave_driver::graph::outside_captures;
/// // No capture is active here, so the closure runs.
/// assert_eq!(outside_captures(|| 7), Some(7));
/// ```
pub fn outside_captures<R>(f: impl FnOnce() -> R) -> Option<R> {
    outside_capture_begins(|| (active_captures() == 0).then(f)).flatten()
}

/// Runs `f`, a query cuweave makes of its own accord of work queued eagerly (a free's marker, a
/// fence, a stream's readiness), as [`outside_captures`] does while no capture is active or
/// beginning; while one is, in relaxed capture mode instead of not at all: the thread then
/// breaks no capture and is not refused for another thread's (the event reactor asks so), so
/// memory keeps being reused and waits keep resolving beside a long capture. An event recorded
/// into a capture that is still active is still refused by its query, which callers read as
/// "not yet".
///
/// The same contract as [`outside_captures`] for the first branch: `f` short, waiting for no
/// other thread, beginning no capture.
///
/// # Errors
/// The driver's error from `cuThreadExchangeStreamCaptureMode` (`f` not run).
///
/// ```
/// # use cuweave_driver::graph::outside_captures_or_relaxed;
/// // No capture is active here, so the closure runs as `outside_captures` runs it.
/// assert_eq!(outside_captures_or_relaxed(|| 7).ok(), Some(7));
/// ```
pub fn outside_captures_or_relaxed<R>(f: impl FnOnce() -> R) -> crate::error::Result<R> {
    let mut f = Some(f);
    if let Some(answer) = outside_captures(|| (f.take().expect("runs once"))()) {
        return Ok(answer);
    }
    let _relaxed = super::mode::CaptureModeGuard::enter(super::mode::CaptureMode::Relaxed)?;
    Ok((f.take().expect("not run by outside_captures"))())
}

/// Runs `f` unless a capture begin through cuweave is under way, and no capture begins while
/// `f` runs: `Some(f())`, or `None` without running `f`. Captures already active may be; `f`
/// can read them ([`active_captures`], the capture records) knowing the set cannot grow until
/// it returns. The same contract as [`outside_captures`]: `f` short, waiting for no other
/// thread, beginning no capture.
pub(crate) fn outside_capture_begins<R>(f: impl FnOnce() -> R) -> Option<R> {
    let outer = DEPTH.with(|depth| {
        let outer = depth.get();
        depth.set(outer + 1);
        outer
    });
    let _depth = Depth;
    if outer > 0 {
        // Nested in this thread's own call, which is running its work: every begin announced
        // since waits for that call, so none can be under way past its wait, and no second
        // count is needed (refusing here would make a query inside the outer call wait for a
        // begin that waits for it).
        return Some(f());
    }
    let shard = SHARD.with(|shard| *shard);
    let _left = Leave(shard);
    GATE.enter(shard).then(f)
}

/// Runs `f` as [`outside_capture_begins`] does, waiting out capture begins under way (each a
/// few microseconds: one driver call and some bookkeeping) instead of skipping: for a driver
/// call that must happen, and must not race a capture begin (an event query that would break
/// it). On a thread already inside [`outside_captures`] no begin can be under way.
pub(crate) fn between_capture_begins<R>(f: impl FnOnce() -> R) -> R {
    let mut f = Some(f);
    let backoff = Backoff::new();
    loop {
        if let Some(result) = outside_capture_begins(|| (f.take().expect("runs once"))()) {
            return result;
        }
        while GATE.is_beginning() {
            pause(&backoff);
        }
    }
}

/// Whether this thread is inside [`outside_captures`] (or [`outside_capture_begins`]) running
/// its work: every capture begin announced meanwhile waits for it, so none can begin until it
/// returns.
pub(super) fn inside_on_this_thread() -> bool {
    DEPTH.with(Cell::get) > 0
}

/// Counts the caller out of its shard (unwinding included).
struct Leave(usize);

impl Drop for Leave {
    fn drop(&mut self) {
        GATE.leave(self.0);
    }
}

/// Counts one call of this thread out of [`DEPTH`] (unwinding included).
struct Depth;

impl Drop for Depth {
    fn drop(&mut self) {
        DEPTH.with(|depth| depth.set(depth.get() - 1));
    }
}

/// One wait between looks at the gate: spins briefly, then yields the core.
fn pause(backoff: &Backoff) {
    if backoff.is_completed() {
        std::thread::yield_now();
    } else {
        backoff.snooze();
    }
}

/// Held by a capture begin from before its driver call until the capture is counted in
/// [`active_captures`]: [`outside_captures`] skips its work meanwhile.
#[must_use = "the announcement ends when this is dropped"]
pub(super) struct CaptureBeginAnnounced(());

impl Drop for CaptureBeginAnnounced {
    fn drop(&mut self) {
        GATE.end_announcement();
    }
}

/// Announces a capture begin to [`outside_captures`], then waits until no caller is inside it
/// (other than the calling thread itself): from then until the returned guard is dropped, no
/// caller runs its work. Drop the guard only once the capture is counted in
/// [`active_captures`] (or has failed to begin).
pub(super) fn announce_capture_begin() -> CaptureBeginAnnounced {
    let backoff = Backoff::new();
    // This thread's own count: one while it is inside (only its outermost call counts).
    let own = usize::from(DEPTH.with(Cell::get) > 0);
    GATE.announce(SHARD.with(|shard| *shard), own, || pause(&backoff));
    CaptureBeginAnnounced(())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    /// The protocol's one promise, with a flag for "the capture has begun": work run by
    /// `outside_captures` never sees the flag raised, while four threads call it in a loop and
    /// another announces two hundred begins (raising the flag only between announcement and
    /// drop, as a begin does around its driver call). Each announcement also proves it waited:
    /// no caller is inside once it returns.
    #[test]
    fn work_never_overlaps_an_announced_begin() {
        let _serial = crate::graph::CAPTURE_COUNT_TEST_LOCK.lock();
        let begun = AtomicBool::new(false);
        let done = AtomicBool::new(false);
        let ran = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    while !done.load(Ordering::Acquire) {
                        let seen = outside_captures(|| {
                            let seen = begun.load(Ordering::SeqCst);
                            std::hint::spin_loop();
                            seen || begun.load(Ordering::SeqCst)
                        });
                        if let Some(seen) = seen {
                            assert!(!seen, "work ran while a capture was beginning");
                            ran.fetch_add(1, Ordering::Relaxed);
                        }
                        std::thread::yield_now();
                    }
                });
            }
            for _ in 0..200 {
                let announced = announce_capture_begin();
                begun.store(true, Ordering::SeqCst);
                std::hint::spin_loop();
                begun.store(false, Ordering::SeqCst);
                drop(announced);
                std::thread::yield_now();
            }
            done.store(true, Ordering::Release);
        });
        assert!(
            ran.load(Ordering::Relaxed) > 0,
            "no caller ever ran its work"
        );
    }

    /// A caller skips its work while a begin is announced, and runs it again once the begin is
    /// over; a call that must happen waits for the begin to end, then runs.
    #[test]
    fn work_is_skipped_while_announced_and_runs_after() {
        let _serial = crate::graph::CAPTURE_COUNT_TEST_LOCK.lock();
        let announced = announce_capture_begin();
        let other = std::thread::spawn(|| outside_captures(|| ()));
        assert_eq!(other.join().unwrap(), None);
        let ended = AtomicBool::new(false);
        let skipped = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let waiting = scope.spawn(|| {
                // Seen announced (skipped) first, so the call below meets the begin (or its end).
                skipped.store(outside_captures(|| ()).is_none(), Ordering::SeqCst);
                between_capture_begins(|| ended.load(Ordering::SeqCst))
            });
            while !skipped.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            ended.store(true, Ordering::SeqCst);
            drop(announced);
            assert!(waiting.join().unwrap(), "ran before the begin ended");
        });
        assert_eq!(outside_captures(|| 3), Some(3));
    }

    /// A begin announced from inside `outside_captures` on the same thread (against its
    /// contract) does not wait for itself for ever, and nested calls count in and out.
    /// A call nested in one that runs while another thread announces a begin runs at once: the
    /// begin waits for the outer call, so waiting for the begin would deadlock.
    #[test]
    fn a_begin_inside_does_not_wait_for_its_own_thread() {
        let _serial = crate::graph::CAPTURE_COUNT_TEST_LOCK.lock();
        let nested = outside_captures(|| {
            let inner = outside_captures(|| DEPTH.with(Cell::get));
            let announced = announce_capture_begin();
            drop(announced);
            inner
        });
        assert_eq!(nested, Some(Some(2)));
        assert_eq!(DEPTH.with(Cell::get), 0);

        let inside = AtomicBool::new(false);
        let announced = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                outside_captures(|| {
                    inside.store(true, Ordering::SeqCst);
                    while !GATE.is_beginning() {
                        std::thread::yield_now();
                    }
                    assert_eq!(between_capture_begins(|| 5), 5);
                    assert!(!announced.load(Ordering::SeqCst));
                })
                .expect("no begin was under way");
            });
            while !inside.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            let begin = announce_capture_begin();
            announced.store(true, Ordering::SeqCst);
            drop(begin);
        });
    }

    /// `while_no_capture_begins` called inside `outside_captures` does not wait for the begin
    /// lock: a begin holding it waits for this thread's call, so waiting back would deadlock
    /// (and no capture can begin meanwhile anyway).
    #[test]
    fn the_begin_lock_is_not_waited_for_inside() {
        let _serial = crate::graph::CAPTURE_COUNT_TEST_LOCK.lock();
        let _beginning = super::super::registry::CAPTURE_BEGIN.write();
        let ran = std::thread::spawn(|| {
            outside_captures(|| super::super::registry::while_no_capture_begins(|| 9))
        });
        assert_eq!(ran.join().unwrap(), Some(9));
    }
}

#[cfg(all(loom, test))]
mod loom_tests {
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicBool, Ordering};
    use loom::thread;

    use super::Gate;

    /// A caller's work never overlaps an announced begin: the flag the begin raises after its
    /// wait (and lowers before its end) is never seen raised by the work.
    #[test]
    fn loom_work_never_overlaps_an_announced_begin() {
        loom::model(|| {
            let gate = Arc::new(Gate::<2>::new());
            let begun = Arc::new(AtomicBool::new(false));
            let caller = {
                let (gate, begun) = (gate.clone(), begun.clone());
                thread::spawn(move || {
                    if gate.enter(0) {
                        assert!(!begun.load(Ordering::Relaxed), "work ran during a begin");
                    }
                    gate.leave(0);
                })
            };
            gate.announce(1, 0, thread::yield_now);
            begun.store(true, Ordering::Relaxed);
            begun.store(false, Ordering::Relaxed);
            gate.end_announcement();
            caller.join().unwrap();
        });
    }

    /// Two callers in one shard and a begin: neither works during the begin, and the begin's
    /// wait ends (each shard is waited for on its own).
    #[test]
    fn loom_two_callers_sharing_a_shard_never_overlap_a_begin() {
        // Three threads and a wait loop: bounded preemptions keep the model to seconds.
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let gate = Arc::new(Gate::<2>::new());
            let begun = Arc::new(AtomicBool::new(false));
            let callers: Vec<_> = (0..2)
                .map(|_| {
                    let (gate, begun) = (gate.clone(), begun.clone());
                    thread::spawn(move || {
                        if gate.enter(0) {
                            assert!(!begun.load(Ordering::Relaxed), "work ran during a begin");
                        }
                        gate.leave(0);
                    })
                })
                .collect();
            gate.announce(1, 0, thread::yield_now);
            begun.store(true, Ordering::Relaxed);
            begun.store(false, Ordering::Relaxed);
            gate.end_announcement();
            for caller in callers {
                caller.join().unwrap();
            }
        });
    }

    /// A caller entering after an announcement ended runs its work.
    #[test]
    fn loom_a_caller_after_the_begin_runs() {
        loom::model(|| {
            let gate = Arc::new(Gate::<2>::new());
            gate.announce(0, 0, thread::yield_now);
            gate.end_announcement();
            let caller = {
                let gate = gate.clone();
                thread::spawn(move || {
                    let ran = gate.enter(1);
                    gate.leave(1);
                    ran
                })
            };
            assert!(caller.join().unwrap());
        });
    }
}
