//! Second-look programs for the collective layer, written as NCCL, nccl-tests and
//! torch.distributed users write them, on what the other GPU tests leave out or cover in part:
//!
//! - every reduction of every element type at an uneven count (262 147, where NCCL 2.28's
//!   one-rank mean kernel left a tail unwritten) on views at odd offsets, by every entry point:
//!   the communicator's calls, one-call groups and coordinated operations, out of place and in
//!   place, with the bytes around each view untouched;
//! - collectives racing the user's own *kernels* (not copies or memsets) on other streams:
//!   a kernel still reading a collective's output buffer, a kernel writing its input late, a
//!   kernel consuming its output, a host slice of a pinned output;
//! - 10^4 small collectives each awaited, with threads, device memory and resident memory flat;
//! - an abort from another thread while idle, then every entry point of the crate;
//! - a `split_share` child whose parent is aborted (and the reverse): exact bytes or typed
//!   errors, and an end within the deadline, never a hang;
//! - one group spanning a communicator and its split child, with self exchanges of mixed element
//!   types, split while the parent still has a collective queued behind a spin;
//! - groups dropped unlaunched, refused calls, empty groups;
//! - buffers from a stream-ordered pool allocated behind a spin on other streams;
//! - futures of several streams awaited out of order, with host access to pinned outputs
//!   refused (`DeviceBusy`) until each resolves;
//! - on two GPUs only (skipped with a reason on one): every reduction of every type across
//!   `init_all` ranks against values computed on the host.
//!
//! Every test takes the binary's serial guard (`gate!`).

#[macro_use]
mod common;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{Pattern, assert_bytes_eq, comm, own_comm, pattern, skip, stream};
use cuweave_collective::{
    Bf16, CollectiveError, CommConfig, Communicator, CoordinatedCollectives, F16, Group, NcclType,
    ReduceOp,
};
use cuweave_driver::{Context, Device, Kernel, LaunchConfig, Stream};
use cuweave_event::{EventPool, OperationCoordinator};
use cuweave_memory::{
    AsyncPoolResource, Buffer, BufferSlice, BufferSliceMut, DeviceBuffer, MemoryError,
    MemoryResource, PinnedBuffer, TrackedLaunch,
};
use cuweave_test_support::kernels::TestKernels;

/// How long a user's kernel keeps reading (or spins before writing) in the ordering probes.
const KERNEL_NS: u64 = 60_000_000;

fn upload<T: NcclType>(context: &Arc<Context>, values: &[T]) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(context, values).expect("upload")
}

fn aborted(what: &str, result: Result<(), CollectiveError>) {
    assert!(
        matches!(result, Err(CollectiveError::Aborted { .. })),
        "{what}: {result:?}"
    );
}

fn invalid(what: &str, result: Result<(), CollectiveError>) {
    assert!(
        matches!(result, Err(CollectiveError::InvalidArgument { .. })),
        "{what}: {result:?}"
    );
}

/// A grid-stride launch over `n` elements of at most `most` blocks of 256 threads.
fn grid(n: usize, most: u32) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, most as usize) as u32;
    LaunchConfig {
        grid: (blocks, 1, 1),
        block: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Queues on `stream` a kernel that keeps reading `data` for [`KERNEL_NS`] and counts into
/// `mismatches` every element it sees differ from `expected` (declared a read of `data`).
fn watch(
    kernel: &Kernel,
    stream: &Stream,
    data: &impl Buffer<u32>,
    expected: u32,
    mismatches: &mut DeviceBuffer<u32>,
) {
    let n = data.len() as u64;
    // SAFETY: watch_u32(const unsigned* data, size_t n, unsigned expected, unsigned long long ns,
    // unsigned* mismatches) gets the buffer's address and length, a value, a duration and a
    // one-word counter; it only reads `data` (declared a read) and atomically adds to the
    // counter (declared a write).
    unsafe {
        TrackedLaunch::new(kernel, stream, grid(data.len(), 120))
            .read(data)
            .arg(&n)
            .arg(&expected)
            .arg(&KERNEL_NS)
            .write(mismatches)
            .launch()
    }
    .expect("watch");
}

/// Queues on `stream` a spin of [`KERNEL_NS`], then a kernel writing `value` into every element
/// of `data` (declared a write).
fn late_fill(
    kernels: &TestKernels,
    fill: &Kernel,
    stream: &Stream,
    data: &mut impl Buffer<u32>,
    value: u32,
) {
    kernels.spin_ns(stream, KERNEL_NS).expect("spin");
    let n = data.len() as u64;
    // SAFETY: fill_u32(unsigned* dst, unsigned value, size_t n) gets the buffer's address, a
    // value and its length; it writes only `data`, declared a write.
    unsafe {
        TrackedLaunch::new(fill, stream, grid(data.len(), 4096))
            .write(data)
            .arg(&value)
            .arg(&n)
            .launch()
    }
    .expect("fill");
}

// ---------------------------------------------------------------------------------------------
// 1. Every reduction of every type at uneven counts on views, by every entry point
// ---------------------------------------------------------------------------------------------

/// A call of the crate, with the reduction where it has one.
#[derive(Debug, Clone, Copy)]
enum Call {
    AllReduce(ReduceOp),
    AllReduceInPlace(ReduceOp),
    Reduce(ReduceOp),
    ReduceInPlace(ReduceOp),
    ReduceScatter(ReduceOp),
    ReduceScatterInPlace(ReduceOp),
    Broadcast,
    BroadcastInPlace,
    AllGather,
    AllGatherInPlace,
}

impl Call {
    fn in_place(self) -> bool {
        matches!(
            self,
            Self::AllReduceInPlace(_)
                | Self::ReduceInPlace(_)
                | Self::ReduceScatterInPlace(_)
                | Self::BroadcastInPlace
                | Self::AllGatherInPlace
        )
    }

    fn all() -> Vec<Self> {
        let mut calls = Vec::new();
        for op in ReduceOp::ALL {
            calls.extend([
                Self::AllReduce(op),
                Self::AllReduceInPlace(op),
                Self::Reduce(op),
                Self::ReduceInPlace(op),
                Self::ReduceScatter(op),
                Self::ReduceScatterInPlace(op),
            ]);
        }
        calls.extend([
            Self::Broadcast,
            Self::BroadcastInPlace,
            Self::AllGather,
            Self::AllGatherInPlace,
        ]);
        calls
    }
}

/// How a call reaches NCCL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Direct,
    Group,
    Coordinated,
}

/// Issues `call` by `route` with `send` as input and `recv` as output (for an in-place call,
/// `recv` is both, `send` unused). `None` when the route has no such call.
fn issue<T: NcclType>(
    comm: &Communicator,
    coordinated: &CoordinatedCollectives,
    route: Route,
    call: Call,
    send: &BufferSlice<'_, T>,
    recv: &mut BufferSliceMut<'_, T>,
    stream: &Arc<Stream>,
) -> Option<Result<(), CollectiveError>> {
    let s: &Stream = stream;
    Some(match route {
        Route::Direct => match call {
            Call::AllReduce(op) => comm.all_reduce(send, recv, op, s),
            Call::AllReduceInPlace(op) => comm.all_reduce_in_place(recv, op, s),
            Call::Reduce(op) => comm.reduce(send, recv, op, 0, s),
            Call::ReduceInPlace(op) => comm.reduce_in_place(recv, op, 0, s),
            Call::ReduceScatter(op) => comm.reduce_scatter(send, recv, op, s),
            Call::ReduceScatterInPlace(op) => comm.reduce_scatter_in_place(recv, op, s),
            Call::Broadcast => comm.broadcast(send, recv, 0, s),
            Call::BroadcastInPlace => comm.broadcast_in_place(recv, 0, s),
            Call::AllGather => comm.all_gather(send, recv, s),
            Call::AllGatherInPlace => comm.all_gather_in_place(recv, s),
        },
        Route::Group => {
            let mut group = Group::new();
            let added = match call {
                Call::AllReduce(op) => group.all_reduce(comm, send, recv, op, s).map(drop),
                Call::AllReduceInPlace(op) => {
                    group.all_reduce_in_place(comm, recv, op, s).map(drop)
                }
                Call::Reduce(op) => group.reduce(comm, send, recv, op, 0, s).map(drop),
                Call::ReduceInPlace(op) => group.reduce_in_place(comm, recv, op, 0, s).map(drop),
                Call::ReduceScatter(op) => group.reduce_scatter(comm, send, recv, op, s).map(drop),
                Call::ReduceScatterInPlace(op) => {
                    group.reduce_scatter_in_place(comm, recv, op, s).map(drop)
                }
                Call::Broadcast => group.broadcast(comm, send, recv, 0, s).map(drop),
                Call::BroadcastInPlace => group.broadcast_in_place(comm, recv, 0, s).map(drop),
                Call::AllGather => group.all_gather(comm, send, recv, s).map(drop),
                Call::AllGatherInPlace => group.all_gather_in_place(comm, recv, s).map(drop),
            };
            added.and_then(|()| group.launch())
        }
        Route::Coordinated => match call {
            Call::AllReduce(op) => coordinated
                .all_reduce(comm, send, recv, op, stream, &[])
                .map(drop),
            Call::AllReduceInPlace(op) => coordinated
                .all_reduce_in_place(comm, recv, op, stream, &[])
                .map(drop),
            Call::Reduce(op) => coordinated
                .reduce(comm, send, recv, op, 0, stream, &[])
                .map(drop),
            Call::Broadcast => coordinated
                .broadcast(comm, send, recv, 0, stream, &[])
                .map(drop),
            _ => return None,
        },
    })
}

/// Every call by every route on `count` elements of `T`: the input a view at element 5 of a
/// larger buffer, the output a view at element 3 of a buffer of stale values. On one rank every
/// result is the input, byte for byte, and nothing outside the output view changes.
fn every_call_by_every_route<T: Pattern>(
    comm: &Communicator,
    coordinated: &CoordinatedCollectives,
    streams: &[Arc<Stream>],
    count: usize,
) {
    let context = comm.context();
    let name = std::any::type_name::<T>();
    let input: Vec<T> = pattern(count, 1);
    let mut send_backing: Vec<T> = pattern(count + 9, 2);
    send_backing[5..5 + count].clone_from_slice(&input);
    let send_buffer = upload(context, &send_backing);
    let send = send_buffer.slice(5..5 + count).expect("send view");
    let stale: Vec<T> = pattern(count + 8, 3);
    let mut in_place_start = stale.clone();
    in_place_start[3..3 + count].clone_from_slice(&input);
    let mut issued = 0usize;
    for route in [Route::Direct, Route::Group, Route::Coordinated] {
        for call in Call::all() {
            let what = format!("{route:?} {call:?} of {count} × {name}");
            let start = if call.in_place() {
                &in_place_start
            } else {
                &stale
            };
            let mut recv_buffer = upload(context, start);
            let stream = &streams[issued % streams.len()];
            let outcome = {
                let mut recv = recv_buffer.slice_mut(3..3 + count).expect("recv view");
                issue(comm, coordinated, route, call, &send, &mut recv, stream)
            };
            let Some(outcome) = outcome else { continue };
            issued += 1;
            outcome.unwrap_or_else(|e| panic!("{what}: {e}"));
            // No synchronize: the download waits for the collective through the tracker.
            let got = recv_buffer.to_vec().expect("download");
            assert_bytes_eq(&what, &got[3..3 + count], &input);
            assert_bytes_eq(&format!("{what}: before the view"), &got[..3], &stale[..3]);
            assert_bytes_eq(
                &format!("{what}: after the view"),
                &got[3 + count..],
                &stale[3 + count..],
            );
        }
    }
    assert_bytes_eq(
        &format!("{name}: the input buffer"),
        &send_buffer.to_vec().expect("download"),
        &send_backing,
    );
}

/// nccl-tests' data check of every collective, every reduction (the mean included, at the
/// uneven count where NCCL 2.28.3's one-rank mean kernel left the last elements unwritten), on
/// every element type, through the communicator's calls, one-call groups and coordinated
/// operations, on views at odd offsets of larger buffers, over two streams. On one rank each
/// result is the input byte for byte, the bytes around each output view keep their stale
/// values, and every coordinated operation retires.
#[test]
fn every_reduction_of_every_type_at_uneven_counts_on_views_by_every_entry_point() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let coordinator = OperationCoordinator::new(EventPool::new(&gpu.context, 8, 8).expect("pool"))
        .expect("coordinator");
    let coordinated = CoordinatedCollectives::new(coordinator.clone());
    let streams: Vec<Arc<Stream>> = (0..2).map(|_| Arc::new(stream(comm.context()))).collect();
    for count in [1usize, 4099] {
        every_call_by_every_route::<f32>(comm, &coordinated, &streams, count);
        every_call_by_every_route::<f64>(comm, &coordinated, &streams, count);
        every_call_by_every_route::<F16>(comm, &coordinated, &streams, count);
        every_call_by_every_route::<Bf16>(comm, &coordinated, &streams, count);
        every_call_by_every_route::<i8>(comm, &coordinated, &streams, count);
        every_call_by_every_route::<u8>(comm, &coordinated, &streams, count);
        every_call_by_every_route::<i32>(comm, &coordinated, &streams, count);
        every_call_by_every_route::<u32>(comm, &coordinated, &streams, count);
        every_call_by_every_route::<i64>(comm, &coordinated, &streams, count);
        every_call_by_every_route::<u64>(comm, &coordinated, &streams, count);
    }
    let uneven = 262_147;
    every_call_by_every_route::<f32>(comm, &coordinated, &streams, uneven);
    every_call_by_every_route::<F16>(comm, &coordinated, &streams, uneven);
    every_call_by_every_route::<Bf16>(comm, &coordinated, &streams, uneven);
    every_call_by_every_route::<i8>(comm, &coordinated, &streams, uneven);
    every_call_by_every_route::<u64>(comm, &coordinated, &streams, uneven);
    for s in &streams {
        comm.synchronize(s).expect("synchronize");
    }
    coordinator.retire_finished();
    assert_eq!(coordinator.live_operations(), 0, "coordinated calls retire");
    assert!(!comm.is_aborted());
}

// ---------------------------------------------------------------------------------------------
// 2. Collectives racing the user's own kernels on other streams
// ---------------------------------------------------------------------------------------------

/// A training step's kernels and its collectives on different streams, ordered only by the
/// buffers' use tracking:
///
/// - write after read: the user's kernel keeps reading an output buffer on stream A for 60 ms
///   (declared a read); a broadcast, all-gather, reduce, all-reduce, reduce-scatter and a grouped
///   self receive into it on stream B must wait: the kernel sees no element change, and the
///   buffer ends with the collective's result;
/// - read after write: the user's kernel writes the input after a 60 ms spin on A; each call on
///   B must read what the kernel wrote;
/// - a consumer: a checksum kernel on stream C (declared a read) right after an all-reduce that
///   waits behind a spin on B must sum the all-reduce's output;
/// - the host: a pinned output of an all-reduce behind a spin is refused by `try_as_slice`
///   (`DeviceBusy`) and read exact by `as_slice`, with no synchronize.
#[test]
fn kernels_on_other_streams_and_collectives_are_ordered_by_use_tracking() {
    let (_gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let kernels = TestKernels::load(context).expect("kernels");
    let watcher = kernels.module().function("watch_u32").expect("watch_u32");
    let fill = kernels.module().function("fill_u32").expect("fill_u32");
    let checksum = kernels.module().function("checksum_u32").expect("checksum");
    let (a, b, c) = (stream(context), stream(context), stream(context));
    const N: usize = (1 << 20) + 3;
    const OLD: u32 = 0x0101_0101;
    const WRITTEN: u32 = 0x00C0_FFEE;
    let input = pattern::<u32>(N, 7);
    let names = [
        "broadcast",
        "all_gather",
        "reduce",
        "all_reduce",
        "reduce_scatter",
        "self send/recv",
    ];
    for (k, name) in names.iter().enumerate() {
        // Write after read.
        let send = upload(context, &input);
        let mut recv = DeviceBuffer::<u32>::new(context, N).expect("recv");
        recv.fill(OLD).expect("fill");
        let mut mismatches = DeviceBuffer::<u32>::zeroed(context, 1).expect("counter");
        watch(&watcher, &a, &recv, OLD, &mut mismatches);
        let issued = match k {
            0 => comm.broadcast(&send, &mut recv, 0, &b),
            1 => comm.all_gather(&send, &mut recv, &b),
            2 => comm.reduce(&send, &mut recv, ReduceOp::Max, 0, &b),
            3 => comm.all_reduce(&send, &mut recv, ReduceOp::Min, &b),
            4 => comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum, &b),
            _ => {
                let mut group = Group::new();
                group.send(comm, &send, 0, &b).expect("send");
                group.recv(comm, &mut recv, 0, &b).expect("recv");
                group.launch()
            }
        };
        issued.unwrap_or_else(|e| panic!("{name}: {e}"));
        comm.synchronize(&b).expect("synchronize");
        a.synchronize().expect("a");
        assert_eq!(
            mismatches.to_vec().expect("counter"),
            [0],
            "{name}: the collective wrote the buffer while the user's kernel still read it"
        );
        assert_bytes_eq(
            &format!("{name}: write after read"),
            &recv.to_vec().expect("download"),
            &input,
        );

        // Read after write.
        let mut send = upload(context, &input);
        let mut recv = DeviceBuffer::<u32>::zeroed(context, N).expect("recv");
        late_fill(&kernels, &fill, &a, &mut send, WRITTEN);
        let issued = match k {
            0 => comm.broadcast(&send, &mut recv, 0, &b),
            1 => comm.all_gather(&send, &mut recv, &b),
            2 => comm.reduce(&send, &mut recv, ReduceOp::Prod, 0, &b),
            3 => comm.all_reduce(&send, &mut recv, ReduceOp::Avg, &b),
            4 => comm.reduce_scatter(&send, &mut recv, ReduceOp::Max, &b),
            _ => {
                let mut group = Group::new();
                group.send(comm, &send, 0, &b).expect("send");
                group.recv(comm, &mut recv, 0, &b).expect("recv");
                group.launch()
            }
        };
        issued.unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = recv.to_vec().expect("download");
        if let Some(i) = got.iter().position(|&x| x != WRITTEN) {
            panic!(
                "{name}: element {i} is {:#x}: the collective read the input before the user's \
                 kernel wrote it",
                got[i]
            );
        }
        a.synchronize().expect("a");
    }

    // A consumer kernel on a third stream.
    let send = upload(context, &input);
    let mut recv = DeviceBuffer::<u32>::zeroed(context, N).expect("recv");
    let mut sum = DeviceBuffer::<u64>::zeroed(context, 1).expect("sum");
    kernels.spin_ns(&b, KERNEL_NS).expect("spin");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &b)
        .expect("all_reduce");
    let n = N as u64;
    // SAFETY: checksum_u32(const unsigned* data, size_t n, unsigned long long* out) gets the
    // output's address and length (declared a read) and one zeroed u64 (declared a write).
    unsafe {
        TrackedLaunch::new(&checksum, &c, grid(N, 1024))
            .read(&recv)
            .arg(&n)
            .write(&mut sum)
            .launch()
    }
    .expect("checksum");
    c.synchronize().expect("c");
    let want: u64 = input.iter().map(|&x| u64::from(x)).sum();
    assert_eq!(
        sum.to_vec().expect("sum"),
        [want],
        "the consumer kernel on another stream read the output before the all-reduce wrote it"
    );

    // The host, through a pinned output.
    let mut pinned = PinnedBuffer::<u32>::zeroed(context, N).expect("pinned");
    kernels.spin_ns(&b, KERNEL_NS).expect("spin");
    comm.all_reduce(&send, &mut pinned, ReduceOp::Max, &b)
        .expect("all_reduce into pinned memory");
    match pinned.try_as_slice() {
        Err(MemoryError::DeviceBusy { .. }) => {}
        Err(error) => panic!("try_as_slice while the collective is queued: {error}"),
        Ok(_) => panic!("a host slice of the output while the collective is still queued"),
    }
    let host = pinned.as_slice().expect("as_slice waits");
    assert_bytes_eq("pinned output read by the host", &host[..], &input);
}

// ---------------------------------------------------------------------------------------------
// 3. 10^4 small collectives, each awaited
// ---------------------------------------------------------------------------------------------

/// A parameter server's loop: 10^4 steps of a small all-reduce (in place, out of place, or a
/// group of two, in turn) on 64 floats, each step waited for by an awaited future or a
/// synchronize, alternating. From step 1000 to the end the process's threads, the device's free
/// memory and the resident set stay flat, and the last results are exact.
#[test]
#[cfg(target_os = "linux")]
fn ten_thousand_small_collectives_each_awaited_keep_threads_and_memory_flat() {
    let (gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let s = stream(context);
    let input = pattern::<f32>(64, 11);
    let mut buffer = upload(context, &input);
    let mut other = DeviceBuffer::<f32>::zeroed(context, 64).expect("other");
    let mut third = DeviceBuffer::<f32>::zeroed(context, 64).expect("third");
    let mut baseline = None;
    for i in 0..10_000usize {
        match i % 3 {
            0 => comm
                .all_reduce_in_place(&mut buffer, ReduceOp::Sum, &s)
                .expect("in place"),
            1 => comm
                .all_reduce(&buffer, &mut other, ReduceOp::Max, &s)
                .expect("out of place"),
            _ => {
                let mut group = Group::new();
                group
                    .all_reduce(comm, &buffer, &mut other, ReduceOp::Avg, &s)
                    .expect("add");
                group
                    .broadcast(comm, &buffer, &mut third, 0, &s)
                    .expect("add");
                group.launch().expect("group");
            }
        }
        if i % 2 == 0 {
            futures::executor::block_on(comm.completion(&s).expect("future")).expect("awaited");
        } else {
            comm.synchronize(&s).expect("synchronize");
        }
        if i == 1000 {
            baseline = Some((
                cuweave_test_support::process_threads(),
                gpu.context.memory_info().expect("memory info").free,
                cuweave_test_support::resident_bytes(),
            ));
        }
    }
    let (threads, free, resident) = baseline.expect("baseline");
    assert_bytes_eq("in place", &buffer.to_vec().expect("download"), &input);
    assert_bytes_eq("out of place", &other.to_vec().expect("download"), &input);
    assert_bytes_eq("broadcast", &third.to_vec().expect("download"), &input);
    let threads_now = cuweave_test_support::process_threads();
    let free_now = gpu.context.memory_info().expect("memory info").free;
    let resident_now = cuweave_test_support::resident_bytes();
    assert!(
        threads_now <= threads + 2,
        "{threads} threads at step 1000, {threads_now} at 10^4"
    );
    assert!(
        free_now + (16 << 20) >= free,
        "device free memory fell from {free} to {free_now} bytes"
    );
    assert!(
        resident_now <= resident + (64 << 20),
        "resident memory grew from {resident} to {resident_now} bytes over 9000 steps"
    );
}

// ---------------------------------------------------------------------------------------------
// 4. An idle abort from another thread, then every entry point
// ---------------------------------------------------------------------------------------------

/// torch's `abort_process_group` from a watchdog thread while the rank is idle: afterwards
/// every entry point of the crate, on the communicator and on a clone, is `Aborted` (the calls
/// in and out of place, groups, self exchanges, coordinated operations, completion, synchronize,
/// the async-error check, splits of a colour and of none, finalize), nothing is written to the
/// buffers, nothing is recorded on them (the memory layer still uses them at once), no
/// coordinated operation is left live, and a second abort returns at once.
#[test]
fn an_idle_abort_from_another_thread_makes_every_entry_point_typed_and_leaves_buffers_alone() {
    let (gpu, _serial) = gate!();
    let comm = own_comm(&CommConfig::default());
    let clone = comm.clone();
    let context = Arc::clone(comm.context());
    let s = Arc::new(stream(&context));
    let coordinator = OperationCoordinator::new(EventPool::new(&gpu.context, 8, 8).expect("pool"))
        .expect("coordinator");
    let coordinated = CoordinatedCollectives::new(coordinator.clone());
    let input = pattern::<i32>(4096, 1);
    let stale = pattern::<i32>(4096, 2);
    let send = upload(&context, &input);
    let mut recv = upload(&context, &stale);
    // Healthy first.
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        .expect("before the abort");
    comm.synchronize(&s).expect("synchronize");
    recv.copy_from_host(&stale).expect("reset");

    let watchdog = {
        let comm = comm.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            comm.abort();
            started.elapsed()
        })
    };
    let took = watchdog.join().expect("watchdog");
    assert!(
        took < Duration::from_secs(20),
        "the idle abort took {took:?}"
    );
    assert!(comm.is_aborted() && clone.is_aborted());
    assert!(comm.as_raw().is_none(), "a handle after the abort");

    for (who, c) in [("comm", &comm), ("clone", &clone)] {
        let what = |call: &str| format!("{who}: {call}");
        aborted(
            &what("all_reduce"),
            c.all_reduce(&send, &mut recv, ReduceOp::Sum, &s),
        );
        aborted(
            &what("all_reduce_in_place"),
            c.all_reduce_in_place(&mut recv, ReduceOp::Max, &s),
        );
        aborted(&what("broadcast"), c.broadcast(&send, &mut recv, 0, &s));
        aborted(
            &what("broadcast_in_place"),
            c.broadcast_in_place(&mut recv, 0, &s),
        );
        aborted(
            &what("reduce"),
            c.reduce(&send, &mut recv, ReduceOp::Min, 0, &s),
        );
        aborted(
            &what("reduce_in_place"),
            c.reduce_in_place(&mut recv, ReduceOp::Prod, 0, &s),
        );
        aborted(&what("all_gather"), c.all_gather(&send, &mut recv, &s));
        aborted(
            &what("all_gather_in_place"),
            c.all_gather_in_place(&mut recv, &s),
        );
        aborted(
            &what("reduce_scatter"),
            c.reduce_scatter(&send, &mut recv, ReduceOp::Avg, &s),
        );
        aborted(
            &what("reduce_scatter_in_place"),
            c.reduce_scatter_in_place(&mut recv, ReduceOp::Sum, &s),
        );
        {
            let mut group = Group::new();
            group
                .all_reduce(c, &send, &mut recv, ReduceOp::Sum, &s)
                .expect("adding needs no NCCL");
            aborted(&what("a group"), group.launch());
        }
        {
            let mut group = Group::new();
            group.send(c, &send, 0, &s).expect("add send");
            group.recv(c, &mut recv, 0, &s).expect("add recv");
            aborted(&what("a self exchange"), group.launch());
        }
        assert!(
            matches!(
                coordinated.all_reduce(c, &send, &mut recv, ReduceOp::Sum, &s, &[]),
                Err(CollectiveError::Aborted { .. })
            ),
            "{}",
            what("a coordinated all-reduce")
        );
        assert!(
            matches!(c.completion(&s), Err(CollectiveError::Aborted { .. })),
            "{}",
            what("completion")
        );
        aborted(&what("synchronize"), c.synchronize(&s));
        aborted(&what("check_async_error"), c.check_async_error());
        assert!(
            matches!(c.split(Some(0), 0), Err(CollectiveError::Aborted { .. })),
            "{}",
            what("split of a colour")
        );
        assert!(
            matches!(c.split(None, 0), Err(CollectiveError::Aborted { .. })),
            "{}",
            what("split of no colour")
        );
    }
    // Nothing written, nothing recorded that would hold the memory layer back.
    assert_bytes_eq("untouched", &recv.to_vec().expect("download"), &stale);
    let started = Instant::now();
    recv.fill_async(5, &s).expect("fill");
    s.synchronize().expect("stream");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(recv.to_vec().expect("download"), vec![5; 4096]);
    coordinator.retire_finished();
    assert_eq!(
        coordinator.live_operations(),
        0,
        "a refused coordinated call retires"
    );
    let started = Instant::now();
    comm.abort();
    assert!(started.elapsed() < Duration::from_secs(1), "a second abort");
    assert!(matches!(
        clone.finalize(),
        Err(CollectiveError::Aborted { .. })
    ));
    assert!(matches!(
        comm.finalize(),
        Err(CollectiveError::Aborted { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// 5. split_share children and aborts
// ---------------------------------------------------------------------------------------------

/// Runs `body` on a thread of its own and returns its outcome, or fails the test when it has
/// not returned within `limit` (a hang).
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

/// Whether `error` is one a user can act on after an abort of a communicator sharing its
/// resources: aborted, NCCL's error, or the deadline.
fn typed_after_abort(error: &CollectiveError) -> bool {
    matches!(
        error,
        CollectiveError::Aborted { .. }
            | CollectiveError::Nccl { .. }
            | CollectiveError::Timeout { .. }
    )
}

/// One side of a `split_share` family used after the other side was aborted: an out-of-place
/// all-reduce and its wait give the input exactly, or a typed error (never `Ok` with stale
/// bytes), and finalize ends within the deadline.
fn use_after_the_other_aborted(survivor: Communicator, who: &'static str) {
    let context = Arc::clone(survivor.context());
    within(Duration::from_secs(40), who, move || {
        let s = stream(&context);
        let input = pattern::<f32>(100_003, 4);
        let stale = pattern::<f32>(100_003, 5);
        let send = upload(&context, &input);
        let mut recv = upload(&context, &stale);
        let called = survivor
            .all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
            .and_then(|()| survivor.synchronize(&s));
        match &called {
            Ok(()) => assert_bytes_eq(
                &format!("{who}: Ok after the other's abort"),
                &recv.to_vec().expect("download"),
                &input,
            ),
            Err(error) => assert!(typed_after_abort(error), "{who}: {error}"),
        }
        eprintln!("{who}: all-reduce after the other's abort: {called:?}");
        let started = Instant::now();
        let finalized = survivor.finalize();
        eprintln!(
            "{who}: finalize after the other's abort: {finalized:?} in {:?}",
            started.elapsed()
        );
        if let Err(error) = &finalized {
            assert!(typed_after_abort(error), "{who}: finalize: {error}");
        }
    });
}

/// `splitShare` (torch's `split_group` reuses its parent's resources the same way): the child
/// shares the parent's channels, proxy and abort flag. After the parent is aborted (by hand,
/// from another thread), the child's all-reduce must give the exact result or a typed error,
/// never `Ok` over stale bytes, and the child must finalize (or refuse to) within its deadline,
/// never hang. The same for a parent after its child's abort.
#[test]
fn a_split_share_family_member_used_after_the_others_abort_is_exact_or_typed_and_never_hangs() {
    let (_gpu, _serial) = gate!();
    let config = CommConfig::default()
        .with_split_share(true)
        .with_timeout(Duration::from_secs(10));
    // The parent aborted, the child used.
    let parent = own_comm(&config);
    let child = parent
        .split(Some(0), 0)
        .expect("split")
        .expect("a colour gives a child");
    {
        let s = stream(child.context());
        let input = pattern::<u32>(4099, 1);
        let mut buffer = upload(child.context(), &input);
        child
            .all_reduce_in_place(&mut buffer, ReduceOp::Max, &s)
            .expect("the child works");
        child.synchronize(&s).expect("synchronize");
        assert_bytes_eq("child", &buffer.to_vec().expect("download"), &input);
    }
    let aborting = parent.clone();
    within(Duration::from_secs(20), "the parent's abort", move || {
        aborting.abort()
    });
    assert!(parent.is_aborted());
    drop(parent);
    use_after_the_other_aborted(child, "child after its parent's abort");

    // The child aborted, the parent used.
    let parent = own_comm(&config);
    let child = parent
        .split(Some(0), 0)
        .expect("split")
        .expect("a colour gives a child");
    let aborting = child.clone();
    within(Duration::from_secs(20), "the child's abort", move || {
        aborting.abort()
    });
    drop(child);
    use_after_the_other_aborted(parent, "parent after its child's abort");
}

// ---------------------------------------------------------------------------------------------
// 6. One group spanning a communicator and its split child
// ---------------------------------------------------------------------------------------------

/// A program with two process groups (the world and a sub-group split from it while the world
/// still has an all-reduce queued behind a spin) coalesces calls of both in one NCCL group on
/// two streams: an all-reduce on views, an in-place reduce-scatter, an in-place broadcast of
/// bf16, and self exchanges whose sides differ in element type (64 `u8` into 16 `u32`, 10 `i64`
/// into 10 `f64`). Every result is exact, the queued all-reduce too. A group in which the world
/// sends to itself and the sub-group receives from itself (two communicators: not a pair) is
/// refused before NCCL, nothing written, both communicators healthy.
#[test]
fn one_group_spans_a_communicator_and_its_split_child_with_mixed_type_self_exchanges() {
    let (_gpu, _serial) = gate!();
    let world = own_comm(&CommConfig::default());
    let context = Arc::clone(world.context());
    let kernels = TestKernels::load(&context).expect("kernels");
    let (s1, s2) = (stream(&context), stream(&context));
    let queued_input = pattern::<f64>(1 << 18, 9);
    let queued_send = upload(&context, &queued_input);
    let mut queued_recv = DeviceBuffer::<f64>::zeroed(&context, 1 << 18).expect("recv");
    kernels.spin_ns(&s1, KERNEL_NS).expect("spin");
    world
        .all_reduce(&queued_send, &mut queued_recv, ReduceOp::Sum, &s1)
        .expect("queued all-reduce");
    let sub = world
        .split(Some(7), 0)
        .expect("split while busy")
        .expect("a colour gives a child");

    let n = 4099;
    let floats = pattern::<f32>(n + 6, 1);
    let float_send = upload(&context, &floats);
    let stale = pattern::<f32>(n + 4, 2);
    let mut float_recv = upload(&context, &stale);
    let scatter_input = pattern::<i32>(3000, 3);
    let mut scatter = upload(&context, &scatter_input);
    let halves = pattern::<Bf16>(1000, 4);
    let mut broadcast = upload(&context, &halves);
    let bytes_in = pattern::<u8>(64, 5);
    let bytes_src = upload(&context, &bytes_in);
    let mut words_dst = DeviceBuffer::<u32>::zeroed(&context, 20).expect("words");
    let longs: Vec<i64> = (0..10i64).map(|i| i * 0x0101_0101_0101 + 3).collect();
    let longs_src = upload(&context, &longs);
    let mut doubles_dst = DeviceBuffer::<f64>::zeroed(&context, 10).expect("doubles");
    {
        let send_view = float_send.slice(3..3 + n).expect("view");
        let mut recv_view = float_recv.slice_mut(2..2 + n).expect("view");
        let mut words_view = words_dst.slice_mut(2..18).expect("view");
        let mut group = Group::new();
        group
            .all_reduce(&world, &send_view, &mut recv_view, ReduceOp::Max, &s1)
            .expect("add");
        group
            .reduce_scatter_in_place(&world, &mut scatter, ReduceOp::Sum, &s2)
            .expect("add");
        group
            .broadcast_in_place(&sub, &mut broadcast, 0, &s2)
            .expect("add");
        group.send(&world, &bytes_src, 0, &s1).expect("add");
        group.recv(&world, &mut words_view, 0, &s1).expect("add");
        group.send(&sub, &longs_src, 0, &s2).expect("add");
        group.recv(&sub, &mut doubles_dst, 0, &s2).expect("add");
        group.launch().expect("one group over two communicators");
    }
    let got = float_recv.to_vec().expect("download");
    assert_bytes_eq("all-reduce view", &got[2..2 + n], &floats[3..3 + n]);
    assert_bytes_eq("before the view", &got[..2], &stale[..2]);
    assert_bytes_eq("after the view", &got[2 + n..], &stale[2 + n..]);
    assert_bytes_eq(
        "reduce-scatter in place",
        &scatter.to_vec().expect("download"),
        &scatter_input,
    );
    assert_bytes_eq(
        "bf16 broadcast",
        &broadcast.to_vec().expect("download"),
        &halves,
    );
    let words = words_dst.to_vec().expect("download");
    assert_eq!(&words[..2], &[0, 0]);
    assert_eq!(&words[18..], &[0, 0]);
    assert_eq!(
        bytemuck::cast_slice::<u32, u8>(&words[2..18]),
        &bytes_in[..],
        "64 u8 into 16 u32"
    );
    let doubles = doubles_dst.to_vec().expect("download");
    assert_eq!(
        bytemuck::cast_slice::<f64, i64>(&doubles),
        &longs[..],
        "10 i64 into 10 f64, bit for bit"
    );
    assert_bytes_eq(
        "the all-reduce queued before the split",
        &queued_recv.to_vec().expect("download"),
        &queued_input,
    );

    // Sides on two communicators do not pair.
    let mut sink = DeviceBuffer::<u8>::zeroed(&context, 64).expect("sink");
    {
        let mut group = Group::new();
        group.send(&world, &bytes_src, 0, &s1).expect("add");
        group.recv(&sub, &mut sink, 0, &s1).expect("add");
        invalid(
            "a send on one communicator, its receive on another",
            group.launch(),
        );
    }
    assert_eq!(sink.to_vec().expect("download"), vec![0; 64]);
    assert!(!world.is_aborted() && !sub.is_aborted());
    for c in [&world, &sub] {
        let mut buffer = upload(&context, &floats);
        c.all_reduce_in_place(&mut buffer, ReduceOp::Sum, &s1)
            .expect("still healthy");
        c.synchronize(&s1).expect("synchronize");
        assert_bytes_eq(
            "after the refusal",
            &buffer.to_vec().expect("download"),
            &floats,
        );
    }
    sub.finalize().expect("finalize the sub-group");
    world.finalize().expect("finalize the world");
}

// ---------------------------------------------------------------------------------------------
// 7. Groups dropped, refused, empty
// ---------------------------------------------------------------------------------------------

/// A group built and dropped without `launch` queues nothing and records nothing: the buffers
/// keep their bytes and the memory layer uses them at once. A call refused while being added
/// (a wrong length, a root out of range) leaves the group's other calls to launch normally.
/// An empty group launches as nothing. The communicator stays healthy throughout.
#[test]
fn groups_dropped_unlaunched_refused_or_empty_leave_buffers_and_the_communicator_usable() {
    let (_gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let s = stream(context);
    let input = pattern::<u64>(5000, 1);
    let stale = pattern::<u64>(5000, 2);
    let send = upload(context, &input);
    let mut recv = upload(context, &stale);
    let mut other = upload(context, &stale);
    {
        let mut group = Group::new();
        group
            .all_reduce(comm, &send, &mut recv, ReduceOp::Sum, &s)
            .expect("add");
        group
            .broadcast(comm, &send, &mut other, 0, &s)
            .expect("add");
        assert_eq!(group.len(), 2);
        drop(group);
    }
    assert_bytes_eq("dropped group: recv", &recv.to_vec().expect("r"), &stale);
    assert_bytes_eq("dropped group: other", &other.to_vec().expect("o"), &stale);
    let started = Instant::now();
    recv.fill_async(3, &s).expect("fill");
    s.synchronize().expect("stream");
    assert!(started.elapsed() < Duration::from_secs(5));
    recv.copy_from_host(&stale).expect("reset");

    let mut short = DeviceBuffer::<u64>::zeroed(context, 4999).expect("short");
    {
        let mut group = Group::new();
        group
            .all_reduce(comm, &send, &mut recv, ReduceOp::Min, &s)
            .expect("add");
        assert!(matches!(
            group.all_reduce(comm, &send, &mut short, ReduceOp::Min, &s),
            Err(CollectiveError::InvalidArgument { .. })
        ));
        assert!(matches!(
            group.broadcast(comm, &send, &mut other, 1, &s),
            Err(CollectiveError::InvalidArgument { .. })
        ));
        assert_eq!(group.len(), 1, "refused calls are not added");
        group.launch().expect("the rest launches");
    }
    assert_bytes_eq("the call kept", &recv.to_vec().expect("r"), &input);
    assert_bytes_eq("refused: other", &other.to_vec().expect("o"), &stale);
    assert_eq!(short.to_vec().expect("s"), vec![0; 4999]);

    let empty = Group::new();
    assert!(empty.is_empty());
    empty.launch().expect("an empty group");
    comm.synchronize(&s).expect("synchronize");
    assert!(!comm.is_aborted());
}

// ---------------------------------------------------------------------------------------------
// 8. Buffers from a stream-ordered pool
// ---------------------------------------------------------------------------------------------

/// PyTorch's `cudaMallocAsync` backend (RMM's pool resource): the input is allocated from a
/// stream-ordered pool on stream A behind a 60 ms spin and written there, the output allocated
/// on stream B, and the all-reduce runs on stream C: it must read what A wrote. The input is
/// then dropped and a new pool buffer allocated and written on A at once (it may get the input's
/// memory): the all-reduce's result is unchanged. Five rounds, in place and out of place.
#[test]
fn collectives_on_stream_ordered_pool_buffers_allocated_behind_a_spin() {
    let (gpu, _serial) = gate!();
    let resource: Arc<dyn MemoryResource> = match AsyncPoolResource::new(&gpu.context) {
        Ok(resource) => Arc::new(resource),
        Err(error) => {
            skip(
                "nccl_second_look::collectives_on_stream_ordered_pool_buffers_allocated_behind_a_spin",
                &format!("no stream-ordered pool: {error}"),
            );
            return;
        }
    };
    let comm = comm();
    let context = comm.context();
    let kernels = TestKernels::load(context).expect("kernels");
    let (a, b, c) = (stream(context), stream(context), stream(context));
    const N: usize = (1 << 20) + 5;
    for round in 0..5u32 {
        let value = 0x1000 + round;
        kernels.spin_ns(&a, KERNEL_NS).expect("spin");
        let mut send =
            DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &a).expect("send");
        send.fill_async(value, &a).expect("fill");
        let mut recv =
            DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &b).expect("recv");
        if round % 2 == 0 {
            comm.all_reduce(&send, &mut recv, ReduceOp::Max, &c)
                .expect("all_reduce");
        } else {
            comm.all_reduce_in_place(&mut send, ReduceOp::Min, &c)
                .expect("in place");
            recv.copy_from_async(&send, &c).expect("copy");
        }
        drop(send);
        let mut reuse =
            DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &a).expect("reuse");
        reuse.fill_async(0xDEAD, &a).expect("overwrite");
        comm.synchronize(&c).expect("synchronize");
        let got = recv.to_vec().expect("download");
        if let Some(i) = got.iter().position(|&x| x != value) {
            panic!(
                "round {round}: element {i} is {:#x}, expected {value:#x}: the collective did \
                 not read what stream A wrote into pool memory",
                got[i]
            );
        }
        drop(reuse);
        a.synchronize().expect("a");
    }
}

// ---------------------------------------------------------------------------------------------
// 9. Futures of several streams, awaited out of order
// ---------------------------------------------------------------------------------------------

/// An async trainer queues an all-reduce into a pinned output on each of four streams, each
/// behind a spin of 50 to 200 ms, takes a future for each, and awaits them in reverse order on an
/// executor. Before the futures resolve, host access to the outputs is refused without blocking
/// (`try_as_slice` is `DeviceBusy`); once each resolves, its output is readable without blocking
/// and exact.
#[test]
fn futures_of_four_streams_awaited_out_of_order_release_their_pinned_outputs() {
    let (_gpu, _serial) = gate!();
    let comm = comm();
    let context = comm.context();
    let kernels = TestKernels::load(context).expect("kernels");
    let streams: Vec<Stream> = (0..4).map(|_| stream(context)).collect();
    const N: usize = 300_007;
    let inputs: Vec<Vec<f32>> = (0..4).map(|i| pattern::<f32>(N, 20 + i)).collect();
    let sends: Vec<DeviceBuffer<f32>> = inputs.iter().map(|v| upload(context, v)).collect();
    let mut outputs: Vec<PinnedBuffer<f32>> = (0..4)
        .map(|_| PinnedBuffer::<f32>::zeroed(context, N).expect("pinned"))
        .collect();
    let mut futures_in_order = Vec::new();
    for (i, ((s, send), out)) in streams.iter().zip(&sends).zip(&mut outputs).enumerate() {
        kernels
            .spin_ns(s, 50_000_000 * (i as u64 + 1))
            .expect("spin");
        comm.all_reduce(send, out, ReduceOp::Sum, s)
            .expect("all_reduce");
        futures_in_order.push(comm.completion(s).expect("future"));
    }
    for (i, out) in outputs.iter().enumerate() {
        assert!(
            matches!(out.try_as_slice(), Err(MemoryError::DeviceBusy { .. })),
            "output {i}: a host slice while its all-reduce is still queued"
        );
    }
    futures_in_order.reverse();
    let outcomes = futures::executor::block_on(futures::future::join_all(futures_in_order));
    for outcome in outcomes {
        outcome.expect("resolved");
    }
    for (i, (out, input)) in outputs.iter().zip(&inputs).enumerate() {
        let host = out
            .try_as_slice()
            .unwrap_or_else(|e| panic!("output {i} after its future resolved: {e}"));
        assert_bytes_eq(&format!("output {i}"), &host[..], input);
    }
}

// ---------------------------------------------------------------------------------------------
// 10. Two GPUs: every reduction of every type against the host's values
// ---------------------------------------------------------------------------------------------

/// Host-side arithmetic for the two-rank check.
trait Exact: NcclType + PartialEq + std::fmt::Debug {
    /// Rank `rank`'s element `i`: small values whose sums, products and means are exact.
    fn value(i: usize, rank: usize) -> Self;
    fn from_f64(value: f64) -> Self;
    fn to_f64(self) -> f64;
    /// Whether the type is an integer (its mean rounds toward zero).
    const INTEGER: bool;
}

macro_rules! exact_int {
    ($($t:ty),*) => {$(
        impl Exact for $t {
            fn value(i: usize, rank: usize) -> Self {
                ((i * 7 + rank * 3) % 5 + 1) as $t
            }
            fn from_f64(value: f64) -> Self {
                value as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            const INTEGER: bool = true;
        }
    )*};
}
exact_int!(i8, u8, i32, u32, i64, u64);

impl Exact for f32 {
    fn value(i: usize, rank: usize) -> Self {
        ((i * 7 + rank * 3) % 9) as f32 * 0.5 - 2.0
    }
    fn from_f64(value: f64) -> Self {
        value as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    const INTEGER: bool = false;
}

impl Exact for f64 {
    fn value(i: usize, rank: usize) -> Self {
        ((i * 7 + rank * 3) % 9) as f64 * 0.25 - 1.0
    }
    fn from_f64(value: f64) -> Self {
        value
    }
    fn to_f64(self) -> f64 {
        self
    }
    const INTEGER: bool = false;
}

impl Exact for F16 {
    fn value(i: usize, rank: usize) -> Self {
        F16::from_f32(((i * 7 + rank * 3) % 9) as f32 * 0.5 - 2.0)
    }
    fn from_f64(value: f64) -> Self {
        F16::from_f32(value as f32)
    }
    fn to_f64(self) -> f64 {
        f64::from(self.to_f32())
    }
    const INTEGER: bool = false;
}

impl Exact for Bf16 {
    fn value(i: usize, rank: usize) -> Self {
        Bf16::from_f32(((i * 7 + rank * 3) % 9) as f32 * 0.5 - 2.0)
    }
    fn from_f64(value: f64) -> Self {
        Bf16::from_f32(value as f32)
    }
    fn to_f64(self) -> f64 {
        f64::from(self.to_f32())
    }
    const INTEGER: bool = false;
}

fn reduce_on_host<T: Exact>(op: ReduceOp, values: &[f64]) -> T {
    let n = values.len() as f64;
    T::from_f64(match op {
        ReduceOp::Sum => values.iter().sum(),
        ReduceOp::Prod => values.iter().product(),
        ReduceOp::Min => values.iter().copied().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Avg if T::INTEGER => (values.iter().sum::<f64>() / n).trunc(),
        _ => values.iter().sum::<f64>() / n,
    })
}

fn every_reduction_across<T: Exact>(comms: &[Communicator], streams: &[Stream], count: usize) {
    let name = std::any::type_name::<T>();
    let ranks = comms.len();
    let sends: Vec<DeviceBuffer<T>> = comms
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let values: Vec<T> = (0..count).map(|i| T::value(i, r)).collect();
            upload(c.context(), &values)
        })
        .collect();
    for op in ReduceOp::ALL {
        let mut recvs: Vec<DeviceBuffer<T>> = comms
            .iter()
            .map(|c| DeviceBuffer::<T>::zeroed(c.context(), count).expect("recv"))
            .collect();
        {
            let mut group = Group::new();
            for ((c, s), (send, recv)) in comms
                .iter()
                .zip(streams)
                .zip(sends.iter().zip(recvs.iter_mut()))
            {
                group.all_reduce(c, send, recv, op, s).expect("add");
            }
            group.launch().expect("grouped all-reduce");
        }
        let want: Vec<T> = (0..count)
            .map(|i| {
                let values: Vec<f64> = (0..ranks).map(|r| T::value(i, r).to_f64()).collect();
                reduce_on_host::<T>(op, &values)
            })
            .collect();
        for (r, recv) in recvs.iter().enumerate() {
            assert_bytes_eq(
                &format!("{op:?} of {count} × {name}, rank {r}"),
                &recv.to_vec().expect("download"),
                &want,
            );
        }
    }
}

/// nccl-tests' data check across every GPU of the machine (`init_all`), every reduction of
/// every element type, at an uneven count, grouped as one process driving every GPU: each
/// rank's output equals the host's reduction of the ranks' inputs (values kept small, so sums,
/// products and means are exact; integer means round toward zero). Skipped on one GPU.
#[test]
fn two_gpus_every_reduction_of_every_type_matches_the_hosts_arithmetic() {
    let (_gpu, _serial) = gate!();
    let devices = Device::all().expect("devices");
    if devices.len() < 2 {
        skip(
            "nccl_second_look::two_gpus_every_reduction_of_every_type_matches_the_hosts_arithmetic",
            &format!(
                "needs two GPUs, found {} (a multi-rank reduction)",
                devices.len()
            ),
        );
        return;
    }
    let comms = Communicator::init_all(&devices, &CommConfig::default()).expect("init_all");
    let streams: Vec<Stream> = comms.iter().map(|c| stream(c.context())).collect();
    let count = 262_147;
    every_reduction_across::<f32>(&comms, &streams, count);
    every_reduction_across::<f64>(&comms, &streams, count);
    every_reduction_across::<F16>(&comms, &streams, count);
    every_reduction_across::<Bf16>(&comms, &streams, count);
    every_reduction_across::<i8>(&comms, &streams, count);
    every_reduction_across::<u8>(&comms, &streams, count);
    every_reduction_across::<i32>(&comms, &streams, count);
    every_reduction_across::<u32>(&comms, &streams, count);
    every_reduction_across::<i64>(&comms, &streams, count);
    every_reduction_across::<u64>(&comms, &streams, count);
    for (c, s) in comms.iter().zip(&streams) {
        c.synchronize(s).expect("synchronize");
    }
}
