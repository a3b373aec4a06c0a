//! What people porting cudarc programs write against the driver layer, each checked by its
//! outcome on the GPU: event pools hammered by thousands of short-lived threads, completion
//! words, events and queries that must never call a spinning kernel done early, events
//! re-recorded while a wait on them is queued, captured graphs of memsets, copies, kernels and
//! a forked stream that are updated and relaunched hundreds of times, one executable graph
//! launched from four threads at once, modules loaded on eight threads while bad modules,
//! names and launches fail beside them, stream-ordered allocation in a loop of ten thousand,
//! raw copies and memsets at odd offsets on eight threads, and two captures broken on two
//! threads at once.
//!
//! Every GPU test takes the binary's `serial()` lock: captures refuse context-wide
//! synchronisation anywhere in the process, and the ordering proofs need the GPU to themselves.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use cuweave_driver::memory::{
    self, CompletionWords, DeviceAllocation, DevicePtr, HostAllocFlags, HostAllocation, MemoryPool,
};
use cuweave_driver::{
    CaptureMode, Context, DriverError, Event, EventFlags, EventPool, Graph, GraphError,
    InstantiateOptions, KernelArgs, LaunchConfig, Module, Stream, StreamFlags,
};
use cuweave_test_support::kernels::{PTX, TestKernels};
use cuweave_test_support::outside_capture::{raw_mem_alloc, raw_mem_free};
use cuweave_test_support::{require_gpu, serial, skip_under_sanitizer};

const MS: u64 = 1_000_000;
const MIB: usize = 1 << 20;

/// The first `n` `u32`s at `ptr`, after everything queued on `stream`.
fn read_u32(context: &Context, ptr: DevicePtr, n: usize, stream: &Stream) -> Vec<u32> {
    stream.synchronize().unwrap();
    let mut host = vec![0u32; n];
    // SAFETY: the callers pass device memory holding at least `n` u32s; `host` holds `n`.
    unsafe { memory::copy_dtoh(context, host.as_mut_ptr().cast(), ptr, n * 4) }.unwrap();
    host
}

/// The `u64` at `ptr`, after everything queued on `stream`.
fn read_u64(context: &Context, ptr: DevicePtr, stream: &Stream) -> u64 {
    stream.synchronize().unwrap();
    let mut host = 0u64;
    // SAFETY: the callers pass device memory holding at least 8 bytes.
    unsafe { memory::copy_dtoh(context, (&raw mut host).cast(), ptr, 8) }.unwrap();
    host
}

/// A small xorshift generator: the tests' "random" offsets and sizes, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn assert_invalid<T: std::fmt::Debug>(result: Result<T, DriverError>, what: &str) {
    match result {
        Err(DriverError::InvalidArgument { .. }) => {}
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
}

fn assert_driver_error<T: std::fmt::Debug>(result: Result<T, DriverError>, what: &str) {
    match result {
        Err(DriverError::Cuda { .. } | DriverError::ModuleLoad { .. }) => {}
        other => panic!("{what}: expected the driver's error, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Event pools, completion words and events
// ---------------------------------------------------------------------------------------------

#[test]
fn an_event_pool_serves_100k_round_trips_over_2000_short_lived_threads_and_stays_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let pool = EventPool::new(context, 0, 0).unwrap();
    let streams: Arc<Vec<Stream>> = Arc::new(
        (0..8)
            .map(|_| Stream::new(context, StreamFlags::NON_BLOCKING).unwrap())
            .collect(),
    );
    const THREADS: usize = 2000;
    const ROUNDS: usize = 50;
    const WAVE: usize = 8;
    let rounds = Arc::new(AtomicUsize::new(0));
    // Waves of eight threads at a time, each living for fifty round trips: a server's request
    // threads, or a thread pool's, come and go while the pool stays. Plain threads, joined: a
    // join returns after the thread's thread-local destructors ran (which hand its cached
    // event back), unlike the end of a thread scope.
    for _wave in 0..THREADS / WAVE {
        let threads: Vec<_> = (0..WAVE)
            .map(|w| {
                let (pool, streams, rounds) =
                    (pool.clone(), Arc::clone(&streams), Arc::clone(&rounds));
                std::thread::spawn(move || {
                    let stream = &streams[w];
                    for round in 0..ROUNDS {
                        let event = pool.acquire_event(round % 2 == 0).unwrap();
                        if round % 10 == 0 {
                            event.record(stream).unwrap();
                        }
                        if round % 5 == 0 {
                            // A second one at once, owned, as a struct would keep it.
                            let owned = pool.acquire_owned(false).unwrap();
                            owned.record(stream).unwrap();
                        }
                        if round % 25 == 0 {
                            let blocking = pool.acquire_blocking_owned().unwrap();
                            blocking.record(stream).unwrap();
                            blocking.synchronize().unwrap();
                        }
                        drop(event);
                        rounds.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
    }
    assert_eq!(rounds.load(Ordering::Relaxed), THREADS * ROUNDS);
    for stream in streams.iter() {
        stream.synchronize().unwrap();
    }
    let counters = pool.counters();
    // At most two of a kind per thread of a wave were held at once; the pool may make a few
    // more when a release is in flight while another thread looks, never one per thread.
    for (kind, created) in [
        ("regular", counters.created_regular),
        ("timing", counters.created_timing),
        ("blocking", counters.created_blocking),
    ] {
        assert!(
            created <= 4 * WAVE as u64,
            "{created} {kind} events made for {THREADS} threads, {WAVE} at a time, each \
             holding at most two: {counters:?}"
        );
    }
    // Every thread has exited: every event is back and free, none lost in a dead thread's slot.
    let utilization = pool.utilization();
    assert_eq!(utilization.in_use, 0, "{utilization:?}");
    assert_eq!(
        (utilization.available_regular
            + utilization.available_timing
            + utilization.available_blocking) as u64,
        counters.created_regular + counters.created_timing + counters.created_blocking,
        "{utilization:?} {counters:?}"
    );
    // A thousand pools made and dropped on this thread: each new pool's free list is its own
    // (this thread's cache never hands it an index of a dropped one), so each one makes exactly
    // the events it stocks and grows by none.
    for i in 0..1000 {
        let short = EventPool::new(context, 1, 1).unwrap();
        for _ in 0..3 {
            let a = short.acquire_event(false).unwrap();
            let b = short.acquire_event(true).unwrap();
            a.record(&streams[0]).unwrap();
            b.record(&streams[0]).unwrap();
        }
        let counters = short.counters();
        assert_eq!(
            (
                counters.created_regular,
                counters.created_timing,
                counters.grown
            ),
            (1, 1, 0),
            "pool {i}: {counters:?}"
        );
    }
    streams[0].synchronize().unwrap();
    // The context's shared pool is one pool while anyone holds it.
    let shared = EventPool::for_context(context).unwrap();
    drop(shared.acquire_event(false).unwrap());
    let again = EventPool::for_context(context).unwrap();
    assert_eq!(again.counters(), shared.counters());
    drop(again.acquire_event(true).unwrap());
    assert_eq!(again.counters(), shared.counters());
}

#[test]
fn completion_words_events_and_queries_never_call_a_spinning_kernel_done_early_on_eight_threads() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let words = CompletionWords::new(context).unwrap();
    let pool = EventPool::for_context(context).unwrap();
    const THREADS: usize = 8;
    const ROUNDS: u32 = 200;
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (kernels, words, pool, context) = (&kernels, &words, &pool, context);
            scope.spawn(move || {
                let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
                // A flag in mapped pinned memory the kernel stores to after its spin.
                let flag =
                    HostAllocation::new(context, 64, HostAllocFlags::PORTABLE_MAPPED).unwrap();
                let flag_device = flag.device_ptr().unwrap();
                let flag_host = flag.as_ptr().cast::<u32>();
                let mut rng = Rng(0x5EED ^ ((t as u64 + 1) * 0x9E37_79B9));
                for round in 1..=ROUNDS {
                    let spin = 10_000 + rng.below(150_000) as u64;
                    // SAFETY: `flag_device` is the device address of `flag`, which holds a u32
                    // and outlives every kernel (each round waits for its kernel below); the
                    // host only reads it with volatile loads.
                    unsafe { kernels.spin_then_store_u32(&stream, spin, flag_device, round) }
                        .unwrap();
                    let how = match round % 5 {
                        0 => {
                            words.synchronize(&stream).unwrap();
                            "completion word"
                        }
                        1 => {
                            let event = pool.acquire_event(false).unwrap();
                            event.record(&stream).unwrap();
                            event.synchronize().unwrap();
                            "pooled event"
                        }
                        2 => {
                            while !stream.query().unwrap() {
                                std::hint::spin_loop();
                            }
                            "stream query"
                        }
                        3 => {
                            let event = pool.acquire_blocking_owned().unwrap();
                            event.record(&stream).unwrap();
                            event.synchronize().unwrap();
                            "blocking-sync event"
                        }
                        _ => {
                            let event = pool.acquire_event(false).unwrap();
                            event.record(&stream).unwrap();
                            while !event.query().unwrap() {
                                std::hint::spin_loop();
                            }
                            "event query"
                        }
                    };
                    // SAFETY: `flag_host` points at the first u32 of `flag`, alive and
                    // 4-byte aligned (a pinned allocation starts on a page).
                    let seen = unsafe { std::ptr::read_volatile(flag_host) };
                    assert_eq!(
                        seen, round,
                        "thread {t} round {round}: the {how} said done before the kernel's \
                         store landed"
                    );
                }
                stream.synchronize().unwrap();
                drop(flag);
            });
        }
    });
}

#[test]
fn an_event_re_recorded_while_a_wait_on_it_is_queued_leaves_that_wait_on_its_first_recording() {
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "an_event_re_recorded_while_a_wait_on_it_is_queued_leaves_that_wait_on_its_first_recording",
        "needs a kernel on one stream to run while another stream's spin does",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let [a, b, c, d] =
        std::array::from_fn(|_| Stream::new(context, StreamFlags::NON_BLOCKING).unwrap());
    let flag = DeviceAllocation::zeroed(context, 4).unwrap();
    let sums = DeviceAllocation::zeroed(context, 16).unwrap();
    let start = Event::new(context, EventFlags::TIMING).unwrap();
    let end = Event::new(context, EventFlags::TIMING).unwrap();
    let gate = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    // Warm the kernels up so the first launch's setup is not inside the timed span.
    kernels.spin_ns(&a, 1000).unwrap();
    a.synchronize().unwrap();

    start.record(&a).unwrap();
    // SAFETY: `flag` holds a u32 and outlives the kernel (the test synchronises first).
    unsafe { kernels.spin_then_store_u32(&a, 100 * MS, flag.ptr(), 7) }.unwrap();
    gate.record(&a).unwrap();
    // `b` waits on the gate's recording behind the spin ...
    b.wait_event(&gate).unwrap();
    // ... then the gate is recorded again on an idle stream, which passes it at once.
    gate.record(&c).unwrap();
    c.synchronize().unwrap();
    assert!(
        gate.query().unwrap(),
        "the query sees the latest recording, done"
    );
    assert!(!a.query().unwrap(), "the spin is still running");
    // A wait queued now is on the new recording: `d` is not held back.
    d.wait_event(&gate).unwrap();
    // SAFETY: `flag` holds a u32 and `sums` two u64s, alive until the synchronisations below.
    unsafe {
        kernels.checksum_u32(&b, flag.ptr(), 1, sums.ptr()).unwrap();
        kernels
            .checksum_u32(&d, flag.ptr(), 1, sums.ptr() + 8)
            .unwrap();
    }
    end.record(&b).unwrap();
    d.synchronize().unwrap();
    assert!(
        !b.query().unwrap(),
        "`b` still waits on the first recording while the spin runs"
    );
    assert_eq!(
        read_u64(context, sums.ptr() + 8, &d),
        0,
        "`d` read the flag before the spin stored it"
    );
    // `b` read the flag only after the spin stored it: its wait stayed on the first recording.
    assert_eq!(read_u64(context, sums.ptr(), &b), 7);
    end.synchronize().unwrap();
    let ms = start.elapsed_ms(&end).unwrap();
    assert!(
        (99.0..5000.0).contains(&ms),
        "the span across two streams covers the 100 ms spin: {ms} ms"
    );
    // A timing-less event is refused as either end of a span.
    assert_invalid(gate.elapsed_ms(&end), "elapsed from a timing-less event");
    assert_invalid(start.elapsed_ms(&gate), "elapsed to a timing-less event");
    a.synchronize().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Graphs
// ---------------------------------------------------------------------------------------------

/// One parameter set of the pipeline graph below: its buffers and the value it starts from.
struct Buffers {
    a: DeviceAllocation,
    b: DeviceAllocation,
    sum: DeviceAllocation,
}

const GRAPH_N: usize = 1 << 12;

/// Captures, on `s1` with a fork to `s2` and a join back: `sum = 0; a = value; a += 1` on `s1`,
/// then `b = a; b += 1` on `s2`, then `sum += Σ b` on `s1`.
fn capture_pipeline(
    kernels: &TestKernels,
    s1: &Stream,
    s2: &Stream,
    set: &Buffers,
    value: u32,
) -> Graph {
    s1.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: every buffer holds what the nodes touch (`a`, `b`: GRAPH_N u32s; `sum`: a u64)
    // and outlives every launch of the graph (the test synchronises before dropping them).
    unsafe {
        memory::memset_d8_async(set.sum.ptr(), 0, 8, s1).unwrap();
        memory::memset_d32_async(set.a.ptr(), value, GRAPH_N, s1).unwrap();
        kernels.increment_u32(s1, set.a.ptr(), GRAPH_N).unwrap();
    }
    s2.wait_stream(s1).unwrap();
    // SAFETY: as above; `a` and `b` are separate allocations.
    unsafe {
        memory::copy_dtod_async(set.b.ptr(), set.a.ptr(), GRAPH_N * 4, s2).unwrap();
        kernels.increment_u32(s2, set.b.ptr(), GRAPH_N).unwrap();
    }
    s1.wait_stream(s2).unwrap();
    // SAFETY: as above.
    unsafe { kernels.checksum_u32(s1, set.b.ptr(), GRAPH_N, set.sum.ptr()) }.unwrap();
    s1.end_capture().unwrap()
}

/// Asserts `set` holds what the pipeline leaves for `value`.
fn assert_pipeline(context: &Context, set: &Buffers, value: u32, stream: &Stream, what: &str) {
    let a = read_u32(context, set.a.ptr(), GRAPH_N, stream);
    let b = read_u32(context, set.b.ptr(), GRAPH_N, stream);
    let sum = read_u64(context, set.sum.ptr(), stream);
    assert!(
        a.iter().all(|&x| x == value + 1),
        "{what}: a is {:?}…",
        &a[..4]
    );
    assert!(
        b.iter().all(|&x| x == value + 2),
        "{what}: b is {:?}…",
        &b[..4]
    );
    assert_eq!(sum, GRAPH_N as u64 * u64::from(value + 2), "{what}: sum");
}

#[test]
fn a_graph_of_memsets_copies_kernels_and_a_forked_stream_is_updated_and_relaunched_hundreds_of_times()
 {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    // Held for the whole test, so the forks' events come from one pool.
    let _events = EventPool::for_context(context).unwrap();
    let s1 = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let s2 = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let sets: Vec<Buffers> = (0..2)
        .map(|_| Buffers {
            a: DeviceAllocation::zeroed(context, GRAPH_N * 4).unwrap(),
            b: DeviceAllocation::zeroed(context, GRAPH_N * 4).unwrap(),
            sum: DeviceAllocation::zeroed(context, 8).unwrap(),
        })
        .collect();
    let graph = capture_pipeline(&kernels, &s1, &s2, &sets[0], 5);
    let nodes = graph.node_count().unwrap();
    assert!(nodes >= 6, "{nodes} nodes captured");
    let mut exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    drop(graph);
    exec.upload(&s1).unwrap();
    exec.launch(&s1).unwrap();
    assert_pipeline(context, &sets[0], 5, &s1, "first launch");
    let mut last = [Some(5u32), None];
    let mut launches = 1u64;
    for round in 0..200u32 {
        let which = (round % 2) as usize;
        // New addresses and a new scalar every round: the same code captured again.
        let value = 1000 + round * 3;
        let again = capture_pipeline(&kernels, &s1, &s2, &sets[which], value);
        assert_eq!(again.node_count().unwrap(), nodes, "round {round}");
        exec.update(&again)
            .unwrap_or_else(|e| panic!("round {round}: update refused: {e}"));
        drop(again);
        for _ in 0..1 + round % 3 {
            exec.launch(&s1).unwrap();
            launches += 1;
        }
        last[which] = Some(value);
        assert_pipeline(context, &sets[which], value, &s1, &format!("round {round}"));
        // The other set kept what its own last round left: no launch wrote old addresses.
        if let Some(other) = last[1 - which] {
            assert_pipeline(
                context,
                &sets[1 - which],
                other,
                &s1,
                &format!("round {round}, the other set"),
            );
        }
    }
    assert_eq!(exec.launch_count(), launches);
    assert_eq!(exec.kept_alive_count(), 0);
    s2.synchronize().unwrap();
}

#[test]
fn one_graph_exec_launched_from_four_threads_on_four_streams_never_overlaps_itself() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    const N: usize = 1 << 16;
    let counts = DeviceAllocation::zeroed(context, N * 4).unwrap();
    let origin = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    origin.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // A short spin, then a non-atomic increment of every element: two launches running at once
    // would lose increments.
    kernels.spin_ns(&origin, 20_000).unwrap();
    // SAFETY: `counts` holds N u32s and outlives every launch (synchronised below).
    unsafe { kernels.increment_u32(&origin, counts.ptr(), N) }.unwrap();
    let graph = origin.end_capture().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    const THREADS: usize = 4;
    const LAUNCHES: usize = 250;
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for _ in 0..THREADS {
            let (exec, barrier) = (&exec, &barrier);
            scope.spawn(move || {
                let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
                barrier.wait();
                for _ in 0..LAUNCHES {
                    exec.launch(&stream).unwrap();
                }
                stream.synchronize().unwrap();
            });
        }
    });
    assert_eq!(exec.launch_count(), (THREADS * LAUNCHES) as u64);
    let counts_now = read_u32(context, counts.ptr(), N, &origin);
    let expected = (THREADS * LAUNCHES) as u32;
    if let Some(i) = counts_now.iter().position(|&x| x != expected) {
        panic!(
            "element {i} was incremented {} times, not {expected}: launches of one executable \
             overlapped",
            counts_now[i]
        );
    }
}

#[test]
fn two_captures_broken_on_two_threads_each_name_their_own_breaking_call() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let barrier = Barrier::new(2);
    // Thread B breaks its capture first, with cuMemAlloc; thread A breaks its own afterwards,
    // with cuMemFree (both called directly: cuweave's own allocations are made in relaxed mode
    // while capturing and break nothing). Each capture's error should name the call made on its own thread.
    let (a_outcome, b_outcome) = std::thread::scope(|scope| {
        let a = scope.spawn(|| {
            let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
            let victim = raw_mem_alloc(context, MIB).unwrap();
            stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
            barrier.wait(); // both captures have begun
            barrier.wait(); // B has broken its capture
            // SAFETY: allocated above, freed once, used by no work.
            let freed = unsafe { raw_mem_free(context, victim) };
            let ended = stream.end_capture();
            (freed.err(), ended.map(|graph| graph.node_count()))
        });
        let b = scope.spawn(|| {
            let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
            stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
            barrier.wait();
            let allocated = raw_mem_alloc(context, MIB);
            barrier.wait();
            let ended = stream.end_capture();
            // Freed, if it was made, only once the capture is over.
            if let Ok(ptr) = allocated {
                // SAFETY: allocated above, freed once, used by no work.
                unsafe { raw_mem_free(context, ptr) }.unwrap();
            }
            (allocated.err(), ended.map(|graph| graph.node_count()))
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    eprintln!("A (cuMemFree during its capture): {a_outcome:?}");
    eprintln!("B (cuMemAlloc during its capture): {b_outcome:?}");
    assert_eq!(cuweave_driver::graph::active_captures(), 0);
    // Each capture is thread-local, so only its own thread's call can have broken it, and its
    // end names that call (on an H200 with driver 580: both calls break their captures).
    let broken_by = |outcome: &Result<Result<usize, DriverError>, DriverError>| match outcome {
        Err(DriverError::Graph(GraphError::CaptureInvalidated { broken_by, .. })) => *broken_by,
        other => panic!("expected an invalidated capture, got {other:?}"),
    };
    assert_eq!(
        broken_by(&b_outcome.1),
        Some("cuMemAlloc_v2"),
        "B's capture"
    );
    assert_eq!(
        broken_by(&a_outcome.1),
        Some("cuMemFree_v2"),
        "A's capture, not the cuMemAlloc thread B made for B's capture"
    );
    // The context is usable afterwards.
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let buffer = DeviceAllocation::zeroed(context, 4096).unwrap();
    // SAFETY: `buffer` holds 1024 u32s.
    unsafe { memory::memset_d32_async(buffer.ptr(), 9, 1024, &stream) }.unwrap();
    assert!(
        read_u32(context, buffer.ptr(), 1024, &stream)
            .iter()
            .all(|&x| x == 9)
    );
}

// ---------------------------------------------------------------------------------------------
// Modules and launches
// ---------------------------------------------------------------------------------------------

/// PTX that parses but does not assemble: an undeclared register.
const BROKEN_PTX: &str = "\
.version 8.0
.target sm_75
.address_size 64

.visible .entry cuweave_broken()
{
    mov.u32 %cuweave_undeclared, 7;
    ret;
}
";

#[test]
fn modules_load_on_eight_threads_at_once_while_bad_modules_names_and_launches_fail_typed_beside_them()
 {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    const THREADS: usize = 8;
    const N: usize = 100_003;
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let barrier = &barrier;
            scope.spawn(move || {
                barrier.wait();
                // Eight JIT compilations of the same PTX at once, each its own module.
                let module = Module::from_ptx(context, PTX).unwrap();
                let fill = module.function("fill_u32").unwrap();
                let increment = module.function("increment_u32").unwrap();
                let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
                let buffer = DeviceAllocation::new(context, N * 4).unwrap();
                let (dst, n, value) = (buffer.ptr(), N as u64, (t as u32 + 1) * 1000);
                let fill_args = KernelArgs::new().arg(&dst).arg(&value).arg(&n);
                let increment_args = KernelArgs::new().arg(&dst).arg(&n);
                let grid = LaunchConfig::for_elements(N, 256).unwrap();
                // SAFETY: fill_u32(unsigned*, unsigned, size_t) and increment_u32(unsigned*,
                // size_t) match their argument lists; `buffer` holds N u32s and outlives the
                // kernels (the stream is synchronised before it drops).
                unsafe {
                    fill.launch(&stream, grid, &fill_args).unwrap();
                    increment.launch(&stream, grid, &increment_args).unwrap();
                }
                let mut increments = 1;
                if t % 2 == 1 {
                    // Bad modules, names and launches, each a typed error ...
                    assert_driver_error(
                        Module::from_ptx(context, ".version what\nnot PTX {"),
                        "garbage PTX",
                    );
                    let broken = Module::from_ptx(context, BROKEN_PTX).unwrap_err();
                    assert!(
                        broken
                            .jit_log()
                            .is_some_and(|log| log.contains("cuweave_undeclared")),
                        "{broken}"
                    );
                    assert_invalid(Module::from_ptx(context, "a\0b"), "PTX with a NUL");
                    assert_invalid(Module::from_cubin(context, &[]), "an empty image");
                    assert_invalid(
                        Module::from_cubin(context, &[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]),
                        "a truncated ELF header",
                    );
                    let noise: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 3) as u8).collect();
                    assert_invalid(Module::from_cubin(context, &noise), "noise");
                    let missing = module.function("no_such_kernel").unwrap_err();
                    assert!(missing.is_name_not_found(), "{missing:?}");
                    assert_invalid(module.function("fill\0u32"), "a name with a NUL");
                    assert!(
                        module
                            .global("no_such_global")
                            .unwrap_err()
                            .is_name_not_found()
                    );
                    let shapes = [
                        ((0, 1, 1), (256, 1, 1), 0, true),
                        ((1, 1, 1), (0, 1, 1), 0, true),
                        ((1, 1, 1), (1025, 1, 1), 0, false),
                        ((1, 1, 1), (32, 32, 2), 0, false),
                        ((1, 65_536, 1), (32, 1, 1), 0, false),
                        ((1, 1, 1), (32, 1, 1), 1 << 20, false),
                    ];
                    for (grid, block, shared, invalid) in shapes {
                        let config = LaunchConfig {
                            grid,
                            block,
                            shared_mem_bytes: shared,
                        };
                        // SAFETY: as above; a launch the driver refuses runs nothing.
                        let outcome = unsafe { increment.launch(&stream, config, &increment_args) };
                        let what = format!("grid {grid:?} block {block:?} shared {shared}");
                        if invalid {
                            assert_invalid(outcome, &what);
                        } else {
                            match outcome {
                                Err(error @ DriverError::Cuda { .. }) => assert_eq!(
                                    error.operation(),
                                    Some("cuLaunchKernel"),
                                    "{what}: {error}"
                                ),
                                other => {
                                    panic!("{what}: expected the driver's error, got {other:?}")
                                }
                            }
                        }
                    }
                    // ... and none of them is sticky: the stream goes on.
                    // SAFETY: as above.
                    unsafe { increment.launch(&stream, grid, &increment_args) }.unwrap();
                    increments += 1;
                }
                // The module handle may go; its kernels keep it loaded.
                drop(module);
                // SAFETY: as above.
                unsafe { increment.launch(&stream, grid, &increment_args) }.unwrap();
                increments += 1;
                let got = read_u32(context, dst, N, &stream);
                let want = value + increments;
                if let Some(i) = got.iter().position(|&x| x != want) {
                    panic!("thread {t}: element {i} is {}, not {want}", got[i]);
                }
            });
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Raw memory
// ---------------------------------------------------------------------------------------------

#[test]
fn stream_ordered_allocations_made_and_freed_ten_thousand_times_stay_exact_and_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    if !context.device().supports_memory_pools().unwrap() {
        cuweave_test_support::skip(
            "stream_ordered_allocations_made_and_freed_ten_thousand_times_stay_exact_and_bounded",
            "the device has no memory pools",
        );
        return;
    }
    let kernels = TestKernels::load(context).unwrap();
    let pool = MemoryPool::new(context).unwrap();
    let s1 = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let s2 = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    // Up to eight allocations live at once, of sizes from one word to 256 KiB.
    let mut live: VecDeque<(DevicePtr, usize, u32)> = VecDeque::new();
    let mut rng = Rng(0xA110C);
    let mut checked = 0;
    let started = Instant::now();
    for i in 0..10_000u32 {
        let words = 1 + rng.below(64 * 1024);
        // SAFETY: freed exactly once below, after its last use, on a stream ordered after
        // every use.
        let ptr = unsafe { pool.alloc_async(words * 4, &s1) }.unwrap();
        // SAFETY: `ptr` holds `words` u32s from here on, on `s1`.
        unsafe { kernels.fill_u32(&s1, ptr, i, words) }.unwrap();
        live.push_back((ptr, words, i));
        if live.len() > 8 {
            let (old, old_words, old_value) = live.pop_front().unwrap();
            let check = i % 97 == 0;
            if check {
                let got = read_u32(context, old, old_words, &s1);
                assert!(
                    got.iter().all(|&x| x == old_value),
                    "allocation of {old_words} words, filled with {old_value}, holds {:?}…",
                    &got[..got.len().min(4)]
                );
                checked += 1;
            }
            if i % 10 == 0 {
                // Freed on another stream, ordered after the fill.
                s2.wait_stream(&s1).unwrap();
                // SAFETY: `old` came from the pool, its last use is ordered before this free.
                unsafe { memory::free_async(old, &s2) }.unwrap();
            } else {
                // SAFETY: as above, on the stream of its last use.
                unsafe { memory::free_async(old, &s1) }.unwrap();
            }
        }
    }
    for (ptr, words, value) in live.drain(..) {
        assert!(
            read_u32(context, ptr, words, &s1)
                .iter()
                .all(|&x| x == value)
        );
        // SAFETY: as above.
        unsafe { memory::free_async(ptr, &s1) }.unwrap();
    }
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    eprintln!(
        "10,000 stream-ordered allocations in {:?}, {checked} checked",
        started.elapsed()
    );
    assert_eq!(pool.used_bytes().unwrap(), 0);
    let reserved = pool.reserved_bytes().unwrap();
    assert!(
        reserved <= 64 * MIB as u64,
        "{reserved} bytes reserved for at most 9 x 256 KiB live at once"
    );
    pool.trim_to(0).unwrap();
    assert_eq!(pool.reserved_bytes().unwrap(), 0);
}

#[test]
fn raw_copies_and_memsets_at_odd_offsets_round_trip_on_eight_threads_byte_for_byte() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    const THREADS: usize = 8;
    const BYTES: usize = 3 * MIB + 13;
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            scope.spawn(move || {
                let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
                let device = DeviceAllocation::zeroed(context, BYTES).unwrap();
                let other = DeviceAllocation::zeroed(context, BYTES).unwrap();
                let mut pinned =
                    HostAllocation::new(context, BYTES, HostAllocFlags::default()).unwrap();
                // What `device` and `other` must hold.
                let mut model = vec![0u8; BYTES];
                let mut other_model = vec![0u8; BYTES];
                let mut rng = Rng(0xD1CE ^ ((t as u64 + 1) << 20));
                for op in 0..80 {
                    let len = match rng.below(4) {
                        0 => 1 + rng.below(16),
                        1 => 4095 + rng.below(3),
                        2 => 1 + rng.below(64 * 1024),
                        _ => 1 + rng.below(MIB + 7),
                    };
                    let at = rng.below(BYTES - len + 1);
                    match op % 6 {
                        0 => {
                            // Pinned to device, both at odd places.
                            let from = rng.below(BYTES - len + 1);
                            let seed = rng.next();
                            for (k, byte) in pinned.as_bytes_mut()[from..from + len]
                                .iter_mut()
                                .enumerate()
                            {
                                *byte = (seed >> (k % 8 * 8)) as u8 ^ k as u8;
                            }
                            model[at..at + len]
                                .copy_from_slice(&pinned.as_bytes()[from..from + len]);
                            // SAFETY: both ranges lie inside their allocations; `pinned` is
                            // not written again before the synchronize.
                            unsafe {
                                memory::copy_htod_async(
                                    device.ptr() + at as u64,
                                    pinned.as_ptr().add(from),
                                    len,
                                    &stream,
                                )
                            }
                            .unwrap();
                            stream.synchronize().unwrap();
                        }
                        1 => {
                            let value = rng.next() as u8;
                            model[at..at + len].fill(value);
                            // SAFETY: the range lies inside `device`.
                            unsafe {
                                memory::memset_d8_async(
                                    device.ptr() + at as u64,
                                    value,
                                    len,
                                    &stream,
                                )
                            }
                            .unwrap();
                        }
                        2 => {
                            // Device to another allocation, odd places on both sides.
                            let to = rng.below(BYTES - len + 1);
                            other_model[to..to + len].copy_from_slice(&model[at..at + len]);
                            // SAFETY: both ranges lie inside their (distinct) allocations.
                            unsafe {
                                memory::copy_dtod_async(
                                    other.ptr() + to as u64,
                                    device.ptr() + at as u64,
                                    len,
                                    &stream,
                                )
                            }
                            .unwrap();
                        }
                        3 => {
                            // A 16-bit fill at an even address, an odd count.
                            let at = at & !1;
                            let count = (len / 2).max(1).min((BYTES - at) / 2);
                            let value = rng.next() as u16;
                            for k in 0..count {
                                model[at + 2 * k..at + 2 * k + 2]
                                    .copy_from_slice(&value.to_le_bytes());
                            }
                            // SAFETY: 2-byte aligned, `2 * count` bytes inside `device`.
                            unsafe {
                                memory::memset_d16_async(
                                    device.ptr() + at as u64,
                                    value,
                                    count,
                                    &stream,
                                )
                            }
                            .unwrap();
                        }
                        4 => {
                            // Pageable memory through the unified copy, which infers the side.
                            let data: Vec<u8> = (0..len)
                                .map(|k| (k as u8).wrapping_mul(31) ^ t as u8)
                                .collect();
                            model[at..at + len].copy_from_slice(&data);
                            // SAFETY: `data` lives until the synchronize; the range lies inside
                            // `device`.
                            unsafe {
                                memory::copy_async(
                                    device.ptr() + at as u64,
                                    data.as_ptr() as DevicePtr,
                                    len,
                                    &stream,
                                )
                            }
                            .unwrap();
                            stream.synchronize().unwrap();
                        }
                        _ => {
                            // Device to pinned at an odd place, checked against the model.
                            let to = rng.below(BYTES - len + 1);
                            // SAFETY: both ranges lie inside their allocations; `pinned` is
                            // read only after the synchronize.
                            unsafe {
                                memory::copy_dtoh_async(
                                    pinned.as_mut_ptr().add(to),
                                    device.ptr() + at as u64,
                                    len,
                                    &stream,
                                )
                            }
                            .unwrap();
                            stream.synchronize().unwrap();
                            assert!(
                                pinned.as_bytes()[to..to + len] == model[at..at + len],
                                "thread {t} op {op}: {len} bytes at {at} read back wrong"
                            );
                        }
                    }
                }
                stream.synchronize().unwrap();
                let mut whole = vec![0u8; BYTES];
                for (allocation, expected, name) in
                    [(&device, &model, "device"), (&other, &other_model, "other")]
                {
                    // SAFETY: `whole` and the allocation hold BYTES bytes.
                    unsafe {
                        memory::copy_dtoh(context, whole.as_mut_ptr(), allocation.ptr(), BYTES)
                    }
                    .unwrap();
                    if let Some(i) = (0..BYTES).find(|&i| whole[i] != expected[i]) {
                        panic!(
                            "thread {t}: {name} byte {i} is {:#04x}, expected {:#04x}",
                            whole[i], expected[i]
                        );
                    }
                }
            });
        }
    });
}
