//! Third round of whole programs through the facade (`cuweave::prelude` first, a layer's module
//! where the prelude stops): a 10^4-step training loop whose activations are read by a side
//! stream before they drop (PyTorch's `record_stream` pattern) with the caching allocator's books
//! bounded; two captured steps sharing one graph pool (`torch.cuda.graph_pool_handle()`) replayed
//! alternately without clobbering each other's static outputs; a data-loader thread whose uploads
//! order raw kernels only through pooled events; request threads sharing a load-balanced pool
//! and awaiting pooled events; capture misuse, out-of-range views and wrong devices answered with
//! typed errors; and what such programs name, reached from the prelude or the crate root.
//!
//! Every GPU test takes `serial()`: one captures graphs, others read allocator books or rely on
//! slow kernels.

mod common;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cuweave::driver::GraphError;
use cuweave::memory::caching::GraphPool;
use cuweave::prelude::*;
use cuweave_test_support::{poll_until, require_gpu, sanitizer_active, serial};

use common::{MS, Ops, words};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Whether the byte ranges `[a, a + a_len)` and `[b, b + b_len)` overlap.
fn overlaps(a: u64, a_len: usize, b: u64, b_len: usize) -> bool {
    a < b + b_len as u64 && b < a + a_len as u64
}

/// Asserts every word of `actual` is `expected[i] + added` (wrapping), naming the first that is
/// not.
fn assert_words(actual: &[u32], expected: &[u32], added: u32, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    if let Some(i) = (0..actual.len()).find(|&i| actual[i] != expected[i].wrapping_add(added)) {
        panic!(
            "{what}: element {i} is {:#x}, expected {:#x}",
            actual[i],
            expected[i].wrapping_add(added)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

/// PyTorch's eager loop with a side stream (`tensor.record_stream(side)`), 10^4 steps: each
/// step allocates an activation on the compute stream from the program's caching allocator,
/// fills it with the step number and increments it with a kernel; a side stream (held back by a
/// slow kernel every 64 steps) copies the activation's last element into slot `step` of a
/// snapshot buffer; the activation drops at once. A block reused before the side copy read it
/// would put a later step's value into the slot. Checks: every slot is exactly `step + 1`, the
/// allocator's reserved memory and pending frees stay bounded over the loop and settle to zero
/// pending once the side stream is idle, nothing stays allocated, and the snapshot buffer's 10^4
/// disjoint tracked writes stay a bounded number of tracked uses.
#[test]
fn ten_thousand_steps_read_on_a_side_stream_before_drop_stay_exact_and_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    let steps: usize = if sanitizer_active() { 300 } else { 10_000 };
    const LEN: usize = 1024;
    const MIB: usize = 1 << 20;
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let compute = pool.get_priority_stream(StreamPriority::Normal).unwrap();
    let side = pool.get_priority_stream(StreamPriority::High).unwrap();
    assert_ne!(compute.id(), side.id());
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let mut snap = DeviceBuffer::<u32>::zeroed(&gpu.context, steps).unwrap();
    let before = compute.metrics().unwrap();

    let mut max_reserved = 0usize;
    let mut max_pending = 0usize;
    for step in 0..steps {
        let mut activation = allocator.buffer::<u32>(LEN, compute.stream()).unwrap();
        compute.fill(&mut activation, step as u32).unwrap();
        ops.increment(&compute, &mut activation).unwrap();
        if step % 64 == 0 {
            ops.spin(&side, MS / 10);
        }
        {
            let mut slot = snap.slice_mut(step..step + 1).unwrap();
            let last = activation.slice(LEN - 1..).unwrap();
            side.copy_buffer(&mut slot, &last).unwrap();
        }
        drop(activation);
        if step % 256 == 0 {
            let books = allocator.stats();
            max_reserved = max_reserved.max(books.reserved_bytes.current);
            max_pending = max_pending.max(allocator.pending_frees());
            assert!(
                books.reserved_bytes.current <= 8 * MIB,
                "step {step}: 4 KiB activations reserved {} bytes: blocks read on the side \
                 stream never come back",
                books.reserved_bytes.current
            );
            assert!(
                snap.tracked_uses() <= 64,
                "step {step}: the snapshot buffer tracks {} uses",
                snap.tracked_uses()
            );
        }
    }
    side.synchronize().unwrap();
    compute.synchronize().unwrap();
    assert!(
        max_pending <= 2048,
        "pending frees reached {max_pending}: finished side reads are not settled"
    );
    // The next allocation on the compute stream settles its finished pending frees.
    let settle = allocator.buffer::<u32>(LEN, compute.stream()).unwrap();
    assert_eq!(
        allocator.pending_frees(),
        0,
        "every side read has finished, yet blocks stay pending:\n{}",
        allocator.snapshot()
    );
    drop(settle);
    let slots = snap.to_vec().unwrap();
    if let Some(step) = (0..steps).find(|&s| slots[s] != s as u32 + 1) {
        panic!(
            "slot {step} is {}, expected {}: the side copy read a reused block (or ran before \
             the increment)",
            slots[step],
            step + 1
        );
    }
    let after = compute.metrics().unwrap();
    assert_eq!(after.kernel_launches - before.kernel_launches, steps as u64);
    assert_eq!(after.memsets - before.memsets, steps as u64);
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
    eprintln!("max reserved {max_reserved} bytes, max pending {max_pending} blocks");
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.stats().reserved_bytes.current, 0);
}

/// `torch.cuda.graph(pool=graph_pool_handle())` for two graphs that never replay concurrently:
/// step A (`out_a = x + 1`) and step B (`out_b = x + 2`) are captured one after the other on
/// one pool stream into one shared private pool, each through a temporary that drops inside
/// its capture while its static output, allocated inside the capture, is kept by the program.
/// Replayed alternately 300 times on fresh inputs, every output is exact: B's temporary never
/// lands on A's live output. Eager allocations made while the graphs live never get the pool's
/// memory, replays allocate nothing, and once the graphs and outputs drop, `empty_cache` gives
/// every byte back.
#[test]
fn two_graphs_sharing_one_private_pool_replay_alternately_without_clobbering_outputs() {
    let gpu = require_gpu!();
    let _serial = serial();
    let replays: usize = if sanitizer_active() { 10 } else { 300 };
    const LEN: usize = 1 << 16;
    let bytes = 4 * LEN;
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let s = stream.stream();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let shared = GraphPool::new();
    let mut x = allocator.buffer::<u32>(LEN, s).unwrap();
    stream.fill(&mut x, 0).unwrap();
    s.synchronize().unwrap();

    let capture = stream
        .begin_capture(CaptureOptions::default().with_pool(&shared))
        .unwrap();
    let mut tmp = allocator.buffer::<u32>(LEN, s).unwrap();
    stream.copy_buffer(&mut tmp, &x).unwrap();
    ops.increment(&stream, &mut tmp).unwrap();
    let mut out_a = allocator.buffer::<u32>(LEN, s).unwrap();
    stream.copy_buffer(&mut out_a, &tmp).unwrap();
    let tmp_a = tmp.device_ptr();
    drop(tmp);
    let graph_a = capture.finish().unwrap();

    let capture = stream
        .begin_capture(CaptureOptions::default().with_pool(&shared))
        .unwrap();
    let mut tmp = allocator.buffer::<u32>(LEN, s).unwrap();
    stream.copy_buffer(&mut tmp, &x).unwrap();
    ops.increment(&stream, &mut tmp).unwrap();
    ops.increment(&stream, &mut tmp).unwrap();
    let mut out_b = allocator.buffer::<u32>(LEN, s).unwrap();
    stream.copy_buffer(&mut out_b, &tmp).unwrap();
    let tmp_b = tmp.device_ptr();
    drop(tmp);
    let graph_b = capture.finish().unwrap();

    for (what, ptr) in [("B's temporary", tmp_b), ("B's output", out_b.device_ptr())] {
        assert!(
            !overlaps(ptr, bytes, out_a.device_ptr(), bytes),
            "{what} at {ptr:#x} overlaps A's live output at {:#x}",
            out_a.device_ptr()
        );
    }
    let exec_a = graph_a.instantiate(&InstantiateOptions::default()).unwrap();
    let exec_b = graph_b.instantiate(&InstantiateOptions::default()).unwrap();
    let eager = allocator.buffer::<u32>(LEN, s).unwrap();
    for (what, ptr) in [
        ("A's temporary", tmp_a),
        ("B's temporary", tmp_b),
        ("A's output", out_a.device_ptr()),
        ("B's output", out_b.device_ptr()),
    ] {
        assert!(
            !overlaps(eager.device_ptr(), bytes, ptr, bytes),
            "an eager buffer got the graph pool's memory ({what})"
        );
    }
    drop(eager);
    let books = allocator.stats();

    for replay in 0..replays {
        let input = words(LEN, replay as u64);
        let upload = stream.copy_from_host(&mut x, input).unwrap();
        stream.launch_graph(&exec_a).unwrap();
        stream.launch_graph(&exec_b).unwrap();
        let a = stream.copy_to_host(&out_a, vec![0u32; LEN]).unwrap();
        let b = stream.copy_to_host(&out_b, vec![0u32; LEN]).unwrap();
        let input = upload.wait().unwrap();
        assert_words(
            &a.wait().unwrap(),
            &input,
            1,
            &format!("replay {replay}: A"),
        );
        assert_words(
            &b.wait().unwrap(),
            &input,
            2,
            &format!("replay {replay}: B"),
        );
    }
    assert_eq!(
        allocator.stats().allocations,
        books.allocations,
        "a replay allocated"
    );
    assert_eq!(
        (exec_a.launch_count(), exec_b.launch_count()),
        (replays as u64, replays as u64)
    );

    drop((exec_a, exec_b, graph_a, graph_b, out_a, out_b, x));
    drop(shared);
    s.synchronize().unwrap();
    let returned = poll_until(Duration::from_secs(10), || {
        allocator.empty_cache().is_ok() && allocator.stats().reserved_bytes.current == 0
    });
    assert!(
        returned,
        "with both graphs and their outputs gone, the shared pool still holds memory:\n{}",
        allocator.snapshot()
    );
}

/// A static output kept after its graph is deleted (`out = g_out; del g`, as PyTorch programs
/// do when a captured warm-up or a per-shape graph is thrown away): step `out = x + 1` is
/// captured into a fresh private pool (its temporary dropped inside the capture, its output
/// allocated there), replayed once, and its graph and executable dropped. The output lives on
/// in the dead pool's memory. A second capture on a new pool and 64 eager buffers, all filled
/// with other bytes, must get memory elsewhere, and the output still reads `x + 1`; once it
/// drops too, `empty_cache` gives every byte back.
#[test]
fn a_static_output_kept_after_its_graph_is_dropped_is_never_handed_out_again() {
    let gpu = require_gpu!();
    let _serial = serial();
    const LEN: usize = 1 << 16;
    let bytes = 4 * LEN;
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let s = stream.stream();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let input = words(LEN, 21);
    let mut x = allocator.buffer::<u32>(LEN, s).unwrap();
    x.copy_from_host(&input).unwrap();
    s.synchronize().unwrap();

    let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
    let mut tmp = allocator.buffer::<u32>(LEN, s).unwrap();
    stream.copy_buffer(&mut tmp, &x).unwrap();
    ops.increment(&stream, &mut tmp).unwrap();
    let mut out = allocator.buffer::<u32>(LEN, s).unwrap();
    stream.copy_buffer(&mut out, &tmp).unwrap();
    drop(tmp);
    let graph = capture.finish().unwrap();
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    stream.launch_graph(&exec).unwrap();
    stream.synchronize().unwrap();
    drop((exec, graph));
    gpu.context.synchronize().unwrap();
    out.synchronize().unwrap();
    assert_words(
        &out.to_vec().unwrap(),
        &input,
        1,
        "the output after its graph died",
    );
    let kept = out.device_ptr();

    let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
    let mut scratch = allocator.buffer::<u32>(LEN, s).unwrap();
    stream.fill(&mut scratch, 0xDEAD_0000).unwrap();
    let mut other = allocator.buffer::<u32>(LEN, s).unwrap();
    stream.copy_buffer(&mut other, &scratch).unwrap();
    let scratch_at = scratch.device_ptr();
    drop(scratch);
    let second = capture.finish().unwrap();
    for (what, ptr) in [
        ("its scratch", scratch_at),
        ("its output", other.device_ptr()),
    ] {
        assert!(
            !overlaps(ptr, bytes, kept, bytes),
            "a second capture's {what} at {ptr:#x} landed on the kept output at {kept:#x}"
        );
    }
    let second_exec = second.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        stream.launch_graph(&second_exec).unwrap();
    }
    let mut eager = Vec::new();
    for i in 0..64u32 {
        let mut buffer = allocator.buffer::<u32>(LEN, s).unwrap();
        assert!(
            !overlaps(buffer.device_ptr(), bytes, kept, bytes),
            "eager buffer {i} landed on the kept output"
        );
        stream.fill(&mut buffer, 0xBEEF_0000 + i).unwrap();
        eager.push(buffer);
    }
    stream.synchronize().unwrap();
    out.synchronize().unwrap();
    assert_words(
        &out.to_vec().unwrap(),
        &input,
        1,
        "the kept output after other work",
    );
    other.synchronize().unwrap();
    assert!(other.to_vec().unwrap().iter().all(|&v| v == 0xDEAD_0000));

    drop((second_exec, second, other, eager, out, x));
    gpu.context.synchronize().unwrap();
    let returned = poll_until(Duration::from_secs(10), || {
        allocator.empty_cache().is_ok() && allocator.stats().reserved_bytes.current == 0
    });
    assert!(
        returned,
        "with every graph and buffer gone, memory is still reserved:\n{}",
        allocator.snapshot()
    );
}

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

/// A cudarc-style data loader: a loader thread uploads pageable batches into a ring of two
/// device buffers on its own pool stream (behind a slow kernel), records a pooled event after
/// each upload and sends buffer, event and pending copy to the training thread, which makes its
/// compute stream wait on the event and increments the batch with a *raw* kernel launch (no
/// buffer tracking), then downloads it on the same stream and hands the buffer back. Only the
/// event orders the raw kernel after the upload, so a lost wait shows as a result that is not
/// the batch plus one. The context's event pool stops creating events after warm-up.
#[test]
fn a_loader_thread_orders_raw_kernels_by_pooled_events_over_a_ring_of_buffers() {
    let gpu = require_gpu!();
    let _serial = serial();
    let steps: usize = if sanitizer_active() { 10 } else { 200 };
    const LEN: usize = 1 << 16;
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let loader = pool.get_priority_stream(StreamPriority::High).unwrap();
    let compute = pool.get_stream_for_workload(WorkloadType::Compute).unwrap();
    let events = EventPool::for_context(&gpu.context).unwrap();
    type Loaded = (
        usize,
        DeviceBuffer<u32>,
        OwnedPooledEvent,
        PendingCopy<Vec<u32>>,
    );
    let (to_compute, batches) = mpsc::sync_channel::<Loaded>(1);
    let (to_loader, empties) = mpsc::channel::<DeviceBuffer<u32>>();
    for _ in 0..2 {
        to_loader
            .send(DeviceBuffer::<u32>::new_on(loader.stream(), LEN).unwrap())
            .unwrap();
    }
    let mut warm_created = None;

    std::thread::scope(|scope| {
        let (ops, loader, events) = (&ops, &loader, &events);
        scope.spawn(move || {
            for step in 0..steps {
                let Ok(mut slot) = empties.recv() else { return };
                ops.spin(loader, MS / 2);
                let pending = loader
                    .copy_from_host(&mut slot, words(LEN, step as u64))
                    .unwrap();
                let uploaded = events.acquire_owned(false).unwrap();
                uploaded.record(loader.stream()).unwrap();
                if to_compute.send((step, slot, uploaded, pending)).is_err() {
                    return;
                }
            }
        });

        for step in 0..steps {
            let (loaded, slot, uploaded, pending) = batches.recv().unwrap();
            assert_eq!(loaded, step);
            compute.stream().wait_event(&uploaded).unwrap();
            compute.note_queued_wait();
            compute
                .launch(|raw| {
                    // SAFETY: `slot` holds LEN u32s of this context and is not dropped or
                    // handed back before the download queued after this kernel on the same
                    // stream has been waited for.
                    unsafe { ops.test.increment_u32(raw, slot.device_ptr(), LEN) }
                })
                .unwrap();
            drop(uploaded);
            let result = compute
                .copy_to_host(&slot, vec![0u32; LEN])
                .unwrap()
                .wait()
                .unwrap();
            let batch = pending.wait().unwrap();
            assert_words(&result, &batch, 1, &format!("step {step}"));
            let _ = to_loader.send(slot);
            let counters = events.counters();
            let created =
                counters.created_regular + counters.created_timing + counters.created_blocking;
            match warm_created {
                None if step == 8 => warm_created = Some(created),
                Some(warm) => assert!(
                    created <= warm + 64,
                    "step {step}: the event pool made {created} events, {warm} after warm-up"
                ),
                None => {}
            }
        }
        drop(to_loader);
    });
}

// ---------------------------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------------------------

/// An inference server with more handler threads (12) than pool streams (8), each request
/// taking whatever stream a load-balanced pool hands out (so threads share streams at once):
/// a buffer on that stream from the default allocator, an owned upload of the request, a slow
/// kernel and an increment, an owned download, then a pooled event recorded behind it and
/// `.await`ed through the global waiter. Every reply is exact, and afterwards every pool stream
/// reports no outstanding work and the waiter nothing pending.
#[test]
fn request_threads_sharing_a_load_balanced_pool_await_pooled_events_and_leave_nothing_behind() {
    let gpu = require_gpu!();
    let _serial = serial();
    const THREADS: usize = 12;
    let requests: usize = if sanitizer_active() { 2 } else { 16 };
    let lens = [3usize, 1000, 4099, 1 << 15, (1 << 17) + 1];
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(
        &gpu.context,
        StreamPoolConfig::with_strategy(AllocationStrategy::LoadBalanced),
    )
    .unwrap();
    let waiter = AsyncEventWaiter::global().unwrap();

    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (ops, pool) = (&ops, &pool);
            scope.spawn(move || {
                futures::executor::block_on(async move {
                    for r in 0..requests {
                        let stream = pool.get_stream().unwrap();
                        let len = lens[(t + r) % lens.len()];
                        let request = words(len, (t * 1000 + r) as u64);
                        let mut buffer = DeviceBuffer::<u32>::new_on(stream.stream(), len).unwrap();
                        let upload = stream.copy_from_host(&mut buffer, request).unwrap();
                        ops.spin(&stream, MS / 4);
                        ops.increment(&stream, &mut buffer).unwrap();
                        let download = stream.copy_to_host(&buffer, vec![0u32; len]).unwrap();
                        let done = stream.event_pool().acquire_owned(false).unwrap();
                        done.record(stream.stream()).unwrap();
                        waiter.event_done(done).await.unwrap();
                        let request = upload.wait().unwrap();
                        let reply = download.wait().unwrap();
                        assert_words(
                            &reply,
                            &request,
                            1,
                            &format!("thread {t} request {r} ({len} u32s)"),
                        );
                    }
                });
            });
        }
    });

    for stream in pool.streams() {
        let idle = poll_until(Duration::from_secs(10), || {
            stream.outstanding_work().unwrap() == 0
        });
        assert!(
            idle,
            "stream {} reports {} outstanding operations after every request finished",
            stream.id(),
            stream.outstanding_work().unwrap()
        );
    }
    let launches: u64 = pool
        .streams()
        .map(|stream| stream.metrics().unwrap().kernel_launches)
        .sum();
    assert_eq!(launches, 2 * (THREADS * requests) as u64);
    assert!(
        poll_until(Duration::from_secs(10), || waiter.pending() == 0),
        "the waiter still has {} pending waits",
        waiter.pending()
    );
}

// ---------------------------------------------------------------------------------------------
// Error paths
// ---------------------------------------------------------------------------------------------

/// Mistakes a first CUDA-graph program makes, through the facade: synchronising the capturing
/// stream, beginning a second capture on it, uploading a pageable `Vec` into it, emptying the
/// allocator's cache and reading a buffer back with a blocking copy, all while capturing. Each
/// is a typed refusal (the `Vec` handed back) or, for the read, a correct result; none may break
/// the capture, which still finishes and replays exactly. A fork that did work and never joined
/// is `UnjoinedFork`, after which both streams work eagerly again.
#[test]
fn capture_misuse_is_refused_with_typed_errors_and_the_capture_still_replays() {
    let gpu = require_gpu!();
    let _serial = serial();
    const LEN: usize = 4096;
    let ops = Ops::load(&gpu.context);
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let [stream, other] = {
        let normal = pool.streams_of(StreamPriority::Normal);
        [normal[0].clone(), normal[1].clone()]
    };
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let mut x = allocator.buffer::<u32>(LEN, stream.stream()).unwrap();
    stream.fill(&mut x, 0).unwrap();
    stream.synchronize().unwrap();

    let capture = stream.begin_capture(CaptureOptions::default()).unwrap();
    let error = stream.synchronize().unwrap_err();
    assert!(
        error.is_capture_refusal(),
        "synchronize while capturing: {error:?}"
    );
    match stream.begin_capture(CaptureOptions::default()) {
        Err(error) => assert!(
            matches!(
                error.graph_error(),
                Some(GraphError::AlreadyCapturing { .. })
            ),
            "a second capture on a capturing stream: {error:?}"
        ),
        Ok(_) => panic!("a second capture began on a capturing stream"),
    }
    let batch = words(LEN, 5);
    match stream.copy_from_host(&mut x, batch.clone()) {
        Err(refusal) => {
            let (error, host) = cuweave::memory::split_host_refusal::<u32, Vec<u32>, _>(refusal);
            assert!(
                matches!(
                    error,
                    StreamError::Memory(MemoryError::NotCapturable { .. })
                ),
                "a pageable upload into a capture: {error:?}"
            );
            assert_eq!(host, Some(batch), "the refused Vec is handed back");
        }
        Ok(_) => panic!("a pageable upload was recorded into a capture"),
    }
    let error = allocator.empty_cache().unwrap_err();
    assert!(
        error.is_capture_refusal(),
        "empty_cache while capturing: {error:?}"
    );
    match x.to_vec() {
        Ok(values) => assert!(values.iter().all(|&v| v == 0)),
        Err(error) => assert!(
            error.is_capture_refusal(),
            "a blocking read while capturing failed with something else: {error:?}"
        ),
    }
    ops.increment(&stream, &mut x).unwrap();
    let graph = capture
        .finish()
        .expect("the refused calls must leave the capture intact");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..100 {
        stream.launch_graph(&exec).unwrap();
    }
    stream.synchronize().unwrap();
    x.synchronize().unwrap();
    assert!(
        x.to_vec().unwrap().iter().all(|&v| v == 100),
        "100 replays of one captured increment"
    );

    // A fork that queued nothing needs no join (the driver ends such a capture), so the side
    // stream does work, as a real fork would, and never joins back.
    let mut capture = stream.begin_capture(CaptureOptions::default()).unwrap();
    capture.fork(other.stream()).unwrap();
    ops.spin(&other, 1_000);
    assert_eq!(capture.unjoined(), vec![other.stream().id()]);
    match capture.finish() {
        Err(error) => assert!(
            matches!(error.graph_error(), Some(GraphError::UnjoinedFork)),
            "a capture with an unjoined fork: {error:?}"
        ),
        Ok(_) => panic!("a capture with an unjoined fork finished"),
    }
    let mut y = allocator.buffer::<u32>(LEN, other.stream()).unwrap();
    other.fill(&mut y, 7).unwrap();
    other.synchronize().unwrap();
    stream.fill(&mut x, 9).unwrap();
    stream.synchronize().unwrap();
    assert!(y.to_vec().unwrap().iter().all(|&v| v == 7));
    assert!(x.to_vec().unwrap().iter().all(|&v| v == 9));
}

/// A tokenizer writing ragged sequences into one flat buffer: views nested two deep
/// (`buffer.slice_mut(100..900)?.slice_mut(50..60)?`) land exactly where their offsets say;
/// ranges that are empty, reversed, past the end of the buffer or of the outer view, or that
/// overflow are typed errors naming their capacity; a read-only view (or a writable view taken
/// from a copy of one) refuses writes; copies of mismatched lengths and transfers past the end
/// are typed errors of the stream and transfer layers. Nothing panics, and nothing of the
/// buffer changes but what the nested view wrote.
#[test]
fn nested_and_out_of_range_views_are_exact_or_typed_errors_through_every_layer() {
    let gpu = require_gpu!();
    let _serial = serial();
    const LEN: usize = 1000;
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream().unwrap();
    let manager = TransferManager::new().unwrap();
    let initial = words(LEN, 11);
    let mut buffer = DeviceBuffer::from_slice(&gpu.context, &initial).unwrap();

    {
        let mut outer = buffer.slice_mut(100..900).unwrap();
        assert_eq!(outer.len(), 800);
        match outer.slice(790..810) {
            Err(MemoryError::OutOfRange { capacity, .. }) => assert_eq!(capacity, 800),
            other => panic!("a range past the outer view's end: {other:?}"),
        }
        let mut inner = outer.slice_mut(50..60).unwrap();
        stream.fill(&mut inner, 0xABCD).unwrap();
    }
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = buffer.slice(5..3);
    assert!(matches!(reversed, Err(MemoryError::OutOfRange { .. })));
    assert!(matches!(
        buffer.slice(4..4),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        buffer.slice(..=LEN),
        Err(MemoryError::OutOfRange { capacity: LEN, .. })
    ));
    assert!(matches!(
        buffer.slice(usize::MAX..),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        buffer.slice(..=usize::MAX),
        Err(MemoryError::OutOfRange { .. })
    ));

    let mut shared = buffer.slice(..).unwrap();
    match stream.fill(&mut shared, 1) {
        Err(StreamError::Memory(MemoryError::ReadOnlyView { .. })) => {}
        other => panic!("a fill through a read-only view: {other:?}"),
    }
    let mut upgraded = shared.slice_mut(0..10).unwrap();
    match stream.fill(&mut upgraded, 1) {
        Err(StreamError::Memory(MemoryError::ReadOnlyView { .. })) => {}
        other => panic!("a fill through a writable view of a read-only view: {other:?}"),
    }

    let mut short = DeviceBuffer::<u32>::new_on(stream.stream(), 10).unwrap();
    match stream.copy_buffer(&mut short, &buffer.slice(0..12).unwrap()) {
        Err(StreamError::Memory(MemoryError::SizeMismatch { .. })) => {}
        other => panic!("a copy of 12 elements into 10: {other:?}"),
    }
    let host = vec![1u32; 8];
    match manager.upload_async(&host, &mut short, 5) {
        Err(TransferError::OutOfRange { .. }) => {}
        Err(other) => panic!("an upload past the end: {other:?}"),
        Ok(_) => panic!("an upload of 8 elements at offset 5 of 10 was accepted"),
    }
    match manager.upload_async(&host, &mut short, usize::MAX) {
        Err(TransferError::OutOfRange { .. }) => {}
        Err(other) => panic!("an upload at an overflowing offset: {other:?}"),
        Ok(_) => panic!("an upload at offset usize::MAX was accepted"),
    }
    stream.synchronize().unwrap();

    let mut expected = initial.clone();
    expected[150..160].fill(0xABCD);
    assert_eq!(
        buffer.to_vec().unwrap(),
        expected,
        "only elements 150..160 may change"
    );
}

/// A two-GPU program's mistakes: a buffer of device 1 used on a pool stream of device 0 (fill,
/// copy, kernel-free upload) is `WrongDevice` from the stream layer naming both devices, and the
/// buffer's bytes are untouched. Skips on a one-GPU machine.
#[test]
fn buffers_of_another_device_on_a_pool_stream_are_wrong_device_errors() {
    let gpu = require_gpu!();
    let _serial = serial();
    let count = Device::count().unwrap();
    if count < 2 {
        cuweave_test_support::skip(
            "buffers_of_another_device_on_a_pool_stream_are_wrong_device_errors",
            "needs two GPUs",
        );
        return;
    }
    let pool = StreamPool::new(&gpu.context, StreamPoolConfig::default()).unwrap();
    let stream = pool.get_stream().unwrap();
    let other = Context::primary(Device::get(1).unwrap()).unwrap();
    let values = words(4096, 3);
    let mut foreign = DeviceBuffer::from_slice(&other, &values).unwrap();
    let mut local = DeviceBuffer::<u32>::new_on(stream.stream(), 4096).unwrap();
    match stream.fill(&mut foreign, 0) {
        Err(StreamError::WrongDevice { .. }) => {}
        other => panic!("a fill of device 1's buffer on device 0's stream: {other:?}"),
    }
    match stream.copy_buffer(&mut local, &foreign) {
        Err(StreamError::WrongDevice { .. }) => {}
        other => panic!("a copy from device 1 on device 0's stream: {other:?}"),
    }
    match stream.copy_from_host(&mut foreign, vec![0u32; 4096]) {
        Err(refusal) => {
            let (error, host) = cuweave::memory::split_host_refusal::<u32, Vec<u32>, _>(refusal);
            assert!(
                matches!(error, StreamError::WrongDevice { .. }),
                "an upload into device 1's buffer on device 0's stream: {error:?}"
            );
            assert!(host.is_some(), "the refused Vec is handed back");
        }
        Ok(_) => panic!("an upload into another device's buffer was queued"),
    }
    assert_eq!(foreign.to_vec().unwrap(), values);
}

// ---------------------------------------------------------------------------------------------
// Without a GPU
// ---------------------------------------------------------------------------------------------

/// The setup of a program that shares one graph pool between captures and tunes its allocator
/// from `PYTORCH_CUDA_ALLOC_CONF`-style text: the graph pool handle, the capture options that
/// take it, the allocator configuration and its typed refusals, all through the facade and with
/// no device. Options PyTorch has and cuweave does not are refused by name, never ignored;
/// values out of range (a split size at or under the 20 MiB floor, a fraction that is NaN,
/// zero or above one, a size that overflows) are `InvalidConfig`.
#[test]
fn allocator_configuration_and_graph_pool_handles_work_through_the_facade_without_a_device() {
    let first = GraphPool::new();
    let second = cuweave::memory::caching::graph_pool_handle();
    assert_ne!(first.id(), second.id(), "two handles name two pools");
    let options = CaptureOptions::default().with_pool(&first);
    assert_eq!(options.pool.as_ref().map(GraphPool::id), Some(first.id()));
    assert_eq!(options.mode, CaptureMode::ThreadLocal);

    let parsed: AllocatorConfig = "max_split_size_mb:64, memory_fraction:0.5".parse().unwrap();
    assert_eq!(
        parsed,
        AllocatorConfig::default()
            .with_max_split_size(64 << 20)
            .with_memory_fraction(0.5)
    );
    for (text, option) in [
        ("expandable_segments:True", "expandable_segments"),
        (
            "garbage_collection_threshold:0.6",
            "garbage_collection_threshold",
        ),
        ("max_split_size_mb:20", "max_split_size"),
        ("max_split_size_mb:0", "max_split_size"),
        ("max_split_size_mb:-1", "max_split_size_mb"),
        (
            "max_split_size_mb:18446744073709551615",
            "max_split_size_mb",
        ),
        ("memory_fraction:NaN", "memory_fraction"),
        ("memory_fraction:0", "memory_fraction"),
        ("memory_fraction:1.5", "memory_fraction"),
        ("memory_fraction:inf", "memory_fraction"),
        ("no_such_option:1", "no_such_option"),
    ] {
        match text.parse::<AllocatorConfig>() {
            Err(MemoryError::InvalidConfig { option: named, .. }) => {
                assert_eq!(named, option, "{text:?} refused under another name")
            }
            other => panic!("{text:?} should be InvalidConfig naming {option}: {other:?}"),
        }
    }
    // The types such a program names, through the facade.
    let names = [
        std::any::type_name::<GraphPool>(),
        std::any::type_name::<GraphError>(),
        std::any::type_name::<cuweave::memory::BufferSlice<'static, u32>>(),
        std::any::type_name::<cuweave::memory::BlockStatus>(),
        std::any::type_name::<cuweave::memory::HostCopyError<Vec<u32>>>(),
        std::any::type_name::<cuweave::event::PoolCounters>(),
    ];
    for name in names {
        assert!(name.starts_with("cuweave_"), "{name} is not a cuweave type");
    }
    drop(Arc::new(first));
}
