//! GPU tests of graph capture on streams with the caching allocator's private pools: replays
//! bit-identical to eager runs, graph memory that eager work never receives (a watch kernel
//! inside the graph, and a control that bypasses the pool and does see corruption), memory
//! returned after the graph is dropped, and a typed error for every bad use, each leaving the
//! stream usable.
//!
//! Every test takes `serial()`: an active capture changes what the whole process may do (a
//! context synchronisation is refused while one runs), so captures must not overlap other
//! tests' work.

use std::sync::Arc;

use cuweave_driver::graph::{CaptureMode, GraphError, GraphNodeType};
use cuweave_driver::memory::{copy_dtod_async, copy_dtoh, copy_htod, memset_d32_async};
use cuweave_driver::{Context, InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::Buffer;
use cuweave_memory::caching::{CachedAllocation, CachingAllocator, GraphPool, MissPolicy};
use cuweave_memory::resource::{DriverResource, MemoryResource};
use cuweave_stream::capture::{CaptureOptions, StreamCapture};
use cuweave_stream::{
    MultiStreamCoordinator, OperationKind, PriorityStream, StreamError, StreamPriority,
    StreamProfiler,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{Gpu, gpu, sanitizer_active, serial, skip_under_sanitizer};

const N: usize = 1 << 18; // elements: 1 MiB of f32 or u32
const BYTES: usize = N * 4;
const MS: u64 = 1_000_000;

fn stream(gpu: &Gpu) -> Arc<Stream> {
    Arc::new(Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap())
}

fn read_u32(context: &Context, ptr: u64, n: usize) -> Vec<u32> {
    let mut host = vec![0u32; n];
    // SAFETY: `ptr` is device memory of at least `n` u32s; the caller synchronised its writers.
    unsafe { copy_dtoh(context, host.as_mut_ptr().cast(), ptr, n * 4) }.unwrap();
    host
}

fn write_u32(context: &Context, ptr: u64, data: &[u32]) {
    // SAFETY: `ptr` is device memory of at least `data.len()` u32s, idle.
    unsafe { copy_htod(context, ptr, data.as_ptr().cast(), data.len() * 4) }.unwrap();
}

/// What most tests start from: the GPU (or a skip), the test lock, the kernels, an allocator.
struct Fixture {
    gpu: Gpu,
    kernels: TestKernels,
    allocator: CachingAllocator,
    _serial: std::sync::MutexGuard<'static, ()>,
}

fn fixture(test: &str) -> Option<Fixture> {
    let gpu = gpu(test)?;
    let serial = serial();
    Some(Fixture {
        kernels: TestKernels::load(&gpu.context).unwrap(),
        allocator: CachingAllocator::with_driver(&gpu.context),
        gpu,
        _serial: serial,
    })
}

/// Asserts that `result` is a [`GraphError::Capturing`] refusal.
fn assert_capturing<T: std::fmt::Debug, E: Into<StreamError>>(result: Result<T, E>) {
    let error: StreamError = result.unwrap_err().into();
    assert!(error.is_capture_refusal(), "{error}");
}

fn graph_error(error: &StreamError) -> &GraphError {
    error
        .graph_error()
        .unwrap_or_else(|| panic!("expected a graph error, got {error}"))
}

/// The step: `out = (2x + x) + (0.5x + 1)` computed with allocations on both streams, a copy,
/// kernels on `main` and on `side`, and a join. Scratch is dropped inside the step.
fn step(
    kernels: &TestKernels,
    allocator: &CachingAllocator,
    main: &Arc<Stream>,
    side: &Arc<Stream>,
    x: u64,
    out: u64,
    fork: &mut dyn FnMut(&Stream, &Stream),
) {
    let a = allocator.allocate(BYTES, main).unwrap();
    // SAFETY: `a` and `x` are live allocations of BYTES ordered on `main`.
    unsafe { copy_dtod_async(a.ptr(), x, BYTES, main) }.unwrap();
    // SAFETY: as above.
    unsafe { kernels.saxpy_f32(main, 2.0, x, a.ptr(), N) }.unwrap();
    fork(main, side);
    let b = allocator.allocate(BYTES, side).unwrap();
    // SAFETY: `b` is a live allocation of `side`; `x` is read-only here.
    unsafe { kernels.fill_u32(side, b.ptr(), 1.0f32.to_bits(), N) }.unwrap();
    // SAFETY: as above.
    unsafe { kernels.saxpy_f32(side, 0.5, x, b.ptr(), N) }.unwrap();
    let mut b = b;
    b.record_stream(main).unwrap();
    fork(side, main);
    // SAFETY: `main` waits for `side` (fork above), so `b` is complete.
    unsafe { kernels.add_f32(main, a.ptr(), b.ptr(), out, N) }.unwrap();
    drop(a);
    drop(b);
}

fn wait_on(from: &Stream, to: &Stream) {
    let event =
        cuweave_driver::Event::new(from.context(), cuweave_driver::EventFlags::DISABLE_TIMING)
            .unwrap();
    event.record(from).unwrap();
    to.wait_event(&event).unwrap();
}

#[test]
fn a_captured_step_replayed_1000_times_is_bit_identical_to_eager() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("a_captured_step_replayed_1000_times_is_bit_identical_to_eager")
    else {
        return;
    };
    let (main, side) = (stream(&gpu), stream(&gpu));
    let input: Vec<u32> = (0..N as u32)
        .map(|i| (i as f32 * 0.37 - 900.0).to_bits())
        .collect();
    let x = allocator.allocate(BYTES, &main).unwrap();
    write_u32(&gpu.context, x.ptr(), &input);
    let eager_out = allocator.allocate(BYTES, &main).unwrap();
    let graph_out = allocator.allocate(BYTES, &main).unwrap();

    step(
        &kernels,
        &allocator,
        &main,
        &side,
        x.ptr(),
        eager_out.ptr(),
        &mut |from, to| wait_on(from, to),
    );
    main.synchronize().unwrap();
    let eager = read_u32(&gpu.context, eager_out.ptr(), N);

    let mut capture = StreamCapture::begin(&main, CaptureOptions::default()).unwrap();
    let mut joined = false;
    step(
        &kernels,
        &allocator,
        &main,
        &side,
        x.ptr(),
        graph_out.ptr(),
        &mut |from, to| {
            if joined {
                capture.join(from).unwrap();
            } else {
                capture.fork(to).unwrap();
                joined = true;
            }
        },
    );
    let graph = capture.finish().unwrap();
    let types = graph.node_types().unwrap();
    assert!(types.contains(&GraphNodeType::Kernel) && types.contains(&GraphNodeType::Memcpy));
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    let launcher = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    // Under memcheck every kernel runs instrumented: fewer replays there, all 1000 otherwise.
    let rounds: u64 = if sanitizer_active() { 20 } else { 1000 };
    for round in 0..rounds {
        // SAFETY: graph_out is a live allocation of BYTES; the previous replay wrote it on
        // `launcher`, and this memset is ordered after it there.
        unsafe { memset_d32_async(graph_out.ptr(), 0, N, &launcher) }.unwrap();
        launcher.launch_graph(&exec).unwrap();
        if round % 250 == 0 || round == rounds - 1 {
            launcher.synchronize().unwrap();
            let replayed = read_u32(&gpu.context, graph_out.ptr(), N);
            assert!(
                replayed == eager,
                "replay {round} differs from the eager step"
            );
        }
    }
    assert_eq!(launcher.metrics().unwrap().graph_launches, rounds);
    assert_eq!(exec.launch_count(), rounds);
}

/// Captures `fill(g, X); watch(g, X)`; with `private`, `g` is allocated and freed inside the
/// capture (graph memory), else allocated before and freed after it (the pool bypassed).
/// Replays the graph on its own stream while eager code allocates, fills and frees blocks of
/// the same size on the capture's stream and on another; returns the watch's mismatch count.
fn replay_under_eager_churn(gpu: &Gpu, private: bool) -> u32 {
    const X: u32 = 0x1234_5678;
    const Y: u32 = 0xDEAD_BEEF;
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let (origin, launch, other) = (stream(gpu), stream(gpu), stream(gpu));
    let mismatches = allocator.allocate(4, &launch).unwrap();
    let outside = (!private).then(|| allocator.allocate(BYTES, &origin).unwrap());

    let capture = StreamCapture::begin(&origin, CaptureOptions::default()).unwrap();
    let inside = private.then(|| allocator.allocate(BYTES, &origin).unwrap());
    let g = inside.as_ref().or(outside.as_ref()).unwrap().ptr();
    // SAFETY: `g` is BYTES of device memory, alive for the test (the graph keeps the private
    // block; the bypass keeps it only until after the capture: that is the control's bug).
    unsafe { kernels.fill_u32(&origin, g, X, N) }.unwrap();
    // SAFETY: as above; `mismatches` is a live u32.
    unsafe { kernels.watch_u32(&origin, g, N, X, 60 * MS, mismatches.ptr()) }.unwrap();
    drop(inside);
    let graph = capture.finish().unwrap();
    drop(outside); // the bypass: graph memory handed back to the eager cache of `origin`
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    // SAFETY: `mismatches` is a live u32 ordered on `launch`.
    unsafe { memset_d32_async(mismatches.ptr(), 0, 1, &launch) }.unwrap();
    exec.launch(&launch).unwrap();
    // Eager writes spread over the first 40 ms of the 60 ms watch: each waits 2 ms on its
    // stream, then fills a freshly allocated block of the watched size.
    let mut churn: Vec<CachedAllocation> = Vec::new();
    for _ in 0..20 {
        for s in [&origin, &other] {
            kernels.spin_ns(s, 2 * MS).unwrap();
            let block = allocator.allocate(BYTES, s).unwrap();
            // SAFETY: `block` is BYTES of device memory of `s`, freed after in stream order.
            unsafe { kernels.fill_u32(s, block.ptr(), Y, N) }.unwrap();
            churn.push(block);
        }
        churn.clear();
    }
    launch.synchronize().unwrap();
    origin.synchronize().unwrap();
    other.synchronize().unwrap();
    read_u32(&gpu.context, mismatches.ptr(), 1)[0]
}

#[test]
fn eager_churn_never_touches_graph_memory_and_the_bypass_control_does() {
    let Some(gpu) = gpu("eager_churn_never_touches_graph_memory_and_the_bypass_control_does")
    else {
        return;
    };
    if skip_under_sanitizer(
        "eager_churn_never_touches_graph_memory_and_the_bypass_control_does",
        "the control needs the eager stream to run while the graph's watch kernel does",
    ) {
        return;
    }
    let _serial = serial();
    assert_eq!(
        replay_under_eager_churn(&gpu, true),
        0,
        "eager work wrote graph memory"
    );
    assert!(
        replay_under_eager_churn(&gpu, false) > 0,
        "the control (pool bypassed) should have seen eager writes"
    );
}

#[test]
fn dropping_the_graph_and_emptying_the_cache_returns_the_memory() {
    let Some(gpu) = gpu("dropping_the_graph_and_emptying_the_cache_returns_the_memory") else {
        return;
    };
    if skip_under_sanitizer(
        "dropping_the_graph_and_emptying_the_cache_returns_the_memory",
        "memcheck's own device allocations move cuMemGetInfo",
    ) {
        return;
    }
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let main = stream(&gpu);
    // Warm everything that is not graph memory: the module, a graph exec's own structures.
    {
        let capture = StreamCapture::begin(&main, CaptureOptions::default()).unwrap();
        kernels.spin_ns(&main, 1).unwrap();
        let exec = capture
            .finish()
            .unwrap()
            .instantiate(&InstantiateOptions::default())
            .unwrap();
        exec.launch(&main).unwrap();
        main.synchronize().unwrap();
    }
    let start = gpu.context.memory_info().unwrap().free;

    let capture = StreamCapture::begin(&main, CaptureOptions::default()).unwrap();
    let pool = capture.pool().clone();
    for size in [BYTES, 8 << 20, 64 << 20, 3 << 20] {
        let block = allocator.allocate(size, &main).unwrap();
        // SAFETY: `block` holds `size` bytes of `main`.
        unsafe { kernels.fill_u32(&main, block.ptr(), 3, size / 4) }.unwrap();
    }
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..10 {
        exec.launch(&main).unwrap();
    }
    main.synchronize().unwrap();
    assert_eq!(
        pool.holders(),
        3,
        "the handle, the graph and the exec hold the pool"
    );
    allocator.empty_cache().unwrap();
    let held = gpu.context.memory_info().unwrap().free;
    assert!(
        start - held >= 64 << 20,
        "empty_cache must not release a live graph pool"
    );
    drop(exec);
    drop(graph);
    drop(pool);
    allocator.empty_cache().unwrap();
    let end = gpu.context.memory_info().unwrap().free;
    let diff = start.abs_diff(end);
    assert!(
        diff <= 2 << 20,
        "free memory {end} differs from {start} by {diff} bytes"
    );
}

#[test]
fn every_bad_use_is_a_typed_error_and_leaves_the_stream_usable() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("every_bad_use_is_a_typed_error_and_leaves_the_stream_usable")
    else {
        return;
    };
    let (main, other) = (stream(&gpu), stream(&gpu));
    let usable = |s: &Stream| {
        kernels.spin_ns(s, 1000).unwrap();
        s.synchronize().unwrap();
    };

    // Capture on the legacy default stream.
    // SAFETY: the null stream is the context's legacy default stream, never destroyed.
    let legacy = unsafe { Stream::from_raw(&gpu.context, std::ptr::null_mut(), false) };
    let error = StreamCapture::begin(&legacy, CaptureOptions::default()).unwrap_err();
    assert!(matches!(
        graph_error(&error),
        GraphError::LegacyDefaultStream { .. }
    ));
    usable(&legacy);

    // Blocking calls while capturing: refused, and the capture survives them.
    let capture = StreamCapture::begin(&main, CaptureOptions::default()).unwrap();
    assert_capturing(main.synchronize());
    assert_capturing(main.query());
    assert_capturing(gpu.context.synchronize());
    assert_capturing(allocator.empty_cache());
    let mut host = [0u32; 4];
    let scratch = allocator.allocate(16, &other).unwrap();
    // SAFETY: `scratch` holds 16 bytes; the copy is refused before it reaches the driver.
    let refused = unsafe { copy_dtoh(&gpu.context, host.as_mut_ptr().cast(), scratch.ptr(), 16) };
    assert_capturing(refused);
    // A second capture on the same stream, ending on a stream that is not the origin.
    let error = StreamError::from(main.begin_capture(CaptureMode::ThreadLocal).unwrap_err());
    assert!(matches!(
        graph_error(&error),
        GraphError::AlreadyCapturing { .. }
    ));
    let error = StreamError::from(other.end_capture().unwrap_err());
    assert!(matches!(
        graph_error(&error),
        GraphError::NotCapturing { .. }
    ));
    kernels.spin_ns(&main, 1000).unwrap();
    let graph = capture
        .finish()
        .expect("the refused calls did not break the capture");
    graph
        .instantiate(&InstantiateOptions::default())
        .unwrap()
        .launch(&main)
        .unwrap();
    usable(&main);
    usable(&other);

    // The driver resource refuses cuMemAlloc while the capture forbids it, typed, and the
    // capture stays valid.
    let capture = StreamCapture::begin(&main, CaptureOptions::default()).unwrap();
    let raw = DriverResource::new(&gpu.context);
    let refused = StreamError::from(raw.allocate(1 << 20, &main).unwrap_err());
    assert!(
        matches!(graph_error(&refused), GraphError::Capturing { .. }),
        "{refused}"
    );
    drop(
        capture
            .finish()
            .expect("the refused allocation left the capture valid"),
    );

    // A call capture forbids, made anyway (the driver's own allocation, below every check):
    // one typed error naming it at the end.
    let capture = StreamCapture::begin(&main, CaptureOptions::default()).unwrap();
    let broke = cuweave_test_support::outside_capture::raw_mem_alloc(&gpu.context, 1 << 20);
    // Every later call on the broken capture reports the same cause, not a bare INVALIDATED.
    let later = StreamError::from(kernels.spin_ns(&main, 1000).unwrap_err());
    assert!(
        matches!(
            graph_error(&later),
            GraphError::CaptureInvalidated {
                broken_by: Some("cuMemAlloc_v2"),
                ..
            }
        ),
        "{later}"
    );
    let error = capture.finish().unwrap_err();
    match graph_error(&error) {
        GraphError::CaptureInvalidated { broken_by, .. } => {
            eprintln!("capture broken by {broken_by:?} (cuMemAlloc result: {broke:?})");
            assert_eq!(
                *broken_by,
                Some("cuMemAlloc_v2"),
                "the first failing call is named"
            );
        }
        other => panic!("expected CaptureInvalidated, got {other}"),
    }
    if let Ok(ptr) = broke {
        // SAFETY: allocated above, freed once, used by no work.
        unsafe { cuweave_test_support::outside_capture::raw_mem_free(&gpu.context, ptr) }.unwrap();
    }
    usable(&main);

    // Pool misses refused by policy.
    let capture = StreamCapture::begin(
        &main,
        CaptureOptions::default().with_misses(MissPolicy::Fail),
    )
    .unwrap();
    assert_capturing(allocator.allocate(BYTES, &main));
    drop(capture.finish().unwrap());
    usable(&main);
}

#[test]
fn stream_ordered_allocations_in_a_graph_free_on_relaunch_or_refuse_it() {
    let Some(gpu) = gpu("stream_ordered_allocations_in_a_graph_free_on_relaunch_or_refuse_it")
    else {
        return;
    };
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let main = stream(&gpu);
    let capture_alloc = |main: &Stream| {
        let capture = StreamCapture::begin(main, CaptureOptions::default()).unwrap();
        // SAFETY: a graph allocation, freed by auto-free or below.
        let ptr = unsafe { cuweave_driver::memory::alloc_async(main, BYTES) }.unwrap();
        // SAFETY: `ptr` holds BYTES, ordered on `main`.
        unsafe { kernels.fill_u32(main, ptr, 5, N) }.unwrap();
        (capture.finish().unwrap(), ptr)
    };
    let (graph, first_ptr) = capture_alloc(&main);
    assert!(graph.allocates_memory().unwrap());
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        exec.launch(&main).unwrap();
    }
    main.synchronize().unwrap();
    assert_eq!(read_u32(&gpu.context, first_ptr, 4), vec![5; 4]);
    // Auto-free frees a launch's allocation at the next launch; the last one's stays allocated
    // (at the graph's fixed address) until freed, as with any graph allocation.
    // SAFETY: the last launch allocated `first_ptr` and has finished; nothing else uses it.
    unsafe { cuweave_driver::memory::free_async(first_ptr, &main) }.unwrap();
    main.synchronize().unwrap();
    drop(exec);
    drop(graph);

    let (graph, ptr) = capture_alloc(&main);
    let exec = graph
        .instantiate(&InstantiateOptions::default().with_auto_free_on_launch(false))
        .unwrap();
    exec.launch(&main).unwrap();
    let error = StreamError::from(exec.launch(&main).unwrap_err());
    assert!(matches!(
        graph_error(&error),
        GraphError::RelaunchNeedsAutoFree
    ));
    main.synchronize().unwrap();
    assert_eq!(read_u32(&gpu.context, ptr, 4), vec![5; 4]);
    // SAFETY: the single launch allocated `ptr` and is finished; nothing else uses it.
    unsafe { cuweave_driver::memory::free_async(ptr, &main) }.unwrap();
    main.synchronize().unwrap();
}

#[test]
fn forks_must_be_joined_and_fork_blocks_wait_for_the_join() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("forks_must_be_joined_and_fork_blocks_wait_for_the_join")
    else {
        return;
    };
    let (main, side) = (stream(&gpu), stream(&gpu));

    let mut capture = StreamCapture::begin(&main, CaptureOptions::default()).unwrap();
    capture.fork(&side).unwrap();
    kernels.spin_ns(&side, 1000).unwrap();
    assert_eq!(capture.unjoined(), vec![side.id()]);
    let error = capture.finish().unwrap_err();
    assert!(
        matches!(graph_error(&error), GraphError::UnjoinedFork),
        "{error}"
    );
    kernels.spin_ns(&side, 1000).unwrap();
    side.synchronize().unwrap();
    main.synchronize().unwrap();

    let mut capture = StreamCapture::begin(&main, CaptureOptions::default()).unwrap();
    capture.fork(&side).unwrap();
    let mut shared = allocator.allocate(BYTES, &main).unwrap();
    let shared_ptr = shared.ptr();
    // SAFETY: `side` is ordered after `main` by the fork; `shared` stays in the graph.
    unsafe { kernels.fill_u32(&side, shared_ptr, 1, N) }.unwrap();
    shared.record_stream(&side).unwrap();
    drop(shared);
    let forked = allocator.allocate(BYTES, &side).unwrap();
    let forked_ptr = forked.ptr();
    drop(forked);
    let again = allocator.allocate(BYTES, &main).unwrap();
    assert_ne!(
        again.ptr(),
        shared_ptr,
        "a block used on the fork was reused before the join"
    );
    assert_ne!(
        again.ptr(),
        forked_ptr,
        "the fork's block went to the origin before the join"
    );
    drop(again);
    capture.join(&side).unwrap();
    let graph = capture.finish().unwrap();
    graph
        .instantiate(&InstantiateOptions::default())
        .unwrap()
        .launch(&main)
        .unwrap();
    main.synchronize().unwrap();
}

#[test]
fn update_dot_and_profiler_see_graphs() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("update_dot_and_profiler_see_graphs")
    else {
        return;
    };
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let out = allocator.allocate(BYTES, &stream).unwrap();
    let capture_fill = |value: u32, twice: bool| {
        let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
        for _ in 0..(1 + usize::from(twice)) {
            // SAFETY: `out` holds BYTES of this stream.
            unsafe { kernels.fill_u32(&stream, out.ptr(), value, N) }.unwrap();
        }
        capture.finish().unwrap()
    };
    let first = capture_fill(7, false);
    let dot = first.to_dot(true).unwrap();
    assert!(dot.contains("digraph"), "{dot}");
    let mut exec = first.instantiate(&InstantiateOptions::default()).unwrap();
    stream.launch_graph(&exec).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(read_u32(&gpu.context, out.ptr(), 2), vec![7, 7]);
    exec.update(&capture_fill(9, false)).unwrap();
    stream.launch_graph(&exec).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(read_u32(&gpu.context, out.ptr(), 2), vec![9, 9]);
    let error = StreamError::from(exec.update(&capture_fill(11, true)).unwrap_err());
    assert!(
        matches!(graph_error(&error), GraphError::UpdateRejected { .. }),
        "{error}"
    );
    stream.launch_graph(&exec).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(
        read_u32(&gpu.context, out.ptr(), 2),
        vec![9, 9],
        "a refused update changes nothing"
    );

    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    profiler
        .profile(&stream, "step", OperationKind::GraphLaunch, 0, |s| {
            s.launch_graph(&exec)
        })
        .unwrap();
    stream.synchronize().unwrap();
    let report = profiler.report().unwrap();
    assert_eq!(report.combined.graph_launches, 1);
    assert!(profiler.chrome_trace().unwrap().contains("\"graph\""));
    assert_eq!(stream.metrics().unwrap().graph_launches, 4);

    let shared = GraphPool::new();
    let a = stream
        .begin_capture(CaptureOptions::default().with_pool(&shared))
        .unwrap();
    drop(allocator.allocate(BYTES, &stream).unwrap());
    let ga = a.finish().unwrap();
    let b = stream
        .begin_capture(CaptureOptions::default().with_pool(&shared))
        .unwrap();
    let before = allocator.stats().reserved_bytes.current;
    drop(allocator.allocate(BYTES, &stream).unwrap());
    assert_eq!(
        allocator.stats().reserved_bytes.current,
        before,
        "a second capture into the same pool reuses its memory"
    );
    let gb = b.finish().unwrap();
    assert_eq!(shared.holders(), 3);
    drop((ga, gb));
}

#[test]
fn coordinator_dependencies_inside_a_capture_become_graph_edges() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("coordinator_dependencies_inside_a_capture_become_graph_edges")
    else {
        return;
    };
    let main = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let side = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let out = allocator.allocate(BYTES, &main).unwrap();
    let coordinator = MultiStreamCoordinator::new();

    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    // SAFETY: `out` holds BYTES; every kernel below is ordered after this one.
    unsafe { kernels.fill_u32(&main, out.ptr(), 1, N) }.unwrap();
    coordinator.add_dependency(&side, &main).unwrap(); // the fork: an edge main -> side
    let scratch = allocator.allocate(BYTES, &side).unwrap(); // the capture's pool
    // SAFETY: `scratch` holds BYTES of `side`; `out` is ordered by the fork above.
    unsafe { kernels.fill_u32(&side, scratch.ptr(), 0, N) }.unwrap();
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&side, out.ptr(), N) }.unwrap();
    drop(scratch);
    main.wait_for(&side).unwrap(); // the join: an edge side -> main
    // SAFETY: ordered after the increment by the join.
    unsafe { kernels.increment_u32(&main, out.ptr(), N) }.unwrap();
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..100 {
        main.launch_graph(&exec).unwrap();
    }
    main.synchronize().unwrap();
    assert!(read_u32(&gpu.context, out.ptr(), N).iter().all(|&v| v == 3));
}

#[test]
fn typed_buffers_allocate_and_drop_inside_a_capture() {
    let Some(Fixture {
        gpu,
        allocator,
        _serial,
        ..
    }) = fixture("typed_buffers_allocate_and_drop_inside_a_capture")
    else {
        return;
    };
    let main = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let out = allocator.allocate(BYTES, &main).unwrap();

    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    let mut buffer = allocator.buffer::<u32>(N, &main).unwrap();
    main.fill(&mut buffer, 7).unwrap(); // tracked: an event recorded inside the capture
    let inside = buffer.device_ptr();
    // SAFETY: both hold BYTES; the copy is ordered after the fill on `main`.
    unsafe { copy_dtod_async(out.ptr(), inside, BYTES, &main) }.unwrap();
    drop(buffer); // used in the capture: held until it ends, its events never polled
    let again = allocator.buffer::<u32>(N, &main).unwrap();
    assert_ne!(
        again.device_ptr(),
        inside,
        "a used block was reused inside the capture"
    );
    drop(again);
    let graph = capture.finish().unwrap();

    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        main.launch_graph(&exec).unwrap();
    }
    main.synchronize().unwrap();
    assert!(read_u32(&gpu.context, out.ptr(), N).iter().all(|&v| v == 7));
    let eager = allocator.buffer::<u32>(N, &main).unwrap();
    assert_ne!(
        eager.device_ptr(),
        inside,
        "graph memory went to eager work"
    );
}

#[test]
fn a_graph_of_another_device_is_refused_on_this_devices_stream_and_both_stay_usable() {
    const TEST: &str =
        "a_graph_of_another_device_is_refused_on_this_devices_stream_and_both_stay_usable";
    let Some(Fixture {
        gpu,
        kernels,
        _serial,
        ..
    }) = fixture(TEST)
    else {
        return;
    };
    let count = cuweave_driver::Device::count().unwrap();
    if count < 2 {
        cuweave_test_support::skip(TEST, &format!("needs two GPUs, this machine has {count}"));
        return;
    }
    let other = Context::primary(cuweave_driver::Device::get(1).unwrap()).unwrap();
    let other_stream = Stream::new(&other, StreamFlags::NON_BLOCKING).unwrap();
    let other_kernels = TestKernels::load(&other).unwrap();
    let capture = StreamCapture::begin(&other_stream, CaptureOptions::default()).unwrap();
    other_kernels.spin_ns(&other_stream, 1000).unwrap();
    let exec = capture
        .finish()
        .unwrap()
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    let main = stream(&gpu);
    let error = exec.launch(&main).unwrap_err();
    assert!(
        matches!(error, cuweave_driver::DriverError::InvalidArgument { .. }),
        "{error}"
    );
    assert_eq!(exec.launch_count(), 0);
    kernels.spin_ns(&main, 1000).unwrap();
    main.synchronize().unwrap();
    exec.launch(&other_stream).unwrap();
    other_stream.synchronize().unwrap();
    assert_eq!(exec.launch_count(), 1);
}
