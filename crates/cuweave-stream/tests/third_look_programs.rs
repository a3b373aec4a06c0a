//! A third look at the stream crate through programs PyTorch users write, aimed at what the
//! earlier program files leave out:
//!
//! - `torch.profiler` over a `make_graphed_callables`-style step whose graph forks a side
//!   branch: each profiled graph launch lasts as long as its longest branch, not their sum, and
//!   the report counts graph launches exactly;
//! - a graph's static output dropped eagerly after the capture while the graph keeps replaying
//!   (`del static_out` with the graph alive): eager allocations never get that memory;
//! - stream-ordered memory handed on from `b` to `c` (`c` waits on `b`, which waited on the
//!   owner): the owner's free waits for `c`'s late reader too;
//! - stream-ordered scratch given to a side branch inside a capture with
//!   `add_stream_dependency`, replayed 500 times;
//! - a graph replayed on a high-priority pool stream (`torch.cuda.Stream(priority=-1)`) overtakes
//!   a low-priority backlog: graph kernels take the launching stream's priority;
//! - `MultiStreamCoordinator::execute_parallel` closures that each capture their own graph
//!   (one private pool each) and, after a barrier, replay it;
//! - GPU-timed profiles of compute and mixed work fed to `optimize_configuration`;
//! - ten thousand `with torch.cuda.stream(side)` steps with stream-ordered memory and
//!   coordinator dependencies: exact sums and bounded books.
//!
//! Ordering is proven by bytes kernels write, times by GPU timing events or the kernels' own
//! `%globaltimer` stamps. Every GPU test takes `serial()`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuweave_driver::memory::copy_dtod_async;
use cuweave_driver::{Context, InstantiateOptions};
use cuweave_memory::caching::CachingAllocator;
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_stream::capture::CaptureOptions;
use cuweave_stream::{
    MultiStreamCoordinator, OperationKind, PriorityStream, StreamOrderedAllocator, StreamPool,
    StreamPoolConfig, StreamPriority, StreamProfiler, WorkloadType,
};
use cuweave_test_support::host_flags::HostFlags;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{poll_until, require_gpu, sanitizer_active, serial, skip};

const MS: u64 = 1_000_000;

fn normal_stream(context: &Arc<Context>) -> Arc<PriorityStream> {
    Arc::new(PriorityStream::new(context, StreamPriority::Normal).expect("stream"))
}

fn has_pools(gpu: &cuweave_test_support::Gpu, test: &str) -> bool {
    if gpu.device.supports_memory_pools().unwrap_or(false) {
        true
    } else {
        skip(test, "the device has no stream-ordered memory pools");
        false
    }
}

fn under_sanitizer(test: &str, why: &str) -> bool {
    cuweave_test_support::skip_under_sanitizer(test, why)
}

// ---------------------------------------------------------------------------------------------
// The profiler over a fork/join graph
// ---------------------------------------------------------------------------------------------

/// A graphed step whose capture forks a side stream: the origin spins 8 ms, the side branch
/// spins 8 ms beside it and counts itself, then the origin counts itself after the join. Ten
/// launches profiled as `torch.profiler` would (`StreamProfiler::profile` around
/// `launch_graph`).
///
/// Expected: each profiled launch lasts one spin (8 ms, well under the 16 ms the branches would
/// take in sequence), the report counts ten graph launches and no kernel launches under the one
/// name, the launches on one stream do not overlap, and both counters read 10.
#[test]
fn a_fork_join_graph_profiled_per_launch_lasts_its_longest_branch_not_the_sum() {
    let name = "a_fork_join_graph_profiled_per_launch_lasts_its_longest_branch_not_the_sum";
    let gpu = require_gpu!();
    let _serial = serial();
    if under_sanitizer(name, "needs the graph's two branches to run at once") {
        return;
    }
    const SPIN: u64 = 8 * MS;
    const LAUNCHES: u64 = 10;
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let main = normal_stream(context);
    let side = normal_stream(context);
    let counters = DeviceBuffer::<u32>::zeroed(context, 2).expect("counters");
    let counters_ptr = counters.device_ptr();

    let mut capture = main
        .begin_capture(CaptureOptions::default())
        .expect("begin");
    // Forked before the origin's spin: the side branch depends only on what came before.
    capture.fork(side.stream()).expect("fork");
    kernels.spin_ns(main.stream(), SPIN).expect("main spin");
    kernels.spin_ns(side.stream(), SPIN).expect("side spin");
    // SAFETY: `counters` holds two u32s and outlives the graph; written only by the graph.
    unsafe { kernels.increment_u32(side.stream(), counters_ptr + 4, 1) }.expect("side count");
    capture.join(side.stream()).expect("join");
    // SAFETY: as above.
    unsafe { kernels.increment_u32(main.stream(), counters_ptr, 1) }.expect("main count");
    let graph = capture.finish().expect("finish");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");

    let profiler = StreamProfiler::new(context).expect("profiler");
    for _ in 0..LAUNCHES {
        profiler
            .profile(&main, "graphed_step", OperationKind::GraphLaunch, 0, |s| {
                s.launch_graph(&exec)
            })
            .expect("profiled launch");
    }
    main.synchronize().expect("sync");
    let operations = profiler.operations().expect("operations");
    assert_eq!(operations.len() as u64, LAUNCHES);
    for (i, op) in operations.iter().enumerate() {
        assert_eq!(op.kind, OperationKind::GraphLaunch);
        assert_eq!(op.stream, main.id());
        assert!(
            (SPIN * 9 / 10..SPIN * 3 / 2).contains(&op.duration_ns),
            "launch {i}: a graph of two parallel {SPIN} ns branches took {} ns (in sequence they \
             take {} ns)",
            op.duration_ns,
            2 * SPIN
        );
    }
    let report = profiler.report().expect("report");
    assert_eq!(report.streams.len(), 1);
    let stream = &report.streams[0];
    assert_eq!(stream.graph_launches, LAUNCHES);
    assert_eq!(stream.kernel_launches, 0);
    assert_eq!(stream.by_name.len(), 1);
    assert_eq!(stream.by_name[0].name, "graphed_step");
    assert_eq!(stream.by_name[0].count, LAUNCHES);
    assert_eq!(report.combined.graph_launches, LAUNCHES);
    assert!(
        report.combined.overlap_ns < MS,
        "launches on one stream overlapped by {} ns",
        report.combined.overlap_ns
    );
    assert_eq!(main.metrics().expect("metrics").graph_launches, LAUNCHES);
    assert_eq!(
        counters.to_vec().expect("counters"),
        vec![LAUNCHES as u32, LAUNCHES as u32],
        "every launch ran both branches once"
    );
    drop((exec, graph));
}

// ---------------------------------------------------------------------------------------------
// A graph's static output dropped eagerly while the graph lives
// ---------------------------------------------------------------------------------------------

/// `static_out = model(static_in)` captured, then `del static_out` while the graph is kept and
/// replayed (the result is read from a copy the graph also writes). The dropped block was
/// allocated in the capture: every replay still writes it, so it must stay the graph's.
///
/// 300 rounds of: replay, then eager allocations of the same size and of a quarter of it on the
/// replay stream and on another stream, each filled with the round number. Expected: no eager
/// range overlaps the dropped output; each round's eager buffers read back their fill and the
/// graph's copy reads `2x + 1` exactly.
#[test]
fn a_graph_output_dropped_eagerly_after_capture_is_never_handed_to_eager_allocations() {
    let gpu = require_gpu!();
    let _serial = serial();
    const N: usize = 1 << 16;
    const BYTES: usize = N * 4;
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let main = normal_stream(context);
    let other = normal_stream(context);
    let s = main.stream();
    let values: Vec<f32> = (0..N).map(|i| (i % 1000) as f32 - 500.0).collect();
    let x = DeviceBuffer::<f32>::from_slice(context, &values).expect("x");
    let result = DeviceBuffer::<f32>::zeroed(context, N).expect("result");
    let (x_ptr, result_ptr) = (x.device_ptr(), result.device_ptr());

    let capture = main
        .begin_capture(CaptureOptions::default())
        .expect("begin");
    let out = allocator.allocate(BYTES, s).expect("static output");
    // SAFETY: `out` holds N f32s (graph memory), `x` and `result` N f32s each, alive for the
    // graph; all ordered on `s`.
    unsafe {
        kernels
            .fill_u32(s, out.ptr(), 1.0f32.to_bits(), N)
            .expect("fill");
        kernels
            .saxpy_f32(s, 2.0, x_ptr, out.ptr(), N)
            .expect("saxpy");
        copy_dtod_async(result_ptr, out.ptr(), BYTES, s).expect("copy");
    }
    let graph = capture.finish().expect("finish");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");
    let (out_start, out_end) = (out.ptr(), out.ptr() + BYTES as u64);
    drop(out); // `del static_out`: the graph still writes it on every replay

    let overlaps = |ptr: u64, bytes: usize| ptr < out_end && out_start < ptr + bytes as u64;
    for round in 0..300u32 {
        main.launch_graph(&exec).expect("replay");
        let mut eager = Vec::new();
        for (stream, bytes) in [
            (&main, BYTES),
            (&main, BYTES / 4),
            (&other, BYTES),
            (&other, BYTES / 4),
        ] {
            let block = allocator.allocate(bytes, stream.stream()).expect("eager");
            assert!(
                !overlaps(block.ptr(), bytes),
                "round {round}: an eager block of {bytes} bytes at {:#x} lies in the dropped \
                 graph output [{out_start:#x}, {out_end:#x})",
                block.ptr()
            );
            // SAFETY: the block holds bytes/4 u32s, ordered on its own stream.
            unsafe { kernels.fill_u32(stream.stream(), block.ptr(), round, bytes / 4) }
                .expect("eager fill");
            eager.push((stream, block, bytes));
        }
        if round % 50 == 0 || round == 299 {
            main.synchronize().expect("sync main");
            other.synchronize().expect("sync other");
            for (_, block, bytes) in &eager {
                let mut host = vec![0u32; bytes / 4];
                // SAFETY: the block holds bytes/4 u32s whose writers were synchronised.
                unsafe {
                    cuweave_driver::memory::copy_dtoh(
                        context,
                        host.as_mut_ptr().cast(),
                        block.ptr(),
                        *bytes,
                    )
                }
                .expect("read eager");
                assert!(
                    host.iter().all(|&v| v == round),
                    "round {round}: an eager block lost its fill"
                );
            }
            let got = result.to_vec().expect("result");
            for (i, (&g, &v)) in got.iter().zip(&values).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    (2.0 * v + 1.0).to_bits(),
                    "round {round}: result[{i}]"
                );
            }
        }
        drop(eager);
    }
    main.synchronize().expect("sync");
    other.synchronize().expect("sync");
    drop((exec, graph));
}

// ---------------------------------------------------------------------------------------------
// Stream-ordered memory handed on
// ---------------------------------------------------------------------------------------------

/// RMM-style hand-off in two hops: `a` allocates and fills, `b` waits on `a`
/// (`add_stream_dependency(b, a)`), `c` waits on `b` (`add_stream_dependency(c, b)`) and so may
/// use what `b` may, and `c` watches the block for 200 ms. `a` frees it right away, and `d`
/// allocates the same size and fills it at once.
///
/// Expected: the free on `a` waits for `c` (given the block through `b`), so the watch never
/// sees `d`'s fill: zero mismatches in each of three rounds; the books balance.
#[test]
fn stream_ordered_memory_handed_on_from_b_to_c_is_freed_only_after_c_is_done() {
    let name = "stream_ordered_memory_handed_on_from_b_to_c_is_freed_only_after_c_is_done";
    let gpu = require_gpu!();
    let _serial = serial();
    if under_sanitizer(name, "needs d's fill to run beside c's watch") || !has_pools(&gpu, name) {
        return;
    }
    const N: usize = 1 << 20;
    const EXPECTED: u32 = 0x5EED_0001;
    const OTHER: u32 = 0xBAD0_0002;
    const ROUNDS: usize = 3;
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = StreamOrderedAllocator::default();
    let [a, b, c, d] = [(); 4].map(|_| normal_stream(context));
    let mismatches = DeviceBuffer::<u32>::zeroed(context, ROUNDS).expect("mismatches");

    let mut reuses = 0;
    for round in 0..ROUNDS {
        let block = allocator.allocate_for_stream(&a, N * 4).expect("allocate");
        let ptr = allocator.device_ptr(&block).expect("ptr");
        // SAFETY: the block holds N u32s, used on its owner.
        a.launch(|s| unsafe { kernels.fill_u32(s, ptr, EXPECTED, N) })
            .expect("fill");
        allocator.add_stream_dependency(&b, &a).expect("b after a");
        allocator.add_stream_dependency(&c, &b).expect("c after b");
        let slot = mismatches.device_ptr() + 4 * round as u64;
        // SAFETY: `c` is ordered after the fill through `b`; the block stays mapped (its free
        // waits for `c`), and `slot` is one u32 of `mismatches`, alive until synchronised.
        c.launch(|s| unsafe { kernels.watch_u32(s, ptr, N, EXPECTED, 200 * MS, slot) })
            .expect("watch");
        allocator.free(block).expect("free on a");
        let next = allocator.allocate_for_stream(&d, N * 4).expect("next");
        let next_ptr = allocator.device_ptr(&next).expect("next ptr");
        reuses += usize::from(next_ptr == ptr);
        // SAFETY: `next` holds N u32s, used on its owner.
        d.launch(|s| unsafe { kernels.fill_u32(s, next_ptr, OTHER, N) })
            .expect("fill next");
        allocator.free(next).expect("free next");
        for stream in [&a, &b, &c, &d] {
            stream.synchronize().expect("sync");
        }
        assert!(
            allocator.dependencies_satisfied(&c).expect("satisfied"),
            "round {round}: the GPU is past every wait once all streams synchronised"
        );
    }
    let seen = mismatches.to_vec().expect("mismatches");
    assert_eq!(
        seen,
        vec![0; ROUNDS],
        "c's watch saw d's fill: the owner's free did not wait for the stream given the block \
         through b ({reuses} of {ROUNDS} rounds gave d the same address)"
    );
    let stats = allocator.stats();
    assert_eq!(stats.allocations, 2 * ROUNDS as u64);
    assert_eq!(stats.frees, 2 * ROUNDS as u64);
    assert_eq!(stats.live, 0);
    assert_eq!(stats.dependencies, 2 * ROUNDS as u64);
    assert_eq!(allocator.outstanding(), 0);
}

/// `torch.cuda.graph` around a step whose scratch comes from the stream-ordered allocator and is
/// handed to a side branch inside the capture: the origin allocates it and copies the static
/// input in, `add_stream_dependency(side, origin)` forks `side` into the capture, `side` spins
/// 1 ms and increments the scratch, the origin joins `side`, copies the scratch out and frees it
/// (a free node after the join). The graph also bumps the static input first.
///
/// Expected: after replay `r` (from 1) the output is `x0 + r + 1` everywhere (the side
/// branch's increment always lands between the copies), over 500 replays; the allocator's books
/// are clean once the capture ends.
#[test]
fn stream_ordered_scratch_given_to_a_side_branch_inside_a_capture_replays_500_times() {
    let name = "stream_ordered_scratch_given_to_a_side_branch_inside_a_capture_replays_500_times";
    let gpu = require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    const N: usize = 1 << 14;
    let replays: u32 = if sanitizer_active() { 50 } else { 500 };
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = StreamOrderedAllocator::default();
    let main = normal_stream(context);
    let side = normal_stream(context);
    let x0: Vec<u32> = (0..N as u32)
        .map(|i| i.wrapping_mul(2654435761) >> 8)
        .collect();
    let x = DeviceBuffer::<u32>::from_slice(context, &x0).expect("x");
    let out = DeviceBuffer::<u32>::zeroed(context, N).expect("out");
    let (x_ptr, out_ptr) = (x.device_ptr(), out.device_ptr());
    // Warm the allocator's pool eagerly, as the torch recipe's warm-up does.
    let warm = allocator.allocate_for_stream(&main, N * 4).expect("warm");
    allocator.free(warm).expect("free warm");
    main.synchronize().expect("sync");

    let mut capture = main
        .begin_capture(CaptureOptions::default())
        .expect("begin");
    let m = main.stream();
    // SAFETY: `x` holds N u32s, alive for the graph; ordered on `m`.
    unsafe { kernels.increment_u32(m, x_ptr, N) }.expect("bump x");
    let scratch = allocator
        .allocate_for_stream(&main, N * 4)
        .expect("captured scratch");
    let sp = allocator.device_ptr(&scratch).expect("scratch ptr");
    // SAFETY: both ranges hold N u32s; ordered on `m`.
    unsafe { copy_dtod_async(sp, x_ptr, N * 4, m) }.expect("scratch = x");
    allocator
        .add_stream_dependency(&side, &main)
        .expect("side joins the capture");
    kernels.spin_ns(side.stream(), MS).expect("side spin");
    // SAFETY: `side` is ordered after the copy (a graph edge); the scratch holds N u32s.
    unsafe { kernels.increment_u32(side.stream(), sp, N) }.expect("scratch += 1");
    capture.join(side.stream()).expect("join");
    // SAFETY: ordered after the side branch by the join; both ranges hold N u32s.
    unsafe { copy_dtod_async(out_ptr, sp, N * 4, m) }.expect("out = scratch");
    allocator.free(scratch).expect("free inside the capture");
    assert_eq!(allocator.outstanding(), 0, "the captured scratch is freed");
    let graph = capture.finish().expect("finish");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");

    for replay in 1..=replays {
        main.launch_graph(&exec).expect("replay");
        if replay % 100 == 0 || replay == replays {
            main.synchronize().expect("sync");
            let got = out.to_vec().expect("out");
            if let Some(i) = (0..N).find(|&i| got[i] != x0[i] + replay + 1) {
                panic!(
                    "replay {replay}: out[{i}] is {}, expected {} (x0 + replay + 1)",
                    got[i],
                    x0[i] + replay + 1
                );
            }
        }
    }
    let stats = allocator.stats();
    assert_eq!(stats.allocations, 2, "the warm-up and the captured scratch");
    assert_eq!(stats.frees, 2);
    assert_eq!(stats.live, 0);
    assert_eq!(
        main.metrics().expect("metrics").graph_launches,
        u64::from(replays)
    );
    drop((exec, graph));
}

// ---------------------------------------------------------------------------------------------
// Priorities and pools
// ---------------------------------------------------------------------------------------------

/// A step graphed on a high-priority pool stream, replayed while a low-priority pool stream
/// holds a backlog of 100 000 blocks of 100 µs. The host waits until the backlog's stream
/// reached it (a kernel just before it stores a flag in mapped memory), then launches the graph.
///
/// Expected: a graph launched into a stream runs its kernels at that stream's priority, so its
/// one-block 10 µs spin ends well before the backlog drains (`%globaltimer` stamps).
#[test]
fn a_graph_replayed_on_a_high_priority_pool_stream_overtakes_a_low_priority_backlog() {
    let name = "a_graph_replayed_on_a_high_priority_pool_stream_overtakes_a_low_priority_backlog";
    let gpu = require_gpu!();
    let _serial = serial();
    if under_sanitizer(name, "needs the two streams' kernels to run at once") {
        return;
    }
    let context = &gpu.context;
    let pool = StreamPool::new(context, StreamPoolConfig::default()).expect("pool");
    let high = pool
        .get_priority_stream(StreamPriority::High)
        .expect("high");
    let low = pool.get_priority_stream(StreamPriority::Low).expect("low");
    if high.driver_priority() >= low.driver_priority() {
        skip(name, "the device has a single stream priority");
        return;
    }
    let stamped = StreamKernels::load(context).expect("stream kernels");
    let kernels = TestKernels::load(context).expect("kernels");
    let high_stamps = DeviceBuffer::<u64>::from_slice(context, &[u64::MAX, 0]).expect("stamps");
    let low_stamps = DeviceBuffer::<u64>::from_slice(context, &[u64::MAX, 0]).expect("stamps");
    let flags = HostFlags::new(context, 1);

    let capture = high
        .begin_capture(CaptureOptions::default())
        .expect("begin");
    // SAFETY: `high_stamps` holds two u64s and outlives the graph's launch (synchronised below).
    unsafe { stamped.spin_stamped(high.stream(), 10_000, 1, high_stamps.device_ptr()) }
        .expect("captured spin");
    let graph = capture.finish().expect("finish");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");

    // SAFETY: the flag word is mapped pinned memory of this context, alive until the end.
    low.launch(|s| unsafe { kernels.spin_then_store_u32(s, 0, flags.device(0), 1) })
        .expect("flag");
    // SAFETY: `low_stamps` holds two u64s, alive until synchronised.
    low.launch(|s| unsafe { stamped.spin_stamped(s, 100_000, 100_000, low_stamps.device_ptr()) })
        .expect("backlog");
    assert!(
        poll_until(Duration::from_secs(10), || flags.read(0) == 1),
        "the low-priority stream never reached its backlog"
    );
    high.launch_graph(&exec).expect("replay");
    high.synchronize().expect("sync high");
    low.synchronize().expect("sync low");
    let (h, l) = (
        high_stamps.to_vec().expect("high"),
        low_stamps.to_vec().expect("low"),
    );
    let low_span = l[1] - l[0];
    assert!(l[0] < h[0], "the backlog started first");
    assert!(
        h[1] + low_span / 4 < l[1],
        "the graph on the high-priority stream ended {} ns before a {low_span} ns low-priority \
         backlog drained: it did not overtake it",
        l[1].saturating_sub(h[1])
    );
    drop((exec, graph));
}

/// `execute_parallel` as a data-parallel program uses it: on each of the pool's four normal
/// streams, its own thread fills a static input with the stream's index, captures a step
/// (a temporary from the shared caching allocator: `tmp = in; tmp += 1; in = tmp`) into the
/// capture's own private pool and keeps the executable. After a barrier over the four streams, a
/// second `execute_parallel` replays each graph 100 times.
///
/// Expected: four distinct private pools; every input reads `index + 100` exactly; each stream
/// counted 100 graph launches.
#[test]
fn execute_parallel_closures_capture_their_own_graphs_and_replay_them_after_a_barrier() {
    let gpu = require_gpu!();
    let _serial = serial();
    const N: usize = 1 << 14;
    const REPLAYS: u32 = 100;
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let pool = StreamPool::new(context, StreamPoolConfig::default()).expect("pool");
    let streams: Vec<Arc<PriorityStream>> = pool.streams_of(StreamPriority::Normal).to_vec();
    let index: HashMap<u64, u32> = streams
        .iter()
        .enumerate()
        .map(|(i, s)| (s.id(), i as u32))
        .collect();
    let inputs: Vec<DeviceBuffer<u32>> = streams
        .iter()
        .map(|_| DeviceBuffer::<u32>::zeroed(context, N).expect("input"))
        .collect();
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let execs = Mutex::new(HashMap::new());
    let pool_ids = Mutex::new(Vec::new());

    coordinator
        .execute_parallel(|stream| {
            let i = index[&stream.id()];
            let input = inputs[i as usize].device_ptr();
            let s = stream.stream();
            // SAFETY: `input` holds N u32s, used only on this stream.
            unsafe { kernels.fill_u32(s, input, i, N) }?;
            stream.synchronize()?;
            let capture = stream.begin_capture(CaptureOptions::default())?;
            pool_ids.lock().unwrap().push(capture.pool().id());
            let tmp = allocator.allocate(N * 4, s)?;
            // SAFETY: `tmp` (graph memory) and `input` hold N u32s; ordered on `s`.
            unsafe {
                copy_dtod_async(tmp.ptr(), input, N * 4, s)?;
                kernels.increment_u32(s, tmp.ptr(), N)?;
                copy_dtod_async(input, tmp.ptr(), N * 4, s)?;
            }
            drop(tmp);
            let exec = capture
                .finish()?
                .instantiate(&InstantiateOptions::default())?;
            execs.lock().unwrap().insert(stream.id(), exec);
            Ok(())
        })
        .expect("every stream captured its step");
    coordinator.create_barrier().expect("barrier");
    let execs = execs.into_inner().unwrap();
    coordinator
        .execute_parallel(|stream| {
            let exec = &execs[&stream.id()];
            for _ in 0..REPLAYS {
                stream.launch_graph(exec)?;
            }
            stream.synchronize()
        })
        .expect("every stream replayed its graph");

    let mut ids = pool_ids.into_inner().unwrap();
    ids.sort_by_key(|id| id.as_u32());
    ids.dedup();
    assert_eq!(ids.len(), streams.len(), "each capture got its own pool");
    for (i, input) in inputs.iter().enumerate() {
        let got = input.to_vec().expect("input");
        let expected = i as u32 + REPLAYS;
        assert!(
            got.iter().all(|&v| v == expected),
            "stream {i}: expected every element {expected}, first is {}",
            got[0]
        );
        assert_eq!(
            streams[i].metrics().expect("metrics").graph_launches,
            u64::from(REPLAYS)
        );
    }
    assert_eq!(coordinator.stats().parallel_runs, 2);
    assert_eq!(coordinator.stats().barriers, 1);
    drop(execs);
}

/// Workload times measured on the GPU, as a program tuning its pool would: six 3 ms compute
/// spins on the pool's compute streams and six 1 ms spins on its mixed streams, profiled; each
/// profiled duration is recorded with `record_workload_completion`.
///
/// Expected: the averages are about 3 ms and 1 ms; `optimize_configuration` moves the default
/// 2 + 2 split of the four normal streams to 3 compute + 1 mixed (3/4 of the time is compute),
/// after which compute work is handed only the three compute streams and mixed work the other.
#[test]
fn gpu_timed_workload_profiles_drive_optimize_configuration_to_a_three_to_one_split() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let pool = StreamPool::new(context, StreamPoolConfig::default()).expect("pool");
    assert_eq!(pool.layout().compute_streams, 2);
    // Warm-up: a lazily loaded kernel's first launch would put its load inside a timed span.
    for stream in pool.streams() {
        kernels.spin_ns(stream.stream(), 0).expect("warm-up");
        stream.synchronize().expect("sync");
    }
    let profiler = StreamProfiler::new(context).expect("profiler");
    for _ in 0..6 {
        for (workload, name, ns) in [
            (WorkloadType::Compute, "compute", 3 * MS),
            (WorkloadType::Mixed, "mixed", MS),
        ] {
            let stream = pool.get_stream_for_workload(workload).expect("stream");
            profiler
                .profile(&stream, name, OperationKind::KernelLaunch, 0, |s| {
                    s.launch(|st| kernels.spin_ns(st, ns))
                })
                .expect("profiled spin");
        }
    }
    for op in profiler.operations().expect("operations") {
        let workload = if op.name == "compute" {
            WorkloadType::Compute
        } else {
            WorkloadType::Mixed
        };
        pool.record_workload_completion(workload, Duration::from_nanos(op.duration_ns));
    }
    assert_eq!(pool.workload_count(WorkloadType::Compute), 6);
    assert_eq!(pool.workload_count(WorkloadType::Mixed), 6);
    let compute = pool
        .average_workload_time(WorkloadType::Compute)
        .expect("compute average");
    let mixed = pool
        .average_workload_time(WorkloadType::Mixed)
        .expect("mixed average");
    assert!(
        (Duration::from_micros(2_900)..Duration::from_micros(3_600)).contains(&compute),
        "3 ms spins averaged {compute:?}"
    );
    assert!(
        (Duration::from_micros(900)..Duration::from_micros(1_600)).contains(&mixed),
        "1 ms spins averaged {mixed:?}"
    );

    let change = pool.optimize_configuration();
    assert!(change.changed());
    assert_eq!(change.before.compute_streams, 2);
    assert_eq!(change.after.compute_streams, 3);
    let compute_set: Vec<u64> = pool
        .workload_streams(WorkloadType::Compute)
        .expect("compute set")
        .iter()
        .map(|s| s.id())
        .collect();
    let mixed_set: Vec<u64> = pool
        .workload_streams(WorkloadType::Mixed)
        .expect("mixed set")
        .iter()
        .map(|s| s.id())
        .collect();
    assert_eq!(compute_set.len(), 3);
    assert_eq!(mixed_set.len(), 1);
    assert!(compute_set.iter().all(|id| !mixed_set.contains(id)));
    let mut handed = Vec::new();
    for _ in 0..6 {
        let stream = pool
            .get_stream_for_workload(WorkloadType::Compute)
            .expect("compute");
        assert!(compute_set.contains(&stream.id()));
        handed.push(stream.id());
        let stream = pool
            .get_stream_for_workload(WorkloadType::Mixed)
            .expect("mixed");
        assert_eq!(stream.id(), mixed_set[0]);
    }
    handed.sort_unstable();
    handed.dedup();
    assert_eq!(handed.len(), 3, "compute work cycles over all three");
    for stream in pool.streams() {
        stream.synchronize().expect("sync");
    }
}

// ---------------------------------------------------------------------------------------------
// A long loop
// ---------------------------------------------------------------------------------------------

/// Ten thousand steps of `with torch.cuda.stream(side): side.wait_stream(main); ...;
/// main.wait_stream(side)` with stream-ordered memory: `main` allocates a 4 KiB block and fills
/// it with the step number, the coordinator makes `side` wait on `main`, the allocator gives the
/// block to `side`, `side` adds the block into a running sum, the coordinator makes `main` wait
/// on `side`, and `main` frees the block.
///
/// Expected: the sum is exactly `1024 · Σ step`; the coordinator counted every dependency but
/// keeps two edges (a ping-pong cycle, reported, not refused) and two streams; the allocator's
/// books are exact and empty; its pool's reserve and the event pool stay where step 100 left
/// them.
#[test]
fn ten_thousand_side_stream_steps_keep_sums_exact_and_the_books_bounded() {
    let name = "ten_thousand_side_stream_steps_keep_sums_exact_and_the_books_bounded";
    let gpu = require_gpu!();
    let _serial = serial();
    if !has_pools(&gpu, name) {
        return;
    }
    let steps: u64 = if sanitizer_active() { 500 } else { 10_000 };
    const WORDS: usize = 1024;
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = StreamOrderedAllocator::default();
    let coordinator = MultiStreamCoordinator::new();
    let main = normal_stream(context);
    let side = normal_stream(context);
    let sum = DeviceBuffer::<u64>::zeroed(context, 1).expect("sum");
    let sum_ptr = sum.device_ptr();
    let events = main.event_pool().clone();
    let mut at_100 = None;

    for step in 0..steps {
        let block = allocator
            .allocate_for_stream(&main, WORDS * 4)
            .expect("allocate");
        let ptr = allocator.device_ptr(&block).expect("ptr");
        // SAFETY: the block holds WORDS u32s, used on its owner.
        main.launch(|s| unsafe { kernels.fill_u32(s, ptr, step as u32, WORDS) })
            .expect("fill");
        coordinator
            .add_dependency(&side, &main)
            .expect("side after main");
        allocator
            .add_stream_dependency(&side, &main)
            .expect("give the block to side");
        // SAFETY: `side` is ordered after the fill; `sum` is one u64 used only on `side`.
        side.launch(|s| unsafe { kernels.checksum_u32(s, ptr, WORDS, sum_ptr) })
            .expect("sum");
        coordinator
            .add_dependency(&main, &side)
            .expect("main after side");
        allocator.free(block).expect("free");
        if step == 99 {
            main.synchronize().expect("sync");
            side.synchronize().expect("sync");
            at_100 = Some((
                allocator.reserved_bytes(0).expect("reserved"),
                events.counters().created_regular,
            ));
        }
    }
    main.synchronize().expect("sync");
    side.synchronize().expect("sync");
    let expected = WORDS as u64 * (steps * (steps - 1) / 2);
    assert_eq!(sum.to_vec().expect("sum"), vec![expected]);

    let stats = coordinator.stats();
    assert_eq!(stats.dependencies, 2 * steps);
    assert_eq!(coordinator.streams().len(), 2);
    assert_eq!(coordinator.dependencies().len(), 2);
    assert!(coordinator.has_cycles(), "ping-pong is a reported cycle");

    let books = allocator.stats();
    assert_eq!(books.allocations, steps);
    assert_eq!(books.frees, steps);
    assert_eq!(books.live, 0);
    assert_eq!(books.dependencies, steps);
    assert_eq!(allocator.outstanding(), 0);
    assert!(allocator.dependencies_satisfied(&side).expect("satisfied"));

    let (reserved, created) = at_100.expect("step 100");
    let reserved_now = allocator.reserved_bytes(0).expect("reserved");
    assert!(
        reserved_now <= reserved + (2 << 20),
        "the pool grew from {reserved} bytes at step 100 to {reserved_now}"
    );
    let grown = events.counters().created_regular - created;
    assert!(
        grown <= 1200,
        "the event pool made {grown} more events after step 100"
    );
}
