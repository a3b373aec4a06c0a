//! GPU tests of `MultiStreamCoordinator`: dependencies proven by a flag a kernel writes and
//! another reads, ping-pong accepted and ordered, fan-in/fan-out barriers, parallel execution, completion callbacks.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_stream::{MultiStreamCoordinator, PriorityStream, StreamError, StreamPriority};
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;

const MS: u64 = 1_000_000;

struct Kit {
    kernels: TestKernels,
    stream_kernels: StreamKernels,
}

fn kit(gpu: &cuweave_test_support::Gpu) -> Kit {
    Kit {
        kernels: TestKernels::load(&gpu.context).unwrap(),
        stream_kernels: StreamKernels::load(&gpu.context).unwrap(),
    }
}

fn new_stream(gpu: &cuweave_test_support::Gpu) -> Arc<PriorityStream> {
    Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap())
}

/// Queues on `stream` a 50 ms spin that then sets `flag` to 1.
fn spin_then_set(kit: &Kit, stream: &PriorityStream, flag: &DeviceBuffer<u32>) {
    stream
        .launch(|s| {
            // SAFETY: `flag` is one u32 of device memory that the test keeps alive and only reads
            // after synchronizing.
            unsafe {
                kit.kernels
                    .spin_then_store_u32(s, 50 * MS, flag.device_ptr(), 1)
            }
        })
        .unwrap();
}

/// Queues on `stream` a kernel that copies `flag` into `out`.
fn read_flag(
    kit: &Kit,
    stream: &PriorityStream,
    flag: &DeviceBuffer<u32>,
    out: &DeviceBuffer<u32>,
) {
    stream
        .launch(|s| {
            // SAFETY: both are one u32 of device memory kept alive until after synchronization.
            unsafe {
                kit.stream_kernels
                    .copy_flag_u32(s, flag.device_ptr(), out.device_ptr())
            }
        })
        .unwrap();
}

/// What the dependent stream's kernel saw in the flag the prerequisite's kernel sets at its end.
fn flag_seen(gpu: &cuweave_test_support::Gpu, kit: &Kit, with_dependency: bool) -> u32 {
    let (prerequisite, dependent) = (new_stream(gpu), new_stream(gpu));
    let flag = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    let out = DeviceBuffer::<u32>::from_slice(&gpu.context, &[0xDEAD]).unwrap();
    let coordinator = MultiStreamCoordinator::new();
    spin_then_set(kit, &prerequisite, &flag);
    if with_dependency {
        coordinator
            .add_dependency(&dependent, &prerequisite)
            .unwrap();
    }
    read_flag(kit, &dependent, &flag, &out);
    dependent.synchronize().unwrap();
    prerequisite.synchronize().unwrap();
    out.to_vec().unwrap()[0]
}

#[test]
fn a_dependency_makes_the_dependent_kernel_see_the_prerequisites_flag() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kit = kit(&gpu);
    assert_eq!(
        flag_seen(&gpu, &kit, true),
        1,
        "with the dependency the flag is set"
    );
    assert_eq!(
        flag_seen(&gpu, &kit, false),
        0,
        "without it the dependent kernel runs during the spin and sees the flag unset"
    );
}

#[test]
fn ping_pong_dependencies_are_accepted_and_every_round_is_ordered_on_the_gpu() {
    // Copy/compute alternation, as a double-buffered pipeline does it: each round, compute waits
    // for copy, then copy waits for compute. Every step first logs the counter's value, then
    // increments it; the log holds 0, 1, 2, ... only if every step ran after the one before.
    const ROUNDS: usize = 10_000;
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kit = kit(&gpu);
    let (copy, compute) = (new_stream(&gpu), new_stream(&gpu));
    let coordinator = MultiStreamCoordinator::new();
    let counter = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    let log = DeviceBuffer::<u32>::from_slice(&gpu.context, &vec![u32::MAX; 2 * ROUNDS]).unwrap();
    let step = |stream: &PriorityStream, k: usize| {
        stream
            .launch(|s| {
                // SAFETY: `counter` is one u32 and `log` 2 * ROUNDS u32s of device memory, alive
                // until both streams are synchronized below; `k < 2 * ROUNDS`.
                unsafe {
                    kit.stream_kernels.copy_flag_u32(
                        s,
                        counter.device_ptr(),
                        log.device_ptr() + 4 * k as u64,
                    )?;
                    kit.kernels.increment_u32(s, counter.device_ptr(), 1)
                }
            })
            .unwrap();
    };
    for round in 0..ROUNDS {
        coordinator.add_dependency(&compute, &copy).unwrap();
        step(&compute, 2 * round);
        coordinator.add_dependency(&copy, &compute).unwrap();
        step(&copy, 2 * round + 1);
    }
    assert!(coordinator.has_cycles(), "ping-pong is a cycle, diagnosed");
    assert_eq!(
        coordinator.cycles(),
        vec![{
            let mut ids = vec![copy.id(), compute.id()];
            ids.sort_unstable();
            ids
        }]
    );
    assert_eq!(coordinator.stats().dependencies, 2 * ROUNDS as u64);
    copy.synchronize().unwrap();
    compute.synchronize().unwrap();
    let log = log.to_vec().unwrap();
    let out_of_order: Vec<usize> = (0..2 * ROUNDS).filter(|&k| log[k] != k as u32).collect();
    assert!(
        out_of_order.is_empty(),
        "{} steps saw another count than their position, first {:?}",
        out_of_order.len(),
        &out_of_order[..out_of_order.len().min(5)]
    );
    assert_eq!(counter.to_vec().unwrap()[0], 2 * ROUNDS as u32);
    // A barrier starts the diagnostic graph afresh.
    coordinator.create_barrier().unwrap();
    assert!(!coordinator.has_cycles() && coordinator.dependencies().is_empty());
    assert!(matches!(
        coordinator.add_dependency(&copy, &copy),
        Err(StreamError::SelfDependency { .. })
    ));
}

#[test]
fn a_barrier_over_eight_streams_queues_sixteen_waits_at_most_and_orders_them_all() {
    const N: usize = 8;
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kit = kit(&gpu);
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let streams: Vec<Arc<PriorityStream>> = (0..N).map(|_| new_stream(&gpu)).collect();
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let flags = DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap();
    let counts = DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap();
    for (i, stream) in streams.iter().enumerate() {
        stream
            .launch(|s| {
                // SAFETY: `flags` holds N u32s of device memory, alive until the streams are
                // synchronized below.
                unsafe {
                    kit.kernels.spin_then_store_u32(
                        s,
                        (i as u64 + 1) * 5 * MS,
                        flags.device_ptr() + 4 * i as u64,
                        1,
                    )
                }
            })
            .unwrap();
    }
    let barrier = coordinator.create_barrier().unwrap();
    assert_eq!((barrier.streams, barrier.events), (N, N));
    assert_eq!(barrier.waits, 2 * (N - 1), "fan in, fan out");
    assert!(barrier.waits <= 2 * N);
    for (i, stream) in streams.iter().enumerate() {
        stream
            .launch(|s| {
                // SAFETY: as above; `counts` holds N u32s.
                unsafe {
                    event_kernels.count_flags_u32(
                        s,
                        flags.device_ptr(),
                        N,
                        1,
                        counts.device_ptr() + 4 * i as u64,
                    )
                }
            })
            .unwrap();
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_eq!(
        counts.to_vec().unwrap(),
        vec![N as u32; N],
        "after the barrier every stream saw every flag"
    );
}

#[test]
fn a_barrier_orders_every_stream_after_every_other_without_blocking_the_host() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kit = kit(&gpu);
    let streams = [new_stream(&gpu), new_stream(&gpu), new_stream(&gpu)];
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let flag = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    let outs: Vec<DeviceBuffer<u32>> = (0..2)
        .map(|_| DeviceBuffer::from_slice(&gpu.context, &[0xDEAD]).unwrap())
        .collect();
    spin_then_set(&kit, &streams[0], &flag);
    let started = Instant::now();
    let barrier = coordinator.create_barrier().unwrap();
    let took = started.elapsed();
    assert_eq!((barrier.streams, barrier.events, barrier.waits), (3, 3, 4));
    assert!(
        took < Duration::from_millis(25),
        "the barrier blocked the host for {took:?}"
    );
    read_flag(&kit, &streams[1], &flag, &outs[0]);
    read_flag(&kit, &streams[2], &flag, &outs[1]);
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    for out in &outs {
        assert_eq!(
            out.to_vec().unwrap()[0],
            1,
            "work after the barrier saw the flag set"
        );
    }
}

#[test]
fn execute_parallel_runs_on_every_stream_and_collects_every_error() {
    let gpu = cuweave_test_support::require_gpu!();
    let kit = kit(&gpu);
    let streams: Vec<Arc<PriorityStream>> = (0..4).map(|_| new_stream(&gpu)).collect();
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let threads = std::sync::Mutex::new(std::collections::HashSet::new());
    let failing = [streams[1].id(), streams[2].id()];
    let panicking = streams[3].id();
    let result = coordinator.execute_parallel(|stream| {
        threads.lock().unwrap().insert(std::thread::current().id());
        stream.launch(|s| kit.kernels.spin_ns(s, MS))?;
        if failing.contains(&stream.id()) {
            return Err(StreamError::InvalidArgument {
                operation: "test",
                reason: format!("stream {} fails on purpose", stream.id()),
            });
        }
        assert!(stream.id() != panicking, "stream closure panics on purpose");
        Ok(())
    });
    let Err(StreamError::Parallel { failures }) = result else {
        panic!("expected the failures collected, got {result:?}");
    };
    let ids: Vec<u64> = failures.iter().map(|(id, _)| *id).collect();
    let mut expected = vec![failing[0], failing[1], panicking];
    expected.sort_unstable();
    assert_eq!(ids, expected);
    let panicked = &failures.iter().find(|(id, _)| *id == panicking).unwrap().1;
    assert!(
        matches!(panicked, StreamError::Panicked { message, .. } if message.contains("on purpose"))
    );
    assert_eq!(threads.lock().unwrap().len(), 4, "one thread per stream");
    for stream in &streams {
        stream.synchronize().unwrap();
        assert_eq!(stream.metrics().unwrap().kernel_launches, 1);
    }
    assert!(coordinator.execute_parallel(|_| Ok(())).is_ok());
}

#[test]
fn completion_callbacks_fire_when_the_gpu_finishes_each_stream_and_all_of_them() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kit = kit(&gpu);
    let streams: Vec<Arc<PriorityStream>> = (0..3).map(|_| new_stream(&gpu)).collect();
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let (tx, rx) = mpsc::channel::<(&'static str, Instant)>();
    let started = Instant::now();
    for (stream, ms) in streams.iter().zip([20u64, 60, 40]) {
        stream.launch(|s| kit.kernels.spin_ns(s, ms * MS)).unwrap();
    }
    let each = tx.clone();
    coordinator
        .on_stream_complete(&streams[0], move || {
            each.send(("first", Instant::now())).unwrap()
        })
        .unwrap();
    coordinator
        .on_all_complete(move || tx.send(("all", Instant::now())).unwrap())
        .unwrap();
    let first = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    let all = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!((first.0, all.0), ("first", "all"));
    assert!(first.1 - started >= Duration::from_millis(19));
    assert!(
        all.1 - started >= Duration::from_millis(59),
        "all waited for the 60 ms stream"
    );
}
