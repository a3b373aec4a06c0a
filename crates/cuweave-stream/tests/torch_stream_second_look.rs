//! A second look at what PyTorch stream, event and CUDA-graph users (and RMM users of the
//! stream-ordered allocator) expect of this crate, aimed at what the earlier program files
//! leave out:
//!
//! - a stream-ordered typed buffer written by a launch on its own stream (unrecorded, as the
//!   rules allow) and dropped: RMM frees on the buffer's stream;
//! - GPU time as the profiler, the per-stream metrics and `torch.cuda.Event`-style events
//!   report it, against the `%globaltimer` stamps the kernels write themselves;
//! - work queued through a timed `PriorityStream` while it captures (not counted, not timed)
//!   and the graph's launches afterwards (each counted and timed);
//! - a fork/join capture whose branches take typed scratch on both streams, replayed a
//!   thousand times with new inputs, every output checked, memory flat and returned after;
//! - a graph dropped while its replay still runs, with eager work and a new capture right
//!   behind it;
//! - `wait_for` along a chain of eight streams of mixed priorities, proven by kernel-copied
//!   flags;
//! - four threads that capture at the same moment, each reading in its graph a buffer it
//!   filled (and synchronised) before the capture.
//!
//! Ordering is proven by bytes that kernels write, times by the kernels' own clock. Every test
//! takes `serial()`, uses well under a GiB and runs in a few seconds on an H200.

use std::sync::{Arc, Barrier, Mutex};

use cuweave_driver::memory::{copy_dtod_async, memset_d32_async};
use cuweave_driver::{
    Context, Event, EventFlags, EventPool, InstantiateOptions, LaunchConfig, Stream,
};
use cuweave_memory::caching::CachingAllocator;
use cuweave_memory::{Buffer, DeviceBuffer, MemoryError, TrackedLaunch};
use cuweave_stream::capture::{CaptureOptions, StreamCapture};
use cuweave_stream::timing::GpuTimer;
use cuweave_stream::{
    OperationKind, PriorityStream, StreamOrderedAllocator, StreamPriority, StreamProfiler,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{require_gpu, serial, skip, skip_under_sanitizer};

const MS: u64 = 1_000_000;

fn normal_stream(context: &Arc<Context>) -> Arc<PriorityStream> {
    Arc::new(PriorityStream::new(context, StreamPriority::Normal).expect("stream"))
}

/// Whether `measured` is within `tolerance` nanoseconds of `expected`.
fn close(measured: u64, expected: u64, tolerance: u64) -> bool {
    measured.abs_diff(expected) <= tolerance
}

// ---------------------------------------------------------------------------------------------
// RMM: a stream-ordered buffer written on its own stream
// ---------------------------------------------------------------------------------------------

/// RMM's `device_uvector<uint32_t> v(n, stream, mr); kernel<<<.., stream>>>(v.data()); }` in
/// this crate's words: `StreamOrderedAllocator::buffer` on `owner`, a kernel launched through
/// `owner.launch` writes it (behind a 300 ms spin; left unrecorded, since the rules let work on
/// the allocating stream be), and the buffer is dropped. RMM frees on the buffer's stream, so
/// the pool cannot hand the memory to anyone before that kernel ran.
///
/// The next buffer of the same allocator is made on the default stream (wrapped as a
/// `PriorityStream`, as a program mixing this crate with default-stream code does) and filled
/// there. Expected: it holds its fill after every stream has finished.
///
/// Found on an H200 (the cause, now fixed): the drop deallocated on the legacy default stream after the buffer's
/// *recorded* uses only (`cuweave-memory` `buffer/device.rs`, `deallocate_after`), which do not
/// include the launch, so the pool hands the memory to the next default-stream allocation (same
/// stream, so in stream order) while the launch on `owner` is still queued.
#[test]
fn a_stream_ordered_buffer_written_late_by_a_launch_on_its_own_stream_is_not_reused_under_it() {
    let name =
        "a_stream_ordered_buffer_written_late_by_a_launch_on_its_own_stream_is_not_reused_under_it";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(name, "needs the next buffer's fill to run beside the spin") {
        return;
    }
    if !gpu.device.supports_memory_pools().unwrap_or(false) {
        skip(name, "the device has no stream-ordered memory pools");
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = StreamOrderedAllocator::default();
    let default_stream = Arc::new(
        PriorityStream::from_stream(Stream::legacy_default(context)).expect("default stream"),
    );
    const N: usize = 1 << 20; // u32s: 4 MiB
    const STALE: u32 = 0xDEAD_0001;
    const FRESH: u32 = 0xF00D_0002;

    // A fresh owner each round, in case one shares a hardware queue with the default stream
    // (its late write would then land first and hide what the test looks for).
    for round in 0..3 {
        let owner = normal_stream(context);
        let x = allocator.buffer::<u32>(&owner, N).expect("x");
        let ptr = x.device_ptr();
        owner
            .launch(|s| kernels.spin_ns(s, 300 * MS))
            .expect("spin");
        // SAFETY: `x` holds N u32s; the launch is on the stream `x` was allocated on, which the
        // rules allow unrecorded, and its memory is promised not to be reused under queued work.
        owner
            .launch(|s| unsafe { kernels.fill_u32(s, ptr, STALE, N) })
            .expect("late write");
        drop(x);
        let mut y = allocator.buffer::<u32>(&default_stream, N).expect("y");
        let reused = y.device_ptr() == ptr;
        default_stream.fill(&mut y, FRESH).expect("fill y");
        default_stream
            .synchronize()
            .expect("sync the default stream");
        let owner_was_busy = !owner.is_ready().expect("query owner");
        owner.synchronize().expect("sync owner");
        let got = y.to_vec().expect("y");
        let stale = got.iter().filter(|&&v| v != FRESH).count();
        assert_eq!(
            stale, 0,
            "round {round}: {stale} of {N} elements of y hold the late write of the dropped x's \
             own-stream launch (y got x's address: {reused}; x's stream still busy after y's \
             fill: {owner_was_busy})"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// GPU time against the kernels' own clock
// ---------------------------------------------------------------------------------------------

/// `torch.profiler`-style spans and per-stream GPU time against what the kernels measured
/// themselves (`%globaltimer` stamps of one-block spins): a 20 ms and then a 5 ms spin on a
/// timed stream, a 30 ms spin beside them on another. Each profiled duration is the kernel's
/// own to within a millisecond; the starts, placed on the profiler's one clock, are as far
/// apart as the kernels' starts (so overlap across streams is real); the combined report's busy
/// time is the union of the kernels; the timed stream's metrics add up its two kernels.
#[test]
fn profiled_spans_and_stream_gpu_time_match_the_kernels_own_globaltimer_stamps() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "profiled_spans_and_stream_gpu_time_match_the_kernels_own_globaltimer_stamps",
        "needs the two streams' spins to overlap",
    ) {
        return;
    }
    let context = &gpu.context;
    let spins = StreamKernels::load(context).expect("stream kernels");
    let (a, b) = (normal_stream(context), normal_stream(context));
    a.set_timing(true);
    let profiler = StreamProfiler::new(context).expect("profiler");
    let allocator = CachingAllocator::with_driver(context);
    let mut stamps = allocator.buffer::<u64>(6, a.stream()).expect("stamps");
    stamps
        .copy_from_host(&[u64::MAX, 0, u64::MAX, 0, u64::MAX, 0])
        .expect("init stamps");
    let base = stamps.device_ptr();
    let spin = |stream: &PriorityStream, name: &str, ns: u64, slot: u64| {
        profiler
            .profile(stream, name, OperationKind::KernelLaunch, 0, |s| {
                // SAFETY: slot `slot` of `stamps` is two u64s that only this kernel touches;
                // they are read after every stream is synchronised.
                s.launch(|st| unsafe { spins.spin_stamped(st, ns, 1, base + 16 * slot) })
            })
            .expect("profiled spin");
    };
    spin(&a, "first", 20 * MS, 0);
    spin(&b, "beside", 30 * MS, 1);
    spin(&a, "second", 5 * MS, 2);
    let ops = profiler.operations().expect("operations");
    a.synchronize().expect("sync a");
    b.synchronize().expect("sync b");
    let st = stamps.to_vec().expect("stamps");
    let kernel = |slot: usize| (st[2 * slot], st[2 * slot + 1]);
    let op = |name: &str| {
        ops.iter()
            .find(|op| op.name == name)
            .unwrap_or_else(|| panic!("no profiled {name}"))
    };
    const TOLERANCE: u64 = MS;
    for (slot, name, ns) in [
        (0, "first", 20 * MS),
        (1, "beside", 30 * MS),
        (2, "second", 5 * MS),
    ] {
        let (start, end) = kernel(slot);
        let measured = end - start;
        assert!(measured >= ns, "{name}: the kernel spun {measured} ns");
        assert!(
            close(op(name).duration_ns, measured, TOLERANCE),
            "{name}: profiled {} ns, the kernel's own clock {measured} ns",
            op(name).duration_ns
        );
    }
    let first_start = kernel(0).0;
    for (slot, name) in [(1, "beside"), (2, "second")] {
        let on_profiler = op(name).start_ns as i128 - op("first").start_ns as i128;
        let on_kernels = kernel(slot).0 as i128 - first_start as i128;
        assert!(
            (on_profiler - on_kernels).abs() <= i128::from(TOLERANCE),
            "{name} starts {on_profiler} ns after first on the profiler's clock, {on_kernels} ns \
             on the kernels'"
        );
    }
    let report = profiler.report().expect("report");
    let union = kernel(0)
        .1
        .max(kernel(1).1)
        .max(kernel(2).1)
        .saturating_sub(first_start.min(kernel(1).0));
    assert!(
        close(report.combined.busy_ns, union, 2 * TOLERANCE),
        "busy {} ns, the kernels' union {union} ns",
        report.combined.busy_ns
    );
    assert!(
        report.combined.overlap_ns >= 20 * MS,
        "overlap {} ns: the streams did not run together",
        report.combined.overlap_ns
    );
    let metrics = a.metrics().expect("metrics");
    assert_eq!(metrics.kernel_launches, 2);
    assert_eq!(metrics.timed_operations, 2);
    let own = (kernel(0).1 - kernel(0).0) + (kernel(2).1 - kernel(2).0);
    assert!(
        close(metrics.gpu_time_ns, own, 2 * TOLERANCE),
        "the timed stream reports {} ns of GPU time, its kernels ran {own} ns",
        metrics.gpu_time_ns
    );
}

/// `torch.cuda.Event(enable_timing=True)` across two streams: `start` on `a`, a 20 ms spin,
/// `mid` on `a`; `b` waits for `mid`, spins 10 ms, records `end`. The elapsed times are the
/// spins (and their sum across the wait), and the crate's `GpuTimer` spans around the two
/// spins (the second begun after `b`'s wait) read the same.
#[test]
fn timing_events_across_a_cross_stream_wait_measure_the_spins_on_either_side() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let a = PriorityStream::new(context, StreamPriority::High).expect("a");
    let b = PriorityStream::new(context, StreamPriority::Low).expect("b");
    let timer = GpuTimer::<&str>::new(EventPool::for_context(context).expect("pool"));
    let event = || Event::new(context, EventFlags::TIMING).expect("event");
    let (start, mid, end) = (event(), event(), event());

    start.record(&a).expect("start");
    let span = timer.start(&a).expect("span a");
    a.launch(|s| kernels.spin_ns(s, 20 * MS)).expect("spin a");
    timer.finish(span, &a, "a").expect("end span a");
    mid.record(&a).expect("mid");
    b.wait_event(&mid).expect("b waits for mid");
    let span = timer.start(&b).expect("span b");
    b.launch(|s| kernels.spin_ns(s, 10 * MS)).expect("spin b");
    timer.finish(span, &b, "b").expect("end span b");
    end.record(&b).expect("end");
    end.synchronize().expect("wait for end");

    let ms = |from: &Event, to: &Event| {
        (f64::from(from.elapsed_ms(to).expect("elapsed")) * 1e6).round() as u64
    };
    let (first, second, total) = (ms(&start, &mid), ms(&mid, &end), ms(&start, &end));
    assert!(
        (20 * MS..22 * MS).contains(&first),
        "start -> mid {first} ns for a 20 ms spin"
    );
    assert!(
        (10 * MS..12 * MS).contains(&second),
        "mid -> end {second} ns for a 10 ms spin after the wait"
    );
    assert!(
        close(total, first + second, MS / 2),
        "start -> end {total} ns, the parts {first} + {second} ns"
    );
    let mut spans = Vec::new();
    timer
        .harvest_all(|tag, duration, _| spans.push((tag, duration.as_nanos() as u64)))
        .expect("harvest");
    assert_eq!(spans.len(), 2, "{spans:?}");
    assert_eq!((spans[0].0, spans[1].0), ("a", "b"), "in queueing order");
    assert!(
        close(spans[0].1, first, MS),
        "span a {} ns, events {first} ns",
        spans[0].1
    );
    assert!(
        close(spans[1].1, second, MS),
        "span b {} ns, events {second} ns",
        spans[1].1
    );
    assert_eq!(timer.pending(), 0);
}

/// A timed `PriorityStream` that captures a step through its own methods (`launch`, `fill`):
/// nothing recorded into the graph is counted or timed (it did not run), and the stream's
/// metrics are exactly what they were before the capture. Each of the twenty launches of the
/// graph afterwards counts as one operation, one graph launch and one timed span of at least
/// the graph's 10 ms spin; nothing is outstanding once the stream is synchronised, and the
/// graph's output is right.
#[test]
fn a_timed_stream_counts_its_graph_launches_and_nothing_it_captured() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let s = normal_stream(context);
    const N: usize = 1 << 16;
    let mut out = allocator.buffer::<u32>(N, s.stream()).expect("out");
    s.fill(&mut out, 0).expect("zero out");
    s.synchronize().expect("sync");
    s.set_timing(true);
    let before = s.metrics().expect("metrics");

    let capture = StreamCapture::begin(s.stream(), CaptureOptions::default()).expect("begin");
    s.launch(|st| kernels.spin_ns(st, 10 * MS))
        .expect("spin, captured");
    s.fill(&mut out, 7).expect("fill, captured");
    let ptr = out.device_ptr();
    // SAFETY: `out` holds N u32s and outlives the graph; its fill before is on this stream.
    s.launch(|st| unsafe { kernels.increment_u32(st, ptr, N) })
        .expect("increment, captured");
    let graph = capture.finish().expect("finish");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");
    let during = s.metrics().expect("metrics");
    assert_eq!(
        during, before,
        "work recorded into the graph was counted or timed"
    );

    const LAUNCHES: u64 = 20;
    for _ in 0..LAUNCHES {
        s.launch_graph(&exec).expect("launch");
    }
    s.synchronize().expect("sync");
    assert_eq!(s.outstanding_work().expect("outstanding"), 0);
    let after = s.metrics().expect("metrics");
    assert_eq!(after.graph_launches - before.graph_launches, LAUNCHES);
    assert_eq!(after.operations - before.operations, LAUNCHES);
    assert_eq!(after.kernel_launches, before.kernel_launches);
    assert_eq!(after.memsets, before.memsets);
    assert_eq!(after.timed_operations - before.timed_operations, LAUNCHES);
    let gpu_time = after.gpu_time_ns - before.gpu_time_ns;
    assert!(
        (LAUNCHES * 10 * MS..=LAUNCHES * 12 * MS).contains(&gpu_time),
        "{LAUNCHES} launches of a 10 ms graph timed at {gpu_time} ns"
    );
    assert!(out.to_vec().expect("out").iter().all(|&v| v == 8));
    drop((exec, graph));
}

// ---------------------------------------------------------------------------------------------
// Graphs: fork/join with typed scratch, and a graph dropped mid-replay
// ---------------------------------------------------------------------------------------------

/// `data[i] += 1` on `buffer`, declared as a write.
fn bump(
    kernel: &cuweave_driver::Kernel,
    stream: &Stream,
    config: LaunchConfig,
    buffer: &mut DeviceBuffer<u32>,
) -> Result<(), MemoryError> {
    let n = buffer.len() as u64;
    // SAFETY: increment_u32(unsigned*, size_t) writes `n` elements of `buffer`, which holds
    // `n` u32s, declared written.
    unsafe {
        TrackedLaunch::new(kernel, stream, config)
            .write(buffer)
            .arg(&n)
            .launch()
    }
}

/// `torch.cuda.graph` of a two-branch step: the capture forks a side stream; each branch takes
/// typed scratch from the caching allocator on its own stream (the graph's private pool),
/// copies the input into it and bumps it (once on the main branch, twice on the side); after
/// the join the main stream copies half of each branch's scratch into the output (reading the
/// side's scratch across streams inside the capture) and both scratch buffers are dropped.
/// A thousand replays with new inputs written eagerly before each give `input + 1` in the
/// first half and `input + 2` in the second every time; the allocator's books do not move
/// over the replays, and once the graph is gone `empty_cache` returns its pool's memory.
#[test]
fn a_fork_join_graph_with_typed_scratch_on_both_branches_replays_a_thousand_inputs_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let increment = kernels
        .module()
        .function("increment_u32")
        .expect("increment");
    let allocator = CachingAllocator::with_driver(context);
    let (main, side) = (normal_stream(context), normal_stream(context));
    const N: usize = 1 << 16;
    const HALF: usize = N / 2;
    let config = LaunchConfig::for_elements(N, 256).expect("config");

    let mut input = allocator.buffer::<u32>(N, main.stream()).expect("input");
    let mut out = allocator.buffer::<u32>(N, main.stream()).expect("out");
    input.fill_async(0, main.stream()).expect("zero input");
    out.fill_async(0, main.stream()).expect("zero out");
    main.synchronize().expect("sync");
    let base = allocator.stats();

    let mut capture =
        StreamCapture::begin(main.stream(), CaptureOptions::default()).expect("begin");
    capture.fork(side.stream()).expect("fork side");
    let mut a = allocator
        .buffer::<u32>(N, main.stream())
        .expect("scratch on main");
    a.copy_from_async(&input, main.stream())
        .expect("input -> a");
    bump(&increment, main.stream(), config, &mut a).expect("a += 1");
    let mut b = allocator
        .buffer::<u32>(N, side.stream())
        .expect("scratch on side");
    b.copy_from_async(&input, side.stream())
        .expect("input -> b");
    bump(&increment, side.stream(), config, &mut b).expect("b += 1");
    bump(&increment, side.stream(), config, &mut b).expect("b += 1 again");
    capture.join(side.stream()).expect("join side");
    out.slice_mut(..HALF)
        .expect("low")
        .copy_from_async(&a.slice(..HALF).expect("a low"), main.stream())
        .expect("a -> out");
    out.slice_mut(HALF..)
        .expect("high")
        .copy_from_async(&b.slice(HALF..).expect("b high"), main.stream())
        .expect("b -> out (side's scratch, read on main)");
    drop(a);
    drop(b);
    let graph = capture.finish().expect("finish");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");

    let mut host = vec![0u32; N];
    let mut after_first = None;
    for round in 0..1000u32 {
        let value = round.wrapping_mul(2_654_435_761) >> 4;
        input.fill_async(value, main.stream()).expect("new input");
        main.launch_graph(&exec).expect("launch");
        host = out
            .copy_to_host_async(host, main.stream())
            .expect("download")
            .wait()
            .expect("downloaded");
        if let Some(i) = host[..HALF].iter().position(|&v| v != value + 1) {
            panic!(
                "replay {round}: out[{i}] = {} for input {value} (main branch)",
                host[i]
            );
        }
        if let Some(i) = host[HALF..].iter().position(|&v| v != value + 2) {
            panic!(
                "replay {round}: out[{}] = {} for input {value} (side branch)",
                HALF + i,
                host[HALF + i]
            );
        }
        if round == 0 {
            after_first = Some(allocator.stats());
        }
    }
    let first = after_first.expect("first replay");
    let last = allocator.stats();
    assert_eq!(
        last.reserved_bytes.current, first.reserved_bytes.current,
        "replays took memory"
    );
    assert_eq!(last.allocated_bytes.current, base.allocated_bytes.current);
    assert_eq!(last.allocations, first.allocations, "replays allocated");

    drop((exec, graph));
    main.synchronize().expect("sync");
    allocator.empty_cache().expect("empty");
    assert_eq!(
        allocator.stats().reserved_bytes.current,
        base.reserved_bytes.current,
        "the dead graph's pool kept memory"
    );
    drop((input, out));
}

/// A graph dropped (executable and graph, so its pool dies) while its replay is still
/// spinning before it writes its scratch and copies it out. Right behind it: an eager buffer
/// from the same allocator filled on another stream, and a new capture with a fresh pool on
/// that stream, whose scratch may reuse the dead pool's memory. None of that may touch the
/// first graph's memory before its replay is done: its output is exactly what it computed.
#[test]
fn a_graph_dropped_while_its_replay_runs_keeps_its_memory_until_the_replay_ends() {
    let name = "a_graph_dropped_while_its_replay_runs_keeps_its_memory_until_the_replay_ends";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(name, "needs the eager fill to run beside the replay") {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let (s, t) = (normal_stream(context), normal_stream(context));
    const N: usize = 1 << 16;
    const BYTES: usize = N * 4;

    let mut out = allocator.buffer::<u32>(N, s.stream()).expect("out");
    let mut out2 = allocator.buffer::<u32>(N, t.stream()).expect("out2");
    out.fill_async(0, s.stream()).expect("zero out");
    out2.fill_async(0, t.stream()).expect("zero out2");
    s.synchronize().expect("sync s");
    t.synchronize().expect("sync t");
    let (out_ptr, out2_ptr) = (out.device_ptr(), out2.device_ptr());

    let capture = StreamCapture::begin(s.stream(), CaptureOptions::default()).expect("begin");
    let scratch = allocator.allocate(BYTES, s.stream()).expect("scratch");
    let scratch_ptr = scratch.ptr();
    // SAFETY: `scratch` is graph memory of N u32s held by the graph's pool; `out` holds N u32s
    // and outlives every launch (the streams are synchronised before it is read or freed).
    unsafe {
        memset_d32_async(scratch_ptr, 7, N, s.stream()).expect("scratch = 7");
        kernels.spin_ns(s.stream(), 300 * MS).expect("spin");
        kernels
            .increment_u32(s.stream(), scratch_ptr, N)
            .expect("scratch += 1");
        copy_dtod_async(out_ptr, scratch_ptr, BYTES, s.stream()).expect("scratch -> out");
    }
    drop(scratch);
    let graph = capture.finish().expect("finish");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");
    s.launch_graph(&exec).expect("launch");
    drop(exec);
    drop(graph);

    let mut eager = allocator.buffer::<u32>(N, t.stream()).expect("eager");
    assert!(
        eager.device_ptr() + BYTES as u64 <= scratch_ptr
            || scratch_ptr + BYTES as u64 <= eager.device_ptr(),
        "eager work got the dropped graph's scratch while its replay may run"
    );
    t.fill(&mut eager, 99).expect("fill eager");

    let capture = StreamCapture::begin(t.stream(), CaptureOptions::default()).expect("begin 2");
    let scratch2 = allocator.allocate(BYTES, t.stream()).expect("scratch 2");
    let adopted = scratch2.ptr() == scratch_ptr;
    // SAFETY: as for the first graph.
    unsafe {
        memset_d32_async(scratch2.ptr(), 1234, N, t.stream()).expect("scratch2 = 1234");
        copy_dtod_async(out2_ptr, scratch2.ptr(), BYTES, t.stream()).expect("scratch2 -> out2");
    }
    drop(scratch2);
    let graph2 = capture.finish().expect("finish 2");
    let exec2 = graph2
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate 2");
    t.launch_graph(&exec2).expect("launch 2");
    t.synchronize().expect("sync t");
    s.synchronize().expect("sync s");

    let got = out.to_vec().expect("out");
    let wrong = got.iter().filter(|&&v| v != 8).count();
    assert_eq!(
        wrong, 0,
        "{wrong} of {N} outputs of the dropped graph's replay are not 8 (the next capture \
         reused its scratch: {adopted})"
    );
    assert!(eager.to_vec().expect("eager").iter().all(|&v| v == 99));
    assert!(out2.to_vec().expect("out2").iter().all(|&v| v == 1234));
    drop((exec2, graph2, eager, out, out2));
    context.synchronize().expect("sync");
    allocator.empty_cache().expect("empty");
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

// ---------------------------------------------------------------------------------------------
// wait_for along a chain of priorities
// ---------------------------------------------------------------------------------------------

/// `s[i].wait_stream(s[i-1])` along eight streams of mixed priorities: the first stream spins
/// 30 ms and then sets flag 0; every later stream waits for the one before, spins 2 ms, copies
/// the previous flag and adds one. All of it is queued before the first spin ends, so only the
/// waits can make flag `i` read `i + 1`; without them it would read 1. Twenty rounds.
#[test]
fn wait_for_along_eight_streams_of_mixed_priorities_orders_every_link() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "wait_for_along_eight_streams_of_mixed_priorities_orders_every_link",
        "spins hold streams while others are queued",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let flags_kernels = StreamKernels::load(context).expect("stream kernels");
    let levels = [
        StreamPriority::Low,
        StreamPriority::High,
        StreamPriority::Normal,
        StreamPriority::Low,
        StreamPriority::High,
        StreamPriority::Low,
        StreamPriority::Normal,
        StreamPriority::High,
    ];
    let streams: Vec<PriorityStream> = levels
        .iter()
        .map(|&level| PriorityStream::new(context, level).expect("stream"))
        .collect();
    let allocator = CachingAllocator::with_driver(context);
    let mut flags = allocator
        .buffer::<u32>(8, streams[0].stream())
        .expect("flags");
    let base = flags.device_ptr();
    let flag = |i: usize| base + 4 * i as u64;

    for round in 0..20 {
        flags.fill(0).expect("reset flags");
        // SAFETY: every flag is a u32 of `flags`, which outlives the kernels (all streams are
        // synchronised before the flags are read, reset or freed).
        streams[0]
            .launch(|s| unsafe { kernels.spin_then_store_u32(s, 30 * MS, flag(0), 1) })
            .expect("first link");
        for i in 1..streams.len() {
            streams[i]
                .wait_for(&streams[i - 1])
                .expect("wait for the stream before");
            streams[i]
                .launch(|s| kernels.spin_ns(s, 2 * MS))
                .expect("spin");
            // SAFETY: as above.
            streams[i]
                .launch(|s| unsafe { flags_kernels.copy_flag_u32(s, flag(i - 1), flag(i)) })
                .expect("copy the flag");
            // SAFETY: as above.
            streams[i]
                .launch(|s| unsafe { kernels.increment_u32(s, flag(i), 1) })
                .expect("add one");
        }
        for stream in &streams {
            stream.synchronize().expect("sync");
        }
        let got = flags.to_vec().expect("flags");
        assert_eq!(
            got,
            (1..=8).collect::<Vec<u32>>(),
            "round {round}: a link ran before the stream it waited for"
        );
    }
    for stream in &streams {
        assert_eq!(stream.outstanding_work().expect("outstanding"), 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Captures begun on several threads at once
// ---------------------------------------------------------------------------------------------

/// The value thread `thread` feeds its graph in round `round`, replay `replay`.
fn feed(thread: usize, round: usize, replay: usize) -> u32 {
    ((thread as u32 + 1) << 24) | ((round as u32) << 8) | replay as u32
}

/// Replays `graph` with new inputs on `s` and checks each output is `input + 1`; errors are
/// returned as text (the caller's threads must never panic between barriers).
fn replay_checked(
    graph: &cuweave_driver::Graph,
    s: &PriorityStream,
    x: &mut DeviceBuffer<u32>,
    out: &DeviceBuffer<u32>,
    (thread, round): (usize, usize),
    replays: usize,
) -> Result<(), String> {
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .map_err(|error| format!("instantiate: {error}"))?;
    let mut host = vec![0u32; out.len()];
    for replay in 0..replays {
        let value = feed(thread, round, replay);
        x.fill_async(value, s.stream())
            .map_err(|error| format!("new input: {error}"))?;
        s.launch_graph(&exec)
            .map_err(|error| format!("launch: {error}"))?;
        host = out
            .copy_to_host_async(host, s.stream())
            .map_err(|error| format!("download: {error}"))?
            .wait()
            .map_err(|error| format!("downloaded: {error}"))?;
        if let Some(i) = host.iter().position(|&v| v != value + 1) {
            return Err(format!(
                "replay {replay}: out[{i}] = {} for input {value}",
                host[i]
            ));
        }
    }
    Ok(())
}

/// An inference server whose four worker threads each record their own graph at the same
/// moment (thread-local capture mode, one stream each, one shared caching allocator). Before
/// each capture a thread fills its input on its stream and synchronises that stream, as
/// `torch.cuda.graph` users do; inside the capture it copies the input into its output and
/// bumps it. The eager fill is over before any capture begins, so every capture may read the
/// input: each thread's capture is accepted and its graph, replayed with new inputs, gives
/// `input + 1`. Twenty-four rounds, a fresh graph pool each.
///
/// A capture begun while another thread's capture is beginning cannot synchronise the context
/// (`Stream::begin_capture_synchronized`); it must then still know that work finished before
/// the other capture's synchronisation is complete. Found on an H200 (24 of 96
/// captures refused; now fixed): the bound it inherits from the active captures was read
/// before its own synchronisation is attempted (`cuweave-driver`,
/// `graph/capture/begin_end.rs`, `inherited_complete_before` before `while_no_capture_begins`),
/// so when another capture begins in between, the refused synchronisation leaves it with no
/// bound at all and every buffer used before the capture looks unfinished.
#[test]
fn four_threads_capturing_at_once_read_inputs_they_filled_before_and_replay_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    const THREADS: usize = 4;
    const ROUNDS: usize = 24;
    const REPLAYS: usize = 8;
    const N: usize = 1 << 14;
    let barrier = Barrier::new(THREADS);
    let failures: Mutex<Vec<String>> = Mutex::new(Vec::new());

    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let (allocator, kernels, barrier, failures) =
                (&allocator, &kernels, &barrier, &failures);
            // Nothing in the rounds panics: a thread that stopped early would leave the others
            // waiting at a barrier for good. Failures are collected and asserted afterwards.
            scope.spawn(move || {
                let fail = |what: String| {
                    if let Ok(mut failures) = failures.lock() {
                        failures.push(what);
                    }
                };
                let s = normal_stream(context);
                let buffers = allocator
                    .buffer::<u32>(N, s.stream())
                    .and_then(|x| Ok((x, allocator.buffer::<u32>(N, s.stream())?)));
                let (mut x, mut out) = match buffers {
                    Ok(buffers) => (Some(buffers.0), Some(buffers.1)),
                    Err(error) => {
                        fail(format!("thread {thread}: buffers: {error}"));
                        (None, None)
                    }
                };
                for round in 0..ROUNDS {
                    let mut ready = false;
                    if let (Some(x), Some(_)) = (&mut x, &out) {
                        match x
                            .fill_async(feed(thread, round, 0), s.stream())
                            .map_err(|error| error.to_string())
                            .and_then(|()| s.synchronize().map_err(|error| error.to_string()))
                        {
                            Ok(()) => ready = true,
                            Err(error) => {
                                fail(format!("thread {thread} round {round}: fill x: {error}"))
                            }
                        }
                    }
                    barrier.wait();
                    let capture = if ready {
                        Some(StreamCapture::begin(s.stream(), CaptureOptions::default()))
                    } else {
                        None
                    };
                    let mut recorded = false;
                    if let (Some(Ok(capture)), Some(x), Some(out)) = (&capture, &x, &mut out) {
                        recorded = true;
                        if let Err(error) = out.copy_from_async(x, capture.stream()) {
                            recorded = false;
                            fail(format!(
                                "thread {thread} round {round}: the capture could not read x, \
                                 filled and synchronised before it began: {error}"
                            ));
                        }
                        let ptr = out.device_ptr();
                        let bumped =
                            // SAFETY: `out` holds N u32s and outlives every launch of the graph.
                            unsafe { kernels.increment_u32(capture.stream(), ptr, N) };
                        if let Err(error) = bumped {
                            recorded = false;
                            fail(format!("thread {thread} round {round}: bump: {error}"));
                        }
                    }
                    // Every thread holds its capture open here until all have begun theirs.
                    barrier.wait();
                    let capture = match capture {
                        Some(Ok(capture)) => capture,
                        Some(Err(error)) => {
                            fail(format!("thread {thread} round {round}: begin: {error}"));
                            continue;
                        }
                        None => continue,
                    };
                    let graph = match capture.finish() {
                        Ok(graph) => graph,
                        Err(error) => {
                            fail(format!("thread {thread} round {round}: finish: {error}"));
                            continue;
                        }
                    };
                    if let (true, Some(x), Some(out)) = (recorded, &mut x, &out)
                        && let Err(error) =
                            replay_checked(&graph, &s, x, out, (thread, round), REPLAYS)
                    {
                        fail(format!("thread {thread} round {round}: {error}"));
                    }
                    drop(graph);
                }
                if let Err(error) = s.synchronize() {
                    fail(format!("thread {thread}: final sync: {error}"));
                }
            });
        }
    });
    let failures = failures.into_inner().expect("failures");
    assert!(
        failures.is_empty(),
        "{} of {} captures failed; the first ones: {:#?}",
        failures.len(),
        THREADS * ROUNDS,
        &failures[..failures.len().min(6)]
    );
    context.synchronize().expect("sync");
    allocator.empty_cache().expect("empty");
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
}
