//! Adversarial soundness probes of the driver layer's safe API: call sequences with no `unsafe`
//! (or with `unsafe` calls whose contracts are plainly met) that try to drop what queued work
//! still needs, break a stream capture instead of getting a typed refusal, leave the process's
//! capture bookkeeping poisoned, report a stream's progress early, answer bad input with `Ok`
//! or a panic, or grow a registry without bound.
//!
//! Every test starts with `require_gpu!()` (it skips without a GPU); those that capture graphs
//! or rely on a spinning kernel's timing take `serial()`. Each test is named for the behaviour
//! it expects and says above it which sequence it tries and what a failure means.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use cuweave_driver::graph::{
    LaunchesAfter, PRUNE_FENCES_AT, active_captures, eager_use_fences, fence_eager_use,
};
use cuweave_driver::memory::{
    DeviceAllocation, HostAllocFlags, HostAllocation, HostRegistration, ManagedAllocation,
    MappedWords, StreamMarks,
};
use cuweave_driver::{
    CaptureMode, DriverError, Event, EventFlags, EventPool, Graph, InstantiateOptions, Module,
    Stream, StreamFlags,
};
use cuweave_test_support::kernels::{PTX, TestKernels};
use cuweave_test_support::{serial, skip_under_sanitizer};

const MS: u64 = 1_000_000;

fn stream(gpu: &cuweave_test_support::Gpu) -> Stream {
    Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("stream")
}

/// Loads the test kernels and runs one spin eagerly, so that lazy module loading is paid for
/// before any capture (a first launch inside a capture would load the kernel there).
fn warmed_kernels(gpu: &cuweave_test_support::Gpu, on: &Stream) -> TestKernels {
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    kernels.spin_ns(on, 0).expect("warm-up spin");
    on.synchronize().expect("warm-up");
    kernels
}

/// Asserts `result` is `Ok` or a typed capture refusal ([`DriverError::is_capture_refusal`]).
fn ok_or_capture_refusal<T: std::fmt::Debug>(result: &Result<T, DriverError>, what: &str) {
    if let Err(error) = result {
        assert!(
            error.is_capture_refusal(),
            "{what}: expected Ok or a typed capture refusal, got {error:?}"
        );
    }
}

/// Ends the capture on `origin` (always, so a failed probe leaves no capture behind), then
/// checks it produced a graph that instantiates and replays; returns the graph's node count.
fn finish_and_replay(origin: &Stream, what: &str) -> usize {
    let ended = origin.end_capture();
    let graph = ended.unwrap_or_else(|error| panic!("{what}: the capture broke: {error:?}"));
    let nodes = graph.node_count().expect("node count");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .unwrap_or_else(|error| panic!("{what}: instantiate: {error}"));
    exec.launch(origin)
        .unwrap_or_else(|error| panic!("{what}: replay: {error}"));
    origin
        .synchronize()
        .unwrap_or_else(|error| panic!("{what}: sync after replay: {error}"));
    nodes
}

// ---------------------------------------------------------------------------------------------
// Graph keep-alives and queued launches
// ---------------------------------------------------------------------------------------------

/// What a keep-alive saw when it was dropped: `NOT_DROPPED`, or whether the launch stream was
/// idle by then.
const NOT_DROPPED: u8 = 0;
const DROPPED_AFTER_WORK: u8 = 1;
const DROPPED_UNDER_WORK: u8 = 2;

/// A keep-alive that, when dropped, notes whether the stream its graph was launched on had
/// finished (stands for a buffer or pool the graph's nodes use).
struct LaunchWitness {
    stream: Arc<Stream>,
    seen: Arc<AtomicU8>,
}

impl Drop for LaunchWitness {
    fn drop(&mut self) {
        let idle = self.stream.query().unwrap_or(false);
        let seen = if idle {
            DROPPED_AFTER_WORK
        } else {
            DROPPED_UNDER_WORK
        };
        self.seen.store(seen, Ordering::SeqCst);
    }
}

/// Sequence: capture a 300 ms spin into a graph, `keep_alive` a value (what a buffer or pool
/// its nodes use would be), instantiate, drop the graph, launch the executable, and drop the
/// executable at once while the launch still runs.
///
/// `Graph::keep_alive` promises to keep the value alive "as long as this graph and every
/// executable instantiated from it" for "buffers its nodes use", and `GraphExec` says "queued
/// launches still complete". But `Drop for GraphExec` (src/graph/exec.rs) only calls
/// `cuGraphExecDestroy` (which does not wait) and then its fields drop: `keep_alive` and the
/// `Retirement` generations go at once, with no fence for the launches still queued (the
/// retirement fences exist only for `update`). A failure means the memory a graph uses is freed
/// (or returned to a pool and reused) under its own in-flight launch.
#[test]
fn dropping_a_graph_exec_keeps_its_keep_alives_until_its_queued_launches_finish() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let launch_stream = Arc::new(stream(&gpu));
    let kernels = warmed_kernels(&gpu, &launch_stream);
    let seen = Arc::new(AtomicU8::new(NOT_DROPPED));

    launch_stream
        .begin_capture(CaptureMode::ThreadLocal)
        .expect("capture");
    let spun = kernels.spin_ns(&launch_stream, 300 * MS);
    let ended = launch_stream.end_capture();
    spun.expect("spin captured");
    let mut graph: Graph = ended.expect("graph");
    let witness: Arc<dyn Any + Send + Sync> = Arc::new(LaunchWitness {
        stream: Arc::clone(&launch_stream),
        seen: Arc::clone(&seen),
    });
    graph.keep_alive(witness);
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");
    drop(graph);
    assert_eq!(
        seen.load(Ordering::SeqCst),
        NOT_DROPPED,
        "the executable keeps it"
    );

    exec.launch(&launch_stream).expect("launch");
    drop(exec);
    let at_drop = seen.load(Ordering::SeqCst);
    launch_stream.synchronize().expect("sync");
    assert_ne!(
        at_drop, DROPPED_UNDER_WORK,
        "the keep-alive was dropped while the launch it was kept for still ran on the GPU"
    );
}

// ---------------------------------------------------------------------------------------------
// Capture bookkeeping
// ---------------------------------------------------------------------------------------------

/// Sequence: on a thread, begin a thread-local capture on a stream and drop the stream without
/// ending the capture (a `?` or a panic between begin and end does exactly this); then, on the
/// same thread, use another stream normally.
///
/// `Stream::begin_capture_recorded` (src/graph/capture/begin_end.rs) pushes a `Record`, raises the
/// process's capture count and the thread's `THREAD_CAPTURES`; only `end_capture` /
/// `forget_capture` (src/graph/capture/begin_end.rs) lowers them, and `Drop for Stream`
/// (src/stream.rs) does neither. So the thread keeps believing it captures:
/// `refuse_while_capturing` (src/graph/capture/refusals.rs) refuses every later
/// `Stream::synchronize`, `Event::query`, blocking copy and `DeviceAllocation::zeroed` on it,
/// forever, and `active_captures()` never returns to 0 (every capture-aware fast path in the
/// process stays on its slow path). Expected: dropping a capturing stream ends the capture's
/// bookkeeping; the thread's calls work afterwards.
#[test]
fn dropping_a_capturing_stream_does_not_leave_its_thread_refusing_blocking_calls() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let before = active_captures();
    let context = Arc::clone(&gpu.context);
    let (synced, queried) = std::thread::spawn(move || {
        let doomed = Stream::new(&context, StreamFlags::NON_BLOCKING).expect("stream");
        doomed
            .begin_capture(CaptureMode::ThreadLocal)
            .expect("capture");
        drop(doomed);
        let other = Stream::new(&context, StreamFlags::NON_BLOCKING).expect("stream");
        let event = Event::new(&context, EventFlags::DISABLE_TIMING).expect("event");
        event.record(&other).expect("record");
        (other.synchronize(), event.query())
    })
    .join()
    .expect("thread");
    let after = active_captures();
    assert!(
        synced.is_ok(),
        "a stream that never captured cannot be synchronised on a thread whose capturing stream was dropped: {synced:?}"
    );
    assert!(
        matches!(queried, Ok(true)),
        "an event query on that thread: {queried:?}"
    );
    assert_eq!(
        after, before,
        "the dropped stream's capture is still counted as active in the process"
    );
}

// ---------------------------------------------------------------------------------------------
// Stream marks: one word, one stream
// ---------------------------------------------------------------------------------------------

/// Sequence: two `StreamMarks` built (safely) on the same word of one `MappedWords` for two
/// streams; stream `a` spins 500 ms, then marks (mark 1); stream `b` marks at once (also 1)
/// and is synchronised.
///
/// `StreamMarks` documents that "marks from two streams would make the word jump past work the
/// other stream has not done", and guards it only per `StreamMarks` value (`belongs_to`,
/// src/memory/stream_marks.rs); `StreamMarks::new` (src/memory/stream_marks.rs) checks only
/// the index and the context, not that the word already belongs to another stream's marks. So
/// `b`'s write makes `a`'s mark read as reached (`is_reached`, `wait`) while `a` still spins:
/// a pipeline that reuses a staging buffer once its chunk's mark is reached would overwrite
/// bytes a queued copy on `a` still reads. Expected: the second `new` is refused, or `a`'s mark
/// is not reported before `a` got there.
#[test]
fn two_stream_marks_on_one_word_never_report_a_mark_before_its_stream_reached_it() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "two_stream_marks_on_one_word_never_report_a_mark_before_its_stream_reached_it",
        "needs two streams at once",
    ) {
        return;
    }
    let (a, b) = (stream(&gpu), stream(&gpu));
    let kernels = warmed_kernels(&gpu, &a);
    let words = Arc::new(MappedWords::new(&gpu.context, 1).expect("words"));
    let marks_a = StreamMarks::new(Arc::clone(&words), 0, &a, 0).expect("a's marks");
    let marks_b = match StreamMarks::new(Arc::clone(&words), 0, &b, 0) {
        Ok(marks) => marks,
        Err(DriverError::InvalidArgument { .. }) => return,
        Err(other) => panic!("expected Ok or InvalidArgument, got {other:?}"),
    };

    kernels.spin_ns(&a, 500 * MS).expect("spin");
    let mark_a = marks_a.mark(&a).expect("mark a");
    let mark_b = marks_b.mark(&b).expect("mark b");
    b.synchronize().expect("b");
    assert!(marks_b.is_reached(mark_b));
    let reported = marks_a.is_reached(mark_a);
    let a_done = a.query().expect("query a");
    a.synchronize().expect("a");
    assert!(
        !reported || a_done,
        "a's mark {} read as reached while a still ran the work queued before it",
        mark_a.value()
    );
}

// ---------------------------------------------------------------------------------------------
// Safe calls (and implicit drops) during a thread-local capture on the capturing thread
// ---------------------------------------------------------------------------------------------

/// Sequence: pinned memory allocated before a thread-local capture is dropped on the capturing
/// thread while it captures (an implicit, safe call).
///
/// `HostAllocation::new` (src/memory/host.rs) enters relaxed capture mode while a
/// capture is active, because the driver refuses `cuMemHostAlloc` there; `Drop for
/// HostAllocation` (src/memory/host.rs) calls `cuMemFreeHost` with no such guard. If the driver
/// refuses the free the same way, the capture is invalidated (and the memory leaks). Expected:
/// the capture survives and replays.
#[test]
fn dropping_pinned_memory_during_a_capture_keeps_the_capture() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let origin = stream(&gpu);
    let device = DeviceAllocation::new(&gpu.context, 64).expect("device");
    let pinned =
        HostAllocation::new(&gpu.context, 1 << 16, HostAllocFlags::default()).expect("pinned");

    origin
        .begin_capture(CaptureMode::ThreadLocal)
        .expect("capture");
    // SAFETY: a live 64-byte allocation that outlives every replay below.
    let memset = unsafe { cuweave_driver::memory::memset_d8_async(device.ptr(), 7, 64, &origin) };
    drop(pinned);
    let nodes = finish_and_replay(&origin, "cuMemFreeHost during the capture");
    memset.expect("memset captured");
    assert_eq!(nodes, 1);
}

/// Sequence: page-lock a `Vec` with `HostRegistration::new` during a thread-local capture on
/// the capturing thread, and drop the registration (unregister) before the capture ends.
///
/// Neither `HostRegistration::new` (src/memory/host.rs) nor its drop (`Drop for HostRegistration`,
/// src/memory/host.rs) checks for a capture or enters relaxed mode, unlike `HostAllocation::new`;
/// the driver treats pinning calls as unsafe during a capture. Expected: each call is `Ok` or a
/// typed capture refusal, and the capture survives.
#[test]
fn registering_host_memory_during_a_capture_is_refused_or_keeps_the_capture() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let origin = stream(&gpu);
    let kernels = warmed_kernels(&gpu, &origin);
    let mut memory = vec![0u8; 1 << 16];

    origin
        .begin_capture(CaptureMode::ThreadLocal)
        .expect("capture");
    let spun = kernels.spin_ns(&origin, 1_000);
    let registered = HostRegistration::new(&gpu.context, &mut memory);
    let outcome = registered.as_ref().map(|_| ()).map_err(Clone::clone);
    drop(registered);
    let ended = origin.end_capture();
    spun.expect("spin captured");
    ok_or_capture_refusal(&outcome, "HostRegistration::new during a capture");
    let graph = ended.unwrap_or_else(|error| {
        panic!("registering/unregistering host memory broke the capture: {error:?}")
    });
    assert_eq!(graph.node_count().expect("nodes"), 1);
}

/// Sequence: `DeviceAllocation::new` (and `ManagedAllocation::new` where supported) on the
/// capturing thread of a thread-local capture.
///
/// `DeviceAllocation::zeroed` refuses with `GraphError::Capturing` before anything is
/// allocated (src/memory/device_alloc.rs), but `DeviceAllocation::new` (src/memory/device_alloc.rs)
/// and `ManagedAllocation::new` (src/memory/managed.rs) call `cuMemAlloc` / `cuMemAllocManaged`
/// straight away, which the driver refuses during the capture and which invalidates it
/// (`two_captures_broken_on_two_threads_each_name_their_own_breaking_call`,
/// tests/driver_user_programs.rs, observes exactly this for `cuMemAlloc_v2` on an H200 and asserts
/// it as the expected outcome). The architecture says such calls must be typed errors, not broken
/// captures. Expected: `Ok` or a typed capture refusal, and the capture survives.
#[test]
fn synchronous_allocations_during_a_capture_are_refused_before_they_break_it() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let managed = gpu.device.supports_managed_memory().unwrap_or(false);
    let origin = stream(&gpu);
    let kernels = warmed_kernels(&gpu, &origin);
    origin
        .begin_capture(CaptureMode::ThreadLocal)
        .expect("capture");
    kernels.spin_ns(&origin, 1_000).expect("spin");
    let allocated = DeviceAllocation::new(&gpu.context, 1 << 20);
    let outcome = allocated.as_ref().map(|_| ()).map_err(Clone::clone);
    let ended = origin.end_capture();
    drop(allocated);
    ok_or_capture_refusal(&outcome, "DeviceAllocation::new during a capture");
    ended.unwrap_or_else(|error| panic!("DeviceAllocation::new broke the capture: {error:?}"));

    if managed {
        origin
            .begin_capture(CaptureMode::ThreadLocal)
            .expect("capture");
        kernels.spin_ns(&origin, 1_000).expect("spin");
        let allocated = ManagedAllocation::new(&gpu.context, 1 << 20);
        let outcome = allocated.as_ref().map(|_| ()).map_err(Clone::clone);
        let ended = origin.end_capture();
        drop(allocated);
        ok_or_capture_refusal(&outcome, "ManagedAllocation::new during a capture");
        ended.unwrap_or_else(|error| panic!("ManagedAllocation::new broke the capture: {error:?}"));
    }
}

/// Sequence: a `DeviceAllocation` made before a thread-local capture is dropped (an implicit,
/// safe call) on the capturing thread while it captures.
///
/// `Drop for DeviceAllocation` (src/memory/device_alloc.rs) calls `cuMemFree`, which synchronises
/// and which the driver refuses during the capture, invalidating it
/// (`two_captures_broken_on_two_threads_each_name_their_own_breaking_call`,
/// tests/driver_user_programs.rs, breaks a capture the same way through `free`). A drop cannot
/// return a typed error, so it must not make the call then (defer, or free in relaxed mode).
/// Expected: the capture survives and replays.
#[test]
fn dropping_device_memory_during_a_capture_keeps_the_capture() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let origin = stream(&gpu);
    let kept = DeviceAllocation::new(&gpu.context, 64).expect("kept");
    let victim = DeviceAllocation::new(&gpu.context, 1 << 20).expect("victim");

    origin
        .begin_capture(CaptureMode::ThreadLocal)
        .expect("capture");
    // SAFETY: a live 64-byte allocation that outlives every replay below.
    let memset = unsafe { cuweave_driver::memory::memset_d8_async(kept.ptr(), 3, 64, &origin) };
    drop(victim);
    let nodes = finish_and_replay(&origin, "dropping a DeviceAllocation during the capture");
    memset.expect("memset captured");
    assert_eq!(nodes, 1);
}

/// Sequence: during a thread-local capture, the capturing stream waits on eager work: once
/// with `Stream::wait_stream(&eager)` (which records a pooled event on the eager stream) and
/// once with `Stream::wait_event` on an event recorded on the eager stream before.
///
/// Neither `Stream::wait_stream` nor `Stream::wait_event` (src/stream.rs) checks capture; the
/// driver refuses a capturing stream's wait on an event recorded outside the capture (the crate
/// says so itself: "instead of waiting on an event recorded outside the capture (which the driver
/// refuses)", `Stream::begin_capture_synchronized`, src/graph/capture/begin_end.rs) and invalidates
/// the capture. Expected: `Ok` or a typed capture refusal, and the capture survives.
#[test]
fn a_capturing_stream_waiting_on_eager_work_gets_a_typed_answer_and_keeps_the_capture() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let (origin, eager) = (stream(&gpu), stream(&gpu));
    let kernels = warmed_kernels(&gpu, &origin);

    for round in ["wait_stream", "wait_event"] {
        let event = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).expect("event");
        kernels.spin_ns(&eager, MS).expect("eager spin");
        event.record(&eager).expect("record");
        origin
            .begin_capture(CaptureMode::ThreadLocal)
            .expect("capture");
        kernels.spin_ns(&origin, 1_000).expect("spin");
        let waited = match round {
            "wait_stream" => origin.wait_stream(&eager),
            _ => origin.wait_event(&event),
        };
        let eager_capturing = eager.is_capturing();
        let ended = origin.end_capture();
        eager.synchronize().expect("eager usable");
        ok_or_capture_refusal(&waited, round);
        assert!(
            matches!(eager_capturing, Ok(false)),
            "{round}: the eager stream joined the capture: {eager_capturing:?}"
        );
        let graph =
            ended.unwrap_or_else(|error| panic!("{round}: the wait broke the capture: {error:?}"));
        let exec = graph
            .instantiate(&InstantiateOptions::default())
            .expect("instantiate");
        exec.launch(&origin).expect("replay");
        origin.synchronize().expect("sync");
    }
}

/// Sequence: on the capturing thread of a thread-local capture, load a module
/// (`Module::from_ptx`), and, in a second capture, drop the last handle of a module loaded
/// before (an implicit `cuModuleUnload`).
///
/// `Module::load` (src/module.rs) and `Drop for Module` (src/module.rs) make their
/// driver calls whatever captures; module unload synchronises the context, which the driver
/// refuses during a capture. Expected: `Ok` or a typed capture refusal for the load, and both
/// captures survive.
#[test]
fn loading_or_unloading_a_module_during_a_capture_keeps_the_capture() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let origin = stream(&gpu);
    let kernels = warmed_kernels(&gpu, &origin);

    origin
        .begin_capture(CaptureMode::ThreadLocal)
        .expect("capture");
    kernels.spin_ns(&origin, 1_000).expect("spin");
    let loaded = Module::from_ptx(&gpu.context, PTX);
    let outcome = loaded.as_ref().map(|_| ()).map_err(Clone::clone);
    let ended = origin.end_capture();
    drop(loaded);
    ok_or_capture_refusal(&outcome, "Module::from_ptx during a capture");
    ended.unwrap_or_else(|error| panic!("loading a module broke the capture: {error:?}"));

    let module = Module::from_ptx(&gpu.context, PTX).expect("module");
    origin
        .begin_capture(CaptureMode::ThreadLocal)
        .expect("capture");
    kernels.spin_ns(&origin, 1_000).expect("spin");
    drop(module);
    finish_and_replay(&origin, "unloading a module during the capture");
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

/// Sequence: `Module::from_ptx` with empty and whitespace-only text, and `from_cubin` with an
/// empty slice.
///
/// `Module::from_ptx` (src/module.rs) passes any NUL-free text to `cuModuleLoadDataEx` with no
/// check of its own; what the driver does with an empty image is not documented. Expected: a
/// typed error (never an `Ok` module with no code in it, nor a panic).
#[test]
fn empty_module_images_are_typed_errors() {
    let gpu = cuweave_test_support::require_gpu!();
    for text in ["", " \n\t\n"] {
        match Module::from_ptx(&gpu.context, text) {
            Err(DriverError::ModuleLoad { .. } | DriverError::InvalidArgument { .. }) => {}
            other => panic!("PTX {text:?}: expected a typed load error, got {other:?}"),
        }
    }
    assert!(matches!(
        Module::from_cubin(&gpu.context, &[]),
        Err(DriverError::InvalidArgument { .. })
    ));
    // The context is usable afterwards.
    TestKernels::load(&gpu.context).expect("kernels load after the refusals");
}

/// Sequence: allocations far past what the device or the host has, and sizes that overflow.
///
/// `DeviceAllocation::new` documents `CUDA_ERROR_OUT_OF_MEMORY` (`is_out_of_memory`) for a full
/// device; `MappedWords::new` a typed `InvalidArgument` for a size that overflows; pinned and
/// zeroed allocations must fail with an error, not a panic or an abort. Expected: each is the
/// typed error its documentation names, and the context is usable afterwards.
#[test]
fn oversized_allocations_are_typed_errors() {
    let gpu = cuweave_test_support::require_gpu!();
    let total = gpu.device.total_memory().expect("total memory");

    let too_big = DeviceAllocation::new(&gpu.context, total.saturating_mul(4));
    assert!(
        matches!(&too_big, Err(error) if error.is_out_of_memory()),
        "4x the device's memory: {too_big:?}"
    );
    let absurd = DeviceAllocation::new(&gpu.context, usize::MAX);
    assert!(absurd.is_err(), "usize::MAX bytes: {absurd:?}");
    let zeroed = DeviceAllocation::zeroed(&gpu.context, total.saturating_mul(4));
    assert!(
        matches!(&zeroed, Err(error) if error.is_out_of_memory()),
        "zeroed, 4x the device's memory: {zeroed:?}"
    );
    assert!(matches!(
        MappedWords::new(&gpu.context, usize::MAX),
        Err(DriverError::InvalidArgument { .. })
    ));
    assert!(matches!(
        MappedWords::new(&gpu.context, usize::MAX / 8 + 1),
        Err(DriverError::InvalidArgument { .. })
    ));
    let pinned = HostAllocation::new(&gpu.context, 1 << 60, HostAllocFlags::default());
    assert!(pinned.is_err(), "2^60 pinned bytes: {pinned:?}");

    let fine = DeviceAllocation::zeroed(&gpu.context, 4096).expect("the context still works");
    drop(fine);
}

// ---------------------------------------------------------------------------------------------
// Registries: bounded while a capture is open
// ---------------------------------------------------------------------------------------------

/// Sequence: while this thread holds a thread-local capture (a long capture being built),
/// eager work on another stream leaves eager-use fences (`fence_eager_use`, safe) for 1 000
/// distinct captures, each with an event that has already completed.
///
/// `keep_fence` (src/graph/fences.rs) prunes, past `PRUNE_FENCES_AT`, only fences whose
/// `Event::query` answers `Ok(true)`; during the capture `Event::query` is refused on this thread
/// (`refuse_while_capturing` in `Event::query`, src/event.rs), so nothing is ever pruned and every
/// push re-queries every fence (quadratic). Expected: the registry stays near its bound (the events
/// are finished), whatever captures.
#[test]
fn eager_use_fences_stay_bounded_while_a_capture_is_open_on_the_thread() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    const ROUNDS: u64 = 1_000;
    // Capture ids no real capture of this process reaches.
    const BASE: u64 = 1 << 60;
    let (origin, eager) = (stream(&gpu), stream(&gpu));
    let pool = EventPool::for_context(&gpu.context).expect("pool");
    let baseline = eager_use_fences();

    origin
        .begin_capture(CaptureMode::ThreadLocal)
        .expect("capture");
    let mut most = 0;
    for round in 0..ROUNDS {
        // Never recorded: complete from the start.
        let event = pool.acquire_owned(false).expect("event");
        fence_eager_use(&eager, LaunchesAfter::Captures(&[BASE + round]), event);
        most = most.max(eager_use_fences());
    }
    let ended = origin.end_capture();
    // Prune what the capture kept, so later tests see a small registry.
    let event = pool.acquire_owned(false).expect("event");
    fence_eager_use(&eager, LaunchesAfter::Captures(&[BASE + ROUNDS]), event);
    ended.expect("the capture ends");
    let bound = baseline.max(PRUNE_FENCES_AT) + 2;
    assert!(
        most <= bound,
        "{most} eager-use fences of finished events were held while a capture was open (bound {bound})"
    );
}

/// Sequence: 100 000 `Stream::wait_stream` joins between two streams, each taking an event from
/// the context's shared pool, recording it and handing it back, with a pool handle held so the
/// pool persists.
///
/// `Stream::wait_stream` (src/stream.rs) returns the event at once while the wait on it is still
/// queued; the pool must then reuse it rather than grow. Expected: the pool's `created_regular`
/// counter stays at a handful and nothing is left in use.
#[test]
fn the_shared_event_pool_stays_bounded_over_100k_stream_joins() {
    let gpu = cuweave_test_support::require_gpu!();
    // Other tests of this binary take events from the same shared pool.
    let _serial = serial();
    let (a, b) = (stream(&gpu), stream(&gpu));
    let pool = EventPool::for_context(&gpu.context).expect("pool");
    let before = pool.counters();
    for round in 0..100_000u32 {
        a.wait_stream(&b).expect("a joins b");
        b.wait_stream(&a).expect("b joins a");
        if round % 10_000 == 0 {
            a.synchronize().expect("a");
        }
    }
    a.synchronize().expect("a");
    b.synchronize().expect("b");
    let after = pool.counters();
    let grown = after.created_regular - before.created_regular;
    assert!(
        grown <= 64,
        "the pool created {grown} events for 200 000 one-at-a-time joins"
    );
}
