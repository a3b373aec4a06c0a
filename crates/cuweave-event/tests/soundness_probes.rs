//! Adversarial soundness probes of the event layer's safe API: call sequences with no `unsafe`
//! (but for the test kernels' raw pointers) that try to make the coordinator or the waiter
//! accept an illegal program or refuse a legal one, wait on the wrong point, run a callback
//! twice or never, answer bad input with a panic, a hang or an untyped/`Ok` result, or keep a
//! record for ever.
//!
//! Every test starts with `require_gpu!()` (it skips without a GPU) and takes `serial()`: most
//! rely on a spinning kernel's timing or a capture. Each asserts the correct behaviour; the
//! comment above it says which sequence it tries and what a failure means.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::Duration;

use common::{Flags, MS, within};
use cuweave_driver::{CaptureMode, InstantiateOptions, Stream};
use cuweave_event::{
    AsStream, AsyncEventWaiter, CrossStreamBarrier, EventError, EventPool, OperationCoordinator,
    OperationId, OperationState, WaitFuture, WaitOptions, WakeMechanism,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::outside_capture::capture_outside_cuweave;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{poll_until, require_gpu, serial};

/// A value no kernel writes: a flag still holding it was never written.
const UNTOUCHED: u32 = 0xDEAD_BEEF;

/// One poll of `future` with a waker that does nothing.
fn poll_once(future: &mut WaitFuture) -> Poll<Result<(), EventError>> {
    let mut cx = TaskContext::from_waker(Waker::noop());
    std::future::Future::poll(std::pin::Pin::new(future), &mut cx)
}

/// Waits until `waiter` watches nothing (every callback it ran has returned).
fn settle(waiter: &AsyncEventWaiter, what: &str) {
    assert!(
        poll_until(Duration::from_secs(5), || waiter.pending() == 0),
        "{what}: the waiter still has {} waits pending after 5 s",
        waiter.pending()
    );
}

// ---------------------------------------------------------------------------------------------
// AsyncEventWaiter: wait ids
// ---------------------------------------------------------------------------------------------

/// Sequence: two waiters (a library's and the program's, or the global one and a private
/// one); each registers one callback wait behind a closed gate; the program cancels, on the
/// second waiter, the `WaitId` the *first* waiter returned.
///
/// `WaitId` is a per-waiter counter from 1 (`waiter/mod.rs`: `next_id: AtomicU64::new(1)` in
/// `AsyncEventWaiter::new`, `WaitId(self.next_id.fetch_add(..))` in `wait_async_inner`), and
/// `cancel_wait` looks the id up in its own map only. Both first waits are `wait#1`, so the
/// foreign id cancels the second waiter's own, unrelated callback: `true` is returned and that
/// callback never runs. `OperationId` carries its coordinator for exactly this reason; a
/// `WaitId` must not pass for another waiter's. Expected: `false`, and both callbacks run once.
#[test]
fn a_wait_id_of_another_waiter_cancels_nothing_there() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 4, 0).unwrap();
    let first = AsyncEventWaiter::new().unwrap();
    let second = AsyncEventWaiter::new().unwrap();
    let stream = common::stream(&gpu.context);
    let gate = Flags::new(&gpu.context, 1);
    // SAFETY: the flag is mapped pinned memory of this context, alive until the stream is
    // synchronised below; the host writes it only with a volatile store.
    unsafe {
        kernels
            .wait_u32(&stream, gate.device(0), 1, 5_000 * MS)
            .unwrap()
    };
    let (event_a, event_b) = (
        pool.acquire_owned(false).unwrap(),
        pool.acquire_owned(false).unwrap(),
    );
    event_a.record(&stream).unwrap();
    event_b.record(&stream).unwrap();
    let (ran_a, ran_b) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let id_a = first.wait_async(event_a, {
        let ran = Arc::clone(&ran_a);
        move |_| {
            ran.fetch_add(1, Ordering::SeqCst);
        }
    });
    let id_b = second.wait_async(event_b, {
        let ran = Arc::clone(&ran_b);
        move |_| {
            ran.fetch_add(1, Ordering::SeqCst);
        }
    });

    let cancelled_elsewhere = second.cancel_wait(id_a);
    gate.write(0, 1);
    stream.synchronize().unwrap();
    settle(&first, "first waiter");
    settle(&second, "second waiter");

    assert!(
        !cancelled_elsewhere,
        "second.cancel_wait({id_a}) with the first waiter's id returned true (the second \
         waiter's own wait is {id_b}): it cancelled a wait it was never given"
    );
    assert_eq!(
        ran_b.load(Ordering::SeqCst),
        1,
        "the second waiter's callback never ran: cancelled through another waiter's id"
    );
    assert_eq!(ran_a.load(Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------------------------------------
// OperationCoordinator: double completion
// ---------------------------------------------------------------------------------------------

/// A stream whose `as_stream` can be made to pause once, the first time it is called after
/// [`arm`](Self::arm): it fixes where a thread stands inside a coordinator method, so that a
/// race between two threads is played out the same way every run.
struct GatedStream {
    stream: Stream,
    armed: AtomicBool,
    entered: Mutex<Option<mpsc::Sender<()>>>,
    release: Mutex<Option<mpsc::Receiver<()>>>,
}

impl GatedStream {
    fn new(stream: Stream) -> Self {
        Self {
            stream,
            armed: AtomicBool::new(false),
            entered: Mutex::new(None),
            release: Mutex::new(None),
        }
    }

    /// The next `as_stream` call says it entered, then waits for the returned sender.
    fn arm(&self) -> (mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (entered_tx, entered_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        *self.entered.lock().unwrap() = Some(entered_tx);
        *self.release.lock().unwrap() = Some(release_rx);
        self.armed.store(true, Ordering::SeqCst);
        (entered_rx, release_tx)
    }
}

impl AsStream for GatedStream {
    fn as_stream(&self) -> &Stream {
        if self.armed.swap(false, Ordering::SeqCst) {
            if let Some(entered) = self.entered.lock().unwrap().take() {
                let _ = entered.send(());
            }
            let release = self.release.lock().unwrap().take();
            if let Some(release) = release {
                let _ = release.recv_timeout(Duration::from_secs(10));
            }
        }
        &self.stream
    }
}

/// Sequence: an operation is begun; two threads call `complete_operation` on it at once (a
/// retry after a timeout, two owners of one handle). The gated stream holds the first call
/// just after it read the operation's state, while the second runs to its end.
///
/// `complete_operation` (`coordinator/mod.rs`) checks `Begun` under its first lock, releases it
/// to record the event, then takes the lock again and sets `Queued` without checking the state
/// again: both calls record an event, both push the operation onto its stream's queue, the
/// second overwrites the first's event, and both return `Ok`. A sequential double complete is
/// `InvalidState`; a concurrent one must be too. Expected: exactly one `Ok`, the other
/// `InvalidState`.
#[test]
fn two_concurrent_completes_of_one_operation_accept_exactly_one() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 4, 4).unwrap()).unwrap();
    let gated = Arc::new(GatedStream::new(
        Stream::new(&gpu.context, cuweave_driver::StreamFlags::NON_BLOCKING).unwrap(),
    ));
    let op = common::register_kernel(&coordinator, &[], "completed twice at once");
    coordinator.begin_operation(op, &gated).unwrap();
    kernels.spin_ns(&gated.stream, 1000).unwrap();

    let (entered, release) = gated.arm();
    let first = std::thread::spawn({
        let coordinator = coordinator.clone();
        move || coordinator.complete_operation(op)
    });
    entered
        .recv_timeout(Duration::from_secs(10))
        .expect("the first complete never reached its stream");
    // The first call is past its state check and paused; the second runs meanwhile.
    let (second_tx, second_rx) = mpsc::channel();
    std::thread::spawn({
        let coordinator = coordinator.clone();
        move || {
            let _ = second_tx.send(coordinator.complete_operation(op));
        }
    });
    let second = second_rx.recv_timeout(Duration::from_secs(5));
    release.send(()).unwrap();
    let second = match second {
        Ok(result) => result,
        // It waited for the first (a lock held across the pause): fine, it finishes now.
        Err(_) => second_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the second complete hung"),
    };
    let first = first.join().expect("the first complete panicked");

    let accepted = [&first, &second].iter().filter(|r| r.is_ok()).count();
    assert_eq!(
        accepted, 1,
        "two concurrent complete_operation calls on {op}: first {first:?}, second {second:?}"
    );
    let refused = if first.is_ok() { &second } else { &first };
    assert!(
        matches!(refused, Err(EventError::InvalidState { .. })),
        "{refused:?}"
    );
    coordinator.synchronize(op).unwrap();
    gated.stream.synchronize().unwrap();
    assert!(poll_until(Duration::from_secs(5), || coordinator
        .live_operations()
        == 0));
}

// ---------------------------------------------------------------------------------------------
// OperationCoordinator: callbacks that panic
// ---------------------------------------------------------------------------------------------

/// Sequence: two completion callbacks on one operation; the first panics (a bug in one
/// subscriber). The waiter runs the coordinator's watch on its reactor thread.
///
/// The waiter contains a panicking callback (`run_callback`'s `catch_unwind`), but the
/// coordinator runs all of an operation's callbacks inside that one watch
/// (`Inner::on_gpu_complete`: `for callback in callbacks { callback(..) }`, then
/// `try_retire(id)`): the panic unwinds out of the loop, so the second subscriber's callback is
/// dropped without running, and `try_retire` is skipped, so the completed operation is never
/// retired (nothing else ever calls `try_retire` for it). Expected: the second callback runs
/// exactly once and the operation retires.
#[test]
fn a_panicking_callback_neither_cancels_the_next_one_nor_pins_its_operation() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(
        EventPool::new(&gpu.context, 4, 4).unwrap(),
        Arc::clone(&waiter),
    );
    let stream = common::stream(&gpu.context);
    let op = common::register_kernel(&coordinator, &[], "two subscribers, one buggy");
    coordinator
        .on_complete(op, |_, _| {
            panic!("probe: a completion callback that panics")
        })
        .unwrap();
    let second = Arc::new(AtomicUsize::new(0));
    coordinator
        .on_complete(op, {
            let second = Arc::clone(&second);
            move |id, result| {
                assert_eq!((id, result), (op, Ok(())));
                second.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
    coordinator.begin_operation(op, &stream).unwrap();
    kernels.spin_ns(&stream, 20 * MS).unwrap();
    coordinator.complete_operation(op).unwrap();
    stream.synchronize().unwrap();
    // The reactor decides the operation and runs its callbacks; nothing here polls before it
    // has (a poll would run them on this thread instead).
    assert!(
        poll_until(Duration::from_secs(5), || {
            let stats = waiter.stats();
            stats.completed + stats.failed >= 1 && waiter.pending() == 0
        }),
        "the waiter never finished the operation's watch: {:?}",
        waiter.stats()
    );

    assert_eq!(
        second.load(Ordering::SeqCst),
        1,
        "the callback registered after a panicking one never ran"
    );
    let live = coordinator.live_operations();
    assert_eq!(
        live, 0,
        "the completed operation whose callback panicked is still live: it never retires"
    );
}

/// Sequence: two operations recorded into one capture on one stream, each with a callback; the
/// first one's callback panics. The capture ends; the program then calls `retire_finished`
/// (any polling method would do) and asks where the second operation stands.
///
/// Captured operations are decided by the coordinator's poll, on the caller's thread
/// (`Inner::poll`: `take_finished` pops both off the stream's queue, then
/// `for (id, result) in finished { self.on_gpu_complete(id, result) }`). The first callback's
/// panic unwinds out of that loop into the caller's unrelated call, and the second operation,
/// already off its queue, is never decided: it stays `Queued` for ever, its callback never
/// runs, it never retires. Expected: the poll does not panic, the second operation completes
/// and its callback runs once.
#[test]
fn a_panicking_callback_of_a_captured_operation_strands_no_other_operation() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 4, 4).unwrap()).unwrap();
    let stream = common::stream(&gpu.context);
    let ran = Arc::new(AtomicUsize::new(0));

    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let captured = (|| -> Result<(OperationId, OperationId), EventError> {
        let buggy = common::register_kernel(&coordinator, &[], "captured, buggy subscriber");
        coordinator.begin_operation(buggy, &stream)?;
        kernels.spin_ns(&stream, 1000)?;
        coordinator.complete_operation(buggy)?;
        let sibling = common::register_kernel(&coordinator, &[], "captured sibling");
        coordinator.begin_operation(sibling, &stream)?;
        kernels.spin_ns(&stream, 1000)?;
        coordinator.complete_operation(sibling)?;
        coordinator.on_complete(buggy, |_, _| {
            panic!("probe: a captured operation's callback that panics")
        })?;
        coordinator.on_complete(sibling, {
            let ran = Arc::clone(&ran);
            move |_, result| {
                assert_eq!(result, Ok(()));
                ran.fetch_add(1, Ordering::SeqCst);
            }
        })?;
        Ok((buggy, sibling))
    })();
    let graph = stream.end_capture();
    let (_buggy, sibling) = captured.expect("the captured operations");
    graph.expect("the capture stayed valid");

    let polled = catch_unwind(AssertUnwindSafe(|| coordinator.retire_finished()));
    let state = catch_unwind(AssertUnwindSafe(|| coordinator.state(sibling)));
    let state = state.expect("state() panicked");

    assert!(
        polled.is_ok(),
        "a panic in another operation's completion callback escaped into retire_finished()"
    );
    assert_eq!(
        state,
        Ok(OperationState::Completed),
        "the sibling decided in the same poll as the panicking callback was stranded"
    );
    // The waiter watches the capture's end and may decide both operations first, running
    // their callbacks on its thread just after: the sibling's runs once, soon.
    cuweave_test_support::poll_until(Duration::from_secs(5), || {
        ran.load(Ordering::SeqCst) == 1 && coordinator.live_operations() == 0
    });
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "the sibling's callback never ran"
    );
    assert_eq!(coordinator.live_operations(), 0);
}

// ---------------------------------------------------------------------------------------------
// OperationCoordinator: dependencies beside captures
// ---------------------------------------------------------------------------------------------

/// Sequence: `d` runs eagerly on stream `s` (a 300 ms spin, then it sets a flag); `s` begins a
/// capture (not synchronised); `x`, registered after `d`, begins on `s` inside the capture and
/// copies the flag. The graph is launched on another stream `l`, as graphs are.
///
/// For a dependency on another stream the coordinator refuses this very case ("capturing |
/// eager, after, or with no synchronisation | refuse", `coordinator/capture_waits.rs`): the
/// graph could run before `d` has. For a dependency on the *same* stream `begin_operation`
/// skips the table altogether (`if dep.metadata.stream != Some(stream.id()) { .. decide .. }
/// else { same_stream_waits_skipped += 1 }`), as if stream order held; but a captured stream's
/// earlier eager work is not part of the graph, so nothing orders `x` after `d` at a launch.
/// Expected: the begin is refused as a capture refusal, or, if accepted, `x` sees `d`'s flag
/// at a launch on another stream.
#[test]
fn a_captured_operation_is_never_ordered_after_same_stream_eager_work_only_by_assumption() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let copies = StreamKernels::load(&gpu.context).unwrap();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 4, 4).unwrap()).unwrap();
    let (s, l) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let flags = Flags::new(&gpu.context, 2);
    flags.write(1, UNTOUCHED);

    let d = common::register_kernel(&coordinator, &[], "eager: 300 ms, then set the flag");
    coordinator.begin_operation(d, &s).unwrap();
    // SAFETY: mapped pinned memory of this context, alive until both streams are synchronised
    // below; the host reads it with volatile loads only.
    unsafe {
        kernels
            .spin_then_store_u32(&s, 300 * MS, flags.device(0), 1)
            .unwrap()
    };
    coordinator.complete_operation(d).unwrap();

    s.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let x = common::register_kernel(&coordinator, &[d], "captured: copy the flag");
    let begun = coordinator.begin_operation(x, &s);
    let queued = begun.as_ref().ok().map(|_| {
        // SAFETY: as above; `copy_flag_u32` reads word 0 and writes word 1.
        unsafe {
            copies
                .copy_flag_u32(&s, flags.device(0), flags.device(1))
                .unwrap()
        };
        coordinator.complete_operation(x)
    });
    let graph = s.end_capture();

    if let Err(error) = &begun {
        assert!(
            error.is_capture_refusal(),
            "refused, but not as a capture refusal: {error:?}"
        );
        graph.expect("the refused begin left the capture valid");
        s.synchronize().unwrap();
        return;
    }
    queued.unwrap().unwrap();
    let exec = graph
        .expect("the capture broke")
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    exec.launch(&l).unwrap();
    l.synchronize().unwrap();
    let seen = flags.read(1);
    let dependency_done_then = flags.read(0);
    s.synchronize().unwrap();

    assert_ne!(seen, UNTOUCHED, "the graph's copy never ran");
    assert_eq!(
        seen, 1,
        "x (begun after its dependency d, accepted on d's capturing stream with no wait) ran at \
         a launch of its graph before d finished (flag at the end of that launch: \
         {dependency_done_then})"
    );
}

/// Sequence: `d` is recorded into capture C1 on stream `s`, which ends; then stream `t`
/// captures C2 and `x`, depending on `d`, begins on `t`. Played twice: once with a
/// `retire_finished()` between the two captures, once without.
///
/// After a poll `d` is `Completed` (its capture ended: `captured_completion`) and retired, so
/// `x` begins with no wait. Without one, `d` is still `Queued` with `Recorded::Captured { C1 }`
/// and `capture_waits::decide` answers `(Some(C2), Captured { C1 })` with `Refuse` ("in another
/// capture"), though no wait is needed or would be queued once anything polled, and deciding
/// that takes no event query. Whether a legal program is refused then depends on whether some
/// unrelated call happened to poll. Expected: both begins accepted.
#[test]
fn a_dependency_on_an_ended_capture_is_accepted_whether_or_not_anything_polled_first() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 4, 4).unwrap()).unwrap();
    let (s, t) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let mut outcomes = Vec::new();
    for polled in [true, false] {
        s.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let d = common::register_kernel(&coordinator, &[], "captured in C1");
        let recorded = coordinator
            .begin_operation(d, &s)
            .and_then(|()| kernels.spin_ns(&s, 1000).map_err(EventError::from))
            .and_then(|()| coordinator.complete_operation(d));
        let first = s.end_capture();
        recorded.expect("d recorded into C1");
        first.expect("C1 stayed valid");
        if polled {
            coordinator.retire_finished();
        }

        t.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let x = common::register_kernel(&coordinator, &[d], "captured in C2, after d");
        let begun = coordinator.begin_operation(x, &t);
        if begun.is_ok() {
            kernels.spin_ns(&t, 1000).unwrap();
            coordinator.complete_operation(x).unwrap();
        }
        let second = t.end_capture();
        second.expect("C2 stayed valid");
        outcomes.push((polled, begun));
    }
    for (polled, begun) in &outcomes {
        assert!(
            begun.is_ok(),
            "with{} a poll between the captures, a dependency on an operation of an ended \
             capture was refused: {begun:?} (all outcomes: {outcomes:?})",
            if *polled { "" } else { "out" }
        );
    }
}

/// Sequence: another library captures stream `s` with the driver's own calls (relaxed mode;
/// cuweave does not count the capture); meanwhile the program begins and completes an
/// operation on `s`. After the capture ends it asks for the operation's state and begins a
/// dependant. 32 rounds.
///
/// `capture_waits::recorded_on` looks at the stream only while a capture begun *through
/// cuweave* is active (`if active_captures() != 0 && ..`), so the completion event, recorded
/// into the foreign capture, is taken for an eager one; the next poll queries it, the driver
/// answers `CUDA_ERROR_CAPTURED_EVENT` (as the coordinator's own docs say it does, during the
/// capture and after), and `take_finished` turns that into `Failed`: a dependant can never
/// begin (`DependencyNotQueued`), and `Failed` records never retire, one per round. Expected:
/// not `Failed` (complete once the capture ended, as for a cuweave capture), the dependant
/// begins, nothing stays live.
#[test]
fn an_operation_completed_into_a_capture_begun_outside_cuweave_is_not_reported_failed() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 4, 4).unwrap()).unwrap();
    let s = common::stream(&gpu.context);
    let eager = common::stream(&gpu.context);
    let mut rounds = Vec::new();
    let mut first_op = None;
    for round in 0..32 {
        let op = common::register_kernel(&coordinator, &[], "recorded into a foreign capture");
        first_op.get_or_insert(op);
        let (recorded, _graph) = capture_outside_cuweave(&gpu.context, &s, || {
            coordinator
                .begin_operation(op, &s)
                .and_then(|()| kernels.spin_ns(&s, 1000).map_err(EventError::from))
                .and_then(|()| coordinator.complete_operation(op))
        });
        recorded.unwrap_or_else(|error| panic!("round {round}: {error}"));
        let state = coordinator.state(op);
        let dependant = common::register_kernel(&coordinator, &[op], "eager, after it");
        let begun = coordinator.begin_operation(dependant, &eager);
        if begun.is_ok() {
            coordinator.complete_operation(dependant).unwrap();
        }
        rounds.push((round, state, begun));
    }
    eager.synchronize().unwrap();
    let metrics = coordinator.metrics();
    let live = coordinator.live_operations();
    let (_, state, begun) = &rounds[0];
    if state == &Ok(OperationState::Failed) {
        // Which error the driver gave (the rule that decides depends on it).
        eprintln!(
            "the first round failed with: {:?}",
            first_op.map(|op| coordinator.synchronize(op))
        );
    }

    assert_ne!(
        state,
        &Ok(OperationState::Failed),
        "an operation recorded into a capture begun outside cuweave is reported failed \
         (failed operations: {})",
        metrics.failed
    );
    assert!(begun.is_ok(), "its dependant can never begin: {begun:?}");
    assert_eq!(metrics.failed, 0);
    assert!(
        live <= 2,
        "{live} operations live after 32 rounds: the failed records never retire"
    );
}

// ---------------------------------------------------------------------------------------------
// CrossStreamBarrier
// ---------------------------------------------------------------------------------------------

/// Sequence: stream `s` runs eager work (a 200 ms spin that then sets a flag), then begins a
/// relaxed-mode capture through cuweave; the program calls `synchronize()` on a barrier over
/// `s` and an eager stream.
///
/// `CrossStreamBarrier::synchronize` records an event on each stream (on `s`, into the
/// capture) and calls `Event::synchronize`, whose guard (`refuse_while_capturing(None, ..)`)
/// looks only at thread modes: a relaxed capture is not refused there. The driver is then asked
/// to synchronise an event recorded into a capture: it returns either an untyped driver error
/// (`CUDA_ERROR_CAPTURED_EVENT`) or at once, telling the host the queued work finished while
/// the eager spin still runs. `Stream::synchronize` on the same stream refuses with a typed
/// capture refusal. Expected: a capture refusal, the capture still valid.
#[test]
fn a_barrier_synchronize_while_one_of_its_streams_captures_is_a_capture_refusal() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let (s, eager) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let flags = Flags::new(&gpu.context, 1);
    let barrier = CrossStreamBarrier::new(
        vec![Arc::clone(&eager), Arc::clone(&s)],
        EventPool::new(&gpu.context, 4, 0).unwrap(),
    )
    .unwrap();
    // SAFETY: mapped pinned memory of this context, alive until `s` is synchronised below.
    unsafe {
        kernels
            .spin_then_store_u32(&s, 200 * MS, flags.device(0), 1)
            .unwrap()
    };
    kernels.spin_ns(&eager, 1000).unwrap();

    s.begin_capture(CaptureMode::Relaxed).unwrap();
    kernels.spin_ns(&s, 1000).unwrap();
    let synchronized = barrier.synchronize();
    let flag_then = flags.read(0);
    let stream_sync = s.synchronize();
    let graph = s.end_capture();
    s.synchronize().unwrap();

    let stream_refused = stream_sync.as_ref().err().map(|e| e.is_capture_refusal());
    assert_eq!(
        stream_refused,
        Some(true),
        "baseline: Stream::synchronize on the capturing stream: {stream_sync:?}"
    );
    assert!(
        graph.is_ok(),
        "the barrier's synchronize broke the capture: {graph:?}"
    );
    match synchronized {
        Ok(waited) => panic!(
            "the barrier synchronised a capturing stream and returned Ok after {waited:?} \
             (the eager spin's flag was then {flag_then}): the host is told queued work \
             finished that may still run"
        ),
        Err(error) => assert!(
            error.is_capture_refusal(),
            "refused, but with an untyped error: {error:?}"
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input: typed errors, no panic, no hang
// ---------------------------------------------------------------------------------------------

/// Sequence: every coordinator method given an id of another coordinator (alive, with live
/// operations numbered like this one's) and `OperationId::UNREGISTERED`; complete before
/// begin, complete twice, begin twice, a self-dependency, a dependency added after begin; a
/// callback on a foreign id; `wait_until_ready` with zero and `Duration::MAX` timeouts.
/// Expected: each a typed error (a foreign id `UnknownOperation`, never a satisfied or retired
/// one), no callback run for a refused registration, no panic, no hang.
#[test]
fn every_coordinator_method_answers_foreign_ids_and_misuse_with_typed_errors() {
    let gpu = require_gpu!();
    let _serial = serial();
    let pool = EventPool::new(&gpu.context, 4, 4).unwrap();
    let ours = OperationCoordinator::new(pool.clone()).unwrap();
    let theirs = OperationCoordinator::new(pool).unwrap();
    let stream = common::stream(&gpu.context);
    let local = common::register_kernel(&ours, &[], "ours");
    let foreign = common::register_kernel(&theirs, &[], "theirs, same number");
    assert_eq!(local.get(), foreign.get(), "the probe needs equal numbers");

    let unknown = |result: Result<(), EventError>, what: &str| {
        assert!(
            matches!(result, Err(EventError::UnknownOperation { .. })),
            "{what}: {result:?}"
        );
    };
    for id in [foreign, OperationId::UNREGISTERED] {
        unknown(ours.state(id).map(drop), "state");
        unknown(ours.metadata(id).map(drop), "metadata");
        unknown(ours.synchronize(id), "synchronize");
        unknown(ours.completion(id).map(drop), "completion");
        unknown(ours.begin_operation(id, &stream), "begin_operation");
        unknown(ours.complete_operation(id), "complete_operation");
        unknown(
            ours.add_dependency(local, id),
            "add_dependency(local, foreign)",
        );
        unknown(
            ours.add_dependency(id, local),
            "add_dependency(foreign, local)",
        );
        unknown(ours.dependencies_queued(&[id]), "dependencies_queued");
        unknown(
            ours.wait_until_ready(id, Duration::ZERO),
            "wait_until_ready",
        );
        let ran = Arc::new(AtomicBool::new(false));
        unknown(
            ours.on_complete(id, {
                let ran = Arc::clone(&ran);
                move |_, _| ran.store(true, Ordering::SeqCst)
            }),
            "on_complete",
        );
        assert!(!ran.load(Ordering::SeqCst), "a refused callback ran");
    }

    let invalid = |result: Result<(), EventError>, what: &str| {
        assert!(
            matches!(result, Err(EventError::InvalidState { .. })),
            "{what}: {result:?}"
        );
    };
    invalid(ours.complete_operation(local), "complete before begin");
    assert!(matches!(
        ours.add_dependency(local, local),
        Err(EventError::SelfDependency { .. })
    ));
    // Ready at once (no dependencies), whatever the timeout.
    ours.wait_until_ready(local, Duration::ZERO).unwrap();
    within(Duration::from_secs(5), {
        let ours = ours.clone();
        move || ours.wait_until_ready(local, Duration::MAX)
    })
    .unwrap();
    ours.begin_operation(local, &stream).unwrap();
    invalid(ours.begin_operation(local, &stream), "begin twice");
    let later = common::register_kernel(&ours, &[], "later");
    invalid(
        ours.add_dependency(local, later),
        "dependency added after begin",
    );
    ours.complete_operation(local).unwrap();
    invalid(ours.complete_operation(local), "complete twice");
    ours.synchronize(local).unwrap();
    // Retired now (or soon): still answers, and a late callback runs once, at once.
    assert!(poll_until(Duration::from_secs(5), || ours
        .state(local)
        .is_ok_and(|state| state == OperationState::Completed)));
    let late = Arc::new(AtomicUsize::new(0));
    ours.on_complete(local, {
        let late = Arc::clone(&late);
        move |_, result| {
            assert_eq!(result, Ok(()));
            late.fetch_add(1, Ordering::SeqCst);
        }
    })
    .unwrap();
    assert_eq!(late.load(Ordering::SeqCst), 1);
    // The other coordinator's operation was never touched by any of the above.
    assert_eq!(theirs.state(foreign), Ok(OperationState::Registered));
}

/// Sequence: futures polled again after they resolved (completed and timed out), a future
/// with a zero timeout, one with `Duration::MAX`, futures dropped mid-wait, and a waiter
/// dropped while another thread awaits one of its futures behind a closed gate.
/// Expected: a resolved future keeps its answer (never `Pending`, never a panic); zero times
/// out and `MAX` waits as long as it takes; drops cancel; the shutdown resolves the awaited
/// future with `WaiterShutDown` (no hang); every registered wait ends in exactly one counter.
#[test]
fn waiter_futures_answer_repolls_extreme_timeouts_drops_and_shutdown() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let stream = common::stream(&gpu.context);
    let gate = Flags::new(&gpu.context, 1);

    // Resolved futures polled again.
    kernels.spin_ns(&stream, 1000).unwrap();
    let mut done = waiter.stream_idle(&stream).unwrap();
    assert!(
        poll_until(Duration::from_secs(5), || poll_once(&mut done).is_ready()),
        "a 1 µs kernel's wait never resolved"
    );
    for _ in 0..3 {
        assert!(matches!(poll_once(&mut done), Poll::Ready(Ok(()))));
    }

    // SAFETY: mapped pinned memory of this context, alive until the stream is synchronised.
    unsafe {
        kernels
            .wait_u32(&stream, gate.device(0), 1, 5_000 * MS)
            .unwrap()
    };
    let behind_gate = |timeout: Option<Duration>| {
        let mut options = WaitOptions::new(WakeMechanism::CompletionWord);
        if let Some(timeout) = timeout {
            options = options.with_timeout(timeout);
        }
        waiter.stream_idle_with(&stream, options).unwrap()
    };
    let mut zero = behind_gate(Some(Duration::ZERO));
    assert!(
        poll_until(Duration::from_secs(5), || poll_once(&mut zero).is_ready()),
        "a zero timeout never expired"
    );
    for _ in 0..3 {
        assert!(
            matches!(
                poll_once(&mut zero),
                Poll::Ready(Err(EventError::TimedOut { .. }))
            ),
            "a timed-out future changed its answer"
        );
    }
    let mut forever = behind_gate(Some(Duration::MAX));
    assert!(poll_once(&mut forever).is_pending());
    for _ in 0..16 {
        drop(behind_gate(None));
        drop(waiter.event_done_with(
            {
                let pool = EventPool::for_context(&gpu.context).unwrap();
                let event = pool.acquire_owned(false).unwrap();
                event.record(&stream).unwrap();
                event
            },
            Some(Duration::from_secs(1)),
        ));
    }
    drop(forever);
    let awaited = behind_gate(None);
    let (tx, rx) = mpsc::channel();
    let awaiting = std::thread::spawn(move || {
        let _ = tx.send(futures::executor::block_on(awaited));
    });
    // Dropped on another thread: after stopping the reactor (which fails the future), the drop
    // frees the waiter's completion words, and freeing pinned memory waits for the context,
    // gate included, so this thread opens the gate once the future has answered.
    let dropper = std::thread::spawn(move || drop(waiter));
    let result = rx.recv_timeout(Duration::from_secs(5));
    gate.write(0, 1);
    dropper.join().expect("dropping the waiter panicked");
    stream.synchronize().unwrap();
    awaiting.join().unwrap();

    assert_eq!(
        result.expect("a future awaited across the waiter's shutdown hung"),
        Err(EventError::WaiterShutDown)
    );
}

/// Sequence: a coordinator with its own waiter is dropped while an operation it watches (a
/// completion callback) is still behind a closed gate, and a task holds its `completion()`
/// future. Expected: the drop returns promptly (no join on a busy reactor), nothing panics,
/// the callback runs at most once and its captured state is released (not leaked), the future
/// resolves (completed or `WaiterShutDown`) instead of hanging.
#[test]
fn dropping_a_coordinator_with_callbacks_and_futures_pending_releases_them_without_a_hang() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 4, 4).unwrap()).unwrap();
    let stream = common::stream(&gpu.context);
    let gate = Flags::new(&gpu.context, 1);
    let token = Arc::new(());
    let runs = Arc::new(AtomicUsize::new(0));
    let op = common::register_kernel(&coordinator, &[], "behind a gate");
    coordinator
        .on_complete(op, {
            let (token, runs) = (Arc::clone(&token), Arc::clone(&runs));
            move |_, _| {
                let _keep = &token;
                runs.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
    coordinator.begin_operation(op, &stream).unwrap();
    // SAFETY: mapped pinned memory of this context, alive until the stream is synchronised.
    unsafe {
        kernels
            .wait_u32(&stream, gate.device(0), 1, 5_000 * MS)
            .unwrap()
    };
    coordinator.complete_operation(op).unwrap();
    let future = coordinator.completion(op).unwrap();

    within(Duration::from_secs(5), move || drop(coordinator));
    let resolved = within(Duration::from_secs(5), move || {
        futures::executor::block_on(future)
    });
    gate.write(0, 1);
    stream.synchronize().unwrap();

    assert!(
        matches!(resolved, Ok(()) | Err(EventError::WaiterShutDown)),
        "{resolved:?}"
    );
    assert!(runs.load(Ordering::SeqCst) <= 1, "the callback ran twice");
    assert!(
        poll_until(Duration::from_secs(5), || Arc::strong_count(&token) == 1),
        "the dropped coordinator's callback (and what it owns) was leaked"
    );
}

// ---------------------------------------------------------------------------------------------
// Registries over 10^5 iterations
// ---------------------------------------------------------------------------------------------

/// Sequence: 10^5 operations in one chain, with GPU timing on, moving to a freshly created
/// stream every 1000 (the old one dropped); every 10th gets its callback *after* it completed
/// (the waiter starts watching it late); every 7th has a `completion()` future made and dropped
/// at once (cancelled mid-wait). Patterns the existing 10^5 tests do not combine: stream churn
/// (per-stream queues, timing queues and wake events keyed by stream ids), late watches and
/// cancellations. Expected: every callback once; live operations, waiter entries, events
/// created and per-stream state bounded; the waiter's books balance.
#[test]
fn a_hundred_thousand_operations_across_churned_streams_stay_bounded() {
    const OPS: usize = 100_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let events = EventPool::new(&gpu.context, 0, 0).unwrap();
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let coordinator = OperationCoordinator::with_waiter(events.clone(), Arc::clone(&waiter));
    coordinator.set_timing(true);
    let watched = Arc::new(AtomicUsize::new(0));
    let bad = Arc::new(AtomicUsize::new(0));
    let mut stream = common::stream(&gpu.context);
    let mut last: Option<OperationId> = None;
    let mut live_peak = 0;
    let mut callbacks = 0;
    for i in 0..OPS {
        if i % 1000 == 0 && i > 0 {
            stream = common::stream(&gpu.context);
        }
        let deps: Vec<OperationId> = last.into_iter().collect();
        let id = common::register_kernel(&coordinator, &deps, "");
        coordinator.begin_operation(id, &stream).unwrap();
        coordinator.complete_operation(id).unwrap();
        if i % 10 == 0 {
            callbacks += 1;
            let (watched, bad) = (Arc::clone(&watched), Arc::clone(&bad));
            coordinator
                .on_complete(id, move |done, result| {
                    if done != id || result.is_err() {
                        bad.fetch_add(1, Ordering::SeqCst);
                    }
                    watched.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
        }
        if i % 7 == 0 {
            drop(coordinator.completion(id).unwrap());
        }
        if i % 1000 == 999 {
            coordinator.synchronize(id).unwrap();
            live_peak = live_peak.max(coordinator.live_operations());
        }
        last = Some(id);
    }
    coordinator.synchronize(last.unwrap()).unwrap();
    stream.synchronize().unwrap();
    assert!(
        poll_until(Duration::from_secs(10), || {
            coordinator.retire_finished();
            watched.load(Ordering::SeqCst) >= callbacks && waiter.pending() == 0
        }),
        "{} of {callbacks} callbacks ran; {} waits pending",
        watched.load(Ordering::SeqCst),
        waiter.pending()
    );
    assert!(poll_until(Duration::from_secs(5), || coordinator
        .live_operations()
        == 0));

    assert_eq!(
        watched.load(Ordering::SeqCst),
        callbacks,
        "a callback ran twice"
    );
    assert_eq!(bad.load(Ordering::SeqCst), 0);
    assert!(live_peak <= 2048, "{live_peak} operations live at once");
    let stats = waiter.stats();
    assert_eq!(
        stats.completed + stats.failed + stats.timed_out + stats.cancelled,
        stats.registered,
        "{stats:?}"
    );
    let counters = events.counters();
    let created = counters.created_regular + counters.created_timing + counters.created_blocking;
    assert!(
        created <= 8192,
        "{created} events created for {OPS} operations: {counters:?}"
    );
    let metrics = coordinator.metrics();
    assert_eq!((metrics.completed, metrics.failed), (OPS as u64, 0));
}
