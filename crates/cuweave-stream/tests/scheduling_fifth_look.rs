//! Fifth look at eager (non-graph) scheduling, written as programs users run: a `Priority`
//! pool asked for an idle stream while one of its high-priority streams is held behind a
//! cross-stream wait, a barrier behind one gated stream holding a whole pool (a ready-wait
//! whose timeout must fire, then one that must not), one stream GPU-timed while eight threads
//! feed it 10^4 launches, workload records from eight threads feeding `optimize_configuration`
//! while streams are handed out, a dependency chain across 48 streams proven by a counter the
//! kernels log (and its closing edge reported, not refused), completion callbacks that queue
//! every next round on every stream for 1000 rounds, and a profiler over 10^4 operations from
//! four threads whose Chrome trace stays valid and bounded.
//!
//! Ordering is proven by data the kernels write (a logged counter, a flag copied after a gate,
//! mapped words the host checks inside callbacks), never by durations. Every GPU test takes
//! `serial()`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_stream::{
    AllocationStrategy, MultiStreamCoordinator, OperationKind, PriorityStream, StreamPool,
    StreamPoolConfig, StreamPriority, StreamProfiler, WorkloadType,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{require_gpu, serial};

mod common;
use common::Kit;
use common::mapped::{Mapped, copy_flag, hold, increment, maps_host_memory};

/// A `Priority` pool promises "the first idle stream". A high-priority stream made to wait (on
/// the device, through the coordinator) for a stream held behind a closed gate has nothing of
/// its own queued, but it is not idle: the driver reports it busy (`cuStreamQuery`), and any
/// work handed to it starts only once the gate opens. While the other high-priority stream (and
/// every normal one) is really idle, the strategy must not hand out the held one. The work the
/// held stream does get is ordered after the gated stream's store.
#[test]
fn the_priority_strategy_never_hands_out_a_stream_held_behind_a_cross_stream_wait_as_idle() {
    let name =
        "the_priority_strategy_never_hands_out_a_stream_held_behind_a_cross_stream_wait_as_idle";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream_kernels = StreamKernels::load(context).unwrap();
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Priority),
    )
    .unwrap();
    let held = Arc::clone(&pool.streams_of(StreamPriority::High)[0]);
    let producer = Arc::new(PriorityStream::new(context, StreamPriority::Low).unwrap());
    // Word 0: the gate; word 1: what the producer stores after it; word 2: what `held` read.
    let words = Mapped::new(context, 3);
    hold(&kernels, &producer, &words, 0);
    let stored = words.device(1);
    // SAFETY: word 1 of `words`, alive until the producer is synchronized below.
    producer
        .launch(|s| unsafe { kernels.spin_then_store_u32(s, 0, stored, 7) })
        .unwrap();
    let coordinator = MultiStreamCoordinator::new();
    coordinator.add_dependency(&held, &producer).unwrap();

    assert!(
        !held.is_ready().unwrap(),
        "precondition: the driver reports the stream waiting on the gated producer as busy"
    );
    let picks: Vec<u64> = (0..6).map(|_| pool.get_stream().unwrap().id()).collect();
    let handed_held = picks.iter().filter(|&&id| id == held.id()).count();

    copy_flag(&stream_kernels, &held, words.device(1), words.device(2));
    words.write(0, 1);
    held.synchronize().unwrap();
    producer.synchronize().unwrap();
    assert_eq!(
        words.read(2),
        7,
        "work on the held stream ran after the producer's store"
    );
    assert_eq!(
        handed_held,
        0,
        "the Priority strategy handed out the stream held behind a wait on a gated stream \
         {handed_held} times in 6 picks (held {}, picks {picks:?}) while other streams were idle",
        held.id()
    );
}

/// A barrier over a gated stream and every stream of a pool holds the whole pool: none is
/// ready, and `wait_for_any_ready` with a 30 ms timeout must time out (`None`, after at least
/// 30 ms). Once the gate opens, a wait with a 10 s timeout must not: it returns a stream. Each
/// pool stream's work queued after the barrier read the gated stream's store.
#[test]
fn a_barrier_behind_one_gated_stream_holds_every_pool_stream_until_the_gate_opens() {
    let name = "a_barrier_behind_one_gated_stream_holds_every_pool_stream_until_the_gate_opens";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream_kernels = StreamKernels::load(context).unwrap();
    let pool = StreamPool::new(context, StreamPoolConfig::default()).unwrap();
    let gated = Arc::new(PriorityStream::new(context, StreamPriority::Normal).unwrap());
    let streams: Vec<Arc<PriorityStream>> = pool.streams().cloned().collect();
    assert_eq!(streams.len(), 8);
    // Word 0: the gate; word 1: the gated stream's store; words 2..10: what each pool stream read.
    let words = Mapped::new(context, 2 + streams.len());
    hold(&kernels, &gated, &words, 0);
    let stored = words.device(1);
    // SAFETY: word 1 of `words`, alive until every stream is synchronized below.
    gated
        .launch(|s| unsafe { kernels.spin_then_store_u32(s, 0, stored, 0xC0DE) })
        .unwrap();
    let coordinator = MultiStreamCoordinator::with_streams(
        std::iter::once(Arc::clone(&gated)).chain(streams.clone()),
    );
    let info = coordinator.create_barrier().unwrap();
    assert_eq!(info.streams, 9);
    assert_eq!(info.waits, 16);
    for (i, stream) in streams.iter().enumerate() {
        copy_flag(
            &stream_kernels,
            stream,
            words.device(1),
            words.device(2 + i),
        );
    }

    assert!(
        !pool.has_ready_streams().unwrap(),
        "every pool stream waits behind the barrier"
    );
    let started = Instant::now();
    let none = pool.wait_for_any_ready(Duration::from_millis(30)).unwrap();
    let waited = started.elapsed();
    assert!(
        none.is_none(),
        "no pool stream can be ready while the gate is closed"
    );
    assert!(
        waited >= Duration::from_millis(30),
        "the timeout fired early, after {waited:?}"
    );
    for i in 0..streams.len() {
        assert_eq!(words.read(2 + i), 0, "pool stream {i} ran past the barrier");
    }

    words.write(0, 1);
    let started = Instant::now();
    let ready = pool.wait_for_any_ready(Duration::from_secs(10)).unwrap();
    assert!(
        ready.is_some(),
        "a stream became ready after the gate opened, yet the wait timed out after {:?}",
        started.elapsed()
    );
    assert!(pool.contains(&ready.unwrap()));
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    gated.synchronize().unwrap();
    for i in 0..streams.len() {
        assert_eq!(
            words.read(2 + i),
            0xC0DE,
            "pool stream {i} read the gated stream's store after the barrier"
        );
    }
    assert!(pool.has_ready_streams().unwrap());
}

/// One pool stream with GPU timing on, fed 10^4 increments by eight threads, each of which
/// synchronizes the stream after every 250 of its own launches: at no time do more than 2000
/// operations wait for the GPU, far under the 4096 spans the timer keeps waiting. The counts
/// are exact, the counter reads 10^4, and every operation is GPU-timed: a span the GPU has
/// finished is no longer waiting for it, so it must not push later operations out of timing.
#[test]
fn a_timed_stream_fed_by_eight_threads_counts_and_times_every_one_of_ten_thousand_launches() {
    let gpu = require_gpu!();
    let _serial = serial();
    const THREADS: usize = 8;
    const PER_THREAD: usize = 1250;
    const SYNC_EVERY: usize = 250;
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let pool = StreamPool::new(context, StreamPoolConfig::default().with_counts(0, 1, 0)).unwrap();
    let stream = pool.get_stream().unwrap();
    stream.set_timing(true);
    let counter = DeviceBuffer::<u32>::zeroed(context, 1).unwrap();
    let word = counter.device_ptr();

    std::thread::scope(|scope| {
        for _ in 0..THREADS {
            scope.spawn(|| {
                let stream = pool.get_stream().unwrap();
                for i in 1..=PER_THREAD {
                    increment(&kernels, &stream, word);
                    if i % SYNC_EVERY == 0 {
                        stream.synchronize().unwrap();
                    }
                }
            });
        }
    });
    stream.synchronize().unwrap();

    let total = (THREADS * PER_THREAD) as u64;
    assert_eq!(counter.to_vec().unwrap(), vec![total as u32]);
    assert_eq!(stream.outstanding_work().unwrap(), 0);
    let metrics = stream.metrics().unwrap();
    assert_eq!(metrics.operations, total);
    assert_eq!(metrics.kernel_launches, total);
    assert_eq!(metrics.callbacks, 0);
    assert!(metrics.gpu_time_ns > 0);
    assert_eq!(
        metrics.timed_operations,
        total,
        "operations left untimed although at most {} ever waited for the GPU",
        THREADS * SYNC_EVERY
    );
}

/// Eight threads record workload times (four Compute at 3 ms, four Mixed at 1 ms, 1000 each)
/// while they take streams by workload and run increments on them, and a ninth thread keeps
/// calling `optimize_configuration`. Every hand-out has its workload's priority, the typed
/// counters are exact (the memory layer orders each thread's increments across the streams it
/// got), the counts and averages are exact, and the final split is 3 compute streams to 1.
#[test]
fn workload_records_from_eight_threads_feed_optimize_configuration_exactly() {
    let gpu = require_gpu!();
    let _serial = serial();
    const PER_THREAD: u32 = 1000;
    const LAUNCH_EVERY: u32 = 100;
    let context = &gpu.context;
    let kit = Kit::load(context, 1);
    let pool = StreamPool::new(
        context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Workload).with_compute_streams(2),
    )
    .unwrap();
    let normal: Vec<u64> = pool
        .streams_of(StreamPriority::Normal)
        .iter()
        .map(|s| s.id())
        .collect();
    let recording = AtomicU32::new(8);

    let counters: Vec<Vec<u32>> = std::thread::scope(|scope| {
        let optimizer = scope.spawn(|| {
            let mut runs = 0u32;
            while recording.load(Ordering::Acquire) > 0 {
                let change = pool.optimize_configuration();
                assert_eq!(change.after.normal, 4);
                assert!((1..=4).contains(&change.after.compute_streams));
                runs += 1;
                std::thread::yield_now();
            }
            runs
        });
        let workers: Vec<_> = (0..8)
            .map(|t| {
                let (pool, kit, recording) = (&pool, &kit, &recording);
                scope.spawn(move || {
                    let (workload, duration) = if t < 4 {
                        (WorkloadType::Compute, Duration::from_millis(3))
                    } else {
                        (WorkloadType::Mixed, Duration::from_millis(1))
                    };
                    let mut counter = DeviceBuffer::<u32>::zeroed(pool.context(), 1).unwrap();
                    for i in 1..=PER_THREAD {
                        let stream = pool.get_stream_for_workload(workload).unwrap();
                        assert_eq!(stream.priority(), StreamPriority::Normal);
                        let memory = pool.get_stream_for_workload(WorkloadType::Memory).unwrap();
                        assert_eq!(memory.priority(), StreamPriority::Low);
                        let any = pool.get_stream().unwrap();
                        assert_eq!(any.priority(), StreamPriority::Normal);
                        if i % LAUNCH_EVERY == 0 {
                            kit.increment(&stream, &mut counter).unwrap();
                        }
                        pool.record_workload_completion(workload, duration);
                    }
                    recording.fetch_sub(1, Ordering::AcqRel);
                    // This thread's increments went to several compute streams.
                    for stream in pool.streams_of(StreamPriority::Normal) {
                        stream.synchronize().unwrap();
                    }
                    counter.to_vec().unwrap()
                })
            })
            .collect();
        let counters = workers.into_iter().map(|w| w.join().unwrap()).collect();
        assert!(optimizer.join().unwrap() > 0);
        counters
    });

    for (t, counter) in counters.iter().enumerate() {
        assert_eq!(
            counter,
            &vec![PER_THREAD / LAUNCH_EVERY],
            "thread {t}'s counter"
        );
    }
    assert_eq!(
        pool.workload_count(WorkloadType::Compute),
        4 * u64::from(PER_THREAD)
    );
    assert_eq!(
        pool.workload_count(WorkloadType::Mixed),
        4 * u64::from(PER_THREAD)
    );
    assert_eq!(pool.workload_count(WorkloadType::Memory), 0);
    assert_eq!(
        pool.average_workload_time(WorkloadType::Compute),
        Some(Duration::from_millis(3))
    );
    assert_eq!(
        pool.average_workload_time(WorkloadType::Mixed),
        Some(Duration::from_millis(1))
    );
    assert_eq!(pool.average_workload_time(WorkloadType::Coordination), None);

    // round(4 x 12 s / (12 s + 4 s)) = 3.
    pool.optimize_configuration();
    assert_eq!(pool.layout().compute_streams, 3);
    let compute: Vec<u64> = pool
        .workload_streams(WorkloadType::Compute)
        .unwrap()
        .iter()
        .map(|s| s.id())
        .collect();
    let mixed: Vec<u64> = pool
        .workload_streams(WorkloadType::Mixed)
        .unwrap()
        .iter()
        .map(|s| s.id())
        .collect();
    assert_eq!(compute, normal[..3].to_vec());
    assert_eq!(mixed, normal[3..].to_vec());
    for _ in 0..4 {
        assert_eq!(
            pool.get_stream().unwrap().id(),
            normal[3],
            "the Workload strategy hands out the Mixed set"
        );
    }
    let again = pool.optimize_configuration();
    assert!(!again.changed(), "the split is stable: {again:?}");
}

/// A chain across 48 streams of mixed priorities (more streams than hardware queues), each
/// link declared with `add_dependency`, each stream logging a shared device counter and then
/// incrementing it, all queued behind a gate at the head: every stream logs exactly its place
/// in the chain. The chain has no cycle; its closing edge is accepted and reported as one
/// cycle through all 48 streams; a barrier then clears the diagnostic and orders a final read
/// on every stream after all of it.
#[test]
fn a_dependency_chain_across_48_streams_logs_its_order_and_its_closing_edge_is_only_reported() {
    let name =
        "a_dependency_chain_across_48_streams_logs_its_order_and_its_closing_edge_is_only_reported";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    const N: usize = 48;
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream_kernels = StreamKernels::load(context).unwrap();
    let levels = [
        StreamPriority::High,
        StreamPriority::Normal,
        StreamPriority::Low,
    ];
    let streams: Vec<Arc<PriorityStream>> = (0..N)
        .map(|i| Arc::new(PriorityStream::new(context, levels[i % 3]).unwrap()))
        .collect();
    let gate = Mapped::new(context, 1);
    // Element 0: the counter; 1..=N: each stream's log; N+1..=2N: reads after the barrier.
    let words = DeviceBuffer::<u32>::zeroed(context, 1 + 2 * N).unwrap();
    let base = words.device_ptr();
    let at = |i: usize| base + 4 * i as u64;
    let coordinator = MultiStreamCoordinator::new();

    hold(&kernels, &streams[0], &gate, 0);
    for (i, stream) in streams.iter().enumerate() {
        if i > 0 {
            coordinator.add_dependency(stream, &streams[i - 1]).unwrap();
        }
        copy_flag(&stream_kernels, stream, at(0), at(1 + i));
        increment(&kernels, stream, at(0));
    }
    assert!(
        !streams[N - 1].is_ready().unwrap(),
        "the chain's tail waits for the gate"
    );
    assert_eq!(coordinator.streams().len(), N);
    assert_eq!(coordinator.dependencies().len(), N - 1);
    assert!(!coordinator.has_cycles(), "a chain is acyclic");
    gate.write(0, 1);
    streams[N - 1].synchronize().unwrap();

    let seen = words.to_vec().unwrap();
    assert_eq!(seen[0], N as u32, "every stream incremented once, in order");
    let logged: Vec<u32> = seen[1..=N].to_vec();
    let expected: Vec<u32> = (0..N as u32).collect();
    assert_eq!(
        logged, expected,
        "each stream saw the counter at its place in the chain"
    );

    coordinator
        .add_dependency(&streams[0], &streams[N - 1])
        .unwrap();
    assert!(coordinator.has_cycles());
    let cycles = coordinator.cycles();
    assert_eq!(cycles.len(), 1, "one strongly connected part: {cycles:?}");
    let ids: BTreeSet<u64> = streams.iter().map(|s| s.id()).collect();
    assert_eq!(cycles[0].iter().copied().collect::<BTreeSet<u64>>(), ids);
    assert_eq!(cycles[0].len(), N);

    increment(&kernels, &streams[N / 2], at(0));
    let info = coordinator.create_barrier().unwrap();
    assert_eq!((info.streams, info.waits), (N, 2 * (N - 1)));
    assert!(
        !coordinator.has_cycles(),
        "a barrier starts the diagnostic afresh"
    );
    for (i, stream) in streams.iter().enumerate() {
        copy_flag(&stream_kernels, stream, at(0), at(1 + N + i));
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    let after = words.to_vec().unwrap();
    assert!(
        after[1 + N..].iter().all(|&v| v == N as u32 + 1),
        "every stream read the counter after the barrier: {:?}",
        &after[1 + N..]
    );
    let stats = coordinator.stats();
    assert_eq!((stats.dependencies, stats.barriers), (N as u64, 1));
}

/// State of the callback-driven rounds below.
struct Rounds {
    coordinator: MultiStreamCoordinator,
    streams: Vec<Arc<PriorityStream>>,
    kernels: TestKernels,
    words: Mapped,
    total: u32,
    completed: AtomicU32,
    mismatches: AtomicU64,
    done: Mutex<mpsc::Sender<u32>>,
}

/// Queues round `round` (an increment of each stream's mapped word on that stream) and,
/// behind it, the completion callback that checks the words and queues the next round.
fn queue_round(state: &Arc<Rounds>, round: u32) {
    for (i, stream) in state.streams.iter().enumerate() {
        increment(&state.kernels, stream, state.words.device(i));
    }
    let next = Arc::clone(state);
    state
        .coordinator
        .on_all_complete(move || {
            for i in 0..next.streams.len() {
                if next.words.read(i) != round + 1 {
                    next.mismatches.fetch_add(1, Ordering::Relaxed);
                }
            }
            next.completed.fetch_add(1, Ordering::AcqRel);
            if round + 1 < next.total {
                next.coordinator.create_barrier().unwrap();
                queue_round(&next, round + 1);
            } else {
                next.done.lock().unwrap().send(round + 1).unwrap();
            }
        })
        .unwrap();
}

/// JAX-style asynchronous dispatch: each round's `on_all_complete` callback (on a cuweave
/// worker thread) checks that every stream's increment of the round is visible, queues a
/// barrier and the next round on all four streams, and registers the next callback: 1000
/// rounds, each callback running once, after its round's work and never ahead of it.
#[test]
fn completion_callbacks_that_queue_the_next_round_on_every_stream_run_1000_rounds_exactly() {
    let name =
        "completion_callbacks_that_queue_the_next_round_on_every_stream_run_1000_rounds_exactly";
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, name) {
        return;
    }
    const ROUNDS: u32 = 1000;
    let context = &gpu.context;
    let pool = StreamPool::new(context, StreamPoolConfig::default()).unwrap();
    let streams: Vec<Arc<PriorityStream>> = pool.streams_of(StreamPriority::Normal).to_vec();
    let (sender, receiver) = mpsc::channel();
    let state = Arc::new(Rounds {
        coordinator: MultiStreamCoordinator::with_streams(streams.clone()),
        streams: streams.clone(),
        kernels: TestKernels::load(context).unwrap(),
        words: Mapped::new(context, streams.len()),
        total: ROUNDS,
        completed: AtomicU32::new(0),
        mismatches: AtomicU64::new(0),
        done: Mutex::new(sender),
    });
    queue_round(&state, 0);
    let finished = receiver.recv_timeout(Duration::from_secs(30));
    assert_eq!(
        finished,
        Ok(ROUNDS),
        "the chain stopped after {} rounds",
        state.completed.load(Ordering::Acquire)
    );
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_eq!(state.completed.load(Ordering::Acquire), ROUNDS);
    assert_eq!(
        state.mismatches.load(Ordering::Relaxed),
        0,
        "a callback ran before its round's increments were visible"
    );
    for i in 0..streams.len() {
        assert_eq!(state.words.read(i), ROUNDS);
    }
    for stream in &streams {
        let metrics = stream.metrics().unwrap();
        assert_eq!(metrics.kernel_launches, u64::from(ROUNDS));
        assert_eq!(metrics.callbacks, u64::from(ROUNDS));
        assert_eq!(metrics.callback_panics, 0);
        assert!(stream.callback_failures().is_empty());
    }
    assert_eq!(state.coordinator.stats().barriers, u64::from(ROUNDS - 1));
}

/// Four threads each profile 2500 increments on their own pool stream through one profiler
/// that keeps 1024 operations. Every operation is kept, evicted or skipped (exactly 10^4); the
/// Chrome trace is JSON with one complete event per kept operation, a named track per stream
/// it shows, spans that never overlap on one stream, and a size bounded by the limit, not by
/// the 10^4 operations. The counters and each stream's metrics are exact.
#[test]
fn a_profiler_over_ten_thousand_operations_from_four_threads_writes_a_bounded_valid_trace() {
    let gpu = require_gpu!();
    let _serial = serial();
    const THREADS: usize = 4;
    const PER_THREAD: usize = 2500;
    const KEPT: usize = 1024;
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let pool = StreamPool::new(context, StreamPoolConfig::default()).unwrap();
    let streams: Vec<Arc<PriorityStream>> = pool.streams_of(StreamPriority::Normal).to_vec();
    let profiler = StreamProfiler::with_limit(context, KEPT).unwrap();
    let counters: Vec<DeviceBuffer<u32>> = (0..THREADS)
        .map(|_| DeviceBuffer::<u32>::zeroed(context, 1).unwrap())
        .collect();

    std::thread::scope(|scope| {
        for (stream, counter) in streams.iter().zip(&counters) {
            let (profiler, kernels) = (&profiler, &kernels);
            let word = counter.device_ptr();
            scope.spawn(move || {
                for _ in 0..PER_THREAD {
                    profiler
                        .profile(
                            stream,
                            "step \"inc\"",
                            OperationKind::KernelLaunch,
                            4,
                            |s| {
                                // SAFETY: one u32 of `counter`, alive until the stream is
                                // synchronized, touched only by this stream.
                                s.launch(|d| unsafe { kernels.increment_u32(d, word, 1) })
                            },
                        )
                        .unwrap();
                }
            });
        }
    });
    let text = profiler.chrome_trace().unwrap();
    for stream in &streams {
        stream.synchronize().unwrap();
    }

    for counter in &counters {
        assert_eq!(counter.to_vec().unwrap(), vec![PER_THREAD as u32]);
    }
    for stream in &streams {
        let metrics = stream.metrics().unwrap();
        assert_eq!(metrics.kernel_launches, PER_THREAD as u64);
        assert_eq!(metrics.operations, PER_THREAD as u64);
    }
    let total = (THREADS * PER_THREAD) as u64;
    assert_eq!(profiler.pending(), 0);
    assert_eq!(
        KEPT as u64 + profiler.evicted() + profiler.skipped(),
        total,
        "every operation kept, evicted or skipped: evicted {}, skipped {}",
        profiler.evicted(),
        profiler.skipped()
    );
    assert!(
        text.len() < KEPT * 512,
        "the trace of {KEPT} kept operations is {} bytes",
        text.len()
    );

    let trace: serde_json::Value = serde_json::from_str(&text).expect("the trace is JSON");
    assert_eq!(trace["displayTimeUnit"], "ns");
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    let complete: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), KEPT);
    let ids: HashSet<u64> = streams.iter().map(|s| s.id()).collect();
    let mut by_stream: HashMap<u64, Vec<(f64, f64)>> = HashMap::new();
    for event in &complete {
        assert_eq!(event["name"], "step \"inc\"");
        assert_eq!(event["cat"], "kernel");
        assert_eq!(event["pid"], gpu.device.ordinal());
        assert_eq!(event["args"]["bytes"], 4);
        assert_eq!(
            event["args"]["priority"],
            StreamPriority::Normal.to_string()
        );
        let tid = event["tid"].as_u64().expect("tid");
        assert!(ids.contains(&tid), "an event on unknown track {tid}");
        let ts = event["ts"].as_f64().expect("ts");
        let dur = event["dur"].as_f64().expect("dur");
        assert!(ts >= 0.0 && dur >= 0.0);
        by_stream.entry(tid).or_default().push((ts, dur));
    }
    let tracks: HashSet<u64> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["tid"].as_u64().unwrap())
        .collect();
    assert_eq!(tracks, by_stream.keys().copied().collect::<HashSet<u64>>());
    assert_eq!(
        events
            .iter()
            .filter(|e| e["name"] == "process_name")
            .count(),
        1
    );
    for (tid, spans) in &mut by_stream {
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        for pair in spans.windows(2) {
            // Starts carry an f32 offset from the base event: a microsecond of slack.
            assert!(
                pair[0].0 + pair[0].1 <= pair[1].0 + 1.0,
                "two spans of stream {tid} overlap: {pair:?}"
            );
        }
    }

    let report = profiler.report().unwrap();
    assert_eq!(report.combined.operations, KEPT as u64);
    assert_eq!(report.combined.kernel_launches, KEPT as u64);
    assert_eq!(report.combined.bytes, 4 * KEPT as u64);
    assert_eq!(
        report.streams.iter().map(|s| s.operations).sum::<u64>(),
        KEPT as u64
    );
}
