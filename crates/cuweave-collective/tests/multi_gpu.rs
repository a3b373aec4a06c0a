//! Several GPUs: `init_all` over every device, two processes joined through `init_rank` (the
//! test spawns the second process by re-executing this binary), every collective byte-exact,
//! broadcast from each root, and a rank that never joins a collective: the other gets a typed
//! timeout and its communicator is aborted. Each test reports itself skipped, with the reason,
//! on fewer than two devices.

mod common;

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_bytes_eq, nccl_or_skip, pattern};
use cuweave_collective::{CommConfig, Communicator, Group, ReduceOp, UniqueId};
use cuweave_driver::{Device, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_test_support::require_gpu;

const CHILD_VAR: &str = "CUWEAVE_COLLECTIVE_CHILD";

/// Every device, or `None` after printing why the test is skipped.
fn devices(test: &str) -> Option<Vec<Device>> {
    let devices = Device::all().ok()?;
    if devices.len() < 2 {
        common::skip(
            &format!("multi_gpu::{test}"),
            &format!("needs 2 or more devices, found {}", devices.len()),
        );
        return None;
    }
    if !nccl_or_skip(test) {
        return None;
    }
    Some(devices)
}

/// Every rank's input (rank r holds `pattern(len, r + 1)`), built once per check: the expected
/// results are element-wise over these, and rebuilding a rank's input for every element made
/// the 1 Mi-element check quadratic (about 10^12 steps: it ran past the GPU run's limit).
fn inputs(len: usize, n: usize) -> Vec<Vec<f64>> {
    (0..n).map(|r| pattern::<f64>(len, r + 1)).collect()
}

/// What `reduce` makes of each element across the ranks' `inputs`, in rank order: the expected
/// all-reduce and reduce results (exact in f64: the patterns are multiples of 1/8 well inside
/// f64's integer range).
fn per_element(
    inputs: &[Vec<f64>],
    reduce: impl Fn(&mut dyn Iterator<Item = f64>) -> f64,
) -> Vec<f64> {
    let len = inputs.first().map_or(0, Vec::len);
    (0..len)
        .map(|i| reduce(&mut inputs.iter().map(|input| input[i])))
        .collect()
}

/// What rank `rank` of `comms` does in every collective check, on its own stream; all ranks'
/// calls for one collective are grouped (one process) or run in separate processes.
struct Rank<'a> {
    comm: &'a Communicator,
    stream: Stream,
}

fn check_every_collective(ranks: &[Rank<'_>], size: usize, len: usize) {
    let n = size;
    let inputs = inputs(len, n);
    let mut sends: Vec<DeviceBuffer<f64>> = ranks
        .iter()
        .map(|rank| {
            DeviceBuffer::from_slice(rank.comm.context(), &inputs[rank.comm.rank()])
                .expect("upload")
        })
        .collect();
    let mut recvs: Vec<DeviceBuffer<f64>> = ranks
        .iter()
        .map(|rank| DeviceBuffer::zeroed(rank.comm.context(), len).expect("recv"))
        .collect();

    // all_reduce (sum), grouped over the local ranks.
    let mut group = Group::new();
    for ((rank, send), recv) in ranks.iter().zip(&sends).zip(&mut recvs) {
        group
            .all_reduce(rank.comm, send, recv, ReduceOp::Sum, &rank.stream)
            .expect("add");
    }
    group.launch().expect("all_reduce");
    for (rank, recv) in ranks.iter().zip(&recvs) {
        rank.comm.synchronize(&rank.stream).expect("synchronize");
        assert_bytes_eq(
            "all_reduce sum",
            &recv.to_vec().expect("download"),
            &per_element(&inputs, |values| values.sum()),
        );
    }

    // broadcast from each root.
    for (root, input) in inputs.iter().enumerate() {
        let mut group = Group::new();
        for ((rank, send), recv) in ranks.iter().zip(&sends).zip(&mut recvs) {
            group
                .broadcast(rank.comm, send, recv, root, &rank.stream)
                .expect("add");
        }
        group.launch().expect("broadcast");
        for (rank, recv) in ranks.iter().zip(&recvs) {
            rank.comm.synchronize(&rank.stream).expect("synchronize");
            assert_bytes_eq(
                &format!("broadcast from {root}"),
                &recv.to_vec().expect("download"),
                input,
            );
        }
    }

    // reduce (max) to the last rank.
    let root = n - 1;
    let mut group = Group::new();
    for ((rank, send), recv) in ranks.iter().zip(&sends).zip(&mut recvs) {
        group
            .reduce(rank.comm, send, recv, ReduceOp::Max, root, &rank.stream)
            .expect("add");
    }
    group.launch().expect("reduce");
    for (rank, recv) in ranks.iter().zip(&recvs) {
        rank.comm.synchronize(&rank.stream).expect("synchronize");
        if rank.comm.rank() == root {
            assert_bytes_eq(
                "reduce max",
                &recv.to_vec().expect("download"),
                &per_element(&inputs, |values| values.fold(f64::MIN, f64::max)),
            );
        }
    }

    // all_gather: every rank's input, in rank order.
    let mut gathered: Vec<DeviceBuffer<f64>> = ranks
        .iter()
        .map(|rank| DeviceBuffer::zeroed(rank.comm.context(), len * n).expect("gather"))
        .collect();
    let mut group = Group::new();
    for ((rank, send), recv) in ranks.iter().zip(&sends).zip(&mut gathered) {
        group
            .all_gather(rank.comm, send, recv, &rank.stream)
            .expect("add");
    }
    group.launch().expect("all_gather");
    let want: Vec<f64> = inputs.concat();
    for (rank, recv) in ranks.iter().zip(&gathered) {
        rank.comm.synchronize(&rank.stream).expect("synchronize");
        assert_bytes_eq("all_gather", &recv.to_vec().expect("download"), &want);
    }

    // reduce_scatter (sum) of the gathered buffers: rank r gets n × its own slot... of the
    // sum over ranks of the same gathered data, i.e. n × inputs[r].
    let mut group = Group::new();
    for ((rank, send), recv) in ranks.iter().zip(&gathered).zip(&mut recvs) {
        group
            .reduce_scatter(rank.comm, send, recv, ReduceOp::Sum, &rank.stream)
            .expect("add");
    }
    group.launch().expect("reduce_scatter");
    for (rank, recv) in ranks.iter().zip(&recvs) {
        rank.comm.synchronize(&rank.stream).expect("synchronize");
        let want: Vec<f64> = inputs[rank.comm.rank()]
            .iter()
            .map(|x| x * n as f64)
            .collect();
        assert_bytes_eq("reduce_scatter", &recv.to_vec().expect("download"), &want);
    }

    // send/recv around a ring: rank r sends to r + 1 and receives from r - 1.
    let mut group = Group::new();
    for ((rank, send), recv) in ranks.iter().zip(&sends).zip(&mut recvs) {
        let r = rank.comm.rank();
        group
            .send(rank.comm, send, (r + 1) % n, &rank.stream)
            .expect("send");
        group
            .recv(rank.comm, recv, (r + n - 1) % n, &rank.stream)
            .expect("recv");
    }
    group.launch().expect("ring");
    for (rank, recv) in ranks.iter().zip(&recvs) {
        rank.comm.synchronize(&rank.stream).expect("synchronize");
        assert_bytes_eq(
            "ring",
            &recv.to_vec().expect("download"),
            &inputs[(rank.comm.rank() + n - 1) % n],
        );
    }
    sends.clear();
}

#[test]
fn init_all_over_every_device_runs_every_collective_byte_exact() {
    let _gpu = require_gpu!(else return);
    let Some(devices) = devices("init_all_over_every_device_runs_every_collective_byte_exact")
    else {
        return;
    };
    let comms = Communicator::init_all(&devices, &CommConfig::default()).expect("init_all");
    assert_eq!(comms.len(), devices.len());
    for (i, comm) in comms.iter().enumerate() {
        assert_eq!(
            (comm.rank(), comm.size(), comm.device()),
            (i, devices.len(), devices[i])
        );
    }
    let ranks: Vec<Rank<'_>> = comms
        .iter()
        .map(|comm| Rank {
            comm,
            stream: Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream"),
        })
        .collect();
    for len in [1, 1000, 1 << 20, 16 << 20] {
        check_every_collective(&ranks, devices.len(), len);
    }
}

/// In the child process: rank 1 of 2 on device 1, then the same checks as the parent, or (mode
/// `leave`) init and exit without joining the collective.
fn child_main(spec: &str) {
    let mut parts = spec.split(':');
    let (mode, id) = (parts.next().expect("mode"), parts.next().expect("id"));
    let id = UniqueId::from_hex(id).expect("id");
    let comm = Communicator::init_rank(
        2,
        1,
        &id,
        Device::get(1).expect("device 1"),
        &CommConfig::default(),
    )
    .expect("child init");
    if mode == "leave" {
        // Never joins the collective; exits (without finalising) once the parent is waiting.
        std::thread::sleep(Duration::from_secs(1));
        std::process::exit(0);
    }
    let rank = Rank {
        comm: &comm,
        stream: Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream"),
    };
    for len in [1, 1000, 1 << 20, 16 << 20] {
        check_every_collective(std::slice::from_ref(&rank), 2, len);
    }
    drop(rank);
    comm.finalize().expect("rank 1 finalize");
    println!("child rank 1 passed");
}

/// Rank 1's process, its output going to a file rather than a pipe: a pipe nobody reads until
/// the end fills up, blocks the child mid-collective and hangs both ranks.
struct ChildRank {
    child: Child,
    log: PathBuf,
}

fn spawn_child(test: &str, mode: &str, id: &UniqueId) -> ChildRank {
    let log = std::env::temp_dir().join(format!(
        "cuweave-collective-rank1-{}-{mode}.log",
        std::process::id()
    ));
    let file = File::create(&log).expect("rank 1 log");
    let child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, format!("{mode}:{}", id.to_hex()))
        .stdin(Stdio::null())
        .stdout(Stdio::from(file.try_clone().expect("rank 1 log")))
        .stderr(Stdio::from(file))
        .spawn()
        .expect("spawn rank 1");
    ChildRank { child, log }
}

impl ChildRank {
    /// Waits up to `limit` for rank 1 to exit, killing it past that; its exit status (`None`
    /// when it had to be killed) and everything it printed.
    fn finish(mut self, limit: Duration) -> (Option<std::process::ExitStatus>, String) {
        let deadline = Instant::now() + limit;
        let status = loop {
            match self.child.try_wait().expect("rank 1 status") {
                Some(status) => break Some(status),
                None if Instant::now() >= deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break None;
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let _ = std::fs::remove_file(&self.log);
        (status, text)
    }
}

#[test]
fn two_processes_joined_by_init_rank_run_every_collective_byte_exact() {
    const TEST: &str = "two_processes_joined_by_init_rank_run_every_collective_byte_exact";
    if let Ok(spec) = std::env::var(CHILD_VAR) {
        if spec.starts_with("join:") {
            child_main(&spec);
        }
        return;
    }
    let _gpu = require_gpu!(else return);
    let Some(devices) = devices(TEST) else { return };
    let id = UniqueId::new().expect("id");
    let child = spawn_child(TEST, "join", &id);
    let comm = Communicator::init_rank(2, 0, &id, devices[0], &CommConfig::default())
        .expect("parent init");
    let rank = Rank {
        comm: &comm,
        stream: Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream"),
    };
    for len in [1, 1000, 1 << 20, 16 << 20] {
        check_every_collective(std::slice::from_ref(&rank), 2, len);
    }
    // Rank 1's finalize waits for this rank's (NCCL tears a communicator down with its peers):
    // finalize here before waiting for rank 1's process to exit, or both wait out the timeout.
    drop(rank);
    comm.finalize().expect("rank 0 finalize");
    let (status, text) = child.finish(Duration::from_secs(120));
    assert!(
        status.is_some_and(|status| status.success()) && text.contains("child rank 1 passed"),
        "rank 1 ({status:?}):\n{text}"
    );
}

#[test]
fn a_rank_that_never_joins_is_a_typed_timeout_and_the_communicator_is_aborted() {
    const TEST: &str = "a_rank_that_never_joins_is_a_typed_timeout_and_the_communicator_is_aborted";
    if let Ok(spec) = std::env::var(CHILD_VAR) {
        if spec.starts_with("leave:") {
            child_main(&spec);
        }
        return;
    }
    let _gpu = require_gpu!(else return);
    let Some(devices) = devices(TEST) else { return };
    let id = UniqueId::new().expect("id");
    let child = spawn_child(TEST, "leave", &id);
    let config = CommConfig::default().with_timeout(Duration::from_secs(5));
    let comm = Communicator::init_rank(2, 0, &id, devices[0], &config).expect("parent init");
    let stream = Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream");
    let mut buffer =
        DeviceBuffer::from_slice(comm.context(), &pattern::<f32>(1 << 20, 1)).expect("upload");
    let started = Instant::now();
    // NCCL connects a rank to its peers on its first collective (runtime connection), so the
    // call itself may wait for rank 1 and time out; where it queues, the wait times out.
    let error = comm
        .all_reduce_in_place(&mut buffer, ReduceOp::Sum, &stream)
        .and_then(|()| comm.synchronize(&stream))
        .expect_err("rank 1 never joins");
    eprintln!("lonely all_reduce: {error} after {:?}", started.elapsed());
    assert!(
        error.is_timeout() || error.nccl_code().is_some(),
        "a timeout, or NCCL's asynchronous error once the peer's exit is noticed: {error}"
    );
    assert!(comm.is_aborted());
    assert!(started.elapsed() < Duration::from_secs(30));
    // Rank 1 left mid-collective on purpose; whether its exit completes is NCCL's business, so
    // it gets a few seconds and is then killed rather than waited for without end.
    let _ = child.finish(Duration::from_secs(10));
}

/// `init_all` over the first two devices, with `timeout`.
/// Runs `body` on a thread of its own and fails the test, naming the last step `body` noted,
/// when it has not finished within `limit`: a call that never returns (in NCCL or the driver)
/// then fails this test with where it stopped, instead of hanging the binary until the run's
/// limit kills it and loses every test's output.
fn within_limit(limit: Duration, body: impl FnOnce(&Steps) + Send + 'static) {
    let steps = Steps::default();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn({
        let steps = steps.clone();
        move || {
            body(&steps);
            let _ = done_tx.send(());
        }
    });
    match done_rx.recv_timeout(limit) {
        Ok(()) => worker.join().expect("test body"),
        // The body panicked: re-raise its panic here.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!(
            "still running after {limit:?}; the last step begun: {}",
            steps.last()
        ),
    }
}

/// The last step a bounded test body began (see [`within_limit`]).
#[derive(Clone, Default)]
struct Steps(std::sync::Arc<std::sync::Mutex<String>>);

impl Steps {
    fn begin(&self, step: impl Into<String>) {
        let step = step.into();
        eprintln!("step: {step}");
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = step;
    }

    fn last(&self) -> String {
        let last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_empty() {
            "none".to_owned()
        } else {
            last.clone()
        }
    }
}

fn two_ranks(devices: &[Device], timeout: Duration) -> Vec<Communicator> {
    Communicator::init_all(&devices[..2], &CommConfig::default().with_timeout(timeout))
        .expect("init_all over two devices")
}

#[test]
fn an_abort_from_another_thread_ends_a_collective_whose_peer_never_calls() {
    const TEST: &str = "an_abort_from_another_thread_ends_a_collective_whose_peer_never_calls";
    let _gpu = require_gpu!(else return);
    let Some(devices) = devices(TEST) else { return };
    let comms = two_ranks(&devices, Duration::from_secs(120));
    let comm = comms[0].clone();
    let stuck = std::thread::spawn({
        let comm = comm.clone();
        move || {
            let stream = Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream");
            let send = DeviceBuffer::from_slice(comm.context(), &pattern::<f32>(1 << 20, 1))
                .expect("upload");
            let mut recv = DeviceBuffer::<f32>::zeroed(comm.context(), 1 << 20).expect("recv");
            let started = Instant::now();
            // Rank 1 never calls: the call (or the wait behind it) only ends by the abort.
            let result = comm
                .all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)
                .and_then(|()| comm.synchronize(&stream));
            (result, started.elapsed())
        }
    });
    // The watchdog: while rank 0's thread is in its call, every query returns at once.
    let idle = Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream");
    let watching = Instant::now();
    while watching.elapsed() < Duration::from_secs(2) {
        let asked = Instant::now();
        assert!(!comm.is_aborted());
        comm.check_async_error().expect("healthy while waiting");
        comm.synchronize_within(&idle, Duration::from_secs(1))
            .expect("an idle stream is done");
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "queries wait for the call in progress: {:?}",
            asked.elapsed()
        );
    }
    let aborting = Instant::now();
    comm.abort();
    assert!(
        aborting.elapsed() < Duration::from_secs(10),
        "{:?}",
        aborting.elapsed()
    );
    assert!(comm.is_aborted());
    let (result, waited) = stuck.join().expect("thread");
    eprintln!("stuck rank 0: {result:?} after {waited:?}");
    let error = result.expect_err("the abort ends it");
    assert!(
        !error.is_timeout(),
        "ended by the abort, not its deadline: {error}"
    );
    assert!(waited < Duration::from_secs(30), "{waited:?}");
    comms[1].abort();
}

#[test]
fn a_lonely_all_reduce_records_its_uses_whatever_it_returns() {
    const TEST: &str = "a_lonely_all_reduce_records_its_uses_whatever_it_returns";
    let _gpu = require_gpu!(else return);
    let Some(devices) = devices(TEST) else { return };
    let comms = two_ranks(&devices, Duration::from_secs(3));
    let comm = &comms[0];
    let stream = Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream");
    let send =
        DeviceBuffer::from_slice(comm.context(), &pattern::<f32>(1 << 20, 1)).expect("upload");
    let mut recv = DeviceBuffer::<f32>::zeroed(comm.context(), 1 << 20).expect("recv");
    let result = comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream);
    eprintln!("lonely all_reduce: {result:?}");
    let handle = Some(stream.as_raw() as usize);
    assert_eq!(send.last_use(), handle, "the read is recorded: {result:?}");
    assert_eq!(recv.last_use(), handle, "the write is recorded: {result:?}");
    match result {
        Err(error) => {
            assert!(error.is_timeout() || error.nccl_code().is_some(), "{error}");
            assert!(comm.is_aborted());
        }
        Ok(()) => {
            let error = comm.synchronize(&stream).expect_err("rank 1 never calls");
            assert!(error.is_timeout() || error.nccl_code().is_some(), "{error}");
        }
    }
    // The abort drained the stream, so the recorded write completes and the block is freed.
    drop(recv);
    stream.synchronize().expect("drained");
    comms[1].abort();
}

#[test]
fn a_failed_group_settles_or_aborts_every_communicator_and_records_every_use() {
    const TEST: &str = "a_failed_group_settles_or_aborts_every_communicator_and_records_every_use";
    let _gpu = require_gpu!(else return);
    let Some(devices) = devices(TEST) else { return };
    within_limit(Duration::from_secs(90), move |steps| {
        steps.begin("init_all twice");
        let (a, b) = (
            two_ranks(&devices, Duration::from_secs(3)),
            two_ranks(&devices, Duration::from_secs(3)),
        );
        let context = a[0].context();
        let stream = Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream");
        let sends: Vec<DeviceBuffer<f32>> = (0..2)
            .map(|i| DeviceBuffer::from_slice(context, &pattern::<f32>(4096, i)).expect("upload"))
            .collect();
        let mut recvs: Vec<DeviceBuffer<f32>> = (0..2)
            .map(|_| DeviceBuffer::<f32>::zeroed(context, 4096).expect("recv"))
            .collect();
        steps.begin("the lonely group's launch");
        let result = {
            let mut group = Group::new();
            let (ra, rb) = recvs.split_at_mut(1);
            // Rank 0 of two communicators in one group; neither rank 1 ever calls.
            group
                .all_reduce(&a[0], &sends[0], &mut ra[0], ReduceOp::Sum, &stream)
                .expect("add");
            group
                .all_reduce(&b[0], &sends[1], &mut rb[0], ReduceOp::Sum, &stream)
                .expect("add");
            group.launch()
        };
        steps.begin(format!("checks after the launch: {result:?}"));
        let handle = Some(stream.as_raw() as usize);
        for buffer in sends.iter().chain(&recvs) {
            assert_eq!(
                buffer.last_use(),
                handle,
                "every use is recorded: {result:?}"
            );
        }
        match result {
            Err(error) => {
                assert!(error.is_timeout() || error.nccl_code().is_some(), "{error}");
                assert!(
                    a[0].is_aborted() && b[0].is_aborted(),
                    "neither is left unsettled"
                );
            }
            Ok(()) => {
                steps.begin("rank 0's synchronize after an accepted launch");
                let error = a[0].synchronize(&stream).expect_err("rank 1 never calls");
                assert!(error.is_timeout() || error.nccl_code().is_some(), "{error}");
                steps.begin("b's abort");
                b[0].abort();
            }
        }
        steps.begin("the stream's synchronize after the aborts");
        stream.synchronize().expect("drained by the aborts");
        steps.begin("the rank-1 aborts");
        a[1].abort();
        b[1].abort();
        steps.begin("dropping the communicators");
    });
}

#[test]
fn split_all_splits_every_rank_of_init_all_by_parity() {
    const TEST: &str = "split_all_splits_every_rank_of_init_all_by_parity";
    let _gpu = require_gpu!(else return);
    let Some(devices) = devices(TEST) else { return };
    let comms = Communicator::init_all(&devices, &CommConfig::default()).expect("init_all");
    let parents: Vec<&Communicator> = comms.iter().collect();
    let splits: Vec<(Option<u32>, u32)> = (0..comms.len())
        .map(|r| (Some((r % 2) as u32), r as u32))
        .collect();
    let children: Vec<Communicator> = Communicator::split_all(&parents, &splits)
        .expect("split_all")
        .into_iter()
        .map(|child| child.expect("every rank has a colour"))
        .collect();
    let n = comms.len();
    for (r, child) in children.iter().enumerate() {
        let size = if r % 2 == 0 { n.div_ceil(2) } else { n / 2 };
        assert_eq!((child.rank(), child.size()), (r / 2, size), "rank {r}");
    }
    // Every child's ranks all-reduce together, in one group (one thread drives them all).
    let streams: Vec<Stream> = children
        .iter()
        .map(|c| Stream::new(c.context(), StreamFlags::NON_BLOCKING).expect("stream"))
        .collect();
    let mut buffers: Vec<DeviceBuffer<f64>> = children
        .iter()
        .enumerate()
        .map(|(r, c)| DeviceBuffer::from_slice(c.context(), &[r as f64; 64]).expect("upload"))
        .collect();
    {
        let mut group = Group::new();
        for ((child, buffer), stream) in children.iter().zip(&mut buffers).zip(&streams) {
            group
                .all_reduce_in_place(child, buffer, ReduceOp::Sum, stream)
                .expect("add");
        }
        group.launch().expect("launch");
    }
    for (r, ((child, buffer), stream)) in children.iter().zip(&buffers).zip(&streams).enumerate() {
        child.synchronize(stream).expect("synchronize");
        let want: f64 = (0..n).filter(|q| q % 2 == r % 2).map(|q| q as f64).sum();
        assert_bytes_eq(
            "parity sum",
            &buffer.to_vec().expect("download"),
            &[want; 64],
        );
    }
}
