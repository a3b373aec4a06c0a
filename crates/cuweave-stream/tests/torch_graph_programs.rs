//! CUDA-graph programs as users of `torch.cuda.graph`, `torch.cuda.make_graphed_callables`,
//! CUDA graph trees and cudarc write them, against this crate, in the shapes the other graph
//! tests do not already cover: a forward and a backward graph sharing one pool (the backward
//! captured with `MissPolicy::Fail` from the warmed pool, the forward's saved activation never
//! handed out), eager allocations between 2000 replays, a diamond of streams with a fork taken
//! from a forked stream, replays on a stream other than the capture's ordered only by events,
//! replays on the legacy default stream (cudarc's default stream), one executable replayed on
//! every stream of a pool, a global-mode capture seen from another thread, a cudarc-style raw
//! capture bound to a pool by hand, an update loop over fresh pools, many graphs alive at once,
//! and the mistakes (bad paths, bad updates, work after a join) that must be typed errors.
//!
//! Three tests check what the code reading suggested may be wrong (see each test's comment):
//! a raw block freed inside a capture on a stream that joined it through a `wait_for`, a capture
//! bound to its own pool a second time, and a fork of a stream that is capturing elsewhere.
//!
//! Every GPU test takes `serial()`: an active capture changes what the whole process may do.

use std::path::Path;
use std::sync::Arc;

use cuweave_driver::graph::{CaptureMode, CaptureModeGuard, GraphError, active_captures};
use cuweave_driver::memory::{copy_dtod_async, copy_dtoh, memset_d32_async};
use cuweave_driver::{
    Context, Device, DriverError, Event, EventFlags, Graph, InstantiateOptions, Stream, StreamFlags,
};
use cuweave_memory::caching::{
    CachedAllocation, CachingAllocator, GraphPool, MissPolicy, begin_allocate_to_pool,
    stranded_graph_memory,
};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_stream::capture::{CaptureOptions, StreamCapture};
use cuweave_stream::{
    OperationKind, PriorityStream, StreamError, StreamPool, StreamPoolConfig, StreamPriority,
    WorkloadType,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{sanitizer_active, skip};

mod common;
use common::Kit;
use common::graph::{
    Fixture, MS, assert_exact, bits, fixture, graph_error, input_value, priority_stream, read_u32,
    settled, write_u32,
};

/// Asserts that `result` is a capture refusal (`GraphError::Capturing` or `NotCapturable`).
fn assert_refusal<T: std::fmt::Debug, E: Into<StreamError>>(result: Result<T, E>, what: &str) {
    match result {
        Ok(value) => panic!("{what}: expected a capture refusal, got Ok({value:?})"),
        Err(error) => {
            let error: StreamError = error.into();
            assert!(
                error.is_capture_refusal(),
                "{what}: expected a capture refusal, got {error}"
            );
        }
    }
}

/// `make_graphed_callables`: the forward and the backward of one module, warmed up eagerly on a
/// side stream, then captured in turn into one pool. The forward keeps its saved activation
/// (allocated inside its capture, never freed there) and frees its scratch; the backward,
/// captured with `MissPolicy::Fail`, finds all it needs in the warmed pool (no new memory) and
/// is never given the live activation. 1000 replays, forward then backward, each with a new
/// input and a new incoming gradient: every output and gradient exact; the pool's memory comes
/// back once both graphs, the activation and the pool handle are gone.
#[test]
fn graphed_forward_and_backward_share_a_pool_keep_the_saved_activation_and_replay_exactly() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "graphed_forward_and_backward_share_a_pool_keep_the_saved_activation_and_replay_exactly",
    )
    else {
        return;
    };
    const N: usize = 4096;
    let rounds: usize = if sanitizer_active() { 30 } else { 1000 };
    let main = priority_stream(&gpu);
    let side = priority_stream(&gpu);
    let s = main.stream();
    // Static tensors: input, incoming gradient, output, input gradient.
    let (x, g, y, dx) = (
        allocator.allocate(N * 4, s).unwrap(),
        allocator.allocate(N * 4, s).unwrap(),
        allocator.allocate(N * 4, s).unwrap(),
        allocator.allocate(N * 4, s).unwrap(),
    );
    let xs: Vec<f32> = (0..rounds * N).map(input_value).collect();
    let gs: Vec<f32> = (0..rounds * N).map(|k| input_value(k + 31)).collect();
    let table = |values: &[f32]| {
        let block = allocator.allocate(values.len() * 4, s).unwrap();
        write_u32(&gpu.context, block.ptr(), &bits(values));
        block
    };
    let (x_table, g_table) = (table(&xs), table(&gs));
    let y_results = allocator.allocate(rounds * N * 4, s).unwrap();
    let dx_results = allocator.allocate(rounds * N * 4, s).unwrap();

    // forward: act = 2x + 1 (saved); y = (act + 3) + x = 3x + 4.
    let forward = |on: &Stream, act: u64| {
        let scratch = allocator.allocate(N * 4, on).unwrap();
        // SAFETY: every range holds N f32s, ordered on `on`; the scratch goes back in order.
        unsafe {
            kernels.fill_u32(on, act, 1.0f32.to_bits(), N).unwrap();
            kernels.saxpy_f32(on, 2.0, x.ptr(), act, N).unwrap();
            kernels
                .fill_u32(on, scratch.ptr(), 3.0f32.to_bits(), N)
                .unwrap();
            kernels.saxpy_f32(on, 1.0, act, scratch.ptr(), N).unwrap();
            kernels
                .add_f32(on, scratch.ptr(), x.ptr(), y.ptr(), N)
                .unwrap();
        }
        scratch.ptr()
    };
    // backward: dx = (g + 0.5 act) + x = g + 2x + 0.5.
    let backward = |on: &Stream, act: u64| {
        let scratch = allocator.allocate(N * 4, on).unwrap();
        // SAFETY: as above.
        unsafe {
            copy_dtod_async(scratch.ptr(), g.ptr(), N * 4, on).unwrap();
            kernels.saxpy_f32(on, 0.5, act, scratch.ptr(), N).unwrap();
            kernels
                .add_f32(on, scratch.ptr(), x.ptr(), dx.ptr(), N)
                .unwrap();
        }
        scratch.ptr()
    };

    // Warm-up on a side stream that waits for the current one (the module's eager run).
    write_u32(&gpu.context, x.ptr(), &bits(&xs[..N]));
    write_u32(&gpu.context, g.ptr(), &bits(&gs[..N]));
    side.wait_for(&main).unwrap();
    let warm_act = allocator.allocate(N * 4, side.stream()).unwrap();
    for _ in 0..3 {
        forward(side.stream(), warm_act.ptr());
        backward(side.stream(), warm_act.ptr());
    }
    main.wait_for(&side).unwrap();
    main.synchronize().unwrap();
    assert_exact(
        &read_u32(&gpu.context, dx.ptr(), N),
        |i| gs[i] + 2.0 * xs[i] + 0.5,
        "eager warm-up",
    );
    drop(warm_act);
    side.synchronize().unwrap();
    let base = settled(&allocator);
    let stranded = stranded_graph_memory();

    let pool = GraphPool::new();
    let capture = main
        .begin_capture(CaptureOptions::default().with_pool(&pool))
        .unwrap();
    let act = allocator.allocate(N * 4, s).unwrap();
    let forward_scratch = forward(s, act.ptr());
    let forward_graph = capture.finish().unwrap();
    let after_forward = allocator.stats();

    let capture = main
        .begin_capture(
            CaptureOptions::default()
                .with_pool(&pool)
                .with_misses(MissPolicy::Fail),
        )
        .unwrap();
    let backward_scratch = backward(s, act.ptr());
    let backward_graph = capture
        .finish()
        .expect("the backward found its scratch in the pool the forward warmed");
    assert!(
        backward_scratch.abs_diff(act.ptr()) >= (N * 4) as u64,
        "the backward's scratch {backward_scratch:#x} overlaps the live activation {:#x}",
        act.ptr()
    );
    assert_ne!(forward_scratch, act.ptr());
    assert_eq!(
        allocator.stats().reserved_bytes.current,
        after_forward.reserved_bytes.current,
        "the backward took no new memory"
    );
    let fwd = forward_graph
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    let bwd = backward_graph
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    fwd.upload(s).unwrap();
    bwd.upload(s).unwrap();

    for round in 0..rounds {
        let offset = (round * N * 4) as u64;
        // SAFETY: every range holds N f32s and outlives the synchronisation below; both graphs
        // run one after the other on `s`, which also orders the static tensors' refills.
        unsafe {
            copy_dtod_async(x.ptr(), x_table.ptr() + offset, N * 4, s).unwrap();
            main.launch_graph(&fwd).unwrap();
            copy_dtod_async(y_results.ptr() + offset, y.ptr(), N * 4, s).unwrap();
            copy_dtod_async(g.ptr(), g_table.ptr() + offset, N * 4, s).unwrap();
            main.launch_graph(&bwd).unwrap();
            copy_dtod_async(dx_results.ptr() + offset, dx.ptr(), N * 4, s).unwrap();
        }
    }
    main.synchronize().unwrap();
    let (ys, dxs) = (
        read_u32(&gpu.context, y_results.ptr(), rounds * N),
        read_u32(&gpu.context, dx_results.ptr(), rounds * N),
    );
    for round in 0..rounds {
        let at = round * N;
        assert_exact(
            &ys[at..at + N],
            |i| 3.0 * xs[at + i] + 4.0,
            &format!("forward, replay {round}"),
        );
        assert_exact(
            &dxs[at..at + N],
            |i| gs[at + i] + 2.0 * xs[at + i] + 0.5,
            &format!("backward, replay {round}"),
        );
    }
    assert_eq!(fwd.launch_count(), rounds as u64);
    assert_eq!(bwd.launch_count(), rounds as u64);

    drop((fwd, bwd, forward_graph, backward_graph));
    drop(act);
    assert_eq!(pool.holders(), 1, "only the handle holds the pool now");
    drop(pool);
    main.synchronize().unwrap();
    let end = settled(&allocator);
    assert_eq!(end.reserved_bytes.current, base.reserved_bytes.current);
    assert_eq!(end.segments.current, base.segments.current);
    assert_eq!(end.allocated_bytes.current, base.allocated_bytes.current);
    assert_eq!(stranded_graph_memory(), stranded, "nothing stranded");
}

/// A training loop around one graph: temporaries of three sizes allocated and freed inside the
/// capture (a freed one reused by the next of its size, inside the capture), then 2000 replays,
/// each beside an eager temporary of the graph's scratch size allocated and freed on the same
/// stream. The eager temporaries never get graph memory, the allocator's held bytes and
/// segments do not move over the replays, a counter inside the graph shows every replay ran,
/// and dropping the graph and its pool returns every byte.
#[test]
fn temporaries_inside_a_graph_beside_eager_ones_over_2000_replays_leak_nothing() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("temporaries_inside_a_graph_beside_eager_ones_over_2000_replays_leak_nothing")
    else {
        return;
    };
    const N: usize = 1 << 16;
    const LARGE: usize = 3 << 20;
    let rounds: u32 = if sanitizer_active() { 50 } else { 2000 };
    let main = priority_stream(&gpu);
    let s = main.stream();
    let x = allocator.allocate(N * 4, s).unwrap();
    let out = allocator.allocate(N * 4, s).unwrap();
    let counter = allocator.allocate(4, s).unwrap();
    let values: Vec<f32> = (0..N).map(input_value).collect();
    write_u32(&gpu.context, x.ptr(), &bits(&values));
    write_u32(&gpu.context, counter.ptr(), &[0]);
    let base = settled(&allocator);

    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    let pool = capture.pool().clone();
    let tiny = allocator.allocate(512, s).unwrap();
    let large = allocator.allocate(LARGE, s).unwrap();
    let first = allocator.allocate(N * 4, s).unwrap();
    let first_ptr = first.ptr();
    // SAFETY: every range holds what is written, ordered on `s`; the temporaries are freed in
    // stream order into the capture's pool.
    unsafe {
        kernels
            .fill_u32(s, tiny.ptr(), 2.0f32.to_bits(), 128)
            .unwrap();
        kernels.fill_u32(s, large.ptr(), 7, LARGE / 4).unwrap();
        kernels
            .fill_u32(s, first.ptr(), 1.0f32.to_bits(), N)
            .unwrap();
        kernels.saxpy_f32(s, 2.0, x.ptr(), first.ptr(), N).unwrap();
    }
    drop(large);
    let second = allocator.allocate(N * 4, s).unwrap();
    // SAFETY: as above.
    unsafe {
        kernels
            .add_f32(s, first.ptr(), x.ptr(), second.ptr(), N)
            .unwrap();
    }
    drop(first);
    let third = allocator.allocate(N * 4, s).unwrap();
    assert_eq!(
        third.ptr(),
        first_ptr,
        "a temporary freed inside the capture is reused by the next of its size there"
    );
    // SAFETY: as above: out = (2x + 1 + x) + x = 4x + 1.
    unsafe {
        kernels
            .add_f32(s, second.ptr(), x.ptr(), third.ptr(), N)
            .unwrap();
        copy_dtod_async(out.ptr(), third.ptr(), N * 4, s).unwrap();
        kernels.increment_u32(s, counter.ptr(), 1).unwrap();
    }
    let graph_ptrs = [tiny.ptr(), second.ptr(), third.ptr()];
    drop((tiny, second, third));
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    // One eager temporary first, so that the books below start with its segment in the cache.
    drop(allocator.allocate(N * 4, s).unwrap());
    main.synchronize().unwrap();
    let captured = allocator.stats();

    for round in 0..rounds {
        main.launch_graph(&exec).unwrap();
        let eager = allocator.allocate(N * 4, s).unwrap();
        assert!(
            !graph_ptrs.contains(&eager.ptr()) && eager.ptr() != first_ptr,
            "round {round}: an eager temporary got graph memory"
        );
        // SAFETY: the eager temporary holds N u32s, ordered on `s` after the replay, freed in
        // stream order.
        unsafe { kernels.fill_u32(s, eager.ptr(), round, N) }.unwrap();
        drop(eager);
        if round % 500 == 0 || round == rounds - 1 {
            main.synchronize().unwrap();
            assert_exact(
                &read_u32(&gpu.context, out.ptr(), N),
                |i| 4.0 * values[i] + 1.0,
                &format!("replay {round}"),
            );
            let now = allocator.stats();
            assert_eq!(
                now.reserved_bytes.current, captured.reserved_bytes.current,
                "round {round}: replays reserved memory"
            );
            assert_eq!(now.segments.current, captured.segments.current);
            assert_eq!(
                now.allocated_bytes.current, captured.allocated_bytes.current,
                "round {round}: replays left memory allocated"
            );
        }
    }
    assert_eq!(read_u32(&gpu.context, counter.ptr(), 1), vec![rounds]);
    assert_eq!(exec.launch_count(), u64::from(rounds));

    drop((exec, graph));
    assert_eq!(pool.holders(), 1);
    drop(pool);
    main.synchronize().unwrap();
    let end = settled(&allocator);
    assert_eq!(end.reserved_bytes.current, base.reserved_bytes.current);
    assert_eq!(end.segments.current, base.segments.current);
    assert_eq!(end.allocated_bytes.current, base.allocated_bytes.current);
}

/// A diamond of three streams in one capture: `b` is forked with `StreamCapture::fork`, `c`
/// from `b` (`c.wait_for(&b)`, a fork taken from a forked stream, as a submodule that forks its
/// own side stream does), `c` joins `b`, `b` joins the origin. Each branch writes its own part
/// after a spin (so a join that did not hold would show stale zeros) and counts itself; `c`'s
/// scratch comes from the capture's pool. Every replay: the sum of the three parts, and each
/// branch counted once.
#[test]
fn a_diamond_with_a_fork_taken_from_a_forked_stream_runs_every_branch_on_every_replay() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "a_diamond_with_a_fork_taken_from_a_forked_stream_runs_every_branch_on_every_replay",
    )
    else {
        return;
    };
    const N: usize = 1 << 15;
    let main = priority_stream(&gpu);
    let b = priority_stream(&gpu);
    let c = priority_stream(&gpu);
    let m = main.stream();
    let parts: Vec<CachedAllocation> = (0..3)
        .map(|_| allocator.allocate(N * 4, m).unwrap())
        .collect();
    let out = allocator.allocate(N * 4, m).unwrap();
    let counters = allocator.allocate(12, m).unwrap();
    // SAFETY: three u32s, ordered on `m`.
    unsafe { memset_d32_async(counters.ptr(), 0, 3, m) }.unwrap();
    let reset = |stream: &Stream| {
        for ptr in parts.iter().map(CachedAllocation::ptr).chain([out.ptr()]) {
            // SAFETY: each range holds N u32s, ordered on `stream`.
            unsafe { memset_d32_async(ptr, 0, N, stream) }.unwrap();
        }
    };
    reset(m);
    main.synchronize().unwrap();

    let mut capture = main.begin_capture(CaptureOptions::default()).unwrap();
    // SAFETY: `parts[0]` holds N f32s and `counters` three u32s, ordered on `m`.
    unsafe {
        kernels
            .fill_u32(m, parts[0].ptr(), 1.0f32.to_bits(), N)
            .unwrap();
        kernels.increment_u32(m, counters.ptr(), 1).unwrap();
    }
    capture.fork(b.stream()).unwrap();
    c.wait_for(&b).unwrap();
    kernels.spin_ns(b.stream(), 2 * MS).unwrap();
    // SAFETY: `parts[1]` and the second counter are written only by branch `b`, which the
    // origin waits for through the join below.
    unsafe {
        kernels
            .fill_u32(b.stream(), parts[1].ptr(), 20.0f32.to_bits(), N)
            .unwrap();
        kernels
            .increment_u32(b.stream(), counters.ptr() + 4, 1)
            .unwrap();
    }
    let scratch = allocator.allocate(N * 4, c.stream()).unwrap();
    // SAFETY: the scratch (from the capture's pool), `parts[2]` and the third counter are
    // written only by branch `c`, which `b`, then the origin, wait for.
    unsafe {
        kernels
            .fill_u32(c.stream(), scratch.ptr(), 300.0f32.to_bits(), N)
            .unwrap();
        kernels.spin_ns(c.stream(), MS).unwrap();
        copy_dtod_async(parts[2].ptr(), scratch.ptr(), N * 4, c.stream()).unwrap();
        kernels
            .increment_u32(c.stream(), counters.ptr() + 8, 1)
            .unwrap();
    }
    drop(scratch);
    b.wait_for(&c).unwrap();
    capture.join(b.stream()).unwrap();
    // SAFETY: every part holds N f32s, complete after both joins; `out` may equal an input.
    unsafe {
        kernels
            .add_f32(m, parts[0].ptr(), parts[1].ptr(), out.ptr(), N)
            .unwrap();
        kernels
            .add_f32(m, out.ptr(), parts[2].ptr(), out.ptr(), N)
            .unwrap();
    }
    let graph = capture
        .finish()
        .expect("c joined b and b joined the origin");
    assert_eq!(
        read_u32(&gpu.context, counters.ptr(), 3),
        vec![0, 0, 0],
        "a captured branch ran before any launch"
    );
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    let rounds: u32 = if sanitizer_active() { 3 } else { 20 };
    for round in 1..=rounds {
        reset(m);
        main.launch_graph(&exec).unwrap();
        main.synchronize().unwrap();
        assert_exact(
            &read_u32(&gpu.context, out.ptr(), N),
            |_| 321.0,
            &format!("replay {round}: the sum of the three branches"),
        );
        assert_eq!(
            read_u32(&gpu.context, counters.ptr(), 3),
            vec![round; 3],
            "replay {round}: each branch ran once per replay"
        );
    }
    for stream in [&main, &b, &c] {
        stream.launch(|s| kernels.spin_ns(s, 1000)).unwrap();
        stream.synchronize().unwrap();
    }
    assert_eq!(active_captures(), 0);
}

/// What `wait_for` (a coordinator dependency) brings into a capture must be treated as what
/// `fork` brings in: `docs/graphs.md` says a capture's streams are "found by the capture id
/// ... so forked streams are included", and that a block of the general cache a capture used
/// becomes graph memory when freed during it. A raw block allocated eagerly on `side`, written
/// there inside the capture, read by the origin and freed during the capture must therefore not
/// be handed to eager work on `side` while the graph lives.
///
/// A regression test: `graph_pool::release_during_capture` finds the owning pool through the
/// streams listed in the capture's binding, and only `StreamCapture::fork` listed a stream
/// (`note_capture_stream`); a stream that joined through `PriorityStream::wait_for` was listed
/// only once it allocated, so its freed block went straight back to `side`'s general free list.
/// Every cuweave wait now lists the waiting stream (`note_wait_joined_capture`). The `fork`
/// variant is the control.
#[test]
fn a_raw_block_freed_in_a_capture_on_a_stream_joined_by_wait_for_stays_graph_memory() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) =
        fixture("a_raw_block_freed_in_a_capture_on_a_stream_joined_by_wait_for_stays_graph_memory")
    else {
        return;
    };
    const N: usize = 1 << 16;
    const X: u32 = 0x5EED_0001;
    const Y: u32 = 0xBAD0_0002;
    for through_fork in [true, false] {
        let how = if through_fork { "fork" } else { "wait_for" };
        let main = priority_stream(&gpu);
        let side = priority_stream(&gpu);
        let out = allocator.allocate(N * 4, main.stream()).unwrap();
        let block = allocator.allocate(N * 4, side.stream()).unwrap();
        let block_ptr = block.ptr();
        // SAFETY: `block` holds N u32s, ordered on `side`.
        unsafe { kernels.fill_u32(side.stream(), block_ptr, 0, N) }.unwrap();
        side.synchronize().unwrap();

        let mut capture = main.begin_capture(CaptureOptions::default()).unwrap();
        if through_fork {
            capture.fork(side.stream()).unwrap();
        } else {
            side.wait_for(&main).unwrap();
        }
        // SAFETY: `block` holds N u32s; `side` is in the capture, joined back below.
        unsafe { kernels.fill_u32(side.stream(), block_ptr, X, N) }.unwrap();
        if through_fork {
            capture.join(side.stream()).unwrap();
        } else {
            main.wait_for(&side).unwrap();
        }
        // SAFETY: both hold N u32s; ordered after the fill by the join.
        unsafe { copy_dtod_async(out.ptr(), block_ptr, N * 4, main.stream()) }.unwrap();
        drop(block); // freed during the capture that used it: graph memory from now on
        let graph = capture.finish().unwrap();
        let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

        // Eager work on `side` after the capture, while the graph lives.
        let eager = allocator.allocate(N * 4, side.stream()).unwrap();
        // SAFETY: `eager` holds N u32s, ordered on `side`.
        unsafe { kernels.fill_u32(side.stream(), eager.ptr(), Y, N) }.unwrap();
        side.synchronize().unwrap();
        main.launch_graph(&exec).unwrap();
        main.synchronize().unwrap();
        assert!(
            read_u32(&gpu.context, out.ptr(), N).iter().all(|&v| v == X),
            "{how}: the replay did not copy the side branch's write"
        );
        assert!(
            read_u32(&gpu.context, eager.ptr(), N)
                .iter()
                .all(|&v| v == Y),
            "{how}: a replay overwrote eager memory (the graph's block went to eager work)"
        );
        assert_ne!(
            eager.ptr(),
            block_ptr,
            "{how}: the block freed in the capture was handed to eager work while the graph lives"
        );
        drop(eager);
        drop((exec, graph));
        main.synchronize().unwrap();
        side.synchronize().unwrap();
    }
}

/// `begin_allocate_to_pool` says binding a capture to the pool it is already bound to "is
/// fine". A library called inside a `torch.cuda.graph` block that routes its own allocations
/// to the capture's pool (as PyTorch code does with `_cuda_beginAllocateToPool` /
/// `_cuda_endAllocateToPool`) and lets go of its guard must leave the capture as it was: later
/// allocations on the capturing stream still come from the pool, and the graph replays.
///
/// A regression test: bindings were not counted. `bind_capture` kept the one existing binding
/// for a second guard, and `AllocateToPool::drop` removed every binding of the capture, so the
/// library's guard unbound the `StreamCapture`'s capture: the next allocation was refused
/// ("no graph pool is bound to its capture"), and a general-cache block freed later in the
/// capture no longer became graph memory. A binding now counts its guards.
#[test]
fn binding_a_running_capture_to_its_own_pool_again_and_letting_go_keeps_it_bound() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("binding_a_running_capture_to_its_own_pool_again_and_letting_go_keeps_it_bound")
    else {
        return;
    };
    const N: usize = 1 << 14;
    let main = priority_stream(&gpu);
    let s = main.stream();
    let out = allocator.allocate(N * 4, s).unwrap();

    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    let pool = capture.pool().clone();
    {
        let library = begin_allocate_to_pool(s, &pool, MissPolicy::AllocateRelaxed)
            .expect("binding the capture to its own pool again is fine");
        let inner = allocator.allocate(N * 4, s).unwrap();
        // SAFETY: `inner` holds N u32s, ordered on `s`.
        unsafe { kernels.fill_u32(s, inner.ptr(), 1, N) }.unwrap();
        drop(inner);
        drop(library);
    }
    let scratch = allocator.allocate(N * 4, s);
    let scratch = match scratch {
        Ok(scratch) => scratch,
        Err(error) => {
            drop(capture);
            panic!("the capture lost its pool when the second guard dropped: {error}");
        }
    };
    let scratch_ptr = scratch.ptr();
    // SAFETY: `scratch` and `out` hold N u32s, ordered on `s`.
    unsafe {
        kernels.fill_u32(s, scratch_ptr, 41, N).unwrap();
        kernels.increment_u32(s, scratch_ptr, N).unwrap();
        copy_dtod_async(out.ptr(), scratch_ptr, N * 4, s).unwrap();
    }
    drop(scratch);
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    let eager = allocator.allocate(N * 4, s).unwrap();
    assert_ne!(eager.ptr(), scratch_ptr, "graph scratch went to eager work");
    // SAFETY: `eager` and `out` hold N u32s, ordered on `s`.
    unsafe {
        kernels.fill_u32(s, eager.ptr(), 7, N).unwrap();
        memset_d32_async(out.ptr(), 0, N, s).unwrap();
    }
    main.launch_graph(&exec).unwrap();
    main.synchronize().unwrap();
    assert!(
        read_u32(&gpu.context, out.ptr(), N)
            .iter()
            .all(|&v| v == 42)
    );
    assert!(
        read_u32(&gpu.context, eager.ptr(), N)
            .iter()
            .all(|&v| v == 7)
    );
    assert_eq!(pool.holders(), 3, "the handle, the graph and the exec");
}

/// Two captures running at once on one thread (a model capturing two independent graphs
/// interleaved). Forking the origin of the second into the first would merge two capture
/// sequences, which the driver answers by invalidating them (`CUDA_ERROR_STREAM_CAPTURE_MERGE`).
/// The other directions are refused as typed errors before anything is queued
/// (`PriorityStream::wait_for`, `StreamCapture::join`): `fork` should be too, and leave both
/// captures to finish and replay.
///
/// A regression test: `StreamCapture::fork` checked only that the stream is not the origin; it
/// recorded the event and made the stream wait on it without asking whether the stream is in
/// another capture, so the mistake broke both captures instead of being refused.
#[test]
fn forking_a_stream_that_captures_elsewhere_is_refused_and_both_captures_replay() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("forking_a_stream_that_captures_elsewhere_is_refused_and_both_captures_replay")
    else {
        return;
    };
    const N: usize = 1 << 12;
    let first = priority_stream(&gpu);
    let second = priority_stream(&gpu);
    let a = allocator.allocate(N * 4, first.stream()).unwrap();
    let b = allocator.allocate(N * 4, second.stream()).unwrap();
    // SAFETY: both hold N u32s, ordered on their streams.
    unsafe {
        memset_d32_async(a.ptr(), 0, N, first.stream()).unwrap();
        memset_d32_async(b.ptr(), 0, N, second.stream()).unwrap();
    }
    first.synchronize().unwrap();
    second.synchronize().unwrap();

    let mut one = first.begin_capture(CaptureOptions::default()).unwrap();
    let two = second.begin_capture(CaptureOptions::default()).unwrap();
    // SAFETY: each range holds N u32s, used only by its own capture.
    unsafe {
        kernels.increment_u32(first.stream(), a.ptr(), N).unwrap();
        kernels.increment_u32(second.stream(), b.ptr(), N).unwrap();
    }
    assert_refusal(second.wait_for(&first), "wait_for across two captures");
    assert_refusal(
        one.join(second.stream()),
        "join of another capture's origin",
    );
    assert_refusal(
        one.fork(second.stream()),
        "fork of another capture's origin",
    );
    // SAFETY: as above.
    unsafe {
        kernels.increment_u32(first.stream(), a.ptr(), N).unwrap();
        kernels.increment_u32(second.stream(), b.ptr(), N).unwrap();
    }
    let graph_two = two
        .finish()
        .expect("the refused fork left capture two intact");
    let graph_one = one
        .finish()
        .expect("the refused fork left capture one intact");
    let (exec_one, exec_two) = (
        graph_one
            .instantiate(&InstantiateOptions::default())
            .unwrap(),
        graph_two
            .instantiate(&InstantiateOptions::default())
            .unwrap(),
    );
    for _ in 0..3 {
        first.launch_graph(&exec_one).unwrap();
        second.launch_graph(&exec_two).unwrap();
    }
    first.synchronize().unwrap();
    second.synchronize().unwrap();
    assert!(read_u32(&gpu.context, a.ptr(), N).iter().all(|&v| v == 6));
    assert!(read_u32(&gpu.context, b.ptr(), N).iter().all(|&v| v == 6));
}

/// The graph is captured on one stream and never replayed there: a producer stream writes each
/// new input (after a spin on some rounds), the replay stream waits for it with an event, a
/// consumer stream waits for the replay and copies the output aside; the producer waits for the
/// replay before overwriting the input, and the replay for the consumer before overwriting the
/// output. Nothing else orders them, and the graph spins before it writes: every one of the
/// rounds' results is exact.
#[test]
fn a_graph_replayed_off_its_capture_stream_between_producer_and_consumer_streams_is_exact() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "a_graph_replayed_off_its_capture_stream_between_producer_and_consumer_streams_is_exact",
    )
    else {
        return;
    };
    const N: usize = 1 << 14;
    let rounds: usize = if sanitizer_active() { 6 } else { 40 };
    let capturing = priority_stream(&gpu);
    let producer = priority_stream(&gpu);
    let replay = priority_stream(&gpu);
    let consumer = priority_stream(&gpu);
    let c = capturing.stream();
    let x = allocator.allocate(N * 4, c).unwrap();
    let out = allocator.allocate(N * 4, c).unwrap();
    let inputs: Vec<f32> = (0..rounds * N).map(|k| input_value(k + 5)).collect();
    let table = allocator.allocate(rounds * N * 4, c).unwrap();
    write_u32(&gpu.context, table.ptr(), &bits(&inputs));
    let results = allocator.allocate(rounds * N * 4, c).unwrap();

    let capture = capturing.begin_capture(CaptureOptions::default()).unwrap();
    let scratch = allocator.allocate(N * 4, c).unwrap();
    // SAFETY: every range holds N f32s, ordered on `c`; out = 2x + 1 after a 2 ms spin.
    unsafe {
        kernels
            .fill_u32(c, scratch.ptr(), 1.0f32.to_bits(), N)
            .unwrap();
        kernels.spin_ns(c, 2 * MS).unwrap();
        kernels
            .saxpy_f32(c, 2.0, x.ptr(), scratch.ptr(), N)
            .unwrap();
        copy_dtod_async(out.ptr(), scratch.ptr(), N * 4, c).unwrap();
    }
    drop(scratch);
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    for round in 0..rounds {
        let offset = (round * N * 4) as u64;
        producer.wait_for(&replay).unwrap(); // the previous replay has read `x`
        replay.wait_for(&consumer).unwrap(); // the previous output was copied aside
        if round % 3 == 0 {
            producer.launch(|s| kernels.spin_ns(s, 3 * MS)).unwrap();
        }
        // SAFETY: both ranges hold N f32s and outlive the synchronisation below.
        producer
            .enqueue(OperationKind::Copy, (N * 4) as u64, |s| unsafe {
                copy_dtod_async(x.ptr(), table.ptr() + offset, N * 4, s)
            })
            .unwrap();
        replay.wait_for(&producer).unwrap();
        replay.launch_graph(&exec).unwrap();
        consumer.wait_for(&replay).unwrap();
        // SAFETY: as above.
        consumer
            .enqueue(OperationKind::Copy, (N * 4) as u64, |s| unsafe {
                copy_dtod_async(results.ptr() + offset, out.ptr(), N * 4, s)
            })
            .unwrap();
    }
    for stream in [&producer, &replay, &consumer] {
        stream.synchronize().unwrap();
    }
    let outputs = read_u32(&gpu.context, results.ptr(), rounds * N);
    for round in 0..rounds {
        let at = round * N;
        assert_exact(
            &outputs[at..at + N],
            |i| 2.0 * inputs[at + i] + 1.0,
            &format!("round {round}"),
        );
    }
    assert_eq!(capturing.metrics().unwrap().graph_launches, 0);
    assert_eq!(replay.metrics().unwrap().graph_launches, rounds as u64);
}

/// cudarc's default stream is the legacy default stream: a graph captured on a created stream
/// and launched there, with synchronous copies before and after it and a blocking stream
/// reading its output, is ordered by the legacy stream's implicit synchronisation alone. The
/// graph spins before it writes, so an unordered reader would see the previous round's value.
#[test]
fn a_graph_launched_on_the_legacy_default_stream_orders_with_blocking_streams_and_sync_copies() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "a_graph_launched_on_the_legacy_default_stream_orders_with_blocking_streams_and_sync_copies",
    )
    else {
        return;
    };
    const N: usize = 1 << 14;
    let capturing = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let blocking = Stream::new(&gpu.context, StreamFlags::DEFAULT).unwrap();
    let legacy = Stream::legacy_default(&gpu.context);
    let input = allocator.allocate(N * 4, &capturing).unwrap();
    let out = allocator.allocate(N * 4, &capturing).unwrap();
    let seen = allocator.allocate(N * 4, &blocking).unwrap();

    let capture = StreamCapture::begin(&capturing, CaptureOptions::default()).unwrap();
    kernels.spin_ns(&capturing, 2 * MS).unwrap();
    // SAFETY: both hold N u32s, ordered on `capturing`: out = input + 1.
    unsafe {
        copy_dtod_async(out.ptr(), input.ptr(), N * 4, &capturing).unwrap();
        kernels.increment_u32(&capturing, out.ptr(), N).unwrap();
    }
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    let rounds: u32 = if sanitizer_active() { 4 } else { 25 };
    for round in 0..rounds {
        let pattern: Vec<u32> = (0..N as u32).map(|i| i ^ (round << 20)).collect();
        // Synchronous: after the previous launch on the legacy stream, before this one.
        write_u32(&gpu.context, input.ptr(), &pattern);
        exec.launch(&legacy).unwrap();
        // SAFETY: both hold N u32s; the blocking stream waits for the legacy stream's launch.
        unsafe { copy_dtod_async(seen.ptr(), out.ptr(), N * 4, &blocking) }.unwrap();
        blocking.synchronize().unwrap();
        let host = read_u32(&gpu.context, seen.ptr(), N);
        if let Some(i) = (0..N).find(|&i| host[i] != pattern[i] + 1) {
            panic!(
                "round {round}: element {i} is {:#x}, expected {:#x}",
                host[i],
                pattern[i] + 1
            );
        }
    }
    assert_eq!(exec.launch_count(), u64::from(rounds));
}

/// One executable, captured on a pool stream, replayed round robin on every stream of the pool
/// with no event between the launches: CUDA runs one executable's launches one after another,
/// so its read-modify-write of a shared counter through pool scratch never loses an update.
/// Every stream counts the launches it queued.
#[test]
fn one_executable_replayed_round_robin_on_every_pool_stream_never_overlaps_itself() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("one_executable_replayed_round_robin_on_every_pool_stream_never_overlaps_itself")
    else {
        return;
    };
    const N: usize = 1 << 18;
    let launches: u32 = if sanitizer_active() { 12 } else { 240 };
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let streams: Vec<Arc<PriorityStream>> = pool.streams().cloned().collect();
    assert!(streams.len() >= 2, "the default pool has several streams");
    let origin = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let o = origin.stream();
    let counter = allocator.allocate(N * 4, o).unwrap();
    // SAFETY: N u32s, ordered on `o`.
    unsafe { memset_d32_async(counter.ptr(), 0, N, o) }.unwrap();
    origin.synchronize().unwrap();
    let before: Vec<u64> = streams
        .iter()
        .map(|stream| stream.metrics().unwrap().graph_launches)
        .collect();

    let capture = origin.begin_capture(CaptureOptions::default()).unwrap();
    let scratch = allocator.allocate(N * 4, o).unwrap();
    // SAFETY: both hold N u32s, ordered on `o`: counter += 1 through the scratch.
    unsafe {
        copy_dtod_async(scratch.ptr(), counter.ptr(), N * 4, o).unwrap();
        kernels.spin_ns(o, 50_000).unwrap();
        kernels.increment_u32(o, scratch.ptr(), N).unwrap();
        copy_dtod_async(counter.ptr(), scratch.ptr(), N * 4, o).unwrap();
    }
    drop(scratch);
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    for i in 0..launches as usize {
        streams[i % streams.len()].launch_graph(&exec).unwrap();
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    let host = read_u32(&gpu.context, counter.ptr(), N);
    if let Some(i) = (0..N).find(|&i| host[i] != launches) {
        panic!(
            "element {i} is {}, expected {launches}: two launches overlapped",
            host[i]
        );
    }
    let queued: u64 = streams
        .iter()
        .zip(&before)
        .map(|(stream, before)| stream.metrics().unwrap().graph_launches - before)
        .sum();
    assert_eq!(queued, u64::from(launches));
    assert_eq!(exec.launch_count(), u64::from(launches));
    assert!(pool.has_ready_streams().unwrap());
}

/// PyTorch's default capture mode is `global`: while it runs, any thread's blocking call would
/// invalidate it. Another thread that keeps working on its own stream gets typed refusals for
/// its synchronisations, event queries and blocking copies, can still queue work and allocate
/// (the allocator's miss runs in relaxed mode), and can opt out for a scope with a relaxed
/// `CaptureModeGuard` (what `torch.cuda.graph(capture_error_mode="relaxed")` does for a whole
/// capture). The capture finishes and replays exactly; the other thread's work landed.
#[test]
fn a_global_capture_refuses_another_threads_blocking_calls_until_it_relaxes_and_still_replays() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "a_global_capture_refuses_another_threads_blocking_calls_until_it_relaxes_and_still_replays",
    )
    else {
        return;
    };
    const G: usize = 1 << 14;
    let kit = Kit::load(&gpu.context, G);
    let main = priority_stream(&gpu);
    let other = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let values: Vec<f32> = (0..G).map(input_value).collect();
    let x = DeviceBuffer::from_slice(&gpu.context, &values).unwrap();
    let mut out = allocator.buffer::<f32>(G, main.stream()).unwrap();
    let eager = allocator.allocate(G * 4, &other).unwrap();
    let eager_event = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).unwrap();
    eager_event.record(&other).unwrap();
    other.synchronize().unwrap();

    let capture = main
        .begin_capture(CaptureOptions::default().with_mode(CaptureMode::Global))
        .unwrap();
    let mut scratch = allocator.buffer::<f32>(G, main.stream()).unwrap();
    kit.fill(main.stream(), &mut scratch, 1.0).unwrap();
    kit.saxpy(main.stream(), 2.0, &x, &mut scratch).unwrap();
    main.copy_buffer(&mut out, &scratch).unwrap();
    drop(scratch);
    let outcome = std::thread::scope(|scope| {
        scope
            .spawn(|| -> Result<(), String> {
                let check = |result: Result<(), StreamError>, what: &str| match result {
                    Err(error) if error.is_capture_refusal() => Ok(()),
                    Err(error) => Err(format!("{what}: not a capture refusal: {error}")),
                    Ok(()) => Err(format!("{what}: allowed during a global capture")),
                };
                // SAFETY: `eager` holds G u32s, ordered on `other`.
                unsafe { kernels.fill_u32(&other, eager.ptr(), 5, G) }
                    .map_err(|e| format!("queueing work: {e}"))?;
                check(other.synchronize().map_err(Into::into), "synchronize")?;
                check(eager_event.query().map(drop).map_err(Into::into), "query")?;
                check(
                    eager_event.synchronize().map_err(Into::into),
                    "event synchronize",
                )?;
                let mut host = [0u32; 4];
                // SAFETY: `eager` holds 16 bytes; the copy is refused before it is made.
                let copied =
                    unsafe { copy_dtoh(&gpu.context, host.as_mut_ptr().cast(), eager.ptr(), 16) };
                check(copied.map_err(Into::into), "a synchronous copy")?;
                let fresh = allocator
                    .allocate(5 << 20, &other)
                    .map_err(|e| format!("allocating on another thread: {e}"))?;
                drop(fresh);
                {
                    let _relaxed = CaptureModeGuard::enter(CaptureMode::Relaxed)
                        .map_err(|e| format!("relaxed mode: {e}"))?;
                    other
                        .synchronize()
                        .map_err(|e| format!("relaxed synchronize: {e}"))?;
                    if !eager_event
                        .query()
                        .map_err(|e| format!("relaxed query: {e}"))?
                    {
                        return Err("a synchronised stream's event is not complete".into());
                    }
                }
                check(
                    other.synchronize().map_err(Into::into),
                    "synchronize after relaxing",
                )
            })
            .join()
            .unwrap()
    });
    let graph = capture
        .finish()
        .expect("the other thread's refused calls left the global capture intact");
    outcome.unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        main.launch_graph(&exec).unwrap();
    }
    main.synchronize().unwrap();
    other.synchronize().unwrap();
    assert_exact(
        &bits(&out.to_vec().unwrap()),
        |i| 2.0 * values[i] + 1.0,
        "replay",
    );
    assert!(
        read_u32(&gpu.context, eager.ptr(), G)
            .iter()
            .all(|&v| v == 5)
    );
}

/// cudarc-style: a capture begun with the driver layer's own `begin_capture` (no pool), as a
/// program that drives its streams through raw handles does. The caching allocator refuses to
/// allocate on it (a typed refusal, the capture intact) until the program binds the capture to
/// a pool itself; it then allocates from that pool, ends the capture, keeps the pool alive with
/// the graph, replays exactly, and gets the memory back when the graph and the pool go.
#[test]
fn a_raw_driver_capture_refuses_allocations_until_bound_to_a_pool_by_hand_then_replays() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "a_raw_driver_capture_refuses_allocations_until_bound_to_a_pool_by_hand_then_replays",
    )
    else {
        return;
    };
    const N: usize = 1 << 14;
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let out = allocator.allocate(N * 4, &stream).unwrap();
    stream.synchronize().unwrap();
    let base = settled(&allocator);
    let stranded = stranded_graph_memory();

    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let _ends_on_panic = EndCaptureOnDrop(&stream);
    assert_refusal(
        allocator.allocate(N * 4, &stream),
        "an allocation on a capture with no pool",
    );
    let pool = GraphPool::new();
    let binding = begin_allocate_to_pool(&stream, &pool, MissPolicy::AllocateRelaxed).unwrap();
    let scratch = allocator.allocate(N * 4, &stream).unwrap();
    let scratch_ptr = scratch.ptr();
    // SAFETY: `scratch` and `out` hold N u32s, ordered on `stream`.
    unsafe {
        kernels.fill_u32(&stream, scratch_ptr, 10, N).unwrap();
        kernels.increment_u32(&stream, scratch_ptr, N).unwrap();
        copy_dtod_async(out.ptr(), scratch_ptr, N * 4, &stream).unwrap();
    }
    drop(scratch);
    let mut graph: Graph = stream
        .end_capture()
        .expect("the refused allocation left the capture intact");
    drop(binding);
    graph.keep_alive(pool.keep_alive());
    drop(pool);
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    drop(graph);
    let eager = allocator.allocate(N * 4, &stream).unwrap();
    assert_ne!(eager.ptr(), scratch_ptr, "graph memory went to eager work");
    // SAFETY: `eager` and `out` hold N u32s, ordered on `stream`.
    unsafe {
        kernels.fill_u32(&stream, eager.ptr(), 3, N).unwrap();
        memset_d32_async(out.ptr(), 0, N, &stream).unwrap();
    }
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    assert!(
        read_u32(&gpu.context, out.ptr(), N)
            .iter()
            .all(|&v| v == 11)
    );
    assert!(
        read_u32(&gpu.context, eager.ptr(), N)
            .iter()
            .all(|&v| v == 3)
    );
    drop(eager);
    drop(exec);
    stream.synchronize().unwrap();
    let end = settled(&allocator);
    assert_eq!(end.reserved_bytes.current, base.reserved_bytes.current);
    assert_eq!(end.allocated_bytes.current, base.allocated_bytes.current);
    assert_eq!(stranded_graph_memory(), stranded);
}

/// An executable updated 300 times (`GraphExec::update`) from recaptures that each take a fresh
/// pool (`torch.cuda.graph(g)` with no `pool=`, re-recorded every step with a new scalar): each
/// replay runs the newest parameters, the executable holds a bounded number of old
/// generations, and the dead pools' memory is reused rather than reserved anew.
#[test]
fn three_hundred_updates_from_fresh_pool_recaptures_replay_each_scalar_in_bounded_memory() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "three_hundred_updates_from_fresh_pool_recaptures_replay_each_scalar_in_bounded_memory",
    )
    else {
        return;
    };
    const N: usize = 1 << 14;
    let updates: u32 = if sanitizer_active() { 20 } else { 300 };
    let main = priority_stream(&gpu);
    let s = main.stream();
    let x = allocator.allocate(N * 4, s).unwrap();
    let out = allocator.allocate(N * 4, s).unwrap();
    let values: Vec<f32> = (0..N).map(input_value).collect();
    write_u32(&gpu.context, x.ptr(), &bits(&values));
    let capture_step = |k: u32| -> Graph {
        let capture = main.begin_capture(CaptureOptions::default()).unwrap();
        let scratch = allocator.allocate(N * 4, s).unwrap();
        // SAFETY: every range holds N f32s, ordered on `s`: out = 2x + k.
        unsafe {
            kernels
                .fill_u32(s, scratch.ptr(), (k as f32).to_bits(), N)
                .unwrap();
            kernels
                .saxpy_f32(s, 2.0, x.ptr(), scratch.ptr(), N)
                .unwrap();
            copy_dtod_async(out.ptr(), scratch.ptr(), N * 4, s).unwrap();
        }
        drop(scratch);
        capture.finish().unwrap()
    };
    let check = |k: u32, what: &str| {
        main.synchronize().unwrap();
        assert_exact(
            &read_u32(&gpu.context, out.ptr(), N),
            |i| 2.0 * values[i] + k as f32,
            what,
        );
    };

    let first = capture_step(0);
    let mut exec = first.instantiate(&InstantiateOptions::default()).unwrap();
    drop(first);
    main.launch_graph(&exec).unwrap();
    check(0, "the first capture");
    let mut most_kept = 0;
    let mut reserved_after_warmup = 0;
    for k in 1..=updates {
        let graph = capture_step(k);
        exec.update(&graph).unwrap();
        drop(graph);
        main.launch_graph(&exec).unwrap();
        most_kept = most_kept.max(exec.kept_alive_count());
        if k == 10 {
            main.synchronize().unwrap();
            reserved_after_warmup = allocator.stats().reserved_bytes.current;
        }
        if k % 50 == 0 || k == updates {
            check(k, &format!("after update {k}"));
        }
    }
    assert!(
        most_kept <= 3,
        "the executable held {most_kept} values across updates"
    );
    if updates > 10 {
        let reserved = allocator.stats().reserved_bytes.current;
        assert!(
            reserved <= reserved_after_warmup + (8 << 20),
            "{updates} fresh-pool recaptures kept reserving: {reserved_after_warmup} bytes after \
             10, {reserved} after {updates}"
        );
    }
}

/// vLLM and graph trees keep many graphs alive at once, each in its own pool. 32 captures
/// (each with a 2 MiB large-pool and a 4 KiB small-pool temporary) all alive together, each
/// replayed and checked; then all dropped: the allocator holds exactly what it held before,
/// five rounds in a row, and nothing is stranded.
#[test]
fn thirty_two_live_graphs_each_in_its_own_pool_return_every_byte_when_dropped_five_times() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(
        "thirty_two_live_graphs_each_in_its_own_pool_return_every_byte_when_dropped_five_times",
    )
    else {
        return;
    };
    const LARGE: usize = 2 << 20;
    let (graphs, rounds) = if sanitizer_active() {
        (6u32, 2u32)
    } else {
        (32, 5)
    };
    let main = priority_stream(&gpu);
    let s = main.stream();
    let out = allocator.allocate(graphs as usize * 4, s).unwrap();
    let base = settled(&allocator);
    let stranded = stranded_graph_memory();

    for round in 0..rounds {
        let mut live = Vec::new();
        for k in 0..graphs {
            let capture = main.begin_capture(CaptureOptions::default()).unwrap();
            let large = allocator.allocate(LARGE, s).unwrap();
            let small = allocator.allocate(4096, s).unwrap();
            let value = round * 1000 + k;
            // SAFETY: each range holds what is written, ordered on `s`; slot k of `out` is
            // this graph's.
            unsafe {
                kernels.fill_u32(s, large.ptr(), value, LARGE / 4).unwrap();
                copy_dtod_async(small.ptr(), large.ptr(), 4096, s).unwrap();
                copy_dtod_async(out.ptr() + u64::from(k) * 4, small.ptr(), 4, s).unwrap();
            }
            drop((large, small));
            let graph = capture.finish().unwrap();
            let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
            live.push((graph, exec));
        }
        // SAFETY: `out` holds `graphs` u32s, ordered on `s`.
        unsafe { memset_d32_async(out.ptr(), 0, graphs as usize, s) }.unwrap();
        for (_, exec) in &live {
            main.launch_graph(exec).unwrap();
        }
        main.synchronize().unwrap();
        let expected: Vec<u32> = (0..graphs).map(|k| round * 1000 + k).collect();
        assert_eq!(
            read_u32(&gpu.context, out.ptr(), graphs as usize),
            expected,
            "round {round}"
        );
        assert!(
            allocator.stats().segments.current >= base.segments.current + graphs as usize,
            "round {round}: each live graph holds its own large segment"
        );
        drop(live);
        main.synchronize().unwrap();
        let end = settled(&allocator);
        assert_eq!(
            end.reserved_bytes.current, base.reserved_bytes.current,
            "round {round}: the dropped graphs' pools kept memory"
        );
        assert_eq!(end.segments.current, base.segments.current);
        assert_eq!(end.allocated_bytes.current, base.allocated_bytes.current);
    }
    assert_eq!(stranded_graph_memory(), stranded);
}

/// The mistakes and bad inputs of graph users, each a typed error (never a panic) that leaves
/// everything usable: work queued on a side stream after it joined back (the capture then ends
/// with `UnjoinedFork`), forking the origin into itself, ending the capture on a stream that was
/// only forked into it, binding a pool to a stream that is not capturing, a DOT path with a NUL
/// byte, an update that changes a node's type (refused, the executable unchanged) and one that
/// changes the kernel (taken or refused: the replay says which). An empty capture is a graph
/// that launches.
#[test]
fn graph_mistakes_and_bad_inputs_are_typed_errors_and_leave_everything_usable() {
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture("graph_mistakes_and_bad_inputs_are_typed_errors_and_leave_everything_usable")
    else {
        return;
    };
    const N: usize = 1 << 12;
    let main = priority_stream(&gpu);
    let side = priority_stream(&gpu);
    let s = main.stream();
    let out = allocator.allocate(N * 4, s).unwrap();
    let usable = |stream: &PriorityStream| {
        stream.launch(|raw| kernels.spin_ns(raw, 1000)).unwrap();
        stream.synchronize().unwrap();
        drop(allocator.allocate(1 << 20, stream.stream()).unwrap());
    };

    // Work on the side stream after its join: the capture cannot end cleanly.
    let mut capture = main.begin_capture(CaptureOptions::default()).unwrap();
    let error = capture.fork(s).unwrap_err();
    assert!(
        matches!(error, StreamError::InvalidArgument { .. }),
        "{error}"
    );
    capture.fork(side.stream()).unwrap();
    let error = StreamError::from(side.stream().end_capture().unwrap_err());
    assert!(
        matches!(graph_error(&error), GraphError::NotCapturing { stream, .. } if *stream == side.id()),
        "{error}"
    );
    let scratch = allocator.allocate(N * 4, side.stream()).unwrap();
    // SAFETY: `scratch` holds N u32s, ordered on `side` (the capture is discarded).
    unsafe { kernels.fill_u32(side.stream(), scratch.ptr(), 1, N) }.unwrap();
    drop(scratch);
    capture.join(side.stream()).unwrap();
    assert!(capture.unjoined().is_empty());
    kernels.spin_ns(side.stream(), 1000).unwrap(); // after the join: never joined back
    let error = capture.finish().unwrap_err();
    assert!(
        matches!(graph_error(&error), GraphError::UnjoinedFork),
        "{error}"
    );
    assert_eq!(active_captures(), 0);
    usable(&main);
    usable(&side);

    // Binding a pool to a stream that is not capturing.
    let error = StreamError::from(
        begin_allocate_to_pool(s, &GraphPool::new(), MissPolicy::default()).unwrap_err(),
    );
    assert!(
        matches!(graph_error(&error), GraphError::NotCapturing { .. }),
        "{error}"
    );

    // An empty capture is a graph with no node that launches.
    let empty = main
        .begin_capture(CaptureOptions::default())
        .unwrap()
        .finish()
        .unwrap();
    assert_eq!(empty.node_count().unwrap(), 0);
    main.launch_graph(&empty.instantiate(&InstantiateOptions::default()).unwrap())
        .unwrap();
    main.synchronize().unwrap();

    // A DOT path the driver cannot take.
    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    // SAFETY: `out` holds N u32s, ordered on `s`.
    unsafe { kernels.fill_u32(s, out.ptr(), 7, N) }.unwrap();
    let filled = capture.finish().unwrap();
    let error = filled
        .write_dot(Path::new("cuweave\0graph.dot"), false)
        .unwrap_err();
    assert!(
        matches!(error, DriverError::InvalidArgument { .. }),
        "{error}"
    );

    // Updates: a node of another type is refused, the executable unchanged.
    let mut exec = filled.instantiate(&InstantiateOptions::default()).unwrap();
    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    // SAFETY: as above.
    unsafe { memset_d32_async(out.ptr(), 9, N, s) }.unwrap();
    let memset = capture.finish().unwrap();
    let error = StreamError::from(exec.update(&memset).unwrap_err());
    assert!(
        matches!(graph_error(&error), GraphError::UpdateRejected { .. }),
        "{error}"
    );
    // SAFETY: as above.
    unsafe { memset_d32_async(out.ptr(), 0, N, s) }.unwrap();
    main.launch_graph(&exec).unwrap();
    main.synchronize().unwrap();
    assert!(
        read_u32(&gpu.context, out.ptr(), N).iter().all(|&v| v == 7),
        "a refused update changed the executable"
    );
    // Another kernel in the same node: taken (recent drivers) or refused, never half done.
    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    // SAFETY: as above.
    unsafe { kernels.increment_u32(s, out.ptr(), N) }.unwrap();
    let incremented = capture.finish().unwrap();
    let updated = exec.update(&incremented);
    main.launch_graph(&exec).unwrap();
    main.synchronize().unwrap();
    let expected = match updated {
        Ok(()) => 8,
        Err(error) => {
            let error = StreamError::from(error);
            assert!(
                matches!(graph_error(&error), GraphError::UpdateRejected { .. }),
                "{error}"
            );
            7
        }
    };
    assert!(
        read_u32(&gpu.context, out.ptr(), N)
            .iter()
            .all(|&v| v == expected),
        "the replay after a kernel-changing update"
    );
    usable(&main);
    usable(&side);
}

/// A machine with two GPUs: an executable of device 0 updated with a graph of device 1, and
/// uploaded to a stream of device 1, gets typed errors; it still replays its own graph on
/// device 0, and device 1's graph replays there.
#[test]
fn another_devices_graph_or_stream_is_refused_by_an_executable_which_still_replays() {
    const TEST: &str =
        "another_devices_graph_or_stream_is_refused_by_an_executable_which_still_replays";
    let Some(Fixture {
        gpu,
        kernels,
        allocator,
        _serial,
    }) = fixture(TEST)
    else {
        return;
    };
    let count = Device::count().unwrap();
    if count < 2 {
        skip(TEST, &format!("needs two GPUs, this machine has {count}"));
        return;
    }
    const N: usize = 1 << 12;
    let other = Context::primary(Device::get(1).unwrap()).unwrap();
    let other_kernels = TestKernels::load(&other).unwrap();
    let other_allocator = CachingAllocator::with_driver(&other);
    let main = priority_stream(&gpu);
    let remote = PriorityStream::new(&other, StreamPriority::Normal).unwrap();
    let here = allocator.allocate(N * 4, main.stream()).unwrap();
    let there = other_allocator.allocate(N * 4, remote.stream()).unwrap();

    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    // SAFETY: `here` holds N u32s of device 0, ordered on `main`.
    unsafe { kernels.fill_u32(main.stream(), here.ptr(), 7, N) }.unwrap();
    let local = capture.finish().unwrap();
    let capture = remote.begin_capture(CaptureOptions::default()).unwrap();
    // SAFETY: `there` holds N u32s of device 1, ordered on `remote`.
    unsafe { other_kernels.fill_u32(remote.stream(), there.ptr(), 9, N) }.unwrap();
    let foreign = capture.finish().unwrap();
    let mut exec = local.instantiate(&InstantiateOptions::default()).unwrap();

    let error = exec.update(&foreign).unwrap_err();
    eprintln!("{TEST}: updating with device 1's graph: {error}");
    let error = exec.upload(remote.stream()).unwrap_err();
    assert!(
        matches!(error, DriverError::InvalidArgument { .. }),
        "{error}"
    );
    assert_refusal_free(remote.launch_graph(&exec), "a launch on device 1's stream");
    main.launch_graph(&exec).unwrap();
    main.synchronize().unwrap();
    assert!(
        read_u32(&gpu.context, here.ptr(), N)
            .iter()
            .all(|&v| v == 7)
    );
    let foreign_exec = foreign.instantiate(&InstantiateOptions::default()).unwrap();
    remote.launch_graph(&foreign_exec).unwrap();
    remote.synchronize().unwrap();
    assert!(read_u32(&other, there.ptr(), N).iter().all(|&v| v == 9));
}

/// Ends the raw capture begun on a stream if a failing assertion leaves it running, so that the
/// other tests of this binary do not find a capture active for good.
struct EndCaptureOnDrop<'a>(&'a Stream);

impl Drop for EndCaptureOnDrop<'_> {
    fn drop(&mut self) {
        if self.0.capture_mode().is_some() {
            drop(self.0.end_capture());
        }
    }
}

/// `result` is an error that is not a capture refusal (a bad argument, not "not now").
fn assert_refusal_free<T: std::fmt::Debug>(result: Result<T, StreamError>, what: &str) {
    match result {
        Ok(value) => panic!("{what}: expected an error, got Ok({value:?})"),
        Err(error) => assert!(
            !error.is_capture_refusal(),
            "{what}: a bad argument reported as a capture refusal: {error}"
        ),
    }
}
