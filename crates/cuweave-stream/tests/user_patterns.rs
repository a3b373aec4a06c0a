//! What PyTorch users of streams and CUDA graphs do daily, written against this crate: priority
//! streams, a stream pool shared by many threads, `wait_stream`-style dependencies proven with a
//! spinning kernel, `torch.cuda.graph`-style capture (warm-up on a side stream, a step whose
//! scratch comes from the capture's private pool, replays with new inputs copied into static
//! buffers, two graphs sharing one pool, replays after the static tensors are dropped), captures
//! beside eager work on other threads and other pool streams, the stream-ordered allocator in a
//! long loop and the profiler over many iterations.
//!
//! Every GPU test takes `serial()`: captures change what the whole process may do while they
//! run, and the ordering proofs need the GPU to themselves.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cuweave_driver::InstantiateOptions;
use cuweave_driver::graph::CaptureMode;
use cuweave_driver::memory::{address_range, copy_dtod_async};
use cuweave_memory::caching::{CachingAllocator, GraphPool};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer};
use cuweave_stream::capture::{CaptureOptions, StreamCapture};
use cuweave_stream::{
    AllocationStrategy, MultiStreamCoordinator, OperationKind, PriorityStream, StreamError,
    StreamOrderedAllocator, StreamPool, StreamPoolConfig, StreamPriority, StreamProfiler,
    WorkloadType,
};
use cuweave_test_support::{serial, skip_under_sanitizer};

mod common;
use common::Kit;

const G: usize = 1 << 14; // elements of the graph tests' tensors
const MS: u64 = 1_000_000;

/// The "model step" of the graph tests: `out = 2 * x + 1`, with its scratch tensor allocated
/// from `allocator` on `stream` (the capture's private pool while `stream` captures) and freed
/// inside the step.
fn step(
    kit: &Kit,
    allocator: &CachingAllocator,
    stream: &PriorityStream,
    x: &DeviceBuffer<f32>,
    out: &mut DeviceBuffer<f32>,
) -> Result<(), StreamError> {
    let mut scratch = allocator.buffer::<f32>(G, stream.stream())?;
    stream.enqueue(OperationKind::KernelLaunch, 0, |s| {
        kit.fill(s, &mut scratch, 1.0)
    })?;
    stream.enqueue(OperationKind::KernelLaunch, 0, |s| {
        kit.saxpy(s, 2.0, x, &mut scratch)
    })?;
    stream.copy_buffer(out, &scratch)?;
    drop(scratch);
    Ok(())
}

/// Small integers, so that `2x + 1` and friends are exact in `f32`.
fn input(round: usize) -> Vec<f32> {
    (0..G).map(|j| ((round * 7 + j) % 1000) as f32).collect()
}

fn assert_bits(actual: &[f32], expected: impl Fn(usize) -> f32, what: &str) {
    assert_eq!(actual.len(), G);
    if let Some((i, value)) = actual
        .iter()
        .enumerate()
        .find(|(i, value)| value.to_bits() != expected(*i).to_bits())
    {
        panic!("{what}: element {i} is {value}, expected {}", expected(i));
    }
}

fn assert_capture_refusal<T: std::fmt::Debug>(result: Result<T, StreamError>, what: &str) {
    let error = result.expect_err(what);
    assert!(
        error.is_capture_refusal(),
        "{what}: expected a capture refusal, got {error}"
    );
}

#[test]
fn priority_streams_use_the_device_range_and_high_priority_work_finishes_beside_busy_low_work() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "priority_streams_use_the_device_range_and_high_priority_work_finishes_beside_busy_low_work",
        "needs two streams at once",
    ) {
        return;
    }
    let kit = Kit::load(&gpu.context, G);
    let range = gpu.context.stream_priority_range().unwrap();
    let (least, greatest) = (range.least, range.greatest);
    let high = PriorityStream::new(&gpu.context, StreamPriority::High).unwrap();
    let low = PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap();
    assert_eq!(high.driver_priority(), greatest);
    assert_eq!(low.driver_priority(), least);
    assert!(high.driver_priority() <= low.driver_priority());

    let mut out = DeviceBuffer::<f32>::new(&gpu.context, G).unwrap();
    low.launch(|s| kit.test.spin_ns(s, 300 * MS)).unwrap();
    high.enqueue(OperationKind::KernelLaunch, 0, |s| {
        kit.fill(s, &mut out, 5.0)
    })
    .unwrap();
    let started = Instant::now();
    let host = high
        .copy_to_host(&out, vec![0f32; G])
        .unwrap()
        .wait()
        .unwrap();
    assert_bits(&host, |_| 5.0, "high-priority fill");
    assert!(
        !low.is_ready().unwrap(),
        "the high-priority stream finished while the low one still spins (after {:?})",
        started.elapsed()
    );
    assert_eq!(high.metrics().unwrap().kernel_launches, 1);
    low.synchronize().unwrap();
    assert!(low.is_ready().unwrap());
    assert_eq!(low.outstanding_work().unwrap(), 0);
}

#[test]
fn a_pool_shared_by_many_threads_hands_out_working_streams_under_every_strategy() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let strategies = [
        AllocationStrategy::RoundRobin,
        AllocationStrategy::LoadBalanced,
        AllocationStrategy::Priority,
        AllocationStrategy::Workload,
    ];
    for strategy in strategies {
        pool.set_strategy(strategy);
        std::thread::scope(|scope| {
            for t in 0..8u32 {
                let pool = &pool;
                scope.spawn(move || {
                    for i in 0..50u32 {
                        let stream = pool.get_stream().unwrap();
                        assert!(pool.contains(&stream), "{strategy:?}");
                        assert_eq!(stream.device(), gpu.device);
                        let level = [
                            StreamPriority::High,
                            StreamPriority::Normal,
                            StreamPriority::Low,
                        ][(i % 3) as usize];
                        let urgent = pool.get_priority_stream(level).unwrap();
                        assert_eq!(urgent.priority(), level);
                        let memory = pool.get_stream_for_workload(WorkloadType::Memory).unwrap();
                        assert_eq!(memory.priority(), StreamPriority::Low);
                        if i % 10 == 0 {
                            let value = t * 1000 + i;
                            let mut buffer = DeviceBuffer::<u32>::new_on(&stream, 1024).unwrap();
                            stream.fill(&mut buffer, value).unwrap();
                            let host = stream
                                .copy_to_host(&buffer, vec![0u32; 1024])
                                .unwrap()
                                .wait()
                                .unwrap();
                            assert!(host.iter().all(|&v| v == value), "{strategy:?}");
                        }
                    }
                });
            }
        });
    }
    for stream in pool.streams() {
        stream.synchronize().unwrap();
    }
    assert!(pool.has_ready_streams().unwrap());
}

#[test]
fn waiting_for_a_ready_stream_times_out_with_none_while_spins_keep_every_stream_busy() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::default().with_counts(1, 1, 1),
    )
    .unwrap();
    for stream in pool.streams() {
        stream.launch(|s| kit.test.spin_ns(s, 250 * MS)).unwrap();
    }
    assert!(!pool.has_ready_streams().unwrap());
    let started = Instant::now();
    let found = pool.wait_for_any_ready(Duration::from_millis(30)).unwrap();
    let waited = started.elapsed();
    assert!(found.is_none(), "every stream spins for 250 ms");
    assert!(waited >= Duration::from_millis(30), "{waited:?}");
    // "As long as it takes", as a user writes it.
    let found = pool.wait_for_any_ready(Duration::MAX).unwrap();
    let stream = found.expect("a stream is ready once its spin ends");
    assert!(stream.is_ready().unwrap());
    for stream in pool.streams() {
        stream.synchronize().unwrap();
    }
}

/// A pool stream captured (and another forked into the capture) on one thread while another
/// thread asks the same pool for ready and idle streams: the capturing streams are neither
/// ready nor idle (their work is recorded, not run), the others are handed out, and the graph
/// the capture made replays correctly.
#[test]
fn pool_streams_capturing_on_another_thread_are_skipped_as_ready_and_idle_streams() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::default()
            .with_counts(1, 2, 0)
            .with_compute_streams(1),
    )
    .unwrap();
    let origin = Arc::clone(&pool.streams_of(StreamPriority::High)[0]);
    let forked = Arc::clone(&pool.streams_of(StreamPriority::Normal)[0]);
    let free = Arc::clone(&pool.streams_of(StreamPriority::Normal)[1]);
    let x = DeviceBuffer::from_slice(&gpu.context, &input(3)).unwrap();
    let mut out = allocator.buffer::<f32>(G, origin.stream()).unwrap();
    let captured = Barrier::new(2);
    let checked = Barrier::new(2);

    let graph = std::thread::scope(|scope| {
        let capturer = scope.spawn(|| {
            // Both barriers are passed whatever fails, so the other thread never hangs.
            let begun = StreamCapture::begin(origin.stream(), CaptureOptions::default())
                .and_then(|mut capture| capture.fork(forked.stream()).map(|()| capture));
            captured.wait();
            checked.wait();
            let mut capture = begun?;
            step(&kit, &allocator, &origin, &x, &mut out)?;
            forked.launch(|s| kit.test.spin_ns(s, 1000))?;
            capture.join(forked.stream())?;
            capture.finish()
        });
        captured.wait();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let capturing = [origin.id(), forked.id()];
            assert!(pool.has_ready_streams().unwrap());
            let ready = pool
                .wait_for_any_ready(Duration::from_secs(5))
                .unwrap()
                .expect("the idle stream is ready");
            assert_eq!(ready.id(), free.id());
            for strategy in [
                AllocationStrategy::Priority,
                AllocationStrategy::LoadBalanced,
            ] {
                pool.set_strategy(strategy);
                for _ in 0..4 {
                    let stream = pool.get_stream().unwrap();
                    assert!(
                        !capturing.contains(&stream.id()),
                        "{strategy:?} handed out a stream that is capturing on another thread"
                    );
                }
            }
        }));
        checked.wait();
        let graph = capturer.join().unwrap();
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
        graph
    })
    .unwrap();

    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    origin.launch_graph(&exec).unwrap();
    let host = origin
        .copy_to_host(&out, vec![0f32; G])
        .unwrap()
        .wait()
        .unwrap();
    let x_host = input(3);
    assert_bits(
        &host,
        |i| 2.0 * x_host[i] + 1.0,
        "replay of the pool capture",
    );
}

/// Inside a capture, a side stream taken from the pool (PyTorch: `torch.cuda.Stream()` in a
/// `torch.cuda.graph` block, then `wait_stream`) under the strategies that read queued work:
/// the capturing thread may not query events, so the pool hands out a stream that is not
/// capturing instead of failing; forked in and joined back it is part of the graph.
#[test]
fn a_side_stream_taken_from_a_load_balanced_pool_inside_a_capture_joins_the_graph() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced).with_counts(1, 3, 0),
    )
    .unwrap();
    let origin = pool.get_stream().unwrap();
    // Eager work on every stream, so each has markers the strategies would query.
    let mut warm = DeviceBuffer::<u32>::new(&gpu.context, 1024).unwrap();
    for stream in pool.streams() {
        stream.fill(&mut warm, 1).unwrap();
    }
    let mut out = allocator.buffer::<f32>(G, origin.stream()).unwrap();

    let mut capture = origin.begin_capture(CaptureOptions::default()).unwrap();
    let mut sides = Vec::new();
    for strategy in [
        AllocationStrategy::LoadBalanced,
        AllocationStrategy::Priority,
    ] {
        pool.set_strategy(strategy);
        sides.push((strategy, pool.get_stream()));
    }
    let (_, side) = sides.remove(0);
    let (_, urgent) = sides.remove(0);
    let (side, urgent) = match (side, urgent) {
        (Ok(side), Ok(urgent)) => (side, urgent),
        (side, urgent) => {
            drop(capture);
            panic!("get_stream inside a capture failed: {side:?} / {urgent:?}");
        }
    };
    assert_ne!(
        side.id(),
        origin.id(),
        "LoadBalanced handed out the capturing stream"
    );
    assert_ne!(
        urgent.id(),
        origin.id(),
        "Priority handed out the capturing stream"
    );
    assert_eq!(urgent.priority(), StreamPriority::High);
    capture.fork(side.stream()).unwrap();
    let mut a = allocator.buffer::<f32>(G, side.stream()).unwrap();
    side.enqueue(OperationKind::KernelLaunch, 0, |s| kit.fill(s, &mut a, 4.0))
        .unwrap();
    capture.join(side.stream()).unwrap();
    origin.copy_buffer(&mut out, &a).unwrap();
    drop(a);
    let graph = capture.finish().unwrap();

    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    origin.launch_graph(&exec).unwrap();
    let host = origin
        .copy_to_host(&out, vec![0f32; G])
        .unwrap()
        .wait()
        .unwrap();
    assert_bits(&host, |_| 4.0, "the side stream's work replayed");
}

/// torch.cuda.graph as its tutorial writes it: static input and output tensors, three warm-up
/// steps on a side stream that waits for the current one, a capture whose scratch comes from
/// the private pool, then 1000 replays, each after copying a new input into the static input.
/// After the static tensors are dropped the graph still replays into memory that eager
/// allocations never receive.
#[test]
fn a_torch_style_graph_warms_up_on_a_side_stream_and_replays_1000_new_inputs_exactly() {
    torch_style_graph(
        "a_torch_style_graph_warms_up_on_a_side_stream_and_replays_1000_new_inputs_exactly",
        CaptureMode::ThreadLocal,
    );
}

/// The same with PyTorch's default capture mode, `global`: nothing the step does on the
/// capturing thread (private-pool misses, tracked launches, copies) may break it.
#[test]
fn a_torch_style_graph_captured_in_global_mode_replays_exactly() {
    torch_style_graph(
        "a_torch_style_graph_captured_in_global_mode_replays_exactly",
        CaptureMode::Global,
    );
}

fn torch_style_graph(test: &str, mode: CaptureMode) {
    let Some(gpu) = cuweave_test_support::gpu(test) else {
        return;
    };
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let main = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let side = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let mut static_in = allocator.buffer::<f32>(G, main.stream()).unwrap();
    let mut static_out = allocator.buffer::<f32>(G, main.stream()).unwrap();
    main.copy_from_host(&mut static_in, input(0))
        .unwrap()
        .wait()
        .unwrap();

    side.wait_for(&main).unwrap();
    for _ in 0..3 {
        step(&kit, &allocator, &side, &static_in, &mut static_out).unwrap();
    }
    main.wait_for(&side).unwrap();

    let capture = main
        .begin_capture(CaptureOptions::default().with_mode(mode))
        .unwrap();
    step(&kit, &allocator, &main, &static_in, &mut static_out).unwrap();
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.upload(main.stream()).unwrap();
    let launches_before = main.metrics().unwrap().graph_launches;

    for round in 1..=1000 {
        let x = input(round);
        main.copy_from_host(&mut static_in, x.clone())
            .unwrap()
            .wait()
            .unwrap();
        main.launch_graph(&exec).unwrap();
        if round % 100 == 0 {
            let host = main
                .copy_to_host(&static_out, vec![0f32; G])
                .unwrap()
                .wait()
                .unwrap();
            assert_bits(&host, |i| 2.0 * x[i] + 1.0, &format!("replay {round}"));
        }
    }
    assert_eq!(
        main.metrics().unwrap().graph_launches - launches_before,
        1000
    );

    // The static tensors go away while the graph lives: their memory stays the graph's.
    let (in_ptr, out_ptr) = (static_in.device_ptr(), static_out.device_ptr());
    drop(static_in);
    drop(static_out);
    let mut eager: Vec<DeviceBuffer<f32>> = Vec::new();
    for _ in 0..8 {
        let mut buffer = allocator.buffer::<f32>(G, main.stream()).unwrap();
        assert_ne!(
            buffer.device_ptr(),
            in_ptr,
            "graph input handed to eager work"
        );
        assert_ne!(
            buffer.device_ptr(),
            out_ptr,
            "graph output handed to eager work"
        );
        main.fill(&mut buffer, -1.0).unwrap();
        eager.push(buffer);
    }
    for _ in 0..10 {
        main.launch_graph(&exec).unwrap();
    }
    main.synchronize().unwrap();
    for buffer in &eager {
        assert_bits(
            &buffer.to_vec().unwrap(),
            |_| -1.0,
            "eager memory beside replays",
        );
    }
    drop(exec);
    drop(graph);
    drop(eager);
    main.synchronize().unwrap();
    allocator.empty_cache().unwrap();
}

/// A graph whose input and output go through pinned host buffers (PyTorch: `static_in.copy_(
/// pinned, non_blocking=True)` inside the captured step): the host copies are captured too, so
/// each replay reads whatever the host last wrote into the pinned input and writes the pinned
/// output. The copies' receipts cannot be waited for inside the capture and are dropped there.
#[test]
fn a_graph_with_pinned_host_input_and_output_copies_replays_new_host_data() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let main = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let mut pinned_in = PinnedBuffer::<f32>::from_slice(&gpu.context, &input(0)).unwrap();
    let mut pinned_out = PinnedBuffer::<f32>::zeroed(&gpu.context, G).unwrap();
    let mut static_in = allocator.buffer::<f32>(G, main.stream()).unwrap();
    let mut static_out = allocator.buffer::<f32>(G, main.stream()).unwrap();

    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    drop(main.copy_from_host(&mut static_in, &pinned_in).unwrap());
    step(&kit, &allocator, &main, &static_in, &mut static_out).unwrap();
    drop(main.copy_to_host(&static_out, &mut pinned_out).unwrap());
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();

    for round in 1..=200 {
        let x = input(round);
        pinned_in.as_mut_slice().unwrap().copy_from_slice(&x);
        main.launch_graph(&exec).unwrap();
        main.synchronize().unwrap();
        assert_bits(
            &pinned_out.as_slice().unwrap(),
            |i| 2.0 * x[i] + 1.0,
            &format!("round {round}"),
        );
    }
}

/// Two graphs captured in a row into one shared pool (PyTorch's `graph_pool_handle()`), the
/// first one's output tensor consumed by the second, the cache emptied of everything else while
/// they live, the intermediate tensor dropped; replayed in capture order with new inputs the
/// results stay exact, and dropping the graphs gives the memory back.
#[test]
fn two_graphs_sharing_a_pool_replay_in_order_after_the_cache_is_emptied_and_then_free_it() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let main = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let mut x = allocator.buffer::<f32>(G, main.stream()).unwrap();
    let mut out = allocator.buffer::<f32>(G, main.stream()).unwrap();
    main.copy_from_host(&mut x, input(0))
        .unwrap()
        .wait()
        .unwrap();
    let pool = GraphPool::new();

    // Graph 1: a = 2x + 3, `a` allocated inside the capture and kept as its output.
    let capture = main
        .begin_capture(CaptureOptions::default().with_pool(&pool))
        .unwrap();
    let mut a = allocator.buffer::<f32>(G, main.stream()).unwrap();
    main.enqueue(OperationKind::KernelLaunch, 0, |s| kit.fill(s, &mut a, 3.0))
        .unwrap();
    main.enqueue(OperationKind::KernelLaunch, 0, |s| {
        kit.saxpy(s, 2.0, &x, &mut a)
    })
    .unwrap();
    let first_graph = capture.finish().unwrap();

    // Graph 2: out = 0.5 a + 1 = x + 2.5, its scratch from the same pool.
    let capture = main
        .begin_capture(CaptureOptions::default().with_pool(&pool))
        .unwrap();
    let mut b = allocator.buffer::<f32>(G, main.stream()).unwrap();
    main.enqueue(OperationKind::KernelLaunch, 0, |s| kit.fill(s, &mut b, 1.0))
        .unwrap();
    main.enqueue(OperationKind::KernelLaunch, 0, |s| {
        kit.saxpy(s, 0.5, &a, &mut b)
    })
    .unwrap();
    main.copy_buffer(&mut out, &b).unwrap();
    drop(b);
    let second_graph = capture.finish().unwrap();
    drop(pool);

    let first = first_graph
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    let second = second_graph
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    drop(a);
    main.synchronize().unwrap();
    allocator.empty_cache().unwrap();
    let held = allocator.stats().reserved_bytes.current;
    assert!(held > 0, "the graphs' pool keeps its memory");

    for round in 1..=50 {
        let host_x = input(round);
        main.copy_from_host(&mut x, host_x.clone())
            .unwrap()
            .wait()
            .unwrap();
        main.launch_graph(&first).unwrap();
        main.launch_graph(&second).unwrap();
        let host = main
            .copy_to_host(&out, vec![0f32; G])
            .unwrap()
            .wait()
            .unwrap();
        assert_bits(&host, |i| host_x[i] + 2.5, &format!("round {round}"));
    }

    drop(first);
    drop(second);
    drop(first_graph);
    drop(second_graph);
    main.synchronize().unwrap();
    allocator.empty_cache().unwrap();
    let after = allocator.stats().reserved_bytes.current;
    assert!(
        after < held,
        "dropping the graphs returns their pool: {held} bytes held before, {after} after"
    );
}

/// A graph outlives the caching allocator its scratch came from (the allocator, its cache
/// emptied, is dropped): the graph's private memory must not be returned under it. Checked
/// first with `cuMemGetAddressRange` on the scratch's address (so that a failure never
/// replays into freed memory), then by replaying with new inputs beside eager allocations.
#[test]
fn a_graph_replays_exactly_after_the_allocator_its_scratch_came_from_is_dropped() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let main = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let mut x = DeviceBuffer::<f32>::new(&gpu.context, G).unwrap();
    let mut out = DeviceBuffer::<f32>::new(&gpu.context, G).unwrap();
    main.copy_from_host(&mut x, input(0))
        .unwrap()
        .wait()
        .unwrap();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    let mut scratch = allocator.buffer::<f32>(G, main.stream()).unwrap();
    let scratch_ptr = scratch.device_ptr();
    main.enqueue(OperationKind::KernelLaunch, 0, |s| {
        kit.fill(s, &mut scratch, 1.0)
    })
    .unwrap();
    main.enqueue(OperationKind::KernelLaunch, 0, |s| {
        kit.saxpy(s, 2.0, &x, &mut scratch)
    })
    .unwrap();
    main.copy_buffer(&mut out, &scratch).unwrap();
    drop(scratch);
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    drop(graph);
    let mapped = address_range(&gpu.context, scratch_ptr).unwrap();
    allocator.empty_cache().unwrap();
    drop(allocator);
    assert_eq!(
        address_range(&gpu.context, scratch_ptr).ok(),
        Some(mapped),
        "dropping the allocator freed the memory a live graph replays into"
    );

    // Eager allocations meanwhile, filled with a sentinel the replays must not touch.
    let mut eager: Vec<DeviceBuffer<f32>> = (0..8)
        .map(|_| DeviceBuffer::<f32>::new_on(main.stream(), G).unwrap())
        .collect();
    for buffer in &mut eager {
        main.fill(buffer, -3.0).unwrap();
    }
    for round in 1..=100 {
        let host_x = input(round);
        main.copy_from_host(&mut x, host_x.clone())
            .unwrap()
            .wait()
            .unwrap();
        main.launch_graph(&exec).unwrap();
        if round % 25 == 0 {
            let host = main
                .copy_to_host(&out, vec![0f32; G])
                .unwrap()
                .wait()
                .unwrap();
            assert_bits(&host, |i| 2.0 * host_x[i] + 1.0, &format!("round {round}"));
        }
    }
    main.synchronize().unwrap();
    for buffer in &eager {
        assert_bits(&buffer.to_vec().unwrap(), |_| -3.0, "eager memory");
    }
    drop(exec);
}

/// What a user hits by mistake inside a capture (a blocking synchronize, a readiness query, a
/// host callback, a blocking read of a captured tensor) is a typed refusal that leaves the
/// capture intact: it finishes and replays exactly.
#[test]
fn blocking_calls_inside_a_capture_are_typed_refusals_and_the_capture_still_replays() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let main = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let x = DeviceBuffer::from_slice(&gpu.context, &input(5)).unwrap();
    let mut out = allocator.buffer::<f32>(G, main.stream()).unwrap();

    let capture = main.begin_capture(CaptureOptions::default()).unwrap();
    step(&kit, &allocator, &main, &x, &mut out).unwrap();
    assert_capture_refusal(main.synchronize(), "synchronize");
    assert_capture_refusal(main.is_ready(), "is_ready");
    let ran = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    assert_capture_refusal(
        main.add_callback(move || flag.store(true, Ordering::SeqCst)),
        "add_callback",
    );
    assert_capture_refusal(
        out.to_vec().map_err(StreamError::from),
        "a blocking read of a captured tensor",
    );
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        main.launch_graph(&exec).unwrap();
    }
    main.synchronize().unwrap();
    let x_host = input(5);
    assert_bits(&out.to_vec().unwrap(), |i| 2.0 * x_host[i] + 1.0, "replay");
    assert!(
        !ran.load(Ordering::SeqCst),
        "the refused callback never runs"
    );
}

/// `capturing.wait_stream(eager)` is a user's mistake the driver answers by invalidating the
/// capture: through the stream, the coordinator, the stream-ordered allocator and a barrier it
/// is a typed refusal before anything is queued, and the capture goes on. The other direction,
/// an eager stream waiting on the capturing one, forks it into the capture, and joined back the
/// graph replays exactly.
#[test]
fn a_capturing_stream_waiting_on_eager_work_is_refused_and_the_capture_survives() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let main = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let eager = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let side = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let x = DeviceBuffer::from_slice(&gpu.context, &input(11)).unwrap();
    let mut out = allocator.buffer::<f32>(G, main.stream()).unwrap();
    let coordinator = MultiStreamCoordinator::new();
    let ordered = StreamOrderedAllocator::default();

    let mut capture = main.begin_capture(CaptureOptions::default()).unwrap();
    step(&kit, &allocator, &main, &x, &mut out).unwrap();
    eager.launch(|s| kit.test.spin_ns(s, 1000)).unwrap();
    assert_capture_refusal(main.wait_for(&eager), "PriorityStream::wait_for");
    assert_capture_refusal(
        capture.join(eager.stream()),
        "StreamCapture::join of a stream never forked",
    );
    assert_capture_refusal(
        coordinator.add_dependency(&main, &eager),
        "MultiStreamCoordinator::add_dependency",
    );
    assert_capture_refusal(
        ordered.add_stream_dependency(&main, &eager),
        "StreamOrderedAllocator::add_stream_dependency",
    );
    let barrier = MultiStreamCoordinator::with_streams([Arc::clone(&main), Arc::clone(&eager)]);
    assert_capture_refusal(barrier.create_barrier(), "a barrier across the capture");
    // The other direction is a fork; joined back, the capture ends cleanly.
    side.wait_for(&main).unwrap();
    side.launch(|s| kit.test.spin_ns(s, 1000)).unwrap();
    main.wait_for(&side).unwrap();
    let graph = capture
        .finish()
        .expect("the refused waits left the capture intact");

    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    main.launch_graph(&exec).unwrap();
    main.synchronize().unwrap();
    eager.synchronize().unwrap();
    let x_host = input(11);
    assert_bits(&out.to_vec().unwrap(), |i| 2.0 * x_host[i] + 1.0, "replay");
    // Every stream is usable eagerly again.
    main.wait_for(&eager).unwrap();
    barrier.create_barrier().unwrap();
    main.synchronize().unwrap();
}

/// One thread captures a step while another allocates, writes and reads back its own tensors
/// on another stream the whole time: neither corrupts the other.
#[test]
fn eager_allocations_on_another_thread_during_a_capture_corrupt_neither() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let main = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let other = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let x = DeviceBuffer::from_slice(&gpu.context, &input(9)).unwrap();
    let mut out = allocator.buffer::<f32>(G, main.stream()).unwrap();
    let begun = Barrier::new(2);
    let done = Barrier::new(2);

    let graph = std::thread::scope(|scope| {
        let eager = scope.spawn(|| {
            begun.wait();
            // No panic before `done`: the capturing thread waits there.
            let result = (|| -> Result<(), String> {
                let mut kept = Vec::new();
                for i in 0..40u32 {
                    let len = 4096 + i as usize;
                    let mut buffer = allocator
                        .buffer::<u32>(len, other.stream())
                        .map_err(|e| e.to_string())?;
                    other.fill(&mut buffer, i).map_err(|e| e.to_string())?;
                    let host = other
                        .copy_to_host(&buffer, vec![0u32; len])
                        .map_err(|e| e.to_string())?
                        .wait()
                        .map_err(|e| e.to_string())?;
                    if !host.iter().all(|&v| v == i) {
                        return Err(format!("eager tensor {i} read back wrong"));
                    }
                    if i % 2 == 0 {
                        kept.push((i, buffer));
                    }
                }
                for (i, buffer) in &kept {
                    let host = buffer.to_vec().map_err(|e| e.to_string())?;
                    if !host.iter().all(|v| v == i) {
                        return Err(format!("kept tensor {i} changed"));
                    }
                }
                Ok(())
            })();
            done.wait();
            result
        });
        let capture = main.begin_capture(CaptureOptions::default());
        begun.wait();
        let stepped = match &capture {
            Ok(_) => (0..4).try_for_each(|_| step(&kit, &allocator, &main, &x, &mut out)),
            Err(error) => Err(error.clone()),
        };
        done.wait();
        let eager = eager.join().unwrap();
        let graph = capture.and_then(StreamCapture::finish);
        stepped.unwrap();
        eager.unwrap();
        graph
    })
    .unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..20 {
        main.launch_graph(&exec).unwrap();
    }
    main.synchronize().unwrap();
    let x_host = input(9);
    assert_bits(&out.to_vec().unwrap(), |i| 2.0 * x_host[i] + 1.0, "replay");
}

/// `consumer.wait_stream(producer)` with the coordinator: the producer spins, then writes; the
/// consumer copies what the producer wrote (raw copies, so only the dependency orders them).
/// A barrier then orders three writers before one reader, and `execute_parallel` runs one
/// closure per stream.
#[test]
fn producer_consumer_barrier_and_parallel_work_are_ordered_on_the_gpu() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let streams: Vec<Arc<PriorityStream>> = (0..4)
        .map(|_| Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap()))
        .collect();
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let (producer, consumer) = (&streams[0], &streams[1]);
    let n = 1 << 16;
    let produced = DeviceBuffer::<u32>::zeroed(&gpu.context, n).unwrap();
    let consumed = DeviceBuffer::<u32>::zeroed(&gpu.context, n).unwrap();
    let (src, dst) = (produced.device_ptr(), consumed.device_ptr());

    producer.launch(|s| kit.test.spin_ns(s, 50 * MS)).unwrap();
    // SAFETY: `produced` holds n u32s and lives until the streams are synchronised below; only
    // these raw launches touch it meanwhile.
    producer
        .launch(|s| unsafe { kit.test.fill_u32(s, src, 0xC0FFEE, n) })
        .unwrap();
    coordinator.add_dependency(consumer, producer).unwrap();
    // SAFETY: both buffers hold n u32s and outlive the synchronisation below.
    consumer
        .enqueue(OperationKind::Copy, (n * 4) as u64, |s| unsafe {
            copy_dtod_async(dst, src, n * 4, s)
        })
        .unwrap();
    consumer.synchronize().unwrap();
    assert!(
        consumed.to_vec().unwrap().iter().all(|&v| v == 0xC0FFEE),
        "the consumer copied before the producer wrote"
    );

    // Three writers (one slow) behind a barrier, then one reader that sums what they wrote.
    let parts: Vec<DeviceBuffer<u32>> = (0..3)
        .map(|_| DeviceBuffer::<u32>::zeroed(&gpu.context, n).unwrap())
        .collect();
    streams[1].launch(|s| kit.test.spin_ns(s, 30 * MS)).unwrap();
    for (k, part) in parts.iter().enumerate() {
        let ptr = part.device_ptr();
        // SAFETY: each part holds n u32s, written only here, alive past the synchronisation.
        streams[k + 1]
            .launch(|s| unsafe { kit.test.fill_u32(s, ptr, k as u32 + 1, n) })
            .unwrap();
    }
    let info = coordinator.create_barrier().unwrap();
    assert_eq!(info.streams, 4);
    assert_eq!(info.waits, 6);
    let sum = DeviceBuffer::<u64>::zeroed(&gpu.context, 1).unwrap();
    let sum_ptr = sum.device_ptr();
    for part in &parts {
        let ptr = part.device_ptr();
        // SAFETY: the parts hold n u32s, `sum` one u64; the barrier orders the writers first.
        streams[0]
            .launch(|s| unsafe { kit.test.checksum_u32(s, ptr, n, sum_ptr) })
            .unwrap();
    }
    streams[0].synchronize().unwrap();
    assert_eq!(sum.to_vec().unwrap(), vec![(n as u64) * (1 + 2 + 3)]);

    coordinator
        .execute_parallel(|stream| {
            let mut buffer = DeviceBuffer::<u32>::new_on(stream, 4096)?;
            let value = (stream.id() % 1000) as u32;
            stream.fill(&mut buffer, value)?;
            let host = stream.copy_to_host(&buffer, vec![0u32; 4096])?.wait()?;
            if host.iter().all(|&v| v == value) {
                Ok(())
            } else {
                Err(StreamError::NotReady {
                    operation: "wrong bytes",
                })
            }
        })
        .unwrap();
    assert_eq!(coordinator.stats().parallel_runs, 1);
    for stream in &streams {
        stream.synchronize().unwrap();
    }
}

/// Allocate on A, hand to B after a recorded dependency, use on B, free: the first round proves
/// the order with a spin before A's write; 2000 rounds (500 MB if nothing were reused) keep the
/// pool, the books and the dependency list bounded.
#[test]
fn stream_ordered_memory_handed_from_a_to_b_stays_ordered_and_bounded_over_2000_rounds() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let a = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let b = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let allocator = StreamOrderedAllocator::default();
    let n = 1 << 16; // 256 KiB of u32
    let result = DeviceBuffer::<u32>::zeroed(&gpu.context, n).unwrap();
    let result_ptr = result.device_ptr();

    for round in 0..2000u32 {
        let block = allocator.allocate_for_stream(&a, n * 4).unwrap();
        let ptr = allocator.device_ptr(&block).unwrap();
        if round == 0 {
            a.launch(|s| kit.test.spin_ns(s, 30 * MS)).unwrap();
        }
        // SAFETY: the block holds n u32s on `a`; only `a` and, after the dependency, `b` use it
        // before its stream-ordered free.
        a.launch(|s| unsafe { kit.test.fill_u32(s, ptr, round, n) })
            .unwrap();
        allocator.add_stream_dependency(&b, &a).unwrap();
        // SAFETY: as above; `b` waits for `a`'s fill.
        b.launch(|s| unsafe { kit.test.increment_u32(s, ptr, n) })
            .unwrap();
        if round == 0 || round % 500 == 499 {
            // SAFETY: `result` holds n u32s and lives to the end; `b` orders the copy.
            b.enqueue(OperationKind::Copy, 0, |s| unsafe {
                copy_dtod_async(result_ptr, ptr, n * 4, s)
            })
            .unwrap();
            b.synchronize().unwrap();
            let host = result.to_vec().unwrap();
            assert!(
                host.iter().all(|&v| v == round + 1),
                "round {round}: B did not see A's write"
            );
        }
        allocator.free(block).unwrap();
        assert!(
            matches!(
                allocator.device_ptr(&block),
                Err(StreamError::UnknownAllocation { .. })
            ),
            "a freed allocation has no address"
        );
    }
    assert_eq!(allocator.outstanding(), 0);
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    assert!(allocator.dependencies_satisfied(&b).unwrap());
    let stats = allocator.stats();
    assert_eq!(stats.dependencies, 2000);
    let reserved = allocator.reserved_bytes(gpu.device.ordinal()).unwrap();
    assert!(
        reserved <= 128 << 20,
        "2000 rounds of 256 KiB kept {reserved} bytes reserved"
    );
    assert!(a.outstanding_work().unwrap() == 0 && b.outstanding_work().unwrap() == 0);
}

/// Freeing stream-ordered memory that was allocated eagerly, from inside a capture on its
/// owner stream, would record the free into the graph: it would not run now and would run at
/// every replay. It is refused and the memory stays held; once the capture has ended the same
/// free goes through, and the graph replays.
#[test]
fn freeing_eager_stream_ordered_memory_inside_a_capture_is_refused_until_it_ends() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let a = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let allocator = StreamOrderedAllocator::default();
    let n = 1 << 16;
    let block = allocator.allocate_for_stream(&a, n * 4).unwrap();
    let ptr = allocator.device_ptr(&block).unwrap();
    // SAFETY: the block holds n u32s, used only on `a` until its free.
    a.launch(|s| unsafe { kit.test.fill_u32(s, ptr, 3, n) })
        .unwrap();
    let out = DeviceBuffer::<u32>::zeroed(&gpu.context, n).unwrap();
    let out_ptr = out.device_ptr();

    let capture = a.begin_capture(CaptureOptions::default()).unwrap();
    // SAFETY: the block and `out` hold n u32s; the graph runs while both are alive.
    a.launch(|s| unsafe { kit.test.increment_u32(s, ptr, n) })
        .unwrap();
    // SAFETY: as above.
    a.enqueue(OperationKind::Copy, 0, |s| unsafe {
        copy_dtod_async(out_ptr, ptr, n * 4, s)
    })
    .unwrap();
    assert_capture_refusal(allocator.free(block), "free inside the capture");
    assert_capture_refusal(
        allocator.free_for_stream(&a).map(|_| ()),
        "free_for_stream inside the capture",
    );
    assert_eq!(allocator.outstanding(), 1, "the allocation is still held");
    assert_eq!(allocator.device_ptr(&block).unwrap(), ptr);
    let graph = capture.finish().unwrap();

    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        a.launch_graph(&exec).unwrap();
    }
    a.synchronize().unwrap();
    assert!(
        out.to_vec().unwrap().iter().all(|&v| v == 6),
        "3 + 3 replays"
    );
    drop(exec);
    drop(graph);
    allocator.free(block).unwrap();
    assert_eq!(allocator.outstanding(), 0);
    a.synchronize().unwrap();
}

/// Profiling a training loop: 6000 small operations on two streams, read back in GPU time; the
/// spans waiting for the GPU stay bounded and every operation is either reported or counted as
/// skipped.
#[test]
fn the_profiler_over_many_iterations_stays_bounded_and_accounts_for_every_operation() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, G);
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    let compute = PriorityStream::new(&gpu.context, StreamPriority::High).unwrap();
    let copies = PriorityStream::new(&gpu.context, StreamPriority::Low).unwrap();
    let mut buffer = DeviceBuffer::<f32>::new(&gpu.context, G).unwrap();
    let mut staging = DeviceBuffer::<f32>::new(&gpu.context, G).unwrap();
    let rounds = 3000u64;
    let mut most_pending = 0;
    for _ in 0..rounds {
        profiler
            .profile(&compute, "fill", OperationKind::KernelLaunch, 0, |s| {
                s.enqueue(OperationKind::KernelLaunch, 0, |raw| {
                    kit.fill(raw, &mut buffer, 2.0)
                })
            })
            .unwrap();
        profiler
            .profile(&copies, "copy", OperationKind::Copy, (G * 4) as u64, |s| {
                s.copy_buffer(&mut staging, &buffer)
            })
            .unwrap();
        most_pending = most_pending.max(profiler.pending());
    }
    assert!(most_pending <= cuweave_stream::timing::DEFAULT_PENDING_SPANS);
    let report = profiler.report().unwrap();
    assert_eq!(profiler.pending(), 0);
    let skipped = profiler.skipped();
    assert_eq!(report.combined.operations + skipped, 2 * rounds);
    assert_eq!(report.streams.len(), 2);
    let copy_report = report
        .streams
        .iter()
        .find(|stream| stream.stream == copies.id())
        .unwrap();
    assert_eq!(copy_report.bytes, copy_report.copies * (G * 4) as u64);
    assert!(report.combined.gpu_time_ns > 0);
    assert!(report.combined.busy_ns <= report.combined.gpu_time_ns);
    assert_bits(&staging.to_vec().unwrap(), |_| 2.0, "the profiled copies");
    let trace: serde_json::Value = serde_json::from_str(&profiler.chrome_trace().unwrap()).unwrap();
    assert!(trace.to_string().contains("copy"));
    profiler.clear();
    assert_eq!(profiler.report().unwrap().combined.operations, 0);
}
