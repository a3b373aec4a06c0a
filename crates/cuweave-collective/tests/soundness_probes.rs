//! Adversarial soundness probes of the collective layer's safe API: call sequences with no
//! `unsafe` that try to leave an operation stuck in a coordinator, hand NCCL a group it refuses
//! only after a communicator is ruined, turn a finished collective into a timeout that aborts a
//! healthy communicator, wait on a capturing stream, hold a wait far past its deadline, reuse a
//! unique id, or grow the waiter's registry. Each test asserts the correct behaviour, so it
//! fails where the hole exists; the comment above it says which sequence it tries, where in the
//! source the suspected hole is, and what a failure means.
//!
//! Every test starts with the GPU gate (it skips without a GPU or without NCCL) and takes the
//! binary's serial guard: they capture graphs, hold streams behind spinning kernels or count
//! the global waiter's registrations, which other tests running beside them would disturb.
//! Two-GPU probes skip with a reason on one GPU.

#[macro_use]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_bytes_eq, own_comm, pattern, skip, stream};
use cuweave_collective::{
    CollectiveError, CommConfig, Communicator, CoordinatedCollectives, Group, ReduceOp, UniqueId,
};
use cuweave_driver::{CaptureMode, Context, Device, InstantiateOptions, Stream};
use cuweave_event::{AsyncEventWaiter, EventPool, OperationCoordinator};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_test_support::kernels::TestKernels;

const MS: u64 = 1_000_000;

fn upload(context: &Arc<Context>, values: &[u32]) -> DeviceBuffer<u32> {
    DeviceBuffer::from_slice(context, values).expect("upload")
}

/// Whether `error` is a typed capture refusal (`GraphError::Capturing`), however it is wrapped.
fn is_capture_refusal(error: &CollectiveError) -> bool {
    match error {
        CollectiveError::Driver(error) => error.is_capture_refusal(),
        CollectiveError::Event(error) => error.is_capture_refusal(),
        CollectiveError::Memory(error) => error.is_capture_refusal(),
        _ => false,
    }
}

/// Every device, or `None` after printing why the two-GPU probe is skipped.
fn two_devices_or_skip(test: &str) -> Option<Vec<Device>> {
    let devices = Device::all().expect("devices");
    if devices.len() < 2 {
        skip(
            &format!("soundness_probes::{test}"),
            &format!("needs two GPUs, found {} (multi-rank probe)", devices.len()),
        );
        return None;
    }
    Some(devices)
}

// ---------------------------------------------------------------------------------------------
// CoordinatedCollectives::run: a begin refused by a capture
// ---------------------------------------------------------------------------------------------

/// Sequence: a coordinated all-reduce `op0` is queued eagerly on stream A behind a 400 ms spin
/// (so it stays `Queued`); stream B begins a capture without synchronising; the program then
/// asks, 100 times, for a coordinated all-reduce on B that depends on `op0`.
///
/// `CoordinatedCollectives::run` (src/coordinated.rs) pre-checks only the stream's
/// context and that the dependencies are queued, then `register_operation`s and calls
/// `begin_operation(id, stream)?`. The coordinator refuses that begin with
/// `GraphError::Capturing` ("capturing stream, dependency recorded eagerly with no
/// synchronisation": cuweave-event coordinator/capture_waits.rs table, `decide` -> `Refuse`),
/// and its doc says "the operation stays registered" (`OperationCoordinator::begin_operation`,
/// cuweave-event src/coordinator/lifecycle.rs). `run` returns at the `?` without completing it, so
/// every refused call leaves a registered operation that never begins, and keeps `op0` alive
/// through its dependant count. `run`'s own doc promises "a refused call leaves nothing behind ...
/// A caller may retry ... without the coordinator growing." Expected: each call is a typed capture
/// refusal, the capture survives, and once `op0` has finished the coordinator holds no live
/// operation. A failure (`live_operations` of about 101) is a registry that grows by one per
/// refused call, for ever.
#[test]
fn a_coordinated_collective_refused_by_a_capture_leaves_nothing_registered() {
    let (gpu, _serial) = gate!();
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let kernels = TestKernels::load(&context).expect("kernels");
    let coordinator = OperationCoordinator::new(EventPool::new(&context, 16, 16).expect("pool"))
        .expect("coordinator");
    let collectives = CoordinatedCollectives::new(coordinator.clone());
    let (a, b) = (Arc::new(stream(&context)), Arc::new(stream(&context)));
    let mut first = upload(&context, &pattern::<u32>(1024, 1));
    let mut second = upload(&context, &pattern::<u32>(1024, 2));
    kernels.spin_ns(&a, 400 * MS).expect("spin");
    let op0 = collectives
        .all_reduce_in_place(&comm, &mut first, ReduceOp::Sum, &a, &[])
        .expect("op0 queued eagerly on A");

    b.begin_capture(CaptureMode::Relaxed).expect("capture on B");
    let started = Instant::now();
    let mut refusals = Vec::new();
    for _ in 0..100 {
        refusals.push(collectives.all_reduce_in_place(
            &comm,
            &mut second,
            ReduceOp::Sum,
            &b,
            &[op0],
        ));
    }
    let loop_time = started.elapsed();
    let ended = b.end_capture();

    assert!(
        loop_time < Duration::from_millis(300),
        "the refusals took {loop_time:?}: op0 may have finished meanwhile, inconclusive"
    );
    for (i, result) in refusals.iter().enumerate() {
        match result {
            Err(error) => assert!(is_capture_refusal(error), "call {i}: {error:?}"),
            Ok(id) => panic!("call {i} was queued into the capture as {id:?}"),
        }
    }
    ended.expect("the capture survives the refused begins");
    coordinator.synchronize(op0).expect("op0 finishes");
    a.synchronize().expect("A drains");
    coordinator.retire_finished();
    assert_eq!(
        coordinator.live_operations(),
        0,
        "refused calls stayed registered (and kept op0 alive): metrics {:?}",
        coordinator.metrics()
    );
    assert!(!comm.is_aborted());
}

// ---------------------------------------------------------------------------------------------
// Group::launch: one communicator's calls on a capturing and an eager stream
// ---------------------------------------------------------------------------------------------

/// Sequence: stream B begins a (synchronised, relaxed) capture; one `Group` holds a rank's
/// send to itself on B and its receive from itself on the eager stream A; `launch`.
///
/// NCCL refuses a communicator whose calls in one group mix captured and uncaptured streams:
/// `taskAppend` returns `ncclInvalidUsage` ("Streams given to a communicator within a NCCL
/// group must either be all uncaptured or all captured by the same graph"), and
/// `ncclEnqueueCheck`'s `fail:` path calls `ncclCommSetAsyncError` on a non-blocking
/// communicator: the error becomes the communicator's sticky asynchronous state. cuweave checks
/// nothing about capture before issuing (`run` and its `check_self_exchanges`, since replaced by
/// `check_calls`, src/collective/issue.rs); once the first call was accepted it settles, sees the
/// asynchronous error and aborts the group's communicators (the settling in `run`). So a bad
/// argument, which cuweave could see from the streams' capture status, destroys a healthy
/// communicator. (A one-rank collective skips NCCL's planner, so the self send/receive pair is what
/// reaches the check.) Expected: a typed refusal before NCCL (`InvalidArgument` or a capture
/// refusal), the communicator healthy, the capture intact with A not pulled into it, and the same
/// exchange working eagerly afterwards.
#[test]
fn a_group_mixing_a_capturing_and_an_eager_stream_on_one_communicator_is_refused_before_nccl() {
    let (gpu, _serial) = gate!();
    if cuweave_test_support::skip_under_sanitizer(
        "soundness_probes::a_group_mixing_a_capturing_and_an_eager_stream_on_one_communicator_is_refused_before_nccl",
        "buffers used by a capture bound to no graph pool are leaked on purpose",
    ) {
        return;
    }
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let (a, b) = (stream(&context), stream(&context));
    let input = pattern::<u32>(4096, 5);
    let x = upload(&context, &input);
    let mut y = DeviceBuffer::<u32>::zeroed(&context, 4096).expect("y");

    b.begin_capture_synchronized(CaptureMode::Relaxed)
        .expect("capture on B");
    let launched = {
        let mut group = Group::new();
        group.send(&comm, &x, 0, &b).expect("send checks");
        group.recv(&comm, &mut y, 0, &a).expect("recv checks");
        group.launch()
    };
    let a_joined = a.is_capturing();
    let ended = b.end_capture();

    eprintln!("mixed group: {launched:?}; A capturing: {a_joined:?}");
    assert!(
        !comm.is_aborted(),
        "a group NCCL refuses for its streams aborted the communicator: {launched:?}"
    );
    comm.check_async_error()
        .expect("the communicator keeps no asynchronous error");
    match &launched {
        Err(CollectiveError::InvalidArgument { .. }) => {}
        Err(error) if is_capture_refusal(error) => {}
        other => panic!("expected a typed refusal before NCCL, got {other:?}"),
    }
    assert!(matches!(a_joined, Ok(false)), "A joined B's capture");
    ended.expect("the capture survives the refused group");
    let mut group = Group::new();
    group.send(&comm, &x, 0, &a).expect("send");
    group.recv(&comm, &mut y, 0, &a).expect("recv");
    group.launch().expect("the same exchange, eagerly");
    comm.synchronize(&a).expect("synchronize");
    assert_bytes_eq("eager exchange", &y.to_vec().expect("download"), &input);
}

// ---------------------------------------------------------------------------------------------
// CollectiveFuture: polled late
// ---------------------------------------------------------------------------------------------

/// Sequence: a collective queued behind a 40 ms spin; `completion_within(150 ms)` made at once
/// but not polled; the host waits (`Stream::synchronize`) until the collective has finished,
/// well inside the deadline, then is busy with other GPU work past the deadline; only then is
/// the future awaited (what an async task that polls late does).
///
/// The future's wait is re-armed only inside `CollectiveFuture::poll` (src/wait.rs): its first
/// registration carries a 10 ms tick, which the reactor decides as `TimedOut` while the spin
/// still runs. The first late poll sees that tick, checks `ncclCommGetAsyncError`, finds the
/// deadline passed and aborts the communicator with `Timeout`, without ever asking whether the
/// event it waits for has completed. Expected: `Ok(())` (the work finished within the
/// deadline) and a healthy communicator. A failure is a finished collective reported as
/// "did not complete within 150 ms" and a healthy communicator aborted for it.
#[test]
fn a_future_polled_after_its_deadline_for_work_that_finished_in_time_is_ok_and_does_not_abort() {
    let (gpu, _serial) = gate!();
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let kernels = TestKernels::load(&context).expect("kernels");
    let (s, other) = (stream(&context), stream(&context));
    let input = pattern::<u32>(4096, 6);
    let mut buffer = upload(&context, &input);
    kernels.spin_ns(&s, 40 * MS).expect("spin");
    comm.all_reduce_in_place(&mut buffer, ReduceOp::Max, &s)
        .expect("all_reduce");
    let deadline = Duration::from_millis(150);
    let future = comm.completion_within(&s, deadline).expect("future");
    let queued = Instant::now();
    s.synchronize().expect("the collective finishes");
    let finished = queued.elapsed();
    assert!(
        finished < deadline,
        "the collective took {finished:?}, past the deadline: inconclusive"
    );
    // Real GPU work keeps the host busy past the deadline before the first poll.
    kernels.spin_ns(&other, 250 * MS).expect("spin");
    other.synchronize().expect("other work");
    assert!(queued.elapsed() > deadline);

    let result = futures::executor::block_on(future);
    assert!(
        result.is_ok(),
        "work that finished after {finished:?} (deadline {deadline:?}) resolved as {result:?}"
    );
    assert!(
        !comm.is_aborted(),
        "a late poll aborted a communicator whose work had finished"
    );
    assert_bytes_eq("result", &buffer.to_vec().expect("download"), &input);
}

// ---------------------------------------------------------------------------------------------
// synchronize on a capturing stream
// ---------------------------------------------------------------------------------------------

/// Sequence: begin a (synchronised, thread-local) capture on S; capture an all-reduce; call
/// `comm.synchronize_within(&S, 2 s)` while S still captures; end the capture, launch the graph.
///
/// `Communicator::completion_within` (src/wait.rs) checks the device and the abort flag, then
/// records a fresh event on S and hands it to the waiter; it never asks whether S is capturing. The
/// event layer refuses exactly this for its own stream waits (`stream_idle`:
/// `GraphError::Capturing`, "nothing queued on it now would run"), but `event_done_with` has no
/// such check: the event recorded into the capture is either refused by the driver
/// (`CUDA_ERROR_CAPTURED_EVENT`, leaking out as an event-layer error), or read as "never recorded"
/// (an `Ok` for a collective that has not run), or left pending until the deadline (a `Timeout`
/// that aborts a healthy communicator). Expected: a typed capture refusal at once, the communicator
/// healthy, and the capture intact (its graph replays the collective).
#[test]
fn synchronize_on_a_capturing_stream_is_a_typed_capture_refusal_and_the_capture_survives() {
    let (gpu, _serial) = gate!();
    if cuweave_test_support::skip_under_sanitizer(
        "soundness_probes::synchronize_on_a_capturing_stream_is_a_typed_capture_refusal_and_the_capture_survives",
        "buffers used by a capture bound to no graph pool are leaked on purpose",
    ) {
        return;
    }
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let s = stream(&context);
    let input = pattern::<u32>(1 << 14, 7);
    let send = upload(&context, &input);
    let mut recv = DeviceBuffer::<u32>::zeroed(&context, 1 << 14).expect("recv");

    s.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .expect("capture");
    let captured = comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s);
    let started = Instant::now();
    let waited = comm.synchronize_within(&s, Duration::from_secs(2));
    let took = started.elapsed();
    let ended = s.end_capture();

    captured.expect("the all-reduce is captured");
    eprintln!("synchronize while capturing: {waited:?} after {took:?}");
    assert!(
        !comm.is_aborted(),
        "a wait on a capturing stream aborted the communicator: {waited:?}"
    );
    assert!(took < Duration::from_secs(1), "the wait took {took:?}");
    let graph = ended.expect("the capture survives the wait");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");
    exec.launch(&s).expect("replay");
    s.synchronize().expect("replayed");
    assert_bytes_eq("replay", &recv.to_vec().expect("download"), &input);
    match &waited {
        Err(error) if is_capture_refusal(error) => {}
        other => panic!(
            "a wait on a capturing stream must be a typed capture refusal before anything is \
             recorded, got {other:?}"
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Deadlines that fire late
// ---------------------------------------------------------------------------------------------

/// Sequence: a 1.5 s spin holds S; an all-reduce queued behind it; `synchronize_within(50 ms)`.
///
/// The deadline fires in `CollectiveFuture::poll` (src/wait.rs), which then calls
/// `comm.abort()` inline before returning. `ncclCommAbort` frees the communicator's device and
/// pinned host memory (`cudaFree`/`cuMemUnmap`/`cudaFreeHost`, which synchronise with the
/// device), so the abort, and with it the "timed out" return, can wait for the unrelated
/// spinning kernel: a 50 ms deadline that returns after 1.5 s. Expected: `Timeout` within the
/// deadline plus a generous 700 ms, the communicator aborted. A failure means a deadline does
/// not bound the wait whenever other work holds the stream.
#[test]
fn a_deadline_bounds_the_wait_even_when_other_work_holds_the_stream() {
    let (gpu, _serial) = gate!();
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let kernels = TestKernels::load(&context).expect("kernels");
    let s = stream(&context);
    let input = pattern::<u32>(4096, 8);
    let mut buffer = upload(&context, &input);
    kernels.spin_ns(&s, 1_500 * MS).expect("spin");
    comm.all_reduce_in_place(&mut buffer, ReduceOp::Sum, &s)
        .expect("all_reduce");
    let deadline = Duration::from_millis(50);
    let started = Instant::now();
    let waited = comm.synchronize_within(&s, deadline);
    let took = started.elapsed();
    eprintln!("deadline {deadline:?}: {waited:?} after {took:?}");
    assert!(
        matches!(waited, Err(CollectiveError::Timeout { .. })),
        "{waited:?}"
    );
    assert!(comm.is_aborted());
    assert!(
        took < deadline + Duration::from_millis(700),
        "a {deadline:?} deadline returned after {took:?}"
    );
    s.synchronize().expect("the stream drains");
    assert_bytes_eq("buffer", &buffer.to_vec().expect("download"), &input);
}

// ---------------------------------------------------------------------------------------------
// Unique ids reused
// ---------------------------------------------------------------------------------------------

/// Sequence: a one-rank communicator made from `id`; a second `init_rank(1, 0, &id)` with a 2 s
/// deadline.
///
/// `UniqueId` is `Copy` (src/id.rs) and nothing records that an id was used: the second
/// initialisation connects to a bootstrap root that has already served its rank and exited.
/// NCCL retries a refused connection for about 20 s; cuweave's deadline (settle_raw,
/// src/comm/settle.rs) must cut that short through `ncclCommAbort`. Expected: a typed error
/// (`Timeout` or NCCL's) within the deadline plus 3 s, and the first communicator untouched. A
/// failure is a reused id accepted (`Ok`), or a hang past its deadline.
#[test]
fn a_reused_unique_id_is_a_typed_error_within_the_deadline() {
    let (gpu, _serial) = gate!();
    let config = CommConfig::default().with_timeout(Duration::from_secs(2));
    let id = UniqueId::new().expect("id");
    let first = Communicator::init_rank(1, 0, &id, gpu.device, &config).expect("first init");
    let started = Instant::now();
    let second = Communicator::init_rank(1, 0, &id, gpu.device, &config);
    let took = started.elapsed();
    eprintln!("reused id: {second:?} after {took:?}");
    assert!(
        took < config.timeout + Duration::from_secs(3),
        "the reused id took {took:?} (deadline {:?})",
        config.timeout
    );
    match &second {
        Err(CollectiveError::Timeout { .. } | CollectiveError::Nccl { .. }) => {}
        other => panic!("a reused unique id must be a typed error, got {other:?}"),
    }
    let s = stream(first.context());
    let input = pattern::<u32>(256, 9);
    let mut buffer = upload(first.context(), &input);
    first
        .all_reduce_in_place(&mut buffer, ReduceOp::Sum, &s)
        .expect("the first communicator still works");
    first.synchronize(&s).expect("synchronize");
    assert_bytes_eq("first", &buffer.to_vec().expect("download"), &input);
}

// ---------------------------------------------------------------------------------------------
// Registries
// ---------------------------------------------------------------------------------------------

/// Sequence: a 300 ms spin holds S; 10^4 `completion` futures on S are made and dropped while
/// pending (a cancelled task, a `select!` that lost), then the stream drains.
///
/// Each future records a fresh event and registers it with the global waiter
/// (`Communicator::completion_within`, src/wait.rs); dropping it cancels the registration.
/// Expected: every registration is accounted for (completed, cancelled or timed out) and the
/// waiter's pending count returns to where it was within 5 s of the stream draining. A failure is a
/// waiter that keeps an entry (and an event) per abandoned future.
#[test]
fn ten_thousand_completion_futures_dropped_pending_leave_the_waiter_bounded() {
    let (gpu, _serial) = gate!();
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let kernels = TestKernels::load(&context).expect("kernels");
    let s = stream(&context);
    let waiter = AsyncEventWaiter::global().expect("waiter");
    let (pending_before, stats_before) = (waiter.pending(), waiter.stats());
    kernels.spin_ns(&s, 300 * MS).expect("spin");
    const FUTURES: u64 = 10_000;
    for _ in 0..FUTURES {
        drop(comm.completion(&s).expect("future"));
    }
    s.synchronize().expect("drains");
    let deadline = Instant::now() + Duration::from_secs(5);
    while waiter.pending() > pending_before && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let stats = waiter.stats();
    eprintln!("waiter before {stats_before:?}, after {stats:?}");
    assert!(
        waiter.pending() <= pending_before,
        "{} waits still pending after the stream drained (before: {pending_before})",
        waiter.pending()
    );
    let registered = stats.registered - stats_before.registered;
    let ended = (stats.completed - stats_before.completed)
        + (stats.cancelled - stats_before.cancelled)
        + (stats.timed_out - stats_before.timed_out)
        + (stats.failed - stats_before.failed);
    assert!(registered >= FUTURES, "registered {registered}");
    assert!(ended >= registered, "{ended} of {registered} waits ended");
    assert!(!comm.is_aborted());
}

// ---------------------------------------------------------------------------------------------
// Two GPUs
// ---------------------------------------------------------------------------------------------

/// Sequence (two GPUs, one process): `init_all`; rank 0's stream begins a capture, rank 1's
/// stays eager; one `Group` holds both ranks' all-reduces; `launch`.
///
/// NCCL's `doLaunches` refuses a group whose sibling communicators are partly captured
/// ("Either none or all communicators in a ncclGroup() can be CUDA graph captured",
/// `ncclInvalidUsage`), after the ranks entered their intra-process barrier: NCCL's own comment
/// says "these comms are permanently trashed". cuweave issues the group without looking at the
/// streams' capture status (`run`, src/collective/issue.rs) and then aborts every communicator of
/// the failed group. Expected: a typed refusal before NCCL, both ranks healthy, the capture
/// intact, and the same group working eagerly afterwards.
#[test]
fn two_gpus_a_group_with_one_rank_captured_and_one_eager_is_refused_before_nccl() {
    let (_gpu, _serial) = gate!();
    let Some(devices) = two_devices_or_skip(
        "two_gpus_a_group_with_one_rank_captured_and_one_eager_is_refused_before_nccl",
    ) else {
        return;
    };
    let comms = Communicator::init_all(
        &devices[..2],
        &CommConfig::default().with_timeout(Duration::from_secs(10)),
    )
    .expect("init_all");
    let streams: Vec<Stream> = comms.iter().map(|comm| stream(comm.context())).collect();
    let input = pattern::<u32>(4096, 10);
    let mut buffers: Vec<DeviceBuffer<u32>> = comms
        .iter()
        .map(|comm| upload(comm.context(), &input))
        .collect();
    streams[0]
        .begin_capture_synchronized(CaptureMode::Relaxed)
        .expect("capture on rank 0's stream");
    let launched = {
        let mut group = Group::new();
        for ((comm, buffer), s) in comms.iter().zip(buffers.iter_mut()).zip(&streams) {
            group
                .all_reduce_in_place(comm, buffer, ReduceOp::Max, s)
                .expect("checks");
        }
        group.launch()
    };
    let ended = streams[0].end_capture();
    eprintln!("half-captured group: {launched:?}");
    for comm in &comms {
        assert!(
            !comm.is_aborted(),
            "rank {} was aborted by a group NCCL refuses for its streams: {launched:?}",
            comm.rank()
        );
    }
    match &launched {
        Err(CollectiveError::InvalidArgument { .. }) => {}
        Err(error) if is_capture_refusal(error) => {}
        other => panic!("expected a typed refusal before NCCL, got {other:?}"),
    }
    ended.expect("the capture survives");
    let mut group = Group::new();
    for ((comm, buffer), s) in comms.iter().zip(buffers.iter_mut()).zip(&streams) {
        group
            .all_reduce_in_place(comm, buffer, ReduceOp::Max, s)
            .expect("checks");
    }
    group.launch().expect("the same group, eagerly");
    for ((comm, buffer), s) in comms.iter().zip(&buffers).zip(&streams) {
        comm.synchronize(s).expect("synchronize");
        assert_bytes_eq("max", &buffer.to_vec().expect("download"), &input);
    }
}

/// Sequence (two GPUs, one process): `init_all`; one `Group` holds rank 0's send of 4096
/// elements to rank 1 and rank 1's receive of 2048 elements from rank 0; `launch`.
///
/// `check_self_exchanges` (since replaced by `check_calls`, src/collective/issue.rs) pairs only a
/// rank's sends to itself with its receives from itself; between two ranks driven from this one
/// group both sides are in hand, yet their byte counts are not compared. NCCL then runs a send
/// whose receiver expects half of it: the pair hangs on the GPU or leaves the surplus in the
/// connection for the next transfer to read. Expected: `InvalidArgument` before NCCL (as a
/// mismatched self pair is) and both ranks healthy.
#[test]
fn two_gpus_mismatched_send_and_recv_lengths_in_one_group_are_refused_before_nccl() {
    let (_gpu, _serial) = gate!();
    let Some(devices) = two_devices_or_skip(
        "two_gpus_mismatched_send_and_recv_lengths_in_one_group_are_refused_before_nccl",
    ) else {
        return;
    };
    let comms = Communicator::init_all(
        &devices[..2],
        &CommConfig::default().with_timeout(Duration::from_secs(3)),
    )
    .expect("init_all");
    let (s0, s1) = (stream(comms[0].context()), stream(comms[1].context()));
    let send = upload(comms[0].context(), &pattern::<u32>(4096, 11));
    let mut recv = DeviceBuffer::<u32>::zeroed(comms[1].context(), 2048).expect("recv");
    let launched = {
        let mut group = Group::new();
        group.send(&comms[0], &send, 1, &s0).expect("send checks");
        group
            .recv(&comms[1], &mut recv, 0, &s1)
            .expect("recv checks");
        group.launch()
    };
    eprintln!("mismatched pair: {launched:?}");
    if !matches!(launched, Err(CollectiveError::InvalidArgument { .. })) {
        // The pair may be hung on the GPU: abort both ranks together (one after the other, the
        // first abort could wait for the second) before failing, so the test ends.
        std::thread::scope(|scope| {
            for comm in &comms {
                scope.spawn(move || comm.abort());
            }
        });
        panic!("a 4096-element send paired with a 2048-element receive in one group: {launched:?}");
    }
    for comm in &comms {
        assert!(!comm.is_aborted(), "rank {} aborted", comm.rank());
    }
}
