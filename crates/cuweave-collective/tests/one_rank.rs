//! One GPU: a 1-rank communicator runs every collective byte-exact from 4 B to 1 GiB for several
//! element types; two ranks on one device are refused with a typed error at once; a rank whose
//! peer never arrives times out, is aborted, and the process lives on.

mod common;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::{Pattern, assert_bytes_eq, nccl_or_skip, pattern};
use cuweave_collective::{
    CollectiveError, CommConfig, Communicator, CoordinatedCollectives, Group, NcclCode, ReduceOp,
    UniqueId,
};
use cuweave_driver::{Device, Stream, StreamFlags};
use cuweave_event::{EventPool, OperationCoordinator, OperationState};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_test_support::require_gpu;

/// One 1-rank communicator for the whole binary (initialisation takes about half a second).
fn comm() -> &'static Communicator {
    static COMM: OnceLock<Communicator> = OnceLock::new();
    COMM.get_or_init(|| {
        let id = UniqueId::new().expect("ncclGetUniqueId");
        let device = Device::get(0).expect("device 0");
        let started = Instant::now();
        let comm = Communicator::init_rank(1, 0, &id, device, &CommConfig::default())
            .expect("1-rank init");
        eprintln!("1-rank init took {:?}", started.elapsed());
        comm
    })
}

macro_rules! gate {
    () => {{
        let gpu = require_gpu!(else return);
        if !nccl_or_skip(cuweave_test_support::__test_name(std::any::type_name_of_val(&|| ()))) {
            return;
        }
        gpu
    }};
}

fn upload<T: Pattern>(context: &Arc<cuweave_driver::Context>, values: &[T]) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(context, values).expect("upload")
}

/// Every collective on `len` elements of `T`, out of place and in place, each byte-exact.
fn every_collective<T: Pattern>(comm: &Communicator, stream: &Stream, len: usize) {
    let context = comm.context();
    let input: Vec<T> = pattern(len, 1);
    let stale: Vec<T> = pattern(len, 99);
    let send = upload(context, &input);
    let what = |name: &str| format!("{name} of {len} × {}", std::any::type_name::<T>());

    for op in ReduceOp::ALL {
        let mut recv = upload(context, &stale);
        comm.all_reduce(&send, &mut recv, op, stream)
            .expect("all_reduce");
        comm.synchronize(stream).expect("synchronize");
        assert_bytes_eq(
            &what(&format!("all_reduce {op:?}")),
            &recv.to_vec().expect("download"),
            &input,
        );
        let mut buffer = upload(context, &input);
        comm.all_reduce_in_place(&mut buffer, op, stream)
            .expect("all_reduce_in_place");
        comm.synchronize(stream).expect("synchronize");
        assert_bytes_eq(
            &what(&format!("all_reduce_in_place {op:?}")),
            &buffer.to_vec().expect("download"),
            &input,
        );
    }

    let mut recv = upload(context, &stale);
    comm.broadcast(&send, &mut recv, 0, stream)
        .expect("broadcast");
    comm.synchronize(stream).expect("synchronize");
    assert_bytes_eq(
        &what("broadcast"),
        &recv.to_vec().expect("download"),
        &input,
    );
    let mut buffer = upload(context, &input);
    comm.broadcast_in_place(&mut buffer, 0, stream)
        .expect("broadcast_in_place");
    comm.synchronize(stream).expect("synchronize");
    assert_bytes_eq(
        &what("broadcast_in_place"),
        &buffer.to_vec().expect("download"),
        &input,
    );

    for op in [ReduceOp::Sum, ReduceOp::Min] {
        let mut recv = upload(context, &stale);
        comm.reduce(&send, &mut recv, op, 0, stream)
            .expect("reduce");
        comm.synchronize(stream).expect("synchronize");
        assert_bytes_eq(
            &what(&format!("reduce {op:?}")),
            &recv.to_vec().expect("download"),
            &input,
        );
    }
    let mut buffer = upload(context, &input);
    comm.reduce_in_place(&mut buffer, ReduceOp::Prod, 0, stream)
        .expect("reduce_in_place");
    comm.synchronize(stream).expect("synchronize");
    assert_bytes_eq(
        &what("reduce_in_place"),
        &buffer.to_vec().expect("download"),
        &input,
    );

    let mut recv = upload(context, &stale);
    comm.all_gather(&send, &mut recv, stream)
        .expect("all_gather");
    comm.synchronize(stream).expect("synchronize");
    assert_bytes_eq(
        &what("all_gather"),
        &recv.to_vec().expect("download"),
        &input,
    );
    let mut buffer = upload(context, &input);
    comm.all_gather_in_place(&mut buffer, stream)
        .expect("all_gather_in_place");
    comm.synchronize(stream).expect("synchronize");
    assert_bytes_eq(
        &what("all_gather_in_place"),
        &buffer.to_vec().expect("download"),
        &input,
    );

    let mut recv = upload(context, &stale);
    comm.reduce_scatter(&send, &mut recv, ReduceOp::Max, stream)
        .expect("reduce_scatter");
    comm.synchronize(stream).expect("synchronize");
    assert_bytes_eq(
        &what("reduce_scatter"),
        &recv.to_vec().expect("download"),
        &input,
    );
    let mut buffer = upload(context, &input);
    comm.reduce_scatter_in_place(&mut buffer, ReduceOp::Sum, stream)
        .expect("reduce_scatter_in_place");
    comm.synchronize(stream).expect("synchronize");
    assert_bytes_eq(
        &what("reduce_scatter_in_place"),
        &buffer.to_vec().expect("download"),
        &input,
    );

    // Send to and receive from itself: one group, as NCCL requires.
    let mut recv = upload(context, &stale);
    let mut group = Group::new();
    group.send(comm, &send, 0, stream).expect("send");
    group.recv(comm, &mut recv, 0, stream).expect("recv");
    group.launch().expect("group launch");
    comm.synchronize(stream).expect("synchronize");
    assert_bytes_eq(
        &what("send/recv"),
        &recv.to_vec().expect("download"),
        &input,
    );
}

fn sizes_for<T>(bytes: &[usize]) -> Vec<usize> {
    bytes.iter().map(|b| (b / size_of::<T>()).max(1)).collect()
}

const BYTES: [usize; 5] = [4, 4100, 1 << 20, (1 << 20) + 12, 64 << 20];

#[test]
fn every_collective_is_byte_exact_for_several_types_from_4_bytes_to_64_mib() {
    let _gpu = gate!();
    let comm = comm();
    assert_eq!((comm.rank(), comm.size()), (0, 1));
    let stream = Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream");
    for len in sizes_for::<f32>(&BYTES) {
        every_collective::<f32>(comm, &stream, len);
    }
    for len in sizes_for::<f64>(&BYTES) {
        every_collective::<f64>(comm, &stream, len);
    }
    for len in sizes_for::<i32>(&BYTES) {
        every_collective::<i32>(comm, &stream, len);
    }
    for len in sizes_for::<u8>(&BYTES) {
        every_collective::<u8>(comm, &stream, len);
    }
    for len in sizes_for::<i64>(&BYTES[..3]) {
        every_collective::<i64>(comm, &stream, len);
    }
}

#[test]
fn one_gib_all_reduce_and_broadcast_are_byte_exact() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream");
    let len = (1usize << 30) / size_of::<f32>();
    let input: Vec<f32> = pattern(len, 3);
    let send = upload(context, &input);
    let mut recv = DeviceBuffer::<f32>::zeroed(context, len).expect("1 GiB");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)
        .expect("all_reduce");
    comm.synchronize(&stream).expect("synchronize");
    assert_bytes_eq(
        "1 GiB all_reduce",
        &recv.to_vec().expect("download"),
        &input,
    );
    recv.fill(0.0).expect("clear");
    comm.broadcast(&send, &mut recv, 0, &stream)
        .expect("broadcast");
    comm.synchronize(&stream).expect("synchronize");
    assert_bytes_eq("1 GiB broadcast", &recv.to_vec().expect("download"), &input);
    drop(recv);
    let mut bytes = upload(context, &pattern::<u8>(1 << 30, 5));
    comm.all_reduce_in_place(&mut bytes, ReduceOp::Max, &stream)
        .expect("in place");
    comm.synchronize(&stream).expect("synchronize");
    assert_bytes_eq(
        "1 GiB all_reduce_in_place u8",
        &bytes.to_vec().expect("download"),
        &pattern::<u8>(1 << 30, 5),
    );
}

#[test]
fn collectives_record_their_reads_and_writes_on_the_stream() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream");
    let send = upload(context, &pattern::<f32>(4096, 1));
    let mut recv = DeviceBuffer::<f32>::zeroed(context, 4096).expect("recv");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)
        .expect("all_reduce");
    let handle = stream.as_raw() as usize;
    assert_eq!(
        send.last_use(),
        Some(handle),
        "the send buffer's read is recorded"
    );
    assert_eq!(send.concurrent_readers(), 1, "recorded as a read");
    assert_eq!(
        recv.last_use(),
        Some(handle),
        "the receive buffer's write is recorded"
    );
    assert_eq!(recv.concurrent_readers(), 0, "recorded as a write");
    // The host read waits for the collective through the tracker alone: no synchronize.
    assert_bytes_eq(
        "tracked read",
        &recv.to_vec().expect("download"),
        &pattern::<f32>(4096, 1),
    );
}

#[test]
fn mismatched_lengths_and_ranks_are_refused_before_nccl() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream");
    let send = DeviceBuffer::<f32>::zeroed(context, 16).expect("send");
    let mut short = DeviceBuffer::<f32>::zeroed(context, 8).expect("recv");
    let refused = |result: cuweave_collective::Result<()>| {
        assert!(
            matches!(result, Err(CollectiveError::InvalidArgument { .. })),
            "{result:?}"
        );
    };
    refused(comm.all_reduce(&send, &mut short, ReduceOp::Sum, &stream));
    refused(comm.all_gather(&send, &mut short, &stream));
    refused(comm.broadcast_in_place(&mut short, 1, &stream));
    refused(comm.send(&send, 3, &stream));
    assert!(!comm.is_aborted());
}

#[test]
fn two_ranks_on_one_device_are_a_typed_invalid_usage_within_10_s() {
    let gpu = gate!();
    let config = CommConfig::default().with_timeout(Duration::from_secs(10));
    let started = Instant::now();
    let error = Communicator::init_all(&[gpu.device, gpu.device], &config)
        .expect_err("NCCL refuses a duplicate GPU");
    eprintln!(
        "init_all on one device twice: {error} after {:?}",
        started.elapsed()
    );
    assert_eq!(error.nccl_code(), Some(NcclCode::InvalidUsage), "{error}");
    assert!(started.elapsed() < Duration::from_secs(10));

    // Two init_rank calls, one per thread, on the same device.
    let id = UniqueId::new().expect("id");
    let started = Instant::now();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let config = config.clone();
            let device = gpu.device;
            std::thread::spawn(move || Communicator::init_rank(2, rank, &id, device, &config))
        })
        .collect();
    for rank in ranks {
        let error = rank.join().expect("thread").expect_err("duplicate GPU");
        eprintln!("init_rank on one device twice: {error}");
        assert!(
            error.nccl_code() == Some(NcclCode::InvalidUsage) || error.is_timeout(),
            "{error}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(12));
}

#[test]
fn a_peer_that_never_arrives_is_a_timeout_and_the_process_lives_on() {
    let gpu = gate!();
    let id = UniqueId::new().expect("id");
    let config = CommConfig::default().with_timeout(Duration::from_secs(3));
    let started = Instant::now();
    let error =
        Communicator::init_rank(2, 0, &id, gpu.device, &config).expect_err("rank 1 never joins");
    let waited = started.elapsed();
    eprintln!("lonely rank 0: {error} after {waited:?}");
    assert!(error.is_timeout(), "{error}");
    assert!(waited >= Duration::from_secs(3) && waited < Duration::from_secs(8));
    // The process carries on: another communicator still works.
    let comm = comm();
    let stream = Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream");
    let mut buffer = upload(comm.context(), &pattern::<i32>(1000, 4));
    comm.all_reduce_in_place(&mut buffer, ReduceOp::Sum, &stream)
        .expect("all_reduce");
    comm.synchronize(&stream).expect("synchronize");
    assert_bytes_eq(
        "after a timeout",
        &buffer.to_vec().expect("download"),
        &pattern::<i32>(1000, 4),
    );
}

#[test]
fn an_aborted_communicator_refuses_work() {
    let gpu = gate!();
    let comm = Communicator::init_rank(
        1,
        0,
        &UniqueId::new().expect("id"),
        gpu.device,
        &CommConfig::default(),
    )
    .expect("init");
    let stream = Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream");
    let mut buffer = upload(comm.context(), &pattern::<f32>(64, 1));
    comm.abort();
    assert!(comm.is_aborted());
    let error = comm
        .all_reduce_in_place(&mut buffer, ReduceOp::Sum, &stream)
        .expect_err("aborted");
    assert!(matches!(error, CollectiveError::Aborted { .. }), "{error}");
    assert!(matches!(
        comm.synchronize(&stream),
        Err(CollectiveError::Aborted { .. })
    ));
}

#[test]
fn split_makes_a_communicator_and_no_color_takes_no_part() {
    let _gpu = gate!();
    let comm = comm();
    let child = comm
        .split(Some(0), 0)
        .expect("split")
        .expect("a colour gives a communicator");
    assert_eq!((child.rank(), child.size()), (0, 1));
    let stream = Stream::new(child.context(), StreamFlags::NON_BLOCKING).expect("stream");
    let mut buffer = upload(child.context(), &pattern::<u32>(333, 2));
    child
        .all_reduce_in_place(&mut buffer, ReduceOp::Max, &stream)
        .expect("all_reduce");
    child.synchronize(&stream).expect("synchronize");
    assert_bytes_eq(
        "split",
        &buffer.to_vec().expect("download"),
        &pattern::<u32>(333, 2),
    );
    drop(child);
    assert!(comm.split(None, 0).expect("no colour").is_none());
}

#[test]
fn a_collective_is_awaited_as_a_future() {
    let _gpu = gate!();
    let comm = comm();
    let stream = Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream");
    let send = upload(comm.context(), &pattern::<f64>(1 << 20, 6));
    let mut recv = DeviceBuffer::<f64>::zeroed(comm.context(), 1 << 20).expect("recv");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)
        .expect("all_reduce");
    futures::executor::block_on(comm.completion(&stream).expect("future")).expect("resolves");
    assert_bytes_eq(
        "awaited",
        &recv.to_vec().expect("download"),
        &pattern::<f64>(1 << 20, 6),
    );
}

#[test]
fn coordinated_collectives_run_as_operations_with_dependencies() {
    let gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let coordinator = OperationCoordinator::new(EventPool::new(&gpu.context, 8, 8).expect("pool"))
        .expect("coordinator");
    let collectives = CoordinatedCollectives::new(coordinator.clone());
    let (a, b) = (
        Arc::new(Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream")),
        Arc::new(Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream")),
    );
    let input = pattern::<f32>(1 << 16, 8);
    let send = upload(context, &input);
    let mut reduced = DeviceBuffer::<f32>::zeroed(context, 1 << 16).expect("recv");
    let mut broadcast = DeviceBuffer::<f32>::zeroed(context, 1 << 16).expect("recv");
    let mut root = DeviceBuffer::<f32>::zeroed(context, 1 << 16).expect("recv");
    let all_reduce = collectives
        .all_reduce(comm, &send, &mut reduced, ReduceOp::Sum, &a, &[])
        .expect("all_reduce");
    let bcast = collectives
        .broadcast(comm, &reduced, &mut broadcast, 0, &b, &[all_reduce])
        .expect("broadcast after the all-reduce, on another stream");
    let reduce = collectives
        .reduce(comm, &broadcast, &mut root, ReduceOp::Max, 0, &a, &[bcast])
        .expect("reduce");
    futures::executor::block_on(collectives.completion(reduce).expect("future")).expect("resolves");
    for id in [all_reduce, bcast, reduce] {
        coordinator.synchronize(id).expect("synchronize");
        assert_eq!(
            coordinator.state(id).expect("state"),
            OperationState::Completed
        );
    }
    let metrics = coordinator.metrics();
    assert_eq!((metrics.registered, metrics.begun), (3, 3));
    // The chain's bytes prove its order: the broadcast on `b` read the all-reduce's result from
    // `a`, the reduce on `a` the broadcast's (a dependency the GPU had already finished needs no
    // wait, so the count of cross-stream waits is not fixed).
    assert!(metrics.cross_stream_waits <= 2);
    assert_bytes_eq(
        "coordinated chain",
        &root.to_vec().expect("download"),
        &input,
    );
}

#[test]
fn many_collectives_leave_the_trackers_bounded() {
    let gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream");
    let other = Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream");
    let send = upload(context, &pattern::<i32>(256, 1));
    let mut recv = DeviceBuffer::<i32>::zeroed(context, 256).expect("recv");
    // Alternate streams so every call waits for and records across streams.
    for i in 0..100_000 {
        let s = if i % 2 == 0 { &stream } else { &other };
        comm.all_reduce(&send, &mut recv, ReduceOp::Max, s)
            .expect("all_reduce");
        assert!(
            send.concurrent_readers() <= 2,
            "readers stay bounded by the streams"
        );
    }
    comm.synchronize(&stream).expect("synchronize");
    comm.synchronize(&other).expect("synchronize");
    assert_bytes_eq(
        "after 10^5",
        &recv.to_vec().expect("download"),
        &pattern::<i32>(256, 1),
    );

    // And a chain of coordinated operations, each depending on the one before.
    let coordinator = OperationCoordinator::new(EventPool::new(&gpu.context, 8, 8).expect("pool"))
        .expect("coordinator");
    let collectives = CoordinatedCollectives::new(coordinator.clone());
    let stream = Arc::new(stream);
    let mut buffer = upload(context, &pattern::<i32>(256, 2));
    let mut last = None;
    for _ in 0..1000 {
        let deps: Vec<_> = last.into_iter().collect();
        last = Some(
            collectives
                .all_reduce_in_place(comm, &mut buffer, ReduceOp::Max, &stream, &deps)
                .expect("all_reduce"),
        );
    }
    futures::executor::block_on(collectives.completion(last.expect("ran")).expect("future"))
        .expect("resolves");
    assert_bytes_eq(
        "after 1000 coordinated",
        &buffer.to_vec().expect("download"),
        &pattern::<i32>(256, 2),
    );
}

#[test]
fn views_take_part_in_collectives_and_read_only_views_refuse_writes() {
    let _gpu = gate!();
    let comm = comm();
    let context = comm.context();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream");
    let input = pattern::<f32>(4096, 1);
    let stale = pattern::<f32>(4096, 99);
    let send = upload(context, &input);
    let mut whole = upload(context, &stale);
    {
        let src = send.slice(1024..2048).expect("read view");
        let mut dst = whole.slice_mut(..1024).expect("write view");
        comm.all_reduce(&src, &mut dst, ReduceOp::Sum, &stream)
            .expect("all_reduce on views");
    }
    {
        let mut middle = whole.slice_mut(2048..3072).expect("write view");
        comm.broadcast_in_place(&mut middle, 0, &stream)
            .expect("in place on a view");
    }
    comm.synchronize(&stream).expect("synchronize");
    let got = whole.to_vec().expect("download");
    assert_bytes_eq("view result", &got[..1024], &input[1024..2048]);
    assert_bytes_eq("untouched", &got[1024..], &stale[1024..]);
    let mut read_only = send.slice(..16).expect("read view");
    let error = comm
        .all_reduce_in_place(&mut read_only, ReduceOp::Sum, &stream)
        .expect_err("a read-only view is not written");
    assert!(
        matches!(
            error,
            CollectiveError::Memory(cuweave_memory::MemoryError::ReadOnlyView { .. })
        ),
        "{error}"
    );
}

#[test]
fn split_all_splits_the_ranks_of_init_all_in_one_group() {
    let gpu = gate!();
    let comms = Communicator::init_all(&[gpu.device], &CommConfig::default()).expect("init_all");
    let parents: Vec<&Communicator> = comms.iter().collect();
    let mut children = Communicator::split_all(&parents, &[(Some(0), 0)]).expect("split_all");
    let child = children
        .pop()
        .flatten()
        .expect("a colour gives a communicator");
    assert_eq!((child.rank(), child.size()), (0, 1));
    let stream = Stream::new(child.context(), StreamFlags::NON_BLOCKING).expect("stream");
    let mut buffer = upload(child.context(), &pattern::<f32>(4097, 3));
    child
        .all_reduce_in_place(&mut buffer, ReduceOp::Sum, &stream)
        .expect("all_reduce");
    child.synchronize(&stream).expect("synchronize");
    assert_bytes_eq(
        "split_all child",
        &buffer.to_vec().expect("download"),
        &pattern::<f32>(4097, 3),
    );
    drop(child);
    let none = Communicator::split_all(&parents, &[(None, 0)]).expect("no colour");
    assert!(matches!(none.as_slice(), [None]), "{none:?}");
    assert!(!comms[0].is_aborted());
}

#[test]
fn split_all_refuses_bad_arguments_before_nccl() {
    let _gpu = gate!();
    let comm = comm();
    let refused = |result: cuweave_collective::Result<Vec<Option<Communicator>>>| {
        assert!(
            matches!(result, Err(CollectiveError::InvalidArgument { .. })),
            "{result:?}"
        );
    };
    refused(Communicator::split_all(&[], &[]));
    refused(Communicator::split_all(&[comm], &[]));
    refused(Communicator::split_all(
        &[comm, comm],
        &[(Some(0), 0), (Some(0), 1)],
    ));
    refused(Communicator::split_all(&[comm], &[(Some(u32::MAX), 0)]));
    assert!(!comm.is_aborted());
}
