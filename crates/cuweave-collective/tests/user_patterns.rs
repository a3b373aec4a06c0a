//! What NCCL, nccl-tests and torch.distributed users write, on one GPU: every collective on
//! every element type (the 16-bit floats of mixed precision included), in place and out of
//! place, on views at odd offsets; grouped calls (in place too, as one process driving its GPUs
//! must group them) on several streams; ordering with other work proven by bytes behind a
//! spinning kernel; buffers and communicators dropped right after queueing; long loops, threads,
//! futures, deadlines, watchdog aborts, blocking communicators, splits and coordinated DAGs.
//! Multi-rank programs skip with a reason on one GPU.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Pattern, assert_bytes_eq, comm, nccl_or_skip, own_comm, pattern, skip, stream};
use cuweave_collective::{
    Bf16, CollectiveError, CommConfig, Communicator, CoordinatedCollectives, F16, Group, NcclType,
    ReduceOp, UniqueId,
};
use cuweave_driver::{CaptureMode, Context, Device, InstantiateOptions, Stream};
use cuweave_event::{EventPool, EventPriority, OperationCoordinator, OperationType};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

macro_rules! gate {
    () => {{
        let gpu = require_gpu!(else return);
        if !nccl_or_skip(cuweave_test_support::__test_name(std::any::type_name_of_val(&|| ()))) {
            return;
        }
        gpu
    }};
}

fn upload<T: Pattern>(context: &Arc<Context>, values: &[T]) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(context, values).expect("upload")
}

/// 100 ms of a spinning kernel: what is queued behind it on the same stream starts that late,
/// so work on another stream that did not wait for it runs first and shows in the bytes.
const SPIN_NS: u64 = 100_000_000;

/// Every collective, out of place and in place, on views at odd offsets of larger buffers (so
/// the addresses NCCL sees are not aligned), with the elements around each view checked
/// untouched. One rank: every result equals the input.
fn every_collective_on_views<T: Pattern>(comm: &Communicator, stream: &Stream) {
    const LEN: usize = 1031;
    const AT: usize = 3;
    let context = comm.context();
    let name = std::any::type_name::<T>();
    let input: Vec<T> = pattern(LEN + 2 * AT, 1);
    let stale: Vec<T> = pattern(LEN + 2 * AT, 77);
    let view = AT..AT + LEN;
    let send = upload(context, &input);
    let check = |what: &str, buffer: &DeviceBuffer<T>, want_inside: &[T]| {
        let got = buffer.to_vec().expect("download");
        assert_bytes_eq(&format!("{what} {name}"), &got[view.clone()], want_inside);
        assert_bytes_eq(&format!("{what} {name}: before"), &got[..AT], &stale[..AT]);
        assert_bytes_eq(
            &format!("{what} {name}: after"),
            &got[AT + LEN..],
            &stale[AT + LEN..],
        );
    };
    let want = &input[view.clone()];

    for op in ReduceOp::ALL {
        let mut recv = upload(context, &stale);
        comm.all_reduce(
            &send.slice(view.clone()).expect("view"),
            &mut recv.slice_mut(view.clone()).expect("view"),
            op,
            stream,
        )
        .expect("all_reduce");
        check(&format!("all_reduce {op:?}"), &recv, want);

        // In place: the stale buffer's view gets the input first, on the same stream.
        let mut buffer = upload(context, &stale);
        {
            let mut inside = buffer.slice_mut(view.clone()).expect("view");
            inside
                .copy_from_async(&send.slice(view.clone()).expect("view"), stream)
                .expect("copy in");
            comm.all_reduce_in_place(&mut inside, op, stream)
                .expect("all_reduce_in_place");
        }
        check(&format!("all_reduce_in_place {op:?}"), &buffer, want);

        let mut recv = upload(context, &stale);
        comm.reduce(
            &send.slice(view.clone()).expect("view"),
            &mut recv.slice_mut(view.clone()).expect("view"),
            op,
            0,
            stream,
        )
        .expect("reduce");
        check(&format!("reduce {op:?}"), &recv, want);

        let mut recv = upload(context, &stale);
        comm.reduce_scatter(
            &send.slice(view.clone()).expect("view"),
            &mut recv.slice_mut(view.clone()).expect("view"),
            op,
            stream,
        )
        .expect("reduce_scatter");
        check(&format!("reduce_scatter {op:?}"), &recv, want);
    }

    let mut recv = upload(context, &stale);
    comm.broadcast(
        &send.slice(view.clone()).expect("view"),
        &mut recv.slice_mut(view.clone()).expect("view"),
        0,
        stream,
    )
    .expect("broadcast");
    check("broadcast", &recv, want);

    let mut recv = upload(context, &stale);
    comm.all_gather(
        &send.slice(view.clone()).expect("view"),
        &mut recv.slice_mut(view.clone()).expect("view"),
        stream,
    )
    .expect("all_gather");
    check("all_gather", &recv, want);

    let mut buffer = upload(context, &input);
    buffer.copy_range_from_host(0, &stale[..AT]).expect("head");
    buffer
        .copy_range_from_host(AT + LEN, &stale[AT + LEN..])
        .expect("tail");
    for round in 0..4 {
        let mut inside = buffer.slice_mut(view.clone()).expect("view");
        match round {
            0 => comm.broadcast_in_place(&mut inside, 0, stream),
            1 => comm.reduce_in_place(&mut inside, ReduceOp::Min, 0, stream),
            2 => comm.all_gather_in_place(&mut inside, stream),
            _ => comm.reduce_scatter_in_place(&mut inside, ReduceOp::Max, stream),
        }
        .expect("in place");
    }
    check(
        "in-place broadcast, reduce, all_gather, reduce_scatter",
        &buffer,
        want,
    );

    // Send to and receive from itself, in one group.
    let mut recv = upload(context, &stale);
    {
        let src = send.slice(view.clone()).expect("view");
        let mut dst = recv.slice_mut(view.clone()).expect("view");
        let mut group = Group::new();
        group.send(comm, &src, 0, stream).expect("send");
        group.recv(comm, &mut dst, 0, stream).expect("recv");
        group.launch().expect("send/recv");
    }
    check("send/recv", &recv, want);
}

#[test]
fn every_collective_on_every_element_type_on_odd_views_is_byte_exact() {
    let _gpu = gate!();
    let comm = comm();
    let stream = stream(comm.context());
    every_collective_on_views::<i8>(comm, &stream);
    every_collective_on_views::<u8>(comm, &stream);
    every_collective_on_views::<i32>(comm, &stream);
    every_collective_on_views::<u32>(comm, &stream);
    every_collective_on_views::<i64>(comm, &stream);
    every_collective_on_views::<u64>(comm, &stream);
    every_collective_on_views::<f32>(comm, &stream);
    every_collective_on_views::<f64>(comm, &stream);
    every_collective_on_views::<F16>(comm, &stream);
    every_collective_on_views::<Bf16>(comm, &stream);
}

/// torch's AMP: fp16 and bf16 gradients averaged in place, 1 MiB + 3 elements (a count that
/// does not split evenly), and the values read back through `to_f32`.
#[test]
fn mixed_precision_gradients_average_in_place() {
    let _gpu = gate!();
    let comm = comm();
    let stream = stream(comm.context());
    let len = (1 << 20) + 3;
    let halves: Vec<F16> = (0..len)
        .map(|i| F16::from_f32((i % 1000) as f32 * 0.125))
        .collect();
    let mut grads = upload(comm.context(), &halves);
    comm.all_reduce_in_place(&mut grads, ReduceOp::Avg, &stream)
        .expect("fp16 avg");
    let got = grads.to_vec().expect("download");
    assert_bytes_eq("fp16 avg", &got, &halves);
    assert_eq!(got[len - 1].to_f32(), ((len - 1) % 1000) as f32 * 0.125);

    let brains: Vec<Bf16> = (0..len)
        .map(|i| Bf16::from_f32(-((i % 777) as f32)))
        .collect();
    let mut grads = upload(comm.context(), &brains);
    comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, &stream)
        .expect("bf16 sum");
    assert_bytes_eq("bf16 sum", &grads.to_vec().expect("download"), &brains);
}

/// One process driving its GPUs must group every call; torch's `broadcast(tensor, src)`,
/// `all_gather_into_tensor` and `reduce_scatter_tensor` on one buffer are in place. Several
/// types, two streams, one group.
#[test]
fn a_group_holds_in_place_calls_of_several_types_on_two_streams() {
    let gpu = gate!();
    let comms = Communicator::init_all(&[gpu.device], &CommConfig::default()).expect("init_all");
    let comm = &comms[0];
    let context = comm.context();
    let (a, b) = (stream(context), stream(context));
    let params: Vec<f32> = pattern(4099, 1);
    let counts: Vec<i64> = pattern(64, 2);
    let bytes: Vec<u8> = pattern(1 << 16, 3);
    let shards: Vec<f64> = pattern(1000, 4);
    let grads: Vec<F16> = pattern(513, 5);
    let input: Vec<i32> = pattern(300, 6);
    let mut p = upload(context, &params);
    let mut c = upload(context, &counts);
    let mut g = upload(context, &bytes);
    let mut s = upload(context, &shards);
    let mut h = upload(context, &grads);
    let send = upload(context, &input);
    let mut recv = DeviceBuffer::<i32>::zeroed(context, 300).expect("recv");
    let mut group = Group::new();
    group
        .broadcast_in_place(comm, &mut p, 0, &a)
        .expect("broadcast_in_place");
    group
        .reduce_in_place(comm, &mut c, ReduceOp::Sum, 0, &b)
        .expect("reduce_in_place");
    group
        .all_gather_in_place(comm, &mut g, &a)
        .expect("all_gather_in_place");
    group
        .reduce_scatter_in_place(comm, &mut s, ReduceOp::Avg, &b)
        .expect("reduce_scatter_in_place");
    group
        .all_reduce_in_place(comm, &mut h, ReduceOp::Max, &a)
        .expect("all_reduce_in_place");
    group
        .all_reduce(comm, &send, &mut recv, ReduceOp::Prod, &b)
        .expect("all_reduce");
    assert_eq!(group.len(), 6);
    group.launch().expect("launch");
    comm.synchronize(&a).expect("a");
    comm.synchronize(&b).expect("b");
    assert_bytes_eq("broadcast", &p.to_vec().expect("p"), &params);
    assert_bytes_eq("reduce", &c.to_vec().expect("c"), &counts);
    assert_bytes_eq("all_gather", &g.to_vec().expect("g"), &bytes);
    assert_bytes_eq("reduce_scatter", &s.to_vec().expect("s"), &shards);
    assert_bytes_eq("all_reduce fp16", &h.to_vec().expect("h"), &grads);
    assert_bytes_eq("all_reduce", &recv.to_vec().expect("recv"), &input);

    // An empty group queues nothing and succeeds; a group of a refused call fails before NCCL.
    Group::new().launch().expect("empty group");
    let mut short = DeviceBuffer::<i32>::zeroed(context, 3).expect("short");
    let mut group = Group::new();
    assert!(matches!(
        group.broadcast_in_place(comm, &mut short, 1, &a),
        Err(CollectiveError::InvalidArgument { .. })
    ));
    assert!(group.is_empty());
    assert!(!comm.is_aborted());
}

/// A kernel on stream A writes the input behind a 100 ms spin; the collective on stream B must
/// read what it wrote, not what was there before.
#[test]
fn a_collective_reads_what_a_kernel_on_another_stream_wrote_behind_a_spin() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let kernels = TestKernels::load(context).expect("kernels");
    let (a, b) = (stream(context), stream(context));
    let mut send = upload(context, &pattern::<u32>(1 << 16, 1));
    let mut recv = DeviceBuffer::<u32>::zeroed(context, 1 << 16).expect("recv");
    kernels.spin_ns(&a, SPIN_NS).expect("spin");
    send.fill_async(0x5eed_0001, &a).expect("write on a");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &b)
        .expect("all_reduce on b");
    comm.synchronize(&b).expect("synchronize");
    assert_bytes_eq(
        "the collective saw the write",
        &recv.to_vec().expect("download"),
        &vec![0x5eed_0001; 1 << 16],
    );
}

/// The collective on B reads `send` behind a spin; a write to `send` on C must wait for that
/// read (write after read), and a copy of `recv` on C for the collective's write.
#[test]
fn work_on_another_stream_waits_for_a_collective_it_conflicts_with() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let kernels = TestKernels::load(context).expect("kernels");
    let (b, c) = (stream(context), stream(context));
    let input = pattern::<u32>(1 << 16, 2);
    let mut send = upload(context, &input);
    let mut recv = DeviceBuffer::<u32>::zeroed(context, 1 << 16).expect("recv");
    let mut copy = DeviceBuffer::<u32>::zeroed(context, 1 << 16).expect("copy");
    kernels.spin_ns(&b, SPIN_NS).expect("spin");
    comm.all_reduce(&send, &mut recv, ReduceOp::Max, &b)
        .expect("all_reduce");
    send.fill_async(0xdead_beef, &c).expect("overwrite on c");
    copy.copy_from_async(&recv, &c).expect("read on c");
    c.synchronize().expect("c");
    assert_bytes_eq(
        "the collective read send before it was overwritten",
        &recv.to_vec().expect("recv"),
        &input,
    );
    assert_bytes_eq(
        "the copy on c read the collective's result",
        &copy.to_vec().expect("copy"),
        &input,
    );
    assert_bytes_eq(
        "the overwrite landed",
        &send.to_vec().expect("send"),
        &vec![0xdead_beef; 1 << 16],
    );
}

/// Dropping both buffers right after queueing the collective (the stream still spinning) must
/// not hand their memory to the next allocations: a squatter written at once would be read by
/// the collective (the input dropped) or overwritten by it (the output dropped).
#[test]
fn buffers_dropped_right_after_queueing_are_not_reused_under_the_collective() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let kernels = TestKernels::load(context).expect("kernels");
    let s = stream(context);
    const N: usize = 1 << 18;
    let input = pattern::<u32>(N, 3);

    // The input dropped.
    let send = upload(context, &input);
    let mut recv = DeviceBuffer::<u32>::zeroed(context, N).expect("recv");
    kernels.spin_ns(&s, SPIN_NS).expect("spin");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        .expect("all_reduce");
    drop(send);
    let mut squatters = Vec::new();
    for _ in 0..4 {
        let mut squatter = DeviceBuffer::<u32>::new(context, N).expect("squatter");
        squatter.fill(0xbad0_bad0).expect("fill");
        squatters.push(squatter);
    }
    assert_bytes_eq(
        "the dropped input was read intact",
        &recv.to_vec().expect("download"),
        &input,
    );
    drop(squatters);

    // The output dropped.
    let send = upload(context, &input);
    let mut recv = DeviceBuffer::<u32>::zeroed(context, N).expect("recv");
    kernels.spin_ns(&s, SPIN_NS).expect("spin");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        .expect("all_reduce");
    drop(recv);
    let mut squatters = Vec::new();
    for _ in 0..4 {
        let mut squatter = DeviceBuffer::<u32>::new(context, N).expect("squatter");
        squatter.fill(0x0c0f_fee0).expect("fill");
        squatters.push(squatter);
    }
    comm.synchronize(&s).expect("synchronize");
    for squatter in &squatters {
        assert_bytes_eq(
            "no squatter was overwritten by the collective",
            &squatter.to_vec().expect("download"),
            &vec![0x0c0f_fee0; N],
        );
    }
}

/// Dropping the last clone of the communicator right after queueing: finalising waits for the
/// queued work, and the result is there.
#[test]
fn a_communicator_dropped_right_after_queueing_finishes_its_work() {
    let _gpu = gate!();
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(comm.context());
    let kernels = TestKernels::load(&context).expect("kernels");
    let s = stream(&context);
    let input = pattern::<f64>(1 << 16, 4);
    let send = upload(&context, &input);
    let mut recv = DeviceBuffer::<f64>::zeroed(&context, 1 << 16).expect("recv");
    kernels.spin_ns(&s, SPIN_NS).expect("spin");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        .expect("all_reduce");
    let started = Instant::now();
    drop(comm);
    eprintln!("drop with queued work: {:?}", started.elapsed());
    assert_bytes_eq("after the drop", &recv.to_vec().expect("download"), &input);
}

/// `ncclCommFinalize` + `ncclCommDestroy` by hand, as NCCL programs end (torch's
/// `destroy_process_group`): refused while a clone or a future still shares the rank, a typed
/// result otherwise, and `Aborted` for an aborted communicator.
#[test]
fn finalize_by_hand_reports_how_it_went() {
    let _gpu = gate!();
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(comm.context());
    let kernels = TestKernels::load(&context).expect("kernels");
    let s = stream(&context);
    let input = pattern::<u32>(1 << 16, 6);
    let send = upload(&context, &input);
    let mut recv = DeviceBuffer::<u32>::zeroed(&context, 1 << 16).expect("recv");
    kernels.spin_ns(&s, SPIN_NS).expect("spin");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        .expect("all_reduce");
    let future = comm.completion(&s).expect("future");
    let clone = comm.clone();
    assert!(matches!(
        clone.finalize(),
        Err(CollectiveError::InvalidArgument { .. })
    ));
    futures::executor::block_on(future).expect("the clone's refusal left the rank working");
    comm.finalize().expect("finalize and destroy");
    assert_bytes_eq("after finalize", &recv.to_vec().expect("download"), &input);

    let aborted = own_comm(&CommConfig::default());
    aborted.abort();
    assert!(matches!(
        aborted.finalize(),
        Err(CollectiveError::Aborted { .. })
    ));
}

/// 10^4 all-reduces over three streams, with a future and a synchronize every few hundred:
/// the trackers stay bounded by the streams, and the last result is exact.
#[test]
fn ten_thousand_all_reduces_over_three_streams_stay_bounded() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let streams = [stream(context), stream(context), stream(context)];
    let input = pattern::<i64>(512, 5);
    let send = upload(context, &input);
    let mut recv = DeviceBuffer::<i64>::zeroed(context, 512).expect("recv");
    for i in 0..10_000 {
        let s = &streams[i % 3];
        comm.all_reduce(&send, &mut recv, ReduceOp::Min, s)
            .expect("all_reduce");
        assert!(send.tracked_uses() <= 8, "{} uses", send.tracked_uses());
        assert!(recv.tracked_uses() <= 8, "{} uses", recv.tracked_uses());
        if i % 500 == 499 {
            futures::executor::block_on(comm.completion(s).expect("future")).expect("await");
        } else if i % 500 == 249 {
            comm.synchronize(s).expect("synchronize");
        }
    }
    for s in &streams {
        comm.synchronize(s).expect("synchronize");
    }
    assert_bytes_eq("after 10^4", &recv.to_vec().expect("download"), &input);
    assert!(!comm.is_aborted());
}

/// Several threads issue on clones of one communicator, each on its own stream and buffers
/// (issuing is serialised per communicator; the results are each thread's own).
#[test]
fn threads_issue_on_clones_of_one_communicator() {
    let _gpu = gate!();
    let comm = comm();
    std::thread::scope(|scope| {
        for t in 0..4 {
            let comm = comm.clone();
            scope.spawn(move || {
                let context = comm.context();
                let s = stream(context);
                let input = pattern::<f32>(4096 + t, 10 + t);
                let send = upload(context, &input);
                let mut recv = DeviceBuffer::<f32>::zeroed(context, 4096 + t).expect("recv");
                for _ in 0..200 {
                    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
                        .expect("all_reduce");
                }
                comm.synchronize(&s).expect("synchronize");
                assert_bytes_eq(
                    &format!("thread {t}"),
                    &recv.to_vec().expect("download"),
                    &input,
                );
            });
        }
    });
}

/// Two streams' futures awaited together, as `torch.futures.collect_all` does.
#[test]
fn futures_of_two_streams_are_awaited_together() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let (a, b) = (stream(context), stream(context));
    let (x, y) = (pattern::<u64>(1 << 18, 6), pattern::<i8>(1 << 18, 7));
    let (sx, sy) = (upload(context, &x), upload(context, &y));
    let mut rx = DeviceBuffer::<u64>::zeroed(context, 1 << 18).expect("rx");
    let mut ry = DeviceBuffer::<i8>::zeroed(context, 1 << 18).expect("ry");
    comm.all_reduce(&sx, &mut rx, ReduceOp::Sum, &a).expect("a");
    comm.broadcast(&sy, &mut ry, 0, &b).expect("b");
    let (fa, fb) = (
        comm.completion(&a).expect("future a"),
        comm.completion(&b).expect("future b"),
    );
    let (ra, rb) = futures::executor::block_on(futures::future::join(fa, fb));
    ra.expect("a resolves");
    rb.expect("b resolves");
    assert_bytes_eq("a", &rx.to_vec().expect("rx"), &x);
    assert_bytes_eq("b", &ry.to_vec().expect("ry"), &y);
}

/// A wait whose deadline passes before the stream gets there (a spinning kernel ahead of the
/// collective) is a typed `Timeout`; the communicator is aborted, and everything after is a
/// typed `Aborted`; the buffers and the process carry on.
#[test]
fn a_deadline_that_passes_aborts_and_every_later_use_is_a_typed_error() {
    let _gpu = gate!();
    let comm = own_comm(&CommConfig::default().with_timeout(Duration::from_secs(30)));
    let context = Arc::clone(comm.context());
    let kernels = TestKernels::load(&context).expect("kernels");
    let s = stream(&context);
    let input = pattern::<i32>(4096, 8);
    let send = upload(&context, &input);
    let mut recv = DeviceBuffer::<i32>::zeroed(&context, 4096).expect("recv");
    kernels.spin_ns(&s, 3 * SPIN_NS).expect("spin");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        .expect("all_reduce");
    let started = Instant::now();
    let error = comm
        .synchronize_within(&s, Duration::from_millis(20))
        .expect_err("the spin outlasts the deadline");
    eprintln!("deadline: {error} after {:?}", started.elapsed());
    assert!(error.is_timeout(), "{error}");
    assert!(comm.is_aborted());
    assert!(comm.as_raw().is_none());
    let aborted = |result: Result<(), CollectiveError>| {
        assert!(
            matches!(result, Err(CollectiveError::Aborted { .. })),
            "{result:?}"
        );
    };
    aborted(comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s));
    aborted(comm.broadcast_in_place(&mut recv, 0, &s));
    aborted(comm.synchronize(&s));
    aborted(comm.check_async_error());
    aborted(comm.completion(&s).map(drop));
    let mut group = Group::new();
    group
        .all_reduce(&comm, &send, &mut recv, ReduceOp::Sum, &s)
        .expect("checks pass");
    aborted(group.launch());
    assert!(matches!(
        comm.split(Some(0), 0),
        Err(CollectiveError::Aborted { .. })
    ));
    comm.abort(); // a second abort is harmless
    drop(comm);
    // The buffers and the device carry on: the queued copy finished behind the spin.
    assert_bytes_eq("after abort", &recv.to_vec().expect("download"), &input);
    let fresh = own_comm(&CommConfig::default());
    let mut again = upload(&context, &input);
    fresh
        .all_reduce_in_place(&mut again, ReduceOp::Max, &s)
        .expect("a new communicator works");
    assert_bytes_eq("fresh", &again.to_vec().expect("download"), &input);
}

/// The watchdog pattern: one thread waits for a collective (a 120 s deadline), another aborts
/// the communicator; the waiter gets a typed `Aborted` long before its deadline.
#[test]
fn an_abort_from_a_watchdog_thread_ends_a_pending_wait() {
    let _gpu = gate!();
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(comm.context());
    let kernels = TestKernels::load(&context).expect("kernels");
    let s = stream(&context);
    let mut buffer = upload(&context, &pattern::<u32>(1024, 9));
    kernels.spin_ns(&s, 5 * SPIN_NS).expect("spin");
    comm.all_reduce_in_place(&mut buffer, ReduceOp::Sum, &s)
        .expect("all_reduce");
    let started = Instant::now();
    let waited = std::thread::scope(|scope| {
        let waiter = scope.spawn(|| comm.synchronize(&s));
        // Not work: a moment for the waiter to be inside its wait (it gets `Aborted` either
        // way, from the wait or from `completion` refusing an aborted communicator).
        std::thread::sleep(Duration::from_millis(50));
        comm.abort();
        waiter.join().expect("waiter")
    });
    eprintln!("watchdog: {waited:?} after {:?}", started.elapsed());
    assert!(
        matches!(waited, Err(CollectiveError::Aborted { .. })),
        "{waited:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_bytes_eq(
        "the buffer is readable after the abort",
        &buffer.to_vec().expect("download"),
        &pattern::<u32>(1024, 9),
    );
}

/// `CommConfig::with_blocking(true)`: NCCL's own blocking calls, the same results.
#[test]
fn a_blocking_communicator_runs_every_collective() {
    let _gpu = gate!();
    let config = CommConfig::new()
        .with_blocking(true)
        .with_timeout(Duration::from_secs(60));
    let comm = own_comm(&config);
    assert!(comm.config().blocking);
    assert_eq!(comm.config().timeout, Duration::from_secs(60));
    let s = stream(comm.context());
    every_collective_on_views::<f32>(&comm, &s);
    every_collective_on_views::<u8>(&comm, &s);
    comm.check_async_error().expect("healthy");
    let child = comm.split(Some(7), 0).expect("split").expect("child");
    assert!(child.config().blocking);
    let mut buffer = upload(child.context(), &pattern::<i32>(99, 1));
    child
        .all_reduce_in_place(&mut buffer, ReduceOp::Sum, &s)
        .expect("child");
    assert_bytes_eq(
        "child",
        &buffer.to_vec().expect("download"),
        &pattern(99, 1),
    );
}

/// Rank 0 makes the id, sends it as text (JSON through serde, or hex), and "every" rank of a
/// world of one joins with it.
#[test]
fn init_rank_with_an_id_sent_as_json_and_hex() {
    let gpu = gate!();
    let id = UniqueId::new().expect("id");
    let json = serde_json::to_string(&id).expect("serialise");
    let received: UniqueId = serde_json::from_str(&json).expect("deserialise");
    assert_eq!(received.as_bytes(), id.as_bytes());
    assert_eq!(
        UniqueId::from_hex(&id.to_hex()).expect("hex").as_bytes(),
        id.as_bytes()
    );
    let comm = Communicator::init_rank(1, 0, &received, gpu.device, &CommConfig::default())
        .expect("init_rank");
    assert_eq!(
        (comm.rank(), comm.size(), comm.device()),
        (0, 1, gpu.device)
    );
    assert!(format!("{comm:?}").contains("nranks: 1"));
    let s = stream(comm.context());
    let mut buffer = upload(comm.context(), &pattern::<f32>(1000, 2));
    comm.all_reduce_in_place(&mut buffer, ReduceOp::Avg, &s)
        .expect("all_reduce");
    assert_bytes_eq(
        "avg",
        &buffer.to_vec().expect("download"),
        &pattern(1000, 2),
    );
    // A rank outside the world is refused before NCCL.
    assert!(matches!(
        Communicator::init_rank(1, 1, &id, gpu.device, &CommConfig::default()),
        Err(CollectiveError::InvalidArgument { .. })
    ));
    assert!(matches!(
        UniqueId::from_hex("not hex"),
        Err(CollectiveError::InvalidArgument { .. })
    ));
}

/// A split child works beside its parent, and keeps working after the parent is dropped.
#[test]
fn a_split_child_outlives_its_parent() {
    let _gpu = gate!();
    let parent = own_comm(&CommConfig::default());
    let child = parent.split(Some(3), 5).expect("split").expect("child");
    let s = stream(parent.context());
    let input = pattern::<u64>(2049, 3);
    let mut x = upload(parent.context(), &input);
    for _ in 0..10 {
        parent
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &s)
            .expect("parent");
        child
            .all_reduce_in_place(&mut x, ReduceOp::Max, &s)
            .expect("child");
    }
    drop(parent);
    child
        .all_reduce_in_place(&mut x, ReduceOp::Min, &s)
        .expect("child after the parent is gone");
    child.synchronize(&s).expect("synchronize");
    assert_bytes_eq("split", &x.to_vec().expect("download"), &input);
}

/// CUDA graphs with NCCL (torch's `torch.cuda.graph` around an all-reduce): the collective is
/// captured, not run; every replay runs it on the inputs of the moment.
#[test]
fn a_collective_captured_into_a_graph_replays_on_new_inputs() {
    let _gpu = gate!();
    if cuweave_test_support::skip_under_sanitizer(
        "user_patterns::a_collective_captured_into_a_graph_replays_on_new_inputs",
        "buffers used by a capture bound to no graph pool are leaked on purpose",
    ) {
        return;
    }
    // A communicator of its own: no other test's call lands on it while it captures.
    let comm = own_comm(&CommConfig::default());
    let context = comm.context();
    let s = stream(context);
    const N: usize = 1 << 14;
    let mut send = upload(context, &pattern::<f32>(N, 0));
    let mut recv = DeviceBuffer::<f32>::zeroed(context, N).expect("recv");
    s.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .expect("begin capture");
    let captured = comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s);
    let graph = s.end_capture().expect("end capture");
    captured.expect("all_reduce under capture");
    assert!(
        graph.node_count().expect("nodes") >= 1,
        "the call was captured"
    );
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");
    s.synchronize().expect("nothing ran");
    assert_bytes_eq(
        "captured, not run",
        &recv.to_vec().expect("download"),
        &vec![0.0; N],
    );
    for round in 1..4 {
        let input = pattern::<f32>(N, round);
        send.copy_from_host(&input).expect("new input");
        exec.launch(&s).expect("replay");
        s.synchronize().expect("replayed");
        assert_bytes_eq(
            &format!("replay {round}"),
            &recv.to_vec().expect("download"),
            &input,
        );
    }
    assert!(!comm.is_aborted());
}

/// Pinned host and unified buffers take part like device buffers.
#[test]
fn pinned_and_unified_buffers_take_part_in_collectives() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let s = stream(context);
    let input = pattern::<f32>(1 << 16, 4);
    let pinned = PinnedBuffer::from_slice(context, &input).expect("pinned");
    let mut device = DeviceBuffer::<f32>::zeroed(context, 1 << 16).expect("device");
    comm.all_reduce(&pinned, &mut device, ReduceOp::Sum, &s)
        .expect("from pinned");
    let mut unified = UnifiedBuffer::<f32>::zeroed(context, 1 << 16).expect("unified");
    comm.broadcast(&device, &mut unified, 0, &s)
        .expect("into unified");
    let mut back = PinnedBuffer::<f32>::zeroed(context, 1 << 16).expect("pinned");
    comm.all_gather(&unified, &mut back, &s)
        .expect("into pinned");
    comm.synchronize(&s).expect("synchronize");
    assert_bytes_eq("device", &device.to_vec().expect("device"), &input);
    assert_bytes_eq("unified", &unified.to_vec().expect("unified"), &input);
    assert_bytes_eq("pinned", &back.to_vec().expect("pinned"), &input);
}

/// Bad input is a typed error before NCCL sees it, and the communicator stays usable.
#[test]
fn bad_counts_roots_and_peers_are_typed_errors_before_nccl() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let s = stream(context);
    let send = DeviceBuffer::<i32>::zeroed(context, 16).expect("send");
    let mut other = DeviceBuffer::<i32>::zeroed(context, 15).expect("other");
    let mut same = DeviceBuffer::<i32>::zeroed(context, 16).expect("same");
    let invalid = |what: &str, result: Result<(), CollectiveError>| {
        assert!(
            matches!(result, Err(CollectiveError::InvalidArgument { .. })),
            "{what}: {result:?}"
        );
    };
    invalid(
        "all_reduce",
        comm.all_reduce(&send, &mut other, ReduceOp::Sum, &s),
    );
    invalid("broadcast", comm.broadcast(&send, &mut other, 0, &s));
    invalid(
        "reduce",
        comm.reduce(&send, &mut other, ReduceOp::Sum, 0, &s),
    );
    invalid("all_gather", comm.all_gather(&send, &mut other, &s));
    invalid(
        "reduce_scatter",
        comm.reduce_scatter(&send, &mut other, ReduceOp::Sum, &s),
    );
    invalid("broadcast root", comm.broadcast(&send, &mut same, 1, &s));
    invalid(
        "reduce root",
        comm.reduce(&send, &mut same, ReduceOp::Sum, 1, &s),
    );
    invalid(
        "broadcast_in_place root",
        comm.broadcast_in_place(&mut same, 2, &s),
    );
    invalid(
        "reduce_in_place root",
        comm.reduce_in_place(&mut same, ReduceOp::Sum, 9, &s),
    );
    invalid("send peer", comm.send(&send, 1, &s));
    invalid("recv peer", comm.recv(&mut same, 1, &s));
    {
        let mut spare = DeviceBuffer::<i32>::zeroed(context, 16).expect("spare");
        let mut group = Group::new();
        invalid(
            "group reduce_in_place root",
            group
                .reduce_in_place(comm, &mut spare, ReduceOp::Sum, 1, &s)
                .map(drop),
        );
        invalid(
            "group all_gather",
            group.all_gather(comm, &send, &mut other, &s).map(drop),
        );
        assert!(group.is_empty());
    }
    // A read-only view as an output is the tracker's typed error.
    let mut read_only = send.slice(..8).expect("view");
    assert!(matches!(
        comm.all_gather_in_place(&mut read_only, &s),
        Err(CollectiveError::Memory(
            cuweave_memory::MemoryError::ReadOnlyView { .. }
        ))
    ));
    // Empty buffers and views cannot be made, so no collective of zero elements reaches NCCL.
    assert!(send.slice(4..4).is_err());
    assert!(!comm.is_aborted());
    comm.all_reduce(&send, &mut same, ReduceOp::Sum, &s)
        .expect("still usable");
    assert_bytes_eq("zeros", &same.to_vec().expect("download"), &[0i32; 16]);
}

/// NCCL's copy for a rank's send to itself moves the *send's* bytes into the receive buffer,
/// so a smaller receive would be written past its end: pairs that differ, lone halves and
/// ungrouped self sends are typed errors before NCCL (the memory after the receive view stays
/// intact); pairs of equal bytes run in the order they were added, element types may differ.
#[test]
fn self_sends_and_receives_must_pair_up_in_a_group() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let s = stream(context);
    let invalid = |what: &str, result: Result<(), CollectiveError>| {
        assert!(
            matches!(result, Err(CollectiveError::InvalidArgument { .. })),
            "{what}: {result:?}"
        );
    };
    let stale = pattern::<u32>(64, 99);
    let big = upload(context, &pattern::<u32>(64, 1));
    let mut whole = upload(context, &stale);
    {
        let mut first_half = whole.slice_mut(..32).expect("view");
        let mut group = Group::new();
        group.send(comm, &big, 0, &s).expect("send");
        group.recv(comm, &mut first_half, 0, &s).expect("recv");
        invalid("256 bytes into 128", group.launch());
    }
    comm.synchronize(&s).expect("synchronize");
    assert_bytes_eq(
        "nothing written, least of all past the view",
        &whole.to_vec().expect("download"),
        &stale,
    );

    let mut lone = Group::new();
    lone.send(comm, &big, 0, &s).expect("send");
    invalid("a send without its receive", lone.launch());
    let mut other = DeviceBuffer::<u32>::zeroed(context, 64).expect("other");
    let mut lone = Group::new();
    lone.recv(comm, &mut other, 0, &s).expect("recv");
    invalid("a receive without its send", lone.launch());
    invalid("an ungrouped send to itself", comm.send(&big, 0, &s));
    invalid("an ungrouped receive", comm.recv(&mut other, 0, &s));

    // Same bytes, other types: 16 u32 land as 64 u8.
    let words = pattern::<u32>(16, 2);
    let send = upload(context, &words);
    let mut bytes = DeviceBuffer::<u8>::zeroed(context, 64).expect("bytes");
    let mut group = Group::new();
    group.send(comm, &send, 0, &s).expect("send");
    group.recv(comm, &mut bytes, 0, &s).expect("recv");
    group.launch().expect("same bytes");
    assert_eq!(
        bytes.to_vec().expect("download"),
        bytemuck::cast_slice::<u32, u8>(&words)
    );

    // Two pairs, matched in the order they were added (an all-to-all of one rank).
    let (a, b) = (pattern::<i32>(10, 3), pattern::<i32>(20, 4));
    let (send_a, send_b) = (upload(context, &a), upload(context, &b));
    let mut recv_a = DeviceBuffer::<i32>::zeroed(context, 10).expect("recv a");
    let mut recv_b = DeviceBuffer::<i32>::zeroed(context, 20).expect("recv b");
    {
        let mut group = Group::new();
        group.send(comm, &send_a, 0, &s).expect("send a");
        group.send(comm, &send_b, 0, &s).expect("send b");
        group.recv(comm, &mut recv_b, 0, &s).expect("recv b");
        group.recv(comm, &mut recv_a, 0, &s).expect("recv a");
        invalid("pairs out of order", group.launch());
    }
    let mut group = Group::new();
    group.send(comm, &send_a, 0, &s).expect("send a");
    group.send(comm, &send_b, 0, &s).expect("send b");
    group.recv(comm, &mut recv_a, 0, &s).expect("recv a");
    group.recv(comm, &mut recv_b, 0, &s).expect("recv b");
    group.launch().expect("pairs in order");
    assert_bytes_eq("a", &recv_a.to_vec().expect("a"), &a);
    assert_bytes_eq("b", &recv_b.to_vec().expect("b"), &b);
    assert!(!comm.is_aborted());
}

/// A DAG of coordinated collectives on two streams: a diamond (all-reduce, then a broadcast
/// and a reduce after it on different streams, then an all-gather after both through `run`),
/// at high priority; a refused call inside `run` leaves nothing behind.
#[test]
fn coordinated_collectives_form_a_diamond_and_a_refused_call_retires() {
    let gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let coordinator = OperationCoordinator::new(EventPool::new(&gpu.context, 8, 8).expect("pool"))
        .expect("coordinator");
    let collectives =
        CoordinatedCollectives::new(coordinator.clone()).with_priority(EventPriority::High);
    let (a, b) = (Arc::new(stream(context)), Arc::new(stream(context)));
    let input = pattern::<f32>(1 << 15, 5);
    let send = upload(context, &input);
    let zeros = || DeviceBuffer::<f32>::zeroed(context, 1 << 15).expect("zeros");
    let (mut top, mut left, mut right, mut bottom) = (zeros(), zeros(), zeros(), zeros());
    let first = collectives
        .all_reduce(comm, &send, &mut top, ReduceOp::Sum, &a, &[])
        .expect("top");
    let l = collectives
        .broadcast(comm, &top, &mut left, 0, &b, &[first])
        .expect("left");
    let r = collectives
        .reduce(comm, &top, &mut right, ReduceOp::Min, 0, &a, &[first])
        .expect("right");
    let last = collectives
        .run(
            OperationType::AllReduce,
            &b,
            &[l, r],
            "all_gather after both",
            |s| comm.all_gather(&right, &mut bottom, s),
        )
        .expect("bottom");
    futures::executor::block_on(collectives.completion(last).expect("future")).expect("done");
    for (what, buffer) in [("left", &left), ("right", &right), ("bottom", &bottom)] {
        assert_bytes_eq(what, &buffer.to_vec().expect("download"), &input);
    }

    let mut short = DeviceBuffer::<f32>::zeroed(context, 7).expect("short");
    let error = collectives
        .all_reduce(comm, &send, &mut short, ReduceOp::Sum, &a, &[last])
        .expect_err("lengths differ");
    assert!(
        matches!(error, CollectiveError::InvalidArgument { .. }),
        "{error}"
    );
    a.synchronize().expect("a");
    b.synchronize().expect("b");
    coordinator.retire_finished();
    assert_eq!(coordinator.live_operations(), 0, "everything retired");
    assert_eq!(coordinator.metrics().registered, 5);
}

fn devices_or_skip(test: &str) -> Option<Vec<Device>> {
    let devices = Device::all().expect("devices");
    if devices.len() < 2 {
        skip(
            test,
            &format!(
                "needs two GPUs, found {} (multi-rank program)",
                devices.len()
            ),
        );
        return None;
    }
    Some(devices)
}

fn rank_values<T: NcclType + From<u8>>(rank: usize, len: usize) -> Vec<T> {
    vec![T::from(rank as u8 + 1); len]
}

/// One process driving every GPU: grouped all-reduce (the sum of the ranks' values), in-place
/// broadcast from the last rank, and all-gather in rank order.
#[test]
fn one_process_drives_every_gpu_with_grouped_calls() {
    let _gpu = gate!();
    let Some(devices) = devices_or_skip("one_process_drives_every_gpu_with_grouped_calls") else {
        return;
    };
    let n = devices.len();
    let comms = Communicator::init_all(&devices, &CommConfig::default()).expect("init_all");
    let streams: Vec<Stream> = comms.iter().map(|c| stream(c.context())).collect();
    let len = 1 << 16;
    let mut sums: Vec<DeviceBuffer<i32>> = comms
        .iter()
        .map(|c| upload_plain(c.context(), &rank_values::<i32>(c.rank(), len)))
        .collect();
    let mut group = Group::new();
    for ((comm, buffer), s) in comms.iter().zip(&mut sums).zip(&streams) {
        group
            .all_reduce_in_place(comm, buffer, ReduceOp::Sum, s)
            .expect("add");
    }
    group.launch().expect("launch");
    let total = (n * (n + 1) / 2) as i32;
    for buffer in &sums {
        assert_eq!(buffer.to_vec().expect("download"), vec![total; len]);
    }

    let mut params: Vec<DeviceBuffer<u8>> = comms
        .iter()
        .map(|c| upload_plain(c.context(), &rank_values::<u8>(c.rank(), len)))
        .collect();
    let mut group = Group::new();
    for ((comm, buffer), s) in comms.iter().zip(&mut params).zip(&streams) {
        group
            .broadcast_in_place(comm, buffer, n - 1, s)
            .expect("add");
    }
    group.launch().expect("launch");
    for buffer in &params {
        assert_eq!(buffer.to_vec().expect("download"), vec![n as u8; len]);
    }

    let sends: Vec<DeviceBuffer<u32>> = comms
        .iter()
        .map(|c| upload_plain(c.context(), &rank_values::<u32>(c.rank(), 1000)))
        .collect();
    let mut gathered: Vec<DeviceBuffer<u32>> = comms
        .iter()
        .map(|c| DeviceBuffer::zeroed(c.context(), 1000 * n).expect("gathered"))
        .collect();
    let mut group = Group::new();
    for (((comm, send), recv), s) in comms.iter().zip(&sends).zip(&mut gathered).zip(&streams) {
        group.all_gather(comm, send, recv, s).expect("add");
    }
    group.launch().expect("launch");
    let want: Vec<u32> = (0..n).flat_map(|r| rank_values::<u32>(r, 1000)).collect();
    for buffer in &gathered {
        assert_eq!(buffer.to_vec().expect("download"), want);
    }
}

/// One thread per GPU, each joining with `init_rank` and the same id.
#[test]
fn one_thread_per_gpu_joins_with_init_rank() {
    let _gpu = gate!();
    let Some(devices) = devices_or_skip("one_thread_per_gpu_joins_with_init_rank") else {
        return;
    };
    let n = devices.len();
    let id = UniqueId::new().expect("id");
    let results: Vec<Vec<f64>> = std::thread::scope(|scope| {
        let ranks: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(rank, &device)| {
                scope.spawn(move || {
                    let comm =
                        Communicator::init_rank(n, rank, &id, device, &CommConfig::default())
                            .expect("init_rank");
                    let s = stream(comm.context());
                    let mut buffer = upload_plain(comm.context(), &vec![rank as f64 + 1.0; 4096]);
                    comm.all_reduce_in_place(&mut buffer, ReduceOp::Avg, &s)
                        .expect("all_reduce");
                    comm.synchronize(&s).expect("synchronize");
                    buffer.to_vec().expect("download")
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|rank| rank.join().expect("rank"))
            .collect()
    });
    // NCCL averages floats by pre-multiplying with 1/n, so the mean is exact only to rounding.
    let mean = (n + 1) as f64 / 2.0;
    for result in results {
        assert!(
            result.iter().all(|x| (x - mean).abs() < 1e-12),
            "want {mean}, got {:?}",
            &result[..4]
        );
    }
}

fn upload_plain<T: NcclType>(context: &Arc<Context>, values: &[T]) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(context, values).expect("upload")
}
