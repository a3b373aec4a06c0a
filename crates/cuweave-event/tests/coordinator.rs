//! GPU tests of the operation coordinator: a pipeline across four streams checked by kernels,
//! a missing dependency caught, typed errors, callbacks after the GPU, priorities, cycles,
//! stalls and metrics.

mod common;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use common::{Flags, MS};
use cuweave_driver::memory::{self, DeviceAllocation, HostAllocFlags, HostAllocation};
use cuweave_event::{
    EventError, EventPool, EventPriority, OperationCoordinator, OperationState, OperationType,
};
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{Gpu, require_gpu, serial};

const N: usize = 1 << 20;
const SENTINEL: u32 = 0xFFFF_FFFF;

struct PipelineRun {
    sum: u64,
    unfinished: [u32; 2],
}

/// Copy in (after a 20 ms spin, so it lands late) on stream 0; compute `2x+1` on stream 1 and
/// `3x` on stream 2; reduce both into one sum on stream 3. With `drop_dependency`, the second
/// compute stage does not depend on the copy.
fn pipeline(gpu: &Gpu, drop_dependency: bool) -> PipelineRun {
    let test_kernels = TestKernels::load(&gpu.context).unwrap();
    let kernels = EventKernels::load(&gpu.context).unwrap();
    let streams: Vec<_> = (0..4).map(|_| common::stream(&gpu.context)).collect();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 8, 8).unwrap()).unwrap();

    let mut host = HostAllocation::new(&gpu.context, N * 4, HostAllocFlags::default()).unwrap();
    for (i, chunk) in host.as_bytes_mut().chunks_exact_mut(4).enumerate() {
        chunk.copy_from_slice(&(i as u32).to_le_bytes());
    }
    let input = DeviceAllocation::new(&gpu.context, N * 4).unwrap();
    let doubled = DeviceAllocation::new(&gpu.context, N * 4).unwrap();
    let tripled = DeviceAllocation::new(&gpu.context, N * 4).unwrap();
    let counters = DeviceAllocation::new(&gpu.context, 16).unwrap();
    // SAFETY: fresh allocations of this context, sized as written.
    unsafe {
        memory::memset_d32(&gpu.context, input.ptr(), SENTINEL, N).unwrap();
        memory::memset_d32(&gpu.context, counters.ptr(), 0, 4).unwrap();
    }
    let (unfinished_a, unfinished_b, sum) =
        (counters.ptr(), counters.ptr() + 4, counters.ptr() + 8);

    let copy = coordinator
        .register_operation(
            OperationType::MemoryTransfer,
            EventPriority::High,
            Some(&streams[0]),
            &[],
            "copy in",
        )
        .unwrap();
    let compute_a = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            Some(&streams[1]),
            &[copy],
            "2x+1",
        )
        .unwrap();
    let compute_b_deps = if drop_dependency { vec![] } else { vec![copy] };
    let compute_b = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            Some(&streams[2]),
            &compute_b_deps,
            "3x",
        )
        .unwrap();
    let reduce = coordinator
        .register_operation(
            OperationType::Reduction,
            EventPriority::Low,
            Some(&streams[3]),
            &[compute_a, compute_b],
            "sum",
        )
        .unwrap();
    assert!(coordinator.detect_deadlocks().is_empty());

    coordinator.begin_operation(copy, &streams[0]).unwrap();
    test_kernels.spin_ns(&streams[0], 20 * MS).unwrap();
    // SAFETY: pinned host memory and a device allocation of N u32s, both alive until the end.
    unsafe { memory::copy_htod_async(input.ptr(), host.as_ptr(), N * 4, &streams[0]).unwrap() };
    coordinator.complete_operation(copy).unwrap();

    for (op, stream, out, mul, add, unfinished) in [
        (compute_a, &streams[1], doubled.ptr(), 2, 1, unfinished_a),
        (compute_b, &streams[2], tripled.ptr(), 3, 0, unfinished_b),
    ] {
        coordinator.begin_operation(op, stream).unwrap();
        // SAFETY: device allocations of N u32s and a counter, alive until the end.
        unsafe {
            kernels
                .transform_checked_u32(stream, input.ptr(), out, N, mul, add, SENTINEL, unfinished)
                .unwrap()
        };
        coordinator.complete_operation(op).unwrap();
    }

    coordinator.begin_operation(reduce, &streams[3]).unwrap();
    // SAFETY: as above; `sum` is 8-byte aligned.
    unsafe {
        test_kernels
            .checksum_u32(&streams[3], doubled.ptr(), N, sum)
            .unwrap();
        test_kernels
            .checksum_u32(&streams[3], tripled.ptr(), N, sum)
            .unwrap();
    }
    coordinator.complete_operation(reduce).unwrap();
    coordinator.synchronize(reduce).unwrap();
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    let metrics = coordinator.metrics();
    assert_eq!(
        metrics.cross_stream_waits,
        if drop_dependency { 3 } else { 4 }
    );

    let mut out = [0u8; 16];
    // SAFETY: 16 bytes of a live allocation; the streams are idle.
    unsafe { memory::copy_dtoh(&gpu.context, out.as_mut_ptr(), counters.ptr(), 16).unwrap() };
    PipelineRun {
        sum: u64::from_le_bytes(out[8..16].try_into().unwrap()),
        unfinished: [
            u32::from_le_bytes(out[0..4].try_into().unwrap()),
            u32::from_le_bytes(out[4..8].try_into().unwrap()),
        ],
    }
}

fn expected_sum() -> u64 {
    (0..N as u64)
        .map(|i| u64::from((2 * i + 1) as u32) + u64::from((3 * i) as u32))
        .sum()
}

#[test]
fn a_three_stage_pipeline_across_four_streams_computes_the_right_sum() {
    let gpu = require_gpu!();
    let _serial = serial();
    let run = pipeline(&gpu, false);
    assert_eq!(
        run.unfinished,
        [0, 0],
        "a compute stage read input before the copy landed"
    );
    assert_eq!(run.sum, expected_sum());
}

#[test]
fn with_one_dependency_removed_a_kernel_sees_unfinished_input() {
    let gpu = require_gpu!();
    let _serial = serial();
    let run = pipeline(&gpu, true);
    assert_eq!(
        run.unfinished[0], 0,
        "the stage that kept its dependency saw unfinished input"
    );
    assert!(
        run.unfinished[1] > 0,
        "the stage without its dependency did not overtake the copy"
    );
    assert_ne!(run.sum, expected_sum());
}

#[test]
fn beginning_before_a_dependency_is_queued_is_a_typed_error() {
    let gpu = require_gpu!();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 2, 2).unwrap()).unwrap();
    let stream = common::stream(&gpu.context);
    let first = coordinator
        .register_operation(OperationType::Kernel, EventPriority::Normal, None, &[], "a")
        .unwrap();
    let second = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            None,
            &[first],
            "b",
        )
        .unwrap();
    assert_eq!(
        coordinator.begin_operation(second, &stream),
        Err(EventError::DependencyNotQueued {
            id: second,
            dependency: first
        })
    );
    coordinator.begin_operation(first, &stream).unwrap();
    assert!(matches!(
        coordinator.begin_operation(second, &stream),
        Err(EventError::DependencyNotQueued { .. })
    ));
    assert!(matches!(
        coordinator.begin_operation(first, &stream),
        Err(EventError::InvalidState { .. })
    ));
    coordinator.complete_operation(first).unwrap();
    coordinator.begin_operation(second, &stream).unwrap();
    coordinator.complete_operation(second).unwrap();
    let metrics = coordinator.metrics();
    // `first` is on the same stream: no wait either way (skipped while it is queued, needless
    // once the GPU has completed it).
    assert_eq!(metrics.cross_stream_waits, 0);
    assert!(metrics.same_stream_waits_skipped <= 1);
    let other = OperationCoordinator::new(EventPool::new(&gpu.context, 0, 0).unwrap()).unwrap();
    let mut foreign = None;
    for _ in 0..5 {
        foreign = Some(
            other
                .register_operation(OperationType::Kernel, EventPriority::Normal, None, &[], "x")
                .unwrap(),
        );
    }
    let foreign = foreign.unwrap();
    assert!(matches!(
        coordinator.register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            None,
            &[foreign],
            "x"
        ),
        Err(EventError::UnknownOperation { .. })
    ));
    coordinator.synchronize(second).unwrap();
}

#[test]
fn completion_callbacks_fire_when_the_gpu_reaches_the_event() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 2, 2).unwrap()).unwrap();
    coordinator.set_timing(true);
    let stream = common::stream(&gpu.context);
    let flags = Arc::new(Flags::new(&gpu.context, 1));
    let op = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::High,
            Some(&stream),
            &[],
            "spin",
        )
        .unwrap();
    coordinator.begin_operation(op, &stream).unwrap();
    // SAFETY: mapped flag of this context, alive until the stream is done.
    unsafe {
        kernels
            .spin_then_store_u32(&stream, 30 * MS, flags.device(0), 1)
            .unwrap()
    };
    coordinator.complete_operation(op).unwrap();
    let (tx, rx) = mpsc::channel();
    let seen = Arc::clone(&flags);
    coordinator
        .on_complete(op, move |id, result| {
            tx.send((id, result, seen.read(0))).unwrap();
        })
        .unwrap();
    assert!(
        rx.try_recv().is_err(),
        "the callback ran at complete_operation"
    );
    assert_eq!(coordinator.state(op).unwrap(), OperationState::Queued);
    let (id, result, flag) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!((id, result, flag), (op, Ok(()), 1));
    assert_eq!(coordinator.state(op).unwrap(), OperationState::Completed);
    // Completed with nothing depending on it: retired, its figures in the metrics.
    assert_eq!(
        coordinator.metadata(op),
        Err(EventError::Retired { id: op })
    );
    assert_eq!(coordinator.live_operations(), 0);
    coordinator.synchronize(op).unwrap();
    futures_lite_ready(coordinator.completion(op).unwrap());
    let metrics = coordinator.metrics();
    assert_eq!(metrics.completed, 1);
    let gpu_time = metrics.gpu_time_by_type[&OperationType::Kernel];
    assert!(
        gpu_time >= Duration::from_millis(29),
        "GPU time {gpu_time:?} for a 30 ms spin"
    );
    assert!(metrics.coordination_time > Duration::ZERO);
}

/// Resolves an already-resolved future on this thread.
fn futures_lite_ready(future: cuweave_event::WaitFuture) {
    assert_eq!(futures::executor::block_on(future), Ok(()));
}

#[test]
fn a_million_sequential_operations_retire_and_stay_within_64_events() {
    // A training loop's shape: each operation depends on the one before. Finished work
    // retires, so events and records stay bounded by what is in flight.
    const OPERATIONS: u64 = 1_000_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let (a, b) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let pool = EventPool::new(&gpu.context, 0, 0).unwrap();
    let coordinator = OperationCoordinator::new(pool.clone()).unwrap();
    let mut previous: Option<cuweave_event::OperationId> = None;
    let mut live_peak = 0;
    let mut rss_after_warmup = 0;
    for i in 0..OPERATIONS {
        let deps: Vec<_> = previous.into_iter().collect();
        let id = coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                None,
                &deps,
                "step",
            )
            .unwrap();
        // Every 1000th operation switches stream, so cross-stream waits are exercised too.
        let stream = if (i / 1000) % 2 == 0 { &a } else { &b };
        coordinator.begin_operation(id, stream).unwrap();
        coordinator.complete_operation(id).unwrap();
        previous = Some(id);
        if i % 10_000 == 0 {
            live_peak = live_peak.max(coordinator.live_operations());
        }
        if i == 100_000 {
            rss_after_warmup = cuweave_test_support::resident_bytes();
        }
    }
    coordinator.synchronize(previous.unwrap()).unwrap();
    coordinator.retire_finished();
    let rss_end = cuweave_test_support::resident_bytes();
    let counters = pool.counters();
    let created = counters.created_regular + counters.created_timing;
    let metrics = coordinator.metrics();
    eprintln!(
        "{OPERATIONS} operations: {created} events created ({counters:?}), live peak {live_peak}, \
         rss {rss_after_warmup} -> {rss_end} bytes, cross-stream waits {}",
        metrics.cross_stream_waits
    );
    assert!(created <= 64, "created {created} events");
    assert_eq!(metrics.completed, OPERATIONS);
    assert_eq!(coordinator.live_operations(), 0);
    assert!(
        rss_end <= rss_after_warmup + (8 << 20),
        "resident memory grew from {rss_after_warmup} to {rss_end} bytes"
    );
}

#[test]
fn ready_operations_are_listed_most_urgent_first() {
    let gpu = require_gpu!();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 2, 2).unwrap()).unwrap();
    let stream = common::stream(&gpu.context);
    let register = |priority, deps: &[_]| {
        coordinator
            .register_operation(OperationType::Kernel, priority, None, deps, "op")
            .unwrap()
    };
    let base = register(EventPriority::Normal, &[]);
    let cleanup = register(EventPriority::Cleanup, &[]);
    let critical = register(EventPriority::Critical, &[base]);
    let high = register(EventPriority::High, &[]);
    let low = register(EventPriority::Low, &[]);
    assert_eq!(
        coordinator.ready_operations(),
        vec![high, base, low, cleanup]
    );
    coordinator.begin_operation(base, &stream).unwrap();
    coordinator.complete_operation(base).unwrap();
    assert_eq!(
        coordinator.ready_operations(),
        vec![critical, high, low, cleanup]
    );
    stream.synchronize().unwrap();
}

#[test]
fn every_dependency_cycle_is_detected_even_when_closed_later() {
    let gpu = require_gpu!();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 0, 0).unwrap()).unwrap();
    let register = |deps: &[_]| {
        coordinator
            .register_operation(
                OperationType::AllReduce,
                EventPriority::Normal,
                None,
                deps,
                "op",
            )
            .unwrap()
    };
    let a = register(&[]);
    let b = register(&[a]);
    let c = register(&[b]);
    let d = register(&[]);
    let e = register(&[d]);
    assert!(coordinator.detect_deadlocks().is_empty());
    coordinator.add_dependency(a, c).unwrap();
    coordinator.add_dependency(d, e).unwrap();
    coordinator.add_dependency(b, c).unwrap();
    let mut cycles = coordinator.detect_deadlocks();
    cycles.sort();
    assert_eq!(cycles, vec![vec![a, c, b], vec![b, c], vec![d, e]]);
    assert_eq!(
        coordinator.add_dependency(a, a),
        Err(EventError::SelfDependency { id: a })
    );
    let metrics = coordinator.metrics();
    assert_eq!((metrics.deadlock_detections, metrics.cycles_found), (1, 3));
}

#[test]
fn an_operation_waiting_on_one_never_begun_is_reported_stalled() {
    let gpu = require_gpu!();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 1, 1).unwrap()).unwrap();
    let never = coordinator
        .register_operation(
            OperationType::Broadcast,
            EventPriority::Normal,
            None,
            &[],
            "never begun",
        )
        .unwrap();
    let waiting = coordinator
        .register_operation(
            OperationType::Barrier,
            EventPriority::Normal,
            None,
            &[never],
            "waits",
        )
        .unwrap();
    let result = coordinator.wait_until_ready(waiting, Duration::from_millis(50));
    match result {
        Err(EventError::Stalled {
            id,
            waited,
            blocked_on,
        }) => {
            assert_eq!((id, blocked_on), (waiting, vec![never]));
            assert!(waited >= Duration::from_millis(50));
        }
        other => panic!("expected a stall, got {other:?}"),
    }
    assert_eq!(
        coordinator.stalled_operations(Duration::ZERO),
        vec![(waiting, vec![never])]
    );
    // Once the dependency is queued, a waiting caller is released.
    let stream = common::stream(&gpu.context);
    let (coordinator2, stream2) = (coordinator.clone(), Arc::clone(&stream));
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        coordinator2.begin_operation(never, &stream2).unwrap();
        coordinator2.complete_operation(never).unwrap();
    });
    coordinator
        .wait_until_ready(waiting, Duration::from_secs(5))
        .unwrap();
    releaser.join().unwrap();
    assert!(coordinator.stalled_operations(Duration::ZERO).is_empty());
    stream.synchronize().unwrap();
}

#[test]
fn given_a_stream_pool_an_operation_begins_on_a_stream_of_its_priority() {
    use cuweave_stream::{StreamPool, StreamPoolConfig, StreamPriority};
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 4, 4).unwrap()).unwrap();
    let urgent = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Critical,
            None,
            &[],
            "urgent",
        )
        .unwrap();
    let cleanup = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Cleanup,
            None,
            &[urgent],
            "tidy",
        )
        .unwrap();
    let high = coordinator.begin_on_pool(urgent, &pool).unwrap();
    assert_eq!(high.priority(), StreamPriority::High);
    kernels.spin_ns(high.stream(), MS).unwrap();
    coordinator.complete_operation(urgent).unwrap();
    let low = coordinator.begin_on_pool(cleanup, &pool).unwrap();
    assert_eq!(low.priority(), StreamPriority::Low);
    coordinator.complete_operation(cleanup).unwrap();
    assert_eq!(coordinator.metadata(cleanup).unwrap().cross_stream_waits, 1);
    coordinator.synchronize(cleanup).unwrap();
    assert!(
        high.stream().query().unwrap(),
        "the low stream finished before the high one it waits on"
    );
}

#[test]
fn a_completed_operation_kept_for_a_dependant_still_answers_synchronize_and_completion() {
    let gpu = require_gpu!();
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 2, 2).unwrap()).unwrap();
    let stream = common::stream(&gpu.context);
    let a = coordinator
        .register_operation(OperationType::Kernel, EventPriority::Normal, None, &[], "a")
        .unwrap();
    let b = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            None,
            &[a],
            "b",
        )
        .unwrap();
    coordinator.begin_operation(a, &stream).unwrap();
    coordinator.complete_operation(a).unwrap();
    stream.synchronize().unwrap();
    // Observes a's completion; b, registered and not begun, keeps a's record alive.
    assert_eq!(coordinator.ready_operations(), vec![b]);
    assert_eq!(coordinator.state(a).unwrap(), OperationState::Completed);
    assert!(coordinator.metadata(a).is_ok(), "a is still live");
    coordinator.synchronize(a).unwrap();
    futures_lite_ready(coordinator.completion(a).unwrap());
    // b has not been queued: no event to wait on yet, a typed error.
    assert!(matches!(
        coordinator.synchronize(b),
        Err(EventError::InvalidState { .. })
    ));
    coordinator.begin_operation(b, &stream).unwrap();
    coordinator.complete_operation(b).unwrap();
    coordinator.synchronize(b).unwrap();
    // a has retired now; still Ok.
    coordinator.synchronize(a).unwrap();
    futures_lite_ready(coordinator.completion(a).unwrap());
}

#[test]
fn a_slow_stream_does_not_hide_completions_on_another_and_records_stay_bounded() {
    const ITERATIONS: u64 = 100_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let (slow_stream, fast_stream) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let gate = Flags::new(&gpu.context, 1);
    let pool = EventPool::new(&gpu.context, 0, 0).unwrap();
    let coordinator = OperationCoordinator::new(pool.clone()).unwrap();
    let register = || {
        coordinator
            .register_operation(
                OperationType::Kernel,
                EventPriority::Normal,
                None,
                &[],
                "op",
            )
            .unwrap()
    };
    let slow = register();
    coordinator.begin_operation(slow, &slow_stream).unwrap();
    // SAFETY: the gate is mapped pinned memory of this context, alive until the end of the test
    // (after the stream is done); the host writes it only with volatile writes.
    unsafe {
        kernels
            .wait_u32(&slow_stream, gate.device(0), 1, 10_000 * MS)
            .unwrap()
    };
    coordinator.complete_operation(slow).unwrap();

    let first = register();
    coordinator.begin_operation(first, &fast_stream).unwrap();
    coordinator.complete_operation(first).unwrap();
    fast_stream.synchronize().unwrap();
    assert_eq!(
        coordinator.state(first).unwrap(),
        OperationState::Completed,
        "the completion on the fast stream was hidden behind the gated one"
    );

    let mut live_peak = 0;
    for i in 0..ITERATIONS {
        let id = register();
        coordinator.begin_operation(id, &fast_stream).unwrap();
        coordinator.complete_operation(id).unwrap();
        if i % 1000 == 0 {
            live_peak = live_peak.max(coordinator.live_operations());
        }
    }
    fast_stream.synchronize().unwrap();
    coordinator.retire_finished();
    let counters = pool.counters();
    let created = counters.created_regular + counters.created_timing;
    let live_end = coordinator.live_operations();
    let still_gated = coordinator.state(slow).unwrap();
    gate.write(0, 1);
    coordinator.synchronize(slow).unwrap();
    eprintln!(
        "{ITERATIONS} operations beside a gated one: {created} events, live peak {live_peak}"
    );
    assert_eq!(still_gated, OperationState::Queued);
    assert_eq!(live_end, 1, "only the gated operation stays live");
    assert!(live_peak <= 128, "live operations peaked at {live_peak}");
    assert!(created <= 128, "created {created} events");
    assert_eq!(coordinator.state(slow).unwrap(), OperationState::Completed);
    assert_eq!(coordinator.live_operations(), 0);
}

#[test]
fn beginning_on_a_stream_of_another_device_is_a_typed_error_and_changes_nothing() {
    let gpu = require_gpu!();
    let count = cuweave_driver::Device::count().unwrap();
    if count < 2 {
        cuweave_test_support::skip(
            "coordinator::beginning_on_a_stream_of_another_device_is_a_typed_error_and_changes_nothing",
            "needs a second device",
        );
        return;
    }
    let other = cuweave_driver::Context::primary(cuweave_driver::Device::get(1).unwrap()).unwrap();
    let foreign = common::stream(&other);
    let stream = common::stream(&gpu.context);
    let coordinator =
        OperationCoordinator::new(EventPool::new(&gpu.context, 2, 2).unwrap()).unwrap();
    let op = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            None,
            &[],
            "op",
        )
        .unwrap();
    assert_eq!(
        coordinator.begin_operation(op, &foreign),
        Err(EventError::ForeignStream {
            id: op,
            stream: foreign.id(),
            stream_device: 1,
            pool_device: gpu.device.ordinal(),
        })
    );
    assert_eq!(coordinator.state(op).unwrap(), OperationState::Registered);
    assert_eq!(coordinator.metrics().begun, 0);
    // Still registered: it begins and completes on a stream of the pool's context.
    coordinator.begin_operation(op, &stream).unwrap();
    coordinator.complete_operation(op).unwrap();
    coordinator.synchronize(op).unwrap();
    assert_eq!(coordinator.state(op).unwrap(), OperationState::Completed);
}
