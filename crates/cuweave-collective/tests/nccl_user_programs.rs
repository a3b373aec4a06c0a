//! Small programs written the way users of NCCL, nccl-tests and torch DDP/FSDP write them, on
//! what the other GPU tests leave out: DDP's gradient buckets as views of one flat buffer over
//! training steps, FSDP's all-gather / reduce-scatter on side streams, an nccl-tests sweep of odd
//! counts carrying NaN, infinities and integer extremes, many tiny calls coalesced in one group,
//! collectives on the legacy default stream and a high-priority stream, futures dropped, moved
//! to another thread or outliving their communicator, a coordinated DAG mixing the user's own
//! operations with a group, communicators and split children made and destroyed in a loop with
//! their memory and threads counted, process groups made concurrently by several threads, an
//! abort racing a busy issuing thread, a group holding an aborted communicator, and bad input.
//! Two-GPU programs (FSDP slots, another device's buffers, a wait on a collective cut short by an
//! abort) skip with a reason on one GPU.
//!
//! Every test takes the binary's serial guard: the loop test counts device memory and threads,
//! which other tests of this binary running beside it would disturb.

#[macro_use]
mod common;

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Pattern, assert_bytes_eq, comm, own_comm, pattern, skip, stream};
use cuweave_collective::{
    Bf16, CollectiveError, CollectiveFuture, CommConfig, Communicator, CoordinatedCollectives, F16,
    Group, NcclType, ReduceOp, UniqueId,
};
use cuweave_driver::{Context, Device, Stream, StreamFlags};
use cuweave_event::{
    EventPool, EventPriority, OperationCoordinator, OperationState, OperationType,
};
use cuweave_memory::{Buffer, BufferSlice, DeviceBuffer, PinnedBuffer};
use cuweave_test_support::kernels::TestKernels;
use futures::FutureExt as _;

/// 50 ms of a spinning kernel: work queued behind it on its stream starts that late, so work on
/// another stream that did not wait for it would run first and show in the bytes.
const SPIN_NS: u64 = 50_000_000;

fn upload<T: NcclType>(context: &Arc<Context>, values: &[T]) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(context, values).expect("upload")
}

/// Every device, or `None` after printing why the two-GPU program is skipped.
fn two_devices_or_skip(test: &str) -> Option<Vec<Device>> {
    let devices = Device::all().expect("devices");
    if devices.len() < 2 {
        skip(
            &format!("nccl_user_programs::{test}"),
            &format!(
                "needs two GPUs, found {} (multi-rank program)",
                devices.len()
            ),
        );
        return None;
    }
    Some(devices)
}

fn invalid(what: &str, result: Result<(), CollectiveError>) {
    assert!(
        matches!(result, Err(CollectiveError::InvalidArgument { .. })),
        "{what}: {result:?}"
    );
}

/// DDP: each step the backward pass writes every gradient bucket (a view of one flat buffer) on
/// the compute stream behind a spin; each bucket is all-reduced out of place on a high-priority
/// communication stream (itself held behind a spin, so its reads are late); the optimizer copies
/// the whole reduced buffer into the step's row of a history on the compute stream. No host
/// wait between steps: the bytes of every row prove each bucket's collective read that step's
/// gradients (not the previous step's, not the stale ones) and the whole-buffer copy waited for
/// all three bucket writes on the other stream.
#[test]
fn ddp_steps_all_reduce_gradient_buckets_of_one_flat_buffer_on_a_priority_stream() {
    let (_gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let kernels = TestKernels::load(context).expect("kernels");
    let compute = stream(context);
    let highest = context.stream_priority_range().expect("range").greatest;
    let comm_stream = Stream::with_priority(context, StreamFlags::NON_BLOCKING, highest)
        .expect("high-priority stream");
    const LEN: usize = 5130;
    const STEPS: usize = 3;
    let buckets: [Range<usize>; 3] = [0..1000, 1000..5097, 5097..LEN];
    let value = |step: usize, bucket: usize| (step * 10 + bucket + 1) as f32 * 0.5;
    let mut grads = upload(context, &pattern::<f32>(LEN, 77));
    let mut reduced = upload(context, &pattern::<f32>(LEN, 78));
    let mut history = DeviceBuffer::<f32>::zeroed(context, LEN * STEPS).expect("history");
    for step in 0..STEPS {
        kernels.spin_ns(&compute, SPIN_NS).expect("spin");
        for (b, range) in buckets.iter().enumerate() {
            grads
                .slice_mut(range.clone())
                .expect("bucket")
                .fill_async(value(step, b), &compute)
                .expect("backward");
        }
        kernels.spin_ns(&comm_stream, SPIN_NS).expect("spin");
        for (b, range) in buckets.iter().enumerate() {
            // DDP averages; every other bucket sums (a hook that divides by the world itself).
            let op = if b % 2 == 0 {
                ReduceOp::Avg
            } else {
                ReduceOp::Sum
            };
            comm.all_reduce(
                &grads.slice(range.clone()).expect("bucket"),
                &mut reduced.slice_mut(range.clone()).expect("bucket"),
                op,
                &comm_stream,
            )
            .expect("all_reduce");
        }
        history
            .slice_mut(step * LEN..(step + 1) * LEN)
            .expect("row")
            .copy_from_async(&reduced, &compute)
            .expect("optimizer reads the reduced gradients");
    }
    let got = history.to_vec().expect("download");
    for step in 0..STEPS {
        let mut want = vec![0.0f32; LEN];
        for (b, range) in buckets.iter().enumerate() {
            want[range.clone()].fill(value(step, b));
        }
        assert_bytes_eq(
            &format!("step {step}"),
            &got[step * LEN..(step + 1) * LEN],
            &want,
        );
    }
}

/// FSDP on one rank: the shard is copied into the rank's slot of the flat bf16 parameters on
/// the compute stream (late, behind a spin); the in-place all-gather runs on an all-gather
/// stream and the forward pass reads the unsharded parameters on the compute stream; the f32
/// gradients, written late, are averaged by a reduce-scatter on a third stream held behind a
/// spin, while the next micro-batch overwrites them at once on the compute stream. Each result
/// is the bytes the program means, so every cross-stream edge was ordered.
#[test]
fn fsdp_step_all_gathers_bf16_params_and_reduce_scatters_f32_grads_on_side_streams() {
    let (_gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let kernels = TestKernels::load(context).expect("kernels");
    let (compute, gather, scatter) = (stream(context), stream(context), stream(context));
    const N: usize = 12_289;
    let (rank, size) = (comm.rank(), comm.size());
    let shard: Vec<Bf16> = pattern(N, 3);
    let shard_buffer = upload(context, &shard);
    let mut flat = upload(context, &pattern::<Bf16>(N * size, 90));
    kernels.spin_ns(&compute, SPIN_NS).expect("spin");
    flat.slice_mut(rank * N..(rank + 1) * N)
        .expect("this rank's slot")
        .copy_from_async(&shard_buffer, &compute)
        .expect("shard into its slot");
    comm.all_gather_in_place(&mut flat, &gather)
        .expect("all_gather_in_place");
    let mut unsharded = DeviceBuffer::<Bf16>::zeroed(context, N * size).expect("unsharded");
    unsharded
        .copy_from_async(&flat, &compute)
        .expect("forward reads the gathered parameters");

    let grad_values: Vec<f32> = pattern(N * size, 4);
    let grad_source = upload(context, &grad_values);
    let mut grads = DeviceBuffer::<f32>::zeroed(context, N * size).expect("grads");
    kernels.spin_ns(&compute, SPIN_NS).expect("spin");
    grads
        .copy_from_async(&grad_source, &compute)
        .expect("backward");
    let mut shard_grads = upload(context, &pattern::<f32>(N, 91));
    kernels.spin_ns(&scatter, SPIN_NS).expect("spin");
    comm.reduce_scatter(&grads, &mut shard_grads, ReduceOp::Avg, &scatter)
        .expect("reduce_scatter");
    grads
        .fill_async(-1.0, &compute)
        .expect("the next micro-batch overwrites the gradients");
    let mut updated = DeviceBuffer::<f32>::zeroed(context, N).expect("updated");
    updated
        .copy_from_async(&shard_grads, &compute)
        .expect("optimizer reads the shard's gradients");

    let want_unsharded: Vec<Bf16> = shard.repeat(size);
    assert_bytes_eq(
        "gathered",
        &flat.to_vec().expect("download"),
        &want_unsharded,
    );
    assert_bytes_eq(
        "forward saw the gathered parameters",
        &unsharded.to_vec().expect("download"),
        &want_unsharded,
    );
    assert_bytes_eq(
        "the reduce-scatter read the gradients before the overwrite",
        &updated.to_vec().expect("download"),
        &grad_values[rank * N..(rank + 1) * N],
    );
    assert_bytes_eq(
        "the overwrite landed after the read",
        &grads.to_vec().expect("download"),
        &vec![-1.0; N * size],
    );
}

/// Values nccl-tests' data checks and AMP's `found_inf` care about: NaNs with payloads,
/// infinities, negative zero, subnormals, type extremes.
trait Special: NcclType + std::fmt::Debug {
    fn special(i: usize) -> Self;
}

impl Special for f32 {
    fn special(i: usize) -> Self {
        const BITS: [u32; 8] = [
            0x7fc0_0001, // quiet NaN with a payload
            0xffa0_0000, // negative NaN
            0x8000_0000, // -0.0
            0x7f80_0000, // +inf
            0xff80_0000, // -inf
            0x0000_0001, // smallest subnormal
            0x7f7f_ffff, // f32::MAX
            0x3f80_0000, // 1.0
        ];
        if i.is_multiple_of(3) {
            f32::from_bits(BITS[(i / 3) % BITS.len()])
        } else {
            f32::at(i, 5)
        }
    }
}

impl Special for f64 {
    fn special(i: usize) -> Self {
        const BITS: [u64; 6] = [
            0x7ff8_0000_0000_0abc,
            0x8000_0000_0000_0000,
            0x7ff0_0000_0000_0000,
            0xfff0_0000_0000_0000,
            0x0000_0000_0000_0001,
            0xffef_ffff_ffff_ffff,
        ];
        if i.is_multiple_of(2) {
            f64::from_bits(BITS[(i / 2) % BITS.len()])
        } else {
            f64::at(i, 6)
        }
    }
}

impl Special for F16 {
    fn special(i: usize) -> Self {
        const BITS: [u16; 7] = [0x7e01, 0xfe00, 0x8000, 0x7c00, 0xfc00, 0x0001, 0x7bff];
        if i.is_multiple_of(2) {
            F16::from_bits(BITS[(i / 2) % BITS.len()])
        } else {
            F16::at(i, 7)
        }
    }
}

impl Special for Bf16 {
    fn special(i: usize) -> Self {
        const BITS: [u16; 7] = [0x7fc1, 0xffc0, 0x8000, 0x7f80, 0xff80, 0x0001, 0x7f7f];
        if i.is_multiple_of(2) {
            Bf16::from_bits(BITS[(i / 2) % BITS.len()])
        } else {
            Bf16::at(i, 8)
        }
    }
}

impl Special for i8 {
    fn special(i: usize) -> Self {
        [i8::MIN, i8::MAX, -1, 0, 1][i % 5]
    }
}

impl Special for u64 {
    fn special(i: usize) -> Self {
        [u64::MAX, 0, 1 << 63, 1, u64::MAX - 1][i % 5]
    }
}

/// nccl-tests `-b 1 -e ... -f 7` with data checks, on one rank: every reduction out of place
/// and in place, broadcast, reduce, all-gather and reduce-scatter, for counts 7^k from 1, byte
/// for byte (a 1-rank collective is NCCL's copy: NaN payloads and -0.0 must survive).
fn sweep<T: Special>(comm: &Communicator, stream: &Stream) {
    let context = comm.context();
    let name = std::any::type_name::<T>();
    for count in [1usize, 7, 49, 343, 2401, 16_807, 117_649] {
        let input: Vec<T> = (0..count).map(T::special).collect();
        let stale: Vec<T> = (0..count).map(|i| T::special(i + 1)).collect();
        let send = upload(context, &input);
        let what = |call: &str| format!("{call} of {count} × {name}");
        for op in ReduceOp::ALL {
            let mut recv = upload(context, &stale);
            comm.all_reduce(&send, &mut recv, op, stream)
                .expect("all_reduce");
            assert_bytes_eq(
                &what(&format!("all_reduce {op:?}")),
                &recv.to_vec().expect("download"),
                &input,
            );
            let mut recv = upload(context, &stale);
            comm.reduce(&send, &mut recv, op, 0, stream)
                .expect("reduce");
            assert_bytes_eq(
                &what(&format!("reduce {op:?}")),
                &recv.to_vec().expect("download"),
                &input,
            );
            let mut recv = upload(context, &stale);
            comm.reduce_scatter(&send, &mut recv, op, stream)
                .expect("reduce_scatter");
            assert_bytes_eq(
                &what(&format!("reduce_scatter {op:?}")),
                &recv.to_vec().expect("download"),
                &input,
            );
            let mut buffer = upload(context, &input);
            comm.all_reduce_in_place(&mut buffer, op, stream)
                .expect("all_reduce_in_place");
            assert_bytes_eq(
                &what(&format!("all_reduce_in_place {op:?}")),
                &buffer.to_vec().expect("download"),
                &input,
            );
        }
        let mut recv = upload(context, &stale);
        comm.broadcast(&send, &mut recv, 0, stream)
            .expect("broadcast");
        assert_bytes_eq(
            &what("broadcast"),
            &recv.to_vec().expect("download"),
            &input,
        );
        let mut recv = upload(context, &stale);
        comm.all_gather(&send, &mut recv, stream)
            .expect("all_gather");
        assert_bytes_eq(
            &what("all_gather"),
            &recv.to_vec().expect("download"),
            &input,
        );
    }
}

#[test]
fn nccl_tests_sweep_of_counts_7_to_the_k_carries_nan_inf_and_extremes_byte_exact() {
    let (_gpu, _serial) = gate!();
    let comm = comm();
    let s = stream(comm.context());
    sweep::<f32>(comm, &s);
    sweep::<f64>(comm, &s);
    sweep::<F16>(comm, &s);
    sweep::<Bf16>(comm, &s);
    sweep::<i8>(comm, &s);
    sweep::<u64>(comm, &s);
    assert!(!comm.is_aborted());
}

/// DDP's coalescing (and torch's `_coalescing_manager`): 96 small calls of every kind in one
/// group, their inputs views of one flat buffer (many of one element), spread over four
/// streams, plus self send/receive pairs; every output byte-exact, every stale byte around the
/// outputs untouched.
#[test]
fn many_tiny_calls_coalesced_in_one_group_over_four_streams_are_byte_exact() {
    let (_gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let streams: Vec<Stream> = (0..4).map(|_| stream(context)).collect();
    const CALLS: usize = 96;
    let sizes: Vec<usize> = (0..CALLS)
        .map(|i| if i % 3 == 0 { 1 } else { (i * 37) % 97 + 1 })
        .collect();
    let starts: Vec<usize> = sizes
        .iter()
        .scan(0, |at, size| {
            let start = *at;
            *at += size;
            Some(start)
        })
        .collect();
    let total: usize = sizes.iter().sum();
    let input: Vec<f32> = pattern(total, 9);
    let flat = upload(context, &input);
    let views: Vec<BufferSlice<'_, f32>> = starts
        .iter()
        .zip(&sizes)
        .map(|(&start, &size)| flat.slice(start..start + size).expect("view"))
        .collect();
    let mut outputs: Vec<DeviceBuffer<f32>> = sizes
        .iter()
        .map(|&size| upload(context, &pattern::<f32>(size, 55)))
        .collect();
    let bytes_in: Vec<u8> = pattern(CALLS, 10);
    let byte_sources: Vec<DeviceBuffer<u8>> = (0..4)
        .map(|i| upload(context, &bytes_in[i * 24..(i + 1) * 24]))
        .collect();
    let mut byte_sinks: Vec<DeviceBuffer<u8>> = (0..4)
        .map(|_| DeviceBuffer::<u8>::zeroed(context, 24).expect("sink"))
        .collect();
    {
        let mut group = Group::new();
        for (i, (view, output)) in views.iter().zip(&mut outputs).enumerate() {
            let s = &streams[i % streams.len()];
            let op = ReduceOp::ALL[(i / 5) % ReduceOp::ALL.len()];
            match i % 5 {
                0 => group.all_reduce(comm, view, output, op, s),
                1 => group.broadcast(comm, view, output, 0, s),
                2 => group.reduce(comm, view, output, op, 0, s),
                3 => group.all_gather(comm, view, output, s),
                _ => group.reduce_scatter(comm, view, output, op, s),
            }
            .expect("add");
        }
        for (i, (source, sink)) in byte_sources.iter().zip(&mut byte_sinks).enumerate() {
            let s = &streams[i];
            group.send(comm, source, 0, s).expect("send");
            group.recv(comm, sink, 0, s).expect("recv");
        }
        assert_eq!(group.len(), CALLS + 8);
        group.launch().expect("one launch");
    }
    for (i, (output, (&start, &size))) in outputs.iter().zip(starts.iter().zip(&sizes)).enumerate()
    {
        assert_bytes_eq(
            &format!("call {i} ({size} elements)"),
            &output.to_vec().expect("download"),
            &input[start..start + size],
        );
    }
    for (i, sink) in byte_sinks.iter().enumerate() {
        assert_bytes_eq(
            &format!("self exchange {i}"),
            &sink.to_vec().expect("download"),
            &bytes_in[i * 24..(i + 1) * 24],
        );
    }
    assert!(!comm.is_aborted());
}

/// torch on its default stream: the legacy default stream ("stream 0") runs the collective,
/// non-blocking streams around it write its input late and read its output; an in-place call
/// on a view, a future and a synchronize on the legacy stream; the bytes prove each ordering.
#[test]
fn collectives_on_the_legacy_default_stream_order_with_non_blocking_streams() {
    let (_gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let kernels = TestKernels::load(context).expect("kernels");
    let legacy = Stream::legacy_default(context);
    let (x, y) = (stream(context), stream(context));
    const N: usize = 1 << 16;
    let mut send = upload(context, &pattern::<u32>(N, 1));
    let mut recv = DeviceBuffer::<u32>::zeroed(context, N).expect("recv");
    kernels.spin_ns(&x, SPIN_NS).expect("spin");
    send.fill_async(0x1234_5678, &x).expect("late write on x");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &legacy)
        .expect("all_reduce on the legacy stream");
    let mut copy = DeviceBuffer::<u32>::zeroed(context, N).expect("copy");
    copy.copy_from_async(&recv, &y).expect("read on y");
    y.synchronize().expect("y");
    assert_bytes_eq(
        "y read what the legacy-stream collective wrote, which read what x wrote",
        &copy.to_vec().expect("download"),
        &vec![0x1234_5678; N],
    );

    {
        let mut middle = recv.slice_mut(5..N - 5).expect("view");
        kernels.spin_ns(&y, SPIN_NS).expect("spin");
        middle.fill_async(7, &y).expect("late write on y");
        comm.all_reduce_in_place(&mut middle, ReduceOp::Max, &legacy)
            .expect("in place on the legacy stream");
    }
    let mut out = DeviceBuffer::<u32>::zeroed(context, N).expect("out");
    comm.broadcast(&recv, &mut out, 0, &legacy)
        .expect("broadcast on the legacy stream");
    futures::executor::block_on(comm.completion(&legacy).expect("future")).expect("awaited");
    comm.synchronize(&legacy).expect("synchronize");
    let mut want = vec![7u32; N];
    want[..5].fill(0x1234_5678);
    want[N - 5..].fill(0x1234_5678);
    assert_bytes_eq("in place on a view", &recv.to_vec().expect("recv"), &want);
    assert_bytes_eq("broadcast after it", &out.to_vec().expect("out"), &want);
}

fn assert_send_sync<T: Send + Sync>() {}
fn assert_send<T: Send>() {}

/// Futures as async programs hold them: `Send` (tokio::spawn needs it); polled once and then
/// dropped before the GPU got there (a cancelled task), after which the communicator finalizes
/// because the future let go of its share; moved to another thread and awaited there after the
/// caller dropped its communicator, the future then finalizing the rank on that thread.
#[test]
fn futures_are_send_can_be_dropped_pending_and_outlive_their_communicator() {
    assert_send::<CollectiveFuture>();
    assert_send_sync::<Communicator>();
    let (_gpu, _serial) = gate!();
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(comm.context());
    let kernels = TestKernels::load(&context).expect("kernels");
    let s = stream(&context);
    let input = pattern::<f64>(1 << 15, 2);
    let send = upload(&context, &input);
    let mut recv = DeviceBuffer::<f64>::zeroed(&context, 1 << 15).expect("recv");
    kernels.spin_ns(&s, 2 * SPIN_NS).expect("spin");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        .expect("all_reduce");
    let mut future = comm.completion(&s).expect("future");
    if let Some(early) = (&mut future).now_or_never() {
        early.expect("a future that is ready is a success");
    }
    drop(future);
    comm.finalize()
        .expect("the dropped future gave back its share of the rank");
    assert_bytes_eq(
        "after a dropped future",
        &recv.to_vec().expect("download"),
        &input,
    );

    let comm = own_comm(&CommConfig::default());
    let mut recv = DeviceBuffer::<f64>::zeroed(&context, 1 << 15).expect("recv");
    kernels.spin_ns(&s, 2 * SPIN_NS).expect("spin");
    comm.all_reduce(&send, &mut recv, ReduceOp::Max, &s)
        .expect("all_reduce");
    let future = comm.completion(&s).expect("future");
    let idle = comm.completion(&stream(&context)).expect("idle future");
    drop(comm);
    let awaited = std::thread::spawn(move || {
        let result = futures::executor::block_on(futures::future::join(future, idle));
        // The last share of the rank goes here, on this thread: finalize and destroy.
        result
    })
    .join()
    .expect("awaiting thread");
    awaited
        .0
        .expect("the future outlived its communicator's handle");
    awaited.1.expect("an idle stream's future");
    assert_bytes_eq(
        "after the future finalized the rank",
        &recv.to_vec().expect("download"),
        &input,
    );
}

/// A coordinated step as a framework builds it: the user's own backward kernel operation on the
/// compute stream, a `run` of a whole group (two buckets, two reductions) as one `AllReduce`
/// operation on the communication stream after it, and the user's copy operation after that,
/// at low priority; the bytes show the order, and everything retires.
#[test]
fn a_coordinated_group_runs_between_the_users_own_operations_and_everything_retires() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let kernels = TestKernels::load(context).expect("kernels");
    let coordinator = OperationCoordinator::new(EventPool::new(&gpu.context, 8, 8).expect("pool"))
        .expect("coordinator");
    let collectives =
        CoordinatedCollectives::new(coordinator.clone()).with_priority(EventPriority::Low);
    let compute = Arc::new(stream(context));
    let comm_stream = Arc::new(stream(context));
    const N: usize = 4099;
    let mut grads = upload(context, &pattern::<f32>(2 * N, 60));
    let mut first = upload(context, &pattern::<f32>(N, 61));
    let mut second = upload(context, &pattern::<f32>(N, 62));
    let mut params = DeviceBuffer::<f32>::zeroed(context, 2 * N).expect("params");

    let backward = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            Some(&*compute),
            &[],
            "backward",
        )
        .expect("register");
    coordinator
        .begin_operation(backward, &compute)
        .expect("begin");
    kernels.spin_ns(&compute, SPIN_NS).expect("spin");
    grads
        .slice_mut(..N)
        .expect("bucket 0")
        .fill_async(1.5, &compute)
        .expect("bucket 0");
    grads
        .slice_mut(N..)
        .expect("bucket 1")
        .fill_async(-2.25, &compute)
        .expect("bucket 1");
    coordinator.complete_operation(backward).expect("complete");

    let reduce = collectives
        .run(
            OperationType::AllReduce,
            &comm_stream,
            &[backward],
            "two buckets in one group",
            |s| {
                let (a, b) = (
                    grads.slice(..N).expect("bucket 0"),
                    grads.slice(N..).expect("bucket 1"),
                );
                let mut group = Group::new();
                group.all_reduce(comm, &a, &mut first, ReduceOp::Avg, s)?;
                group.all_reduce(comm, &b, &mut second, ReduceOp::Min, s)?;
                group.launch()
            },
        )
        .expect("coordinated group");

    let step = coordinator
        .register_operation(
            OperationType::MemoryTransfer,
            EventPriority::Normal,
            Some(&*compute),
            &[reduce],
            "optimizer",
        )
        .expect("register");
    coordinator.begin_operation(step, &compute).expect("begin");
    params
        .slice_mut(..N)
        .expect("half")
        .copy_from_async(&first, &compute)
        .expect("copy");
    params
        .slice_mut(N..)
        .expect("half")
        .copy_from_async(&second, &compute)
        .expect("copy");
    coordinator.complete_operation(step).expect("complete");
    futures::executor::block_on(coordinator.completion(step).expect("future")).expect("done");

    let mut want = vec![1.5f32; N];
    want.extend(std::iter::repeat_n(-2.25f32, N));
    assert_bytes_eq("params", &params.to_vec().expect("download"), &want);
    for id in [backward, reduce, step] {
        assert_eq!(
            coordinator.state(id).expect("state"),
            OperationState::Completed
        );
    }
    compute.synchronize().expect("compute");
    comm_stream.synchronize().expect("comm");
    coordinator.retire_finished();
    assert_eq!(coordinator.live_operations(), 0, "everything retired");
    assert_eq!(coordinator.metrics().registered, 3);
}

/// Threads this process made whose name is `loop_thread`'s (threads inherit their creator's
/// name, so these are the ones NCCL made from the loop) or NCCL's own (`NCCL_SET_THREAD_NAME`).
#[cfg(target_os = "linux")]
fn threads_named(loop_thread: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| {
            let name = name.trim_end();
            name == loop_thread || name.starts_with("NCCL")
        })
        .count()
}

#[cfg(not(target_os = "linux"))]
fn threads_named(_loop_thread: &str) -> usize {
    0
}

/// One cycle of a program that makes a process group, uses it and ends it: init, an in-place
/// all-reduce, a split child used and dropped, a `None` split, then finalize, drop or abort.
fn comm_cycle(i: usize, context: &Arc<Context>, s: &Stream) {
    let comm = own_comm(&CommConfig::default().with_timeout(Duration::from_secs(30)));
    let input = pattern::<i32>(4096 + i, i);
    let mut buffer = upload(context, &input);
    comm.all_reduce_in_place(&mut buffer, ReduceOp::Sum, s)
        .expect("all_reduce");
    let child = comm.split(Some(0), 0).expect("split").expect("child");
    child
        .all_reduce_in_place(&mut buffer, ReduceOp::Max, s)
        .expect("child all_reduce");
    child.synchronize(s).expect("child synchronize");
    child.finalize().expect("child finalize");
    assert!(comm.split(None, 0).expect("no colour").is_none());
    comm.synchronize(s).expect("synchronize");
    assert_bytes_eq(
        &format!("cycle {i}"),
        &buffer.to_vec().expect("download"),
        &input,
    );
    match i % 3 {
        0 => comm.finalize().expect("finalize"),
        1 => drop(comm),
        _ => {
            comm.abort();
            assert!(matches!(
                comm.finalize(),
                Err(CollectiveError::Aborted { .. })
            ));
        }
    }
}

/// Long-running programs make and end process groups: 24 cycles of init, use, split, and end
/// (finalize, drop or abort in turn) give back the device memory and the threads NCCL made for
/// them. The threads are counted by name: the cycles run on a thread of their own name, which
/// the threads NCCL starts from it inherit.
#[test]
fn communicators_and_split_children_made_and_ended_in_a_loop_give_back_memory_and_threads() {
    let (gpu, _serial) = gate!();
    const NAME: &str = "cwv-comm-cycle";
    const CYCLES: usize = 24;
    const MEMORY_SLACK: usize = 32 << 20;
    let context = gpu.context;
    let counts = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name(NAME.into())
            .spawn_scoped(scope, || {
                let s = stream(&context);
                // A first cycle loads whatever is loaded once (NCCL's state, the waiter).
                comm_cycle(0, &context, &s);
                let threads_before = threads_named(NAME);
                let free_before = context.memory_info().expect("memory info").free;
                for i in 1..=CYCLES {
                    comm_cycle(i, &context, &s);
                }
                // Not a timing: a bounded wait for a bootstrap thread finishing its last reply.
                let waiting = Instant::now();
                let mut threads_after = threads_named(NAME);
                while threads_after > threads_before + 2
                    && waiting.elapsed() < Duration::from_secs(10)
                {
                    std::thread::sleep(Duration::from_millis(50));
                    threads_after = threads_named(NAME);
                }
                let free_after = context.memory_info().expect("memory info").free;
                (threads_before, threads_after, free_before, free_after)
            })
            .expect("cycle thread")
            .join()
            .expect("cycles")
    });
    let (threads_before, threads_after, free_before, free_after) = counts;
    eprintln!(
        "{CYCLES} cycles: threads {threads_before} -> {threads_after}, free device memory \
         {free_before} -> {free_after}"
    );
    assert!(
        threads_after <= threads_before + 2,
        "threads kept after {CYCLES} cycles: {threads_before} -> {threads_after}"
    );
    assert!(
        free_after + MEMORY_SLACK >= free_before,
        "device memory kept after {CYCLES} cycles: {} MiB",
        (free_before - free_after) >> 20
    );
}

/// torch with several process groups: four threads each make their own communicator at once
/// (their own id), run collectives of their own type, split, and finalize, while the main thread
/// uses the shared communicator.
#[test]
fn threads_make_use_and_finalize_their_own_process_groups_concurrently() {
    let (gpu, _serial) = gate!();
    let device = gpu.device;
    let shared = comm();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..4)
            .map(|t: usize| {
                scope.spawn(move || {
                    let id = UniqueId::new().expect("id");
                    let comm = Communicator::init_rank(1, 0, &id, device, &CommConfig::default())
                        .expect("init_rank");
                    let context = comm.context();
                    let s = stream(context);
                    if t.is_multiple_of(2) {
                        let input = pattern::<f64>(3000 + t, t);
                        let send = upload(context, &input);
                        let mut recv = DeviceBuffer::<f64>::zeroed(context, 3000 + t).expect("r");
                        for _ in 0..50 {
                            comm.all_reduce(&send, &mut recv, ReduceOp::Max, &s)
                                .expect("all_reduce");
                        }
                        assert_bytes_eq(
                            &format!("thread {t}"),
                            &recv.to_vec().expect("download"),
                            &input,
                        );
                    } else {
                        let input = pattern::<i8>(5000 + t, t);
                        let mut buffer = upload(context, &input);
                        for _ in 0..50 {
                            comm.broadcast_in_place(&mut buffer, 0, &s)
                                .expect("broadcast");
                        }
                        assert_bytes_eq(
                            &format!("thread {t}"),
                            &buffer.to_vec().expect("download"),
                            &input,
                        );
                    }
                    let child = comm
                        .split(Some(t as u32), 0)
                        .expect("split")
                        .expect("child");
                    let input = pattern::<u32>(777, t);
                    let send = upload(context, &input);
                    let mut gathered = DeviceBuffer::<u32>::zeroed(context, 777).expect("g");
                    child
                        .all_gather(&send, &mut gathered, &s)
                        .expect("all_gather");
                    child.synchronize(&s).expect("synchronize");
                    assert_bytes_eq(
                        &format!("thread {t} child"),
                        &gathered.to_vec().expect("download"),
                        &input,
                    );
                    child.finalize().expect("child finalize");
                    comm.finalize().expect("finalize");
                })
            })
            .collect();
        let s = stream(shared.context());
        let input = pattern::<u8>(1 << 16, 3);
        let mut buffer = upload(shared.context(), &input);
        for _ in 0..100 {
            shared
                .all_reduce_in_place(&mut buffer, ReduceOp::Min, &s)
                .expect("shared all_reduce");
        }
        for worker in workers {
            worker.join().expect("worker");
        }
        assert_bytes_eq("shared", &buffer.to_vec().expect("download"), &input);
    });
    assert!(!shared.is_aborted());
}

/// The watchdog aborts while a worker issues as fast as it can (ungrouped calls, in-place calls,
/// groups, waits): every call returns `Ok` or a typed `Aborted` (never another error, never a
/// panic), every call after the first `Aborted` is refused too, and the buffers and stream
/// carry on.
#[test]
fn an_abort_racing_a_busy_issuing_thread_gives_only_typed_errors() {
    let (_gpu, _serial) = gate!();
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(comm.context());
    let s = stream(&context);
    let input = pattern::<u32>(4096, 12);
    let send = upload(&context, &input);
    let mut recv = DeviceBuffer::<u32>::zeroed(&context, 4096).expect("recv");
    let mut other = upload(&context, &input);
    let issued = AtomicUsize::new(0);
    let (first_abort, calls) = std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let mut first_abort = None;
            let mut i = 0usize;
            loop {
                let result = match i % 4 {
                    0 => comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s),
                    1 => comm.broadcast_in_place(&mut other, 0, &s),
                    2 => {
                        let mut group = Group::new();
                        group
                            .all_reduce(&comm, &send, &mut recv, ReduceOp::Max, &s)
                            .expect("checks pass");
                        group
                            .all_reduce_in_place(&comm, &mut other, ReduceOp::Min, &s)
                            .expect("checks pass");
                        group.launch()
                    }
                    _ => comm.synchronize(&s),
                };
                issued.fetch_add(1, Ordering::Release);
                match result {
                    Ok(()) => assert!(
                        first_abort.is_none(),
                        "call {i} succeeded after call {first_abort:?} was refused as aborted"
                    ),
                    Err(CollectiveError::Aborted { .. }) => {
                        first_abort.get_or_insert(i);
                    }
                    Err(error) => panic!("call {i}: not a typed Aborted: {error}"),
                }
                i += 1;
                if first_abort.is_some_and(|first| i >= first + 40) {
                    return (first_abort, i);
                }
                assert!(i < 5_000_000, "the abort never reached the worker");
            }
        });
        while issued.load(Ordering::Acquire) < 400 && !worker.is_finished() {
            std::thread::yield_now();
        }
        comm.abort();
        worker.join().expect("worker")
    });
    eprintln!("aborted at call {first_abort:?} of {calls}");
    assert!(comm.is_aborted());
    s.synchronize().expect("the stream drains");
    assert_bytes_eq("recv", &recv.to_vec().expect("download"), &input);
    assert_bytes_eq("other", &other.to_vec().expect("download"), &input);
}

/// Two process groups, one of which timed out (aborted): a group holding a call on each is
/// refused with `Aborted`, whatever the order of the calls, and the healthy communicator is not
/// aborted for it (nothing of the aborted one was queued, so nothing of the healthy one waits
/// on it); the healthy one keeps working.
#[test]
fn a_group_holding_an_aborted_communicator_leaves_the_healthy_one_alive() {
    let (_gpu, _serial) = gate!();
    let config = CommConfig::default().with_timeout(Duration::from_secs(30));
    let healthy = own_comm(&config);
    let dead = own_comm(&config);
    dead.abort();
    let context = Arc::clone(healthy.context());
    let s = stream(&context);
    let input = pattern::<f32>(2048, 13);
    let stale = pattern::<f32>(2048, 14);
    let send = upload(&context, &input);
    for healthy_first in [false, true] {
        let mut mine = upload(&context, &stale);
        let mut theirs = upload(&context, &stale);
        let launched = {
            let mut group = Group::new();
            if healthy_first {
                group
                    .all_reduce(&healthy, &send, &mut mine, ReduceOp::Sum, &s)
                    .expect("add");
                group
                    .all_reduce(&dead, &send, &mut theirs, ReduceOp::Sum, &s)
                    .expect("add");
            } else {
                group
                    .all_reduce(&dead, &send, &mut theirs, ReduceOp::Sum, &s)
                    .expect("add");
                group
                    .all_reduce(&healthy, &send, &mut mine, ReduceOp::Sum, &s)
                    .expect("add");
            }
            group.launch()
        };
        assert!(
            matches!(launched, Err(CollectiveError::Aborted { .. })),
            "healthy first: {healthy_first}: {launched:?}"
        );
        assert!(
            !healthy.is_aborted(),
            "healthy first: {healthy_first}: the healthy communicator was aborted by a group \
             that also held an already aborted one"
        );
        let got = mine.to_vec().expect("download");
        assert!(
            bytemuck::cast_slice::<f32, u8>(&got) == bytemuck::cast_slice::<f32, u8>(&stale)
                || bytemuck::cast_slice::<f32, u8>(&got) == bytemuck::cast_slice::<f32, u8>(&input),
            "the healthy call's output is either untouched or its result"
        );
    }
    let mut after = upload(&context, &stale);
    healthy
        .all_reduce(&send, &mut after, ReduceOp::Sum, &s)
        .expect("the healthy communicator still works");
    assert_bytes_eq("after", &after.to_vec().expect("download"), &input);
}

/// Bad input a program can send: empty device lists, ranks and world sizes out of range or too
/// large for NCCL's C int, split keys too large, roots and peers past the world, zero-length
/// buffers (refused at creation, so no empty collective can be expressed), a group built and
/// dropped on an error path without launching, and id text that is not 256 hex digits. Each is a
/// typed error before NCCL, never a panic, and the communicator stays healthy.
#[test]
fn bad_input_to_inits_splits_calls_and_ids_is_typed_and_leaves_the_communicator_healthy() {
    let (gpu, _serial) = gate!();
    let config = CommConfig::default();
    let id = UniqueId::new().expect("id");
    let init_refused = |what: &str, result: Result<Communicator, CollectiveError>| {
        assert!(
            matches!(result, Err(CollectiveError::InvalidArgument { .. })),
            "{what}: {result:?}"
        );
    };
    assert!(matches!(
        Communicator::init_all(&[], &config),
        Err(CollectiveError::InvalidArgument { .. })
    ));
    init_refused(
        "a world of none",
        Communicator::init_rank(0, 0, &id, gpu.device, &config),
    );
    init_refused(
        "rank past the world",
        Communicator::init_rank(3, 3, &id, gpu.device, &config),
    );
    init_refused(
        "a world past C int",
        Communicator::init_rank(1 << 31, 0, &id, gpu.device, &config),
    );
    init_refused(
        "usize::MAX ranks",
        Communicator::init_rank(usize::MAX, usize::MAX - 1, &id, gpu.device, &config),
    );

    let comm = comm();
    let context = comm.context();
    let s = stream(context);
    assert!(matches!(
        comm.split(Some(0), u32::MAX),
        Err(CollectiveError::InvalidArgument { .. })
    ));
    let send = upload(context, &pattern::<i64>(64, 1));
    let mut recv = DeviceBuffer::<i64>::zeroed(context, 64).expect("recv");
    invalid(
        "root usize::MAX",
        comm.broadcast(&send, &mut recv, usize::MAX, &s),
    );
    invalid(
        "reduce root usize::MAX",
        comm.reduce(&send, &mut recv, ReduceOp::Max, usize::MAX, &s),
    );
    invalid("send to usize::MAX", comm.send(&send, usize::MAX, &s));
    invalid("recv from usize::MAX", comm.recv(&mut recv, usize::MAX, &s));
    assert!(DeviceBuffer::<f32>::zeroed(context, 0).is_err());
    assert!(DeviceBuffer::<u8>::new(context, 0).is_err());
    assert!(PinnedBuffer::<f64>::zeroed(context, 0).is_err());
    assert!(DeviceBuffer::<F16>::from_slice(context, &[]).is_err());
    {
        // Built, then abandoned on an error path: nothing is queued.
        let mut spare = upload(context, &pattern::<i64>(64, 2));
        let mut group = Group::new();
        group
            .all_reduce(comm, &send, &mut recv, ReduceOp::Sum, &s)
            .expect("add");
        group
            .broadcast_in_place(comm, &mut spare, 0, &s)
            .expect("add");
        assert_eq!(group.len(), 2);
        drop(group);
    }
    assert_bytes_eq(
        "an abandoned group queued nothing",
        &recv.to_vec().expect("download"),
        &[0i64; 64],
    );
    assert!(!comm.is_aborted());
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        .expect("still healthy");
    assert_bytes_eq(
        "still healthy",
        &recv.to_vec().expect("download"),
        &pattern::<i64>(64, 1),
    );

    // Id text: a multi-byte character where a digit pair should be is refused, not a panic;
    // so is text of the right length that is not hex digits (a sign is not a digit).
    for text in [
        "é".repeat(128),
        "0".repeat(255),
        format!("{} ", "g".repeat(256)),
        "+0".repeat(128),
    ] {
        assert!(
            matches!(
                UniqueId::from_hex(&text),
                Err(CollectiveError::InvalidArgument { .. })
            ),
            "{text:?} is not 256 hex digits"
        );
    }
}

/// FSDP on two GPUs, one process: each rank's shard sits at its own slot of a view at an odd
/// offset, the in-place all-gather fills the other slot; the in-place reduce-scatter leaves the
/// average of each rank's slot there; Min and Prod all-reduces on integers; a reduce to rank 1
/// leaves rank 0's output untouched. The slot offsets (`rank × chunk`) only matter past rank 0.
#[test]
fn two_gpus_in_place_all_gather_and_reduce_scatter_use_each_ranks_slot() {
    let (_gpu, _serial) = gate!();
    let Some(devices) =
        two_devices_or_skip("two_gpus_in_place_all_gather_and_reduce_scatter_use_each_ranks_slot")
    else {
        return;
    };
    let comms = Communicator::init_all(
        &devices[..2],
        &CommConfig::default().with_timeout(Duration::from_secs(60)),
    )
    .expect("init_all over two devices");
    let streams: Vec<Stream> = comms.iter().map(|c| stream(c.context())).collect();
    const CHUNK: usize = 1001;
    const AT: usize = 3;
    const LEN: usize = AT + 2 * CHUNK + AT;

    // All-gather in place, bf16, on views at an odd offset.
    let shards: Vec<Vec<Bf16>> = (0..2).map(|r| pattern(CHUNK, r + 1)).collect();
    let stale: Vec<Bf16> = pattern(LEN, 50);
    let mut flats: Vec<DeviceBuffer<Bf16>> = comms
        .iter()
        .map(|c| {
            let r = c.rank();
            let mut host = stale.clone();
            host[AT + r * CHUNK..AT + (r + 1) * CHUNK].copy_from_slice(&shards[r]);
            upload(c.context(), &host)
        })
        .collect();
    {
        let mut views: Vec<_> = flats
            .iter_mut()
            .map(|f| f.slice_mut(AT..AT + 2 * CHUNK).expect("view"))
            .collect();
        let mut group = Group::new();
        for ((comm, view), s) in comms.iter().zip(&mut views).zip(&streams) {
            group.all_gather_in_place(comm, view, s).expect("add");
        }
        group.launch().expect("all_gather_in_place");
    }
    let mut want = stale.clone();
    want[AT..AT + CHUNK].copy_from_slice(&shards[0]);
    want[AT + CHUNK..AT + 2 * CHUNK].copy_from_slice(&shards[1]);
    for (r, flat) in flats.iter().enumerate() {
        assert_bytes_eq(
            &format!("rank {r} gathered"),
            &flat.to_vec().expect("download"),
            &want,
        );
    }

    // Reduce-scatter in place, f32 average (exact: halves of quarters).
    let grads: Vec<Vec<f32>> = (0..2).map(|r| pattern(2 * CHUNK, r + 7)).collect();
    let mut buffers: Vec<DeviceBuffer<f32>> = comms
        .iter()
        .map(|c| upload(c.context(), &grads[c.rank()]))
        .collect();
    {
        let mut group = Group::new();
        for ((comm, buffer), s) in comms.iter().zip(&mut buffers).zip(&streams) {
            group
                .reduce_scatter_in_place(comm, buffer, ReduceOp::Avg, s)
                .expect("add");
        }
        group.launch().expect("reduce_scatter_in_place");
    }
    for (r, buffer) in buffers.iter().enumerate() {
        let got = buffer.to_vec().expect("download");
        let want: Vec<f32> = (r * CHUNK..(r + 1) * CHUNK)
            .map(|i| grads[0][i] * 0.5 + grads[1][i] * 0.5)
            .collect();
        assert_bytes_eq(
            &format!("rank {r}'s slot"),
            &got[r * CHUNK..(r + 1) * CHUNK],
            &want,
        );
    }

    // Integer Min and Prod across the two ranks, out of place.
    let ints: Vec<Vec<i32>> = (0..2)
        .map(|r| (0..CHUNK).map(|i| (i as i32 % 13) - 6 + r).collect())
        .collect();
    let sends: Vec<DeviceBuffer<i32>> = comms
        .iter()
        .map(|c| upload(c.context(), &ints[c.rank()]))
        .collect();
    for op in [ReduceOp::Min, ReduceOp::Prod] {
        let mut recvs: Vec<DeviceBuffer<i32>> = comms
            .iter()
            .map(|c| DeviceBuffer::zeroed(c.context(), CHUNK).expect("recv"))
            .collect();
        let mut group = Group::new();
        for (((comm, send), recv), s) in comms.iter().zip(&sends).zip(&mut recvs).zip(&streams) {
            group.all_reduce(comm, send, recv, op, s).expect("add");
        }
        group.launch().expect("all_reduce");
        let want: Vec<i32> = (0..CHUNK)
            .map(|i| match op {
                ReduceOp::Min => ints[0][i].min(ints[1][i]),
                _ => ints[0][i] * ints[1][i],
            })
            .collect();
        for (r, recv) in recvs.iter().enumerate() {
            assert_bytes_eq(
                &format!("rank {r} {op:?}"),
                &recv.to_vec().expect("download"),
                &want,
            );
        }
    }

    // Reduce to rank 1: rank 0's output is not written.
    let untouched: Vec<i32> = vec![-99; CHUNK];
    let mut recvs: Vec<DeviceBuffer<i32>> = comms
        .iter()
        .map(|c| upload(c.context(), &untouched))
        .collect();
    let mut group = Group::new();
    for (((comm, send), recv), s) in comms.iter().zip(&sends).zip(&mut recvs).zip(&streams) {
        group
            .reduce(comm, send, recv, ReduceOp::Sum, 1, s)
            .expect("add");
    }
    group.launch().expect("reduce");
    let sum: Vec<i32> = (0..CHUNK).map(|i| ints[0][i] + ints[1][i]).collect();
    assert_bytes_eq(
        "rank 0 (not the root)",
        &recvs[0].to_vec().expect("download"),
        &untouched,
    );
    assert_bytes_eq("root", &recvs[1].to_vec().expect("download"), &sum);
}

/// A rank on device 0 given another device's buffers or streams: every call, group entry,
/// future and wait is a typed `InvalidArgument` before NCCL, and the rank stays healthy.
#[test]
fn two_gpus_buffers_and_streams_of_another_device_are_typed_errors() {
    let (_gpu, _serial) = gate!();
    let Some(devices) =
        two_devices_or_skip("two_gpus_buffers_and_streams_of_another_device_are_typed_errors")
    else {
        return;
    };
    let comm = Communicator::init_rank(
        1,
        0,
        &UniqueId::new().expect("id"),
        devices[0],
        &CommConfig::default(),
    )
    .expect("init on device 0");
    let here = Arc::clone(comm.context());
    let there = Context::primary(devices[1]).expect("device 1");
    let (s_here, s_there) = (stream(&here), stream(&there));
    let input = pattern::<f32>(1024, 3);
    let mine = upload(&here, &input);
    let mut out = DeviceBuffer::<f32>::zeroed(&here, 1024).expect("out");
    let foreign = upload(&there, &input);
    let mut foreign_out = DeviceBuffer::<f32>::zeroed(&there, 1024).expect("foreign out");
    let foreign_pinned = PinnedBuffer::from_slice(&there, &input).expect("pinned on device 1");
    invalid(
        "foreign input",
        comm.all_reduce(&foreign, &mut out, ReduceOp::Sum, &s_here),
    );
    invalid(
        "foreign output",
        comm.all_reduce(&mine, &mut foreign_out, ReduceOp::Sum, &s_here),
    );
    invalid(
        "foreign pinned input",
        comm.broadcast(&foreign_pinned, &mut out, 0, &s_here),
    );
    invalid(
        "foreign stream",
        comm.all_reduce(&mine, &mut out, ReduceOp::Sum, &s_there),
    );
    invalid(
        "in place, foreign",
        comm.all_reduce_in_place(&mut foreign_out, ReduceOp::Max, &s_here),
    );
    invalid(
        "reduce, foreign stream",
        comm.reduce(&mine, &mut out, ReduceOp::Sum, 0, &s_there),
    );
    invalid(
        "all_gather, foreign",
        comm.all_gather(&foreign, &mut out, &s_here),
    );
    invalid(
        "reduce_scatter, foreign",
        comm.reduce_scatter(&mine, &mut foreign_out, ReduceOp::Sum, &s_here),
    );
    {
        let mut group = Group::new();
        invalid(
            "group send, foreign",
            group.send(&comm, &foreign, 0, &s_here).map(drop),
        );
        invalid(
            "group recv, foreign stream",
            group.recv(&comm, &mut out, 0, &s_there).map(drop),
        );
        assert!(group.is_empty());
    }
    invalid(
        "future on a foreign stream",
        comm.completion(&s_there).map(drop),
    );
    invalid("wait on a foreign stream", comm.synchronize(&s_there));
    assert!(!comm.is_aborted());
    comm.all_reduce(&mine, &mut out, ReduceOp::Sum, &s_here)
        .expect("still healthy");
    assert_bytes_eq("healthy", &out.to_vec().expect("download"), &input);
    assert_bytes_eq(
        "the foreign output was never written",
        &foreign_out.to_vec().expect("download"),
        &[0.0; 1024],
    );
}

/// The watchdog on two GPUs: after a joint warm-up (so the connections exist), rank 0 queues an
/// all-reduce that rank 1 never joins; its kernel waits on the GPU. A thread waits for it
/// (`synchronize`, or the future); the watchdog aborts rank 0, NCCL's kernel exits and the
/// stream drains. The wait must report the abort: the collective never completed, and a wait
/// that said `Ok` would hand the program a half-reduced buffer as a result.
#[test]
fn two_gpus_a_wait_on_a_collective_cut_short_by_an_abort_is_an_error() {
    let (_gpu, _serial) = gate!();
    let Some(devices) =
        two_devices_or_skip("two_gpus_a_wait_on_a_collective_cut_short_by_an_abort_is_an_error")
    else {
        return;
    };
    const N: usize = 1 << 16;
    let mut judged = 0;
    for round in 0..4 {
        let comms = Communicator::init_all(
            &devices[..2],
            &CommConfig::default().with_timeout(Duration::from_secs(20)),
        )
        .expect("init_all over two devices");
        let streams: Vec<Stream> = comms.iter().map(|c| stream(c.context())).collect();
        let inputs: Vec<Vec<f32>> = (0..2).map(|r| pattern(N, r + 1)).collect();
        let sends: Vec<DeviceBuffer<f32>> = comms
            .iter()
            .map(|c| upload(c.context(), &inputs[c.rank()]))
            .collect();
        let mut recvs: Vec<DeviceBuffer<f32>> = comms
            .iter()
            .map(|c| DeviceBuffer::zeroed(c.context(), N).expect("recv"))
            .collect();
        {
            let mut group = Group::new();
            for (((comm, send), recv), s) in comms.iter().zip(&sends).zip(&mut recvs).zip(&streams)
            {
                group
                    .all_reduce(comm, send, recv, ReduceOp::Sum, s)
                    .expect("add");
            }
            group.launch().expect("warm-up on both ranks");
        }
        for (comm, s) in comms.iter().zip(&streams) {
            comm.synchronize(s).expect("warm-up done");
        }
        recvs[0].fill(-7.0).expect("marker");
        let queued = comms[0].all_reduce(&sends[0], &mut recvs[0], ReduceOp::Sum, &streams[0]);
        if let Err(error) = queued {
            // NCCL waited in the call itself (a connection the warm-up did not make): the call
            // already reported the failure, so this round has no pending wait to judge.
            eprintln!("round {round}: rank 0's lonely call did not queue: {error}");
            comms[1].abort();
            continue;
        }
        judged += 1;
        let waited = std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                if round % 2 == 0 {
                    comms[0].synchronize(&streams[0])
                } else {
                    comms[0]
                        .completion(&streams[0])
                        .and_then(futures::executor::block_on)
                }
            });
            // Not a timing: a moment for the waiter to be inside its wait.
            std::thread::sleep(Duration::from_millis(500));
            comms[0].abort();
            waiter.join().expect("waiter")
        });
        streams[0].synchronize().expect("drained by the abort");
        eprintln!("round {round}: the wait after the abort: {waited:?}");
        assert!(
            waited.is_err(),
            "round {round}: the wait reported success for a collective the abort cut short"
        );
        comms[1].abort();
    }
    assert!(judged > 0, "no round queued rank 0's lonely call");
}
