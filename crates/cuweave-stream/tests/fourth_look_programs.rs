//! A fourth look at the stream crate through programs PyTorch and RMM users write, aimed at
//! what the earlier program files leave out:
//!
//! - a coordinator barrier over the streams of one capture (graph edges, proven by a side
//!   branch that spins before it writes) and one across the capture's boundary (a typed
//!   refusal that leaves the capture and the coordinator as they were);
//! - typed scratch read on a forked branch and dropped on the origin before the join, with a
//!   new scratch taken right after: the graph must not alias the two;
//! - a stream-ordered typed buffer allocated and dropped inside a capture, replayed 10^4 times;
//! - 10^4 replays fed through one pinned input buffer, with bounded events, uses and memory;
//! - eight threads racing to capture on round-robin pool streams: refusals are typed;
//! - `execute_parallel` captures of which one is broken by a raw call: one typed failure, the
//!   other graphs exact, every byte of scratch returned;
//! - a profiler with a small limit over 10^4 graph replays;
//! - four threads in a long loop over a load-balanced pool with typed buffers: exact, bounded.
//!
//! Ordering is proven by bytes kernels write. Every GPU test takes `serial()` (through the
//! graph fixture or directly).

mod common;

use std::sync::{Arc, Barrier, Mutex};

use common::Kit;
use common::graph::{MS, assert_exact, bits, fixture, graph_error, settled};
use cuweave_driver::graph::{Graph, GraphError, GraphExec};
use cuweave_driver::memory::copy_dtod_async;
use cuweave_driver::{Context, InstantiateOptions};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer};
use cuweave_stream::capture::{CaptureOptions, StreamCapture};
use cuweave_stream::{
    AllocationStrategy, MultiStreamCoordinator, OperationKind, PriorityStream, StreamError,
    StreamOrderedAllocator, StreamPool, StreamPoolConfig, StreamPriority, StreamProfiler,
};
use cuweave_test_support::outside_capture::{raw_mem_alloc, raw_mem_free};
use cuweave_test_support::{require_gpu, resident_bytes, sanitizer_active, serial, skip};

fn normal_stream(context: &Arc<Context>) -> Arc<PriorityStream> {
    Arc::new(PriorityStream::new(context, StreamPriority::Normal).expect("stream"))
}

fn input(round: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 31 + round * 7919) % 4001) as f32 - 2000.0)
        .collect()
}

/// Ends `capture` (`what` says why it must end well) and instantiates its graph with plain
/// options.
fn finish(capture: StreamCapture<'_>, what: &str) -> (Graph, GraphExec) {
    let graph = capture.finish().expect(what);
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");
    (graph, exec)
}

/// Runs `work(t)` for `t` in `0..threads`, each on a scoped thread of its own, all at once;
/// their results in order of `t`.
fn on_threads<R: Send>(threads: usize, work: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let work = &work;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads).map(|t| scope.spawn(move || work(t))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `count` zeroed buffers of `n` u32s on `context`.
fn zeroed_buffers(context: &Arc<Context>, count: usize, n: usize) -> Vec<DeviceBuffer<u32>> {
    (0..count)
        .map(|_| DeviceBuffer::<u32>::zeroed(context, n).expect("buffer"))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Barriers and captures
// ---------------------------------------------------------------------------------------------

/// `torch.cuda.graph` around a step that syncs its side stream with a coordinator barrier (the
/// way a library written for eager multi-stream code behaves when captured): the origin forks a
/// pool stream that spins 2 ms and then writes 7 into `out`; a barrier over {origin, side};
/// the origin then copies `out` into `res`. In the same capture a second coordinator that also
/// holds an eager pool stream is asked for a barrier.
///
/// Expected: the mixed barrier is a typed `Capturing` refusal, counted nowhere, and the capture
/// survives it; the inner barrier is two graph edges, so every one of 20 replays (after `out`
/// and `res` are zeroed) copies 7, never the 0 the copy would see without the edge. After the
/// capture the mixed barrier is accepted and the eager stream round-trips bytes.
#[test]
fn a_barrier_inside_a_capture_orders_its_branches_and_one_across_its_boundary_is_refused() {
    let name =
        "a_barrier_inside_a_capture_orders_its_branches_and_one_across_its_boundary_is_refused";
    let Some(fx) = fixture(name) else {
        return;
    };
    const N: usize = 1 << 12;
    let context = &fx.gpu.context;
    let pool = StreamPool::new(context, StreamPoolConfig::default()).expect("pool");
    let normals = pool.streams_of(StreamPriority::Normal);
    assert!(
        normals.len() >= 3,
        "the default pool has several normal streams"
    );
    let (origin, side, eager) = (
        Arc::clone(&normals[0]),
        Arc::clone(&normals[1]),
        Arc::clone(&normals[2]),
    );
    let out = DeviceBuffer::<u32>::zeroed(context, N).expect("out");
    let res = DeviceBuffer::<u32>::zeroed(context, N).expect("res");
    let (out_ptr, res_ptr) = (out.device_ptr(), res.device_ptr());
    let inside = MultiStreamCoordinator::with_streams([Arc::clone(&origin), Arc::clone(&side)]);
    let across = MultiStreamCoordinator::with_streams([Arc::clone(&eager), Arc::clone(&origin)]);

    let mut capture = origin
        .begin_capture(CaptureOptions::default())
        .expect("begin");
    capture.fork(side.stream()).expect("fork");
    fx.kernels
        .spin_ns(side.stream(), 2 * MS)
        .expect("side spin");
    // SAFETY: `out` holds N u32s and outlives the graph; written by the graph only.
    unsafe { fx.kernels.fill_u32(side.stream(), out_ptr, 7, N) }.expect("side write");

    let refused = across
        .create_barrier()
        .expect_err("a barrier mixing an eager stream with a capturing one must be refused");
    assert!(
        matches!(graph_error(&refused), GraphError::Capturing { .. }),
        "{refused}"
    );
    assert!(refused.is_capture_refusal());
    assert_eq!(
        across.stats().barriers,
        0,
        "a refused barrier is not counted"
    );

    let info = inside.create_barrier().expect("barrier inside one capture");
    assert_eq!((info.streams, info.waits), (2, 2));
    // SAFETY: both hold N u32s, alive for the graph; ordered after the side write by the barrier.
    unsafe { copy_dtod_async(res_ptr, out_ptr, N * 4, origin.stream()) }.expect("copy");
    capture.join(side.stream()).expect("join");
    let (graph, exec) = finish(
        capture,
        "the refused barrier must not have broken the capture",
    );

    for round in 0..20 {
        // SAFETY: as above; ordered on `origin` before the replay.
        unsafe {
            fx.kernels
                .fill_u32(origin.stream(), out_ptr, 0, N)
                .expect("zero out");
            fx.kernels
                .fill_u32(origin.stream(), res_ptr, 0, N)
                .expect("zero res");
        }
        origin.launch_graph(&exec).expect("replay");
        origin.synchronize().expect("sync");
        let got = res.to_vec().expect("res");
        assert!(
            got.iter().all(|&v| v == 7),
            "round {round}: the copy after the captured barrier read {} (the side branch had \
             not written yet: the barrier is not a graph edge)",
            got.iter().find(|&&v| v != 7).unwrap()
        );
    }

    across
        .create_barrier()
        .expect("the same barrier once no capture runs");
    assert_eq!(across.stats().barriers, 1);
    let mut check = DeviceBuffer::<u32>::zeroed(context, N).expect("check");
    eager.fill(&mut check, 0xABCD).expect("eager fill");
    eager.synchronize().expect("sync eager");
    assert!(check.to_vec().expect("check").iter().all(|&v| v == 0xABCD));
    drop((exec, graph));
}

// ---------------------------------------------------------------------------------------------
// Scratch freed inside a capture while a forked branch still reads it
// ---------------------------------------------------------------------------------------------

/// `tmp = x.clone()` on the origin; a forked side stream spins 3 ms and computes
/// `side_out = 2·tmp + 1`; the origin then does `del tmp` and takes a new same-sized
/// `tmp2 = full(-1000)` and `main_out = tmp2`, before the side is joined. In the graph nothing
/// orders the origin's `tmp2` fill after the side's read of `tmp`, so the two must be
/// different memory.
///
/// Expected: across 50 replays with new inputs, `side_out` is exactly `2x + 1` and `main_out`
/// exactly -1000; once the graph is dropped the private allocator gives everything back.
#[test]
fn scratch_read_on_a_forked_branch_and_dropped_on_the_origin_is_not_reused_within_the_graph() {
    let name =
        "scratch_read_on_a_forked_branch_and_dropped_on_the_origin_is_not_reused_within_the_graph";
    let Some(fx) = fixture(name) else {
        return;
    };
    const N: usize = 1 << 16;
    let context = &fx.gpu.context;
    let kit = Kit::load(context, N);
    let (main, side) = (normal_stream(context), normal_stream(context));
    let (m, s) = (main.stream(), side.stream());
    let mut x = DeviceBuffer::<f32>::from_slice(context, &input(0, N)).expect("x");
    let mut side_out = DeviceBuffer::<f32>::zeroed(context, N).expect("side_out");
    let mut main_out = DeviceBuffer::<f32>::zeroed(context, N).expect("main_out");

    let mut capture = main
        .begin_capture(CaptureOptions::default())
        .expect("begin");
    let mut tmp = DeviceBuffer::<f32>::with_allocator(&fx.allocator, N, m).expect("tmp");
    kit.fill(m, &mut tmp, 0.0).expect("tmp = 0");
    kit.saxpy(m, 1.0, &x, &mut tmp).expect("tmp = x");
    capture.fork(s).expect("fork");
    fx.kernels.spin_ns(s, 3 * MS).expect("side spin");
    kit.fill(s, &mut side_out, 1.0).expect("side_out = 1");
    kit.saxpy(s, 2.0, &tmp, &mut side_out)
        .expect("side_out += 2 tmp");
    let tmp_range = (tmp.device_ptr(), tmp.device_ptr() + (N * 4) as u64);
    drop(tmp); // `del tmp` on the origin, the side's read not joined yet
    let mut tmp2 = DeviceBuffer::<f32>::with_allocator(&fx.allocator, N, m).expect("tmp2");
    let tmp2_ptr = tmp2.device_ptr();
    kit.fill(m, &mut tmp2, -1000.0).expect("tmp2 = -1000");
    kit.fill(m, &mut main_out, 0.0).expect("main_out = 0");
    kit.saxpy(m, 1.0, &tmp2, &mut main_out)
        .expect("main_out = tmp2");
    drop(tmp2);
    capture.join(s).expect("join");
    let (graph, exec) = finish(capture, "finish");
    assert!(
        !(tmp_range.0..tmp_range.1).contains(&tmp2_ptr),
        "tmp2 at {tmp2_ptr:#x} reuses tmp [{:#x}, {:#x}) while the side branch still reads it",
        tmp_range.0,
        tmp_range.1
    );

    for round in 1..=50 {
        let values = input(round, N);
        main.copy_from_host(&mut x, values.clone())
            .expect("new input")
            .wait()
            .expect("input copied");
        main.launch_graph(&exec).expect("replay");
        main.synchronize().expect("sync");
        assert_exact(
            &bits(&side_out.to_vec().expect("side_out")),
            |i| 2.0 * values[i] + 1.0,
            &format!("round {round}: side_out"),
        );
        assert_exact(
            &bits(&main_out.to_vec().expect("main_out")),
            |_| -1000.0,
            &format!("round {round}: main_out"),
        );
    }
    drop((exec, graph));
    assert_eq!(
        settled(&fx.allocator).reserved_bytes.current,
        0,
        "the graph's scratch went back once the graph was dropped"
    );
}

// ---------------------------------------------------------------------------------------------
// Stream-ordered typed scratch inside a capture
// ---------------------------------------------------------------------------------------------

/// PyTorch's `cudaMallocAsync` backend inside `torch.cuda.graph`, as RMM users write it: a
/// typed buffer from the stream-ordered allocator is allocated, filled with 3, added into a
/// static accumulator and dropped, all inside the capture. The graph is replayed 10^4 times.
///
/// Expected: the capture ends and instantiates with plain options; every replay allocates and
/// frees its own scratch, so the accumulator reads exactly `3 · 10^4` and the pool's reserve
/// after the loop is where the first replay left it.
#[test]
fn a_stream_ordered_typed_buffer_allocated_and_dropped_in_a_capture_replays_ten_thousand_times() {
    let name = "a_stream_ordered_typed_buffer_allocated_and_dropped_in_a_capture_replays_ten_thousand_times";
    let gpu = require_gpu!();
    let _serial = serial();
    if !gpu.device.supports_memory_pools().unwrap_or(false) {
        skip(name, "the device has no stream-ordered memory pools");
        return;
    }
    const N: usize = 1 << 14;
    let replays: u32 = if sanitizer_active() { 300 } else { 10_000 };
    let context = &gpu.context;
    let kit = Kit::load(context, N);
    let allocator = StreamOrderedAllocator::default();
    let main = normal_stream(context);
    let m = main.stream();
    let mut acc = DeviceBuffer::<f32>::zeroed(context, N).expect("acc");

    let capture = main
        .begin_capture(CaptureOptions::default())
        .expect("begin");
    let mut tmp = allocator
        .buffer::<f32>(&main, N)
        .expect("scratch in the capture");
    kit.fill(m, &mut tmp, 3.0).expect("tmp = 3");
    kit.saxpy(m, 1.0, &tmp, &mut acc).expect("acc += tmp");
    drop(tmp); // freed inside the capture: a graph free node, as `del tmp` is
    let (graph, exec) = finish(
        capture,
        "a capture that allocates and frees stream-ordered scratch ends",
    );

    main.launch_graph(&exec).expect("first replay");
    main.synchronize().expect("sync");
    let reserved = allocator.reserved_bytes(0).expect("reserved");
    for i in 1..replays {
        main.launch_graph(&exec)
            .unwrap_or_else(|e| panic!("replay {i}: {e}"));
    }
    main.synchronize().expect("sync");
    let expected = 3.0 * replays as f32;
    assert_exact(
        &bits(&acc.to_vec().expect("acc")),
        |_| expected,
        "accumulator",
    );
    let reserved_now = allocator.reserved_bytes(0).expect("reserved");
    assert!(
        reserved_now <= reserved + (2 << 20),
        "the pool grew from {reserved} to {reserved_now} bytes over the replays"
    );
    assert_eq!(
        main.metrics().expect("metrics").graph_launches,
        u64::from(replays)
    );
    drop((exec, graph));
}

// ---------------------------------------------------------------------------------------------
// A long replay loop fed through pinned memory
// ---------------------------------------------------------------------------------------------

/// The serving loop of `torch.cuda.graph` users: `static_out = 2·static_in + 1` captured once,
/// then 10^4 times: write the request into one pinned host buffer, `static_in.copy_(pinned,
/// non_blocking=True)`, replay; every 500th result is copied back and checked.
///
/// Expected: every checked result exact; the stream's event pool, the input's tracked uses,
/// the private allocator's reserve and the process's resident memory stay where iteration
/// 1000 left them (within small slack).
#[test]
fn ten_thousand_replays_fed_through_one_pinned_buffer_stay_exact_and_bounded() {
    let name = "ten_thousand_replays_fed_through_one_pinned_buffer_stay_exact_and_bounded";
    let Some(fx) = fixture(name) else {
        return;
    };
    const N: usize = 4096;
    let iterations: usize = if sanitizer_active() { 600 } else { 10_000 };
    let context = &fx.gpu.context;
    let kit = Kit::load(context, N);
    let main = normal_stream(context);
    let m = main.stream();
    let mut static_in = DeviceBuffer::<f32>::with_allocator(&fx.allocator, N, m).expect("in");
    let mut static_out = DeviceBuffer::<f32>::with_allocator(&fx.allocator, N, m).expect("out");
    let mut pinned_in = PinnedBuffer::<f32>::zeroed(context, N).expect("pinned in");
    let mut pinned_out = PinnedBuffer::<f32>::zeroed(context, N).expect("pinned out");
    main.fill(&mut static_in, 0.0).expect("zero in");
    main.synchronize().expect("sync");

    let capture = main
        .begin_capture(CaptureOptions::default())
        .expect("begin");
    kit.fill(m, &mut static_out, 1.0).expect("out = 1");
    kit.saxpy(m, 2.0, &static_in, &mut static_out)
        .expect("out += 2 in");
    let (graph, exec) = finish(capture, "finish");

    let events = main.event_pool().clone();
    let mut at_1000 = None;
    for k in 0..iterations {
        let value = (k % 65_536) as f32 - 32_768.0;
        pinned_in
            .as_mut_slice()
            .expect("pinned input, once the last copy is done")
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = value + (i % 8) as f32);
        drop(
            main.copy_from_host(&mut static_in, &pinned_in)
                .expect("copy in"),
        );
        main.launch_graph(&exec).expect("replay");
        if k % 500 == 499 || k + 1 == iterations {
            main.copy_to_host(&static_out, &mut pinned_out)
                .expect("copy out")
                .wait()
                .expect("copied out");
            let got = pinned_out.as_slice().expect("pinned out");
            assert_exact(
                &bits(&got),
                |i| 2.0 * (value + (i % 8) as f32) + 1.0,
                &format!("iteration {k}"),
            );
        }
        if k == 999 {
            main.synchronize().expect("sync");
            at_1000 = Some((
                events.counters().created_regular,
                static_in.tracked_uses(),
                fx.allocator.stats().reserved_bytes.current,
                resident_bytes(),
            ));
        }
    }
    main.synchronize().expect("sync");
    let Some((created, uses, reserved, resident)) = at_1000 else {
        return; // the short sanitizer run
    };
    let grown = events.counters().created_regular - created;
    assert!(
        grown <= 64,
        "the event pool made {grown} events after iteration 1000"
    );
    let uses_now = static_in.tracked_uses();
    assert!(
        uses_now <= uses.max(4),
        "the static input tracks {uses_now} uses (it tracked {uses} at iteration 1000)"
    );
    assert_eq!(fx.allocator.stats().reserved_bytes.current, reserved);
    let resident_now = resident_bytes();
    assert!(
        resident_now <= resident + (64 << 20),
        "resident memory grew from {resident} to {resident_now} bytes"
    );
    drop((exec, graph));
}

// ---------------------------------------------------------------------------------------------
// Captures raced onto pool streams
// ---------------------------------------------------------------------------------------------

/// Eight worker threads each take a stream from one round-robin pool (four normal streams, so
/// two threads often get the same one) and, all released at once by a barrier, try to capture
/// their own step (`buf[t] += 1`) on it; a refused begin takes the next stream and tries again.
///
/// Expected: every refusal is the typed `AlreadyCapturing` (never an untyped driver state
/// error, never a capture merged into another thread's), every thread gets its graph, and 100
/// replays of each leave exactly 100 in its buffer and nothing in any other. The replays wait
/// until every thread has its graph: a launch on a pool stream that another thread is
/// capturing would join (or, in global mode, break) that capture, in CUDA as in PyTorch.
#[test]
fn eight_threads_racing_to_capture_on_round_robin_pool_streams_get_typed_refusals_or_graphs() {
    let name =
        "eight_threads_racing_to_capture_on_round_robin_pool_streams_get_typed_refusals_or_graphs";
    let Some(fx) = fixture(name) else {
        return;
    };
    const THREADS: usize = 8;
    const N: usize = 1024;
    const REPLAYS: u32 = 100;
    let context = &fx.gpu.context;
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::RoundRobin),
    )
    .expect("pool");
    let buffers = zeroed_buffers(context, THREADS, N);
    let start = Barrier::new(THREADS);
    let captured = Barrier::new(THREADS);
    let refusals = Mutex::new(Vec::new());

    let results = on_threads(THREADS, |t| -> Result<(), String> {
        let ptr = buffers[t].device_ptr();
        start.wait();
        let built = (|| {
            for _attempt in 0..10_000 {
                let stream = pool.get_stream().map_err(|e| e.to_string())?;
                let capture = match stream.begin_capture(CaptureOptions::default()) {
                    Ok(capture) => capture,
                    Err(error) => {
                        refusals.lock().unwrap().push(error);
                        std::thread::yield_now();
                        continue;
                    }
                };
                // SAFETY: `ptr` is this thread's N u32s, alive until the end.
                unsafe { fx.kernels.increment_u32(stream.stream(), ptr, N) }
                    .map_err(|e| e.to_string())?;
                let graph = capture.finish().map_err(|e| e.to_string())?;
                let exec = graph
                    .instantiate(&InstantiateOptions::default())
                    .map_err(|e| e.to_string())?;
                return Ok((stream, exec));
            }
            Err("no stream could be captured in 10000 attempts".to_string())
        })();
        // Every thread passes here, whether or not it got a graph.
        captured.wait();
        let (stream, exec) = built?;
        for _ in 0..REPLAYS {
            stream.launch_graph(&exec).map_err(|e| e.to_string())?;
        }
        stream.synchronize().map_err(|e| e.to_string())
    });
    for (t, result) in results.iter().enumerate() {
        if let Err(error) = result {
            panic!("thread {t}: {error}");
        }
    }
    for error in refusals.into_inner().unwrap() {
        assert!(
            matches!(
                error.graph_error(),
                Some(GraphError::AlreadyCapturing { .. })
            ),
            "a begin on a stream another thread captures must be AlreadyCapturing, got {error:?}"
        );
    }
    for (t, buffer) in buffers.iter().enumerate() {
        let got = buffer.to_vec().expect("buffer");
        assert!(
            got.iter().all(|&v| v == REPLAYS),
            "thread {t}: expected {REPLAYS} everywhere, first is {} (a capture merged into \
             another or lost)",
            got[0]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// One broken capture among parallel ones
// ---------------------------------------------------------------------------------------------

/// `execute_parallel` over the pool's four normal streams, each closure capturing a step with
/// typed scratch from one shared caching allocator (`tmp = buf; tmp += 1; buf = tmp`); the
/// closure of one stream also calls `cuMemAlloc` directly (a library that is not capture
/// aware), which breaks its thread-local capture.
///
/// Expected: `Parallel` with exactly that stream's failure, a `CaptureInvalidated`; the three
/// other graphs replay exactly; the broken stream runs eager work and a fresh capture; once
/// the graphs are dropped the allocator gives back every byte.
#[test]
fn one_capture_broken_among_four_parallel_ones_fails_typed_and_alone() {
    let name = "one_capture_broken_among_four_parallel_ones_fails_typed_and_alone";
    let Some(fx) = fixture(name) else {
        return;
    };
    const N: usize = 1 << 14;
    const REPLAYS: u32 = 25;
    let context = &fx.gpu.context;
    let pool = StreamPool::new(context, StreamPoolConfig::default()).expect("pool");
    let streams: Vec<Arc<PriorityStream>> = pool.streams_of(StreamPriority::Normal).to_vec();
    let victim = streams[1].id();
    let buffers = zeroed_buffers(context, streams.len(), N);
    let index = |id: u64| streams.iter().position(|s| s.id() == id).unwrap();
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let execs = Mutex::new(Vec::new());
    let stray = Mutex::new(Vec::new());

    let result = coordinator.execute_parallel(|stream| {
        let s = stream.stream();
        let ptr = buffers[index(stream.id())].device_ptr();
        let capture = stream.begin_capture(CaptureOptions::default())?;
        let tmp = fx.allocator.allocate(N * 4, s)?;
        // SAFETY: `tmp` (graph memory) and `ptr` hold N u32s; ordered on `s`.
        unsafe {
            copy_dtod_async(tmp.ptr(), ptr, N * 4, s)?;
            fx.kernels.increment_u32(s, tmp.ptr(), N)?;
            copy_dtod_async(ptr, tmp.ptr(), N * 4, s)?;
        }
        if stream.id() == victim
            && let Ok(raw) = raw_mem_alloc(stream.context(), 1 << 20)
        {
            stray.lock().unwrap().push(raw);
        }
        drop(tmp);
        let exec = capture
            .finish()?
            .instantiate(&InstantiateOptions::default())?;
        execs.lock().unwrap().push((stream.id(), exec));
        Ok(())
    });
    for raw in stray.into_inner().unwrap() {
        // SAFETY: allocated above, used by no work, freed once.
        unsafe { raw_mem_free(context, raw) }.expect("free the stray allocation");
    }
    let failures = match result {
        Err(StreamError::Parallel { failures }) => failures,
        other => panic!("expected exactly the broken capture to fail, got {other:?}"),
    };
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].0, victim);
    assert!(
        matches!(
            failures[0].1.graph_error(),
            Some(GraphError::CaptureInvalidated { .. })
        ),
        "{}",
        failures[0].1
    );

    let execs = execs.into_inner().unwrap();
    assert_eq!(execs.len(), streams.len() - 1);
    for (id, exec) in &execs {
        let stream = &streams[index(*id)];
        for _ in 0..REPLAYS {
            stream.launch_graph(exec).expect("replay");
        }
        stream.synchronize().expect("sync");
    }
    for (i, buffer) in buffers.iter().enumerate() {
        let expected = if streams[i].id() == victim {
            0
        } else {
            REPLAYS
        };
        let got = buffer.to_vec().expect("buffer");
        assert!(
            got.iter().all(|&v| v == expected),
            "stream {i}: expected {expected}, first is {}",
            got[0]
        );
    }

    // The broken stream: eager work, then a fresh capture that replays.
    let broken = &streams[index(victim)];
    let ptr = buffers[index(victim)].device_ptr();
    // SAFETY: `ptr` holds N u32s, used only on `broken` now.
    unsafe { fx.kernels.increment_u32(broken.stream(), ptr, N) }.expect("eager increment");
    broken.synchronize().expect("sync");
    let capture = broken
        .begin_capture(CaptureOptions::default())
        .expect("recapture");
    // SAFETY: as above.
    unsafe { fx.kernels.increment_u32(broken.stream(), ptr, N) }.expect("captured increment");
    let (_, exec) = finish(capture, "finish");
    broken.launch_graph(&exec).expect("replay");
    broken.launch_graph(&exec).expect("replay");
    broken.synchronize().expect("sync");
    assert!(
        buffers[index(victim)]
            .to_vec()
            .expect("buffer")
            .iter()
            .all(|&v| v == 3)
    );

    drop((exec, execs));
    assert_eq!(
        settled(&fx.allocator).reserved_bytes.current,
        0,
        "the graphs' scratch and the broken capture's went back"
    );
}

// ---------------------------------------------------------------------------------------------
// The profiler over a long replay loop
// ---------------------------------------------------------------------------------------------

/// `torch.profiler` left on around a graph served 10^4 times, with a small keep limit (64).
///
/// Expected: pending spans never pass the documented bound; exactly 64 operations are kept,
/// all graph launches of the one stream in GPU order; kept + evicted + skipped = 10^4; the
/// graph's counter reads 10^4 and the stream counted 10^4 graph launches.
#[test]
fn a_profiler_with_a_small_limit_over_ten_thousand_graph_replays_is_bounded_and_exact() {
    let name = "a_profiler_with_a_small_limit_over_ten_thousand_graph_replays_is_bounded_and_exact";
    let Some(fx) = fixture(name) else {
        return;
    };
    const KEPT: usize = 64;
    let replays: u64 = if sanitizer_active() { 500 } else { 10_000 };
    let context = &fx.gpu.context;
    let main = normal_stream(context);
    let counter = DeviceBuffer::<u32>::zeroed(context, 1).expect("counter");
    let capture = main
        .begin_capture(CaptureOptions::default())
        .expect("begin");
    // SAFETY: one u32, alive for the graph, written by it only.
    unsafe {
        fx.kernels
            .increment_u32(main.stream(), counter.device_ptr(), 1)
    }
    .expect("count");
    let (graph, exec) = finish(capture, "finish");

    let profiler = StreamProfiler::with_limit(context, KEPT).expect("profiler");
    for i in 0..replays {
        profiler
            .profile(&main, "serve", OperationKind::GraphLaunch, 0, |s| {
                s.launch_graph(&exec)
            })
            .unwrap_or_else(|e| panic!("replay {i}: {e}"));
        assert!(profiler.pending() <= cuweave_stream::timing::DEFAULT_PENDING_SPANS);
    }
    main.synchronize().expect("sync");
    let operations = profiler.operations().expect("operations");
    assert_eq!(operations.len(), KEPT);
    assert!(
        operations
            .iter()
            .all(|op| op.kind == OperationKind::GraphLaunch
                && op.stream == main.id()
                && op.name == "serve")
    );
    assert!(
        operations
            .windows(2)
            .all(|pair| pair[0].start_ns <= pair[1].start_ns),
        "kept operations out of GPU order"
    );
    assert_eq!(
        KEPT as u64 + profiler.evicted() + profiler.skipped(),
        replays,
        "every replay is kept, evicted or skipped"
    );
    assert_eq!(counter.to_vec().expect("counter"), vec![replays as u32]);
    assert_eq!(main.metrics().expect("metrics").graph_launches, replays);
    drop((exec, graph));
}

// ---------------------------------------------------------------------------------------------
// Many threads, one load-balanced pool, a long loop
// ---------------------------------------------------------------------------------------------

/// Four threads, 2500 steps each, on one load-balanced pool: each step takes whichever stream
/// the pool picks, allocates a typed temporary for it from a shared caching allocator, fills it
/// with the step number, copies it into the thread's `last` buffer, increments the thread's
/// `counts` buffer and drops the temporary. Successive steps land on different streams, so only
/// the buffers' use tracking orders them.
///
/// Expected: `counts` reads exactly 2500 and `last` exactly 2499 in every thread; once the
/// streams are idle the allocator's reserve is at most one small segment's worth.
#[test]
fn four_threads_looping_over_a_load_balanced_pool_with_typed_temporaries_stay_exact_and_bounded() {
    let name = "four_threads_looping_over_a_load_balanced_pool_with_typed_temporaries_stay_exact_and_bounded";
    let Some(fx) = fixture(name) else {
        return;
    };
    const THREADS: usize = 4;
    const N: usize = 1024;
    let steps: u32 = if sanitizer_active() { 200 } else { 2500 };
    let context = &fx.gpu.context;
    let kit = Kit::load(context, N);
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced),
    )
    .expect("pool");

    let results = on_threads(THREADS, |_| {
        let mut counts = DeviceBuffer::<u32>::zeroed(context, N).expect("counts");
        let mut last = DeviceBuffer::<u32>::zeroed(context, N).expect("last");
        for step in 0..steps {
            let stream = pool.get_stream().expect("stream");
            let mut tmp = DeviceBuffer::<u32>::with_allocator(&fx.allocator, N, stream.stream())
                .expect("tmp");
            stream.fill(&mut tmp, step).expect("fill");
            stream.copy_buffer(&mut last, &tmp).expect("copy");
            kit.increment(stream.stream(), &mut counts)
                .expect("increment");
        }
        (
            counts.to_vec().expect("counts"),
            last.to_vec().expect("last"),
        )
    });
    for (t, (counts, last)) in results.iter().enumerate() {
        assert!(
            counts.iter().all(|&v| v == steps),
            "thread {t}: counts first {} (expected {steps}): an increment raced another",
            counts[0]
        );
        assert!(
            last.iter().all(|&v| v == steps - 1),
            "thread {t}: last first {} (expected {}): a copy ran out of order or read reused \
             memory",
            last[0],
            steps - 1
        );
    }
    for stream in pool.streams() {
        stream.synchronize().expect("sync");
    }
    let reserved = settled(&fx.allocator).reserved_bytes.current;
    assert!(
        reserved <= 2 << 20,
        "{reserved} bytes stay reserved after every temporary was dropped and the streams idle"
    );
}
