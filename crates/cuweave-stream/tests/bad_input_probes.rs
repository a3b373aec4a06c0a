//! Adversarial probes of the rule "bad input gets a clear typed error, never a panic, never lost
//! data, never UB" in the stream layer, as PyTorch stream-pool and RMM users hit it: pools with
//! no streams, strategies with no stream to pick, priorities out of range, endless and zero
//! timeouts, self-dependencies and cycles, barriers of nothing, profiler reports of nothing,
//! stream-ordered allocations of zero bytes, of a tebibyte, and frees of unknown receipts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cuweave_driver::{DriverError, Stream, StreamFlags, StreamPriorityRange};
use cuweave_memory::MemoryError;
use cuweave_stream::{
    AllocationStrategy, DependencyGraph, MultiStreamCoordinator, OperationKind, PriorityStream,
    ProfileReport, ProfiledOperation, StreamError, StreamOrderedAllocator, StreamPool,
    StreamPoolConfig, StreamPriority, StreamProfiler, WorkloadType, compute_stream_share,
    queue_barrier, wait_for_any_ready,
};
use cuweave_test_support::{require_gpu, serial};

const TIB: usize = 1 << 40;

// ---------------------------------------------------------------------------------------------
// CPU-only: no device needed.
// ---------------------------------------------------------------------------------------------

#[test]
fn waiting_on_no_streams_returns_none_for_zero_and_endless_timeouts() {
    let started = Instant::now();
    assert!(wait_for_any_ready(&[], Duration::ZERO).unwrap().is_none());
    assert!(wait_for_any_ready(&[], Duration::MAX).unwrap().is_none());
    assert!(
        wait_for_any_ready(&[], Duration::from_secs(u64::MAX))
            .unwrap()
            .is_none()
    );
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[test]
fn an_empty_coordinator_barriers_runs_and_completes_without_a_device() {
    let coordinator = MultiStreamCoordinator::new();
    let barrier = coordinator.create_barrier().unwrap();
    assert_eq!((barrier.streams, barrier.events, barrier.waits), (0, 0, 0));
    coordinator
        .execute_parallel(|_| panic!("no stream to run on"))
        .unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    coordinator
        .on_all_complete(move || flag.store(true, Ordering::SeqCst))
        .unwrap();
    assert!(
        ran.load(Ordering::SeqCst),
        "no streams: the callback runs at once"
    );
    assert!(!coordinator.has_cycles());
    assert!(coordinator.cycles().is_empty());
    assert_eq!(coordinator.stats().barriers, 1);
    let info = queue_barrier(&[]).unwrap();
    assert_eq!((info.streams, info.events, info.waits), (0, 0, 0));
}

#[test]
fn dependency_graphs_of_unknown_ids_self_loops_and_cycles_are_reported_not_panics() {
    let mut graph = DependencyGraph::new();
    assert!(graph.prerequisites(u64::MAX).is_empty());
    assert!(graph.path(1, 2).is_none());
    graph.remove(12345);
    let self_loop = graph.try_add(7, 7);
    assert!(self_loop.is_err(), "{self_loop:?}");
    assert!(graph.try_add(1, 2).unwrap());
    assert!(graph.try_add(2, 3).unwrap());
    let cycle = graph.try_add(3, 1).unwrap_err();
    assert!(
        cycle.contains(&1) && cycle.contains(&3),
        "the refusal names the cycle: {cycle:?}"
    );
    assert!(!graph.has_cycles(), "a refused edge was kept");
    graph.add_unchecked(3, 1);
    assert!(graph.has_cycles());
    assert_eq!(graph.cycles().len(), 1);
    graph.add_unchecked(u64::MAX, 0);
    graph.remove(2);
    assert!(!graph.has_cycles());
    graph.clear();
    assert!(graph.is_empty());
}

#[test]
fn a_report_of_nothing_is_empty_and_displays() {
    let report = ProfileReport::from_operations(&[]);
    assert!(report.streams.is_empty());
    assert_eq!(report.combined.operations, 0);
    assert_eq!(report.combined.span_ns, (0, 0));
    assert_eq!(report.combined.busy_ns, 0);
    assert!(!report.to_string().is_empty());
}

fn op(start_ns: u64, duration_ns: u64) -> ProfiledOperation {
    ProfiledOperation {
        stream: 1,
        priority: StreamPriority::Normal,
        name: "op".into(),
        kind: OperationKind::Other,
        bytes: u64::MAX,
        start_ns,
        duration_ns,
    }
}

// A report reloaded from JSON (or made by hand) with times at the end of `u64`: summarising it
// must not panic. `ProfiledOperation::end_ns` is `start_ns + duration_ns` unchecked
// (src/profiler/report.rs) and the sums of durations and bytes (`ProfileReport::from_operations`,
// src/profiler/report.rs) are plain `+`/`sum()`, which overflow (a panic in debug builds, a wrapped
// nonsense in release).
#[test]
fn a_report_of_operations_with_extreme_times_does_not_overflow() {
    let json = serde_json::to_string(&[op(u64::MAX - 1, 10), op(0, u64::MAX)]).unwrap();
    let operations: Vec<ProfiledOperation> = serde_json::from_str(&json).unwrap();
    let report = std::panic::catch_unwind(|| ProfileReport::from_operations(&operations));
    let report = report.expect("summarising extreme times panicked");
    assert_eq!(report.combined.operations, 2);
    assert!(report.combined.span_ns.1 >= report.combined.span_ns.0);
}

#[test]
fn priority_mapping_with_a_one_value_range_is_consistent() {
    let range = StreamPriorityRange {
        least: 0,
        greatest: 0,
    };
    for level in StreamPriority::ALL {
        assert_eq!(level.to_driver(range), 0);
    }
    assert_eq!(
        StreamPriority::from_driver(i32::MAX, range),
        StreamPriority::High
    );
    assert_eq!(
        StreamPriority::from_driver(i32::MIN, range),
        StreamPriority::High
    );
    let h100 = StreamPriorityRange {
        least: 0,
        greatest: -5,
    };
    assert_eq!(StreamPriority::from_driver(1000, h100), StreamPriority::Low);
    assert_eq!(
        StreamPriority::from_driver(-1000, h100),
        StreamPriority::High
    );
}

// A range with its fields swapped (the naming invites it: the *least* priority is numerically
// the *greatest*): `from_driver` calls `i32::clamp(greatest, least)` through
// `StreamPriorityRange::clamp` (cuweave-driver src/context.rs), which panics when
// min > max; extreme ranges overflow `greatest + least` (`StreamPriority::to_driver`,
// src/priority.rs) and the distance `to_driver(range) - priority` (`StreamPriority::from_driver`,
// src/priority.rs).
#[test]
fn priority_mapping_with_a_swapped_or_extreme_range_does_not_panic() {
    let swapped = StreamPriorityRange {
        least: -5,
        greatest: 0,
    };
    let extreme = StreamPriorityRange {
        least: i32::MAX,
        greatest: i32::MIN,
    };
    let negative = StreamPriorityRange {
        least: i32::MIN,
        greatest: i32::MIN,
    };
    for range in [swapped, extreme, negative] {
        for priority in [i32::MIN, -3, 0, i32::MAX] {
            let got = std::panic::catch_unwind(|| {
                let level = StreamPriority::from_driver(priority, range);
                (level, level.to_driver(range))
            });
            assert!(got.is_ok(), "{range:?} / {priority}: panicked");
        }
    }
}

#[test]
fn compute_share_with_extreme_durations_stays_in_bounds() {
    for (normal, compute, mixed, current) in [
        (0, Duration::MAX, Duration::MAX, 5),
        (1, Duration::MAX, Duration::ZERO, 9),
        (8, Duration::MAX, Duration::MAX, 4),
        (8, Duration::MAX, Duration::from_nanos(1), 0),
        (8, Duration::from_nanos(1), Duration::MAX, 8),
        (usize::MAX, Duration::MAX, Duration::MAX, usize::MAX),
    ] {
        let share = compute_stream_share(normal, compute, mixed, current);
        assert!(share <= normal, "{normal} {compute:?} {mixed:?}: {share}");
    }
}

#[test]
fn pool_configs_with_no_streams_or_too_many_compute_streams_are_refused() {
    // The validation runs before any driver call, but `StreamPool::new` needs a context.
    let _serial = serial();
    let gpu = require_gpu!();
    let empty = StreamPoolConfig::default().with_counts(0, 0, 0);
    let got = StreamPool::new(&gpu.context, empty);
    assert!(
        matches!(got, Err(StreamError::InvalidArgument { .. })),
        "{:?}",
        got.map(|p| p.len())
    );
    let too_many = StreamPoolConfig::default()
        .with_counts(1, 2, 1)
        .with_compute_streams(3);
    let got = StreamPool::new(&gpu.context, too_many);
    assert!(
        matches!(got, Err(StreamError::InvalidArgument { .. })),
        "{:?}",
        got.map(|p| p.len())
    );
    let huge = StreamPoolConfig::default().with_compute_streams(usize::MAX);
    let got = StreamPool::new(&gpu.context, huge);
    assert!(
        matches!(got, Err(StreamError::InvalidArgument { .. })),
        "{:?}",
        got.map(|p| p.len())
    );
}

// ---------------------------------------------------------------------------------------------
// GPU.
// ---------------------------------------------------------------------------------------------

// A pool of high-priority streams only: every strategy still hands out a stream (or a typed
// `NoStreamForWorkload`), never an index panic on an empty set.
#[test]
fn a_pool_of_only_high_streams_serves_every_strategy_or_says_why_not() {
    let _serial = serial();
    let gpu = require_gpu!();
    let config = StreamPoolConfig::default()
        .with_counts(2, 0, 0)
        .with_compute_streams(0);
    let pool = StreamPool::new(&gpu.context, config).unwrap();
    for strategy in [
        AllocationStrategy::RoundRobin,
        AllocationStrategy::LoadBalanced,
        AllocationStrategy::Priority,
    ] {
        pool.set_strategy(strategy);
        let stream = pool.get_stream().unwrap();
        assert_eq!(stream.priority(), StreamPriority::High, "{strategy:?}");
    }
    pool.set_strategy(AllocationStrategy::Workload);
    let got = pool.get_stream().map(|s| s.id());
    assert!(
        matches!(
            got,
            Err(StreamError::NoStreamForWorkload {
                workload: WorkloadType::Mixed
            })
        ),
        "{got:?}"
    );
    for workload in [WorkloadType::Compute, WorkloadType::Memory] {
        let got = pool.get_stream_for_workload(workload).map(|s| s.id());
        assert!(
            matches!(got, Err(StreamError::NoStreamForWorkload { .. })),
            "{workload:?}: {got:?}"
        );
    }
    assert!(
        pool.get_stream_for_workload(WorkloadType::Coordination)
            .is_ok()
    );
    for priority in StreamPriority::ALL {
        assert_eq!(
            pool.get_priority_stream(priority).unwrap().priority(),
            StreamPriority::High
        );
    }
    pool.record_workload_completion(WorkloadType::Compute, Duration::MAX);
    pool.record_workload_completion(WorkloadType::Mixed, Duration::MAX);
    let change = pool.optimize_configuration();
    assert_eq!(change.after.normal, 0);
}

#[test]
fn waiting_for_a_ready_stream_with_zero_and_endless_timeouts_returns_promptly() {
    let _serial = serial();
    let gpu = require_gpu!();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    for stream in pool.streams() {
        stream.synchronize().unwrap();
    }
    let started = Instant::now();
    assert!(pool.wait_for_any_ready(Duration::ZERO).unwrap().is_some());
    assert!(pool.wait_for_any_ready(Duration::MAX).unwrap().is_some());
    assert!(started.elapsed() < Duration::from_secs(1));
}

// `torch.cuda.Stream(priority=...)` clamps; the driver layer refuses a priority outside the
// device's range with `InvalidArgument`, and the in-range one still works.
#[test]
fn stream_priorities_out_of_range_are_invalid_arguments() {
    let _serial = serial();
    let gpu = require_gpu!();
    let range = gpu.context.stream_priority_range().unwrap();
    for priority in [range.least + 1, range.greatest - 1, i32::MIN, i32::MAX] {
        let got = Stream::with_priority(&gpu.context, StreamFlags::NON_BLOCKING, priority);
        assert!(
            matches!(got, Err(DriverError::InvalidArgument { .. })),
            "{priority}: {:?}",
            got.map(|s| s.id())
        );
    }
    let stream =
        Stream::with_priority(&gpu.context, StreamFlags::NON_BLOCKING, range.greatest).unwrap();
    let stream = PriorityStream::from_stream(stream).unwrap();
    assert_eq!(stream.priority(), StreamPriority::High);
    stream.synchronize().unwrap();
}

#[test]
fn a_stream_depending_on_itself_is_a_self_dependency_and_cycles_are_only_reported() {
    let _serial = serial();
    let gpu = require_gpu!();
    let a = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let b = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let coordinator = MultiStreamCoordinator::new();
    let got = coordinator.add_dependency(&a, &a);
    assert!(
        matches!(got, Err(StreamError::SelfDependency { stream, .. }) if stream == a.id()),
        "{got:?}"
    );
    assert!(
        coordinator.streams().is_empty(),
        "a refused dependency added streams"
    );
    coordinator.add_dependency(&a, &b).unwrap();
    coordinator.add_dependency(&b, &a).unwrap();
    assert!(coordinator.has_cycles());
    let barrier = coordinator.create_barrier().unwrap();
    assert_eq!(barrier.streams, 2);
    assert!(!coordinator.has_cycles());
    a.synchronize().unwrap();
    b.synchronize().unwrap();
}

#[test]
fn a_profiler_with_nothing_recorded_reports_nothing() {
    let _serial = serial();
    let gpu = require_gpu!();
    let profiler = StreamProfiler::with_limit(&gpu.context, 0).unwrap();
    assert!(profiler.operations().unwrap().is_empty());
    let report = profiler.report().unwrap();
    assert!(report.streams.is_empty());
    assert_eq!(report.combined.operations, 0);
    let trace: serde_json::Value = serde_json::from_str(&profiler.chrome_trace().unwrap()).unwrap();
    assert!(trace["traceEvents"].is_array());
    profiler.clear();
    assert_eq!(profiler.pending(), 0);
}

// RMM's `cuda_async_memory_resource`: zero bytes and sizes that overflow the size classes are
// `InvalidArgument`; a tebibyte is the memory layer's out-of-memory error; none of them leaves
// an allocation behind, and a normal allocation works afterwards on the same stream.
#[test]
fn stream_ordered_allocations_of_zero_overflowing_and_huge_sizes_are_typed_errors() {
    let _serial = serial();
    let gpu = require_gpu!();
    let stream = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let allocator = StreamOrderedAllocator::default();

    let got = allocator.allocate_for_stream(&stream, 0);
    assert!(
        matches!(got, Err(StreamError::InvalidArgument { .. })),
        "{got:?}"
    );
    let got = allocator.allocate_for_stream(&stream, usize::MAX);
    assert!(
        matches!(got, Err(StreamError::InvalidArgument { .. })),
        "{got:?}"
    );
    let got = allocator.allocate_for_stream(&stream, TIB);
    match &got {
        Err(StreamError::Memory(error)) => assert!(error.is_out_of_memory(), "{error:?}"),
        Err(StreamError::Driver(error)) => assert!(error.is_out_of_memory(), "{error:?}"),
        other => panic!("a tebibyte: {other:?}"),
    }
    assert_eq!(allocator.outstanding(), 0);
    stream
        .synchronize()
        .expect("the stream survives a refused allocation");

    let got = allocator.buffer::<u32>(&stream, 0).map(drop);
    assert!(
        matches!(
            got,
            Err(StreamError::Memory(MemoryError::ZeroLength { .. }))
        ),
        "{got:?}"
    );
    let got = allocator.buffer::<u64>(&stream, usize::MAX).map(drop);
    assert!(
        matches!(
            got,
            Err(StreamError::Memory(MemoryError::Misaligned { .. }))
        ),
        "{got:?}"
    );

    let allocation = allocator.allocate_for_stream(&stream, 4096).unwrap();
    assert_eq!(allocator.outstanding(), 1);
    allocator.free(allocation).unwrap();
    let twice = allocator.free(allocation);
    assert!(
        matches!(twice, Err(StreamError::UnknownAllocation { .. })),
        "{twice:?}"
    );
    let ptr = allocator.device_ptr(&allocation);
    assert!(
        matches!(ptr, Err(StreamError::UnknownAllocation { .. })),
        "{ptr:?}"
    );
    assert_eq!(allocator.outstanding(), 0);
    assert_eq!(allocator.free_for_stream(&stream).unwrap(), 0);
    stream.synchronize().unwrap();
}
