//! GPU tests of `MultiStreamCoordinator`: dependencies proven by a flag a kernel writes and
//! another reads, cycles refused, device-side barriers, parallel execution, completion callbacks.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_stream::{MultiStreamCoordinator, PriorityStream, StreamError, StreamPriority};
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
fn a_dependency_closing_a_cycle_is_refused_and_named() {
    let gpu = cuweave_test_support::require_gpu!();
    let (a, b, c) = (new_stream(&gpu), new_stream(&gpu), new_stream(&gpu));
    let coordinator = MultiStreamCoordinator::new();
    coordinator.add_dependency(&b, &a).unwrap();
    coordinator.add_dependency(&c, &b).unwrap();
    let refused = coordinator.add_dependency(&a, &c).unwrap_err();
    assert_eq!(
        refused,
        StreamError::DependencyCycle {
            dependent: a.id(),
            prerequisite: c.id(),
            cycle: vec![a.id(), c.id(), b.id()],
        }
    );
    assert!(refused.to_string().contains(&format!(
        "{} -> {} -> {} -> {}",
        a.id(),
        c.id(),
        b.id(),
        a.id()
    )));
    assert!(matches!(
        coordinator.add_dependency(&a, &a),
        Err(StreamError::SelfDependency { .. })
    ));
    assert!(!coordinator.has_cycles());
    assert!(coordinator.cycles().is_empty());
    assert_eq!(coordinator.dependencies().len(), 2);
    let stats = coordinator.stats();
    assert_eq!((stats.dependencies, stats.refused_cycles), (2, 1));
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
    assert_eq!((barrier.streams, barrier.events, barrier.waits), (3, 3, 6));
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
