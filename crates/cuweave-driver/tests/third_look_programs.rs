//! A third look at the driver layer through the programs cudarc users and people porting CUDA
//! C++ write, aimed at what the other suites leave out: every stream-memop wait condition and
//! the 64-bit wait, a host function that releases a device-side wait on another stream, graphs
//! that allocate and free inside themselves, updates made while earlier launches are still
//! gated, a diamond captured with explicit event records and waits (CUDA C++'s idiom, not
//! `fork`/`wait_stream`), event-pool ping-pong from several threads, kernel attributes, and
//! work of one device refused on another's streams. Each test checks its outcome on the GPU:
//! exact bytes, sums that count every launch, ordering proven by a gate or a word the host
//! controls.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

mod common;

use common::{non_blocking, warmed_kernels};
use cuweave_driver::graph::{GraphNodeType, graph_memory_usage, trim_graph_memory};
use cuweave_driver::memory::{self, DeviceAllocation, DevicePtr};
use cuweave_driver::{
    CaptureMode, Context, Device, DriverError, Event, EventFlags, EventPool, Graph, GraphError,
    InstantiateOptions, OwnedPooledEvent, Stream, StreamFlags, WaitCondition, WriteOrdering, sys,
};
use cuweave_test_support::host_flags::HostFlags;
use cuweave_test_support::{require_gpu, serial};

const MS: u64 = 1_000_000;

/// How long a test waits for work that must finish before calling it stuck.
const STUCK: Duration = Duration::from_secs(10);

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

/// Polls `stream` until its work has finished, panicking with `what` after [`STUCK`] instead
/// of hanging in a synchronize on a wait nothing will ever satisfy.
fn finish_or_panic(stream: &Stream, what: &str) {
    let start = Instant::now();
    while !stream.query().unwrap() {
        assert!(
            start.elapsed() < STUCK,
            "{what}: the stream did not finish within {STUCK:?}"
        );
        std::thread::yield_now();
    }
    stream.synchronize().unwrap();
}

/// Asserts for `window` that `stream` is still held and that the host word `marker` of
/// `flags`, which the stream writes once released, is still 0.
fn assert_held(stream: &Stream, flags: &HostFlags, marker: usize, window: Duration, what: &str) {
    let start = Instant::now();
    while start.elapsed() < window {
        assert_eq!(
            flags.read(marker),
            0,
            "{what}: the stream ran past a wait whose condition did not hold"
        );
        assert!(
            !stream.query().unwrap(),
            "{what}: the stream finished although its wait condition did not hold"
        );
        std::thread::yield_now();
    }
}

fn assert_invalid<T: std::fmt::Debug>(result: Result<T, DriverError>, what: &str) {
    match result {
        Err(DriverError::InvalidArgument { .. }) => {}
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Stream memory operations
// ---------------------------------------------------------------------------------------------

/// `cuStreamWaitValue32` with each condition CUDA offers: the stream is held while the word
/// does not match (values on both sides of the condition's edge, including a wrapped sequence
/// number for `AtLeast`) and released by the first value that does.
#[test]
fn wait_value_u32_equal_any_bit_nor_and_wrapping_at_least_release_only_on_a_matching_word() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let nor = gpu
        .device
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR)
        .unwrap_or(0)
        != 0;
    // (condition, compared value, words that must hold the stream, the word that releases it)
    let cases: [(WaitCondition, u32, &[u32], u32); 4] = [
        (
            WaitCondition::Equal,
            0xABCD,
            &[0xABCC, 0xABCE, 0x1_ABCD],
            0xABCD,
        ),
        // Bits 5 and 7 compared: words with neither set hold it, either one releases it.
        (
            WaitCondition::AnyBitSet,
            0b1010_0000,
            &[0, 0b0101_1111, 0x100],
            0b0010_0000,
        ),
        // `!(word | value) != 0`: released once the word leaves a low bit clear.
        (
            WaitCondition::Nor,
            0xFFFF_0000,
            &[0x0000_FFFF, 0xFFFF_FFFF],
            0x0000_FFFE,
        ),
        // A sequence number that wrapped past the compared one has reached it; one that is
        // 2^31 behind, or one behind, has not.
        (
            WaitCondition::AtLeast,
            0xFFFF_FFF0,
            &[0x7FFF_FFF0, 0xFFFF_FFEF],
            0x0000_0010,
        ),
    ];
    let flags = HostFlags::new(context, 2);
    for (case, (condition, value, holding, releasing)) in cases.into_iter().enumerate() {
        if condition == WaitCondition::Nor && !nor {
            eprintln!("device lacks CAN_USE_STREAM_WAIT_VALUE_NOR: the Nor case is left out");
            continue;
        }
        let what = format!("{condition:?} {value:#x}");
        let marker = (case + 1) as u32;
        flags.write(0, holding[0]);
        flags.write(1, 0);
        // SAFETY: both words are mapped pinned memory of this context that outlive the stream's
        // work (the loop waits for it to finish before the next case; `flags` is dropped last).
        unsafe {
            stream
                .wait_value_u32(flags.device(0), value, condition)
                .unwrap();
            stream
                .write_value_u32(flags.device(1), marker, WriteOrdering::AfterPriorWrites)
                .unwrap();
        }
        for &word in holding {
            flags.write(0, word);
            assert_held(
                &stream,
                &flags,
                1,
                Duration::from_millis(5),
                &format!("{what}, word {word:#x}"),
            );
        }
        flags.write(0, releasing);
        finish_or_panic(&stream, &format!("{what}, word {releasing:#x}"));
        assert_eq!(flags.read(1), marker, "{what}: the write behind the wait");
    }
}

/// A producer stream publishes 64-bit sequence numbers above 2^32 (`cuStreamWriteValue64`)
/// and a consumer stream waits for each (`cuStreamWaitValue64`, `AtLeast`) before summing the
/// step's data. The producer starts with a 5 ms spin, so the consumer reaches its first waits
/// long before anything is published, while the word still holds 5: a wait that compared only
/// the low 32 bits would pass the first steps at once and sum zeros. The producer is queued
/// first: waits that CUDA does not see as dependencies must never sit ahead of the work that
/// satisfies them, in case the two streams share one hardware queue.
#[test]
fn a_64_bit_sequence_word_holds_a_consumer_until_each_producer_step() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let producer = non_blocking(context);
    let consumer = non_blocking(context);
    let kernels = warmed_kernels(context, &producer);
    const STEPS: usize = 48;
    const N: usize = 1 << 12;
    const BASE: u64 = 1 << 32;
    let data = DeviceAllocation::zeroed(context, STEPS * N * 4).unwrap();
    let sums = DeviceAllocation::zeroed(context, STEPS * 8).unwrap();
    let sequence = DeviceAllocation::new(context, 8).unwrap();
    let start = 5u64;
    // SAFETY: `sequence` holds 8 bytes.
    unsafe { memory::copy_htod(context, sequence.ptr(), (&raw const start).cast(), 8) }.unwrap();
    let step_data = |step: usize| data.ptr() + (step * N * 4) as u64;

    for step in 0..STEPS {
        // A spin first, so a consumer that ran ahead would find the step's data still zero.
        let spin = if step == 0 { 5 * MS } else { 200_000 };
        kernels.spin_ns(&producer, spin).unwrap();
        // SAFETY: `sequence` is 8-byte aligned device memory, and every step's data and sum
        // slot lie inside their allocations, all of which outlive both streams' work (they are
        // synchronized below before anything is dropped).
        unsafe {
            kernels
                .fill_u32(&producer, step_data(step), step as u32 * 7 + 1, N)
                .unwrap();
            producer
                .write_value_u64(
                    sequence.ptr(),
                    BASE + step as u64 + 1,
                    WriteOrdering::AfterPriorWrites,
                )
                .unwrap();
        }
    }
    for step in 0..STEPS {
        // SAFETY: as above.
        let waited = unsafe {
            consumer.wait_value_u64(
                sequence.ptr(),
                BASE + step as u64 + 1,
                WaitCondition::AtLeast,
            )
        };
        if let Err(error) = waited {
            assert_eq!(
                step, 0,
                "only the first wait may find 64-bit waits unsupported"
            );
            producer.synchronize().unwrap();
            cuweave_test_support::skip(
                "a_64_bit_sequence_word_holds_a_consumer_until_each_producer_step",
                &format!("64-bit stream waits are unsupported here: {error}"),
            );
            return;
        }
        // SAFETY: as above.
        unsafe {
            kernels
                .checksum_u32(
                    &consumer,
                    step_data(step),
                    N,
                    sums.ptr() + (step * 8) as u64,
                )
                .unwrap();
        }
    }
    finish_or_panic(&consumer, "the consumer of 48 sequence steps");
    producer.synchronize().unwrap();
    let mut host = vec![0u64; STEPS];
    // SAFETY: `host` and `sums` hold STEPS u64s.
    unsafe { memory::copy_dtoh(context, host.as_mut_ptr().cast(), sums.ptr(), STEPS * 8) }.unwrap();
    for (step, &sum) in host.iter().enumerate() {
        assert_eq!(
            sum,
            N as u64 * (step as u64 * 7 + 1),
            "step {step}: the consumer summed data the producer had not yet written"
        );
    }
    assert_eq!(
        read_u64(context, sequence.ptr(), &producer),
        BASE + STEPS as u64
    );
}

/// A host function on the producer stream (it must not call CUDA) opens a mapped word that a
/// device-side wait on the consumer stream gates on: the host-to-device hand-off CUDA C++
/// programs build with `cudaLaunchHostFunc` and `cuStreamWaitValue32`. The producer starts with
/// a 5 ms spin, so the consumer reaches its waits first; it copies each round's data only after
/// the host function behind that round's kernel ran. The host functions run once each, in
/// order. The producer is queued first, so no wait sits ahead of what opens it should the two
/// streams share one hardware queue.
#[test]
fn host_functions_release_device_waits_on_another_stream_round_by_round() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let producer = non_blocking(context);
    let consumer = non_blocking(context);
    let kernels = warmed_kernels(context, &producer);
    const ROUNDS: usize = 32;
    const N: usize = 1 << 12;
    let data = DeviceAllocation::zeroed(context, ROUNDS * N * 4).unwrap();
    let out = DeviceAllocation::zeroed(context, ROUNDS * N * 4).unwrap();
    let slot = |base: DevicePtr, round: usize| base + (round * N * 4) as u64;
    let flags = Arc::new(HostFlags::new(context, 1));
    let ran = Arc::new(Mutex::new(Vec::new()));

    for round in 0..ROUNDS {
        let spin = if round == 0 { 5 * MS } else { 300_000 };
        kernels.spin_ns(&producer, spin).unwrap();
        // SAFETY: each round's slot lies inside `data`, which outlives the producer's work.
        unsafe {
            kernels
                .fill_u32(&producer, slot(data.ptr(), round), 0x1000 + round as u32, N)
                .unwrap();
        }
        let (flags, ran) = (Arc::clone(&flags), Arc::clone(&ran));
        producer
            .launch_host_fn(move || {
                ran.lock().unwrap().push(round);
                flags.write(0, round as u32 + 1);
            })
            .unwrap();
    }
    for round in 0..ROUNDS {
        // SAFETY: the flag word is mapped pinned memory kept alive by `flags` (and by the host
        // functions' clones) until both streams are synchronized; each round's slots lie inside
        // `data` and `out`, which outlive the streams' work.
        unsafe {
            consumer
                .wait_value_u32(flags.device(0), round as u32 + 1, WaitCondition::AtLeast)
                .unwrap();
            memory::copy_dtod_async(
                slot(out.ptr(), round),
                slot(data.ptr(), round),
                N * 4,
                &consumer,
            )
            .unwrap();
        }
    }
    finish_or_panic(&consumer, "the consumer gated by host functions");
    producer.synchronize().unwrap();
    assert_eq!(*ran.lock().unwrap(), (0..ROUNDS).collect::<Vec<_>>());
    let copied = read_u32(context, out.ptr(), ROUNDS * N, &consumer);
    for round in 0..ROUNDS {
        let words = &copied[round * N..(round + 1) * N];
        assert!(
            words.iter().all(|&word| word == 0x1000 + round as u32),
            "round {round}: the consumer copied {:#x}… before the producer's fill",
            words[0]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Graphs
// ---------------------------------------------------------------------------------------------

/// Graphs with memory nodes, as `torch.cuda.graphs` with a private pool produce them: a graph
/// that allocates a scratch buffer, fills it, sums it and frees it replays exactly with
/// auto-free; one that keeps its allocation and was instantiated without auto-free is launched
/// once and a relaunch is a typed error; once both executables are gone and the allocation is
/// freed, trimming gives all graph memory back to the driver.
#[test]
fn graphs_that_allocate_replay_exactly_refuse_a_relaunch_without_auto_free_and_trim_to_zero() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    const N: usize = 1 << 16;
    let sums = DeviceAllocation::zeroed(context, 16).unwrap();

    // Keeps its allocation: launched once, then refused.
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: freed below with `free_async` once the only launch has finished; the graph's
    // nodes touch only it and `sums`, which outlives them.
    let kept = unsafe { memory::alloc_async(&stream, N * 4) }.unwrap();
    // SAFETY: `kept` holds N u32s when the graph runs; `sums` holds two u64s.
    unsafe {
        kernels.fill_u32(&stream, kept, 9, N).unwrap();
        kernels.checksum_u32(&stream, kept, N, sums.ptr()).unwrap();
    }
    let once = stream.end_capture().unwrap();
    assert!(once.allocates_memory().unwrap());
    let once_exec = once
        .instantiate(&InstantiateOptions::default().with_auto_free_on_launch(false))
        .unwrap();
    once_exec.launch(&stream).unwrap();
    match once_exec.launch(&stream) {
        Err(DriverError::Graph(GraphError::RelaunchNeedsAutoFree)) => {}
        other => panic!("a second launch without auto-free gave {other:?}"),
    }
    assert_eq!(once_exec.launch_count(), 1);
    assert_eq!(read_u64(context, sums.ptr(), &stream), N as u64 * 9);
    // The allocation outlives the launch at its fixed address: the host can still read it.
    assert_eq!(read_u32(context, kept, 4, &stream), vec![9; 4]);
    // SAFETY: `kept` came from the graph's allocation, which its launch made and nothing freed.
    unsafe { memory::free_async(kept, &stream) }.unwrap();
    drop(once_exec);
    drop(once);

    // Allocates and frees inside: replays as often as asked.
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: freed inside the same capture, after the nodes that use it.
    let scratch = unsafe { memory::alloc_async(&stream, N * 4) }.unwrap();
    // SAFETY: `scratch` holds N u32s between its allocation and free nodes; `sums` holds two
    // u64s and outlives every launch.
    unsafe {
        kernels.fill_u32(&stream, scratch, 3, N).unwrap();
        kernels
            .checksum_u32(&stream, scratch, N, sums.ptr() + 8)
            .unwrap();
        memory::free_async(scratch, &stream).unwrap();
    }
    let graph = stream.end_capture().unwrap();
    let types = graph.node_types().unwrap();
    assert_eq!(
        types
            .iter()
            .filter(|&&kind| kind == GraphNodeType::MemAlloc)
            .count(),
        1,
        "{types:?}"
    );
    assert_eq!(
        types
            .iter()
            .filter(|&&kind| kind == GraphNodeType::MemFree)
            .count(),
        1,
        "{types:?}"
    );
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    const LAUNCHES: u64 = 50;
    for _ in 0..LAUNCHES {
        exec.launch(&stream).unwrap();
    }
    stream.synchronize().unwrap();
    let usage = graph_memory_usage(gpu.device).unwrap();
    assert!(
        usage.reserved >= (N * 4) as u64 && usage.reserved_high >= usage.reserved,
        "a live graph with a {} byte allocation: {usage:?}",
        N * 4
    );
    let mut host = [0u64; 2];
    // SAFETY: `host` and `sums` hold two u64s.
    unsafe { memory::copy_dtoh(context, host.as_mut_ptr().cast(), sums.ptr(), 16) }.unwrap();
    assert_eq!(host, [N as u64 * 9, LAUNCHES * N as u64 * 3]);

    drop(exec);
    drop(graph);
    context.synchronize().unwrap();
    trim_graph_memory(gpu.device).unwrap();
    let usage = graph_memory_usage(gpu.device).unwrap();
    assert_eq!(
        (usage.used, usage.reserved),
        (0, 0),
        "no executable or graph allocation is left, yet graph memory is held: {usage:?}"
    );
}

/// An executable updated while its earlier launches wait behind a closed gate: CUDA applies
/// an update to later launches only, so each launch runs with the parameters current when it
/// was queued. Every launch fills a buffer with its value and adds the buffer's sum to a
/// counter, so the final sum names the value each launch used. The updates return while the
/// gate is still closed: they do not wait for the queued launches.
#[test]
fn updates_made_while_launches_wait_behind_a_gate_change_only_the_later_launches() {
    let gpu = require_gpu!();
    let _serial = serial();
    if cuweave_test_support::skip_under_sanitizer(
        "updates_made_while_launches_wait_behind_a_gate_change_only_the_later_launches",
        "holds a stream behind a gate the host opens",
    ) {
        return;
    }
    let context = &gpu.context;
    let stream = non_blocking(context);
    let capturing = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    const N: usize = 1 << 14;
    let out = DeviceAllocation::zeroed(context, N * 4).unwrap();
    let sum = DeviceAllocation::zeroed(context, 8).unwrap();
    let capture = |value: u32| -> Graph {
        capturing.begin_capture(CaptureMode::ThreadLocal).unwrap();
        // SAFETY: `out` holds N u32s and `sum` one u64; both outlive every launch (the test
        // synchronizes before dropping them).
        unsafe {
            kernels.fill_u32(&capturing, out.ptr(), value, N).unwrap();
            kernels
                .checksum_u32(&capturing, out.ptr(), N, sum.ptr())
                .unwrap();
        }
        capturing.end_capture().unwrap()
    };
    let mut exec = capture(2)
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    let (five, eleven) = (capture(5), capture(11));
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();

    let gate = HostFlags::new(context, 1);
    // SAFETY: the gate word is mapped pinned memory that outlives the kernel (opened and the
    // stream synchronized before `gate` drops).
    unsafe { kernels.wait_u32(&stream, gate.device(0), 1, 5_000 * MS) }.unwrap();
    let gated = Instant::now();
    exec.launch(&stream).unwrap(); // 2
    exec.update(&five).unwrap();
    exec.launch(&stream).unwrap(); // 5
    exec.launch(&stream).unwrap(); // 5
    exec.update(&eleven).unwrap();
    exec.launch(&stream).unwrap(); // 11
    let queued_in = gated.elapsed();
    assert!(
        !stream.query().unwrap(),
        "the launches were not held behind the gate"
    );
    assert!(
        queued_in < Duration::from_secs(2),
        "two updates and four launches took {queued_in:?} behind a closed gate: an update waited for queued launches"
    );
    gate.write(0, 1);
    finish_or_panic(&stream, "the gated launches");
    assert_eq!(exec.launch_count(), 5);
    assert_eq!(
        read_u64(context, sum.ptr(), &stream),
        N as u64 * (2 + 2 + 5 + 5 + 11),
        "a launch queued before an update ran with the updated parameters (or the reverse)"
    );
    assert_eq!(read_u32(context, out.ptr(), N, &stream), vec![11; N]);
}

/// The diamond CUDA C++ programs capture with explicit events: `cudaEventRecord(fork, s0)`,
/// two streams wait on that one event, each records its own join event, and `s0` waits on both.
/// Captured on a high-priority stream, instantiated with node priorities, launched on a
/// low-priority one. The events become edges, not nodes; every replay reads what the node
/// before it wrote in that same replay, so one misordered replay changes the total.
#[test]
fn a_diamond_captured_with_explicit_event_records_replays_in_order_with_node_priorities() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let range = context.stream_priority_range().unwrap();
    let s0 = Stream::with_priority(context, StreamFlags::NON_BLOCKING, range.greatest).unwrap();
    let s1 = non_blocking(context);
    let s2 = non_blocking(context);
    let low = Stream::with_priority(context, StreamFlags::NON_BLOCKING, range.least).unwrap();
    let kernels = warmed_kernels(context, &s0);
    const N: usize = 1 << 14;
    let a = DeviceAllocation::zeroed(context, N * 4).unwrap();
    let b = DeviceAllocation::zeroed(context, N * 4).unwrap();
    let c = DeviceAllocation::zeroed(context, N * 4).unwrap();
    let sum = DeviceAllocation::zeroed(context, 8).unwrap();
    let fork = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    let join1 = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    let join2 = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();

    s0.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // Launch k: a = k; b = k + 1; c = k; sum += Σb + Σc = N(2k + 1).
    // SAFETY: `a`, `b`, `c` hold N u32s and `sum` one u64, separate allocations that outlive
    // every launch (the test synchronizes before dropping them); the blocks below likewise.
    unsafe { kernels.increment_u32(&s0, a.ptr(), N) }.unwrap();
    fork.record(&s0).unwrap();
    s1.wait_event(&fork).unwrap();
    s2.wait_event(&fork).unwrap();
    // SAFETY: as above.
    unsafe {
        memory::copy_dtod_async(b.ptr(), a.ptr(), N * 4, &s1).unwrap();
        kernels.increment_u32(&s1, b.ptr(), N).unwrap();
        memory::copy_dtod_async(c.ptr(), a.ptr(), N * 4, &s2).unwrap();
    }
    join1.record(&s1).unwrap();
    join2.record(&s2).unwrap();
    s0.wait_event(&join1).unwrap();
    s0.wait_event(&join2).unwrap();
    // SAFETY: as above.
    unsafe {
        kernels.checksum_u32(&s0, b.ptr(), N, sum.ptr()).unwrap();
        kernels.checksum_u32(&s0, c.ptr(), N, sum.ptr()).unwrap();
    }
    let graph = s0.end_capture().unwrap();
    let types = graph.node_types().unwrap();
    assert_eq!(
        types.len(),
        6,
        "the events must become edges, not nodes: {types:?}"
    );
    assert_eq!(
        types
            .iter()
            .filter(|&&kind| kind == GraphNodeType::Kernel)
            .count(),
        4,
        "{types:?}"
    );
    let exec = graph
        .instantiate(&InstantiateOptions::default().with_node_priority(true))
        .unwrap();
    const LAUNCHES: u64 = 200;
    for _ in 0..LAUNCHES {
        exec.launch(&low).unwrap();
    }
    assert_eq!(
        read_u64(context, sum.ptr(), &low),
        N as u64 * LAUNCHES * (LAUNCHES + 2),
        "Σ N(2k + 1) over the launches"
    );
    assert_eq!(
        read_u32(context, b.ptr(), N, &low),
        vec![LAUNCHES as u32 + 1; N]
    );
    // The events were recorded into the capture only: nothing ever ran on s1 or s2.
    assert!(s1.query().unwrap() && s2.query().unwrap());
}

// ---------------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------------

/// Four threads each bounce one buffer between two streams 5 000 times, every hop a pooled
/// event recorded on one stream, waited on by the other and returned to one shared private
/// pool at once (re-recorded by the next hop while the wait on it is still queued). Each hop is
/// a non-atomic increment of every element, so a hop that overlapped another would lose
/// counts. The pool grows only to what was in use at once and ends with nothing in use.
#[test]
fn four_threads_ping_pong_pooled_events_between_stream_pairs_and_the_pool_stays_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let pool = EventPool::new(context, 0, 0).unwrap();
    const THREADS: usize = 4;
    const ROUNDS: usize = 5_000;
    const N: usize = 1 << 12;
    let barrier = Barrier::new(THREADS);
    let finished = AtomicU32::new(0);
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let (pool, barrier, finished) = (&pool, &barrier, &finished);
            scope.spawn(move || {
                let a = non_blocking(context);
                let b = non_blocking(context);
                let kernels = warmed_kernels(context, &a);
                let data = DeviceAllocation::zeroed(context, N * 4).unwrap();
                barrier.wait();
                let mut last_b: Option<OwnedPooledEvent> = None;
                for _ in 0..ROUNDS {
                    if let Some(event) = last_b.take() {
                        a.wait_event(&event).unwrap();
                    }
                    // SAFETY: `data` holds N u32s and outlives both streams' work (synchronized
                    // below before it drops).
                    unsafe { kernels.increment_u32(&a, data.ptr(), N) }.unwrap();
                    let hop = pool.acquire_owned(false).unwrap();
                    hop.record(&a).unwrap();
                    b.wait_event(&hop).unwrap();
                    drop(hop);
                    // SAFETY: as above.
                    unsafe { kernels.increment_u32(&b, data.ptr(), N) }.unwrap();
                    let back = pool.acquire_owned(false).unwrap();
                    back.record(&b).unwrap();
                    last_b = Some(back);
                }
                drop(last_b);
                a.synchronize().unwrap();
                let counts = read_u32(context, data.ptr(), N, &b);
                if let Some(i) = counts.iter().position(|&x| x != 2 * ROUNDS as u32) {
                    panic!(
                        "thread {thread}: element {i} was incremented {} times, not {}: two \
                         hops overlapped",
                        counts[i],
                        2 * ROUNDS
                    );
                }
                finished.fetch_add(1, Ordering::Relaxed);
            });
        }
    });
    assert_eq!(finished.load(Ordering::Relaxed), THREADS as u32);
    let utilization = pool.utilization();
    assert_eq!(utilization.in_use, 0, "{utilization:?}");
    let counters = pool.counters();
    assert!(
        counters.created_regular <= 16 * THREADS as u64,
        "{} acquisitions created {} events: {counters:?}",
        2 * THREADS * ROUNDS,
        counters.created_regular
    );
    assert_eq!(counters.created_timing + counters.created_blocking, 0);
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

/// cudarc's `CudaFunction::set_attribute` / CUDA C++'s `cudaFuncSetAttribute`: the shared
/// memory carveout is set and read back, an out-of-range carveout and a read-only attribute
/// are typed errors rather than panics, and the kernel still launches and writes exactly.
#[test]
fn kernel_attributes_read_back_and_refused_settings_are_typed_errors() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let stream = non_blocking(context);
    // A module of this test's own: the attributes belong to its functions alone.
    let kernels = warmed_kernels(context, &stream);
    let fill = kernels.module().function("fill_u32").unwrap();
    use sys::CUfunction_attribute as A;
    let max_threads = fill
        .attribute(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
        .unwrap();
    assert!((1..=1024).contains(&max_threads), "{max_threads}");
    let registers = fill.attribute(A::CU_FUNC_ATTRIBUTE_NUM_REGS).unwrap();
    assert!((1..=255).contains(&registers), "{registers} registers");

    fill.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 50)
        .unwrap();
    assert_eq!(
        fill.attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)
            .unwrap(),
        50
    );
    // A kernel looked up again by name is the same function and sees the setting.
    let again = kernels.module().function("fill_u32").unwrap();
    assert_eq!(
        again
            .attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)
            .unwrap(),
        50
    );
    match fill.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 101) {
        Err(DriverError::Cuda { .. }) => {}
        other => panic!("a carveout of 101 % gave {other:?}"),
    }
    match fill.set_attribute(A::CU_FUNC_ATTRIBUTE_NUM_REGS, registers + 1) {
        Err(DriverError::Cuda { .. }) => {}
        other => panic!("setting the read-only register count gave {other:?}"),
    }
    assert_eq!(
        fill.attribute(A::CU_FUNC_ATTRIBUTE_NUM_REGS).unwrap(),
        registers
    );

    const N: usize = 100_003;
    let out = DeviceAllocation::zeroed(context, N * 4).unwrap();
    // SAFETY: `out` holds N u32s and outlives the kernel (read after a synchronize).
    unsafe { kernels.fill_u32(&stream, out.ptr(), 0x5A5A_0001, N) }.unwrap();
    assert_eq!(
        read_u32(context, out.ptr(), N, &stream),
        vec![0x5A5A_0001; N]
    );
}

// ---------------------------------------------------------------------------------------------
// Two devices
// ---------------------------------------------------------------------------------------------

/// With two GPUs: a kernel, an event record, a graph launch and a stream-ordered allocation
/// of device 0 aimed at a stream of device 1 are typed errors before reaching the driver,
/// while a stream of device 0 waiting on an event of device 1 is legal and really waits (a
/// store that device 1's kernel makes after a spin is visible once device 0's stream is done).
#[test]
fn device_zero_work_on_device_one_streams_is_refused_and_cross_device_event_waits_order() {
    let gpu = require_gpu!();
    let devices = Device::count().unwrap();
    if devices < 2 {
        cuweave_test_support::skip(
            "device_zero_work_on_device_one_streams_is_refused_and_cross_device_event_waits_order",
            &format!("needs two GPUs, this machine has {devices}"),
        );
        return;
    }
    let _serial = serial();
    let zero = &gpu.context;
    let one = Context::primary(Device::get(1).unwrap()).unwrap();
    let stream0 = non_blocking(zero);
    let stream1 = non_blocking(&one);
    let kernels0 = warmed_kernels(zero, &stream0);
    let kernels1 = warmed_kernels(&one, &stream1);
    let out0 = DeviceAllocation::zeroed(zero, 4 * 256).unwrap();

    // SAFETY: refused before the driver sees it; `out0` would outlive the kernel anyway.
    assert_invalid(
        unsafe { kernels0.fill_u32(&stream1, out0.ptr(), 1, 256) },
        "a device 0 kernel on a device 1 stream",
    );
    let event0 = Event::new(zero, EventFlags::DISABLE_TIMING).unwrap();
    assert_invalid(
        event0.record(&stream1),
        "a device 0 event recorded on a device 1 stream",
    );
    stream0.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: `out0` holds 256 u32s and outlives the graph's launches.
    unsafe { kernels0.fill_u32(&stream0, out0.ptr(), 3, 256) }.unwrap();
    let exec = stream0
        .end_capture()
        .unwrap()
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    assert_invalid(
        exec.launch(&stream1),
        "a device 0 graph launched on a device 1 stream",
    );
    assert_eq!(exec.launch_count(), 0);
    exec.launch(&stream0).unwrap();
    assert_eq!(read_u32(zero, out0.ptr(), 256, &stream0), vec![3; 256]);

    // Device 1 stores after a 20 ms spin; device 0's stream waits on its event.
    let flags = HostFlags::new(&one, 2);
    // SAFETY: the word is mapped pinned memory of device 1's context that outlives the kernel
    // (both streams are synchronized before `flags` drops).
    unsafe { kernels1.spin_then_store_u32(&stream1, 20 * MS, flags.device(0), 7) }.unwrap();
    let event1 = Event::new(&one, EventFlags::DISABLE_TIMING).unwrap();
    event1.record(&stream1).unwrap();
    stream0.wait_event(&event1).unwrap();
    let done = Event::new(zero, EventFlags::DISABLE_TIMING).unwrap();
    done.record(&stream0).unwrap();
    done.synchronize().unwrap();
    assert_eq!(
        flags.read(0),
        7,
        "device 0's stream finished before the device 1 work it waited on"
    );
    stream1.synchronize().unwrap();
}
