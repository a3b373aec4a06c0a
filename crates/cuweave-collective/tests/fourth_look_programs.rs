//! Fourth-look programs for the collective layer, written as NCCL, nccl-tests and
//! torch.distributed users write them, on what the other GPU tests leave out:
//!
//! - two independent communicators on one device, chained through a user kernel, an
//!   all-reduce and one group that spans both, over many steps without host waits between;
//! - a 64 MiB buffer ping-ponged through an all-reduce and a reduce on two streams while a
//!   kernel increments it on a third, each step held late behind a spin;
//! - one of two communicators of a device aborted while the other has work queued: the other's
//!   future and bytes are untouched, and a replacement joins it in a group;
//! - three generations of splits in one group (mixed-type self exchange included), finalised
//!   child first or parent first, the survivors still exact;
//! - a group refused at launch by one read-only output queues none of its calls; views past the
//!   end and empty views are typed memory errors;
//! - on two GPUs (skipped with a reason on one): a reduce leaves the non-root's output and
//!   in-place input alone; an all-to-all of grouped sends and receives with self exchanges and
//!   other element types on the receiving side; a ping-pong between one thread per rank with a
//!   kernel on every hop; a split where one rank opts out and one whose keys reverse the ranks;
//!   views at different offsets on each rank.
//!
//! Every test takes the binary's serial guard (`gate!`).

#[macro_use]
mod common;

use std::sync::Arc;

use common::increment::{increment, incrementer, plus};
use common::{Pattern, assert_bytes_eq, comm, own_comm, pattern, skip, stream};
use cuweave_collective::{
    Bf16, CollectiveError, CommConfig, Communicator, F16, Group, NcclType, ReduceOp, UniqueId,
};
use cuweave_driver::{Context, Device, Stream};
use cuweave_memory::{Buffer, BufferSlice, BufferSliceMut, DeviceBuffer, MemoryError};

/// 20 ms of a spinning kernel: work queued behind it on its stream starts that late, so work on
/// another stream that did not wait for it would run first and show in the bytes.
const SPIN_NS: u64 = 20_000_000;

fn upload<T: NcclType>(context: &Arc<Context>, values: &[T]) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(context, values).expect("upload")
}

/// The first two devices, or `None` after printing why the two-rank program is skipped.
fn two_devices_or_skip(test: &str) -> Option<[Device; 2]> {
    let devices = Device::all().expect("devices");
    if devices.len() < 2 {
        skip(
            &format!("fourth_look_programs::{test}"),
            &format!(
                "needs two GPUs, found {} (a two-rank program)",
                devices.len()
            ),
        );
        return None;
    }
    Some([devices[0], devices[1]])
}

/// Two ranks of one `init_all` over `devices`, and a non-blocking stream for each.
fn two_ranks(devices: &[Device; 2]) -> (Vec<Communicator>, Vec<Stream>) {
    let comms = Communicator::init_all(devices, &CommConfig::default()).expect("init_all");
    let streams = comms.iter().map(|c| stream(c.context())).collect();
    (comms, streams)
}

fn synchronize_all(comms: &[Communicator], streams: &[Stream]) {
    for (c, s) in comms.iter().zip(streams) {
        c.synchronize(s).expect("synchronize");
    }
}

// ---------------------------------------------------------------------------------------------
// One GPU
// ---------------------------------------------------------------------------------------------

/// Two process groups on one GPU (torch's `new_group` over a one-rank world, twice): each step
/// a kernel increments `x` on a compute stream (held behind a spin every eighth step),
/// communicator A all-reduces it (max) into `y` on its stream, and one group spanning both
/// communicators broadcasts `y` into `z` (B) and all-gathers it into `w` (A); the compute
/// stream then copies `z` and `w` into the step's rows of two histories. Futures of both
/// communicators are awaited together every sixteenth step only. Every row holding exactly
/// `x0 + step + 1` proves each edge between the three streams and the two communicators.
#[test]
fn two_communicators_on_one_device_chain_kernels_collectives_and_a_shared_group_over_steps() {
    let (_gpu, _serial) = gate!();
    let a = own_comm(&CommConfig::default());
    let b = own_comm(&CommConfig::default());
    assert_eq!((a.size(), b.size()), (1, 1));
    assert_eq!(a.device(), b.device());
    let context = Arc::clone(a.context());
    let (kernels, inc) = incrementer(&context);
    let (sk, sa, sb) = (stream(&context), stream(&context), stream(&context));
    const LEN: usize = 4099;
    const STEPS: usize = 64;
    let x0 = pattern::<u32>(LEN, 11);
    let mut x = upload(&context, &x0);
    let mut y = upload(&context, &pattern::<u32>(LEN, 12));
    let mut z = upload(&context, &pattern::<u32>(LEN, 13));
    let mut w = upload(&context, &pattern::<u32>(LEN, 14));
    let mut hz = DeviceBuffer::<u32>::zeroed(&context, LEN * STEPS).expect("history z");
    let mut hw = DeviceBuffer::<u32>::zeroed(&context, LEN * STEPS).expect("history w");
    for step in 0..STEPS {
        if step % 8 == 0 {
            kernels.spin_ns(&sk, SPIN_NS).expect("spin");
        }
        increment(&inc, &sk, &mut x);
        a.all_reduce(&x, &mut y, ReduceOp::Max, &sa)
            .expect("A all_reduce");
        {
            let mut group = Group::new();
            group
                .broadcast(&b, &y, &mut z, 0, &sb)
                .expect("B broadcast");
            group.all_gather(&a, &y, &mut w, &sa).expect("A all_gather");
            group.launch().expect("one group over two communicators");
        }
        let row = step * LEN..(step + 1) * LEN;
        hz.slice_mut(row.clone())
            .expect("row")
            .copy_from_async(&z, &sk)
            .expect("copy z");
        hw.slice_mut(row)
            .expect("row")
            .copy_from_async(&w, &sk)
            .expect("copy w");
        if step % 16 == 15 {
            let (ra, rb) = futures::executor::block_on(futures::future::join(
                a.completion(&sa).expect("A future"),
                b.completion(&sb).expect("B future"),
            ));
            ra.expect("A's work");
            rb.expect("B's work");
        }
    }
    let (gz, gw) = (hz.to_vec().expect("z rows"), hw.to_vec().expect("w rows"));
    for step in 0..STEPS {
        let want = plus(&x0, step as u32 + 1);
        let row = step * LEN..(step + 1) * LEN;
        assert_bytes_eq(&format!("z at step {step}"), &gz[row.clone()], &want);
        assert_bytes_eq(&format!("w at step {step}"), &gw[row], &want);
    }
    assert!(!a.is_aborted() && !b.is_aborted());
    a.finalize().expect("finalize A");
    b.finalize().expect("finalize B");
}

/// nccl-tests' largest default size on one rank: a 64 MiB `u32` buffer goes round a loop of
/// six steps with no host wait: a kernel increments `a` on the compute stream (behind a spin),
/// an all-reduce (sum) copies it into `b` on a second stream, and a reduce (max) to root 0
/// writes `b` back into `a` on a third. Both ending at exactly `a0 + 6` proves every step read
/// what the step before it wrote, across three streams, at a size where a missed edge shows.
#[test]
fn a_64_mib_buffer_ping_pongs_through_collectives_and_a_kernel_on_three_streams() {
    let (_gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let (kernels, inc) = incrementer(context);
    let (sk, s1, s2) = (stream(context), stream(context), stream(context));
    const LEN: usize = 16 << 20;
    const STEPS: u32 = 6;
    let a0 = pattern::<u32>(LEN, 21);
    let mut a = upload(context, &a0);
    let mut b = upload(context, &pattern::<u32>(LEN, 22));
    for _ in 0..STEPS {
        kernels.spin_ns(&sk, SPIN_NS).expect("spin");
        increment(&inc, &sk, &mut a);
        comm.all_reduce(&a, &mut b, ReduceOp::Sum, &s1)
            .expect("all_reduce");
        comm.reduce(&b, &mut a, ReduceOp::Max, 0, &s2)
            .expect("reduce");
    }
    let want = plus(&a0, STEPS);
    assert_bytes_eq("a", &a.to_vec().expect("a"), &want);
    assert_bytes_eq("b", &b.to_vec().expect("b"), &want);
    comm.synchronize(&s2).expect("synchronize");
}

/// A job with two process groups on one GPU loses one of them (`abort`, as a watchdog does)
/// while both have a collective queued behind a spin. The other's future resolves `Ok` with
/// exact bytes, it keeps working for 50 kernel-and-collective steps, and a fresh communicator
/// replacing the aborted one joins it in a group on the aborted one's stream and buffers. The
/// aborted one answers `Aborted` everywhere, its pending future included.
#[test]
fn aborting_one_of_two_communicators_of_a_device_spares_the_others_work_and_a_replacement_joins_it()
{
    let (_gpu, _serial) = gate!();
    let a = own_comm(&CommConfig::default());
    let b = own_comm(&CommConfig::default());
    let context = Arc::clone(a.context());
    let (kernels, inc) = incrementer(&context);
    let (sa, sb) = (stream(&context), stream(&context));
    const LEN: usize = 65_537;
    let input = pattern::<u32>(LEN, 31);
    let x = upload(&context, &input);
    let mut ya = DeviceBuffer::<u32>::zeroed(&context, LEN).expect("ya");
    let mut yb = DeviceBuffer::<u32>::zeroed(&context, LEN).expect("yb");
    kernels.spin_ns(&sa, 4 * SPIN_NS).expect("spin");
    a.all_reduce(&x, &mut ya, ReduceOp::Sum, &sa)
        .expect("A all_reduce");
    kernels.spin_ns(&sb, 4 * SPIN_NS).expect("spin");
    b.all_reduce(&x, &mut yb, ReduceOp::Min, &sb)
        .expect("B all_reduce");
    let pending_a = a.completion(&sa).expect("A future");
    let pending_b = b.completion(&sb).expect("B future");
    a.abort();
    assert!(a.is_aborted());
    assert!(!b.is_aborted(), "an abort of A reaches B");
    let a_result = futures::executor::block_on(pending_a);
    assert!(
        matches!(a_result, Err(CollectiveError::Aborted { .. })),
        "{a_result:?}"
    );
    futures::executor::block_on(pending_b).expect("B's queued work");
    b.check_async_error().expect("B healthy");
    assert_bytes_eq("B's result", &yb.to_vec().expect("yb"), &input);
    for _ in 0..50 {
        increment(&inc, &sb, &mut yb);
        b.all_reduce_in_place(&mut yb, ReduceOp::Max, &sb)
            .expect("B keeps working");
    }
    assert!(matches!(
        a.synchronize(&sa),
        Err(CollectiveError::Aborted { .. })
    ));
    assert!(matches!(
        a.broadcast_in_place(&mut ya, 0, &sa),
        Err(CollectiveError::Aborted { .. })
    ));
    // The aborted rank's output is undefined (its kernel may have been cut short), but it is an
    // ordinary buffer again: readable, and written by the replacement below.
    ya.to_vec()
        .expect("the aborted collective's output is readable");
    let c = own_comm(&CommConfig::default());
    let mut yc = DeviceBuffer::<u32>::zeroed(&context, LEN).expect("yc");
    {
        let mut group = Group::new();
        group
            .all_reduce(&c, &yb, &mut ya, ReduceOp::Sum, &sa)
            .expect("C all_reduce");
        group
            .broadcast(&b, &x, &mut yc, 0, &sb)
            .expect("B broadcast");
        group.launch().expect("the replacement's group");
    }
    c.synchronize(&sa).expect("C");
    b.synchronize(&sb).expect("B");
    assert_bytes_eq("C's result", &ya.to_vec().expect("ya"), &plus(&input, 50));
    assert_bytes_eq("B's broadcast", &yc.to_vec().expect("yc"), &input);
    assert!(matches!(a.finalize(), Err(CollectiveError::Aborted { .. })));
    c.finalize().expect("finalize C");
    b.finalize().expect("finalize B");
}

/// `new_group` of a `new_group` of a `new_group`: a communicator, its split child and the
/// child's split grandchild run in one group (a product all-reduce, a min reduce, an in-place
/// all-gather, and a self exchange that sends bytes and receives them as `f32`), on two
/// streams. Each family is then finalised one member at a time, child first or parent first,
/// and every survivor still all-reduces exactly; every finalisation reports `Ok`.
#[test]
fn three_generations_of_splits_share_a_group_and_finalize_in_either_order() {
    let (_gpu, _serial) = gate!();
    for parent_first in [false, true] {
        let parent = own_comm(&CommConfig::default());
        let child = parent.split(Some(3), 0).expect("split").expect("child");
        let grandchild = child.split(Some(0), 7).expect("split").expect("grand");
        assert!(child.split(None, 0).expect("no color").is_none());
        assert_eq!(
            (
                child.size(),
                child.rank(),
                grandchild.size(),
                grandchild.rank()
            ),
            (1, 0, 1, 0)
        );
        let context = Arc::clone(parent.context());
        let (s1, s2) = (stream(&context), stream(&context));
        const LEN: usize = 3001;
        let f = pattern::<f32>(LEN, 41);
        let d = pattern::<f64>(LEN, 42);
        let g = pattern::<i8>(LEN, 43);
        let fs = upload(&context, &f);
        let mut fr = upload(&context, &pattern::<f32>(LEN, 44));
        let ds = upload(&context, &d);
        let mut dr = upload(&context, &pattern::<f64>(LEN, 45));
        let mut gb = upload(&context, &g);
        let bytes = upload(&context, bytemuck::cast_slice::<f32, u8>(&f));
        let mut fx = upload(&context, &pattern::<f32>(LEN, 46));
        {
            let mut group = Group::new();
            group
                .all_reduce(&parent, &fs, &mut fr, ReduceOp::Prod, &s1)
                .expect("parent");
            group
                .reduce(&child, &ds, &mut dr, ReduceOp::Min, 0, &s2)
                .expect("child");
            group
                .all_gather_in_place(&grandchild, &mut gb, &s2)
                .expect("grandchild gather");
            group.send(&grandchild, &bytes, 0, &s1).expect("send bytes");
            group.recv(&grandchild, &mut fx, 0, &s1).expect("recv f32");
            group.launch().expect("three generations in one group");
        }
        for (c, s) in [(&parent, &s1), (&child, &s2), (&grandchild, &s1)] {
            c.synchronize(s).expect("synchronize");
        }
        assert_bytes_eq("parent", &fr.to_vec().expect("fr"), &f);
        assert_bytes_eq("child", &dr.to_vec().expect("dr"), &d);
        assert_bytes_eq("grandchild gather", &gb.to_vec().expect("gb"), &g);
        assert_bytes_eq("bytes as f32", &fx.to_vec().expect("fx"), &f);

        let mut family = if parent_first {
            vec![
                ("parent", parent),
                ("child", child),
                ("grandchild", grandchild),
            ]
        } else {
            vec![
                ("grandchild", grandchild),
                ("child", child),
                ("parent", parent),
            ]
        };
        while !family.is_empty() {
            let (name, first) = family.remove(0);
            first
                .finalize()
                .unwrap_or_else(|e| panic!("finalize {name}: {e}"));
            for (i, (survivor, c)) in family.iter().enumerate() {
                let input = pattern::<u64>(LEN, 50 + i);
                let mut buffer = upload(&context, &input);
                c.all_reduce_in_place(&mut buffer, ReduceOp::Sum, &s2)
                    .expect("a survivor works");
                c.synchronize(&s2).expect("synchronize");
                assert_bytes_eq(
                    &format!("{survivor} after {name} was finalised"),
                    &buffer.to_vec().expect("download"),
                    &input,
                );
            }
        }
    }
}

/// A group whose middle call writes through a read-only view is refused at launch by the view's
/// tracker (`MemoryError::ReadOnlyView`) before NCCL sees it: none of the group's calls is
/// queued (their outputs keep their bytes), and the communicator stays healthy. The same group
/// with a writable view then runs exactly. A view past the end, or an empty one, is a typed
/// memory error before any call can be made.
#[test]
fn a_group_refused_at_launch_by_one_read_only_output_queues_none_of_its_calls() {
    let (_gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let (s1, s2) = (stream(context), stream(context));
    const LEN: usize = 4096;
    let input = pattern::<i32>(LEN, 61);
    let stale = pattern::<i32>(LEN, 62);
    let send = upload(context, &input);
    let mut recv = upload(context, &stale);
    let mut gathered = upload(context, &stale);
    let mut target = upload(context, &stale);
    {
        let mut read_only = target.slice(5..1005).expect("read-only view");
        let mut group = Group::new();
        group
            .all_reduce(comm, &send, &mut recv, ReduceOp::Sum, &s1)
            .expect("add");
        group
            .broadcast_in_place(comm, &mut read_only, 0, &s2)
            .expect("lengths and devices pass; the tracker judges the access");
        group
            .all_gather(comm, &send, &mut gathered, &s1)
            .expect("add");
        assert_eq!(group.len(), 3);
        let error = group.launch().expect_err("a read-only output");
        assert!(
            matches!(
                error,
                CollectiveError::Memory(MemoryError::ReadOnlyView { .. })
            ),
            "{error}"
        );
    }
    comm.synchronize(&s1).expect("s1");
    comm.synchronize(&s2).expect("s2");
    assert!(!comm.is_aborted());
    comm.check_async_error().expect("healthy");
    assert_bytes_eq("all_reduce not queued", &recv.to_vec().expect("r"), &stale);
    assert_bytes_eq(
        "all_gather not queued",
        &gathered.to_vec().expect("g"),
        &stale,
    );
    assert_bytes_eq("view untouched", &target.to_vec().expect("t"), &stale);

    assert!(matches!(
        send.slice(4000..4097),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        recv.slice_mut(7..7),
        Err(MemoryError::ZeroLength { .. })
    ));

    {
        let mut writable = target.slice_mut(5..1005).expect("writable view");
        writable
            .copy_from_host(&input[..1000])
            .expect("the root's data");
        let mut group = Group::new();
        group
            .all_reduce(comm, &send, &mut recv, ReduceOp::Sum, &s1)
            .expect("add");
        group
            .broadcast_in_place(comm, &mut writable, 0, &s2)
            .expect("add");
        group
            .all_gather(comm, &send, &mut gathered, &s1)
            .expect("add");
        group.launch().expect("the same group, writable");
    }
    comm.synchronize(&s1).expect("s1");
    comm.synchronize(&s2).expect("s2");
    assert_bytes_eq("all_reduce", &recv.to_vec().expect("r"), &input);
    assert_bytes_eq("all_gather", &gathered.to_vec().expect("g"), &input);
    let mut want = stale.clone();
    want[5..1005].copy_from_slice(&input[..1000]);
    assert_bytes_eq("broadcast view", &target.to_vec().expect("t"), &want);
}

// ---------------------------------------------------------------------------------------------
// Two GPUs
// ---------------------------------------------------------------------------------------------

/// Reduces to root 1 out of place and to root 0 in place, grouped over both ranks, and checks
/// the root's result against the host and the other rank's buffer byte for byte: the non-root's
/// output keeps its sentinel (NCCL: `recvbuff` is only used on the root) and its in-place input
/// stays its input.
fn reduce_leaves_non_root_alone<T: Pattern + Copy>(
    comms: &[Communicator],
    streams: &[Stream],
    count: usize,
    op: ReduceOp,
    host: fn(T, T) -> T,
) {
    let what = format!("{op:?} of {count} × {}", std::any::type_name::<T>());
    let inputs: Vec<Vec<T>> = (0..2).map(|r| pattern::<T>(count, 100 + r)).collect();
    let sentinel = pattern::<T>(count, 999);
    let want: Vec<T> = inputs[0]
        .iter()
        .zip(&inputs[1])
        .map(|(&a, &b)| host(a, b))
        .collect();
    let sends: Vec<DeviceBuffer<T>> = comms
        .iter()
        .zip(&inputs)
        .map(|(c, v)| upload(c.context(), v))
        .collect();
    let mut recvs: Vec<DeviceBuffer<T>> = comms
        .iter()
        .map(|c| upload(c.context(), &sentinel))
        .collect();
    {
        let mut group = Group::new();
        for ((c, s), (send, recv)) in comms.iter().zip(streams).zip(sends.iter().zip(&mut recvs)) {
            group.reduce(c, send, recv, op, 1, s).expect("add reduce");
        }
        group.launch().expect("reduce to root 1");
    }
    synchronize_all(comms, streams);
    assert_bytes_eq(
        &format!("{what}: root 1"),
        &recvs[1].to_vec().expect("root"),
        &want,
    );
    assert_bytes_eq(
        &format!("{what}: rank 0's output untouched"),
        &recvs[0].to_vec().expect("non-root"),
        &sentinel,
    );
    let mut buffers: Vec<DeviceBuffer<T>> = comms
        .iter()
        .zip(&inputs)
        .map(|(c, v)| upload(c.context(), v))
        .collect();
    {
        let mut group = Group::new();
        for ((c, s), buffer) in comms.iter().zip(streams).zip(&mut buffers) {
            group
                .reduce_in_place(c, buffer, op, 0, s)
                .expect("add reduce in place");
        }
        group.launch().expect("reduce in place to root 0");
    }
    synchronize_all(comms, streams);
    assert_bytes_eq(
        &format!("{what}: in place at root 0"),
        &buffers[0].to_vec().expect("root"),
        &want,
    );
    assert_bytes_eq(
        &format!("{what}: rank 1's in-place input untouched"),
        &buffers[1].to_vec().expect("non-root"),
        &inputs[1],
    );
}

/// torch's `dist.reduce(tensor, dst)` across two GPUs at 1, 3 and 1 000 003 elements, for
/// several element types and reductions: the root's result is the host's, and the non-root's
/// buffers are left exactly as they were.
#[test]
fn two_gpus_reduce_leaves_the_non_roots_output_and_in_place_input_untouched() {
    let (_gpu, _serial) = gate!();
    let Some(devices) = two_devices_or_skip(
        "two_gpus_reduce_leaves_the_non_roots_output_and_in_place_input_untouched",
    ) else {
        return;
    };
    let (comms, streams) = two_ranks(&devices);
    for count in [1, 3, 1_000_003] {
        reduce_leaves_non_root_alone::<f64>(&comms, &streams, count, ReduceOp::Sum, |a, b| a + b);
        reduce_leaves_non_root_alone::<f32>(&comms, &streams, count, ReduceOp::Avg, |a, b| {
            (a + b) / 2.0
        });
        reduce_leaves_non_root_alone::<u64>(&comms, &streams, count, ReduceOp::Avg, |a, b| {
            (a + b) / 2
        });
        reduce_leaves_non_root_alone::<i32>(&comms, &streams, count, ReduceOp::Min, i32::min);
        reduce_leaves_non_root_alone::<u8>(&comms, &streams, count, ReduceOp::Max, u8::max);
        reduce_leaves_non_root_alone::<i64>(&comms, &streams, count, ReduceOp::Prod, |a, b| a * b);
        reduce_leaves_non_root_alone::<F16>(&comms, &streams, count, ReduceOp::Max, |a, b| {
            if a.to_f32() >= b.to_f32() { a } else { b }
        });
    }
}

/// torch's `all_to_all_single` with equal splits, written as NCCL users write it: one group in
/// which every rank sends slot `p` of its input to rank `p` (itself included) and receives from
/// every rank; the self exchange stays `f32`, the peer's arrives as `u32` (NCCL moves bytes).
/// At 1 and 4099 elements per slot, every received slot holds the sender's bytes exactly.
#[test]
fn two_gpus_all_to_all_of_grouped_sends_and_receives_with_self_exchanges() {
    let (_gpu, _serial) = gate!();
    let Some(devices) = two_devices_or_skip(
        "two_gpus_all_to_all_of_grouped_sends_and_receives_with_self_exchanges",
    ) else {
        return;
    };
    let (comms, streams) = two_ranks(&devices);
    for chunk in [1usize, 4099] {
        let inputs: Vec<Vec<f32>> = (0..2).map(|r| pattern::<f32>(2 * chunk, 70 + r)).collect();
        let sends: Vec<DeviceBuffer<f32>> = comms
            .iter()
            .zip(&inputs)
            .map(|(c, v)| upload(c.context(), v))
            .collect();
        let slots: Vec<Vec<BufferSlice<'_, f32>>> = sends
            .iter()
            .map(|b| {
                (0..2)
                    .map(|p| b.slice(p * chunk..(p + 1) * chunk).expect("slot"))
                    .collect()
            })
            .collect();
        let mut own: Vec<DeviceBuffer<f32>> = comms
            .iter()
            .map(|c| upload(c.context(), &pattern::<f32>(chunk, 80)))
            .collect();
        let mut from_peer: Vec<DeviceBuffer<u32>> = comms
            .iter()
            .map(|c| upload(c.context(), &pattern::<u32>(chunk, 81)))
            .collect();
        {
            let mut group = Group::new();
            for (r, ((c, s), (mine, peer))) in comms
                .iter()
                .zip(&streams)
                .zip(own.iter_mut().zip(from_peer.iter_mut()))
                .enumerate()
            {
                let other = 1 - r;
                group
                    .send(c, &slots[r][other], other, s)
                    .expect("send to peer");
                group.send(c, &slots[r][r], r, s).expect("send to self");
                group.recv(c, mine, r, s).expect("recv from self");
                group.recv(c, peer, other, s).expect("recv from peer");
            }
            group.launch().expect("all-to-all");
        }
        synchronize_all(&comms, &streams);
        for r in 0..2 {
            let other = 1 - r;
            let slot = r * chunk..(r + 1) * chunk;
            assert_bytes_eq(
                &format!("chunk {chunk}: rank {r} from itself"),
                &own[r].to_vec().expect("own"),
                &inputs[r][slot.clone()],
            );
            let want: Vec<u32> = inputs[other][slot].iter().map(|v| v.to_bits()).collect();
            assert_bytes_eq(
                &format!("chunk {chunk}: rank {r} from rank {other}"),
                &from_peer[r].to_vec().expect("peer"),
                &want,
            );
        }
    }
}

/// nccl-tests' `sendrecv` latency loop with one thread per rank (`init_rank`): rank 0 sends, then
/// receives the answer and increments it with a kernel; rank 1 receives, increments and sends
/// back; 40 rounds of plain (ungrouped) `send` / `recv` on one stream each, no host wait. Rank
/// 0 ending at `start + 80` and rank 1 at `start + 79` proves every hop carried the previous
/// hop's kernel output.
#[test]
fn two_gpus_thread_per_rank_ping_pong_of_sends_and_receives_with_a_kernel_on_every_hop() {
    let (_gpu, _serial) = gate!();
    let Some(devices) = two_devices_or_skip(
        "two_gpus_thread_per_rank_ping_pong_of_sends_and_receives_with_a_kernel_on_every_hop",
    ) else {
        return;
    };
    const ROUNDS: u32 = 40;
    const LEN: usize = 4099;
    let start = pattern::<u32>(LEN, 90);
    let id = UniqueId::new().expect("id");
    let results: Vec<Vec<u32>> = std::thread::scope(|scope| {
        let ranks: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(rank, &device)| {
                let (id, start) = (&id, &start);
                scope.spawn(move || {
                    let comm = Communicator::init_rank(2, rank, id, device, &CommConfig::default())
                        .expect("init_rank");
                    let context = Arc::clone(comm.context());
                    let (_kernels, inc) = incrementer(&context);
                    let s = stream(&context);
                    let mut buffer = if rank == 0 {
                        upload(&context, start)
                    } else {
                        DeviceBuffer::<u32>::zeroed(&context, LEN).expect("zeroed")
                    };
                    for _ in 0..ROUNDS {
                        if rank == 0 {
                            comm.send(&buffer, 1, &s).expect("send");
                            comm.recv(&mut buffer, 1, &s).expect("recv");
                            increment(&inc, &s, &mut buffer);
                        } else {
                            comm.recv(&mut buffer, 0, &s).expect("recv");
                            increment(&inc, &s, &mut buffer);
                            comm.send(&buffer, 0, &s).expect("send");
                        }
                    }
                    comm.synchronize(&s).expect("synchronize");
                    buffer.to_vec().expect("download")
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|rank| rank.join().expect("rank thread"))
            .collect()
    });
    assert_bytes_eq("rank 0", &results[0], &plus(&start, 2 * ROUNDS));
    assert_bytes_eq("rank 1", &results[1], &plus(&start, 2 * ROUNDS - 1));
}

/// `split_all` over two GPUs where rank 1 opts out (`None`): rank 0 gets a one-rank child that
/// runs alone (a product is the identity), rank 1 gets nothing, and the parent still reduces
/// across both. A second split puts both ranks in one color with reversed keys: the children's
/// ranks are swapped, so an all-gather lists device 1's input first and a broadcast from child
/// root 0 carries device 1's input to both.
#[test]
fn two_gpus_split_with_one_rank_opting_out_and_one_with_reversed_keys() {
    let (_gpu, _serial) = gate!();
    let Some(devices) =
        two_devices_or_skip("two_gpus_split_with_one_rank_opting_out_and_one_with_reversed_keys")
    else {
        return;
    };
    let (comms, streams) = two_ranks(&devices);
    let parents: Vec<&Communicator> = comms.iter().collect();
    const LEN: usize = 10_007;
    let inputs: Vec<Vec<f64>> = (0..2).map(|r| pattern::<f64>(LEN, 110 + r)).collect();

    let mut lonely = Communicator::split_all(&parents, &[(Some(5), 0), (None, 0)]).expect("split");
    assert!(lonely[1].is_none(), "rank 1 opted out");
    let alone = lonely[0].take().expect("rank 0's child");
    assert_eq!(
        (alone.size(), alone.rank(), alone.device()),
        (1, 0, devices[0])
    );
    let mut solo = upload(alone.context(), &inputs[0]);
    alone
        .all_reduce_in_place(&mut solo, ReduceOp::Prod, &streams[0])
        .expect("the child runs alone");
    alone.synchronize(&streams[0]).expect("synchronize");
    assert_bytes_eq("alone", &solo.to_vec().expect("solo"), &inputs[0]);
    drop(alone);

    let mut sums: Vec<DeviceBuffer<f64>> = comms
        .iter()
        .zip(&inputs)
        .map(|(c, v)| upload(c.context(), v))
        .collect();
    {
        let mut group = Group::new();
        for ((c, s), buffer) in comms.iter().zip(&streams).zip(&mut sums) {
            group
                .all_reduce_in_place(c, buffer, ReduceOp::Sum, s)
                .expect("add");
        }
        group.launch().expect("parent all-reduce");
    }
    synchronize_all(&comms, &streams);
    let want: Vec<f64> = inputs[0]
        .iter()
        .zip(&inputs[1])
        .map(|(a, b)| a + b)
        .collect();
    for (r, buffer) in sums.iter().enumerate() {
        assert_bytes_eq(
            &format!("parent rank {r}"),
            &buffer.to_vec().expect("sum"),
            &want,
        );
    }

    let swapped: Vec<Communicator> =
        Communicator::split_all(&parents, &[(Some(1), 1), (Some(1), 0)])
            .expect("split")
            .into_iter()
            .map(|child| child.expect("same color"))
            .collect();
    assert_eq!(
        (swapped[0].rank(), swapped[1].rank()),
        (1, 0),
        "keys order the ranks"
    );
    assert_eq!((swapped[0].size(), swapped[1].size()), (2, 2));
    let sends: Vec<DeviceBuffer<f64>> = swapped
        .iter()
        .zip(&inputs)
        .map(|(c, v)| upload(c.context(), v))
        .collect();
    let mut gathered: Vec<DeviceBuffer<f64>> = swapped
        .iter()
        .map(|c| DeviceBuffer::<f64>::zeroed(c.context(), 2 * LEN).expect("gathered"))
        .collect();
    let mut broadcast: Vec<DeviceBuffer<f64>> = swapped
        .iter()
        .zip(&inputs)
        .map(|(c, v)| upload(c.context(), v))
        .collect();
    {
        let mut group = Group::new();
        for ((c, s), ((send, gather), cast)) in swapped
            .iter()
            .zip(&streams)
            .zip(sends.iter().zip(&mut gathered).zip(&mut broadcast))
        {
            group.all_gather(c, send, gather, s).expect("add gather");
            group
                .broadcast_in_place(c, cast, 0, s)
                .expect("add broadcast");
        }
        group.launch().expect("child collectives");
    }
    synchronize_all(&swapped, &streams);
    let in_child_rank_order = [inputs[1].clone(), inputs[0].clone()].concat();
    for r in 0..2 {
        assert_bytes_eq(
            &format!("gather on device {r}"),
            &gathered[r].to_vec().expect("gathered"),
            &in_child_rank_order,
        );
        assert_bytes_eq(
            &format!("broadcast on device {r}"),
            &broadcast[r].to_vec().expect("broadcast"),
            &inputs[1],
        );
    }
}

/// The writes of `buffer` a view at `offset` should leave: `outside` around `inside`.
fn framed<T: Copy>(outside: T, total: usize, offset: usize, inside: &[T]) -> Vec<T> {
    let mut all = vec![outside; total];
    all[offset..offset + inside.len()].copy_from_slice(inside);
    all
}

/// Each rank passes views at its own offset (a bucket of a flat buffer laid out differently per
/// rank): an in-place `i8` min of 1 000 001 elements at offsets 3 and 11, an `F16` all-gather of
/// one element per rank into a two-element view, and a `Bf16` reduce-scatter (sum) of two
/// elements into one. Every result is exact and every byte around the views keeps its value.
#[test]
fn two_gpus_views_at_different_offsets_on_each_rank_leave_their_neighbours_alone() {
    let (_gpu, _serial) = gate!();
    let Some(devices) = two_devices_or_skip(
        "two_gpus_views_at_different_offsets_on_each_rank_leave_their_neighbours_alone",
    ) else {
        return;
    };
    let (comms, streams) = two_ranks(&devices);

    const N: usize = 1_000_001;
    const PAD: usize = 20;
    let offsets = [3usize, 11];
    let value = |i: usize, r: usize| (((i * 7 + r * 13) % 200) as i32 - 100) as i8;
    let inputs: Vec<Vec<i8>> = (0..2)
        .map(|r| (0..N).map(|i| value(i, r)).collect())
        .collect();
    let mut bufs: Vec<DeviceBuffer<i8>> = comms
        .iter()
        .enumerate()
        .map(|(r, c)| upload(c.context(), &framed(77i8, N + PAD, offsets[r], &inputs[r])))
        .collect();
    {
        let mut views: Vec<BufferSliceMut<'_, i8>> = bufs
            .iter_mut()
            .zip(offsets)
            .map(|(b, o)| b.slice_mut(o..o + N).expect("view"))
            .collect();
        let mut group = Group::new();
        for ((c, s), view) in comms.iter().zip(&streams).zip(&mut views) {
            group
                .all_reduce_in_place(c, view, ReduceOp::Min, s)
                .expect("add");
        }
        group.launch().expect("min on views");
    }
    synchronize_all(&comms, &streams);
    let min: Vec<i8> = inputs[0]
        .iter()
        .zip(&inputs[1])
        .map(|(a, b)| *a.min(b))
        .collect();
    for (r, buffer) in bufs.iter().enumerate() {
        assert_bytes_eq(
            &format!("i8 min on rank {r}"),
            &buffer.to_vec().expect("download"),
            &framed(77i8, N + PAD, offsets[r], &min),
        );
    }

    // One F16 per rank, from element r + 1 of a four-element buffer, into elements 5..7 of nine.
    let f16_sentinel = F16::from_f32(-7.5);
    let f16_inputs: Vec<Vec<F16>> = (0..2)
        .map(|r| {
            (0..4)
                .map(|i| F16::from_f32((r * 10 + i) as f32 + 0.5))
                .collect()
        })
        .collect();
    let f16_sends: Vec<DeviceBuffer<F16>> = comms
        .iter()
        .zip(&f16_inputs)
        .map(|(c, v)| upload(c.context(), v))
        .collect();
    let mut f16_recvs: Vec<DeviceBuffer<F16>> = comms
        .iter()
        .map(|c| upload(c.context(), &[f16_sentinel; 9]))
        .collect();
    // Two Bf16 per rank, from elements 1..3 of four, summed into element 2 of five.
    let bf16_sentinel = Bf16::from_f32(-3.0);
    let bf16_inputs: Vec<Vec<Bf16>> = (0..2)
        .map(|r| {
            (0..4)
                .map(|i| Bf16::from_f32((r + 1) as f32 * (i + 1) as f32))
                .collect()
        })
        .collect();
    let bf16_sends: Vec<DeviceBuffer<Bf16>> = comms
        .iter()
        .zip(&bf16_inputs)
        .map(|(c, v)| upload(c.context(), v))
        .collect();
    let mut bf16_recvs: Vec<DeviceBuffer<Bf16>> = comms
        .iter()
        .map(|c| upload(c.context(), &[bf16_sentinel; 5]))
        .collect();
    {
        let f16_send_views: Vec<BufferSlice<'_, F16>> = f16_sends
            .iter()
            .enumerate()
            .map(|(r, b)| b.slice(r + 1..r + 2).expect("one element"))
            .collect();
        let mut f16_recv_views: Vec<BufferSliceMut<'_, F16>> = f16_recvs
            .iter_mut()
            .map(|b| b.slice_mut(5..7).expect("two elements"))
            .collect();
        let bf16_send_views: Vec<BufferSlice<'_, Bf16>> = bf16_sends
            .iter()
            .map(|b| b.slice(1..3).expect("two elements"))
            .collect();
        let mut bf16_recv_views: Vec<BufferSliceMut<'_, Bf16>> = bf16_recvs
            .iter_mut()
            .map(|b| b.slice_mut(2..3).expect("one element"))
            .collect();
        let mut group = Group::new();
        for (((c, s), send), recv) in comms
            .iter()
            .zip(&streams)
            .zip(&f16_send_views)
            .zip(&mut f16_recv_views)
        {
            group.all_gather(c, send, recv, s).expect("add gather");
        }
        for (((c, s), send), recv) in comms
            .iter()
            .zip(&streams)
            .zip(&bf16_send_views)
            .zip(&mut bf16_recv_views)
        {
            group
                .reduce_scatter(c, send, recv, ReduceOp::Sum, s)
                .expect("add reduce_scatter");
        }
        group.launch().expect("one-element views");
    }
    synchronize_all(&comms, &streams);
    let gathered = [f16_inputs[0][1], f16_inputs[1][2]];
    for r in 0..2 {
        assert_bytes_eq(
            &format!("f16 gather on rank {r}"),
            &f16_recvs[r].to_vec().expect("f16"),
            &framed(f16_sentinel, 9, 5, &gathered),
        );
        // Rank r's slot is element 1 + r of both ranks' inputs: (1 + 2) × (r + 2).
        let sum = Bf16::from_f32(3.0 * (r + 2) as f32);
        assert_bytes_eq(
            &format!("bf16 reduce_scatter on rank {r}"),
            &bf16_recvs[r].to_vec().expect("bf16"),
            &framed(bf16_sentinel, 5, 2, &[sum]),
        );
    }
}

/// A blocking and a non-blocking communicator of one device in one group (a library that makes
/// its own communicator with other defaults, joined to the program's group): NCCL refuses the
/// mix only once the group is under way. cuweave refuses it first, with `InvalidArgument`, for
/// collectives and for splits alike; nothing is queued and both communicators keep working,
/// alone or each in a group of its own kind.
#[test]
fn a_group_mixing_blocking_and_non_blocking_communicators_is_refused_before_nccl_sees_it() {
    let (_gpu, _serial) = gate!();
    let blocking = own_comm(&CommConfig::default().with_blocking(true));
    let non_blocking = own_comm(&CommConfig::default());
    let context = blocking.context();
    let (s1, s2) = (stream(context), stream(context));
    const LEN: usize = 1000;
    let input = pattern::<u32>(LEN, 71);
    let stale = pattern::<u32>(LEN, 72);
    let send = upload(context, &input);
    let (mut a, mut b) = (upload(context, &stale), upload(context, &stale));
    {
        let mut group = Group::new();
        group
            .all_reduce(&blocking, &send, &mut a, ReduceOp::Sum, &s1)
            .expect("add");
        group
            .all_reduce(&non_blocking, &send, &mut b, ReduceOp::Sum, &s2)
            .expect("add");
        let error = group.launch().expect_err("a mixed group");
        assert!(
            matches!(error, CollectiveError::InvalidArgument { .. }),
            "{error}"
        );
        assert!(error.to_string().contains("blocking"), "{error}");
    }
    let refused =
        Communicator::split_all(&[&blocking, &non_blocking], &[(Some(0), 0), (Some(0), 1)]);
    assert!(
        matches!(refused, Err(CollectiveError::InvalidArgument { .. })),
        "{refused:?}"
    );
    assert_bytes_eq("nothing queued", &a.to_vec().expect("a"), &stale);
    assert_bytes_eq("nothing queued", &b.to_vec().expect("b"), &stale);
    for comm in [&blocking, &non_blocking] {
        assert!(!comm.is_aborted());
        comm.check_async_error().expect("healthy");
    }
    blocking
        .all_reduce(&send, &mut a, ReduceOp::Sum, &s1)
        .expect("blocking alone");
    non_blocking
        .all_reduce(&send, &mut b, ReduceOp::Sum, &s2)
        .expect("non-blocking alone");
    blocking.synchronize(&s1).expect("s1");
    non_blocking.synchronize(&s2).expect("s2");
    assert_bytes_eq("one rank's sum", &a.to_vec().expect("a"), &input);
    assert_bytes_eq("one rank's sum", &b.to_vec().expect("b"), &input);
}
