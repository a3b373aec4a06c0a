//! Sixth-look programs for the collective layer, aimed at how its waits, aborts and NCCL calls
//! behave beside CUDA-graph captures in global mode on other threads (torch.cuda.graph's default
//! `capture_error_mode="global"` while a DDP communication thread keeps working), and at
//! interactions the other GPU tests leave out:
//!
//! - an eager collective's wait that ticks (and a `Duration::MAX` deadline) while another
//!   thread holds a global capture: `Ok`, the capture intact, nothing aborted;
//! - the capturing thread itself waiting, in global mode, for an eager collective on another
//!   stream;
//! - a deadline that passes during another thread's global capture: the background
//!   `ncclCommAbort` cuweave starts of its own accord must not break the user's capture;
//! - a watchdog's inline `abort`, `finalize` of a rank with queued work, and a fresh
//!   `init_rank` plus `split`, each during another thread's global capture: the capture intact
//!   (or, for the init, a typed capture refusal);
//! - 150 collectives issued and awaited past a tick each, beside a loop of global captures on
//!   another thread: every wait `Ok`, every capture intact, pooled events returned, bytes exact;
//! - a flat gradient buffer cut by `chunks_mut` into buckets, each all-reduced in one group by
//!   its own communicator split from one parent, between tracked kernels on another stream;
//! - one half of a buffer (`split_at_mut`) all-reduced into its other half behind a slow
//!   kernel on another stream;
//! - pure CPU: an empty group launches without NCCL, and a `Duration::MAX` deadline validates.
//!
//! Every GPU test takes the binary's serial guard (`gate!`).

#[macro_use]
mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use common::increment::{increment, incrementer, plus};
use common::{assert_bytes_eq, comm, own_comm, pattern, stream};
use cuweave_collective::{CollectiveError, CommConfig, Communicator, Group, ReduceOp, UniqueId};
use cuweave_driver::{CaptureMode, Context, DriverError, EventPool, Stream};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_test_support::host_flags::HostFlags;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::poll_until;

/// How long a gate holds its stream at most when a test fails before opening it.
const GATE_TIMEOUT_NS: u64 = 5_000_000_000;

/// A deadline no healthy wait here comes near (the gates open themselves after 5 s).
const GENEROUS: Duration = Duration::from_secs(20);

fn upload<T: cuweave_collective::NcclType>(
    context: &Arc<Context>,
    values: &[T],
) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(context, values).expect("upload")
}

/// Queues a gate on `stream`: work queued after it starts only once `flags` word 0 is 1.
fn gate_on(kernels: &TestKernels, stream: &Stream, flags: &HostFlags) {
    // SAFETY: word 0 of `flags` is mapped pinned memory of the stream's context, alive until
    // the kernel finishes (each test opens the gate and waits before dropping `flags`; a drop
    // opens it too); the host writes it only with volatile writes.
    unsafe { kernels.wait_u32(stream, flags.device(0), 1, GATE_TIMEOUT_NS) }.expect("gate");
}

/// Makes NCCL's lazy first-call setup happen now, not during a capture or a test's timing.
fn warm_up(comm: &Communicator, stream: &Stream) {
    let mut warm = upload(comm.context(), &[1u32; 64]);
    comm.all_reduce_in_place(&mut warm, ReduceOp::Sum, stream)
        .expect("warm-up all_reduce");
    comm.synchronize(stream).expect("warm-up");
}

/// Runs `body` on a thread of its own and fails the test when it is still running after
/// `limit` (a hang becomes a failure, not a stuck binary).
fn within<R: Send + 'static>(
    limit: Duration,
    what: &str,
    body: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(body());
    });
    receiver
        .recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what}: still running after {limit:?}"))
}

fn is_capture_refusal(error: &CollectiveError) -> bool {
    match error {
        CollectiveError::Driver(error) => error.is_capture_refusal(),
        CollectiveError::Event(error) => error.is_capture_refusal(),
        CollectiveError::Memory(error) => error.is_capture_refusal(),
        _ => false,
    }
}

/// A capture another thread begins on a stream of its own (one tiny kernel in it) and holds
/// open until [`end`](Self::end), as a user's graph-building thread does.
struct HeldCapture {
    end: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<Result<usize, DriverError>>,
}

impl HeldCapture {
    fn begin(context: &Arc<Context>, kernels: &Arc<TestKernels>, mode: CaptureMode) -> Self {
        let stream = stream(context);
        let kernels = Arc::clone(kernels);
        let (began_tx, began_rx) = mpsc::channel();
        let (end, end_rx) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            stream.begin_capture(mode)?;
            kernels.spin_ns(&stream, 1000)?;
            let _ = began_tx.send(());
            let _ = end_rx.recv();
            stream.end_capture().and_then(|graph| graph.node_count())
        });
        if began_rx.recv_timeout(Duration::from_secs(10)).is_err() {
            let outcome = thread.join();
            panic!("the capture thread did not begin its capture: {outcome:?}");
        }
        Self { end, thread }
    }

    /// Ends the capture: the graph's node count (1 when nothing broke it).
    fn end(self) -> Result<usize, DriverError> {
        let _ = self.end.send(());
        self.thread.join().expect("capture thread")
    }
}

// ---------------------------------------------------------------------------------------------
// Waits beside global captures
// ---------------------------------------------------------------------------------------------

/// A DDP communication thread waits for its gradient all-reduce (queued behind a slow producer,
/// a gate here) while the main thread builds a CUDA graph in global mode (torch.cuda.graph's
/// default), and a second wait uses a `Duration::MAX` deadline ("never time out").
///
/// Each wait crosses several 10 ms ticks during the capture, so the tick's own event query and
/// `ncclCommGetAsyncError` run while a global capture is active. Expected: both waits `Ok`,
/// `check_async_error` `Ok` during the capture, the communicator not aborted, the other
/// thread's capture ends with its one node, and the output is the input (one rank).
#[test]
fn an_eager_collectives_wait_ticks_and_resolves_while_another_thread_holds_a_global_capture() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).expect("kernels"));
    let s = stream(context);
    warm_up(comm, &s);

    const N: usize = 65_537;
    let input = pattern::<f32>(N, 11);
    let send = upload(context, &input);
    let mut recv = upload(context, &pattern::<f32>(N, 12));
    let mut second = upload(context, &pattern::<u32>(N, 13));
    let flags = HostFlags::new(context, 1);
    gate_on(&kernels, &s, &flags);
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        .expect("all_reduce behind the gate");

    let capture = HeldCapture::begin(context, &kernels, CaptureMode::Global);
    let (first, during, second_wait) = std::thread::scope(|scope| {
        let waiter = scope.spawn(|| comm.synchronize_within(&s, GENEROUS));
        // Only to let the wait tick a few times while the capture is active; nothing below
        // depends on how long the waiting thread actually ran.
        std::thread::sleep(Duration::from_millis(60));
        let during = comm.check_async_error();
        flags.write(0, 1);
        let first = waiter.join().expect("waiting thread");
        // A second collective behind a slow kernel, waited with no deadline at all.
        kernels.spin_ns(&s, 30_000_000).expect("spin");
        comm.all_reduce_in_place(&mut second, ReduceOp::Max, &s)
            .expect("second all_reduce during the capture");
        let second_wait = comm.synchronize_within(&s, Duration::MAX);
        (first, during, second_wait)
    });
    let nodes = capture.end();

    first.expect("the wait across another thread's global capture");
    during.expect("check_async_error during another thread's global capture");
    second_wait.expect("a Duration::MAX wait during another thread's global capture");
    assert!(!comm.is_aborted(), "a healthy communicator was aborted");
    assert_eq!(
        nodes.as_ref().ok(),
        Some(&1),
        "the waits (or the all-reduce issued meanwhile) broke the other thread's global capture: {nodes:?}"
    );
    assert_bytes_eq("all_reduce output", &recv.to_vec().expect("read"), &input);
    assert_bytes_eq(
        "second all_reduce",
        &second.to_vec().expect("read"),
        &pattern::<u32>(N, 13),
    );
}

/// The graph-building thread itself waits: it begins a global capture on its own stream, then
/// (before ending it) synchronizes an eager all-reduce it queued earlier on another stream, as a
/// training loop that captures its forward pass while the previous step's gradients drain.
///
/// Expected: the wait is `Ok` (an eager stream is not the capturing one, so nothing is
/// refused), the capture ends with its one node, the output is exact, nothing aborted.
#[test]
fn the_capturing_thread_waits_for_an_eager_collective_in_global_mode() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let eager = stream(context);
    let capturing = stream(context);
    warm_up(comm, &eager);

    const N: usize = 4099;
    let input = pattern::<i32>(N, 21);
    let mut data = upload(context, &input);
    let flags = HostFlags::new(context, 1);
    gate_on(&kernels, &eager, &flags);
    comm.all_reduce_in_place(&mut data, ReduceOp::Min, &eager)
        .expect("all_reduce behind the gate");

    capturing
        .begin_capture(CaptureMode::Global)
        .expect("global capture");
    kernels.spin_ns(&capturing, 1000).expect("captured spin");
    let waited = std::thread::scope(|scope| {
        scope.spawn(|| {
            // Lets the wait below tick during the capture; no assertion depends on it.
            std::thread::sleep(Duration::from_millis(40));
            flags.write(0, 1);
        });
        comm.synchronize_within(&eager, GENEROUS)
    });
    let graph = capturing.end_capture();

    waited.expect("the capturing thread's wait for an eager collective");
    let graph = graph.expect("the global capture survived the wait");
    assert_eq!(graph.node_count().expect("node count"), 1);
    assert!(!comm.is_aborted());
    assert_bytes_eq("in-place all_reduce", &data.to_vec().expect("read"), &input);
}

/// A communication thread's deadline passes while the main thread holds a global capture open:
/// the wait becomes `Timeout`, the communicator is marked aborted, and cuweave runs
/// `ncclCommAbort` on a background thread of its own accord, while the capture is still open.
/// The capture is kept open until that abort has returned (`abort()` waits for it).
///
/// Expected: `Timeout`, then the user's capture ends with its one node: an abort cuweave starts
/// by itself must not break (invalidate) a capture another thread holds. Suspected: the
/// background abort makes its driver calls (frees, synchronisations inside NCCL) without
/// relaxed capture mode, which the driver refuses during a global capture and which
/// invalidates it.
#[test]
fn a_deadline_passing_during_another_threads_global_capture_leaves_the_capture_intact() {
    let (gpu, _serial) = gate!();
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).expect("kernels"));
    let comm = own_comm(&CommConfig::default().with_timeout(GENEROUS));
    let s = stream(context);
    warm_up(&comm, &s);
    let mut data = upload(context, &pattern::<u32>(1024, 31));
    let flags = HostFlags::new(context, 1);
    gate_on(&kernels, &s, &flags);
    comm.all_reduce_in_place(&mut data, ReduceOp::Sum, &s)
        .expect("all_reduce behind the gate");

    let capture = HeldCapture::begin(context, &kernels, CaptureMode::Global);
    let error = comm
        .synchronize_within(&s, Duration::from_millis(100))
        .expect_err("a wait behind a closed gate finished");
    assert!(
        matches!(error, CollectiveError::Timeout { .. }),
        "{error:?}"
    );
    assert!(
        comm.is_aborted(),
        "a timed-out communicator was not aborted"
    );
    flags.write(0, 1);
    let comm = within(Duration::from_secs(30), "the background abort", move || {
        comm.abort();
        comm
    });
    let nodes = capture.end();
    assert_eq!(
        nodes.as_ref().ok(),
        Some(&1),
        "the background ncclCommAbort broke another thread's global capture: {nodes:?}"
    );
    let refused = comm
        .all_reduce_in_place(&mut data, ReduceOp::Sum, &s)
        .expect_err("an aborted communicator accepted work");
    assert!(
        matches!(refused, CollectiveError::Aborted { .. }),
        "{refused:?}"
    );
    s.synchronize().expect("the stream drains after the abort");
}

/// A watchdog thread aborts an idle communicator (a failed peer noticed out of band) while the
/// main thread holds a global capture open.
///
/// Expected: `abort` returns, every later call is `Aborted`, and the capture ends with its one
/// node (the inline `ncclCommAbort` must not break another thread's capture either).
#[test]
fn a_watchdog_abort_during_another_threads_global_capture_leaves_the_capture_intact() {
    let (gpu, _serial) = gate!();
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).expect("kernels"));
    let comm = own_comm(&CommConfig::default().with_timeout(GENEROUS));
    let s = stream(context);
    warm_up(&comm, &s);

    let capture = HeldCapture::begin(context, &kernels, CaptureMode::Global);
    let comm = within(Duration::from_secs(30), "the watchdog's abort", move || {
        comm.abort();
        comm
    });
    let nodes = capture.end();
    assert_eq!(
        nodes.as_ref().ok(),
        Some(&1),
        "ncclCommAbort broke another thread's global capture: {nodes:?}"
    );
    assert!(comm.is_aborted());
    let mut data = upload(context, &[5u32; 16]);
    let refused = comm
        .all_reduce_in_place(&mut data, ReduceOp::Sum, &s)
        .expect_err("an aborted communicator accepted work");
    assert!(
        matches!(refused, CollectiveError::Aborted { .. }),
        "{refused:?}"
    );
    assert_eq!(data.to_vec().expect("read"), vec![5u32; 16]);
}

/// A job thread finishes and ends its process group (`finalize`, torch's
/// `destroy_process_group`) with its last all-reduce still queued, while the main thread holds
/// a global capture open.
///
/// Expected: `finalize` is a typed capture refusal (NCCL's teardown runs partly on threads of
/// its own, beyond relaxed capture mode, and broke the capture on the GPU), the rank being
/// finalised on a thread of its own once the capture has ended; the output is exact, and the
/// capture ends with its one node.
#[test]
fn finalize_with_queued_work_during_another_threads_global_capture_leaves_the_capture_intact() {
    let (gpu, _serial) = gate!();
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).expect("kernels"));
    let comm = own_comm(&CommConfig::default().with_timeout(GENEROUS));
    let s = stream(context);
    warm_up(&comm, &s);
    const N: usize = 8191;
    let input = pattern::<f64>(N, 41);
    let send = upload(context, &input);
    let mut recv = upload(context, &pattern::<f64>(N, 42));
    let flags = HostFlags::new(context, 1);
    gate_on(&kernels, &s, &flags);
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        .expect("all_reduce behind the gate");

    let capture = HeldCapture::begin(context, &kernels, CaptureMode::Global);
    flags.write(0, 1);
    let finalized = within(Duration::from_secs(30), "finalize", move || comm.finalize());
    let nodes = capture.end();
    match finalized {
        Ok(()) => {}
        Err(error) => assert!(
            is_capture_refusal(&error),
            "finalize during another thread's global capture: neither Ok nor refused: {error:?}"
        ),
    }
    assert_eq!(
        nodes.as_ref().ok(),
        Some(&1),
        "finalising a communicator broke another thread's global capture: {nodes:?}"
    );
    assert_bytes_eq("all_reduce output", &recv.to_vec().expect("read"), &input);
}

/// An elastic job makes a new process group (`init_rank`) and a subgroup of it (`split`) while
/// another thread holds a global capture open.
///
/// Expected: each is `Ok`, or a typed capture refusal (cuweave may refuse them during a
/// capture); whichever, the capture ends with its one node, and after it the communicators
/// made run an exact all-reduce. A broken capture is the failure.
#[test]
fn init_and_split_during_another_threads_global_capture_leave_the_capture_intact() {
    let (gpu, _serial) = gate!();
    let context = &gpu.context;
    let device = gpu.device;
    let kernels = Arc::new(TestKernels::load(context).expect("kernels"));
    // NCCL itself loaded, and its process-wide setup done, before the capture.
    warm_up(comm(), &stream(context));
    let id = UniqueId::new().expect("id");

    let capture = HeldCapture::begin(context, &kernels, CaptureMode::Global);
    let made = within(Duration::from_secs(60), "init and split", move || {
        let config = CommConfig::default().with_timeout(GENEROUS);
        let fresh = Communicator::init_rank(1, 0, &id, device, &config);
        let child = fresh.as_ref().ok().map(|fresh| fresh.split(Some(0), 0));
        (fresh, child)
    });
    let nodes = capture.end();
    assert_eq!(
        nodes.as_ref().ok(),
        Some(&1),
        "init_rank or split broke another thread's global capture: {nodes:?}"
    );
    let (fresh, child) = made;
    let fresh = match fresh {
        Ok(fresh) => fresh,
        Err(error) if is_capture_refusal(&error) => return,
        Err(error) => panic!("init_rank during a capture: neither Ok nor refused: {error:?}"),
    };
    let s = stream(context);
    let input = pattern::<u8>(3001, 51);
    let mut data = upload(context, &input);
    fresh
        .all_reduce_in_place(&mut data, ReduceOp::Max, &s)
        .expect("the fresh communicator's all_reduce");
    fresh.synchronize(&s).expect("wait");
    assert_bytes_eq("fresh all_reduce", &data.to_vec().expect("read"), &input);
    match child.expect("split attempted") {
        Ok(Some(child)) => {
            child
                .all_reduce_in_place(&mut data, ReduceOp::Sum, &s)
                .expect("the child's all_reduce");
            child.synchronize(&s).expect("wait");
            assert_bytes_eq("child all_reduce", &data.to_vec().expect("read"), &input);
        }
        Ok(None) => panic!("a split with a color returned no child"),
        Err(error) => assert!(
            is_capture_refusal(&error),
            "split during a capture: neither Ok nor refused: {error:?}"
        ),
    }
}

/// A training loop whose communication thread issues and awaits an all-reduce every step (each
/// behind 15 ms of compute, so each wait crosses a 10 ms tick), while another thread captures
/// graphs in global mode over and over (a compile-and-capture warm-up running beside it).
///
/// Expected: every step's wait `Ok` and the communicator never aborted; every capture of the
/// loop ends with its one node (none broken by the collectives, their tracker bookkeeping or
/// the ticks); the context's pooled events come back (at most a few in use, not one kept per
/// wait); the buffer
/// holds the input plus one per step.
#[test]
fn collectives_awaited_past_a_tick_beside_a_global_capture_loop_stay_exact_and_bounded() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let context = &gpu.context;
    let kernels = Arc::new(TestKernels::load(context).expect("kernels"));
    let (_module, inc) = incrementer(context);
    let s = stream(context);
    warm_up(comm, &s);
    comm.synchronize(&s).expect("settled");
    let events = EventPool::for_context(context).expect("event pool");
    let in_use_before = events.utilization().in_use;

    const STEPS: u32 = 150;
    const EVENT_SLACK: usize = 16;
    let input = pattern::<u32>(2053, 61);
    let mut data = upload(context, &input);

    let stop = Arc::new(AtomicBool::new(false));
    let (ended, broken) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let capturer = {
        let (stop, ended, broken) = (Arc::clone(&stop), Arc::clone(&ended), Arc::clone(&broken));
        let kernels = Arc::clone(&kernels);
        let c = stream(context);
        std::thread::spawn(move || {
            let mut failures = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let outcome = c
                    .begin_capture(CaptureMode::Global)
                    .and_then(|()| {
                        let spun = kernels.spin_ns(&c, 1000);
                        let graph = c.end_capture();
                        spun.and(graph)
                    })
                    .and_then(|graph| graph.node_count());
                match outcome {
                    Ok(1) => ended.fetch_add(1, Ordering::SeqCst),
                    other => {
                        failures.push(format!("{other:?}"));
                        broken.fetch_add(1, Ordering::SeqCst)
                    }
                };
            }
            failures
        })
    };
    let mut failures = Vec::new();
    for step in 0..STEPS {
        kernels.spin_ns(&s, 15_000_000).expect("compute");
        increment(&inc, &s, &mut data);
        if let Err(error) = comm.all_reduce_in_place(&mut data, ReduceOp::Sum, &s) {
            failures.push(format!("step {step}: all_reduce: {error:?}"));
            break;
        }
        if let Err(error) = comm.synchronize_within(&s, GENEROUS) {
            failures.push(format!("step {step}: wait: {error:?}"));
            break;
        }
    }
    let progressed = poll_until(Duration::from_secs(10), || {
        ended.load(Ordering::SeqCst) + broken.load(Ordering::SeqCst) > 0
    });
    stop.store(true, Ordering::SeqCst);
    let capture_failures = capturer.join().expect("capture thread");

    assert!(failures.is_empty(), "{failures:?}");
    assert!(!comm.is_aborted(), "a healthy communicator was aborted");
    assert!(progressed, "the capture loop never finished a capture");
    assert_eq!(
        broken.load(Ordering::SeqCst),
        0,
        "captures broken beside the collectives: {capture_failures:?}"
    );
    assert_bytes_eq(
        "after every step",
        &data.to_vec().expect("read"),
        &plus(&input, STEPS),
    );
    // The buffer's tracker and the allocator may keep a few events for the last uses; a wait
    // that kept its event would leave one per step (150).
    let returned = poll_until(Duration::from_secs(10), || {
        events.utilization().in_use <= in_use_before + EVENT_SLACK
    });
    assert!(
        returned,
        "pooled events kept by the waits: {} in use, {in_use_before} before",
        events.utilization().in_use
    );
}

// ---------------------------------------------------------------------------------------------
// Buckets, views and split communicators
// ---------------------------------------------------------------------------------------------

/// DDP with one communicator per gradient bucket (as torch users do with `new_group` per
/// bucket): a flat gradient buffer cut by `chunks_mut` into seven buckets (the last shorter),
/// six all-reduced by children split from one parent and the seventh by the parent, all in one
/// group on a communication stream, every step after a tracked kernel on the compute stream
/// writes the whole buffer (and the next step's kernel after the group's writes).
///
/// Expected: after 25 steps the buffer holds the input plus 25 (the cross-stream order held
/// both ways, for every bucket's range); no communicator aborted; the children dropped first
/// leave the parent working.
#[test]
fn per_bucket_communicators_split_from_one_parent_all_reduce_chunks_of_a_flat_buffer_in_a_group() {
    let (gpu, _serial) = gate!();
    let context = &gpu.context;
    let parent = own_comm(&CommConfig::default().with_timeout(GENEROUS));
    let (_module, inc) = incrementer(context);
    let compute = stream(context);
    let comms_stream = stream(context);
    warm_up(&parent, &comms_stream);
    let children: Vec<Communicator> = (0..6u32)
        .map(|color| {
            parent
                .split(Some(color), 0)
                .expect("split")
                .expect("a child for a color")
        })
        .collect();
    let mut buckets: Vec<&Communicator> = children.iter().collect();
    buckets.push(&parent);

    const BUCKET: usize = 1031;
    const STEPS: u32 = 25;
    let input = pattern::<u32>(6 * BUCKET + 5, 71);
    let mut grads = upload(context, &input);
    for step in 0..STEPS {
        increment(&inc, &compute, &mut grads);
        let mut chunks = grads.chunks_mut(BUCKET).expect("buckets");
        assert_eq!(chunks.len(), buckets.len());
        let mut group = Group::new();
        for (chunk, comm) in chunks.iter_mut().zip(&buckets) {
            group
                .all_reduce_in_place(comm, chunk, ReduceOp::Sum, &comms_stream)
                .expect("add a bucket");
        }
        group
            .launch()
            .unwrap_or_else(|error| panic!("step {step}: group launch: {error:?}"));
    }
    for comm in &buckets {
        comm.synchronize(&comms_stream).expect("wait");
        assert!(!comm.is_aborted());
    }
    assert_bytes_eq(
        "flat buffer after every step",
        &grads.to_vec().expect("read"),
        &plus(&input, STEPS),
    );
    drop(buckets);
    drop(children);
    let mut again = upload(context, &input);
    parent
        .all_reduce_in_place(&mut again, ReduceOp::Max, &comms_stream)
        .expect("the parent after its children are gone");
    parent.synchronize(&comms_stream).expect("wait");
    assert_bytes_eq("parent all_reduce", &again.to_vec().expect("read"), &input);
    parent.finalize().expect("finalize the parent");
}

/// A flat buffer whose first half is produced by a slow kernel on the compute stream and
/// all-reduced into its second half on the communication stream (send and receive views of
/// one buffer, from `split_at_mut`), as a fused optimizer keeps inputs and outputs in one
/// allocation.
///
/// Expected: the second half holds the first half *after* the kernel (the collective's read of
/// the head waited for the kernel's write on another stream), and the head itself is the
/// kernel's output; nothing else is written.
#[test]
fn one_half_of_a_buffer_all_reduced_into_its_other_half_waits_for_the_kernel_writing_it() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (_module, inc) = incrementer(context);
    let compute = stream(context);
    let comms_stream = stream(context);
    warm_up(comm, &comms_stream);

    const HALF: usize = 300_007;
    let head_input = pattern::<u32>(HALF, 81);
    let tail_input = pattern::<u32>(HALF, 82);
    let mut flat = upload(context, &[head_input.clone(), tail_input].concat());
    {
        let (mut head, mut tail) = flat.split_at_mut(HALF).expect("halves");
        // Long enough that a collective not ordered after the kernel reads the old head.
        kernels.spin_ns(&compute, 50_000_000).expect("spin");
        increment(&inc, &compute, &mut head);
        comm.all_reduce(&head, &mut tail, ReduceOp::Sum, &comms_stream)
            .expect("head into tail");
    }
    let got = flat.to_vec().expect("read");
    let want_head = plus(&head_input, 1);
    assert_bytes_eq("head", &got[..HALF], &want_head);
    assert_bytes_eq("tail (all_reduce of the head)", &got[HALF..], &want_head);
}

// ---------------------------------------------------------------------------------------------
// Pure CPU
// ---------------------------------------------------------------------------------------------

/// A bucketing loop that ends up with no buckets launches an empty group: `Ok`, without NCCL
/// or a driver (this test runs anywhere). And a user who wants no deadline writes
/// `Duration::MAX`: the configuration validates (no overflow, no refusal), as does a zero one.
#[test]
fn an_empty_group_launches_without_nccl_and_extreme_deadlines_validate() {
    let group = Group::new();
    assert!(group.is_empty());
    assert_eq!(group.len(), 0);
    assert_eq!(format!("{group:?}"), "[]");
    group.launch().expect("an empty group launches");
    for timeout in [Duration::MAX, Duration::ZERO, Duration::from_nanos(1)] {
        let config = CommConfig::default().with_timeout(timeout);
        assert_eq!(config.timeout, timeout);
        config
            .validate()
            .unwrap_or_else(|error| panic!("a {timeout:?} deadline: {error:?}"));
    }
}
