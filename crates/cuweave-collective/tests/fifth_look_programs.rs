//! Fifth-look programs for the collective layer, aimed at the newest code and at what the other
//! GPU tests leave out, written as torch.distributed, NCCL and cudarc users write them:
//!
//! - `CoordinatedCollectives` on a stream type of the user's own (any `AsStream`, as a pool's
//!   `PriorityStream` is): told of each cross-stream dependency wait it queues, ordered after an
//!   untracked producer only by the coordinator's dependency, and told of the device wait a
//!   collective's use tracker queues on it (a pool would otherwise hand the held stream out as
//!   idle);
//! - a DDP-style loop alternating two such lanes for 10^4 steps with a kernel and a
//!   coordinated all-reduce each step: operations, readers and bytes stay bounded and exact;
//! - coordinated calls refused by an aborted communicator or by bad lengths: typed, and every
//!   operation (the refused one and its dependency) retires;
//! - four async tasks on one thread (a plain `block_on`) each awaiting its collectives between
//!   kernels;
//! - a zero deadline: finished work is `Ok` and aborts nothing, queued work is a bounded
//!   `Timeout`;
//! - a split child of a blocking communicator is blocking: refused beside a non-blocking
//!   communicator (in a group and in `split_all`), accepted beside its parent;
//! - two GPUs (skipped with a reason on one): a coordinated call with a buffer of the other
//!   device is a typed refusal whose operation retires;
//! - pure CPU: `F16` and `Bf16` round to nearest (ties to even) and round-trip every bit
//!   pattern, the property mixed-precision gradients rely on.
//!
//! Every GPU test takes the binary's serial guard (`gate!`).

#[macro_use]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::increment::{increment, incrementer, plus};
use common::{assert_bytes_eq, comm, own_comm, pattern, skip, stream};
use cuweave_collective::{
    Bf16, CollectiveError, CommConfig, Communicator, CoordinatedCollectives, F16, Group, ReduceOp,
};
use cuweave_driver::{Context, Device, Stream};
use cuweave_event::{
    AsStream, EventPool, EventPriority, OperationCoordinator, OperationId, OperationType,
};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_test_support::host_flags::HostFlags;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::poll_until;

/// A spin long enough that work on another stream which did not wait for it runs first and
/// shows in the bytes.
const SPIN_NS: u64 = 50_000_000;

/// How long a gate holds its stream at most when a test fails before opening it.
const GATE_TIMEOUT_NS: u64 = 5_000_000_000;

/// Queues a gate on `stream`: work queued after it starts only once `flags` word 0 is 1.
fn gate_on(kernels: &TestKernels, stream: &Stream, flags: &HostFlags) {
    // SAFETY: word 0 of `flags` is mapped pinned memory of the stream's context, alive until
    // the kernel finishes (the tests open the gate, then wait, before dropping `flags`; a drop
    // opens it too); the host writes it only with volatile writes.
    unsafe { kernels.wait_u32(stream, flags.device(0), 1, GATE_TIMEOUT_NS) }.expect("gate");
}

/// A stream of the user's own, as a scheduler wraps one (a pool's `PriorityStream` is the
/// library's): it counts the device waits the coordinator tells it were queued on it.
struct Lane {
    stream: Stream,
    noted: AtomicUsize,
}

impl Lane {
    fn new(context: &Arc<Context>) -> Arc<Self> {
        Arc::new(Self {
            stream: stream(context),
            noted: AtomicUsize::new(0),
        })
    }

    fn noted(&self) -> usize {
        self.noted.load(Ordering::SeqCst)
    }
}

impl AsStream for Lane {
    fn as_stream(&self) -> &Stream {
        &self.stream
    }

    fn note_queued_wait(&self) {
        self.noted.fetch_add(1, Ordering::SeqCst);
    }
}

fn upload<T: cuweave_collective::NcclType>(
    context: &Arc<Context>,
    values: &[T],
) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(context, values).expect("upload")
}

fn coordinator(context: &Arc<Context>) -> OperationCoordinator {
    OperationCoordinator::new(EventPool::new(context, 16, 16).expect("event pool"))
        .expect("coordinator")
}

/// Retires what has finished until nothing is live (the coordinator's bound), or fails.
fn all_retired(coordinator: &OperationCoordinator, what: &str) {
    let retired = poll_until(Duration::from_secs(10), || {
        coordinator.retire_finished();
        coordinator.live_operations() == 0
    });
    assert!(
        retired,
        "{what}: {} operations still live after 10 s",
        coordinator.live_operations()
    );
}

/// Makes NCCL's lazy first-call setup happen now, not under a test's timing.
fn warm_up(comm: &Communicator, stream: &Stream) {
    let mut warm = upload(comm.context(), &[1u32; 64]);
    comm.all_reduce_in_place(&mut warm, ReduceOp::Sum, stream)
        .expect("warm-up all_reduce");
    comm.synchronize(stream).expect("warm-up");
}

// ---------------------------------------------------------------------------------------------
// CoordinatedCollectives on a stream type of the user's own
// ---------------------------------------------------------------------------------------------

/// A scheduler that wraps its streams (as a `StreamPool` hands out `PriorityStream`s) runs a
/// producer kernel as an operation on a stream P, then a coordinated all-reduce on lane 1
/// depending on it, a broadcast on lane 1 depending on the all-reduce, and a reduce on lane 2
/// depending on the broadcast. The producer writes `x` with a raw (untracked) fill behind a gate
/// the host opens only after all three calls are queued, so only the coordinator's dependency
/// orders the all-reduce after it: every output holding the fill's value proves the
/// dependency's device wait was queued on the lane's stream.
/// Each lane is told of the cross-stream wait queued on it (`note_queued_wait`, what keeps a pool
/// from handing a held stream out as idle); the coordinator counts two cross-stream waits and
/// one skipped same-stream wait, and every operation retires once finished.
#[test]
fn a_users_own_stream_type_is_told_of_dependency_waits_and_ordered_by_them() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let producer_stream = Arc::new(stream(context));
    let (lane1, lane2) = (Lane::new(context), Lane::new(context));
    warm_up(comm, &lane1.stream);
    warm_up(comm, &lane2.stream);
    let coordinator = coordinator(context);
    let collectives = CoordinatedCollectives::new(coordinator.clone());

    const N: usize = 4099;
    const FILLED: u32 = 0x00C0_FFEE;
    let x = upload(context, &pattern::<u32>(N, 1));
    let mut y = upload(context, &pattern::<u32>(N, 2));
    let mut z = upload(context, &pattern::<u32>(N, 3));
    let mut w = upload(context, &pattern::<u32>(N, 4));

    let producer = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            Some(producer_stream.as_ref()),
            &[],
            "fill x",
        )
        .expect("register producer");
    coordinator
        .begin_operation(producer, &producer_stream)
        .expect("begin producer");
    let flags = HostFlags::new(context, 1);
    gate_on(&kernels, &producer_stream, &flags);
    // SAFETY: `x` is a live device buffer of N u32 on this context; it outlives the kernel (the
    // coordinator's synchronize below waits for the whole chain, which waits for the fill), and
    // the host does not touch it until then.
    unsafe { kernels.fill_u32(&producer_stream, x.device_ptr(), FILLED, N) }.expect("fill");
    coordinator
        .complete_operation(producer)
        .expect("complete producer");

    let a = collectives
        .all_reduce(comm, &x, &mut y, ReduceOp::Max, &lane1, &[producer])
        .expect("coordinated all_reduce on lane 1");
    assert!(
        lane1.noted() >= 1,
        "lane 1 was made to wait for the producer on another stream, and not told"
    );
    let b = collectives
        .broadcast(comm, &y, &mut z, 0, &lane1, &[a])
        .expect("coordinated broadcast on lane 1");
    let c = collectives
        .reduce(comm, &z, &mut w, ReduceOp::Sum, 0, &lane2, &[b])
        .expect("coordinated reduce on lane 2");
    assert!(
        lane2.noted() >= 1,
        "lane 2 was made to wait for lane 1's broadcast, and not told"
    );
    flags.write(0, 1);
    coordinator.synchronize(c).expect("the chain finishes");

    let want = vec![FILLED; N];
    assert_bytes_eq("all_reduce of x", &y.to_vec().expect("y"), &want);
    assert_bytes_eq("broadcast of y", &z.to_vec().expect("z"), &want);
    assert_bytes_eq("reduce of z", &w.to_vec().expect("w"), &want);
    let metrics = coordinator.metrics();
    assert_eq!(
        (
            metrics.cross_stream_waits,
            metrics.same_stream_waits_skipped
        ),
        (2, 1),
        "producer→lane 1 and lane 1→lane 2 wait on the device; lane 1→lane 1 is stream order"
    );
    assert_eq!((metrics.registered, metrics.begun), (4, 4));
    all_retired(&coordinator, "after the chain");
}

/// A DDP bucket whose gradients a backward kernel wrote on the compute stream is all-reduced on
/// a communication lane of the user's scheduler with no coordinator dependency: the bucket's use
/// tracker makes the lane wait, on the device, for the kernel (held behind a closed gate until
/// the call has returned). That
/// wait holds the lane exactly as a coordinator dependency's wait does, so the lane must be told
/// of it (`AsStream::note_queued_wait`), or a `StreamPool` reading its `PriorityStream` as idle
/// hands it to the next urgent job, which then queues behind the backward kernel. The bytes
/// show the tracker ordered the call (`x0 + 1`).
///
/// Suspected gap: `CoordinatedCollectives::run` (src/coordinated.rs) queues the collective on
/// `stream.as_stream()` and never calls `stream.note_queued_wait()`, so the trackers' waits (and
/// the collective itself) are invisible to the lane's pool.
#[test]
fn a_tracker_wait_queued_by_a_coordinated_collective_is_noted_on_the_lane() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let context = &gpu.context;
    let (kernels, inc) = incrementer(context);
    let compute = stream(context);
    let lane = Lane::new(context);
    warm_up(comm, &lane.stream);
    let coordinator = coordinator(context);
    let collectives = CoordinatedCollectives::new(coordinator.clone());

    const N: usize = 1 << 16;
    let x0 = pattern::<u32>(N, 5);
    let mut bucket = upload(context, &x0);
    let flags = HostFlags::new(context, 1);
    gate_on(&kernels, &compute, &flags);
    increment(&inc, &compute, &mut bucket);
    let before = lane.noted();
    let id = collectives
        .all_reduce_in_place(comm, &mut bucket, ReduceOp::Max, &lane, &[])
        .expect("coordinated all_reduce");
    let noted = lane.noted() - before;
    flags.write(0, 1);
    coordinator.synchronize(id).expect("finishes");
    assert_bytes_eq(
        "bucket after the backward kernel and the all-reduce",
        &bucket.to_vec().expect("bucket"),
        &plus(&x0, 1),
    );
    assert!(
        noted >= 1,
        "the all-reduce's tracker queued a device wait on the lane for the compute stream's \
         kernel, but the lane was told of no wait: its pool would read it as idle while it is \
         held behind the gate"
    );
    all_retired(&coordinator, "after the bucket");
}

/// DDP's overlap over 10^4 steps: each step a kernel increments the flat gradient buffer on one
/// of two communication lanes (alternating), then a coordinated all-reduce (max) runs on that
/// lane, depending on the previous step's all-reduce on the other lane. Every 500 steps the
/// program waits for the last operation: the coordinator must then retire everything, the
/// buffer's concurrent readers stay within the two lanes, and at the end the buffer holds
/// exactly `x0 + 10^4` (every step saw the one before, across lanes). The metrics count each
/// step once.
#[test]
fn ten_thousand_coordinated_steps_alternating_two_lanes_stay_bounded_and_exact() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let context = &gpu.context;
    let (_kernels, inc) = incrementer(context);
    let lanes = [Lane::new(context), Lane::new(context)];
    warm_up(comm, &lanes[0].stream);
    let coordinator = coordinator(context);
    let collectives = CoordinatedCollectives::new(coordinator.clone());

    const N: usize = 4099;
    const STEPS: usize = 10_000;
    const CHECK: usize = 500;
    let x0 = pattern::<u32>(N, 7);
    let mut x = upload(context, &x0);
    let mut last: Option<OperationId> = None;
    let mut most_live = 0;
    for step in 0..STEPS {
        let lane = &lanes[step % 2];
        increment(&inc, &lane.stream, &mut x);
        let deps: Vec<OperationId> = last.into_iter().collect();
        let id = collectives
            .all_reduce_in_place(comm, &mut x, ReduceOp::Max, lane, &deps)
            .unwrap_or_else(|error| panic!("step {step}: {error}"));
        last = Some(id);
        most_live = most_live.max(coordinator.live_operations());
        assert!(
            most_live <= CHECK + 32,
            "step {step}: {most_live} live operations (in flight since the last wait: {})",
            step % CHECK + 1
        );
        if step % CHECK == CHECK - 1 {
            coordinator.synchronize(id).expect("checkpoint");
            all_retired(&coordinator, &format!("checkpoint at step {step}"));
            assert!(
                x.concurrent_readers() <= 2,
                "step {step}: {} concurrent readers",
                x.concurrent_readers()
            );
        }
    }
    assert_bytes_eq(
        "after 10^4 steps",
        &x.to_vec().expect("download"),
        &plus(&x0, STEPS as u32),
    );
    let metrics = coordinator.metrics();
    assert_eq!(
        (metrics.registered, metrics.begun, metrics.cancelled),
        (STEPS as u64, STEPS as u64, 0)
    );
    let noted = lanes[0].noted() + lanes[1].noted();
    assert!(
        noted as u64 >= metrics.cross_stream_waits && noted <= 2 * STEPS,
        "lanes told of {noted} waits, the coordinator queued {}",
        metrics.cross_stream_waits
    );
}

/// torch's process group after `abort()`, still driven by the program's scheduler: a
/// coordinated all-reduce on an aborted communicator, depending on a producer operation, is a
/// typed `Aborted` and leaves the buffer as it was; on a healthy communicator a coordinated
/// all-reduce whose output is shorter than its input is a typed `InvalidArgument`. In both cases
/// the refused operation is completed at a point with no work of its own, so it and the
/// producer it depended on retire, and a later operation may run on the same lane.
#[test]
fn coordinated_calls_refused_by_an_abort_or_bad_lengths_are_typed_and_retire() {
    let (gpu, _serial) = gate!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let aborted = own_comm(&CommConfig::default());
    let lane = Lane::new(context);
    warm_up(&aborted, &lane.stream);
    aborted.abort();
    assert!(aborted.is_aborted());
    let coordinator = coordinator(context);
    let collectives = CoordinatedCollectives::new(coordinator.clone());
    let producer_stream = Arc::new(stream(context));

    const N: usize = 1021;
    let x0 = pattern::<u32>(N, 9);
    let mut x = upload(context, &x0);
    let producer = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            Some(producer_stream.as_ref()),
            &[],
            "producer",
        )
        .expect("register");
    coordinator
        .begin_operation(producer, &producer_stream)
        .expect("begin");
    kernels.spin_ns(&producer_stream, SPIN_NS).expect("spin");
    coordinator.complete_operation(producer).expect("complete");

    let refused =
        collectives.all_reduce_in_place(&aborted, &mut x, ReduceOp::Sum, &lane, &[producer]);
    assert!(
        matches!(refused, Err(CollectiveError::Aborted { .. })),
        "on an aborted communicator: {refused:?}"
    );
    all_retired(&coordinator, "after the aborted call");
    assert_bytes_eq("x after the refused call", &x.to_vec().expect("x"), &x0);

    let healthy = comm();
    let short = upload(context, &pattern::<u32>(N - 1, 2));
    let mut out = upload(context, &pattern::<u32>(N - 2, 3));
    let refused = collectives.all_reduce(healthy, &short, &mut out, ReduceOp::Sum, &lane, &[]);
    assert!(
        matches!(refused, Err(CollectiveError::InvalidArgument { .. })),
        "lengths {} and {}: {refused:?}",
        N - 1,
        N - 2
    );
    all_retired(&coordinator, "after the refused lengths");

    // The lane and the coordinator still serve.
    let id = collectives
        .all_reduce_in_place(healthy, &mut x, ReduceOp::Sum, &lane, &[])
        .expect("a later call");
    coordinator.synchronize(id).expect("finishes");
    assert_bytes_eq("x after a later call", &x.to_vec().expect("x"), &x0);
    all_retired(&coordinator, "after the later call");
    let metrics = coordinator.metrics();
    assert_eq!(metrics.registered, metrics.begun);
}

// ---------------------------------------------------------------------------------------------
// Awaiting, deadlines, splits
// ---------------------------------------------------------------------------------------------

/// An async training loop with four concurrent tasks on one executor thread (a plain
/// `block_on` over `join_all`): each task owns a stream and a buffer and, 48 times, increments
/// it with a kernel, all-reduces it in place (max) and awaits `comm.completion`. A waker lost
/// between tasks hangs the loop (bounded by the communicator's deadline, then a `Timeout`);
/// every buffer ending at exactly `x0 + 48` proves each await saw its own stream's work.
#[test]
fn four_async_tasks_on_one_thread_await_their_collectives_between_kernels() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let context = &gpu.context;
    let (_kernels, inc) = incrementer(context);
    const N: usize = 3001;
    const STEPS: u32 = 48;
    let streams: Vec<Stream> = (0..4).map(|_| stream(context)).collect();
    warm_up(comm, &streams[0]);
    let starts: Vec<Vec<u32>> = (0..4).map(|t| pattern::<u32>(N, 20 + t)).collect();
    let mut buffers: Vec<DeviceBuffer<u32>> = starts.iter().map(|s| upload(context, s)).collect();
    let started = Instant::now();
    let tasks = buffers
        .iter_mut()
        .zip(&streams)
        .map(|(buffer, s)| {
            let inc = &inc;
            async move {
                for step in 0..STEPS {
                    increment(inc, s, buffer);
                    comm.all_reduce_in_place(buffer, ReduceOp::Max, s)
                        .expect("all_reduce");
                    comm.completion(s)
                        .expect("future")
                        .await
                        .unwrap_or_else(|error| panic!("step {step}: {error}"));
                }
            }
        })
        .collect::<Vec<_>>();
    futures::executor::block_on(futures::future::join_all(tasks));
    assert!(!comm.is_aborted());
    for (t, (buffer, start)) in buffers.iter().zip(&starts).enumerate() {
        assert_bytes_eq(
            &format!("task {t}"),
            &buffer.to_vec().expect("download"),
            &plus(start, STEPS),
        );
    }
    eprintln!("4 × {STEPS} awaited steps took {:?}", started.elapsed());
}

/// A zero deadline (a health check that must not block): on a stream whose collective has
/// already finished, `synchronize_within(ZERO)` and an awaited `completion_within(ZERO)` are
/// `Ok` and abort nothing; on a stream held 1.5 s behind a spin with an all-reduce queued after
/// it, `synchronize_within(ZERO)` is a typed `Timeout` returned long before the spin ends, the
/// communicator is aborted, and the buffer is still downloadable once the stream drains.
#[test]
fn a_zero_deadline_is_ok_for_finished_work_and_a_bounded_timeout_for_queued_work() {
    let (gpu, _serial) = gate!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let comm = own_comm(&CommConfig::default());
    let s = stream(context);
    warm_up(&comm, &s);
    let x0 = pattern::<u32>(2048, 4);
    let mut x = upload(context, &x0);
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s)
        .expect("all_reduce");
    s.synchronize().expect("stream drains");
    comm.synchronize_within(&s, Duration::ZERO)
        .expect("finished work with a zero deadline");
    futures::executor::block_on(comm.completion_within(&s, Duration::ZERO).expect("future"))
        .expect("finished work awaited with a zero deadline");
    assert!(!comm.is_aborted(), "finished work aborted the communicator");

    kernels.spin_ns(&s, 30 * SPIN_NS).expect("spin");
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s)
        .expect("queued all_reduce");
    let started = Instant::now();
    let waited = comm.synchronize_within(&s, Duration::ZERO);
    let took = started.elapsed();
    assert!(
        matches!(waited, Err(CollectiveError::Timeout { .. })),
        "queued work with a zero deadline: {waited:?}"
    );
    assert!(
        took < Duration::from_secs(1),
        "a zero deadline held the caller {took:?}, behind the 1.5 s spin"
    );
    assert!(comm.is_aborted());
    assert!(matches!(
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s),
        Err(CollectiveError::Aborted { .. })
    ));
    s.synchronize().expect("the stream drains after the abort");
    assert_eq!(x.to_vec().expect("download").len(), x0.len());
}

/// A process group made blocking (`NCCL_COMM_BLOCKING=1`'s config field) and split into a
/// subgroup: the child inherits blocking, so a group holding the child and a non-blocking
/// communicator is an `InvalidArgument` before NCCL sees it (both buffers untouched), and so is
/// `split_all` over a blocking and a non-blocking parent; a group of the child with its own
/// (blocking) parent runs, byte-exact, and the child is finalised before the parent.
#[test]
fn a_split_child_of_a_blocking_communicator_keeps_blocking_in_group_checks() {
    let (gpu, _serial) = gate!();
    let context = &gpu.context;
    let blocking = own_comm(&CommConfig::default().with_blocking(true));
    let child = blocking
        .split(Some(0), 0)
        .expect("split")
        .expect("color 0 makes a child");
    assert!(child.config().blocking, "the child inherits blocking");
    let other = own_comm(&CommConfig::default());
    assert!(!other.config().blocking);
    let s = stream(context);

    const N: usize = 777;
    let a0 = pattern::<f32>(N, 1);
    let b0 = pattern::<f32>(N, 2);
    let mut a = upload(context, &a0);
    let mut b = upload(context, &b0);
    // A one-rank sum is the identity: what is checked is that the refusal queued nothing and
    // left both communicators healthy.
    {
        let mut group = Group::new();
        group
            .all_reduce_in_place(&child, &mut a, ReduceOp::Sum, &s)
            .expect("child's call");
        group
            .all_reduce_in_place(&other, &mut b, ReduceOp::Sum, &s)
            .expect("non-blocking call");
        let refused = group.launch();
        assert!(
            matches!(refused, Err(CollectiveError::InvalidArgument { .. })),
            "a blocking child beside a non-blocking communicator: {refused:?}"
        );
    }
    assert!(!child.is_aborted() && !other.is_aborted());
    assert_bytes_eq("a", &a.to_vec().expect("a"), &a0);
    assert_bytes_eq("b", &b.to_vec().expect("b"), &b0);

    let refused = Communicator::split_all(&[&blocking, &other], &[(Some(0), 0), (Some(0), 0)]);
    assert!(
        matches!(refused, Err(CollectiveError::InvalidArgument { .. })),
        "split_all over a blocking and a non-blocking parent: {refused:?}"
    );
    assert!(!blocking.is_aborted() && !other.is_aborted());

    let mut into = upload(context, &pattern::<f32>(N, 3));
    {
        let mut group = Group::new();
        group
            .broadcast(&child, &a, &mut into, 0, &s)
            .expect("child's broadcast");
        group
            .all_reduce_in_place(&blocking, &mut b, ReduceOp::Max, &s)
            .expect("parent's all_reduce");
        group.launch().expect("child and parent, both blocking");
    }
    child.synchronize(&s).expect("child's work");
    assert_bytes_eq("broadcast", &into.to_vec().expect("into"), &a0);
    assert_bytes_eq("parent's max", &b.to_vec().expect("b"), &b0);
    child.finalize().expect("finalize the child");
    blocking.finalize().expect("finalize the parent");
    other.finalize().expect("finalize the other");
}

// ---------------------------------------------------------------------------------------------
// Two GPUs
// ---------------------------------------------------------------------------------------------

/// A pipeline that picked the wrong device's buffer: a one-rank communicator on device 0 asked,
/// through `CoordinatedCollectives` on a lane of device 0, to all-reduce a buffer of device 1.
/// The call is a typed `InvalidArgument` naming both devices, nothing reaches NCCL, the buffer
/// on device 1 is untouched, the registered operation retires, and the lane then runs a correct
/// call. Skipped with a reason on one GPU.
#[test]
fn two_gpus_a_coordinated_call_on_the_other_devices_buffer_is_typed_and_retires() {
    let (gpu, _serial) = gate!();
    let devices = Device::all().expect("devices");
    if devices.len() < 2 {
        skip(
            "fifth_look_programs::two_gpus_a_coordinated_call_on_the_other_devices_buffer_is_typed_and_retires",
            &format!("needs two GPUs, found {}", devices.len()),
        );
        return;
    }
    let comm = comm();
    let context = &gpu.context;
    let other = Context::primary(devices[1]).expect("device 1's context");
    let lane = Lane::new(context);
    let coordinator = coordinator(context);
    let collectives = CoordinatedCollectives::new(coordinator.clone());
    const N: usize = 513;
    let far0 = pattern::<i32>(N, 6);
    let mut far = upload(&other, &far0);
    let refused = collectives.all_reduce_in_place(comm, &mut far, ReduceOp::Sum, &lane, &[]);
    match &refused {
        Err(error @ CollectiveError::InvalidArgument { .. }) => {
            let text = error.to_string();
            assert!(
                text.contains("device 0") && text.contains("on 1"),
                "the refusal names both devices: {text}"
            );
        }
        unexpected => panic!("a buffer of device 1 on a rank of device 0: {unexpected:?}"),
    }
    all_retired(&coordinator, "after the refused call");
    assert_bytes_eq("far buffer", &far.to_vec().expect("far"), &far0);
    let mut near = upload(context, &far0);
    let id = collectives
        .all_reduce_in_place(comm, &mut near, ReduceOp::Sum, &lane, &[])
        .expect("a correct call");
    coordinator.synchronize(id).expect("finishes");
    assert_bytes_eq("near buffer", &near.to_vec().expect("near"), &far0);
}

// ---------------------------------------------------------------------------------------------
// Pure CPU
// ---------------------------------------------------------------------------------------------

/// Whether `got` is the nearest of its neighbours `candidates` to `value` (exact in f64), ties
/// going to the even bit pattern.
fn nearest_ties_even(value: f32, got: u16, to_f32: impl Fn(u16) -> f32, candidates: &[u16]) {
    let v = f64::from(value);
    let d = (f64::from(to_f32(got)) - v).abs();
    for &c in candidates {
        let dc = (f64::from(to_f32(c)) - v).abs();
        assert!(
            d < dc || (d == dc && got.is_multiple_of(2)),
            "{value:e} rounded to {got:#06x} ({}), but {c:#06x} ({}) is as near or nearer",
            to_f32(got),
            to_f32(c)
        );
    }
}

/// Mixed-precision gradients are converted on the host before the all-reduce and back after
/// it (a checkpoint loader, a loss-scale check): `F16` and `Bf16` must round f32 to the nearest
/// value, ties to even, as CUDA's `__float2half_rn` and `__float2bfloat16_rn` do, overflow to
/// infinity only past the halfway point above the largest finite value, keep NaN a NaN and the
/// sign of zero; and every one of the 65 536 bit patterns must survive `to_f32` then
/// `from_f32` unchanged (NaNs staying NaNs), since collectives move bits, not values. Checked
/// over 2·10^5 f32 values spread over every exponent, against the neighbours of each result.
#[test]
fn f16_and_bf16_round_to_nearest_even_and_round_trip_every_bit_pattern() {
    for bits in 0..=u16::MAX {
        let h = F16::from_bits(bits);
        let back = F16::from_f32(h.to_f32());
        if h.to_f32().is_nan() {
            assert!(
                back.to_f32().is_nan(),
                "F16 NaN {bits:#06x} came back {back:?}"
            );
        } else {
            assert_eq!(back.to_bits(), bits, "F16 {bits:#06x} ({})", h.to_f32());
        }
        let b = Bf16::from_bits(bits);
        let back = Bf16::from_f32(b.to_f32());
        if b.to_f32().is_nan() {
            assert!(
                back.to_f32().is_nan(),
                "Bf16 NaN {bits:#06x} came back {back:?}"
            );
        } else {
            assert_eq!(back.to_bits(), bits, "Bf16 {bits:#06x} ({})", b.to_f32());
        }
    }

    let f16 = |bits: u16| F16::from_bits(bits).to_f32();
    let bf16 = |bits: u16| Bf16::from_bits(bits).to_f32();
    // Deterministic f32 bit patterns over every exponent (an LCG), positive finite ones.
    let mut lcg = cuweave_test_support::lcg::Lcg::new(0x9E37_79B9_7F4A_7C15);
    for _ in 0..200_000 {
        let value = f32::from_bits((lcg.next_state() >> 33) as u32 & 0x7fff_ffff);
        if !value.is_finite() {
            continue;
        }
        // F16: finite below 65 520 (the midpoint between 65 504 and 2^16), infinity from it.
        let h = F16::from_f32(value).to_bits();
        if value >= 65_520.0 {
            assert_eq!(h, 0x7c00, "{value:e} overflows F16 to infinity");
        } else {
            assert!(h < 0x7c00, "{value:e} is finite in F16, got {h:#06x}");
            let mut around = vec![h + 1];
            if h > 0 {
                around.push(h - 1);
            }
            around.retain(|&c| c < 0x7c00);
            nearest_ties_even(value, h, f16, &around);
        }
        assert_eq!(
            F16::from_f32(-value).to_bits(),
            h | 0x8000,
            "F16 of {:e} is F16 of {value:e} negated",
            -value
        );
        // Bf16: finite up to the midpoint above its largest finite value (0x7f7f).
        let b = Bf16::from_f32(value).to_bits();
        if b == 0x7f80 {
            let limit =
                f64::from(bf16(0x7f7f)) + (f64::from(bf16(0x7f7f)) - f64::from(bf16(0x7f7e))) / 2.0;
            assert!(f64::from(value) >= limit, "{value:e} overflowed Bf16 early");
        } else {
            assert!(b < 0x7f80, "{value:e} is finite in Bf16, got {b:#06x}");
            let mut around = vec![b + 1];
            if b > 0 {
                around.push(b - 1);
            }
            around.retain(|&c| c < 0x7f80);
            nearest_ties_even(value, b, bf16, &around);
        }
        assert_eq!(Bf16::from_f32(-value).to_bits(), b | 0x8000);
    }

    // Exact ties and edges.
    assert_eq!(
        F16::from_f32(65_519.0).to_bits(),
        0x7bff,
        "below the midpoint: 65 504"
    );
    assert_eq!(
        F16::from_f32(65_520.0).to_bits(),
        0x7c00,
        "the midpoint ties to even: ∞"
    );
    assert_eq!(
        F16::from_f32(2.0f32.powi(-25)).to_bits(),
        0x0000,
        "half the least subnormal: 0"
    );
    assert_eq!(
        F16::from_f32(f32::from_bits(0x3300_0001)).to_bits(),
        0x0001,
        "just above half the least subnormal"
    );
    assert_eq!(
        F16::from_f32(1.0 + 2.0f32.powi(-11)).to_bits(),
        0x3c00,
        "tie to even: 1.0"
    );
    assert_eq!(
        F16::from_f32(1.0 + 3.0 * 2.0f32.powi(-11)).to_bits(),
        0x3c02,
        "tie to even: up"
    );
    assert_eq!(F16::from_f32(-0.0).to_bits(), 0x8000, "negative zero");
    assert!(F16::from_f32(f32::NAN).to_f32().is_nan());
    assert_eq!(F16::from_f32(f32::NEG_INFINITY).to_bits(), 0xfc00);
    assert_eq!(
        Bf16::from_f32(1.0 + 2.0f32.powi(-8)).to_bits(),
        0x3f80,
        "tie to even: 1.0"
    );
    assert_eq!(
        Bf16::from_f32(1.0 + 3.0 * 2.0f32.powi(-8)).to_bits(),
        0x3f82,
        "tie to even: up"
    );
    assert_eq!(
        Bf16::from_f32(f32::MAX).to_bits(),
        0x7f80,
        "past the midpoint: ∞"
    );
    assert_eq!(Bf16::from_f32(-0.0).to_bits(), 0x8000);
    assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    assert!(Bf16::from_f32(-f32::NAN).to_f32().is_nan());
}
