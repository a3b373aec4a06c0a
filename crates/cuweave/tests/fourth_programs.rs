//! Fourth round of whole programs through the facade (`cuweave::prelude` first, a layer's module
//! where the prelude stops), aimed at features that meet: a one-rank NCCL all-reduce captured
//! into a cuweave graph and replayed; a capture loop (thread-local and global) on one thread
//! while other threads allocate from the same caching allocator, copy across streams, synchronise
//! and read back, with the frees a capture deferred coming back afterwards; stream-ordered
//! temporaries (graph allocation nodes) inside a replayed step; one executable updated from a
//! fresh capture (and fresh private pool) every cycle while eager buffers churn; the whole
//! training script at once (async weight upload, captured step, profiled replays, coordinated
//! one-rank all-reduce, awaited async download); a GPU-timed profiler over a long
//! run of kernels and graph launches keeping exactly the newest window and never recording work
//! profiled into a capture; borrowed and owned async transfers awaited together in one plain
//! executor after a tracked kernel; a 10^4-step coordinator chain ordering raw, untracked kernels
//! across two pool streams with bounded books; and, without a device, `?` from every layer's
//! error into the layers above and into `Box<dyn Error>`, with capture refusals still
//! recognisable, and the types these programs name reached through the facade.
//!
//! Every GPU test takes `serial()`: they capture graphs, read allocator books or rely on slow
//! kernels.

mod common;

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cuweave::driver::GraphError;
use cuweave::prelude::*;
use cuweave_test_support::{poll_until, require_gpu, sanitizer_active, serial};

use common::{MS, Ops, nccl_or_skip, words};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Asserts every word of `actual` is `expected[i] + added` (wrapping), naming the first that is
/// not.
fn assert_words(actual: &[u32], expected: &[u32], added: u32, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    if let Some(i) = (0..actual.len()).find(|&i| actual[i] != expected[i].wrapping_add(added)) {
        panic!(
            "{what}: element {i} is {:#x}, expected {:#x}",
            actual[i],
            expected[i].wrapping_add(added)
        );
    }
}

/// Runs `f` until it returns something other than a capture refusal ("not now": another
/// thread's global capture is active), for at most 30 s; panics on any other error.
fn retry_refusals<T, E: std::fmt::Debug>(
    what: &str,
    is_refusal: impl Fn(&E) -> bool,
    mut f: impl FnMut() -> Result<T, E>,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match f() {
            Ok(value) => return value,
            Err(error) if is_refusal(&error) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_micros(50));
            }
            Err(error) => panic!("{what}: {error:?}"),
        }
    }
}

/// Counts a finished worker when dropped, also when the worker panics, so the capture loop
/// that waits for the workers cannot outlive a failed one.
struct Finished<'a>(&'a AtomicUsize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Whether a collective error is a capture refusal: `CollectiveError` has no
/// `is_capture_refusal` of its own, so a program must look through each wrapped layer itself.
fn collective_refusal(error: &CollectiveError) -> bool {
    match error {
        CollectiveError::Driver(error) => error.is_capture_refusal(),
        CollectiveError::Memory(error) => error.is_capture_refusal(),
        CollectiveError::Event(error) => error.is_capture_refusal(),
        _ => false,
    }
}

/// As [`collective_refusal`], for the transfer layer's error.
fn transfer_refusal(error: &TransferError) -> bool {
    match error {
        TransferError::Driver(error) => error.is_capture_refusal(),
        TransferError::Memory(error) => error.is_capture_refusal(),
        TransferError::Event(error) => error.is_capture_refusal(),
        _ => false,
    }
}

// ---------------------------------------------------------------------------------------------
// Collectives in graphs
// ---------------------------------------------------------------------------------------------

/// A data-parallel trainer that captures its step, all-reduce included, into a CUDA graph (as
/// PyTorch programs do with NCCL under `torch.cuda.graph` after a warm-up iteration): one rank,
/// an eager warm-up all-reduce, then a capture on a pool stream of `x += 1; y = allreduce(x)`
/// and 60 replays. With one rank the all-reduce is a copy, so after replay `k` the output holds
/// exactly the input plus `k`: a collective recorded into the graph once (or dropped from it)
/// shows as a wrong count. Afterwards the communicator still works eagerly on the same stream.
#[test]
fn a_one_rank_all_reduce_captured_in_a_cuweave_graph_replays_with_every_launch() {
    const TEST: &str =
        "a_one_rank_all_reduce_captured_in_a_cuweave_graph_replays_with_every_launch";
    let gpu = require_gpu!();
    let _serial = serial();
    if !nccl_or_skip(TEST) {
        return;
    }
    const LEN: usize = 1 << 14;
    let replays: u32 = if sanitizer_active() { 4 } else { 60 };
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let id = UniqueId::new().unwrap();
    let comm = Communicator::init_rank(1, 0, &id, gpu.device, &CommConfig::default()).unwrap();

    let input = words(LEN, 77);
    let mut x = DeviceBuffer::from_slice(&gpu.context, &input).unwrap();
    let mut y = DeviceBuffer::<u32>::zeroed(&gpu.context, LEN).unwrap();
    comm.all_reduce(&x, &mut y, ReduceOp::Sum, stream.stream())
        .unwrap();
    comm.synchronize(stream.stream()).unwrap();
    assert_words(&y.to_vec().unwrap(), &input, 0, "the eager warm-up");
    stream.synchronize().unwrap();

    let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
    ops.increment(&stream, &mut x).unwrap();
    if let Err(error) = comm.all_reduce(&x, &mut y, ReduceOp::Sum, stream.stream()) {
        panic!(
            "an all-reduce on a capturing pool stream (capture refusal: {}): {error:?}",
            collective_refusal(&error)
        );
    }
    let graph = capture
        .finish()
        .expect("a capture holding an all-reduce must finish");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for replay in 1..=replays {
        stream.launch_graph(&exec).unwrap();
        if replay % 10 == 0 || replay == replays {
            stream.synchronize().unwrap();
            y.synchronize().unwrap();
            assert_words(
                &y.to_vec().unwrap(),
                &input,
                replay,
                &format!("the all-reduced output after replay {replay}"),
            );
        }
    }
    assert_eq!(exec.launch_count(), u64::from(replays));

    comm.all_reduce_in_place(&mut x, ReduceOp::Max, stream.stream())
        .unwrap();
    comm.synchronize(stream.stream()).unwrap();
    x.synchronize().unwrap();
    assert_words(
        &x.to_vec().unwrap(),
        &input,
        replays,
        "an eager in-place all-reduce after the replays",
    );
    drop((exec, graph));
}

// ---------------------------------------------------------------------------------------------
// Captures beside other threads
// ---------------------------------------------------------------------------------------------

/// An inference server that re-captures its step (shape changes) on the main thread, alternating
/// cuweave's thread-local mode and PyTorch's global mode, while three request threads share the
/// same caching allocator: each allocates a source on one stream of its own, fills it, copies it
/// on a second stream (a cross-stream use, so its free needs an event and is deferred while a
/// capture runs), drops it, synchronises and reads the copy back. Calls a global capture
/// refuses are retried ("not now"). Checks: every capture finishes and its replay is exact,
/// every request reads its own value, and once the threads are done the deferred frees come
/// back: no block stays pending or allocated, and `empty_cache` returns every byte.
#[test]
fn captures_on_one_thread_beside_threads_that_allocate_copy_and_synchronize_stay_exact() {
    let gpu = require_gpu!();
    let _serial = serial();
    const LEN: usize = 1 << 14;
    const WORKERS: usize = 3;
    let requests: usize = if sanitizer_active() { 10 } else { 150 };
    let min_captures: usize = if sanitizer_active() { 4 } else { 20 };
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let capturing = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let finished = AtomicUsize::new(0);
    let mut captures = 0usize;
    // Each request thread's two streams, kept after the threads end: a block freed with a use
    // on another stream waits in its allocation stream's shard, which an allocation on that
    // stream settles.
    let lanes: Vec<[PriorityStream; 2]> = (0..WORKERS)
        .map(|_| {
            [
                PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap(),
                PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap(),
            ]
        })
        .collect();

    std::thread::scope(|scope| {
        for (w, [a, b]) in lanes.iter().enumerate() {
            let (allocator, finished) = (&allocator, &finished);
            scope.spawn(move || {
                let _done = Finished(finished);
                for r in 0..requests {
                    let value = (w * 1_000_000 + r) as u32;
                    let mut src = retry_refusals(
                        "allocate the source",
                        MemoryError::is_capture_refusal,
                        || allocator.buffer::<u32>(LEN, a.stream()),
                    );
                    retry_refusals("fill", StreamError::is_capture_refusal, || {
                        a.fill(&mut src, value)
                    });
                    let mut dst = retry_refusals(
                        "allocate the copy",
                        MemoryError::is_capture_refusal,
                        || allocator.buffer::<u32>(LEN, b.stream()),
                    );
                    retry_refusals("cross-stream copy", StreamError::is_capture_refusal, || {
                        b.copy_buffer(&mut dst, &src)
                    });
                    drop(src);
                    retry_refusals("synchronize", StreamError::is_capture_refusal, || {
                        b.synchronize()
                    });
                    let read = retry_refusals("read back", MemoryError::is_capture_refusal, || {
                        dst.to_vec()
                    });
                    if let Some(i) = read.iter().position(|&v| v != value) {
                        panic!(
                            "worker {w} request {r}: element {i} is {:#x}, expected {value:#x}",
                            read[i]
                        );
                    }
                }
            });
        }

        let input = words(LEN, 5);
        while captures < min_captures || finished.load(Ordering::SeqCst) < WORKERS {
            let mode = if captures.is_multiple_of(2) {
                CaptureMode::ThreadLocal
            } else {
                CaptureMode::Global
            };
            let mut x = allocator.buffer::<u32>(LEN, capturing.stream()).unwrap();
            capturing
                .copy_from_host(&mut x, input.clone())
                .unwrap()
                .wait()
                .unwrap();
            capturing.synchronize().unwrap();
            let capture = capturing
                .begin_capture(CaptureOptions::default().with_mode(mode))
                .unwrap();
            let mut tmp = allocator.buffer::<u32>(LEN, capturing.stream()).unwrap();
            capturing.copy_buffer(&mut tmp, &x).unwrap();
            ops.increment(&capturing, &mut tmp).unwrap();
            let mut out = allocator.buffer::<u32>(LEN, capturing.stream()).unwrap();
            capturing.copy_buffer(&mut out, &tmp).unwrap();
            drop(tmp);
            let graph = match capture.finish() {
                Ok(graph) => graph,
                Err(error) => panic!(
                    "capture {captures} ({mode:?}) beside allocating threads failed: {error:?}"
                ),
            };
            let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
            capturing.launch_graph(&exec).unwrap();
            let result = capturing
                .copy_to_host(&out, vec![0u32; LEN])
                .unwrap()
                .wait()
                .unwrap();
            assert_words(
                &result,
                &input,
                1,
                &format!("capture {captures} ({mode:?})"),
            );
            capturing.synchronize().unwrap();
            drop((exec, graph, out, x));
            captures += 1;
        }
    });

    gpu.context.synchronize().unwrap();
    let settled = poll_until(Duration::from_secs(10), || {
        // The next allocations after the captures carry out what they deferred and settle
        // the finished pending frees of each stream's shard.
        drop(allocator.buffer::<u32>(LEN, capturing.stream()).unwrap());
        for stream in lanes.iter().flatten() {
            drop(allocator.buffer::<u32>(LEN, stream.stream()).unwrap());
        }
        allocator.pending_frees() == 0 && allocator.stats().allocated_bytes.current == 0
    });
    assert!(
        settled,
        "after {captures} captures and every request, {} frees stay pending and {} bytes \
         allocated:\n{}",
        allocator.pending_frees(),
        allocator.stats().allocated_bytes.current,
        allocator.snapshot()
    );
    let returned = poll_until(Duration::from_secs(10), || {
        allocator.empty_cache().is_ok() && allocator.stats().reserved_bytes.current == 0
    });
    assert!(
        returned,
        "every graph and buffer is gone, yet memory stays reserved:\n{}",
        allocator.snapshot()
    );
}

/// A program that re-captures its step for every new input allocation and *updates* one
/// executable instead of instantiating again (CUDA's `cudaGraphExecUpdate` loop), each capture
/// into a fresh private pool, the graph itself dropped right after the update (the executable
/// is what the program keeps). After each replay, eight eager buffers are filled with garbage
/// on the same stream before the output is read: none may land on the live output or on the
/// temporary the executable still writes, and the output is exactly the input plus one. The
/// executable's keep-alives stay bounded, reserved memory stays bounded over 60 cycles (dead
/// pools' segments are reused), and everything goes back once the executable drops.
#[test]
fn an_updated_executable_keeps_its_capture_pools_while_eager_buffers_churn() {
    let gpu = require_gpu!();
    let _serial = serial();
    const LEN: usize = 1 << 16;
    const MIB: usize = 1 << 20;
    let bytes = 4 * LEN;
    let cycles: usize = if sanitizer_active() { 6 } else { 60 };
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let s = stream.stream();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let mut exec: Option<GraphExec> = None;
    let mut max_reserved = 0usize;

    for cycle in 0..cycles {
        let input = words(LEN, 300 + cycle as u64);
        let mut x = allocator.buffer::<u32>(LEN, s).unwrap();
        x.copy_from_host(&input).unwrap();
        s.synchronize().unwrap();
        let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
        let mut tmp = allocator.buffer::<u32>(LEN, s).unwrap();
        stream.copy_buffer(&mut tmp, &x).unwrap();
        ops.increment(&stream, &mut tmp).unwrap();
        let mut out = allocator.buffer::<u32>(LEN, s).unwrap();
        stream.copy_buffer(&mut out, &tmp).unwrap();
        let tmp_at = tmp.device_ptr();
        drop(tmp);
        let graph = capture.finish().unwrap();
        match exec.as_mut() {
            None => exec = Some(graph.instantiate(&InstantiateOptions::default()).unwrap()),
            Some(exec) => {
                if let Err(error) = exec.update(&graph) {
                    panic!(
                        "cycle {cycle}: the same step captured again was not updatable: {error:?}"
                    );
                }
            }
        }
        drop(graph);
        let current = exec.as_ref().unwrap();
        stream.launch_graph(current).unwrap();
        let mut garbage = Vec::new();
        for g in 0..8u32 {
            let mut buffer = allocator.buffer::<u32>(LEN, s).unwrap();
            for (what, at) in [("output", out.device_ptr()), ("temporary", tmp_at)] {
                let (lo, hi) = (buffer.device_ptr(), buffer.device_ptr() + bytes as u64);
                assert!(
                    hi <= at || at + bytes as u64 <= lo,
                    "cycle {cycle}: eager buffer {g} at {lo:#x} overlaps the executable's {what} \
                     at {at:#x}"
                );
            }
            stream.fill(&mut buffer, 0xDEAD_0000 | g).unwrap();
            garbage.push(buffer);
        }
        let result = stream
            .copy_to_host(&out, vec![0u32; LEN])
            .unwrap()
            .wait()
            .unwrap();
        assert_words(&result, &input, 1, &format!("cycle {cycle}"));
        assert!(
            current.kept_alive_count() <= 4,
            "cycle {cycle}: the executable keeps {} generations alive",
            current.kept_alive_count()
        );
        drop((garbage, out, x));
        max_reserved = max_reserved.max(allocator.stats().reserved_bytes.current);
    }
    assert_eq!(exec.as_ref().unwrap().launch_count(), cycles as u64);
    assert!(
        max_reserved <= 96 * MIB,
        "{cycles} cycles of 256 KiB buffers reserved up to {max_reserved} bytes:\n{}",
        allocator.snapshot()
    );
    drop(exec);
    gpu.context.synchronize().unwrap();
    let returned = poll_until(Duration::from_secs(10), || {
        allocator.empty_cache().is_ok() && allocator.stats().reserved_bytes.current == 0
    });
    assert!(
        returned,
        "with the executable and every buffer gone, memory stays reserved:\n{}",
        allocator.snapshot()
    );
}

// ---------------------------------------------------------------------------------------------
// A whole training program
// ---------------------------------------------------------------------------------------------

/// The whole data-parallel training script at once: initial weights uploaded with an awaited
/// async transfer, the step (`w += x; out = (2x + 1) + w`) captured once into a graph and
/// replayed for 100 batches each uploaded on the compute stream, every replay profiled, an
/// `OperationCoordinator` ordering the one-rank all-reduce of the output on a comms stream after
/// the replay and the next replay after the all-reduce (the graph's launches are not tracked
/// per buffer, so only the coordinator orders them), and the reduced output downloaded with an
/// awaited async transfer after awaiting the step's completion. Without NCCL the output itself
/// is downloaded. Checks: every step's output and the final weights are exact, the profiler
/// saw every replay, every operation retires, and the event pool stops making non-timing
/// events after warm-up.
#[test]
fn a_captured_training_step_with_all_reduce_profiler_and_async_io_stays_exact() {
    use common::{N, assert_exact, value};
    let gpu = require_gpu!();
    let _serial = serial();
    let nccl = cuweave::collective::is_available();
    let steps: usize = if sanitizer_active() { 5 } else { 100 };
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let compute = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let comms = pool.get_priority_stream(StreamPriority::High).unwrap();
    assert_ne!(compute.id(), comms.id());
    let c = compute.stream();
    let manager = TransferManager::new().unwrap();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    let events = EventPool::for_context(&gpu.context).unwrap();
    let coordinator = OperationCoordinator::new(events.clone()).unwrap();
    let comm = if nccl {
        let id = UniqueId::new().unwrap();
        Some(Communicator::init_rank(1, 0, &id, gpu.device, &CommConfig::default()).unwrap())
    } else {
        eprintln!("no NCCL: the program downloads the step's output instead of its all-reduce");
        None
    };

    let mut host_w: Vec<f32> = (0..N).map(|i| value(0, i)).collect();
    let mut w = allocator.buffer::<f32>(N, c).unwrap();
    futures::executor::block_on(async {
        manager
            .upload_async(&host_w, &mut w, 0)
            .unwrap()
            .await
            .unwrap();
    });
    let mut x = allocator.buffer::<f32>(N, c).unwrap();
    compute.fill(&mut x, 0.0).unwrap();
    let mut h = allocator.buffer::<f32>(N, c).unwrap();
    let mut out = allocator.buffer::<f32>(N, c).unwrap();
    let mut reduced = allocator.buffer::<f32>(N, comms.stream()).unwrap();
    gpu.context.synchronize().unwrap();

    let capture = compute.begin_capture(CaptureOptions::default()).unwrap();
    ops.step(&compute, &x, &mut w, &mut h, &mut out);
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.upload(c).unwrap();

    let mut previous: Option<OperationId> = None;
    let mut warm_created = None;
    for step in 1..=steps {
        let batch: Vec<f32> = (0..N).map(|i| value(step, i)).collect();
        let upload = compute.copy_from_host(&mut x, batch).unwrap();
        let replay = coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::High,
                Some(c),
                previous.as_slice(),
                format!("step {step}"),
            )
            .unwrap();
        coordinator.begin_operation(replay, &compute).unwrap();
        profiler
            .profile(&compute, "step", OperationKind::GraphLaunch, 0, |s| {
                s.launch_graph(&exec)
            })
            .unwrap();
        coordinator.complete_operation(replay).unwrap();
        let mut last = replay;
        if let Some(comm) = &comm {
            let reduce = coordinator
                .register_operation(
                    OperationType::AllReduce,
                    EventPriority::High,
                    Some(comms.stream()),
                    &[replay],
                    format!("all-reduce {step}"),
                )
                .unwrap();
            coordinator.begin_operation(reduce, &comms).unwrap();
            comm.all_reduce(&out, &mut reduced, ReduceOp::Sum, comms.stream())
                .unwrap();
            coordinator.complete_operation(reduce).unwrap();
            last = reduce;
        }
        previous = Some(last);
        let batch = upload.wait().unwrap();
        for (w, x) in host_w.iter_mut().zip(&batch) {
            *w += x;
        }
        let mut host = vec![0.0f32; N];
        futures::executor::block_on(async {
            coordinator.completion(last).unwrap().await.unwrap();
            let source = if comm.is_some() { &reduced } else { &out };
            manager
                .download_async(source, 0, &mut host)
                .unwrap()
                .await
                .unwrap();
        });
        assert_exact(
            &host,
            |i| 2.0 * batch[i] + 1.0 + host_w[i],
            &format!("step {step}'s output"),
        );
        // Timing events are left out: the profiler holds two per replay until it is read.
        let counters = events.counters();
        let created = counters.created_regular + counters.created_blocking;
        match warm_created {
            None if step == 10 => warm_created = Some(created),
            Some(warm) => assert!(
                created <= warm + 64,
                "step {step}: the event pool made {created} events, {warm} after warm-up"
            ),
            None => {}
        }
    }
    compute.synchronize().unwrap();
    w.synchronize().unwrap();
    let mut final_w = vec![0.0f32; N];
    manager.transfer(&w, &mut final_w).unwrap();
    assert_exact(&final_w, |i| host_w[i], "the final weights");
    let operations = profiler.operations().unwrap();
    assert_eq!(
        operations.len() as u64 + profiler.skipped(),
        steps as u64,
        "every replay is profiled or counted as skipped"
    );
    assert!(
        operations
            .iter()
            .all(|op| op.kind == OperationKind::GraphLaunch)
    );
    assert_eq!(exec.launch_count(), steps as u64);
    if let Some(comm) = &comm {
        comm.synchronize(comms.stream()).unwrap();
    }
    assert!(
        poll_until(Duration::from_secs(10), || coordinator.live_operations()
            == 0),
        "{} operations never retired",
        coordinator.live_operations()
    );
    let expected_ops = if comm.is_some() { 2 * steps } else { steps } as u64;
    assert_eq!(
        (
            coordinator.metrics().completed,
            coordinator.metrics().failed
        ),
        (expected_ops, 0)
    );
}

// ---------------------------------------------------------------------------------------------
// Stream-ordered memory in graphs
// ---------------------------------------------------------------------------------------------

/// `torch.cuda.graph` over the `cudaMallocAsync` backend: a step whose temporary comes from the
/// stream-ordered allocator inside the capture (an allocation node) and is dropped there (a free
/// node): `tmp = x; tmp += 2; out = tmp`. Replayed 200 times on fresh inputs uploaded between
/// replays, each output is exactly the input plus two (each replay allocates and frees its
/// temporary). After the graph is gone the same allocator still serves eager buffers exactly.
#[test]
fn stream_ordered_temporaries_inside_a_captured_step_replay_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    if !gpu.device.capabilities().unwrap().memory_pools_supported {
        cuweave_test_support::skip(
            "stream_ordered_temporaries_inside_a_captured_step_replay_exactly",
            "the device has no memory pools",
        );
        return;
    }
    const LEN: usize = 1 << 15;
    let replays: usize = if sanitizer_active() { 5 } else { 200 };
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let ordered = StreamOrderedAllocator::default();
    let mut x = DeviceBuffer::<u32>::zeroed(&gpu.context, LEN).unwrap();
    let mut out = DeviceBuffer::<u32>::zeroed(&gpu.context, LEN).unwrap();
    stream.synchronize().unwrap();

    let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
    let mut tmp = ordered.buffer::<u32>(&stream, LEN).unwrap();
    stream.copy_buffer(&mut tmp, &x).unwrap();
    ops.increment(&stream, &mut tmp).unwrap();
    ops.increment(&stream, &mut tmp).unwrap();
    stream.copy_buffer(&mut out, &tmp).unwrap();
    drop(tmp);
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    for replay in 0..replays {
        let input = words(LEN, 1000 + replay as u64);
        let upload = stream.copy_from_host(&mut x, input).unwrap();
        stream.launch_graph(&exec).unwrap();
        let download = stream.copy_to_host(&out, vec![0u32; LEN]).unwrap();
        let input = upload.wait().unwrap();
        assert_words(
            &download.wait().unwrap(),
            &input,
            2,
            &format!("replay {replay}"),
        );
    }
    assert_eq!(exec.launch_count(), replays as u64);
    stream.synchronize().unwrap();
    drop((exec, graph));

    let mut eager = ordered.buffer::<u32>(&stream, LEN).unwrap();
    stream.fill(&mut eager, 0x5EED).unwrap();
    stream.synchronize().unwrap();
    assert!(eager.to_vec().unwrap().iter().all(|&v| v == 0x5EED));
}

// ---------------------------------------------------------------------------------------------
// Profiling
// ---------------------------------------------------------------------------------------------

/// A training script's profiler (`torch.profiler` with a bounded buffer) over 1000 iterations
/// of an eager kernel and a graph replay on one pool stream, keeping the newest 256 operations;
/// one increment profiled while the stream captures (recorded into a graph that is never
/// launched). Checks: the counter saw exactly the 2000 increments that ran; the stream counted
/// every graph launch; the profiler kept exactly the newest window (no operation older than the
/// last 128 iterations, none profiled into the capture), counts the rest as evicted or skipped,
/// reports the window's graph launches and kernels, and has nothing pending afterwards.
#[test]
fn a_bounded_profiler_over_kernels_and_graph_replays_keeps_exactly_the_newest_window() {
    let gpu = require_gpu!();
    let _serial = serial();
    const KEPT: usize = 256;
    let iterations: usize = if sanitizer_active() { 200 } else { 1000 };
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let profiler = StreamProfiler::with_limit(&gpu.context, KEPT).unwrap();
    let mut counter = DeviceBuffer::<u32>::zeroed(&gpu.context, 256).unwrap();
    let mut scratch = DeviceBuffer::<u32>::zeroed(&gpu.context, 256).unwrap();
    gpu.context.synchronize().unwrap();

    let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
    ops.increment(&stream, &mut counter).unwrap();
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    // Profiled into a capture: recorded into a graph, never run, so never reported.
    let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
    profiler
        .profile(&stream, "captured", OperationKind::KernelLaunch, 0, |s| {
            ops.increment(s, &mut scratch)
        })
        .unwrap();
    let unlaunched = capture.finish().unwrap();
    drop(unlaunched);
    assert_eq!(profiler.pending(), 0, "a span was queued into the capture");

    let before = stream.metrics().unwrap();
    for i in 0..iterations {
        profiler
            .profile(
                &stream,
                format!("increment {i}"),
                OperationKind::KernelLaunch,
                0,
                |s| ops.increment(s, &mut counter),
            )
            .unwrap();
        profiler
            .profile(
                &stream,
                format!("replay {i}"),
                OperationKind::GraphLaunch,
                0,
                |s| s.launch_graph(&exec),
            )
            .unwrap();
    }
    let operations = profiler.operations().unwrap();
    assert_eq!(profiler.pending(), 0, "operations() waits for every span");
    let total = 2 * iterations as u64;
    let (skipped, evicted) = (profiler.skipped(), profiler.evicted());
    assert_eq!(
        operations.len() as u64 + evicted + skipped,
        total,
        "kept {} + evicted {evicted} + skipped {skipped} must account for {total} operations",
        operations.len()
    );
    assert_eq!(operations.len(), KEPT.min((total - skipped) as usize));
    assert!(
        operations.iter().all(|op| op.name != "captured"),
        "an operation profiled into a capture was reported"
    );
    if skipped == 0 {
        let oldest_kept = iterations - KEPT / 2;
        for op in &operations {
            let i: usize = op
                .name
                .rsplit(' ')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("an operation named {:?}", op.name));
            assert!(
                i >= oldest_kept,
                "{} was kept while newer operations were evicted",
                op.name
            );
        }
    }
    let report = profiler.report().unwrap();
    let graph_ops = operations
        .iter()
        .filter(|op| op.kind == OperationKind::GraphLaunch)
        .count() as u64;
    assert_eq!(report.combined.graph_launches, graph_ops);
    assert_eq!(
        report.combined.kernel_launches + report.combined.graph_launches,
        operations.len() as u64
    );
    assert!(
        operations
            .windows(2)
            .all(|w| w[0].start_ns <= w[1].start_ns),
        "operations are listed by start time"
    );
    let after = stream.metrics().unwrap();
    assert_eq!(
        after.graph_launches - before.graph_launches,
        iterations as u64
    );
    stream.synchronize().unwrap();
    counter.synchronize().unwrap();
    assert!(
        counter
            .to_vec()
            .unwrap()
            .iter()
            .all(|&v| v == 2 * iterations as u32),
        "the counter must see exactly the eager increments and the replays"
    );
    scratch.synchronize().unwrap();
    assert!(
        scratch.to_vec().unwrap().iter().all(|&v| v == 0),
        "the graph that holds the captured increment was never launched"
    );
    assert!(profiler.chrome_trace().unwrap().contains("replay"));
    profiler.clear();
    assert!(profiler.operations().unwrap().is_empty());
    drop((exec, graph));
}

// ---------------------------------------------------------------------------------------------
// Async transfers
// ---------------------------------------------------------------------------------------------

/// A data loader written with `async`: a batch of ragged tensors (1 element to 1 MiB + 3) is
/// uploaded with borrowed async transfers awaited together (`join_all`) in one plain executor,
/// incremented by a kernel on a pool stream that first spins for 5 ms, downloaded the same way,
/// then round-tripped again as owned transfers (the buffers handed back). The downloads must
/// wait for the slow kernel through the buffers' tracking: every element is exactly the input
/// plus one, and the owned round trip returns the same bytes.
#[test]
fn borrowed_and_owned_async_transfers_awaited_together_wait_for_a_slow_kernel() {
    let gpu = require_gpu!();
    let _serial = serial();
    let lens = [1usize, 3, 4097, (1 << 16) + 5, (1 << 18) + 3];
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let manager = TransferManager::new().unwrap();
    let inputs: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| words(len, 40 + i as u64))
        .collect();
    let mut devices: Vec<DeviceBuffer<u32>> = lens
        .iter()
        .map(|&len| DeviceBuffer::<u32>::new(&gpu.context, len).unwrap())
        .collect();

    futures::executor::block_on(async {
        let uploads: Vec<_> = inputs
            .iter()
            .zip(devices.iter_mut())
            .map(|(host, device)| manager.upload_async(host, device, 0).unwrap())
            .collect();
        for (i, report) in futures::future::join_all(uploads)
            .await
            .into_iter()
            .enumerate()
        {
            if let Err(error) = report {
                panic!(
                    "upload {i} ({} elements; capture refusal: {}): {error:?}",
                    lens[i],
                    transfer_refusal(&error)
                );
            }
        }
    });
    ops.spin(&stream, 5 * MS);
    for device in &mut devices {
        ops.increment(&stream, device).unwrap();
    }
    let mut outputs: Vec<Vec<u32>> = lens.iter().map(|&len| vec![0u32; len]).collect();
    futures::executor::block_on(async {
        let downloads: Vec<_> = devices
            .iter()
            .zip(outputs.iter_mut())
            .map(|(device, host)| manager.download_async(device, 0, host).unwrap())
            .collect();
        for report in futures::future::join_all(downloads).await {
            report.unwrap();
        }
    });
    for (i, (output, input)) in outputs.iter().zip(&inputs).enumerate() {
        assert_words(
            output,
            input,
            1,
            &format!("tensor {i} ({} elements)", lens[i]),
        );
    }

    let owned = futures::executor::block_on(async {
        let mut back = Vec::new();
        for (device, input) in devices.into_iter().zip(&inputs) {
            let up = manager.upload_owned(input.clone(), device, 0).await;
            up.result.unwrap();
            let down = manager
                .download_owned(up.device, 0, vec![0u32; input.len()])
                .await;
            down.result.unwrap();
            back.push(down.host);
        }
        back
    });
    for (i, (output, input)) in owned.iter().zip(&inputs).enumerate() {
        assert_words(output, input, 0, &format!("owned round trip {i}"));
    }
}

// ---------------------------------------------------------------------------------------------
// Coordination at scale
// ---------------------------------------------------------------------------------------------

/// A pipeline scheduler (an `OperationCoordinator` chain, 10^4 steps) alternating two pool
/// streams, each step a *raw* kernel pair with no buffer tracking: a watcher that counts a
/// mismatch unless the counter holds exactly the step number, then an increment; every eighth
/// step first spins 20 µs so the other stream would overtake it without the coordinator's
/// wait. Every 1000 steps the program awaits the step's completion and the stream's idle future
/// in a plain executor. Checks: no mismatch and the counter ends at 10^4, every operation
/// completes and retires, live operations and created events stay bounded, and the global
/// waiter has nothing pending at the end.
#[test]
fn ten_thousand_coordinated_raw_steps_across_two_pool_streams_stay_ordered_and_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    let steps: usize = if sanitizer_active() { 300 } else { 10_000 };
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let normal = pool.streams_of(StreamPriority::Normal);
    let streams = [normal[0].clone(), normal[1].clone()];
    assert_ne!(streams[0].id(), streams[1].id());
    let events = EventPool::for_context(&gpu.context).unwrap();
    let coordinator = OperationCoordinator::new(events.clone()).unwrap();
    let waiter = AsyncEventWaiter::global().unwrap();
    let counter = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    let mismatches = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    gpu.context.synchronize().unwrap();
    let (count_at, mismatch_at) = (counter.device_ptr(), mismatches.device_ptr());

    let mut previous: Option<OperationId> = None;
    let mut warm_created = None;
    let mut max_live = 0usize;
    for step in 0..steps {
        let stream = &streams[step % 2];
        let id = coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                Some(stream.stream()),
                previous.as_slice(),
                format!("step {step}"),
            )
            .unwrap();
        coordinator.begin_operation(id, stream).unwrap();
        if step % 8 == 0 {
            ops.spin(stream, 20_000);
        }
        stream
            .launch(|raw| {
                // SAFETY: both buffers hold one u32 of this context and live until the context
                // is synchronised below; the watcher only reads the counter and adds to the
                // mismatch count, the increment writes one element.
                unsafe {
                    ops.test
                        .watch_u32(raw, count_at, 1, step as u32, 0, mismatch_at)?;
                    ops.test.increment_u32(raw, count_at, 1)
                }
            })
            .unwrap();
        coordinator.complete_operation(id).unwrap();
        previous = Some(id);
        max_live = max_live.max(coordinator.live_operations());
        if (step + 1) % 1000 == 0 || step + 1 == steps {
            futures::executor::block_on(async {
                coordinator.completion(id).unwrap().await.unwrap();
                waiter.stream_idle(stream.stream()).unwrap().await.unwrap();
            });
            let counters = events.counters();
            let created =
                counters.created_regular + counters.created_timing + counters.created_blocking;
            match warm_created {
                None => warm_created = Some(created),
                Some(warm) => assert!(
                    created <= warm + 64,
                    "step {step}: the event pool made {created} events, {warm} after the first \
                     thousand steps"
                ),
            }
        }
    }
    gpu.context.synchronize().unwrap();
    assert_eq!(
        mismatches.to_vec().unwrap(),
        vec![0],
        "a step ran before the one it depends on"
    );
    assert_eq!(counter.to_vec().unwrap(), vec![steps as u32]);
    assert!(
        max_live <= 2048,
        "{max_live} operations were live at once in a chain that finishes as it goes"
    );
    assert!(
        poll_until(Duration::from_secs(10), || coordinator.live_operations()
            == 0),
        "{} operations never retired",
        coordinator.live_operations()
    );
    let metrics = coordinator.metrics();
    assert_eq!(
        (metrics.completed, metrics.failed, metrics.cancelled),
        (steps as u64, 0, 0)
    );
    assert!(
        poll_until(Duration::from_secs(10), || waiter.pending() == 0),
        "the waiter still has {} pending waits",
        waiter.pending()
    );
}

// ---------------------------------------------------------------------------------------------
// Without a GPU
// ---------------------------------------------------------------------------------------------

/// The error plumbing of a program written with `?` across layers: a capture refusal raised in
/// the driver layer travels up through a function per layer (memory, stream, event, transfer,
/// collective) and into `Box<dyn Error + Send + Sync>`, as `anyhow`-style programs do. At each
/// step the error is still a capture refusal where the layer can say so, the stream layer still
/// names the `GraphError`, the text still names the refused operation, and the boxed error
/// downcasts back to its layer's type. The memory layer's own refusal (`NotCapturable`) is a
/// refusal through every wrapper too. Needs no device.
#[test]
fn errors_convert_with_question_mark_through_every_layer_and_stay_capture_refusals() {
    fn driver_layer() -> Result<(), DriverError> {
        Err(DriverError::from(GraphError::Capturing {
            operation: "probe_operation",
            reason: "a probe",
        }))
    }
    fn memory_layer() -> Result<(), MemoryError> {
        driver_layer()?;
        Ok(())
    }
    fn stream_layer() -> Result<(), StreamError> {
        memory_layer()?;
        Ok(())
    }
    fn stream_from_driver() -> Result<(), StreamError> {
        driver_layer()?;
        Ok(())
    }
    fn event_layer() -> Result<(), EventError> {
        stream_layer()?;
        Ok(())
    }
    fn transfer_layer() -> Result<(), TransferError> {
        event_layer()?;
        Ok(())
    }
    fn transfer_from_memory() -> Result<(), TransferError> {
        memory_layer()?;
        Ok(())
    }
    fn collective_layer() -> Result<(), CollectiveError> {
        event_layer()?;
        Ok(())
    }
    fn collective_from_memory() -> Result<(), CollectiveError> {
        memory_layer()?;
        Ok(())
    }
    fn program(layer: usize) -> Result<(), Box<dyn Error + Send + Sync>> {
        match layer {
            0 => driver_layer()?,
            1 => memory_layer()?,
            2 => stream_layer()?,
            3 => event_layer()?,
            4 => transfer_layer()?,
            _ => collective_layer()?,
        }
        Ok(())
    }

    assert!(driver_layer().unwrap_err().is_capture_refusal());
    assert!(memory_layer().unwrap_err().is_capture_refusal());
    let stream = stream_layer().unwrap_err();
    assert!(stream.is_capture_refusal(), "{stream:?}");
    assert!(
        matches!(stream.graph_error(), Some(GraphError::Capturing { .. })),
        "{stream:?}"
    );
    assert!(matches!(
        stream_from_driver().unwrap_err().graph_error(),
        Some(GraphError::Capturing { .. })
    ));
    let event = event_layer().unwrap_err();
    assert!(event.is_capture_refusal(), "{event:?}");
    assert!(transfer_refusal(&transfer_layer().unwrap_err()));
    assert!(transfer_refusal(&transfer_from_memory().unwrap_err()));
    assert!(collective_refusal(&collective_layer().unwrap_err()));
    assert!(collective_refusal(&collective_from_memory().unwrap_err()));

    for layer in 0..6 {
        let boxed = program(layer).unwrap_err();
        assert!(
            boxed.to_string().contains("probe_operation"),
            "layer {layer}: the text lost the refused operation: {boxed}"
        );
        let downcast = match layer {
            0 => boxed.downcast_ref::<DriverError>().is_some(),
            1 => boxed.downcast_ref::<MemoryError>().is_some(),
            2 => boxed.downcast_ref::<StreamError>().is_some(),
            3 => boxed.downcast_ref::<EventError>().is_some(),
            4 => boxed.downcast_ref::<TransferError>().is_some(),
            _ => boxed.downcast_ref::<CollectiveError>().is_some(),
        };
        assert!(
            downcast,
            "layer {layer}: the box does not hold its layer's error"
        );
    }

    // The memory layer's own refusal, wrapped by the layers above.
    let not_capturable = MemoryError::NotCapturable {
        operation: "probe_upload",
        reason: "a pageable source",
    };
    assert!(not_capturable.is_capture_refusal());
    let stream = StreamError::from(not_capturable.clone());
    assert!(stream.is_capture_refusal());
    let event = EventError::from(stream);
    assert!(event.is_capture_refusal());
    assert!(transfer_refusal(&TransferError::from(event.clone())));
    assert!(collective_refusal(&CollectiveError::from(event)));
    assert!(transfer_refusal(&TransferError::from(not_capturable)));

    // An error that is not a refusal stays one that is not, through every wrapper.
    let zero = MemoryError::ZeroLength { operation: "probe" };
    assert!(!StreamError::from(zero.clone()).is_capture_refusal());
    assert!(!EventError::from(StreamError::from(zero.clone())).is_capture_refusal());
    assert!(!collective_refusal(&CollectiveError::from(zero)));
}

/// The setup of a program that captures with a warmed pool only (PyTorch's
/// `capture_error_mode`-style strictness) and reads the profiler's, waiter's and coordinator's
/// books: every type it names is reached through the facade (a compile-time check that the
/// re-exports cover them), and the capture options built from them say what was asked. Needs
/// no device.
#[test]
fn the_facade_reaches_the_types_of_capture_profiling_and_coordination_programs() {
    use cuweave::memory::caching::MissPolicy;

    let options = CaptureOptions::default()
        .with_mode(CaptureMode::Global)
        .with_misses(MissPolicy::Fail)
        .with_pool(&GraphPool::new());
    assert_eq!(options.mode, CaptureMode::Global);
    assert_eq!(options.misses, MissPolicy::Fail);
    assert!(options.pool.is_some());
    assert_eq!(
        CaptureOptions::default().misses,
        MissPolicy::AllocateRelaxed,
        "a capture may allocate on a miss unless told otherwise"
    );

    fn named<T: ?Sized>() -> &'static str {
        std::any::type_name::<T>()
    }
    let names = [
        (named::<MissPolicy>(), "cuweave_memory"),
        (named::<cuweave::stream::ProfileReport>(), "cuweave_stream"),
        (
            named::<cuweave::stream::ProfiledOperation>(),
            "cuweave_stream",
        ),
        (named::<cuweave::stream::CombinedReport>(), "cuweave_stream"),
        (
            named::<cuweave::stream::StreamOrderedAllocatorConfig>(),
            "cuweave_stream",
        ),
        (named::<cuweave::event::WaitOptions>(), "cuweave_event"),
        (named::<cuweave::event::WaiterStats>(), "cuweave_event"),
        (
            named::<cuweave::event::CoordinatorMetrics>(),
            "cuweave_event",
        ),
        (named::<cuweave::driver::CaptureStatus>(), "cuweave_driver"),
        (named::<cuweave::driver::PoolCounters>(), "cuweave_driver"),
        (named::<cuweave::collective::F16>(), "cuweave_collective"),
        (named::<cuweave::transfer::PathStats>(), "cuweave_transfer"),
        (named::<Owned<u32>>(), "cuweave_transfer"),
        (named::<OwnedTransfer<u32>>(), "cuweave_transfer"),
        (named::<AsyncTransfer<'static, u32>>(), "cuweave_transfer"),
    ];
    for (name, layer) in names {
        assert!(name.starts_with(layer), "{name} is not from {layer}");
    }
    // What a profiled program reads back, built without a device.
    let report = cuweave::stream::ProfileReport::from_operations(&[]);
    assert_eq!(
        (report.combined.operations, report.combined.graph_launches),
        (0, 0)
    );
    assert!(report.streams.is_empty());
}
