//! GPU tests of `StreamPool`: strategies chosen from what the GPU is doing, workload sets,
//! ready-stream detection and waiting, the per-device pool, layout optimisation.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuweave_stream::{
    AllocationStrategy, PriorityStream, StreamError, StreamPool, StreamPoolConfig, StreamPriority,
    WorkloadType,
};
use cuweave_test_support::kernels::TestKernels;

const MS: u64 = 1_000_000;

fn pool(
    gpu: &cuweave_test_support::Gpu,
    high: usize,
    normal: usize,
    low: usize,
    strategy: AllocationStrategy,
) -> StreamPool {
    StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(strategy)
            .with_counts(high, normal, low)
            .with_compute_streams(normal.min(1)),
    )
    .expect("pool")
}

fn spin(kernels: &TestKernels, stream: &PriorityStream, ns: u64) {
    stream.launch(|s| kernels.spin_ns(s, ns)).expect("spin");
}

#[test]
fn round_robin_cycles_through_the_normal_streams() {
    let gpu = cuweave_test_support::require_gpu!();
    let pool = pool(&gpu, 1, 3, 1, AllocationStrategy::RoundRobin);
    let ids: Vec<u64> = (0..6).map(|_| pool.get_stream().unwrap().id()).collect();
    assert_eq!(ids[0..3], ids[3..6]);
    assert_eq!(ids[0..3].iter().collect::<HashSet<_>>().len(), 3);
    for stream in pool.streams_of(StreamPriority::Normal) {
        assert!(ids.contains(&stream.id()));
    }
    assert_eq!(pool.len(), 5);
}

#[test]
fn load_balanced_picks_the_stream_with_the_least_queued_gpu_work() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = pool(&gpu, 0, 3, 0, AllocationStrategy::LoadBalanced);
    let streams = pool.streams_of(StreamPriority::Normal).to_vec();
    spin(&kernels, &streams[0], 200 * MS);
    spin(&kernels, &streams[1], 200 * MS);
    for _ in 0..5 {
        assert_eq!(
            pool.get_stream().unwrap().id(),
            streams[2].id(),
            "the idle stream"
        );
    }
    spin(&kernels, &streams[2], 200 * MS);
    spin(&kernels, &streams[2], 200 * MS);
    let loads: Vec<u64> = streams
        .iter()
        .map(|s| s.outstanding_work().unwrap())
        .collect();
    assert_eq!(loads, vec![1, 1, 2]);
    for _ in 0..4 {
        assert_ne!(
            pool.get_stream().unwrap().id(),
            streams[2].id(),
            "not the busiest"
        );
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert!(streams.iter().all(|s| s.outstanding_work().unwrap() == 0));
}

#[test]
fn priority_strategy_prefers_the_most_urgent_idle_stream() {
    let gpu = cuweave_test_support::require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = pool(&gpu, 1, 1, 1, AllocationStrategy::Priority);
    let first = pool.get_stream().unwrap();
    assert_eq!(first.priority(), StreamPriority::High);
    spin(&kernels, &first, 100 * MS);
    assert_eq!(
        pool.get_stream().unwrap().priority(),
        StreamPriority::Normal
    );
    first.synchronize().unwrap();
    assert_eq!(pool.get_stream().unwrap().priority(), StreamPriority::High);
}

#[test]
fn workloads_get_their_priority_and_memory_stays_off_compute_streams() {
    let gpu = cuweave_test_support::require_gpu!();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Workload),
    )
    .unwrap();
    let ids = |workload| -> HashSet<u64> {
        pool.workload_streams(workload)
            .unwrap()
            .iter()
            .map(|s| s.id())
            .collect()
    };
    let (compute, memory) = (ids(WorkloadType::Compute), ids(WorkloadType::Memory));
    assert!(compute.is_disjoint(&memory));
    for _ in 0..8 {
        let stream = pool.get_stream_for_workload(WorkloadType::Memory).unwrap();
        assert!(!compute.contains(&stream.id()));
        assert_eq!(stream.priority(), StreamPriority::Low);
    }
    for workload in WorkloadType::ALL {
        let stream = pool.get_stream_for_workload(workload).unwrap();
        assert_eq!(stream.priority(), workload.priority(), "{workload}");
    }
    let coordination = pool
        .get_stream_for_workload(WorkloadType::Coordination)
        .unwrap();
    let memory_stream = pool.get_stream_for_workload(WorkloadType::Memory).unwrap();
    assert!(coordination.driver_priority() <= memory_stream.driver_priority());
    assert!(ids(WorkloadType::Mixed).contains(&pool.get_stream().unwrap().id()));

    // A pool whose only streams are compute streams has nowhere to put memory work.
    let compute_only = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Workload)
            .with_counts(0, 2, 0)
            .with_compute_streams(2),
    )
    .unwrap();
    assert!(matches!(
        compute_only.get_stream_for_workload(WorkloadType::Memory),
        Err(StreamError::NoStreamForWorkload {
            workload: WorkloadType::Memory
        })
    ));
}

#[test]
fn optimize_configuration_follows_recorded_workload_times() {
    let gpu = cuweave_test_support::require_gpu!();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    assert_eq!(pool.average_workload_time(WorkloadType::Compute), None);
    assert!(!pool.optimize_configuration().changed());
    for _ in 0..3 {
        pool.record_workload_completion(WorkloadType::Compute, Duration::from_millis(30));
    }
    pool.record_workload_completion(WorkloadType::Mixed, Duration::from_millis(10));
    assert_eq!(
        pool.average_workload_time(WorkloadType::Compute),
        Some(Duration::from_millis(30))
    );
    let change = pool.optimize_configuration();
    // 4 normal streams, compute 90 ms of 100 ms: round(3.6) = 4, capped at 3 to keep one for mixed.
    assert_eq!(
        (change.before.compute_streams, change.after.compute_streams),
        (2, 3)
    );
    assert_eq!(
        pool.workload_streams(WorkloadType::Compute).unwrap().len(),
        3
    );
    assert_eq!(pool.workload_streams(WorkloadType::Mixed).unwrap().len(), 1);
}

#[test]
fn wait_for_any_ready_returns_the_shortest_spin_without_burning_a_core() {
    let gpu = cuweave_test_support::require_gpu!();
    if cuweave_test_support::skip_under_sanitizer(
        "pool::wait_for_any_ready_returns_the_shortest_spin_without_burning_a_core",
        "memcheck serialises kernels, so the three spins cannot run at once",
    ) {
        return;
    }
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = pool(&gpu, 0, 3, 0, AllocationStrategy::RoundRobin);
    let streams: Vec<Arc<PriorityStream>> = pool.streams().cloned().collect();
    assert!(pool.has_ready_streams().unwrap(), "idle streams are ready");
    for (stream, ms) in streams.iter().zip([400, 100, 250]) {
        spin(&kernels, stream, ms * MS);
    }
    assert!(!pool.has_ready_streams().unwrap());
    let cpu_before = thread_cpu_ticks();
    let started = Instant::now();
    let ready = pool
        .wait_for_any_ready(Duration::from_secs(5))
        .unwrap()
        .expect("a stream finished");
    let waited = started.elapsed();
    let cpu_ticks = thread_cpu_ticks()
        .zip(cpu_before)
        .map(|(after, before)| after - before);
    eprintln!("waited {waited:?}, CPU ticks (10 ms each) while waiting: {cpu_ticks:?}");
    assert_eq!(ready.id(), streams[1].id(), "the 100 ms spin ends first");
    assert!(
        waited >= Duration::from_millis(80) && waited < Duration::from_millis(240),
        "{waited:?}"
    );
    if let Some(ticks) = cpu_ticks {
        assert!(
            ticks <= 3,
            "waiting ~100 ms used {ticks} ticks of CPU: it spins"
        );
    }
    // Before anything else finishes, a short wait times out.
    spin(&kernels, &streams[1], 300 * MS);
    assert!(
        pool.wait_for_any_ready(Duration::from_millis(20))
            .unwrap()
            .is_none()
    );
    for stream in &streams {
        stream.synchronize().unwrap();
    }
}

/// user + system CPU time of this thread, in clock ticks, from /proc (Linux only).
fn thread_cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    let after_name = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 and 15 of stat (utime, stime) are 11 and 12 after the state field.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

#[test]
fn each_device_has_one_process_wide_pool() {
    let gpu = cuweave_test_support::require_gpu!();
    let first = StreamPool::for_device(gpu.device).unwrap();
    let again = StreamPool::for_device(gpu.device).unwrap();
    assert!(Arc::ptr_eq(&first, &again));
    assert_eq!(first.device(), gpu.device);
    let stream = first.get_stream().unwrap();
    assert!(first.contains(&stream));
    first.ensure_same_device(&stream).unwrap();
    let outsider = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    assert!(!first.contains(&outsider));
}
