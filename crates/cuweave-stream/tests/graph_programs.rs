//! CUDA-graph programs as PyTorch, vLLM and TensorRT-LLM users write them, against this crate:
//! the `torch.cuda.graph` recipe replayed 1000 times with every output checked, two graphs in
//! one pool (`pool=g1.pool()`), one graph per batch size sharing a pool (vLLM), a capture forked
//! onto two pool streams and joined back (ordering proven with kernels that spin), executable
//! update instead of re-instantiation, the mistakes users make (ending what was never begun,
//! beginning twice, abandoning a capture, a capture broken by a raw call) and a long
//! capture-instantiate-launch-drop loop whose memory and registries stay bounded.
//!
//! Every GPU test takes `serial()`: an active capture changes what the whole process may do.

use std::sync::Arc;

use cuweave_driver::graph::{GraphError, active_captures};
use cuweave_driver::memory::{copy_dtod_async, copy_htod_async, memset_d32_async};
use cuweave_driver::{Graph, InstantiateOptions, Stream};
use cuweave_memory::PinnedBuffer;
use cuweave_memory::caching::{
    CachedAllocation, CachingAllocator, GraphPool, stranded_graph_memory,
};
use cuweave_stream::capture::{CaptureOptions, StreamCapture};
use cuweave_stream::{PriorityStream, StreamError, StreamPool, StreamPoolConfig, StreamPriority};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{sanitizer_active, skip_under_sanitizer};

mod common;
use common::graph::{
    Fixture, MS, assert_exact, bits, fixture, graph_error, input_value, priority_stream, read_u32,
    settled, write_u32,
};

/// The model step of most tests: `out = (2x + 1) + x`, its scratch allocated from `allocator`
/// on `stream` (the capture's pool while it captures) and freed inside the step.
fn step(
    kernels: &TestKernels,
    allocator: &CachingAllocator,
    stream: &Stream,
    x: u64,
    out: u64,
    n: usize,
) {
    let scratch = allocator.allocate(n * 4, stream).unwrap();
    // SAFETY: `scratch`, `x` and `out` hold `n` f32s, all ordered on `stream`; the scratch block
    // goes back to its pool (private during a capture) in stream order.
    unsafe {
        kernels
            .fill_u32(stream, scratch.ptr(), 1.0f32.to_bits(), n)
            .unwrap();
        kernels.saxpy_f32(stream, 2.0, x, scratch.ptr(), n).unwrap();
        kernels.add_f32(stream, scratch.ptr(), x, out, n).unwrap();
    }
    drop(scratch);
}

fn step_reference(x: f32) -> f32 {
    (2.0 * x + 1.0) + x
}

/// `torch.cuda.graph`'s recipe: three warm-up steps on a side stream that waits for the current
/// one, a capture of the step (static input, kernels, static output, scratch from the private
/// pool), then 1000 replays, each after a new input lands in the static input (a device copy on
/// even rounds, an async copy from pinned host memory on odd ones) and each output copied aside
/// on the replay stream: all 1000 outputs checked bit for bit.
#[test]
fn torch_recipe_replays_1000_new_inputs_from_device_and_pinned_memory_every_output_exact() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "torch_recipe_replays_1000_new_inputs_from_device_and_pinned_memory_every_output_exact",
    )
    else {
        return;
    };
    const N: usize = 4096;
    let rounds: usize = if sanitizer_active() { 50 } else { 1000 };
    let main = priority_stream(&gpu);
    let side = priority_stream(&gpu);
    let static_in = allocator.allocate(N * 4, main.stream()).unwrap();
    let static_out = allocator.allocate(N * 4, main.stream()).unwrap();
    let inputs: Vec<f32> = (0..rounds * N).map(input_value).collect();
    let inputs_device = allocator.allocate(rounds * N * 4, main.stream()).unwrap();
    write_u32(&gpu.context, inputs_device.ptr(), &bits(&inputs));
    let inputs_pinned = PinnedBuffer::<f32>::from_slice(&gpu.context, &inputs).unwrap();
    let results = allocator.allocate(rounds * N * 4, main.stream()).unwrap();
    let warm: Vec<f32> = (0..N).map(|i| input_value(i + 17)).collect();
    write_u32(&gpu.context, static_in.ptr(), &bits(&warm));

    side.wait_for(&main).unwrap();
    for _ in 0..3 {
        step(
            &kernels,
            &allocator,
            side.stream(),
            static_in.ptr(),
            static_out.ptr(),
            N,
        );
    }
    main.wait_for(&side).unwrap();
    main.synchronize().unwrap();
    assert_exact(
        &read_u32(&gpu.context, static_out.ptr(), N),
        |i| step_reference(warm[i]),
        "warm-up",
    );

    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    step(
        &kernels,
        &allocator,
        main.stream(),
        static_in.ptr(),
        static_out.ptr(),
        N,
    );
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.upload(main.stream()).unwrap();
    let launches = main.metrics().unwrap().graph_launches;

    let s = main.stream();
    for round in 0..rounds {
        let offset = round * N;
        if round % 2 == 0 {
            // SAFETY: both ranges hold N f32s and outlive the synchronisation below.
            unsafe {
                copy_dtod_async(
                    static_in.ptr(),
                    inputs_device.ptr() + (offset * 4) as u64,
                    N * 4,
                    s,
                )
            }
            .unwrap();
        } else {
            // SAFETY: the pinned range holds N f32s, is never written by the host, and lives
            // until the synchronisation below; `static_in` holds N f32s.
            unsafe {
                copy_htod_async(
                    static_in.ptr(),
                    inputs_pinned.as_host_ptr().add(offset).cast(),
                    N * 4,
                    s,
                )
            }
            .unwrap();
        }
        main.launch_graph(&exec).unwrap();
        // SAFETY: both ranges hold N f32s and outlive the synchronisation below.
        unsafe {
            copy_dtod_async(
                results.ptr() + (offset * 4) as u64,
                static_out.ptr(),
                N * 4,
                s,
            )
        }
        .unwrap();
    }
    main.synchronize().unwrap();
    let outputs = read_u32(&gpu.context, results.ptr(), rounds * N);
    for round in 0..rounds {
        assert_exact(
            &outputs[round * N..(round + 1) * N],
            |i| step_reference(inputs[round * N + i]),
            &format!("replay {round}"),
        );
    }
    assert_eq!(
        main.metrics().unwrap().graph_launches - launches,
        rounds as u64
    );
    assert_eq!(exec.launch_count(), rounds as u64);
}

/// Two graphs in one pool (PyTorch `torch.cuda.graph(g2, pool=g1.pool())`): the second capture
/// gets the first one's scratch, freed inside it, back (no new memory); replayed alternately on
/// one stream both stay exact; the pool's memory stays while either graph lives and goes back,
/// to the allocator's books and to the driver, once both are dropped.
#[test]
fn two_graphs_in_one_pool_share_freed_scratch_replay_alternately_and_free_it_when_dropped() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "two_graphs_in_one_pool_share_freed_scratch_replay_alternately_and_free_it_when_dropped",
    )
    else {
        return;
    };
    const N: usize = 1 << 16;
    const ROUNDS: usize = 64;
    let main = priority_stream(&gpu);
    let s = main.stream();
    let x = allocator.allocate(N * 4, s).unwrap();
    let (out1, out2) = (
        allocator.allocate(N * 4, s).unwrap(),
        allocator.allocate(N * 4, s).unwrap(),
    );
    let inputs: Vec<f32> = (0..ROUNDS * N).map(input_value).collect();
    let table = allocator.allocate(ROUNDS * N * 4, s).unwrap();
    write_u32(&gpu.context, table.ptr(), &bits(&inputs));
    let (res1, res2) = (
        allocator.allocate(ROUNDS * N * 4, s).unwrap(),
        allocator.allocate(ROUNDS * N * 4, s).unwrap(),
    );
    // Warm what is not pool memory (the driver's own graph structures) before measuring.
    {
        let capture = main.begin_capture(CaptureOptions::default()).unwrap();
        kernels.spin_ns(s, 1).unwrap();
        let exec = capture
            .finish()
            .unwrap()
            .instantiate(&InstantiateOptions::default())
            .unwrap();
        main.launch_graph(&exec).unwrap();
        main.synchronize().unwrap();
    }
    let base = settled(&allocator);
    let free_before = gpu.context.memory_info().unwrap().free;

    let pool = GraphPool::new();
    // g1: out1 = 2x + 1, scratch allocated and freed inside the capture.
    let capture = main
        .begin_capture(CaptureOptions::default().with_pool(&pool))
        .unwrap();
    let scratch = allocator.allocate(N * 4, s).unwrap();
    let first_scratch = scratch.ptr();
    // SAFETY: every range holds N f32s, ordered on `s`.
    unsafe {
        kernels
            .fill_u32(s, scratch.ptr(), 1.0f32.to_bits(), N)
            .unwrap();
        kernels
            .saxpy_f32(s, 2.0, x.ptr(), scratch.ptr(), N)
            .unwrap();
        copy_dtod_async(out1.ptr(), scratch.ptr(), N * 4, s).unwrap();
    }
    drop(scratch);
    let g1 = capture.finish().unwrap();
    let after_g1 = allocator.stats();
    assert!(after_g1.reserved_bytes.current > base.reserved_bytes.current);

    // g2: out2 = 0.5x + 3, into the same pool: it gets g1's freed scratch back.
    let capture = main
        .begin_capture(CaptureOptions::default().with_pool(&pool))
        .unwrap();
    let scratch = allocator.allocate(N * 4, s).unwrap();
    assert_eq!(
        scratch.ptr(),
        first_scratch,
        "the second capture into the pool reuses the block the first freed"
    );
    // SAFETY: as above.
    unsafe {
        kernels
            .fill_u32(s, scratch.ptr(), 3.0f32.to_bits(), N)
            .unwrap();
        kernels
            .saxpy_f32(s, 0.5, x.ptr(), scratch.ptr(), N)
            .unwrap();
        copy_dtod_async(out2.ptr(), scratch.ptr(), N * 4, s).unwrap();
    }
    drop(scratch);
    let g2 = capture.finish().unwrap();
    assert_eq!(
        allocator.stats().reserved_bytes.current,
        after_g1.reserved_bytes.current,
        "the second graph took no new memory"
    );
    let e1 = g1.instantiate(&InstantiateOptions::default()).unwrap();
    let e2 = g2.instantiate(&InstantiateOptions::default()).unwrap();
    assert_eq!(pool.holders(), 5, "the handle, two graphs, two executables");

    for round in 0..ROUNDS {
        let offset = (round * N * 4) as u64;
        // SAFETY: every range holds N f32s and outlives the synchronisation below; the two
        // graphs share scratch and run one after the other on `s`.
        unsafe {
            copy_dtod_async(x.ptr(), table.ptr() + offset, N * 4, s).unwrap();
            main.launch_graph(&e1).unwrap();
            copy_dtod_async(res1.ptr() + offset, out1.ptr(), N * 4, s).unwrap();
            main.launch_graph(&e2).unwrap();
            copy_dtod_async(res2.ptr() + offset, out2.ptr(), N * 4, s).unwrap();
        }
    }
    main.synchronize().unwrap();
    let (r1, r2) = (
        read_u32(&gpu.context, res1.ptr(), ROUNDS * N),
        read_u32(&gpu.context, res2.ptr(), ROUNDS * N),
    );
    for round in 0..ROUNDS {
        let at = round * N;
        assert_exact(
            &r1[at..at + N],
            |i| 2.0 * inputs[at + i] + 1.0,
            &format!("g1, round {round}"),
        );
        assert_exact(
            &r2[at..at + N],
            |i| 0.5 * inputs[at + i] + 3.0,
            &format!("g2, round {round}"),
        );
    }

    // One graph gone: the pool (held by the other) keeps its memory through empty_cache.
    drop((e1, g1));
    assert_eq!(
        settled(&allocator).reserved_bytes.current,
        after_g1.reserved_bytes.current
    );
    drop((e2, g2, pool));
    main.synchronize().unwrap();
    let end = settled(&allocator);
    assert_eq!(end.reserved_bytes.current, base.reserved_bytes.current);
    assert_eq!(end.segments.current, base.segments.current);
    if !sanitizer_active() {
        let free_after = gpu.context.memory_info().unwrap().free;
        assert!(
            free_after + (2 << 20) >= free_before,
            "the driver got the pool back: {free_before} free before, {free_after} after"
        );
    }
}

/// vLLM captures one graph per batch size, largest first, all into one pool: eight graphs,
/// replayed interleaved with new inputs, every output exact; the eight captures together take
/// one segment (each frees its scratch, the next smaller one reuses it); dropping them gives
/// the memory back.
#[test]
fn eight_batch_size_graphs_in_one_pool_replay_interleaved_in_bounded_memory_and_free_it() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "eight_batch_size_graphs_in_one_pool_replay_interleaved_in_bounded_memory_and_free_it",
    )
    else {
        return;
    };
    const MAX: usize = 32 * 1024;
    const ROUNDS: usize = 160;
    let sizes: Vec<usize> = (0..8).map(|k| MAX >> (7 - k)).collect();
    assert_eq!(sizes.len(), 8);
    let main = priority_stream(&gpu);
    let s = main.stream();
    let x = allocator.allocate(MAX * 4, s).unwrap();
    let out = allocator.allocate(MAX * 4, s).unwrap();
    let inputs: Vec<f32> = (0..ROUNDS * MAX).map(input_value).collect();
    let table = allocator.allocate(ROUNDS * MAX * 4, s).unwrap();
    write_u32(&gpu.context, table.ptr(), &bits(&inputs));
    let results = allocator.allocate(ROUNDS * MAX * 4, s).unwrap();
    let base = settled(&allocator);

    let pool = GraphPool::new();
    let coefficient = |k: usize| (k as f32 + 2.0, k as f32 * 3.0 - 5.0); // (a, c): out = a x + c
    let mut execs = Vec::new();
    for k in (0..sizes.len()).rev() {
        let n = sizes[k];
        let (a, c) = coefficient(k);
        let capture = main
            .begin_capture(CaptureOptions::default().with_pool(&pool))
            .unwrap();
        let scratch = allocator.allocate(n * 4, s).unwrap();
        // SAFETY: `scratch` holds n f32s, `x` and `out` MAX >= n; ordered on `s`.
        unsafe {
            kernels.fill_u32(s, scratch.ptr(), c.to_bits(), n).unwrap();
            kernels.saxpy_f32(s, a, x.ptr(), scratch.ptr(), n).unwrap();
            copy_dtod_async(out.ptr(), scratch.ptr(), n * 4, s).unwrap();
        }
        drop(scratch);
        let graph = capture.finish().unwrap();
        execs.push((
            k,
            graph.instantiate(&InstantiateOptions::default()).unwrap(),
            graph,
        ));
    }
    execs.sort_by_key(|(k, _, _)| *k);
    let captured = allocator.stats();
    assert!(
        captured.segments.current - base.segments.current <= 1,
        "eight captures into one pool took {} segments ({} bytes)",
        captured.segments.current - base.segments.current,
        captured.reserved_bytes.current - base.reserved_bytes.current
    );

    let order: Vec<usize> = (0..ROUNDS).map(|r| (r * 5 + r / 8) % 8).collect();
    for (round, &k) in order.iter().enumerate() {
        let n = sizes[k];
        let offset = (round * MAX * 4) as u64;
        // SAFETY: every range holds at least n f32s and outlives the synchronisation below.
        unsafe {
            copy_dtod_async(x.ptr(), table.ptr() + offset, n * 4, s).unwrap();
            main.launch_graph(&execs[k].1).unwrap();
            copy_dtod_async(results.ptr() + offset, out.ptr(), n * 4, s).unwrap();
        }
    }
    main.synchronize().unwrap();
    let outputs = read_u32(&gpu.context, results.ptr(), ROUNDS * MAX);
    for (round, &k) in order.iter().enumerate() {
        let (a, c) = coefficient(k);
        let at = round * MAX;
        assert_exact(
            &outputs[at..at + sizes[k]],
            |i| a * inputs[at + i] + c,
            &format!("round {round}, batch size {}", sizes[k]),
        );
    }
    for (k, exec, _) in &execs {
        assert!(exec.launch_count() > 0, "graph {k} was replayed");
    }

    drop(execs);
    assert_eq!(
        settled(&allocator).reserved_bytes.current,
        captured.reserved_bytes.current,
        "the pool handle still holds the memory"
    );
    drop(pool);
    main.synchronize().unwrap();
    let end = settled(&allocator);
    assert_eq!(end.reserved_bytes.current, base.reserved_bytes.current);
    assert_eq!(end.segments.current, base.segments.current);
}

/// A capture forked onto two streams of a `StreamPool` with `wait_for` (an event recorded on
/// the capturing stream, waited for by each pool stream), each branch spinning before it
/// writes, joined back with `wait_for`: every replay shows both branches' results and the
/// join's order (the origin reads what the slower branch stored only after its spin); the
/// branches ran nothing before the first launch; all three streams are usable afterwards.
#[test]
fn a_capture_forked_onto_two_pool_streams_and_joined_replays_both_branches_in_order() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) =
        fixture("a_capture_forked_onto_two_pool_streams_and_joined_replays_both_branches_in_order")
    else {
        return;
    };
    const N: usize = 1 << 14;
    const FLAG: u32 = 0xA11C_E5ED;
    const B: u32 = 0x0B0B_0B0B;
    const A: u32 = 5;
    let stream_kernels = StreamKernels::load(&gpu.context).unwrap();
    let streams = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let normal = streams.streams_of(StreamPriority::Normal);
    let (a, b) = (Arc::clone(&normal[0]), Arc::clone(&normal[1]));
    assert_ne!(a.id(), b.id());
    let main = priority_stream(&gpu);
    let m = main.stream();
    let flag = allocator.allocate(4, m).unwrap();
    let region_a = allocator.allocate(N * 4, m).unwrap();
    let region_b = allocator.allocate(N * 4, m).unwrap();
    let seen_flag = allocator.allocate(4, m).unwrap();
    let seen_a = allocator.allocate(N * 4, m).unwrap();
    let seen_b = allocator.allocate(N * 4, m).unwrap();
    let reset = |stream: &Stream| {
        for (ptr, n) in [
            (flag.ptr(), 1),
            (region_a.ptr(), N),
            (region_b.ptr(), N),
            (seen_flag.ptr(), 1),
            (seen_a.ptr(), N),
            (seen_b.ptr(), N),
        ] {
            // SAFETY: each range holds n u32s, ordered on `stream`.
            unsafe { memset_d32_async(ptr, 0, n, stream) }.unwrap();
        }
    };
    reset(m);
    main.synchronize().unwrap();

    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    a.wait_for(&main).unwrap(); // fork: `a` joins the capture
    b.wait_for(&main).unwrap();
    // Branch A: scratch from the capture's pool on `a`, then a slow store of the flag.
    let scratch = allocator.allocate(N * 4, a.stream()).unwrap();
    // SAFETY: every range holds N u32s (the flag one), ordered on `a`.
    unsafe {
        kernels.fill_u32(a.stream(), scratch.ptr(), A, N).unwrap();
        copy_dtod_async(region_a.ptr(), scratch.ptr(), N * 4, a.stream()).unwrap();
        kernels
            .spin_then_store_u32(a.stream(), 3 * MS, flag.ptr(), FLAG)
            .unwrap();
    }
    // Branch B: spins, then fills.
    kernels.spin_ns(b.stream(), 2 * MS).unwrap();
    // SAFETY: `region_b` holds N u32s, ordered on `b`.
    unsafe { kernels.fill_u32(b.stream(), region_b.ptr(), B, N) }.unwrap();
    main.wait_for(&a).unwrap(); // joins
    main.wait_for(&b).unwrap();
    // SAFETY: every range holds what is copied, ordered on `m` after both joins.
    unsafe {
        copy_dtod_async(seen_a.ptr(), region_a.ptr(), N * 4, m).unwrap();
        copy_dtod_async(seen_b.ptr(), region_b.ptr(), N * 4, m).unwrap();
    }
    main.launch(|s| {
        // SAFETY: both hold one u32, ordered on `m` after the joins.
        unsafe { stream_kernels.copy_flag_u32(s, flag.ptr(), seen_flag.ptr()) }
    })
    .unwrap();
    drop(scratch);
    let graph = capture.finish().unwrap();
    assert_eq!(
        read_u32(&gpu.context, flag.ptr(), 1),
        vec![0],
        "a captured branch ran before any launch"
    );
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    let rounds = if sanitizer_active() { 3 } else { 10 };
    for round in 0..rounds {
        reset(m);
        main.launch_graph(&exec).unwrap();
        main.synchronize().unwrap();
        assert_eq!(
            read_u32(&gpu.context, seen_flag.ptr(), 1),
            vec![FLAG],
            "round {round}: the origin read the flag before branch A's join"
        );
        assert!(
            read_u32(&gpu.context, seen_b.ptr(), N)
                .iter()
                .all(|&v| v == B),
            "round {round}: branch B's fill not seen after the join"
        );
        assert!(
            read_u32(&gpu.context, seen_a.ptr(), N)
                .iter()
                .all(|&v| v == A),
            "round {round}: branch A's scratch copy not seen after the join"
        );
    }
    for stream in [&main, &*a, &*b] {
        stream.launch(|s| kernels.spin_ns(s, 1000)).unwrap();
        stream.synchronize().unwrap();
        assert_eq!(stream.outstanding_work().unwrap(), 0);
    }
}

/// Re-capturing the same step with another input and updating the executable in place
/// (`GraphExec::update`) instead of instantiating again: the next replay uses the new input.
/// Then 200 updates alternating the inputs, recaptured into one pool as a user recapturing
/// every step would: each replay exact, the executable's kept-alive values and the allocator's
/// memory bounded.
#[test]
fn updating_an_executable_with_a_recaptured_graph_replays_the_new_input_and_stays_bounded() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "updating_an_executable_with_a_recaptured_graph_replays_the_new_input_and_stays_bounded",
    )
    else {
        return;
    };
    const N: usize = 1 << 14;
    let main = priority_stream(&gpu);
    let s = main.stream();
    let inputs: [Vec<f32>; 2] = [
        (0..N).map(input_value).collect(),
        (0..N).map(|i| input_value(i + 999)).collect(),
    ];
    let x: Vec<CachedAllocation> = inputs
        .iter()
        .map(|values| {
            let block = allocator.allocate(N * 4, s).unwrap();
            write_u32(&gpu.context, block.ptr(), &bits(values));
            block
        })
        .collect();
    let out = allocator.allocate(N * 4, s).unwrap();
    let capture_step = |which: usize, options: CaptureOptions| -> Graph {
        let capture = main.begin_capture(options).unwrap();
        step(&kernels, &allocator, s, x[which].ptr(), out.ptr(), N);
        capture.finish().unwrap()
    };
    let check = |which: usize, what: &str| {
        main.synchronize().unwrap();
        assert_exact(
            &read_u32(&gpu.context, out.ptr(), N),
            |i| step_reference(inputs[which][i]),
            what,
        );
    };

    let first = capture_step(0, CaptureOptions::default());
    let mut exec = first.instantiate(&InstantiateOptions::default()).unwrap();
    main.launch_graph(&exec).unwrap();
    check(0, "the first capture");
    exec.update(&capture_step(1, CaptureOptions::default()))
        .unwrap();
    main.launch_graph(&exec).unwrap();
    check(1, "after the update to the second input");
    drop(first);

    let pool = GraphPool::new();
    let mut most_kept = 0;
    let mut reserved_after_first = None;
    let updates = if sanitizer_active() { 20 } else { 200 };
    for round in 0..updates {
        let which = round % 2;
        let graph = capture_step(which, CaptureOptions::default().with_pool(&pool));
        exec.update(&graph).unwrap();
        drop(graph);
        main.launch_graph(&exec).unwrap();
        most_kept = most_kept.max(exec.kept_alive_count());
        let reserved = allocator.stats().reserved_bytes.current;
        let first = *reserved_after_first.get_or_insert(reserved);
        assert_eq!(
            reserved, first,
            "round {round}: recapturing into one pool took new memory"
        );
        if round % 50 == 49 || round == updates - 1 {
            check(which, &format!("update {round}"));
        }
    }
    assert!(
        most_kept <= 3,
        "the executable held {most_kept} kept-alive values across updates"
    );
}

/// What users get wrong: ending a capture never begun, beginning one twice, abandoning one
/// mid-way (a fork never joined, scratch allocated on both streams, one block still held when
/// the guard drops), a capture broken by a raw `cuMemAlloc`. Each is a typed error or a clean
/// end; the streams stay usable, the abandoned capture's pool is not leaked, and a fresh
/// capture on the same stream then replays exactly.
#[test]
fn capture_mistakes_are_typed_leave_streams_usable_leak_no_pool_and_a_fresh_capture_works() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "capture_mistakes_are_typed_leave_streams_usable_leak_no_pool_and_a_fresh_capture_works",
    )
    else {
        return;
    };
    const N: usize = 1 << 14;
    let main = priority_stream(&gpu);
    let side = priority_stream(&gpu);
    let s = main.stream();
    let x = allocator.allocate(N * 4, s).unwrap();
    let out = allocator.allocate(N * 4, s).unwrap();
    let values: Vec<f32> = (0..N).map(input_value).collect();
    write_u32(&gpu.context, x.ptr(), &bits(&values));
    let usable = |stream: &PriorityStream| {
        stream.launch(|raw| kernels.spin_ns(raw, 1000)).unwrap();
        stream.synchronize().unwrap();
    };
    let base = settled(&allocator);
    let stranded = stranded_graph_memory();

    // Ending a capture that was never begun.
    let error = StreamError::from(s.end_capture().unwrap_err());
    assert!(
        matches!(graph_error(&error), GraphError::NotCapturing { stream, .. } if *stream == main.id()),
        "{error}"
    );
    usable(&main);

    // Beginning twice: the second is refused, the first still records and replays.
    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    let again = main.begin_capture(CaptureOptions::default()).unwrap_err();
    assert!(
        matches!(graph_error(&again), GraphError::AlreadyCapturing { stream } if *stream == main.id()),
        "{again}"
    );
    let again = StreamCapture::begin(s, CaptureOptions::default()).unwrap_err();
    assert!(matches!(
        graph_error(&again),
        GraphError::AlreadyCapturing { .. }
    ));
    step(&kernels, &allocator, s, x.ptr(), out.ptr(), N);
    let graph = capture
        .finish()
        .expect("the refused second begin left the capture intact");
    main.launch_graph(&graph.instantiate(&InstantiateOptions::default()).unwrap())
        .unwrap();
    main.synchronize().unwrap();
    assert_exact(
        &read_u32(&gpu.context, out.ptr(), N),
        |i| step_reference(values[i]),
        "the capture that survived a second begin",
    );
    drop(graph);

    // Abandoned mid-way: allocations on both streams, a fork never joined, a block still held.
    let capture_pool;
    let held;
    {
        let mut capture = main.begin_capture(CaptureOptions::default()).unwrap();
        capture_pool = capture.pool().clone();
        held = allocator.allocate(3 << 20, s).unwrap();
        // SAFETY: `held` holds 3 MiB, ordered on `s`; the capture is discarded, nothing runs.
        unsafe { kernels.fill_u32(s, held.ptr(), 9, (3 << 20) / 4) }.unwrap();
        capture.fork(side.stream()).unwrap();
        let on_side = allocator.allocate(N * 4, side.stream()).unwrap();
        // SAFETY: as above, on `side`.
        unsafe { kernels.fill_u32(side.stream(), on_side.ptr(), 9, N) }.unwrap();
        drop(on_side);
        assert!(active_captures() > 0);
    }
    assert_eq!(active_captures(), 0, "the dropped guard ended the capture");
    assert!(!s.is_capturing().unwrap() && !side.stream().is_capturing().unwrap());
    usable(&main);
    usable(&side);
    assert_eq!(
        capture_pool.holders(),
        1,
        "only this test's handle holds the abandoned capture's pool"
    );
    drop(held);
    drop(capture_pool);
    let after = settled(&allocator);
    assert_eq!(
        after.reserved_bytes.current, base.reserved_bytes.current,
        "the abandoned capture's pool memory went back"
    );
    assert_eq!(after.allocated_bytes.current, base.allocated_bytes.current);

    // Broken by a raw call; its scratch from the pool; then a fresh capture on the same stream.
    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    let scratch = allocator.allocate(N * 4, s).unwrap();
    let broke = cuweave_test_support::outside_capture::raw_mem_alloc(&gpu.context, 1 << 20);
    drop(scratch);
    let error = capture.finish().unwrap_err();
    assert!(
        matches!(graph_error(&error), GraphError::CaptureInvalidated { .. }),
        "{error}"
    );
    if let Ok(ptr) = broke {
        // SAFETY: allocated above, freed once, used by no work.
        unsafe { cuweave_test_support::outside_capture::raw_mem_free(&gpu.context, ptr) }.unwrap();
    }
    assert_eq!(active_captures(), 0);
    usable(&main);
    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    step(&kernels, &allocator, s, x.ptr(), out.ptr(), N);
    let graph = capture
        .finish()
        .expect("a fresh capture after a broken one");
    // SAFETY: `out` holds N u32s, ordered on `s`.
    unsafe { memset_d32_async(out.ptr(), 0, N, s) }.unwrap();
    main.launch_graph(&graph.instantiate(&InstantiateOptions::default()).unwrap())
        .unwrap();
    main.synchronize().unwrap();
    assert_exact(
        &read_u32(&gpu.context, out.ptr(), N),
        |i| step_reference(values[i]),
        "the fresh capture after a broken one",
    );
    drop(graph);
    main.synchronize().unwrap();
    let end = settled(&allocator);
    assert_eq!(end.reserved_bytes.current, base.reserved_bytes.current);
    assert_eq!(stranded_graph_memory(), stranded, "nothing stranded");
}

/// Beginning a capture on a stream that was forked into another capture (a side stream of the
/// running step, `torch.cuda.graph` on a stream already waiting on the capturing one) is the
/// same mistake as beginning twice: a typed `AlreadyCapturing`, and the running capture is not
/// disturbed: it joins, finishes and replays exactly.
#[test]
fn beginning_a_capture_on_a_stream_forked_into_another_is_a_typed_refusal_and_harmless() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "beginning_a_capture_on_a_stream_forked_into_another_is_a_typed_refusal_and_harmless",
    )
    else {
        return;
    };
    const N: usize = 1 << 14;
    let main = priority_stream(&gpu);
    let side = priority_stream(&gpu);
    let out = allocator.allocate(N * 4, main.stream()).unwrap();
    // SAFETY: `out` holds N u32s, ordered on `main`.
    unsafe { memset_d32_async(out.ptr(), 0, N, main.stream()) }.unwrap();
    main.synchronize().unwrap();

    let mut capture = main.begin_capture(CaptureOptions::default()).unwrap();
    // SAFETY: `out` holds N u32s; `side` is ordered after this by the fork below.
    unsafe { kernels.increment_u32(main.stream(), out.ptr(), N) }.unwrap();
    capture.fork(side.stream()).unwrap();
    let error = side.begin_capture(CaptureOptions::default()).unwrap_err();
    assert!(
        matches!(graph_error(&error), GraphError::AlreadyCapturing { stream } if *stream == side.id()),
        "{error}"
    );
    let error = StreamCapture::begin(side.stream(), CaptureOptions::default()).unwrap_err();
    assert!(
        matches!(graph_error(&error), GraphError::AlreadyCapturing { .. }),
        "{error}"
    );
    // SAFETY: as above, on `side`, joined back before `main` goes on.
    unsafe { kernels.increment_u32(side.stream(), out.ptr(), N) }.unwrap();
    capture.join(side.stream()).unwrap();
    let graph = capture
        .finish()
        .expect("the refused begin left the running capture intact");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        main.launch_graph(&exec).unwrap();
    }
    main.synchronize().unwrap();
    assert!(
        read_u32(&gpu.context, out.ptr(), N).iter().all(|&v| v == 6),
        "three replays of two increments"
    );
    assert_eq!(active_captures(), 0);
    // The side stream can begin its own capture now.
    let own = side.begin_capture(CaptureOptions::default()).unwrap();
    kernels.spin_ns(side.stream(), 1000).unwrap();
    drop(own.finish().unwrap());
    side.launch(|s| kernels.spin_ns(s, 1000)).unwrap();
    side.synchronize().unwrap();
}

/// A long-running program: 10^4 cycles of capture (a fork onto a side stream and a join every
/// cycle, a scratch block from one shared pool), instantiate, launch, drop. Every launch ran
/// (the counters), and the allocator's memory, the event pool and the pool's holders stay
/// where the first cycles left them.
#[test]
fn ten_thousand_capture_instantiate_launch_drop_cycles_stay_bounded() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("ten_thousand_capture_instantiate_launch_drop_cycles_stay_bounded")
    else {
        return;
    };
    let cycles: u32 = if sanitizer_active() { 300 } else { 10_000 };
    let main = priority_stream(&gpu);
    let side = priority_stream(&gpu);
    let s = main.stream();
    let counters = allocator.allocate(8, s).unwrap();
    // SAFETY: two u32s, ordered on `s`.
    unsafe { memset_d32_async(counters.ptr(), 0, 2, s) }.unwrap();
    main.synchronize().unwrap();
    let pool = GraphPool::new();
    let events = main.event_pool().clone();
    let stranded = stranded_graph_memory();
    let mut settled_at: Option<(usize, u64)> = None;

    for cycle in 0..cycles {
        let mut capture = main
            .begin_capture(CaptureOptions::default().with_pool(&pool))
            .unwrap();
        let scratch = allocator.allocate(256, s).unwrap();
        // SAFETY: the counters hold two u32s and `scratch` 64; ordered on `s` (and on `side`
        // after the fork, before the join).
        unsafe {
            kernels.fill_u32(s, scratch.ptr(), cycle, 64).unwrap();
            kernels.increment_u32(s, counters.ptr(), 1).unwrap();
        }
        capture.fork(side.stream()).unwrap();
        // SAFETY: as above.
        unsafe { kernels.increment_u32(side.stream(), counters.ptr() + 4, 1) }.unwrap();
        capture.join(side.stream()).unwrap();
        drop(scratch);
        let graph = capture.finish().unwrap();
        let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
        main.launch_graph(&exec).unwrap();
        drop(exec);
        drop(graph);
        if cycle == 99 {
            main.synchronize().unwrap();
            settled_at = Some((
                allocator.stats().reserved_bytes.current,
                events.counters().created_regular,
            ));
        }
    }
    main.synchronize().unwrap();
    assert_eq!(
        read_u32(&gpu.context, counters.ptr(), 2),
        vec![cycles, cycles],
        "every launch ran both branches once"
    );
    assert_eq!(main.metrics().unwrap().graph_launches, u64::from(cycles));
    assert_eq!(main.outstanding_work().unwrap(), 0);
    assert_eq!(active_captures(), 0);
    assert_eq!(pool.holders(), 1, "no dropped graph still holds the pool");
    assert_eq!(stranded_graph_memory(), stranded);
    let (reserved, created) = settled_at.unwrap();
    assert_eq!(
        allocator.stats().reserved_bytes.current,
        reserved,
        "the allocator grew after the first 100 cycles"
    );
    // The stream keeps at most 256 markers behind its launches (pruned when asked for its
    // outstanding work), each a pooled event: that, not the cycle count, bounds the pool.
    let grown = events.counters().created_regular - created;
    assert!(
        grown <= 300,
        "the event pool made {grown} more events after the first 100 cycles"
    );
    assert!(events.utilization().in_use <= 300);
}

/// The same loop with a fresh pool per capture (`CaptureOptions::default()`, PyTorch's default
/// `torch.cuda.graph(g)`) and a scratch block in each: the pool of a dropped graph should not
/// keep reserving memory, or a long recapture loop grows without bound (and, with blocks over
/// 1 MiB, runs out of memory inside a capture, where no out-of-memory retry runs).
///
/// A capture's miss in its fresh private pool adopts a whole free segment of a pool that died
/// before the capture's context synchronisation (`cuweave-memory`, 77bd8b2), so the loop settles
/// at a few segments instead of taking a new one from the driver every cycle.
#[test]
fn recapturing_with_a_fresh_pool_each_cycle_keeps_reserved_memory_bounded() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("recapturing_with_a_fresh_pool_each_cycle_keeps_reserved_memory_bounded")
    else {
        return;
    };
    if skip_under_sanitizer(
        "recapturing_with_a_fresh_pool_each_cycle_keeps_reserved_memory_bounded",
        "500 captures, too slow under the sanitizer",
    ) {
        return;
    }
    let main = priority_stream(&gpu);
    let s = main.stream();
    let mut reserved_after_warmup = 0;
    for cycle in 0..500u32 {
        let capture = main.begin_capture(CaptureOptions::default()).unwrap();
        let scratch = allocator.allocate(256, s).unwrap();
        // SAFETY: `scratch` holds 64 u32s, ordered on `s`.
        unsafe { kernels.fill_u32(s, scratch.ptr(), cycle, 64) }.unwrap();
        drop(scratch);
        let exec = capture
            .finish()
            .unwrap()
            .instantiate(&InstantiateOptions::default())
            .unwrap();
        main.launch_graph(&exec).unwrap();
        drop(exec);
        if cycle == 9 {
            reserved_after_warmup = allocator.stats().reserved_bytes.current;
        }
    }
    main.synchronize().unwrap();
    let reserved = allocator.stats().reserved_bytes.current;
    assert!(
        reserved <= reserved_after_warmup + (4 << 20),
        "500 captures of a dropped graph each reserved memory: {reserved_after_warmup} bytes \
         after 10, {reserved} after 500"
    );
}
