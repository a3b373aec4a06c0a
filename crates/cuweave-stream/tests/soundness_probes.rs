//! Adversarial soundness probes of the stream layer's safe API: call sequences with no `unsafe`
//! that try to make the host touch memory queued work still uses, free or reuse memory under
//! queued work or a capture, get wrong bytes, a panic or an untyped/`Ok` answer on bad input,
//! or grow a registry without bound.
//!
//! Every test starts with `require_gpu!()` (it skips without a GPU); those that capture graphs
//! or rely on a spinning kernel's timing take `serial()`. A test named for the behaviour it
//! expects; a regression test says above it which sequence broke and where.

use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use cuweave_driver::{InstantiateOptions, Stream};
use cuweave_memory::{Buffer, DeviceBuffer, MemoryError, PinnedBuffer};
use cuweave_stream::capture::{CaptureOptions, StreamCapture};
use cuweave_stream::{
    AllocationStrategy, MultiStreamCoordinator, OperationKind, PriorityStream, StreamError,
    StreamOrderedAllocator, StreamPool, StreamPoolConfig, StreamPriority, StreamProfiler,
    WorkloadType, wait_for_any_ready,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{serial, skip_under_sanitizer};

const MS: u64 = 1_000_000;

fn stream(gpu: &cuweave_test_support::Gpu) -> Arc<PriorityStream> {
    Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).expect("stream"))
}

fn spin(kernels: &TestKernels, stream: &PriorityStream, ns: u64) {
    stream
        .launch(|s| kernels.spin_ns(s, ns))
        .expect("spin kernel");
}

fn pattern(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

/// Whether the device has stream-ordered memory pools (printing a skip when not).
fn has_pools(gpu: &cuweave_test_support::Gpu, test: &str) -> bool {
    let pools = gpu.device.supports_memory_pools().unwrap_or(false);
    if !pools {
        cuweave_test_support::skip(test, "the device has no stream-ordered memory pools");
    }
    pools
}

/// Asserts `result` is either `Ok` or a typed capture refusal (nothing queued).
fn ok_or_capture_refusal<T: std::fmt::Debug>(result: &Result<T, StreamError>, what: &str) {
    if let Err(error) = result {
        assert!(
            error.is_capture_refusal(),
            "{what}: expected Ok or a typed capture refusal, got {error:?}"
        );
    }
}

/// Ends `capture`, checks the graph instantiates and replays on `origin`, and that `origin` is
/// usable afterwards.
fn finish_and_replay(capture: StreamCapture<'_>, origin: &PriorityStream, what: &str) {
    let graph = capture
        .finish()
        .unwrap_or_else(|error| panic!("{what}: the capture broke: {error}"));
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .unwrap_or_else(|error| panic!("{what}: instantiate: {error}"));
    origin
        .launch_graph(&exec)
        .unwrap_or_else(|error| panic!("{what}: replay: {error}"));
    origin
        .synchronize()
        .unwrap_or_else(|error| panic!("{what}: sync after replay: {error}"));
}

// ---------------------------------------------------------------------------------------------
// StreamOrderedAllocator: frees while a stream the memory was given to captures
// ---------------------------------------------------------------------------------------------

/// A regression test (it failed on the H200 before the fix).
///
/// Sequence: `a` owns a raw receipt; `add_stream_dependency(b, a)` gives it to `b`; `b` begins a
/// capture; the program frees the receipt (`free`, then `free_for_stream`) from eager code.
///
/// `StreamOrderedAllocator::release` (src/allocator/free.rs) checks only that the *owner* is not
/// capturing, then `order_after_users` (src/allocator/free.rs) calls `owner.wait_for(user)` for
/// `b`. `PriorityStream::wait_for` (src/stream/mod.rs) allows an eager stream to wait on a
/// capturing one: `a` JOINS `b`'s capture (a fork). The `cuMemFreeAsync` of eager memory is then
/// queued on a capturing stream (the end of `release`): a graph free node for memory the graph
/// never allocated (the driver refuses it, or it runs at every replay), and `a` is left forked into
/// `b`'s capture and never joined, so the capture ends with `CUDA_ERROR_STREAM_CAPTURE_UNJOINED` /
/// invalidated. Expected: the free is either a typed capture refusal before anything is queued (as
/// when the owner itself captures), or an eager free; the owner never joins the capture and the
/// capture still ends and replays.
#[test]
fn freeing_memory_given_to_a_stream_that_now_captures_never_pulls_the_owner_into_the_capture() {
    let name =
        "freeing_memory_given_to_a_stream_that_now_captures_never_pulls_the_owner_into_the_capture";
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let (a, b) = (stream(&gpu), stream(&gpu));
    let allocator = StreamOrderedAllocator::default();

    for round in ["free", "free_for_stream"] {
        let block = allocator.allocate_for_stream(&a, 1 << 20).expect("block");
        allocator
            .add_stream_dependency(&b, &a)
            .expect("b may use it");
        spin(&kernels, &b, 10_000);
        let capture = b.begin_capture(CaptureOptions::default()).expect("capture");
        spin(&kernels, &b, 1_000);
        let freed = match round {
            "free" => allocator.free(block),
            _ => allocator.free_for_stream(&a).map(|_| ()),
        };
        let owner_capturing = a.stream().is_capturing();
        assert!(
            matches!(owner_capturing, Ok(false)),
            "{round}: the owner joined b's capture through the free's wait on b: \
             {owner_capturing:?} (free returned {freed:?})"
        );
        finish_and_replay(capture, &b, round);
        ok_or_capture_refusal(&freed, round);
        if freed.is_err() {
            allocator
                .free(block)
                .expect("the free goes through once the capture ended");
        }
        assert_eq!(allocator.outstanding(), 0, "{round}: nothing stays held");
        a.synchronize().expect("owner usable");
        b.synchronize().expect("user usable");
    }
}

/// A regression test (it failed on the H200 before the fix), same root cause as the test above,
/// through `Drop`.
///
/// `Drop for StreamOrderedAllocator` (src/allocator/free.rs) calls `release` on every held
/// entry; `order_after_users` makes the owner `a` wait on the user `b`, which captures, so `a`
/// joins `b`'s capture and the eager free is recorded into it. Dropping an allocator (a safe,
/// implicit call) thus breaks an unrelated capture. Expected: the capture ends and replays, and
/// the owner is not left capturing.
#[test]
fn dropping_the_allocator_while_a_user_stream_captures_leaves_that_capture_intact() {
    let name = "dropping_the_allocator_while_a_user_stream_captures_leaves_that_capture_intact";
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let (a, b) = (stream(&gpu), stream(&gpu));
    let allocator = StreamOrderedAllocator::default();
    let _block = allocator.allocate_for_stream(&a, 4096).expect("block");
    allocator
        .add_stream_dependency(&b, &a)
        .expect("b may use it");
    let capture = b.begin_capture(CaptureOptions::default()).expect("capture");
    spin(&kernels, &b, 1_000);
    drop(allocator);
    let owner_capturing = a.stream().is_capturing();
    assert!(
        matches!(owner_capturing, Ok(false)),
        "dropping the allocator made the owner join b's capture: {owner_capturing:?}"
    );
    finish_and_replay(capture, &b, "after dropping the allocator");
    a.synchronize().expect("owner usable");
}

// ---------------------------------------------------------------------------------------------
// The legacy default stream and captures
// ---------------------------------------------------------------------------------------------

/// A regression test (it failed on the H200 before the fix).
///
/// The legacy default stream can never be captured (`StreamCapture::begin` refuses it with
/// `GraphError::LegacyDefaultStream`), yet every way of making a stream wait on a capturing
/// one lets it try to *join* a capture: `StreamCapture::fork` (src/capture/mod.rs),
/// `PriorityStream::wait_for` (src/stream/mod.rs), `MultiStreamCoordinator::add_dependency` and
/// `StreamOrderedAllocator::add_stream_dependency` all call `refuse_wait_across_capture`
/// (src/capture/mod.rs), which only refuses a *capturing* dependent; the legacy stream is not
/// capturing, so `cuStreamWaitEvent(NULL, captured event)` reaches the driver, which refuses it
/// with an untyped error and (as for any wait across a capture's isolation) invalidates the
/// capture. Expected: a typed refusal before anything is queued, and the capture still ends and
/// replays.
#[test]
fn the_legacy_default_stream_cannot_join_a_capture_and_the_capture_survives_the_attempt() {
    let name =
        "the_legacy_default_stream_cannot_join_a_capture_and_the_capture_survives_the_attempt";
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let origin = stream(&gpu);
    let legacy = Arc::new(
        PriorityStream::from_stream(Stream::legacy_default(&gpu.context)).expect("legacy"),
    );
    let allocator = StreamOrderedAllocator::default();
    let pools = gpu.device.supports_memory_pools().unwrap_or(false);
    let coordinator = MultiStreamCoordinator::new();

    type Attempt<'a> = Box<dyn FnOnce(&mut StreamCapture<'_>) -> Result<(), StreamError> + 'a>;
    let mut attempts: Vec<(&str, Attempt<'_>)> = vec![
        (
            "StreamCapture::fork(legacy)",
            Box::new(|capture| capture.fork(legacy.stream())),
        ),
        (
            "legacy.wait_for(capturing)",
            Box::new(|_| legacy.wait_for(&origin)),
        ),
        (
            "MultiStreamCoordinator::add_dependency(legacy, capturing)",
            Box::new(|_| coordinator.add_dependency(&legacy, &origin)),
        ),
    ];
    if pools {
        attempts.push((
            "StreamOrderedAllocator::add_stream_dependency(legacy, capturing)",
            Box::new(|_| allocator.add_stream_dependency(&legacy, &origin)),
        ));
    } else {
        cuweave_test_support::skip(name, "no memory pools: the allocator's case is left out");
    }
    for (what, attempt) in attempts {
        let mut capture = origin
            .begin_capture(CaptureOptions::default())
            .expect("capture");
        spin(&kernels, &origin, 1_000);
        let result = attempt(&mut capture);
        let error = result.expect_err(what);
        assert!(
            error.graph_error().is_some(),
            "{what}: a typed graph refusal expected, got {error:?}"
        );
        finish_and_replay(capture, &origin, what);
        legacy.synchronize().expect("legacy stream usable");
    }
}

// ---------------------------------------------------------------------------------------------
// MultiStreamCoordinator: refused calls and dropped streams
// ---------------------------------------------------------------------------------------------

/// A regression test (it failed on the H200 before the fix).
///
/// `MultiStreamCoordinator::add_dependency` (src/coordinator/mod.rs) adds both streams to
/// the coordinator *before* `dependent.wait_for(prerequisite)?` can refuse. A refused call
/// (a capturing stream told to wait on an eager one) therefore leaves the capturing stream
/// coordinated: every later `create_barrier` and `on_all_complete` is refused while that capture
/// runs, though the program never added it. Expected: a refused call changes nothing.
#[test]
fn a_refused_dependency_leaves_the_coordinator_as_it_was() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let (capturing, eager, other) = (stream(&gpu), stream(&gpu), stream(&gpu));
    let coordinator = MultiStreamCoordinator::with_streams([Arc::clone(&eager), other]);
    let capture = capturing
        .begin_capture(CaptureOptions::default())
        .expect("capture");
    spin(&kernels, &capturing, 1_000);
    let refused = coordinator.add_dependency(&capturing, &eager);
    let error = refused.expect_err("a capturing stream may not wait on eager work");
    assert!(error.is_capture_refusal(), "typed: {error:?}");
    let coordinated = coordinator.streams().len();
    let barrier = coordinator.create_barrier();
    finish_and_replay(capture, &capturing, "after the refused dependency");
    assert_eq!(
        coordinated, 2,
        "the refused call added streams to the coordinator"
    );
    barrier.expect("a barrier over the two eager streams works during the capture");
}

/// A regression test (unbounded registry; it failed on the H200 before the fix).
///
/// `add_dependency` adds both streams, as `Arc`s, to the coordinator's list
/// (through `MultiStreamCoordinator::add_stream`, src/coordinator/mod.rs) and nothing ever retires
/// them: a loop that orders short-lived streams keeps every one alive (its CUDA stream, its event
/// pool handle, and, once `on_all_complete` has run on it, its callback thread), and every later
/// barrier waits on all of them (`2 (n - 1)` waits). Expected: streams the program has dropped are
/// not kept, so the list stays bounded.
#[test]
fn a_coordinator_does_not_keep_alive_the_short_lived_streams_it_ordered() {
    let gpu = cuweave_test_support::require_gpu!();
    let coordinator = MultiStreamCoordinator::new();
    let mut released = Vec::new();
    for _ in 0..500 {
        let (a, b) = (stream(&gpu), stream(&gpu));
        coordinator.add_dependency(&b, &a).expect("dependency");
        a.synchronize().expect("sync");
        b.synchronize().expect("sync");
        released.push(Arc::downgrade(&a));
        released.push(Arc::downgrade(&b));
    }
    let alive = released
        .iter()
        .filter(|weak| weak.upgrade().is_some())
        .count();
    let coordinated = coordinator.streams().len();
    assert!(
        alive <= 64 && coordinated <= 64,
        "after 500 rounds on short-lived streams the coordinator keeps {coordinated} streams \
         and {alive} of the 1000 dropped streams are still alive"
    );
}

// ---------------------------------------------------------------------------------------------
// Callbacks: the failure list
// ---------------------------------------------------------------------------------------------

const PROBE_PANIC: &str = "soundness probe: a callback panics on purpose";

/// Keeps the default panic message for every panic but the probe's own (10^4 of them would
/// flood the output); other tests' panics still print.
fn quiet_probe_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let probe = info
                .payload()
                .downcast_ref::<&str>()
                .is_some_and(|message| *message == PROBE_PANIC);
            if !probe {
                previous(info);
            }
        }));
    });
}

/// A regression test (unbounded registry; it failed on the H200 before the fix).
///
/// Every panicking host callback pushes a `CallbackFailure` (with its message `String`) onto
/// `Shared::failures`, a `Vec` that is never trimmed (pushed by `run`, src/stream/callback.rs);
/// `callback_failures()` clones it whole. A long-running stream whose callback panics now and then
/// (a closed channel, say) grows it forever, against the rule that every registry has a bound.
/// Expected: the panic count stays exact (`metrics().callback_panics`), the kept list is bounded (a
/// window of the newest, as the profiler keeps).
#[test]
fn ten_thousand_panicking_callbacks_are_counted_exactly_and_keep_a_bounded_failure_list() {
    let gpu = cuweave_test_support::require_gpu!();
    quiet_probe_panics();
    let a = stream(&gpu);
    const N: u64 = 10_000;
    for _ in 0..N {
        a.add_callback(|| std::panic::panic_any(PROBE_PANIC))
            .expect("callback queued");
    }
    a.synchronize().expect("sync");
    let deadline = Instant::now() + Duration::from_secs(20);
    while a.metrics().expect("metrics").callback_panics < N && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let metrics = a.metrics().expect("metrics");
    assert_eq!(metrics.callback_panics, N, "every panic counted");
    assert_eq!(metrics.callbacks, N);
    let kept = a.callback_failures().len();
    assert!(
        kept <= 4096,
        "{kept} callback failures kept for {N} panics: the list grows without bound"
    );
}

// ---------------------------------------------------------------------------------------------
// Host access and copies through the stream's helpers
// ---------------------------------------------------------------------------------------------

/// (a) A `PendingCopy` is an ordinary value: `mem::forget` ends its borrow of a pinned buffer
/// without waiting. The pinned buffer's own tracking must still hold host views back until the
/// copies queued through `PriorityStream::copy_to_host` / `copy_from_host` (behind a 300 ms
/// spin) have run: `try_as_slice` is `DeviceBusy`, `as_slice` waits and reads the copied bytes,
/// and a host write through `as_mut_slice` never reaches a device copy still reading it.
#[test]
fn a_forgotten_pending_copy_still_holds_host_views_of_its_pinned_buffer_back() {
    let name = "a_forgotten_pending_copy_still_holds_host_views_of_its_pinned_buffer_back";
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(name, "relies on a spin still running when the host looks") {
        return;
    }
    const N: usize = 1 << 16;
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let a = stream(&gpu);
    let expected = pattern(N, 0x5A5A);
    let src = DeviceBuffer::from_slice(&gpu.context, &expected).expect("src");
    let mut pinned = PinnedBuffer::<u32>::zeroed(&gpu.context, N).expect("pinned");

    // Device to host, the pending copy forgotten.
    spin(&kernels, &a, 300 * MS);
    let pending = a.copy_to_host(&src, &mut pinned).expect("download");
    std::mem::forget(pending);
    match pinned.try_as_slice() {
        Err(MemoryError::DeviceBusy { .. }) => {}
        Ok(slice) => panic!(
            "a host view while the download is queued behind a spin (first element {})",
            slice[0]
        ),
        Err(other) => panic!("expected DeviceBusy, got {other:?}"),
    }
    {
        let slice = pinned.as_slice().expect("waits for the download");
        assert!(
            *slice == *expected,
            "the host read the pinned buffer before the download finished"
        );
    }

    // Host to device, the pending copy forgotten, then the host overwrites the source.
    let mut dst = DeviceBuffer::<u32>::zeroed(&gpu.context, N).expect("dst");
    spin(&kernels, &a, 300 * MS);
    let pending = a.copy_from_host(&mut dst, &pinned).expect("upload");
    std::mem::forget(pending);
    {
        let mut slice = pinned.as_mut_slice().expect("waits for the upload");
        slice.fill(0xDEAD_BEEF);
    }
    a.synchronize().expect("sync");
    assert_eq!(
        dst.to_vec().expect("read back"),
        expected,
        "the host overwrote the pinned source under the queued upload"
    );
    assert!(
        pinned
            .as_slice()
            .expect("idle")
            .iter()
            .all(|&v| v == 0xDEAD_BEEF)
    );
}

/// (b)(c) The stream helpers on four streams, ordered only by the buffers' own tracking, with
/// a stream-ordered buffer dropped under a pending read and its memory asked for again at once:
/// upload on `a` behind a 200 ms spin, `copy_buffer` on `b`, drop the source and allocate from
/// the same pool on `c` (a fill of `0x0BAD` there would land in `y` if the source's memory were
/// reused before `b` read it), `fill` of half of `y` on `c`, download on `d`. Byte for byte.
#[test]
fn stream_helpers_on_four_streams_are_ordered_by_the_buffers_and_reuse_waits_for_the_read() {
    let name =
        "stream_helpers_on_four_streams_are_ordered_by_the_buffers_and_reuse_waits_for_the_read";
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    const N: usize = 1 << 18;
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let [a, b, c, d] = [(); 4].map(|_| stream(&gpu));
    let allocator = StreamOrderedAllocator::default();
    let data = pattern(N, 0x1234);

    let mut x = allocator.buffer::<u32>(&a, N).expect("x");
    spin(&kernels, &a, 200 * MS);
    let upload = a
        .copy_from_host(&mut x, data.clone())
        .unwrap_or_else(|refusal| panic!("upload: {}", refusal.error()));
    let mut y = allocator.buffer::<u32>(&b, N).expect("y");
    b.copy_buffer(&mut y, &x).expect("copy on b");
    drop(x);
    let mut reused = Vec::new();
    for _ in 0..4 {
        let mut z = allocator.buffer::<u32>(&c, N).expect("z");
        c.fill(&mut z, 0x0BAD).expect("fill z");
        reused.push(z);
    }
    {
        let mut upper = y.slice_mut(N / 2..).expect("upper half");
        c.fill(&mut upper, 0xFFFF_0000).expect("fill on c");
    }
    let downloaded = d
        .copy_to_host(&y, vec![0u32; N])
        .unwrap_or_else(|refusal| panic!("download: {}", refusal.error()))
        .wait()
        .expect("downloaded");
    upload.wait().expect("uploaded");
    let expected: Vec<u32> = data[..N / 2]
        .iter()
        .copied()
        .chain(std::iter::repeat_n(0xFFFF_0000, N / 2))
        .collect();
    if let Some(i) = (0..N).find(|&i| downloaded[i] != expected[i]) {
        panic!(
            "element {i} is {:#x}, expected {:#x} (0xbad: the source's memory was reused before \
             b read it; the pattern in the upper half: c's fill ran before b's copy)",
            downloaded[i], expected[i]
        );
    }
    for z in &reused {
        assert!(z.to_vec().expect("z").iter().all(|&v| v == 0x0BAD));
    }
}

/// (b) A `PriorityStream` dropped right after queuing work (behind a 200 ms spin) and a
/// callback: the work still lands in the buffer it wrote, the buffer's next reader on another
/// stream sees it, and the callback runs once.
#[test]
fn a_stream_dropped_with_queued_work_leaves_its_writes_ordered_and_its_callback_run() {
    let name = "a_stream_dropped_with_queued_work_leaves_its_writes_ordered_and_its_callback_run";
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    const N: usize = 1 << 16;
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let allocator = StreamOrderedAllocator::default();
    let reader = stream(&gpu);
    let (sender, receiver) = std::sync::mpsc::channel();
    let mut buffer = {
        let doomed = stream(&gpu);
        let mut buffer = allocator.buffer::<u32>(&doomed, N).expect("buffer");
        spin(&kernels, &doomed, 200 * MS);
        doomed.fill(&mut buffer, 0x7777_7777).expect("fill");
        doomed
            .add_callback(move || sender.send(()).expect("send"))
            .expect("callback");
        buffer
    };
    let out = reader
        .copy_to_host(&buffer, vec![0u32; N])
        .unwrap_or_else(|refusal| panic!("download: {}", refusal.error()))
        .wait()
        .expect("downloaded");
    assert!(
        out.iter().all(|&v| v == 0x7777_7777),
        "the reader saw the buffer before the dropped stream's fill"
    );
    receiver
        .recv_timeout(Duration::from_secs(10))
        .expect("the dropped stream's callback ran");
    assert!(receiver.recv_timeout(Duration::from_millis(50)).is_err());
    reader.fill(&mut buffer, 1).expect("usable after");
    assert!(buffer.to_vec().expect("read").iter().all(|&v| v == 1));
}

// ---------------------------------------------------------------------------------------------
// Typed buffers and captures
// ---------------------------------------------------------------------------------------------

/// (b)(d) A typed buffer of the stream-ordered pool made on a capturing stream (the origin, or a
/// stream that joined the capture through `wait_for`) is a graph allocation that exists only
/// while the graph runs: it serves as the capture's scratch, and any use outside the capture is
/// a typed `GraphAllocation` refusal (the review's probe expected a refusal at allocation, which
/// PyTorch's `cudaMallocAsync` scratch inside `torch.cuda.graph` rules out). A buffer made
/// before the capture, used in it and dropped during it, must keep its memory for the graph
/// (replays read the bytes written eagerly).
#[test]
fn typed_pool_buffers_on_capturing_streams_serve_only_their_capture_and_the_capture_survives() {
    let name = "typed_pool_buffers_on_capturing_streams_serve_only_their_capture";
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    const N: usize = 4096;
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let (origin, side) = (stream(&gpu), stream(&gpu));
    let allocator = StreamOrderedAllocator::default();
    let input = allocator.buffer::<u32>(&origin, N).expect("input");
    let mut input = input;
    origin.fill(&mut input, 41).expect("eager fill");
    let mut output = DeviceBuffer::<u32>::zeroed(&gpu.context, N).expect("output");

    let mut capture = origin
        .begin_capture(CaptureOptions::default())
        .expect("capture");
    spin(&kernels, &origin, 1_000);
    let mut on_origin = allocator
        .buffer::<u32>(&origin, N)
        .expect("graph scratch on the capturing stream");
    origin
        .fill(&mut on_origin, 5)
        .expect("the scratch is used inside its capture");
    side.wait_for(&origin).expect("side joins the capture");
    let mut on_side = allocator
        .buffer::<u32>(&side, N)
        .expect("graph scratch on a stream forked into the capture");
    side.copy_buffer(&mut on_side, &on_origin)
        .expect("scratch to scratch inside the capture");
    drop(on_origin);
    side.copy_buffer(&mut output, &input)
        .expect("captured copy on the side stream");
    capture.join(side.stream()).expect("join");
    drop(input);
    let graph = capture.finish().expect("the capture survives its scratch");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");
    // Outside its capture the scratch is refused, before anything is queued.
    let refused = side.fill(&mut on_side, 1).unwrap_err();
    assert!(
        matches!(
            refused,
            StreamError::Memory(MemoryError::GraphAllocation { .. })
        ),
        "an eager fill of graph-allocated scratch: {refused:?}"
    );
    drop(on_side);

    // Eager churn on the same pool: if the dropped input's memory went back to it, these
    // buffers would take it and the replays would copy 0x0BAD.
    let mut churn = Vec::new();
    for _ in 0..8 {
        let mut z = allocator.buffer::<u32>(&side, N).expect("churn");
        side.fill(&mut z, 0x0BAD).expect("churn fill");
        churn.push(z);
    }
    for _ in 0..3 {
        origin.launch_graph(&exec).expect("replay");
    }
    origin.synchronize().expect("sync");
    let out = output.to_vec().expect("output");
    assert!(
        out.iter().all(|&v| v == 41),
        "the replays copied {:#x}, not the eagerly written 41: the dropped input's memory was \
         reused while the graph still reads it",
        out.iter().copied().find(|&v| v != 41).unwrap_or_default()
    );
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

/// (d) Bad and edge-case input across the pool, the coordinator, the profiler and the copy
/// helpers: typed errors or documented answers, never a panic, and everything usable after.
#[test]
fn bad_input_to_pools_coordinators_profilers_and_copies_is_typed_and_never_panics() {
    let gpu = cuweave_test_support::require_gpu!();
    let kernels = TestKernels::load(&gpu.context).expect("kernels");

    // A pool of one low-priority stream: every strategy and workload either hands out that
    // stream or answers with a typed error, never a division by zero.
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::default().with_counts(0, 0, 1),
    )
    .expect("a one-stream pool");
    for strategy in [
        AllocationStrategy::RoundRobin,
        AllocationStrategy::LoadBalanced,
        AllocationStrategy::Priority,
        AllocationStrategy::Workload,
    ] {
        pool.set_strategy(strategy);
        match pool.get_stream() {
            Ok(stream) => assert!(pool.contains(&stream)),
            Err(error) => assert!(
                matches!(error, StreamError::NoStreamForWorkload { .. }),
                "{strategy:?}: {error:?}"
            ),
        }
    }
    for workload in [
        WorkloadType::Compute,
        WorkloadType::Mixed,
        WorkloadType::Memory,
        WorkloadType::Coordination,
    ] {
        match pool.get_stream_for_workload(workload) {
            Ok(stream) => assert!(pool.contains(&stream)),
            Err(error) => assert!(
                matches!(error, StreamError::NoStreamForWorkload { .. }),
                "{workload:?}: {error:?}"
            ),
        }
        pool.record_workload_completion(workload, Duration::MAX);
        pool.record_workload_completion(workload, Duration::ZERO);
    }
    let change = pool.optimize_configuration();
    assert_eq!(change.after.normal, 0);
    assert!(
        StreamPool::new(
            &gpu.context,
            StreamPoolConfig::default().with_counts(0, 0, 0)
        )
        .is_err()
    );
    assert!(
        wait_for_any_ready(&[], Duration::ZERO)
            .expect("none")
            .is_none()
    );

    // The coordinator: self-dependency, empty barrier, callbacks with no streams.
    let a = stream(&gpu);
    let coordinator = MultiStreamCoordinator::new();
    assert!(matches!(
        coordinator.add_dependency(&a, &a),
        Err(StreamError::SelfDependency { .. })
    ));
    assert!(
        coordinator.streams().is_empty(),
        "a refused self-dependency adds nothing"
    );
    assert_eq!(coordinator.create_barrier().expect("empty").waits, 0);
    let (sender, receiver) = std::sync::mpsc::channel();
    coordinator
        .on_all_complete(move || sender.send(()).expect("send"))
        .expect("no streams: at once");
    receiver.try_recv().expect("ran at once");

    // A profiler that keeps at most one operation (a limit of zero keeps one).
    let profiler = StreamProfiler::with_limit(&gpu.context, 0).expect("profiler");
    for name in ["first", "second"] {
        profiler
            .profile(&a, name, OperationKind::KernelLaunch, 0, |s| {
                Ok(kernels.spin_ns(s, 1_000)?)
            })
            .expect("profiled");
    }
    let operations = profiler.operations().expect("operations");
    assert_eq!(operations.len(), 1);
    assert_eq!(operations[0].name, "second");
    assert_eq!(profiler.evicted(), 1);

    // Copies of the wrong length hand an owned host side back, untouched.
    let mut dst = DeviceBuffer::<u32>::zeroed(&gpu.context, 16).expect("dst");
    let refusal = match a.copy_from_host(&mut dst, vec![7u32; 15]) {
        Ok(pending) => {
            let _ = pending.wait();
            panic!("15 elements copied into 16");
        }
        Err(refusal) => refusal,
    };
    let (error, host) = refusal.into_parts();
    assert!(matches!(error, StreamError::Memory(_)), "typed: {error:?}");
    assert_eq!(host.expect("handed back"), vec![7u32; 15]);
    let src = DeviceBuffer::<u32>::zeroed(&gpu.context, 17).expect("src");
    assert!(a.copy_buffer(&mut dst, &src).is_err(), "mismatched lengths");
    match a.copy_to_host(&src, vec![0u32; 16]) {
        Ok(_) => panic!("17 elements copied into 16"),
        Err(refusal) => {
            let (error, host) = refusal.into_parts();
            assert!(matches!(error, StreamError::Memory(_)), "typed: {error:?}");
            assert_eq!(host.expect("handed back").len(), 16);
        }
    }
    // An empty view: a typed error or a no-op, never a panic.
    match dst.slice_mut(16..) {
        Ok(mut empty) => {
            if let Err(error) = a.fill(&mut empty, 1) {
                assert!(matches!(error, StreamError::Memory(_)), "typed: {error:?}");
            }
        }
        Err(error) => assert!(
            matches!(
                error,
                MemoryError::ZeroLength { .. } | MemoryError::OutOfRange { .. }
            ),
            "typed: {error:?}"
        ),
    }
    a.fill(&mut dst, 3).expect("usable after the refusals");
    a.synchronize().expect("sync");
    assert_eq!(dst.to_vec().expect("read"), vec![3u32; 16]);
    assert_eq!(a.metrics().expect("metrics").callback_panics, 0);
}

/// (e) Raw receipts handed to a fresh stream every round, 10^4 rounds: the allocator releases
/// the streams it was given once their memory is freed, keeps exact books and does not grow
/// its pool's reserve.
#[test]
fn ten_thousand_receipts_given_to_fresh_streams_release_those_streams_and_stay_bounded() {
    let name =
        "ten_thousand_receipts_given_to_fresh_streams_release_those_streams_and_stay_bounded";
    let gpu = cuweave_test_support::require_gpu!();
    if !has_pools(&gpu, name) {
        return;
    }
    let owner = stream(&gpu);
    let allocator = StreamOrderedAllocator::default();
    let mut released = Vec::new();
    let mut reserved_after_warmup = 0;
    const ROUNDS: usize = 10_000;
    for round in 0..ROUNDS {
        let user = stream(&gpu);
        let block = allocator
            .allocate_for_stream(&owner, 64 << 10)
            .expect("block");
        allocator
            .add_stream_dependency(&user, &owner)
            .expect("given to the user");
        allocator.free(block).expect("free");
        if round % 1000 == 0 {
            released.push(Arc::downgrade(&user));
            owner.synchronize().expect("sync");
        }
        if round == 100 {
            reserved_after_warmup = allocator.reserved_bytes(0).expect("reserved");
        }
    }
    owner.synchronize().expect("sync");
    let alive = released.iter().filter(|w| w.upgrade().is_some()).count();
    assert_eq!(
        alive, 0,
        "users kept alive by the allocator after their memory was freed"
    );
    assert_eq!(allocator.outstanding(), 0);
    let stats = allocator.stats();
    assert_eq!(stats.allocations, ROUNDS as u64);
    assert_eq!(stats.live, 0);
    assert!(
        allocator.dependencies_satisfied(&owner).expect("query"),
        "no wait pending"
    );
    let reserved = allocator.reserved_bytes(0).expect("reserved");
    assert!(
        reserved <= reserved_after_warmup.max(2 << 20) * 2,
        "the pool's reserve grew from {reserved_after_warmup} to {reserved} bytes"
    );
}

/// (b)(c) A typed pool buffer made on a busy stream and first used on another: the memory
/// exists only from the point its stream reaches the allocation, and the pool may hand out
/// memory whose free is still queued behind the busy stream. Here `p`'s download is queued
/// behind a 300 ms spin on `x`, `p` is dropped, `q` is allocated on `x` (possibly `p`'s memory)
/// and filled at once on `y`: the download must still read `p`'s bytes.
#[test]
fn a_pool_buffer_first_used_on_another_stream_waits_for_its_allocation_point() {
    let name = "a_pool_buffer_first_used_on_another_stream_waits_for_its_allocation_point";
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) || skip_under_sanitizer(name, "needs y's fill to overlap the spin") {
        return;
    }
    const N: usize = 1 << 18;
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let (x, y) = (stream(&gpu), stream(&gpu));
    let allocator = StreamOrderedAllocator::default();
    for round in 0..4 {
        let mut p = allocator.buffer::<u32>(&x, N).expect("p");
        x.fill(&mut p, 0x1111_1111).expect("fill p");
        spin(&kernels, &x, 300 * MS);
        let download = x
            .copy_to_host(&p, vec![0u32; N])
            .unwrap_or_else(|refusal| panic!("download: {}", refusal.error()));
        drop(p);
        let mut q = allocator.buffer::<u32>(&x, N).expect("q");
        y.fill(&mut q, 0x2222_2222).expect("fill q on y");
        let seen = download.wait().expect("downloaded");
        if let Some(i) = seen.iter().position(|&v| v != 0x1111_1111) {
            panic!(
                "round {round}: element {i} of p read {:#x}: q's fill on y reached p's memory \
                 before x's download of p ran",
                seen[i]
            );
        }
        y.synchronize().expect("sync");
        assert!(q.to_vec().expect("q").iter().all(|&v| v == 0x2222_2222));
    }
}
