//! Cross-layer programs written the way users of the facade write them, through `cuweave::...`
//! paths alone (the prelude first, a layer's module where the prelude stops): an eager
//! PyTorch-style training loop (weights on the caching allocator, batches uploaded from pageable
//! `Vec`s by the transfer manager, kernels on a pool stream, temporaries dropped every step, the
//! allocator's reserved memory flat over hundreds of steps); the same step captured into a CUDA
//! graph and replayed with fresh batches copied into static buffers; an inference server whose
//! threads each take a stream from a pool and `.await` uploads, kernels and downloads; a
//! producer and a consumer on two pool streams ordered only by the operation coordinator; a
//! gradient all-reduce on a one-rank NCCL communicator; unified memory written on the host,
//! prefetched, computed on and read back; and the first calls of any program on a machine with
//! or without a driver. Every outcome is checked by bytes the GPU wrote, by ordering a slow
//! kernel would have broken, or by bounded statistics.
//!
//! Every GPU test takes `serial()`: one captures a graph, which changes what the whole process
//! may do while it runs, and the others measure allocator books or rely on slow kernels.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use cuweave::driver::InstantiateOptions;
use cuweave::event::OperationId;
use cuweave::prelude::*;
use cuweave::stream::capture::CaptureOptions;
use cuweave::transfer::TransferPath;
use cuweave_test_support::{require_gpu, sanitizer_active, serial};

use common::{MS, N, Ops, assert_exact, nccl_or_skip, value, words};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Transfers the manager counted on `path`, over every size class.
fn counted(manager: &TransferManager, path: TransferPath) -> u64 {
    manager
        .stats()
        .snapshot()
        .iter()
        .filter(|(p, ..)| *p == path)
        .map(|(_, _, stats)| stats.count)
        .sum()
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

// PyTorch's eager training loop: weights on the caching allocator, each batch uploaded from a
// pageable `Vec` by the transfer manager, the optimizer step and the forward as kernels on a
// compute stream of the pool, the hidden activation and the output temporaries dropped every
// step, the loss read back every step (`loss.item()`).
#[test]
fn an_eager_training_loop_is_exact_every_step_and_keeps_the_allocators_reserved_memory_flat() {
    let gpu = require_gpu!();
    let _serial = serial();
    let steps: usize = if sanitizer_active() { 20 } else { 300 };
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let s = stream.stream();
    let manager = TransferManager::new().unwrap();
    // An allocator of the program's own, so that its books hold this loop's memory alone.
    let allocator = CachingAllocator::with_driver(&gpu.context);

    let mut host_w: Vec<f32> = (0..N).map(|i| value(0, i)).collect();
    let mut w = allocator.buffer::<f32>(N, s).unwrap();
    manager.transfer(&host_w, &mut w).unwrap();
    let metrics = stream.metrics().unwrap();
    let mut loss = vec![0.0f32; N];
    let mut warm: Option<MemoryStats> = None;
    for step in 1..=steps {
        let batch: Vec<f32> = (0..N).map(|i| value(step, i)).collect();
        let mut x = allocator.buffer::<f32>(N, s).unwrap();
        manager.transfer(&batch, &mut x).unwrap();
        // The optimizer's update (w += x), then the forward: y = (2x + 1) + w.
        ops.saxpy(&stream, 1.0, &x, &mut w).unwrap();
        let mut h = allocator.buffer::<f32>(N, s).unwrap();
        stream.fill(&mut h, 1.0).unwrap();
        ops.saxpy(&stream, 2.0, &x, &mut h).unwrap();
        let mut y = allocator.buffer::<f32>(N, s).unwrap();
        ops.add(&stream, &h, &w, &mut y).unwrap();
        // Read on the manager's own streams: only y's tracked write orders it after the add.
        manager.transfer(&y, &mut loss).unwrap();
        for (w, x) in host_w.iter_mut().zip(&batch) {
            *w += x;
        }
        assert_exact(
            &loss,
            |i| 2.0 * batch[i] + 1.0 + host_w[i],
            &format!("step {step}"),
        );
        drop((x, h, y));

        let books = allocator.stats();
        match &warm {
            None => warm = Some(books),
            Some(warm) => {
                assert_eq!(
                    books.reserved_bytes.current, warm.reserved_bytes.current,
                    "step {step}: the allocator reserved more than the first step did"
                );
                assert_eq!(books.segments.current, warm.segments.current);
                assert_eq!(
                    books.cache_misses, warm.cache_misses,
                    "step {step}: a temporary missed the cache"
                );
            }
        }
    }

    let after = stream.metrics().unwrap();
    assert_eq!(
        after.kernel_launches - metrics.kernel_launches,
        3 * steps as u64
    );
    assert_eq!(after.memsets - metrics.memsets, steps as u64);
    assert_eq!(
        counted(&manager, TransferPath::PAGEABLE_TO_DEVICE),
        steps as u64 + 1
    );
    assert_eq!(
        counted(&manager, TransferPath::DEVICE_TO_PAGEABLE),
        steps as u64
    );
    assert_exact(&w.to_vec().unwrap(), |i| host_w[i], "the trained weights");
    drop(w);
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
    allocator.empty_cache().unwrap();
    let end = allocator.stats();
    assert_eq!(
        (end.reserved_bytes.current, end.segments.current),
        (0, 0),
        "the loop's memory did not all go back"
    );
}

// `torch.cuda.graph` / `make_graphed_callables`: the step of the eager loop run once eagerly to
// warm up, captured once (its hidden activation from the capture's private pool), then replayed
// with each new batch copied into the static input and the static output read back after every
// replay, as `static_input.copy_(batch); graph.replay(); static_output.cpu()` does.
#[test]
fn a_captured_training_step_replays_fresh_batches_in_static_buffers_exactly_without_allocating() {
    let gpu = require_gpu!();
    let _serial = serial();
    let replays: usize = if sanitizer_active() { 20 } else { 200 };
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let s = stream.stream();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let mut host_w: Vec<f32> = (0..N).map(|i| value(0, i)).collect();
    let mut x = allocator.buffer::<f32>(N, s).unwrap();
    let mut w = allocator.buffer::<f32>(N, s).unwrap();
    let mut y = allocator.buffer::<f32>(N, s).unwrap();
    w.copy_from_host(&host_w).unwrap();
    // w += x; y = (2x + 1) + w, the hidden activation a temporary. Returns its address.
    let step = |x: &DeviceBuffer<f32>, w: &mut DeviceBuffer<f32>, y: &mut DeviceBuffer<f32>| {
        ops.saxpy(&stream, 1.0, x, w).unwrap();
        let mut h = allocator.buffer::<f32>(N, s).unwrap();
        stream.fill(&mut h, 1.0).unwrap();
        ops.saxpy(&stream, 2.0, x, &mut h).unwrap();
        ops.add(&stream, &h, w, y).unwrap();
        h.device_ptr()
    };

    let batch: Vec<f32> = (0..N).map(|i| value(1, i)).collect();
    x.copy_from_host(&batch).unwrap();
    let eager_h = step(&x, &mut w, &mut y);
    for (w, x) in host_w.iter_mut().zip(&batch) {
        *w += x;
    }
    assert_exact(
        &y.to_vec().unwrap(),
        |i| 2.0 * batch[i] + 1.0 + host_w[i],
        "the eager warm-up",
    );

    let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
    let captured_h = step(&x, &mut w, &mut y);
    let graph = capture.finish().unwrap();
    assert_ne!(
        captured_h, eager_h,
        "the captured temporary came from the eager cache, not the capture's private pool"
    );
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.upload(s).unwrap();
    let books = allocator.stats();
    let metrics = stream.metrics().unwrap();

    let mut out = vec![0.0f32; N];
    for replay in 1..=replays {
        let batch: Vec<f32> = (0..N).map(|i| value(replay + 1, i)).collect();
        let upload = stream.copy_from_host(&mut x, batch).unwrap();
        stream.launch_graph(&exec).unwrap();
        let download = stream.copy_to_host(&y, out).unwrap();
        let batch = upload.wait().unwrap();
        out = download.wait().unwrap();
        for (w, x) in host_w.iter_mut().zip(&batch) {
            *w += x;
        }
        assert_exact(
            &out,
            |i| 2.0 * batch[i] + 1.0 + host_w[i],
            &format!("replay {replay}"),
        );
    }

    let after = allocator.stats();
    assert_eq!(after.allocations, books.allocations, "a replay allocated");
    assert_eq!(after.reserved_bytes.current, books.reserved_bytes.current);
    assert_eq!(
        stream.metrics().unwrap().graph_launches - metrics.graph_launches,
        replays as u64
    );
    assert_eq!(exec.launch_count(), replays as u64);
    // The weights the graph updated in place, read after a wait that covers its launches.
    w.synchronize().unwrap();
    assert_exact(
        &w.to_vec().unwrap(),
        |i| host_w[i],
        "the weights after the replays",
    );
    // Eager work after the replays never gets the graph's memory.
    let eager = allocator.buffer::<f32>(N, s).unwrap();
    assert_ne!(eager.device_ptr(), captured_h);
}

// ---------------------------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------------------------

// An inference server: four handler threads, each with its own stream from the pool, serving
// requests of odd sizes one after another as `async` code under a plain executor: `.await` the
// upload, queue a slow kernel, `.await` the stream through the event layer, `.await` the
// download. Every request's bytes are the kernel's, and the stream future never resolves before
// the kernel has finished.
#[test]
fn request_handlers_on_their_own_pool_streams_await_upload_kernel_and_download_byte_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    const THREADS: usize = 4;
    const REQUESTS: usize = 12;
    let lens = [1usize, 1000, 4097, 1 << 16, (1 << 18) + 3];
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let manager = TransferManager::new().unwrap();
    let waiter = AsyncEventWaiter::global().unwrap();
    let streams: Vec<Arc<PriorityStream>> =
        (0..THREADS).map(|_| pool.get_stream().unwrap()).collect();
    let ids: HashSet<u64> = streams.iter().map(|stream| stream.id()).collect();
    assert_eq!(ids.len(), THREADS, "the pool handed out a stream twice");

    std::thread::scope(|scope| {
        for (t, stream) in streams.iter().enumerate() {
            let (ops, manager) = (&ops, &manager);
            scope.spawn(move || {
                futures::executor::block_on(async move {
                    for r in 0..REQUESTS {
                        let len = lens[(t + r) % lens.len()];
                        let input = words(len, (t * 1000 + r) as u64);
                        let mut buffer = DeviceBuffer::<u32>::new_on(stream.stream(), len).unwrap();
                        let report = manager
                            .upload_async(&input, &mut buffer, 0)
                            .unwrap()
                            .await
                            .unwrap();
                        assert_eq!(report.bytes, 4 * len);
                        ops.spin(stream, MS);
                        ops.increment(stream, &mut buffer).unwrap();
                        waiter.stream_idle(stream.stream()).unwrap().await.unwrap();
                        assert!(
                            buffer.is_idle().unwrap(),
                            "thread {t} request {r}: the stream's future resolved before its kernel"
                        );
                        let mut output = vec![0u32; len];
                        manager
                            .download_async(&buffer, 0, &mut output)
                            .unwrap()
                            .await
                            .unwrap();
                        if let Some(i) = (0..len).find(|&i| output[i] != input[i].wrapping_add(1)) {
                            panic!(
                                "thread {t} request {r} ({len} u32s): element {i} is {:#x}, \
                                 expected {:#x}",
                                output[i],
                                input[i].wrapping_add(1)
                            );
                        }
                    }
                });
            });
        }
    });

    for stream in &streams {
        assert_eq!(
            stream.metrics().unwrap().kernel_launches,
            2 * REQUESTS as u64,
            "a spin and an increment per request"
        );
    }
    let served = (THREADS * REQUESTS) as u64;
    assert_eq!(counted(&manager, TransferPath::PAGEABLE_TO_DEVICE), served);
    assert_eq!(counted(&manager, TransferPath::DEVICE_TO_PAGEABLE), served);
}

// ---------------------------------------------------------------------------------------------
// Scheduling
// ---------------------------------------------------------------------------------------------

// A pipeline scheduler: a producer (high priority) and a consumer (low priority) taking their
// streams from one pool through the coordinator, ping-ponging one buffer for 16 rounds. The
// kernels take raw addresses, so the buffers' own tracking is out of the way and only the
// coordinator's dependencies order them: the consumer of round r after its producer, the
// producer of round r + 1 after that consumer. Both spin first, so a missing wait in either
// direction would change a checksum. Awaiting the last operation covers every round.
#[test]
fn a_coordinated_producer_and_consumer_on_two_pool_streams_ping_pong_a_buffer_in_order() {
    let gpu = require_gpu!();
    let _serial = serial();
    const ROUNDS: usize = 16;
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let coordinator =
        OperationCoordinator::new(EventPool::for_context(&gpu.context).unwrap()).unwrap();
    let x = DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap();
    let sums = DeviceBuffer::<u64>::zeroed(&gpu.context, ROUNDS).unwrap();

    let mut previous: Option<OperationId> = None;
    for round in 0..ROUNDS {
        let produce = coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::High,
                None,
                previous.as_slice(),
                format!("produce {round}"),
            )
            .unwrap();
        let producer = coordinator.begin_on_pool(produce, &pool).unwrap();
        assert_eq!(producer.priority(), StreamPriority::High);
        ops.spin(&producer, MS);
        producer
            .launch(|raw| {
                // SAFETY: `x` holds N u32s of this context and outlives every round (the test
                // awaits the last operation, which follows all of them, before it ends); the
                // host touches it only after that.
                unsafe { ops.test.increment_u32(raw, x.device_ptr(), N) }
            })
            .unwrap();
        coordinator.complete_operation(produce).unwrap();

        let consume = coordinator
            .register_operation(
                OperationType::Reduction,
                EventPriority::Low,
                None,
                &[produce],
                format!("consume {round}"),
            )
            .unwrap();
        let consumer = coordinator.begin_on_pool(consume, &pool).unwrap();
        assert_eq!(consumer.priority(), StreamPriority::Low);
        assert_ne!(producer.id(), consumer.id());
        ops.spin(&consumer, MS);
        consumer
            .launch(|raw| {
                // SAFETY: as above; slot `round` of `sums` is an 8-byte-aligned u64 of a buffer
                // of ROUNDS of them, zeroed, and written by this kernel alone.
                unsafe {
                    ops.test.checksum_u32(
                        raw,
                        x.device_ptr(),
                        N,
                        sums.device_ptr() + 8 * round as u64,
                    )
                }
            })
            .unwrap();
        coordinator.complete_operation(consume).unwrap();
        previous = Some(consume);
    }
    futures::executor::block_on(coordinator.completion(previous.unwrap()).unwrap()).unwrap();

    let expected: Vec<u64> = (1..=ROUNDS as u64).map(|r| r * N as u64).collect();
    assert_eq!(
        sums.to_vec().unwrap(),
        expected,
        "a consumer read the buffer before its producer finished, or a producer ran ahead of \
         the previous consumer"
    );
    assert!(x.to_vec().unwrap().iter().all(|&v| v == ROUNDS as u32));
    let metrics = coordinator.metrics();
    let operations = 2 * ROUNDS as u64;
    assert_eq!(
        (
            metrics.registered,
            metrics.begun,
            metrics.completed,
            metrics.failed
        ),
        (operations, operations, operations, 0)
    );
    assert_eq!(
        metrics.cross_stream_waits,
        operations - 1,
        "every operation but the first waits for one on another stream"
    );
    cuweave_test_support::poll_until(Duration::from_secs(5), || {
        coordinator.live_operations() == 0
    });
    assert_eq!(
        coordinator.live_operations(),
        0,
        "finished operations retire"
    );
}

// ---------------------------------------------------------------------------------------------
// Collectives
// ---------------------------------------------------------------------------------------------

// Data-parallel training's gradient all-reduce (DDP's bucket reduction) on one rank: gradients
// computed on a compute stream behind a slow kernel, all-reduced out of place on a
// communication stream into a buffer holding stale bytes, awaited, downloaded by the transfer
// manager; then reduced in place. One rank's sum and max are the input itself, so every byte
// is known, and a collective that did not wait for the compute stream would read stale input.
#[test]
fn a_one_rank_gradient_all_reduce_waits_for_the_compute_stream_and_lands_every_byte() {
    const TEST: &str =
        "a_one_rank_gradient_all_reduce_waits_for_the_compute_stream_and_lands_every_byte";
    let gpu = require_gpu!();
    let _serial = serial();
    if !nccl_or_skip(TEST) {
        return;
    }
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let compute = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let comms = pool.get_priority_stream(StreamPriority::High).unwrap();
    assert_ne!(compute.id(), comms.id());
    let manager = TransferManager::new().unwrap();
    let id = UniqueId::new().unwrap();
    let comm = Communicator::init_rank(1, 0, &id, gpu.device, &CommConfig::default()).unwrap();

    let activations: Vec<f32> = (0..N).map(|i| value(1, i)).collect();
    let mut x = DeviceBuffer::<f32>::new_on(compute.stream(), N).unwrap();
    manager.transfer(&activations, &mut x).unwrap();
    let mut grads = DeviceBuffer::<f32>::new_on(compute.stream(), N).unwrap();
    ops.spin(&compute, 20 * MS);
    compute.fill(&mut grads, 0.5).unwrap();
    ops.saxpy(&compute, 3.0, &x, &mut grads).unwrap();
    let expected = |i: usize| 3.0 * activations[i] + 0.5;

    let stale: Vec<f32> = (0..N).map(|i| value(99, i)).collect();
    let mut reduced = DeviceBuffer::from_slice(&gpu.context, &stale).unwrap();
    comm.all_reduce(&grads, &mut reduced, ReduceOp::Sum, comms.stream())
        .unwrap();
    futures::executor::block_on(comm.completion(comms.stream()).unwrap()).unwrap();
    let mut host = vec![0.0f32; N];
    manager.transfer(&reduced, &mut host).unwrap();
    assert_exact(&host, expected, "the out-of-place all-reduce");

    comm.all_reduce_in_place(&mut grads, ReduceOp::Max, comms.stream())
        .unwrap();
    comm.synchronize(comms.stream()).unwrap();
    assert_exact(
        &grads.to_vec().unwrap(),
        expected,
        "the in-place all-reduce",
    );
}

// ---------------------------------------------------------------------------------------------
// Unified memory
// ---------------------------------------------------------------------------------------------

// Unified memory as a first GPU program: a 16 MiB table written in place on the host, kept on
// the device by policy, prefetched there, incremented twice by kernels on a pool stream,
// prefetched back and read in place (the host view waits for the device first).
#[test]
fn a_unified_table_written_on_the_host_is_prefetched_computed_on_and_read_back_in_place() {
    let gpu = require_gpu!();
    let _serial = serial();
    const LEN: usize = 4 << 20;
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream().unwrap();
    let device = gpu.device.ordinal();
    let values = words(LEN, 7);
    let mut table = UnifiedBuffer::<u32>::new(&gpu.context, LEN).unwrap();
    table.as_mut_slice().unwrap().copy_from_slice(&values);
    table
        .apply_policy(&MigrationPolicy::PreferDevice(device))
        .unwrap();

    stream
        .prefetch(&table, MemLocation::Device(device))
        .unwrap();
    ops.increment(&stream, &mut table).unwrap();
    ops.increment(&stream, &mut table).unwrap();
    stream.prefetch(&table, MemLocation::Host).unwrap();
    let host = table.as_slice().unwrap();
    if let Some(i) = (0..LEN).find(|&i| host[i] != values[i].wrapping_add(2)) {
        panic!(
            "element {i} is {:#x}, expected {:#x}",
            host[i],
            values[i].wrapping_add(2)
        );
    }
    drop(host);
    let metrics = stream.metrics().unwrap();
    assert_eq!((metrics.prefetches, metrics.kernel_launches), (2, 2));
}

// ---------------------------------------------------------------------------------------------
// First calls
// ---------------------------------------------------------------------------------------------

// The first lines of any program: is there a GPU, and what is it? Through the prelude alone, a
// machine without a driver gets the driver's typed error from every layer's entry point (never
// a panic); a machine with one lists its devices and opens each layer on them. Needs no GPU: it
// checks whichever of the two this machine is.
#[test]
fn first_calls_through_the_prelude_list_the_devices_or_fail_with_the_drivers_typed_error() {
    match cuweave::driver::driver() {
        Err(error) => {
            assert_eq!(Device::count(), Err(error.clone()));
            assert_eq!(Device::all(), Err(error.clone()));
            assert_eq!(Device::get(0), Err(error.clone()));
            match TransferManager::new() {
                Err(TransferError::Driver(from_manager)) => assert_eq!(from_manager, error),
                other => panic!("the transfer manager without a driver: {other:?}"),
            }
        }
        Ok(_) => {
            let devices = Device::all().unwrap();
            assert_eq!(devices.len(), Device::count().unwrap());
            for device in &devices {
                assert!(!device.name().unwrap().is_empty());
                let context = Context::primary(*device).unwrap();
                let memory = context.memory_info().unwrap();
                assert!(memory.free <= memory.total && memory.total > 0);
                let pool = StreamPool::for_device(*device).unwrap();
                assert_eq!(pool.device(), *device);
                assert!(!pool.is_empty());
                assert_eq!(
                    CachingAllocator::for_device(*device).unwrap().device(),
                    *device
                );
            }
            assert_eq!(
                TransferManager::new().unwrap().device_count(),
                devices.len()
            );
        }
    }
}
