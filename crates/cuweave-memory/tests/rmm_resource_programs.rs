//! Programs written the way RMM users compose memory resources, aimed at the resources' newest
//! code: typed buffers on adaptor stacks freed beside a capture on another thread (at once, as
//! eager drops are, on the buffer's home stream behind every use), stream-ordered
//! frees across streams and threads, `device_uvector`-style growth, out-of-memory refusals of a
//! `LimitAdaptor`, and the counters of every adaptor over long runs:
//!
//! - a data loader on RMM's async pool resource allocating, filling and dropping a 4 MiB batch
//!   256 times while another thread holds a capture open: the bytes outstanding stay bounded, as
//!   the caching allocator's do in the same program;
//! - a pool buffer written by hand (unrecorded) on its home stream behind a gate, dropped during
//!   a capture elsewhere: the free, made at once on its home stream, waits for that write, so a
//!   buffer the pool hands out on another stream keeps its bytes;
//! - the same with the home stream's handle dropped before the buffer: the free waits for the
//!   handle's end;
//! - a buffer allocated on one stream, written on a second behind a gate and dropped on a third
//!   thread: a new buffer on a fourth stream keeps its bytes;
//! - a logging and tracking stack over the pool: a free beside a capture is logged on the
//!   buffer's home stream (not the legacy stream), before the next allocation, and the log
//!   replays to nothing live;
//! - a `LimitAdaptor` whose budget is held by buffers dropped during a capture: a raw
//!   `allocate` after the capture ends is served (RMM's `mr.allocate` beside `device_uvector`s);
//! - a typed buffer refused by the limit during a capture elsewhere, while a live buffer holds
//!   its budget: a typed OOM naming the cap, nothing booked, counted as a failure, and served
//!   once that buffer is dropped;
//! - `device_uvector` growth (allocate double, copy, free the old one) 10^4 times under a tight
//!   limit: contents exact, every counter exact at each step, the pool's reserve bounded;
//! - eight threads churning buffers over `tracking(statistics(limit(pool)))`, read on side
//!   streams and dropped on a dropper thread, beside a thread capturing graphs in a loop: every
//!   byte checked, and all books back to zero at the end.
//!
//! Every GPU test takes the serial guard: each opens captures or holds a stream behind a gate,
//! whose presence anywhere in the process changes every other test's paths.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use cuweave_driver::graph::{CaptureMode, active_captures};
use cuweave_driver::{Context, Graph, Stream, StreamFlags};
use cuweave_memory::resource::{
    DriverResource, LOG_HEADER, LimitAdaptor, LoggingAdaptor, MemoryResource, StatisticsAdaptor,
    TrackingAdaptor,
};
use cuweave_memory::{Buffer, DeviceBuffer, MemoryError};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{poll_until, require_gpu, serial};

#[path = "common/async_pool.rs"]
mod async_pool;
use async_pool::async_pool_or_skip;

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

const MIB: usize = 1 << 20;

/// How long a test waits for deferred frees to come back after a capture ends: far more than
/// it takes, so a miss is a leak, not a slow machine.
const SETTLE: Duration = Duration::from_secs(10);

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// The test's full name, for skip lines.
fn name(test: &str) -> String {
    format!("rmm_resource_programs::{test}")
}

/// A capture held open on a thread of its own (ThreadLocal mode, its own non-blocking stream, a
/// short spin kernel captured), until [`close`](Self::close). Dropping it without closing ends
/// the capture too.
struct CaptureElsewhere {
    done: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<Captured>>,
}

/// A capture's graph with the module of the kernel it captured (declared after the graph, so
/// it is unloaded only once the graph is gone). Tests that hold a gate keep it until the gate
/// is open: unloading a module waits for the device.
struct Captured {
    _graph: Graph,
    _kernels: TestKernels,
}

impl CaptureElsewhere {
    /// Begins the capture on a new thread and returns once it is active.
    fn open(context: &Arc<Context>) -> Self {
        let (opened_tx, opened_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let context = Arc::clone(context);
        let thread = std::thread::spawn(move || {
            let kernels = TestKernels::load(&context).expect("load test kernels");
            let s = stream(&context);
            s.begin_capture(CaptureMode::ThreadLocal)
                .expect("begin capture");
            kernels.spin_ns(&s, 1_000).expect("captured spin");
            opened_tx.send(()).unwrap();
            let _ = done_rx.recv();
            let graph = s.end_capture().expect("end capture");
            Captured {
                _graph: graph,
                _kernels: kernels,
            }
        });
        opened_rx
            .recv()
            .expect("the capture thread began its capture");
        assert!(active_captures() > 0, "the capture is active");
        Self {
            done: Some(done_tx),
            thread: Some(thread),
        }
    }

    /// Ends the capture and returns its graph (with the captured kernel's module).
    fn close(mut self) -> Captured {
        drop(self.done.take());
        let captured = self.thread.take().unwrap().join().expect("capture thread");
        assert_eq!(active_captures(), 0, "no capture is active any more");
        captured
    }
}

impl Drop for CaptureElsewhere {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Makes and drops a one-page resource buffer on `s` until `done` holds (a resource buffer made
/// with no capture active carries out the frees captures deferred); whether it did in time.
fn nudge_until(
    resource: &Arc<dyn MemoryResource>,
    s: &Stream,
    mut done: impl FnMut() -> bool,
) -> bool {
    poll_until(SETTLE, || {
        let mut next = DeviceBuffer::<u32>::with_resource(Arc::clone(resource), 1024, s)
            .expect("nudge buffer");
        next.fill_async(1, s).expect("nudge fill");
        drop(next);
        done()
    })
}

fn assert_all(values: &[u32], expected: u32, what: &str) {
    if let Some((index, value)) = values.iter().enumerate().find(|(_, v)| **v != expected) {
        panic!("{what}: element {index} is {value:#x}, expected {expected:#x}");
    }
}

// ---------------------------------------------------------------------------------------------
// Frees deferred by a capture elsewhere
// ---------------------------------------------------------------------------------------------

/// A data loader thread on RMM's `cuda_async_memory_resource` (here `AsyncPoolResource` under a
/// statistics adaptor) allocates a 4 MiB batch on its own stream, fills it, reads one word back
/// and drops it, 256 times, while the training thread holds a graph capture open (PyTorch's
/// `torch.cuda.graph` beside a loader). Nothing of the loader's is captured and every use is on
/// its own stream, so each batch can go back to the pool in stream order; the bytes
/// outstanding must stay bounded (at most 64 MiB, where holding every batch until the capture
/// ends reaches 1 GiB), as the caching allocator's reserve does in the same program (seventh
/// look), and everything is deallocated once the capture ends.
#[test]
fn a_loaders_pool_batches_during_a_long_capture_elsewhere_stay_bounded() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let Some(pool) = async_pool_or_skip(
        &name("a_loaders_pool_batches_during_a_long_capture_elsewhere_stay_bounded"),
        ctx,
    ) else {
        return;
    };
    let stats = Arc::new(StatisticsAdaptor::new(Arc::clone(&pool)));
    let resource: Arc<dyn MemoryResource> = stats.clone();
    let s = stream(ctx);
    let capture = CaptureElsewhere::open(ctx);
    let mut worst = 0;
    for step in 0..256u32 {
        let mut batch = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), MIB, &s).unwrap();
        batch.fill_async(step, &s).unwrap();
        let mut word = [0u32; 1];
        batch.copy_range_to_host(MIB / 2, &mut word).unwrap();
        assert_eq!(word[0], step, "step {step}");
        drop(batch);
        worst = worst.max(stats.stats().current_bytes);
    }
    let during = stats.stats();
    drop(capture.close());
    let drained = nudge_until(&resource, &s, || stats.stats().current_allocations == 0);
    assert!(
        drained,
        "batches dropped during the capture were never deallocated after it: {:?}",
        stats.stats()
    );
    assert!(
        worst <= 64 * MIB,
        "256 loader steps of a 4 MiB batch, each dropped on its own stream with nothing \
         captured, held {worst} bytes outstanding during a capture on another thread: {during:?}"
    );
}

/// RMM's rule that memory is freed on the stream it was allocated on covers work queued there
/// by hand: a pool buffer whose home stream writes it with a raw kernel (no use recorded, which
/// the docs allow on the allocation stream) behind a gate is dropped while another thread holds
/// a capture open. No capture used it and its home stream is not capturing, so it is freed at
/// once, on its home stream (the limit's budget comes back then). That free must be ordered
/// behind the raw write on the home stream: the next buffer, made after the capture on another
/// stream and filled there before the gate opens, must read back its own value, never the late
/// write's.
#[test]
fn a_deferred_pool_free_waits_for_unrecorded_work_on_its_home_stream() {
    const LEN: usize = MIB / 4; // 1 MiB of u32
    const STALE: u32 = 0xDEAD_0001;
    const FRESH: u32 = 0x0000_F00D;
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let Some(pool) = async_pool_or_skip(
        &name("a_deferred_pool_free_waits_for_unrecorded_work_on_its_home_stream"),
        ctx,
    ) else {
        return;
    };
    let kernels = TestKernels::load(ctx).unwrap();
    let limit = Arc::new(LimitAdaptor::new(Arc::clone(&pool), 64 * MIB));
    let resource: Arc<dyn MemoryResource> = limit.clone();
    let (home, other) = (stream(ctx), stream(ctx));
    let gate = Gate::new(ctx);
    let old = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), LEN, &home).unwrap();
    let old_ptr = old.device_ptr();
    home.synchronize().unwrap();

    // The capture first: its thread loads a module, which must not meet a closed gate.
    let capture = CaptureElsewhere::open(ctx);
    gate.hold(&kernels, &home);
    // SAFETY: `old` is LEN u32s of live device memory, written only by this kernel; the test
    // relies on the buffer's free being ordered after the home stream's work, which is what it
    // checks.
    unsafe { kernels.fill_u32(&home, old_ptr, STALE, LEN) }.unwrap();
    drop(old);
    assert_eq!(
        limit.used(),
        0,
        "freed at once beside the capture, in stream order on its home stream"
    );
    let captured = capture.close();

    let mut fresh = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), LEN, &other).unwrap();
    assert_eq!(limit.used(), LEN * 4, "only the new buffer is outstanding");
    fresh.fill_async(FRESH, &other).unwrap();
    let reused = fresh.device_ptr() == old_ptr;
    gate.open();
    let back = fresh.to_vec().unwrap();
    assert_all(
        &back,
        FRESH,
        &format!(
            "the new buffer (the old address reused: {reused}) after the home stream's late write"
        ),
    );
    drop(fresh);
    home.synchronize().unwrap();
    other.synchronize().unwrap();
    assert_eq!(limit.used(), 0);
    assert_eq!(pool.outstanding(), 0);
    drop(captured);
}

/// As above, but the program drops the home stream's handle (a per-request stream) after
/// queuing the raw write and before the buffer: the free, made at once beside the capture on
/// the legacy stream, must wait for the handle's end, behind the gated write, so the next
/// buffer the pool hands out on another stream keeps its bytes.
#[test]
fn a_deferred_pool_free_whose_home_stream_is_gone_waits_for_that_streams_end() {
    const LEN: usize = MIB / 4;
    const STALE: u32 = 0xDEAD_0002;
    const FRESH: u32 = 0x0000_BEEF;
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let Some(pool) = async_pool_or_skip(
        &name("a_deferred_pool_free_whose_home_stream_is_gone_waits_for_that_streams_end"),
        ctx,
    ) else {
        return;
    };
    let kernels = TestKernels::load(ctx).unwrap();
    let stats = Arc::new(StatisticsAdaptor::new(Arc::clone(&pool)));
    let resource: Arc<dyn MemoryResource> = stats.clone();
    let other = stream(ctx);
    let gate = Gate::new(ctx);
    let home = stream(ctx);
    let old = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), LEN, &home).unwrap();
    let old_ptr = old.device_ptr();
    home.synchronize().unwrap();

    let capture = CaptureElsewhere::open(ctx);
    gate.hold(&kernels, &home);
    // SAFETY: as in the previous test; the write is queued before the home handle is dropped,
    // which the docs require for unrecorded work on the allocation stream.
    unsafe { kernels.fill_u32(&home, old_ptr, STALE, LEN) }.unwrap();
    drop(home);
    drop(old);
    assert_eq!(
        stats.stats().current_allocations,
        0,
        "freed at once, behind the home stream's end"
    );
    let captured = capture.close();

    let mut fresh = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), LEN, &other).unwrap();
    let counted = stats.stats();
    assert_eq!(
        (counted.current_allocations, counted.total_deallocations),
        (1, 1),
        "only the new buffer is outstanding: {counted:?}"
    );
    fresh.fill_async(FRESH, &other).unwrap();
    let reused = fresh.device_ptr() == old_ptr;
    gate.open();
    assert_all(
        &fresh.to_vec().unwrap(),
        FRESH,
        &format!(
            "the new buffer (the old address reused: {reused}) after the dropped stream's late write"
        ),
    );
    drop(fresh);
    ctx.synchronize().unwrap();
    assert_eq!(stats.stats().current_bytes, 0);
    drop(captured);
}

// ---------------------------------------------------------------------------------------------
// Stream-ordered frees across streams and threads
// ---------------------------------------------------------------------------------------------

/// RMM's cross-stream pattern: a `device_buffer` allocated on stream A, written on stream B (a
/// recorded fill, held behind a gate), then handed to a worker thread that drops it. The free
/// goes on A behind B's write; a new buffer the pool hands out on a fourth stream and fills
/// there before the gate opens must read back its own value. The tracking adaptor books exactly
/// the live buffer at each step, each as owned, on the stream it was allocated on.
#[test]
fn a_buffer_written_on_a_second_stream_and_dropped_on_a_third_thread_is_freed_after_the_write() {
    const LEN: usize = MIB / 4;
    const STALE: u32 = 0xDEAD_0003;
    const FRESH: u32 = 0x0000_CAFE;
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let Some(pool) = async_pool_or_skip(
        &name(
            "a_buffer_written_on_a_second_stream_and_dropped_on_a_third_thread_is_freed_after_the_write",
        ),
        ctx,
    ) else {
        return;
    };
    let kernels = TestKernels::load(ctx).unwrap();
    let tracked = Arc::new(TrackingAdaptor::new(Arc::clone(&pool)));
    let resource: Arc<dyn MemoryResource> = tracked.clone();
    let (a, b, d) = (stream(ctx), stream(ctx), stream(ctx));
    let gate = Gate::new(ctx);

    let mut old = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), LEN, &a).unwrap();
    let old_ptr = old.device_ptr();
    let booked = tracked.outstanding();
    assert_eq!(booked.len(), 1);
    assert_eq!(
        (
            booked[0].ptr,
            booked[0].bytes,
            booked[0].owned,
            booked[0].stream
        ),
        (old_ptr, LEN * 4, true, a.id())
    );
    gate.hold(&kernels, &b);
    old.fill_async(STALE, &b).unwrap();
    std::thread::spawn(move || drop(old))
        .join()
        .expect("dropping thread");
    assert_eq!(tracked.outstanding_count(), 0, "freed (in stream order)");

    let mut fresh = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), LEN, &d).unwrap();
    fresh.fill_async(FRESH, &d).unwrap();
    let reused = fresh.device_ptr() == old_ptr;
    let booked = tracked.outstanding();
    assert_eq!(booked.len(), 1);
    assert_eq!(
        (booked[0].ptr, booked[0].stream),
        (fresh.device_ptr(), d.id())
    );
    gate.open();
    assert_all(
        &fresh.to_vec().unwrap(),
        FRESH,
        &format!("the new buffer (the old address reused: {reused}) after the gated write"),
    );
    drop(fresh);
    ctx.synchronize().unwrap();
    assert_eq!(tracked.outstanding_count(), 0);
    assert_eq!(tracked.outstanding_bytes(), 0);
    assert_eq!(pool.pool().used_bytes().unwrap(), 0);
}

// ---------------------------------------------------------------------------------------------
// Logging and tracking of deferred frees
// ---------------------------------------------------------------------------------------------

#[path = "common/shared_log.rs"]
mod shared_log;
use shared_log::SharedLog;

/// One parsed log line: action, address, bytes, stream id.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Row {
    action: String,
    ptr: u64,
    bytes: usize,
    stream: u64,
}

fn parse_log(text: &str) -> Vec<Row> {
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(LOG_HEADER), "{text}");
    lines
        .map(|line| {
            let columns: Vec<&str> = line.split(',').collect();
            assert_eq!(columns.len(), 6, "six columns: {line}");
            Row {
                action: columns[2].to_owned(),
                ptr: u64::from_str_radix(columns[3].trim_start_matches("0x"), 16).expect("ptr"),
                bytes: columns[4].parse().expect("size"),
                stream: columns[5].parse().expect("stream"),
            }
        })
        .collect()
}

/// RMM's `logging_resource_adaptor` over a tracking adaptor over the async pool, for replaying
/// a program's allocations: two buffers, one whose home stream lives on and one whose home
/// stream's handle is dropped, both also read on a side stream and dropped while another thread
/// holds a capture. No capture used them, so both are freed at once beside it, as eager drops
/// are: the tracking books hold only the side stream's scratch buffer, and in the log both frees
/// come before the next allocation, the live buffer's on its home stream (the stream it is
/// deallocated on), the other's not on its dead stream; the log replays to nothing live and the
/// books end empty.
#[test]
fn deferred_frees_are_logged_on_their_home_stream_before_the_next_allocation() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let Some(pool) = async_pool_or_skip(
        &name("deferred_frees_are_logged_on_their_home_stream_before_the_next_allocation"),
        ctx,
    ) else {
        return;
    };
    let log = SharedLog::default();
    let stack = Arc::new(
        LoggingAdaptor::new(TrackingAdaptor::new(Arc::clone(&pool)), log.clone()).unwrap(),
    );
    assert_eq!(stack.name(), "logging(tracking(async-pool))");
    let resource: Arc<dyn MemoryResource> = stack.clone();
    let (home, side, next) = (stream(ctx), stream(ctx), stream(ctx));
    let gone = stream(ctx);
    let (home_id, gone_id) = (home.id(), gone.id());

    let mut kept = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 5000, &home).unwrap();
    let mut orphan =
        DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 7000, &gone).unwrap();
    kept.fill_async(11, &home).unwrap();
    orphan.fill_async(22, &gone).unwrap();
    let mut probe = [0u32; 1];
    kept.copy_range_to_host(4999, &mut probe).unwrap();
    assert_eq!(probe[0], 11);
    orphan.copy_range_to_host(6999, &mut probe).unwrap();
    assert_eq!(probe[0], 22);
    // A read on a side stream each: their frees wait for it.
    let mut scratch =
        DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 5000, &side).unwrap();
    scratch
        .copy_range_from_async(0, &kept, 0, 5000, &side)
        .unwrap();
    scratch
        .copy_range_from_async(0, &orphan, 0, 5000, &side)
        .unwrap();
    let (kept_ptr, orphan_ptr) = (kept.device_ptr(), orphan.device_ptr());
    drop(gone);

    let capture = CaptureElsewhere::open(ctx);
    drop(kept);
    drop(orphan);
    let tracking = stack.upstream();
    assert_eq!(
        tracking.outstanding_count(),
        1,
        "only the scratch buffer: {}",
        tracking.report()
    );
    let captured = capture.close();

    let after = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 3000, &next).unwrap();
    let after_ptr = after.device_ptr();
    drop(after);
    drop(scratch);
    stack.flush().unwrap();
    assert_eq!(stack.write_errors(), 0);
    let rows = parse_log(&log.text());
    let position = |action: &str, ptr: u64| {
        rows.iter()
            .position(|row| row.action == action && row.ptr == ptr)
            .unwrap_or_else(|| panic!("no {action} of {ptr:#x} in the log: {rows:?}"))
    };
    let next_allocation = rows
        .iter()
        .position(|row| row.action == "allocate" && row.ptr == after_ptr && row.stream == next.id())
        .expect("the next allocation is logged");
    for (what, ptr) in [("kept", kept_ptr), ("orphan", orphan_ptr)] {
        assert!(
            position("free", ptr) < next_allocation,
            "{what}: freed before the next allocation: {rows:?}"
        );
    }
    let kept_free = &rows[position("free", kept_ptr)];
    assert_eq!(
        (kept_free.bytes, kept_free.stream),
        (20_000, home_id),
        "freed on its home stream, as an eager drop would be"
    );
    let orphan_free = &rows[position("free", orphan_ptr)];
    assert_eq!(orphan_free.bytes, 28_000);
    assert_ne!(orphan_free.stream, gone_id, "its home stream is gone");
    assert!(
        rows.iter().all(|row| !row.action.contains("failure")),
        "{rows:?}"
    );
    let mut live: HashMap<u64, usize> = HashMap::new();
    for row in &rows {
        match row.action.as_str() {
            "allocate" => assert!(live.insert(row.ptr, row.bytes).is_none(), "{row:?} twice"),
            "free" => assert_eq!(live.remove(&row.ptr), Some(row.bytes), "{row:?}"),
            other => panic!("unexpected action {other}"),
        }
    }
    assert!(live.is_empty(), "the log replays to nothing live: {live:?}");
    assert_eq!(tracking.outstanding_count(), 0, "{}", tracking.report());
    assert_eq!(tracking.outstanding_bytes(), 0);
    ctx.synchronize().unwrap();
    assert_eq!(pool.pool().used_bytes().unwrap(), 0);
    drop(captured);
}

// ---------------------------------------------------------------------------------------------
// Out of memory from a limit
// ---------------------------------------------------------------------------------------------

/// An RMM program caps its share of the GPU with a limiting adaptor, keeps `device_uvector`s on
/// it, and also calls `mr.allocate` directly (thrust's temporary storage does). Two 4 MiB
/// buffers under an 8 MiB cap are dropped while another thread holds a capture: their frees are
/// deferred, which holds the budget. Once the capture has ended nothing is live, so a raw
/// allocation of the whole cap must be served, not refused with an out-of-memory error for
/// budget that only frees waiting for nothing hold.
#[test]
fn a_raw_allocation_after_a_capture_is_not_refused_for_budget_its_deferred_frees_hold() {
    const CAP: usize = 8 * MIB;
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let limit = Arc::new(LimitAdaptor::new(DriverResource::new(ctx), CAP));
    let resource: Arc<dyn MemoryResource> = limit.clone();
    let s = stream(ctx);
    let mut first = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), MIB, &s).unwrap();
    let mut second = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), MIB, &s).unwrap();
    first.fill_async(1, &s).unwrap();
    second.fill_async(2, &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(limit.used(), CAP);

    let capture = CaptureElsewhere::open(ctx);
    drop(first);
    drop(second);
    drop(capture.close());

    let raw = limit.allocate(CAP, &s);
    let used_then = limit.used();
    let ptr = match raw {
        Ok(ptr) => ptr,
        Err(error) => {
            // Put things back for the other tests before failing.
            drop(DeviceBuffer::<u32>::with_resource(
                Arc::clone(&resource),
                1,
                &s,
            ));
            panic!(
                "a raw allocation of the cap after the capture ended was refused ({error}) with \
                 {used_then} bytes of the budget held by buffers dropped during it"
            );
        }
    };
    limit.deallocate(ptr, CAP, &s).unwrap();
    assert_eq!(limit.used(), 0);
    assert_eq!(limit.upstream().outstanding(), 0);
}

/// A typed buffer refused by a limit (RMM's `limiting_resource_adaptor` throwing
/// `out_of_memory`) during another thread's capture, while a live buffer holds the budget: the
/// refusal is a typed `OutOfMemory` naming the cap, the request and the bytes in use, not a
/// capture refusal; the statistics adaptor counts one failure and nothing else changes; the
/// tracking books hold only the live buffer. Once it is dropped (after the capture) the same
/// request is served, its bytes round-trip, and the books end empty.
#[test]
fn a_limit_refusal_beside_a_capture_is_typed_leaks_nothing_and_is_served_after_it() {
    const CAP: usize = 4 * MIB;
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let Some(pool) = async_pool_or_skip(
        &name("a_limit_refusal_beside_a_capture_is_typed_leaks_nothing_and_is_served_after_it"),
        ctx,
    ) else {
        return;
    };
    let stack = Arc::new(TrackingAdaptor::new(StatisticsAdaptor::new(
        LimitAdaptor::new(Arc::clone(&pool), CAP),
    )));
    assert_eq!(stack.name(), "tracking(statistics(limit(async-pool)))");
    let resource: Arc<dyn MemoryResource> = stack.clone();
    let statistics = stack.upstream();
    let limit = statistics.upstream();
    let s = stream(ctx);

    let mut held =
        DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 3 * MIB / 4, &s).unwrap();
    held.fill_async(3, &s).unwrap();
    s.synchronize().unwrap();
    let capture = CaptureElsewhere::open(ctx);
    let before = statistics.stats();
    let refused = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), MIB / 2, &s);
    match &refused {
        Err(
            error @ MemoryError::OutOfMemory {
                requested,
                allocated,
                limit: Some(cap),
                ..
            },
        ) => {
            assert!(error.is_out_of_memory());
            assert!(!error.is_capture_refusal());
            assert_eq!((*requested, *allocated, *cap), (2 * MIB, 3 * MIB, CAP));
        }
        other => panic!("expected the limit's OutOfMemory, got {other:?}"),
    }
    drop(refused);
    let after = statistics.stats();
    assert_eq!(after.failed_allocations, before.failed_allocations + 1);
    assert_eq!(
        (
            after.current_bytes,
            after.total_allocations,
            after.total_deallocations
        ),
        (
            before.current_bytes,
            before.total_allocations,
            before.total_deallocations
        ),
        "a refusal changes no other count"
    );
    assert_eq!(limit.used(), 3 * MIB, "the refusal reserved nothing");
    assert_eq!(stack.outstanding_count(), 1, "{}", stack.report());
    let captured = capture.close();
    drop(held);

    let pattern: Vec<u32> = (0..(MIB / 2) as u32)
        .map(|i| i.wrapping_mul(0x9E37_79B9))
        .collect();
    let mut served = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), MIB / 2, &s)
        .expect("served once the capture has ended");
    served.copy_from_host(&pattern).unwrap();
    assert_eq!(served.to_vec().unwrap(), pattern);
    assert_eq!(limit.used(), 2 * MIB);
    let booked = stack.outstanding();
    assert_eq!(booked.len(), 1, "{}", stack.report());
    assert_eq!(
        (booked[0].ptr, booked[0].bytes),
        (served.device_ptr(), 2 * MIB)
    );
    drop(served);
    let stats = statistics.stats();
    assert_eq!((stats.current_bytes, stats.current_allocations), (0, 0));
    assert_eq!(stats.total_allocations, stats.total_deallocations);
    assert_eq!(stats.total_allocations, 2);
    assert_eq!(stats.failed_allocations, 1);
    assert_eq!(stack.outstanding_count(), 0);
    drop(captured);
}

// ---------------------------------------------------------------------------------------------
// Long runs
// ---------------------------------------------------------------------------------------------

/// The tag written into the elements a growth step adds.
fn growth_tag(cycle: u32, step: u32) -> u32 {
    (cycle << 8) | step
}

/// `rmm::device_uvector` growth: a vector on `statistics(limit(pool))` under a tight 512 KiB
/// cap grows from one element by doubling to 65,536 (allocate the bigger buffer on the stream,
/// copy the old contents in, fill the new tail, free the old one on the stream), then starts
/// over, 600 times: 10,200 allocations. At every step exactly one buffer is live with exactly
/// its bytes in both adaptors (the cap leaves no room for a leaked one); at the end of each
/// cycle every element holds the tag of the step that added it; the peak is exactly the last
/// step's two buffers; the pool's reserve stays bounded and nothing is in use at the end.
#[test]
fn device_uvector_growth_ten_thousand_times_keeps_every_counter_exact() {
    const CYCLES: u32 = 600;
    const STEPS: u32 = 17; // 1 << 0 ..= 1 << 16 elements
    const CAP: usize = 512 * 1024;
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let Some(pool) = async_pool_or_skip(
        &name("device_uvector_growth_ten_thousand_times_keeps_every_counter_exact"),
        ctx,
    ) else {
        return;
    };
    let stats = Arc::new(StatisticsAdaptor::new(LimitAdaptor::new(
        Arc::clone(&pool),
        CAP,
    )));
    let resource: Arc<dyn MemoryResource> = stats.clone();
    let s = stream(ctx);
    let expected_at = |cycle: u32, index: usize| {
        let step = if index == 0 { 0 } else { index.ilog2() + 1 };
        growth_tag(cycle, step)
    };
    for cycle in 0..CYCLES {
        let mut vector = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 1, &s).unwrap();
        vector.fill_async(growth_tag(cycle, 0), &s).unwrap();
        for step in 1..STEPS {
            let (old_len, len) = (1usize << (step - 1), 1usize << step);
            let mut grown =
                DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), len, &s).unwrap();
            grown
                .copy_range_from_async(0, &vector, 0, old_len, &s)
                .unwrap();
            grown
                .slice_mut(old_len..)
                .unwrap()
                .fill_async(growth_tag(cycle, step), &s)
                .unwrap();
            drop(std::mem::replace(&mut vector, grown));
            let counted = stats.stats();
            assert_eq!(
                (counted.current_allocations, counted.current_bytes),
                (1, len * 4),
                "cycle {cycle} step {step}: {counted:?}"
            );
            assert_eq!(
                stats.upstream().used(),
                len * 4,
                "cycle {cycle} step {step}"
            );
        }
        if cycle % 50 == 0 || cycle == CYCLES - 1 {
            let values = vector.to_vec().unwrap();
            if let Some(index) = (0..values.len()).find(|&i| values[i] != expected_at(cycle, i)) {
                panic!(
                    "cycle {cycle}: element {index} is {:#x}, expected {:#x}",
                    values[index],
                    expected_at(cycle, index)
                );
            }
        }
    }
    s.synchronize().unwrap();
    let counted = stats.stats();
    let total = u64::from(CYCLES * STEPS);
    assert_eq!(counted.total_allocations, total);
    assert_eq!(counted.total_deallocations, total);
    assert_eq!((counted.current_allocations, counted.current_bytes), (0, 0));
    assert_eq!(
        counted.peak_bytes,
        (1 << 16) * 4 + (1 << 15) * 4,
        "the last step's two buffers"
    );
    assert_eq!(counted.peak_allocations, 2);
    assert_eq!(counted.failed_allocations, 0);
    assert_eq!(stats.upstream().used(), 0);
    assert_eq!(pool.pool().used_bytes().unwrap(), 0);
    let reserved = pool.pool().reserved_bytes().unwrap();
    assert!(
        reserved <= 64 * MIB as u64,
        "10^4 growth steps of at most 384 KiB live reserved {reserved} bytes in the pool"
    );
}

/// Eight request threads share `tracking(statistics(limit(pool)))` while a ninth captures a
/// small graph in a loop (a serving process that recaptures CUDA graphs beside its workers).
/// Each worker allocates buffers of varying sizes on its own stream, fills them, checks a word,
/// copies some into a scratch buffer on a side stream, keeps a window of two, and hands every
/// seventh to a dropper thread instead of dropping it itself; 1,500 buffers each. Drops landing
/// in a capture are deferred, the others freed at once. After the capture loop stops and one
/// more resource buffer is made, every adaptor's books are exactly zero, the totals balance, no
/// allocation was refused, and the pool has nothing in use.
#[test]
fn eight_threads_churn_resource_buffers_beside_a_capture_loop_and_every_book_ends_at_zero() {
    const THREADS: usize = 8;
    const PER_THREAD: usize = 1_500;
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let Some(pool) = async_pool_or_skip(
        &name(
            "eight_threads_churn_resource_buffers_beside_a_capture_loop_and_every_book_ends_at_zero",
        ),
        ctx,
    ) else {
        return;
    };
    let stack = Arc::new(TrackingAdaptor::new(StatisticsAdaptor::new(
        LimitAdaptor::new(Arc::clone(&pool), 1 << 30),
    )));
    let resource: Arc<dyn MemoryResource> = stack.clone();

    let stop = Arc::new(AtomicBool::new(false));
    let captures = Arc::new(AtomicUsize::new(0));
    let capturer = {
        let (ctx, stop, captures) = (Arc::clone(ctx), Arc::clone(&stop), Arc::clone(&captures));
        std::thread::spawn(move || {
            let kernels = TestKernels::load(&ctx).expect("kernels");
            let s = stream(&ctx);
            while !stop.load(Ordering::Acquire) || captures.load(Ordering::Relaxed) < 50 {
                s.begin_capture(CaptureMode::ThreadLocal)
                    .expect("begin capture");
                kernels.spin_ns(&s, 2_000).expect("captured spin");
                std::thread::yield_now();
                drop(s.end_capture().expect("end capture"));
                captures.fetch_add(1, Ordering::Relaxed);
                // A gap with no capture active, where resource buffers carry out the frees
                // the last capture deferred.
                std::thread::sleep(Duration::from_micros(100));
            }
        })
    };
    let (drop_tx, drop_rx) = mpsc::channel::<DeviceBuffer<u32>>();
    let dropper = std::thread::spawn(move || {
        let mut dropped = 0usize;
        for buffer in drop_rx {
            drop(buffer);
            dropped += 1;
        }
        dropped
    });

    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (resource, drop_tx) = (Arc::clone(&resource), drop_tx.clone());
            scope.spawn(move || {
                let (s, side) = (stream(ctx), stream(ctx));
                let mut scratch =
                    DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 16 * 1024, &side)
                        .unwrap();
                let mut window: VecDeque<(DeviceBuffer<u32>, u32)> = VecDeque::new();
                for i in 0..PER_THREAD {
                    let len = 1024 * (1 + (i * 7 + t * 3) % 16);
                    let tag = ((t as u32) << 24) | i as u32;
                    let mut buffer =
                        DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), len, &s)
                            .unwrap_or_else(|e| panic!("thread {t} buffer {i}: {e}"));
                    buffer.fill_async(tag, &s).unwrap();
                    if i % 5 == 0 {
                        scratch
                            .copy_range_from_async(0, &buffer, 0, 1024, &side)
                            .unwrap();
                    }
                    if i % 50 == 0 {
                        let mut word = [0u32; 1];
                        buffer.copy_range_to_host(len - 1, &mut word).unwrap();
                        assert_eq!(word[0], tag, "thread {t} buffer {i}");
                        let mut head = [0u32; 1];
                        scratch.copy_range_to_host(0, &mut head).unwrap();
                        assert_eq!(head[0] >> 24, t as u32, "thread {t}: the side copy");
                    }
                    window.push_back((buffer, tag));
                    if window.len() > 2 {
                        let (oldest, _) = window.pop_front().unwrap();
                        if i % 7 == 0 {
                            drop_tx.send(oldest).unwrap();
                        } else {
                            drop(oldest);
                        }
                    }
                }
                for (buffer, tag) in window {
                    let mut word = [0u32; 1];
                    buffer.copy_range_to_host(0, &mut word).unwrap();
                    assert_eq!(word[0], tag, "thread {t}: a kept buffer");
                }
            });
        }
    });
    drop(drop_tx);
    let handed = dropper.join().expect("dropper");
    stop.store(true, Ordering::Release);
    capturer.join().expect("capture loop");
    assert!(handed > 0);
    assert!(captures.load(Ordering::Relaxed) >= 50);

    let s = stream(ctx);
    let statistics = stack.upstream();
    let settled = nudge_until(&resource, &s, || stack.outstanding_count() == 0);
    assert!(settled, "buffers never deallocated: {}", stack.report());
    let counted = statistics.stats();
    assert_eq!(
        (counted.current_allocations, counted.current_bytes),
        (0, 0),
        "{counted:?}"
    );
    assert_eq!(counted.total_allocations, counted.total_deallocations);
    assert!(
        counted.total_allocations >= (THREADS * (PER_THREAD + 1)) as u64,
        "{counted:?}"
    );
    assert_eq!(counted.failed_allocations, 0);
    assert_eq!(statistics.upstream().used(), 0);
    assert_eq!(stack.outstanding_bytes(), 0);
    assert!(
        stack.report().starts_with(
            "tracking(statistics(limit(async-pool))): 0 allocations outstanding, 0 bytes"
        ),
        "{}",
        stack.report()
    );
    ctx.synchronize().unwrap();
    assert_eq!(pool.outstanding(), 0);
    assert_eq!(pool.pool().used_bytes().unwrap(), 0);
}

// ---------------------------------------------------------------------------------------------
// Without a device
// ---------------------------------------------------------------------------------------------

/// What an RMM program's error handling sees from a limit, without a device: a limit's refusal
/// is out-of-memory (never a capture refusal) and says its cap; a capture refusal is the other
/// way round, so a retry loop that waits for captures never spins on a full budget.
#[test]
fn a_limit_refusal_and_a_capture_refusal_classify_apart() {
    let oom = MemoryError::OutOfMemory {
        requested: 2 * MIB,
        allocated: 3 * MIB,
        reserved: 3 * MIB,
        limit: Some(4 * MIB),
    };
    assert!(oom.is_out_of_memory());
    assert!(!oom.is_capture_refusal());
    let text = oom.to_string();
    assert!(text.contains(&format!("limit {}", 4 * MIB)), "{text}");
    assert!(text.contains(&format!("requested {}", 2 * MIB)), "{text}");
    let refusal = MemoryError::Driver(
        cuweave_driver::GraphError::Capturing {
            operation: "DeviceBuffer::drop",
            reason: "a capture began while the buffer was being freed",
        }
        .into(),
    );
    assert!(refusal.is_capture_refusal());
    assert!(!refusal.is_out_of_memory());
    assert_eq!(LOG_HEADER.split(',').count(), 6, "RMM's six columns");
}
