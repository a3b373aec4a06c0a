//! Scheduler programs written the way users drive streams, against the public API of this
//! crate: an inference server picking the least-loaded pool stream while a long request holds
//! one, waiting for whichever gated stream is released first (and for none, with zero and
//! endless timeouts), a pipeline-parallel schedule of eight stages with a barrier per tick,
//! JAX-style asynchronous dispatch whose completion callbacks queue the next step, completion
//! callbacks that still run exactly once after the pool and coordinator are dropped with the
//! work queued, a `torch.profiler`-style trace of a serving loop exported as Chrome trace JSON,
//! 10^5 profiled operations held within the documented bounds, a ring of three streams whose
//! dependency cycle is reported, not refused, and bad input answered with typed errors.
//!
//! Ordering is proven by data: kernels that spin before they store, order-sensitive transforms
//! whose exact result the host recomputes, and `wait_u32` gates that only the host opens. No
//! assertion is on a duration beyond "non-negative" or "ordered". Every GPU test takes
//! `serial()`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use cuweave_driver::{Context, Device, DriverError, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer, PendingCopy};
use cuweave_stream::timing::DEFAULT_PENDING_SPANS;
use cuweave_stream::{
    AllocationStrategy, DEFAULT_KEPT_OPERATIONS, MultiStreamCoordinator, OperationKind,
    PriorityStream, StreamError, StreamPool, StreamPoolConfig, StreamPriority, StreamProfiler,
    WorkloadType, wait_for_any_ready,
};
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip, skip_under_sanitizer};

mod common;
use common::Kit;
use common::mapped::Mapped;
use cuweave_test_support::resident_bytes;

const MS: u64 = 1_000_000;
const US: u64 = 1_000;
/// A value no transform in these tests is expected to produce: input not yet written.
const SENTINEL: u32 = u32::MAX;

/// Queues on `stream` a `wait_u32` gate that holds it until word `word` of `gate` becomes 1
/// (or 10 s pass), counted as one operation.
fn hold(kernels: &TestKernels, stream: &PriorityStream, gate: &Mapped, word: usize) {
    let flag = gate.device(word);
    // SAFETY: `flag` is a mapped word of `gate`, which outlives the kernel (the gate is opened
    // before it is freed, and freeing pinned memory waits for the device).
    stream
        .launch(|s| unsafe { kernels.wait_u32(s, flag, 1, 10_000 * MS) })
        .unwrap();
}

/// Queues on `stream` a spin of `ns` that then stores `value` into word `word` of `words`.
fn spin_then_store(
    kernels: &TestKernels,
    stream: &PriorityStream,
    ns: u64,
    words: &Mapped,
    word: usize,
    value: u32,
) {
    let dst = words.device(word);
    // SAFETY: `dst` is a mapped word of `words`, which every test keeps alive until the
    // streams that store into it have finished.
    stream
        .launch(|s| unsafe { kernels.spin_then_store_u32(s, ns, dst, value) })
        .unwrap();
}

/// `false` (after saying why) when the device cannot map pinned host memory for the gates.
fn maps_host_memory(gpu: &cuweave_test_support::Gpu, test: &str) -> bool {
    if gpu.device.can_map_host_memory().unwrap() {
        return true;
    }
    skip(test, "the device cannot map host memory");
    false
}

/// What the order-sensitive transform `x -> x * mul + add` gives, as the kernel computes it.
fn affine(x: u32, mul: u32, add: u32) -> u32 {
    x.wrapping_mul(mul).wrapping_add(add)
}

/// Waits (sleeping) until `done()` holds or 20 s pass; the callers then assert on the outcome.
fn wait_until(mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// An inference server: requests arrive one by one and each takes `pool.get_stream()` from a
/// `LoadBalanced` pool, uploads its input, runs a kernel and downloads the answer. A long batch
/// request holds one stream behind a closed gate with 300 operations queued. Answered one at a
/// time, the requests spread over all three free streams and never land on the held one;
/// pipelined (six in flight) they still never do; once the batch is released and drained, the
/// stream is handed out again. Every answer and the batch's own result are exact.
#[test]
fn an_inference_server_on_a_load_balanced_pool_never_schedules_onto_the_stream_a_batch_holds() {
    const TEST: &str = "scheduler_programs::an_inference_server_on_a_load_balanced_pool_never_schedules_onto_the_stream_a_batch_holds";
    const N: usize = 4096;
    const BATCH_OPS: u64 = 300;
    const SEQUENTIAL: usize = 24;
    const PIPELINED: usize = 96;
    const IN_FLIGHT: usize = 6;
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(TEST, "the requests must run beside the held stream")
        || !maps_host_memory(&gpu, TEST)
    {
        return;
    }
    let kit = Kit::load(&gpu.context, N);
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced).with_counts(0, 4, 0),
    )
    .unwrap();
    let normal: Vec<Arc<PriorityStream>> = pool.streams_of(StreamPriority::Normal).to_vec();
    let held = Arc::clone(&normal[1]);
    let mut batch = DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap();
    let mut inputs: Vec<DeviceBuffer<u32>> = (0..SEQUENTIAL + PIPELINED + 4)
        .map(|_| DeviceBuffer::<u32>::new(&gpu.context, N).unwrap())
        .collect();
    let gate = Mapped::new(&gpu.context, 1);
    hold(&kit.test, &held, &gate, 0);
    for _ in 1..BATCH_OPS {
        held.enqueue(OperationKind::KernelLaunch, 0, |s| {
            kit.increment(s, &mut batch)
        })
        .unwrap();
    }
    assert_eq!(held.outstanding_work().unwrap(), BATCH_OPS);

    // Queues one request on the stream the pool picks; returns the stream and the download.
    let queue = |input: &mut DeviceBuffer<u32>, value: u32| {
        let stream = pool.get_stream().unwrap();
        let upload = stream.copy_from_host(input, vec![value; N]).unwrap();
        stream
            .enqueue(OperationKind::KernelLaunch, 0, |s| kit.increment(s, input))
            .unwrap();
        let download = stream.copy_to_host(&*input, vec![0u32; N]).unwrap();
        (stream, upload, download)
    };
    let check = |value: u32, upload: PendingCopy<Vec<u32>>, download: PendingCopy<Vec<u32>>| {
        upload.wait().unwrap();
        let answer = download.wait().unwrap();
        assert!(
            answer.iter().all(|&v| v == value + 1),
            "request {value} got {} back",
            answer[0]
        );
    };

    let mut served: HashMap<u64, usize> = HashMap::new();
    for (r, input) in inputs[..SEQUENTIAL].iter_mut().enumerate() {
        let (stream, upload, download) = queue(input, r as u32);
        check(r as u32, upload, download);
        stream.synchronize().unwrap();
        *served.entry(stream.id()).or_default() += 1;
    }
    assert_eq!(
        served.get(&held.id()),
        None,
        "a request was scheduled behind the held batch"
    );
    for stream in normal.iter().filter(|s| s.id() != held.id()) {
        assert!(
            served.get(&stream.id()).copied().unwrap_or(0) > 0,
            "idle stream {} never served a request: {served:?}",
            stream.id()
        );
    }

    let mut in_flight = VecDeque::new();
    for (r, input) in inputs[SEQUENTIAL..SEQUENTIAL + PIPELINED]
        .iter_mut()
        .enumerate()
    {
        let value = 10_000 + r as u32;
        let (stream, upload, download) = queue(input, value);
        assert_ne!(
            stream.id(),
            held.id(),
            "pipelined request {r} was scheduled behind the held batch"
        );
        in_flight.push_back((value, upload, download));
        if in_flight.len() > IN_FLIGHT {
            let (value, upload, download) = in_flight.pop_front().unwrap();
            check(value, upload, download);
        }
    }
    for (value, upload, download) in in_flight.drain(..) {
        check(value, upload, download);
    }
    assert!(
        !held.is_ready().unwrap(),
        "premise: the batch is still held while the requests are served"
    );

    gate.write(0, 1);
    held.synchronize().unwrap();
    assert_eq!(held.outstanding_work().unwrap(), 0);
    let mut after = HashSet::new();
    for (r, input) in inputs[SEQUENTIAL + PIPELINED..].iter_mut().enumerate() {
        let value = 20_000 + r as u32;
        let (stream, upload, download) = queue(input, value);
        check(value, upload, download);
        stream.synchronize().unwrap();
        after.insert(stream.id());
    }
    assert!(
        after.contains(&held.id()),
        "the drained stream is never handed out again"
    );
    assert_eq!(
        batch.to_vec().unwrap(),
        vec![BATCH_OPS as u32 - 1; N],
        "the batch ran every increment once"
    );
}

/// Four pool streams (high, normal, normal, low), each behind its own gate and then a store of
/// "done". While every gate is closed, waits with a zero, a short and a subset timeout all give
/// `None`; a wait with `Duration::MAX` returns exactly the stream whose gate another thread
/// opens, and its store has landed while the others' have not. With several ready, the pool's
/// order decides (high first); with no streams even an endless wait returns `None` at once.
#[test]
fn wait_for_any_ready_returns_the_stream_whose_gate_opened_and_none_while_all_are_held() {
    const TEST: &str = "scheduler_programs::wait_for_any_ready_returns_the_stream_whose_gate_opened_and_none_while_all_are_held";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(TEST, "the gated streams must wait beside one another")
        || !maps_host_memory(&gpu, TEST)
    {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::default().with_counts(1, 2, 1),
    )
    .unwrap();
    let streams: Vec<Arc<PriorityStream>> = pool.streams().cloned().collect();
    assert_eq!(
        streams.iter().map(|s| s.priority()).collect::<Vec<_>>(),
        [
            StreamPriority::High,
            StreamPriority::Normal,
            StreamPriority::Normal,
            StreamPriority::Low
        ]
    );
    assert!(
        pool.wait_for_any_ready(Duration::ZERO).unwrap().is_some(),
        "idle streams are ready at once, even with a zero timeout"
    );
    let gates = Mapped::new(&gpu.context, streams.len());
    let done = Mapped::new(&gpu.context, streams.len());
    for (k, stream) in streams.iter().enumerate() {
        hold(&kernels, stream, &gates, k);
        spin_then_store(&kernels, stream, 0, &done, k, 1);
    }
    assert!(!pool.has_ready_streams().unwrap());
    assert!(pool.wait_for_any_ready(Duration::ZERO).unwrap().is_none());
    assert!(
        pool.wait_for_any_ready(Duration::from_millis(20))
            .unwrap()
            .is_none()
    );

    let released = 2;
    let found = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            gates.write(released, 1);
        });
        pool.wait_for_any_ready(Duration::MAX).unwrap()
    })
    .expect("an endless wait returns once a gate opens");
    assert_eq!(
        found.id(),
        streams[released].id(),
        "not the released stream"
    );
    assert_eq!(done.read(released), 1, "its work has finished");
    for k in [0, 1, 3] {
        assert_eq!(done.read(k), 0, "stream {k} is still held");
    }

    let others: Vec<Arc<PriorityStream>> = [0, 1, 3]
        .into_iter()
        .map(|k| Arc::clone(&streams[k]))
        .collect();
    assert!(
        wait_for_any_ready(&others, Duration::ZERO)
            .unwrap()
            .is_none()
    );
    assert!(
        wait_for_any_ready(&others, Duration::from_millis(10))
            .unwrap()
            .is_none()
    );
    gates.write(3, 1);
    streams[3].synchronize().unwrap();
    let low = wait_for_any_ready(&others, Duration::ZERO)
        .unwrap()
        .expect("the low stream finished");
    assert_eq!(low.id(), streams[3].id());
    gates.write(0, 1);
    streams[0].synchronize().unwrap();
    let first = pool
        .wait_for_any_ready(Duration::ZERO)
        .unwrap()
        .expect("three streams are ready");
    assert_eq!(first.id(), streams[0].id(), "pool order: high first");

    gates.write(1, 1);
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_eq!((0..4).map(|k| done.read(k)).collect::<Vec<_>>(), [1; 4]);
    assert!(wait_for_any_ready(&[], Duration::ZERO).unwrap().is_none());
    assert!(wait_for_any_ready(&[], Duration::MAX).unwrap().is_none());
}

/// A GPipe-style pipeline-parallel schedule on the eight streams of a default pool (all three
/// priorities): stage `s` owns a stream, and at tick `t` it transforms micro-batch `t - s` from
/// its input level into its output level, after a spin that differs per stage and tick. Each
/// tick is queued with `execute_parallel` (one thread per stage) and closed with a barrier.
/// Every level of every micro-batch is exact and no stage read an input before it was
/// written.
#[test]
fn a_pipeline_parallel_schedule_over_eight_stages_with_a_barrier_per_tick_is_exact() {
    const MICRO: usize = 16;
    const N: usize = 1024;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stages: Vec<Arc<PriorityStream>> = pool.streams().cloned().collect();
    let s_count = stages.len();
    assert_eq!(s_count, 8);
    let coordinator = MultiStreamCoordinator::with_streams(stages.iter().cloned());
    let stage_of: HashMap<u64, usize> = stages
        .iter()
        .enumerate()
        .map(|(s, stream)| (stream.id(), s))
        .collect();

    // levels[l][m]: micro-batch m after l stages; level 0 is the input.
    let input = |m: usize, i: usize| (m * 1000 + i) as u32;
    let mut host = vec![SENTINEL; (s_count + 1) * MICRO * N];
    for m in 0..MICRO {
        for i in 0..N {
            host[m * N + i] = input(m, i);
        }
    }
    let levels = DeviceBuffer::<u32>::from_slice(&gpu.context, &host).unwrap();
    let unfinished = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    let (base, unfinished_ptr) = (levels.device_ptr(), unfinished.device_ptr());
    let at = |level: usize, m: usize| base + 4 * ((level * MICRO + m) * N) as u64;
    let coefficients = |s: usize| (3 + 2 * s as u32, s as u32 + 1);

    let ticks = MICRO + s_count - 1;
    for t in 0..ticks {
        coordinator
            .execute_parallel(|stream| {
                let s = stage_of[&stream.id()];
                let Some(m) = t.checked_sub(s).filter(|&m| m < MICRO) else {
                    return Ok(());
                };
                let spin = ((s * 5 + t * 3) % 4) as u64 * 100 * US;
                stream.launch(|raw| kernels.spin_ns(raw, spin))?;
                let (mul, add) = coefficients(s);
                let (src, dst) = (at(s, m), at(s + 1, m));
                // SAFETY: both ranges are N u32s inside `levels`, different levels, alive past
                // the final synchronisation; `unfinished` is one u32.
                stream.launch(|raw| unsafe {
                    event_kernels.transform_checked_u32(
                        raw,
                        src,
                        dst,
                        N,
                        mul,
                        add,
                        SENTINEL,
                        unfinished_ptr,
                    )
                })?;
                Ok(())
            })
            .unwrap();
        let barrier = coordinator.create_barrier().unwrap();
        assert_eq!(
            (barrier.streams, barrier.waits),
            (s_count, 2 * (s_count - 1))
        );
    }
    for stream in &stages {
        stream.synchronize().unwrap();
    }
    assert_eq!(
        unfinished.to_vec().unwrap(),
        [0],
        "a stage read its input before the previous stage wrote it"
    );
    let got = levels.to_vec().unwrap();
    for m in 0..MICRO {
        for i in 0..N {
            let mut value = input(m, i);
            for s in 0..s_count {
                let (mul, add) = coefficients(s);
                value = affine(value, mul, add);
                assert_ne!(value, SENTINEL, "premise: no level equals the sentinel");
                assert_eq!(
                    got[((s + 1) * MICRO + m) * N + i],
                    value,
                    "micro-batch {m}, element {i}, after stage {s}"
                );
            }
        }
    }
    let stats = coordinator.stats();
    assert_eq!(
        (stats.barriers, stats.parallel_runs),
        (ticks as u64, ticks as u64)
    );
}

/// What the JAX-style dispatch chain shares with its callbacks.
struct Chain {
    streams: Vec<Arc<PriorityStream>>,
    coordinator: MultiStreamCoordinator,
    kernels: TestKernels,
    progress: Mapped,
    seen: Mutex<Vec<u32>>,
    errors: Mutex<Vec<String>>,
    finished: Mutex<Option<mpsc::Sender<()>>>,
    steps: u32,
}

impl Chain {
    fn finish(&self) {
        if let Some(sender) = self.finished.lock().unwrap().take() {
            let _ = sender.send(());
        }
    }
}

/// Queues step `step` (a spin, then a store of `step + 1`) on its stream and a completion
/// callback that reads the store and dispatches the next step from the callback's worker.
fn dispatch(chain: &Arc<Chain>, step: u32) {
    let stream = &chain.streams[step as usize % chain.streams.len()];
    let word = chain.progress.device(0);
    let spin = u64::from(step % 3) * 20 * US;
    // SAFETY: `word` is the mapped word of `progress`, alive as long as the chain.
    let launched =
        stream.launch(|s| unsafe { chain.kernels.spin_then_store_u32(s, spin, word, step + 1) });
    let next = Arc::clone(chain);
    let queued = launched.and_then(|()| {
        chain.coordinator.on_stream_complete(stream, move || {
            next.seen.lock().unwrap().push(next.progress.read(0));
            if step + 1 < next.steps {
                dispatch(&next, step + 1);
            } else {
                next.finish();
            }
        })
    });
    if let Err(error) = queued {
        chain
            .errors
            .lock()
            .unwrap()
            .push(format!("step {step}: {error}"));
        chain.finish();
    }
}

/// JAX-style asynchronous dispatch: the host dispatches only the first step; each step's
/// completion callback (which may call CUDA) reads what the step's kernel stored and dispatches
/// the next step on the next of four streams. 400 steps: every callback runs exactly once,
/// after its own kernel, in dispatch order, with no synchronize driving them.
#[test]
fn completion_callbacks_dispatch_the_next_step_on_another_stream_400_times_in_order() {
    const TEST: &str = "scheduler_programs::completion_callbacks_dispatch_the_next_step_on_another_stream_400_times_in_order";
    const STEPS: u32 = 400;
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, TEST) {
        return;
    }
    let streams: Vec<Arc<PriorityStream>> = (0..4)
        .map(|_| Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap()))
        .collect();
    let (sender, finished) = mpsc::channel();
    let chain = Arc::new(Chain {
        coordinator: MultiStreamCoordinator::with_streams(streams.iter().cloned()),
        streams,
        kernels: TestKernels::load(&gpu.context).unwrap(),
        progress: Mapped::new(&gpu.context, 1),
        seen: Mutex::new(Vec::new()),
        errors: Mutex::new(Vec::new()),
        finished: Mutex::new(Some(sender)),
        steps: STEPS,
    });
    dispatch(&chain, 0);
    finished
        .recv_timeout(Duration::from_secs(30))
        .expect("the chain of callbacks reached its last step");
    // A callback that ran twice would log after the last one: give it the chance.
    std::thread::sleep(Duration::from_millis(50));
    for stream in &chain.streams {
        stream.synchronize().unwrap();
        assert!(stream.callback_failures().is_empty());
    }
    let errors = chain.errors.lock().unwrap().clone();
    assert!(errors.is_empty(), "{errors:?}");
    let seen = chain.seen.lock().unwrap().clone();
    let expected: Vec<u32> = (1..=STEPS).collect();
    assert_eq!(
        seen.len(),
        expected.len(),
        "callbacks ran {} times for {STEPS} steps",
        seen.len()
    );
    if let Some(step) = (0..seen.len()).find(|&k| seen[k] != expected[k]) {
        panic!(
            "step {step}'s callback saw {} (expected {}): it ran before its kernel stored",
            seen[step], expected[step]
        );
    }
    let callbacks: u64 = chain
        .streams
        .iter()
        .map(|s| s.metrics().unwrap().callbacks)
        .sum();
    assert_eq!(callbacks, u64::from(STEPS));
    wait_until(|| Arc::strong_count(&chain) == 1);
}

/// Async dispatch that outlives its scheduler: on each of a default pool's eight streams, 50
/// iterations of "spin, store the iteration" each get a completion callback (alternately
/// `on_stream_complete` and `add_callback`), and every iteration an `on_all_complete` hook, all
/// queued behind closed gates. The coordinator and the pool are then dropped with every
/// callback still queued; none has run. Opened, every callback runs exactly once, after its
/// stream's store, and every hook after all eight.
#[test]
fn completion_callbacks_run_once_after_their_work_when_pool_and_coordinator_are_dropped_first() {
    const TEST: &str = "scheduler_programs::completion_callbacks_run_once_after_their_work_when_pool_and_coordinator_are_dropped_first";
    // Kept well under the launches a stream queues before the host blocks in a launch call:
    // with every stream gated, a blocked launch would hold the test until the gates time out.
    const ITERATIONS: usize = 50;
    let gpu = require_gpu!();
    let _serial = serial();
    if !maps_host_memory(&gpu, TEST) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let streams: Vec<Arc<PriorityStream>> = pool.streams().cloned().collect();
    let n = streams.len();
    let coordinator = MultiStreamCoordinator::with_streams(streams.iter().cloned());
    let gate = Mapped::new(&gpu.context, 1);
    let flags = Arc::new(Mapped::new(&gpu.context, n));
    let runs: Arc<Vec<AtomicU32>> =
        Arc::new((0..n * ITERATIONS).map(|_| AtomicU32::new(0)).collect());
    let hooks: Arc<Vec<AtomicU32>> = Arc::new((0..ITERATIONS).map(|_| AtomicU32::new(0)).collect());
    let early: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    for stream in &streams {
        hold(&kernels, stream, &gate, 0);
    }
    for it in 0..ITERATIONS {
        let value = it as u32 + 1;
        for (k, stream) in streams.iter().enumerate() {
            let spin = ((k + it) % 3) as u64 * 10 * US;
            spin_then_store(&kernels, stream, spin, &flags, k, value);
            let (flags, runs, early) = (Arc::clone(&flags), Arc::clone(&runs), Arc::clone(&early));
            let callback = move || {
                let seen = flags.read(k);
                if seen < value {
                    early.lock().unwrap().push(format!(
                        "stream {k} iteration {it}: saw {seen} before its store of {value}"
                    ));
                }
                runs[k * ITERATIONS + it].fetch_add(1, Ordering::SeqCst);
            };
            if (k + it) % 2 == 0 {
                coordinator.on_stream_complete(stream, callback).unwrap();
            } else {
                stream.add_callback(callback).unwrap();
            }
        }
        let (flags, hooks, early) = (Arc::clone(&flags), Arc::clone(&hooks), Arc::clone(&early));
        coordinator
            .on_all_complete(move || {
                let seen: Vec<u32> = (0..n).map(|k| flags.read(k)).collect();
                if seen.iter().any(|&flag| flag < value) {
                    early.lock().unwrap().push(format!(
                        "hook {it} ran before every stream stored {value}: {seen:?}"
                    ));
                }
                hooks[it].fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
    }
    let ran = || {
        runs.iter().map(|r| r.load(Ordering::SeqCst)).sum::<u32>()
            + hooks.iter().map(|h| h.load(Ordering::SeqCst)).sum::<u32>()
    };
    assert_eq!(ran(), 0, "a callback ran while its stream was held");
    drop(coordinator);
    drop(streams);
    drop(pool);
    assert_eq!(
        ran(),
        0,
        "dropping the pool ran (or waited for) the queued work"
    );

    gate.write(0, 1);
    let total = (n * ITERATIONS + ITERATIONS) as u32;
    wait_until(|| ran() >= total);
    std::thread::sleep(Duration::from_millis(50));
    let twice: Vec<usize> = (0..n * ITERATIONS)
        .filter(|&i| runs[i].load(Ordering::SeqCst) != 1)
        .collect();
    assert!(
        twice.is_empty(),
        "{} stream callbacks ran other than once, first (stream, iteration) {:?}",
        twice.len(),
        twice.first().map(|&i| (i / ITERATIONS, i % ITERATIONS))
    );
    let hooks_wrong: Vec<usize> = (0..ITERATIONS)
        .filter(|&it| hooks[it].load(Ordering::SeqCst) != 1)
        .collect();
    assert!(
        hooks_wrong.is_empty(),
        "on_all_complete hooks ran other than once: {hooks_wrong:?}"
    );
    let early = early.lock().unwrap();
    assert!(
        early.is_empty(),
        "{} early: {:?}",
        early.len(),
        early.first()
    );
    assert_eq!(
        (0..n).map(|k| flags.read(k)).collect::<Vec<_>>(),
        vec![ITERATIONS as u32; n]
    );
}

/// A serving loop profiled as `torch.profiler` users export it: per request an upload on the
/// memory stream, a spin and a kernel on the compute stream (after the upload, by dependency),
/// a download on the coordination stream (after the kernel). `chrome_trace()` parses as JSON:
/// one process, one named track per stream, one complete event per profiled operation with
/// its kind, non-negative start and duration; on the shared GPU clock each request's events
/// follow its dependencies. The report agrees with the trace, and every answer is exact.
#[test]
fn a_torch_profiler_style_trace_of_a_serving_loop_has_one_ordered_event_per_operation() {
    const STEPS: usize = 40;
    const N: usize = 1 << 14;
    /// Slack for the `f32` start offsets the profiler places spans with.
    const SLACK_US: f64 = 2.0;
    let gpu = require_gpu!();
    let _serial = serial();
    let kit = Kit::load(&gpu.context, N);
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::Workload),
    )
    .unwrap();
    let upload = pool.get_stream_for_workload(WorkloadType::Memory).unwrap();
    let compute = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let download = pool
        .get_stream_for_workload(WorkloadType::Coordination)
        .unwrap();
    let ids = [upload.id(), compute.id(), download.id()];
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 3);
    let coordinator = MultiStreamCoordinator::new();
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    let mut inputs: Vec<DeviceBuffer<u32>> = (0..STEPS)
        .map(|_| DeviceBuffer::<u32>::new(&gpu.context, N).unwrap())
        .collect();
    let bytes = (N * 4) as u64;
    let mut pending = Vec::new();
    for (step, input) in inputs.iter_mut().enumerate() {
        let sent = profiler
            .profile(
                &upload,
                format!("h2d {step}"),
                OperationKind::Copy,
                bytes,
                |s| Ok(s.copy_from_host(input, vec![step as u32; N])?),
            )
            .unwrap();
        coordinator.add_dependency(&compute, &upload).unwrap();
        profiler
            .profile(
                &compute,
                format!("spin {step}"),
                OperationKind::KernelLaunch,
                0,
                |s| s.launch(|raw| kit.test.spin_ns(raw, 100 * US)),
            )
            .unwrap();
        profiler
            .profile(
                &compute,
                format!("increment {step}"),
                OperationKind::KernelLaunch,
                0,
                |s| {
                    s.enqueue(OperationKind::KernelLaunch, 0, |raw| {
                        kit.increment(raw, input)
                    })
                },
            )
            .unwrap();
        coordinator.add_dependency(&download, &compute).unwrap();
        let received = profiler
            .profile(
                &download,
                format!("d2h {step}"),
                OperationKind::Copy,
                bytes,
                |s| Ok(s.copy_to_host(&*input, vec![0u32; N])?),
            )
            .unwrap();
        pending.push((step, sent, received));
    }
    for (step, sent, received) in pending {
        sent.wait().unwrap();
        let answer = received.wait().unwrap();
        assert!(
            answer.iter().all(|&v| v == step as u32 + 1),
            "request {step} got {}",
            answer[0]
        );
    }

    let text = profiler.chrome_trace().unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).expect("the trace is JSON");
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    let processes = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .count();
    assert_eq!(processes, 1);
    let tracks: HashSet<u64> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| e["tid"].as_u64().unwrap())
        .collect();
    assert_eq!(
        tracks,
        ids.iter().copied().collect(),
        "one track per stream"
    );
    let complete: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(
        complete.len(),
        4 * STEPS,
        "one complete event per profiled operation"
    );
    assert_eq!(complete.len() + processes + tracks.len(), events.len());
    let mut spans: HashMap<String, (f64, f64, u64)> = HashMap::new();
    for event in &complete {
        let name = event["name"].as_str().unwrap().to_string();
        let (ts, dur) = (
            event["ts"].as_f64().unwrap(),
            event["dur"].as_f64().unwrap(),
        );
        let tid = event["tid"].as_u64().unwrap();
        assert!(ts >= 0.0 && dur >= 0.0, "{event}");
        assert_eq!(event["pid"].as_u64(), Some(gpu.device.ordinal() as u64));
        let kind = if name.starts_with("h2d") || name.starts_with("d2h") {
            "copy"
        } else {
            "kernel"
        };
        assert_eq!(event["cat"], kind, "{event}");
        assert!(spans.insert(name, (ts, ts + dur, tid)).is_none(), "{event}");
    }
    for step in 0..STEPS {
        let span = |what: &str| spans[&format!("{what} {step}")];
        let (h2d, spin, increment, d2h) =
            (span("h2d"), span("spin"), span("increment"), span("d2h"));
        assert_eq!(
            (h2d.2, spin.2, increment.2, d2h.2),
            (ids[0], ids[1], ids[1], ids[2])
        );
        assert!(h2d.1 <= spin.0 + SLACK_US, "step {step}: {h2d:?} {spin:?}");
        assert!(
            spin.1 <= increment.0 + SLACK_US,
            "step {step}: {spin:?} {increment:?}"
        );
        assert!(
            increment.1 <= d2h.0 + SLACK_US,
            "step {step}: {increment:?} {d2h:?}"
        );
    }

    let report = profiler.report().unwrap();
    assert_eq!(report.combined.operations, 4 * STEPS as u64);
    assert_eq!(report.combined.copies, 2 * STEPS as u64);
    assert_eq!(report.combined.kernel_launches, 2 * STEPS as u64);
    assert_eq!(report.combined.bytes, 2 * STEPS as u64 * bytes);
    assert!(report.combined.busy_ns <= report.combined.gpu_time_ns);
    for stream in &report.streams {
        let in_trace = complete
            .iter()
            .filter(|e| e["tid"].as_u64() == Some(stream.stream))
            .count();
        assert_eq!(stream.operations, in_trace as u64, "{stream:?}");
        assert_eq!(
            stream.by_name.iter().map(|named| named.count).sum::<u64>(),
            stream.operations
        );
    }
}

/// A profiler left on for 10^5 operations on four pool streams (the default limits): the spans
/// waiting for the GPU never pass `DEFAULT_PENDING_SPANS`, the kept operations never pass
/// `DEFAULT_KEPT_OPERATIONS`, every operation is kept, let go (`evicted`) or left untimed
/// (`skipped`), resident memory stays flat once the window is full, and the report and trace
/// describe exactly the kept window, newest operation included.
#[test]
fn a_hundred_thousand_profiled_operations_stay_within_the_documented_bounds() {
    const OPS: usize = 100_000;
    let gpu = require_gpu!();
    let _serial = serial();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::default().with_counts(0, 4, 0),
    )
    .unwrap();
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    let mut most_pending = 0;
    let mut rss_full = 0;
    for i in 0..OPS {
        let stream = pool.get_stream().unwrap();
        profiler
            .profile(
                &stream,
                format!("op {i}"),
                OperationKind::KernelLaunch,
                0,
                |s| s.launch(|raw| event_kernels.noop(raw)),
            )
            .unwrap();
        most_pending = most_pending.max(profiler.pending());
        if i % 20_000 == 19_999 {
            let kept = profiler.operations().unwrap().len();
            assert!(kept <= DEFAULT_KEPT_OPERATIONS, "{kept} kept after {i}");
        }
        if i == 79_999 {
            rss_full = resident_bytes();
        }
    }
    for stream in pool.streams() {
        stream.synchronize().unwrap();
    }
    let last = pool.get_stream().unwrap();
    profiler
        .profile(&last, "last", OperationKind::KernelLaunch, 0, |s| {
            s.launch(|raw| event_kernels.noop(raw))
        })
        .unwrap();
    let operations = profiler.operations().unwrap();
    let rss_end = resident_bytes();
    let total = OPS as u64 + 1;
    let (kept, evicted, skipped) = (
        operations.len() as u64,
        profiler.evicted(),
        profiler.skipped(),
    );
    assert!(most_pending <= DEFAULT_PENDING_SPANS, "{most_pending}");
    assert_eq!(profiler.pending(), 0);
    assert_eq!(
        kept + evicted + skipped,
        total,
        "kept {kept}, evicted {evicted}, skipped {skipped}: operations were lost"
    );
    assert_eq!(kept, (total - skipped).min(DEFAULT_KEPT_OPERATIONS as u64));
    assert_eq!(
        operations.last().map(|op| op.name.as_str()),
        Some("last"),
        "the newest operation ends the window"
    );
    assert!(
        rss_end <= rss_full + (24 << 20),
        "resident memory grew from {rss_full} to {rss_end} bytes with the window full"
    );

    let report = profiler.report().unwrap();
    assert_eq!(report.combined.operations, kept);
    assert_eq!(report.combined.kernel_launches, kept);
    assert_eq!(
        report.streams.iter().map(|s| s.operations).sum::<u64>(),
        kept
    );
    let trace: serde_json::Value =
        serde_json::from_str(&profiler.chrome_trace().unwrap()).expect("the trace is JSON");
    let complete: Vec<&serde_json::Value> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .collect();
    assert_eq!(complete.len() as u64, kept);
    assert!(complete.iter().all(|e| {
        e["ts"].as_f64().is_some_and(|ts| ts >= 0.0) && e["dur"].as_f64().is_some_and(|d| d >= 0.0)
    }));
    profiler.clear();
    assert_eq!(profiler.operations().unwrap().len(), 0);
    assert_eq!(profiler.evicted(), evicted, "clearing is not evicting");
}

/// A profiled copy that fails (its lengths differ, so nothing is queued) beside one that
/// succeeds: the stream's own metrics count only the fill that ran. The profiler's report and
/// trace should agree with them: a copy that never happened is not a copy, and its bytes were
/// never moved.
#[test]
fn a_profiled_operation_that_fails_is_not_reported_as_work_done() {
    let gpu = require_gpu!();
    let _serial = serial();
    let stream = PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap();
    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&gpu.context, 1024).unwrap();
    let src = DeviceBuffer::<u32>::zeroed(&gpu.context, 512).unwrap();
    let error = profiler
        .profile(&stream, "bad copy", OperationKind::Copy, 4096, |s| {
            s.copy_buffer(&mut dst, &src)
        })
        .unwrap_err();
    assert!(matches!(error, StreamError::Memory(_)), "{error}");
    profiler
        .profile(&stream, "fill", OperationKind::Memset, 4096, |s| {
            s.fill(&mut dst, 7)
        })
        .unwrap();
    stream.synchronize().unwrap();
    let metrics = stream.metrics().unwrap();
    assert_eq!((metrics.copies, metrics.memsets), (0, 1));
    assert_eq!(dst.to_vec().unwrap(), vec![7; 1024]);

    let report = profiler.report().unwrap();
    assert_eq!(
        (report.combined.copies, report.combined.bytes),
        (metrics.copies, 4096),
        "the profiler reports a copy the stream never queued: {report}"
    );
    assert_eq!(report.combined.operations, 1);
    let trace = profiler.chrome_trace().unwrap();
    assert!(!trace.contains("bad copy"), "{trace}");
}

/// `record_workload_completion` fed a duration no clock produces (`Duration::MAX`, what a
/// scheduler writes for "timed out") and then an ordinary one: the mean stays at least the
/// largest representable total over two records instead of wrapping to a few milliseconds,
/// and `optimize_configuration` gives compute work the larger share.
#[test]
fn a_workload_record_of_duration_max_saturates_instead_of_wrapping() {
    let gpu = require_gpu!();
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    pool.record_workload_completion(WorkloadType::Compute, Duration::MAX);
    pool.record_workload_completion(WorkloadType::Compute, Duration::from_millis(10));
    pool.record_workload_completion(WorkloadType::Mixed, Duration::from_millis(10));
    assert_eq!(pool.workload_count(WorkloadType::Compute), 2);
    let average = pool.average_workload_time(WorkloadType::Compute).unwrap();
    assert!(
        average >= Duration::from_nanos(u64::MAX / 2),
        "two compute records, one of them Duration::MAX, average {average:?}: the total wrapped"
    );
    let change = pool.optimize_configuration();
    assert_eq!(
        (change.before.compute_streams, change.after.compute_streams),
        (2, 3),
        "compute has by far the most recorded time"
    );
}

/// Bad input, each answered with a typed error or the documented behaviour, never a panic: a
/// pool of no streams, more compute streams than normal ones, a pool with no normal streams
/// (strategies fall back to the streams it has; workloads with no set are
/// `NoStreamForWorkload`), driver priorities outside the device's range (refused) and every one
/// inside it (wrapped at the nearest level), zero timeouts, a stream depending on itself, an
/// empty coordinator's barrier and parallel run, a profiler limit of zero.
#[test]
fn bad_scheduler_input_gives_typed_errors_and_documented_behaviour() {
    let gpu = require_gpu!();
    let _serial = serial();
    let invalid = |config: StreamPoolConfig| match StreamPool::new(&gpu.context, config) {
        Err(StreamError::InvalidArgument { operation, reason }) => {
            assert_eq!(operation, "StreamPool::new");
            reason
        }
        other => panic!("{config:?}: expected InvalidArgument, got {other:?}"),
    };
    invalid(StreamPoolConfig::default().with_counts(0, 0, 0));
    let reason = invalid(
        StreamPoolConfig::default()
            .with_counts(1, 2, 1)
            .with_compute_streams(3),
    );
    assert!(reason.contains('3') && reason.contains('2'), "{reason}");

    let high_only = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::default().with_counts(1, 0, 0),
    )
    .unwrap();
    let only = Arc::clone(&high_only.streams_of(StreamPriority::High)[0]);
    for strategy in [
        AllocationStrategy::RoundRobin,
        AllocationStrategy::LoadBalanced,
        AllocationStrategy::Priority,
    ] {
        high_only.set_strategy(strategy);
        assert_eq!(
            high_only.get_stream().unwrap().id(),
            only.id(),
            "{strategy:?}"
        );
    }
    high_only.set_strategy(AllocationStrategy::Workload);
    assert!(matches!(
        high_only.get_stream(),
        Err(StreamError::NoStreamForWorkload {
            workload: WorkloadType::Mixed
        })
    ));
    for workload in [WorkloadType::Compute, WorkloadType::Memory] {
        assert!(
            matches!(
                high_only.get_stream_for_workload(workload),
                Err(StreamError::NoStreamForWorkload { workload: w }) if w == workload
            ),
            "{workload}"
        );
    }
    assert_eq!(
        high_only
            .get_stream_for_workload(WorkloadType::Coordination)
            .unwrap()
            .id(),
        only.id()
    );
    for level in StreamPriority::ALL {
        assert_eq!(
            high_only.get_priority_stream(level).unwrap().id(),
            only.id()
        );
    }
    assert!(!high_only.optimize_configuration().changed());
    assert!(
        high_only
            .wait_for_any_ready(Duration::ZERO)
            .unwrap()
            .is_some()
    );

    let range = gpu.context.stream_priority_range().unwrap();
    for priority in [range.least + 1, range.greatest - 1, i32::MIN, i32::MAX] {
        assert!(
            matches!(
                Stream::with_priority(&gpu.context, StreamFlags::NON_BLOCKING, priority),
                Err(DriverError::InvalidArgument { .. })
            ),
            "priority {priority} outside {range:?} was accepted"
        );
        let level = StreamPriority::from_driver(priority, range);
        assert!(range.contains(level.to_driver(range)));
    }
    for priority in range.greatest..=range.least {
        let stream = PriorityStream::from_stream(
            Stream::with_priority(&gpu.context, StreamFlags::NON_BLOCKING, priority).unwrap(),
        )
        .unwrap();
        assert_eq!(stream.driver_priority(), priority);
        assert_eq!(
            stream.priority(),
            StreamPriority::from_driver(priority, range)
        );
    }

    let stream = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let coordinator = MultiStreamCoordinator::new();
    assert!(matches!(
        coordinator.add_dependency(&stream, &stream),
        Err(StreamError::SelfDependency { stream: id, .. }) if id == stream.id()
    ));
    assert!(
        coordinator.streams().is_empty(),
        "a refused dependency adds no stream"
    );
    let barrier = coordinator.create_barrier().unwrap();
    assert_eq!((barrier.streams, barrier.events, barrier.waits), (0, 0, 0));
    coordinator
        .execute_parallel(|_| panic!("no stream, no closure"))
        .unwrap();
    assert_eq!(coordinator.stats().parallel_runs, 1);

    let profiler = StreamProfiler::with_limit(&gpu.context, 0).unwrap();
    let mut buffer = DeviceBuffer::<u32>::zeroed(&gpu.context, 256).unwrap();
    for value in 0..3 {
        profiler
            .profile(
                &stream,
                format!("fill {value}"),
                OperationKind::Memset,
                1024,
                |s| s.fill(&mut buffer, value),
            )
            .unwrap();
    }
    let kept = profiler.operations().unwrap();
    assert_eq!(kept.len(), 1, "a limit of zero keeps one");
    assert_eq!(kept[0].name, "fill 2");
    assert_eq!(profiler.evicted() + profiler.skipped(), 2);
}

/// A ring of three streams, each step depending on the stream of the step before (a
/// dependency cycle over the ring, which is correct and accepted): 3000 steps of an
/// order-sensitive transform, some after a spin, give the exact result; the cycle is reported
/// once with the three streams; removing one stream breaks it.
#[test]
fn a_ring_of_three_streams_is_ordered_on_the_gpu_and_its_cycle_reported_not_refused() {
    const STEPS: usize = 3000;
    const N: usize = 256;
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let ring: Vec<Arc<PriorityStream>> = [
        StreamPriority::High,
        StreamPriority::Normal,
        StreamPriority::Low,
    ]
    .into_iter()
    .map(|level| Arc::new(PriorityStream::new(&gpu.context, level).unwrap()))
    .collect();
    let coordinator = MultiStreamCoordinator::new();
    let buffers = [
        DeviceBuffer::<u32>::from_slice(&gpu.context, &[5u32; N]).unwrap(),
        DeviceBuffer::<u32>::zeroed(&gpu.context, N).unwrap(),
    ];
    let ptrs = [buffers[0].device_ptr(), buffers[1].device_ptr()];
    let unfinished = DeviceBuffer::<u32>::zeroed(&gpu.context, 1).unwrap();
    let unfinished_ptr = unfinished.device_ptr();
    let mut expected = 5u32;
    for step in 0..STEPS {
        let stream = &ring[step % 3];
        if step > 0 {
            coordinator
                .add_dependency(stream, &ring[(step - 1) % 3])
                .unwrap();
        }
        if step % 101 == 0 {
            stream.launch(|s| kernels.spin_ns(s, 200 * US)).unwrap();
        }
        let (mul, add) = (3 + (step % 4) as u32 * 2, (step % 9) as u32 + 1);
        let (src, dst) = (ptrs[step % 2], ptrs[(step + 1) % 2]);
        // SAFETY: both buffers hold N u32s and `unfinished` one, alive past the final
        // synchronisation; src and dst differ; only these launches touch them.
        stream
            .launch(|s| unsafe {
                event_kernels.transform_checked_u32(
                    s,
                    src,
                    dst,
                    N,
                    mul,
                    add,
                    SENTINEL,
                    unfinished_ptr,
                )
            })
            .unwrap();
        expected = affine(expected, mul, add);
    }
    for stream in &ring {
        stream.synchronize().unwrap();
    }
    let result = buffers[STEPS % 2].to_vec().unwrap();
    assert!(
        result.iter().all(|&v| v == expected),
        "a step ran out of order: {:#x} != {expected:#x}",
        result[0]
    );
    assert_eq!(coordinator.stats().dependencies, STEPS as u64 - 1);
    assert_eq!(
        coordinator.dependencies().len(),
        3,
        "three edges of the ring"
    );
    let cycles = coordinator.cycles();
    assert_eq!(cycles.len(), 1, "{cycles:?}");
    let mut members = cycles[0].clone();
    members.sort_unstable();
    let mut ids: Vec<u64> = ring.iter().map(|s| s.id()).collect();
    ids.sort_unstable();
    assert_eq!(members, ids);
    coordinator.remove_stream(&ring[1]);
    assert!(
        !coordinator.has_cycles(),
        "removing a stream breaks the ring"
    );
    assert_eq!(coordinator.dependencies().len(), 1);
    assert_eq!(coordinator.streams().len(), 2);
}

/// Two GPUs: a stream of device 1 given to device 0's profiler, pool and buffers is
/// `WrongDevice` (nothing profiled, the closure never called), while the coordinator accepts a
/// dependency and a barrier across the two devices (CUDA waits on events of other devices):
/// device 0's completion callback, queued after the dependency, sees the flag that device 1's
/// spinning kernel stores at its end, and `wait_for_any_ready` over streams of both devices
/// returns the idle one.
#[test]
fn streams_of_another_device_are_typed_errors_and_cross_device_waits_order_the_work() {
    const TEST: &str = "scheduler_programs::streams_of_another_device_are_typed_errors_and_cross_device_waits_order_the_work";
    let gpu = require_gpu!();
    let _serial = serial();
    let count = Device::count().unwrap();
    if count < 2 {
        skip(TEST, &format!("needs two GPUs, found {count}"));
        return;
    }
    if !maps_host_memory(&gpu, TEST) {
        return;
    }
    let other = Context::primary(Device::get(1).unwrap()).unwrap();
    if !other.device().can_map_host_memory().unwrap() {
        skip(TEST, "device 1 cannot map host memory");
        return;
    }
    let local = Arc::new(PriorityStream::new(&gpu.context, StreamPriority::Normal).unwrap());
    let foreign = Arc::new(PriorityStream::new(&other, StreamPriority::Normal).unwrap());
    let (ours, theirs) = (gpu.device.ordinal(), other.device().ordinal());

    let profiler = StreamProfiler::new(&gpu.context).unwrap();
    let mut called = false;
    let refused = profiler.profile(&foreign, "foreign", OperationKind::Other, 0, |_| {
        called = true;
        Ok(())
    });
    assert_eq!(
        refused,
        Err(StreamError::WrongDevice {
            operation: "StreamProfiler::profile",
            expected: ours,
            actual: theirs
        })
    );
    assert!(!called, "the closure ran for a refused stream");
    assert_eq!(profiler.pending(), 0);
    assert!(profiler.operations().unwrap().is_empty());

    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    assert!(!pool.contains(&foreign));
    assert!(matches!(
        pool.ensure_same_device(&foreign),
        Err(StreamError::WrongDevice { expected, actual, .. }) if (expected, actual) == (ours, theirs)
    ));
    let mut buffer = DeviceBuffer::<u32>::zeroed(&gpu.context, 64).unwrap();
    assert!(matches!(
        foreign.fill(&mut buffer, 1),
        Err(StreamError::WrongDevice { expected, actual, .. }) if (expected, actual) == (theirs, ours)
    ));
    assert_eq!(foreign.metrics().unwrap().operations, 0);

    let kernels = TestKernels::load(&other).unwrap();
    let flags = Arc::new(Mapped::new(&other, 2));
    spin_then_store(&kernels, &foreign, 50 * MS, &flags, 0, 1);
    let coordinator = MultiStreamCoordinator::new();
    coordinator.add_dependency(&local, &foreign).unwrap();
    let (sender, seen) = mpsc::channel();
    let (watch, tell) = (Arc::clone(&flags), sender.clone());
    coordinator
        .on_stream_complete(&local, move || {
            let _ = tell.send(("dependency", watch.read(0)));
        })
        .unwrap();
    assert_eq!(
        seen.recv_timeout(Duration::from_secs(10)).unwrap(),
        ("dependency", 1),
        "device 0's callback ran before device 1's kernel stored"
    );

    spin_then_store(&kernels, &foreign, 50 * MS, &flags, 1, 1);
    let barrier = coordinator.create_barrier().unwrap();
    assert_eq!((barrier.streams, barrier.waits), (2, 2));
    let watch = Arc::clone(&flags);
    coordinator
        .on_stream_complete(&local, move || {
            let _ = sender.send(("barrier", watch.read(1)));
        })
        .unwrap();
    assert_eq!(
        seen.recv_timeout(Duration::from_secs(10)).unwrap(),
        ("barrier", 1),
        "device 0's work after the barrier ran before device 1's kernel stored"
    );

    foreign.launch(|s| kernels.spin_ns(s, 100 * MS)).unwrap();
    local.synchronize().unwrap();
    let ready = wait_for_any_ready(
        &[Arc::clone(&foreign), Arc::clone(&local)],
        Duration::from_secs(5),
    )
    .unwrap()
    .expect("device 0's stream is idle");
    assert_eq!(ready.id(), local.id());
    foreign.synchronize().unwrap();
}
