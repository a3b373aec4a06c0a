//! NCCL all-reduce through cuweave against the raw `ncclAllReduce` through the same loaded
//! library, on one communicator, one stream and the same buffers, in one run.
//!
//! | case | what it does |
//! |---|---|
//! | `all_reduce/raw/BYTES` | `ncclAllReduce` (f32, sum, out of place) on the communicator's handle, then `cuStreamSynchronize` |
//! | `all_reduce/cuweave/BYTES` | `Communicator::all_reduce` on typed buffers (use tracking included), then `cuStreamSynchronize` |
//!
//! Sizes run from 4 B to 1 GiB. Criterion's throughput is the algorithm bandwidth (bytes /
//! time); after the groups a table gives both cases' mean times, their ratio, and the bus
//! bandwidth as nccl-tests computes it (`algbw × 2 (n − 1) / n`, which is 0 on one rank: one
//! rank moves nothing between GPUs, so its figure to compare is the time).
//!
//! With two or more devices a last table runs the same all-reduce on every device at once
//! (`init_all`, one group per step: raw grouped `ncclAllReduce` beside cuweave's `Group`) and
//! gives both cases' bus bandwidth.
//!
//! Run with `NCCL_NVLS_ENABLE=0 cargo bench -p cuweave-benches --bench collective`. Without a
//! driver or without NCCL it prints one skip line.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Throughput};
use cuweave_collective::sys;
use cuweave_collective::{CommConfig, Communicator, Group, ReduceOp, UniqueId};
use cuweave_driver::memory::DevicePtr;
use cuweave_driver::{Device, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer};

const SIZES: [usize; 9] = [
    4,
    64,
    1 << 10,
    16 << 10,
    256 << 10,
    4 << 20,
    64 << 20,
    256 << 20,
    1 << 30,
];

fn main() {
    cuweave_benches::run("collective", |c, gpu| {
        let nccl = match cuweave_collective::nccl() {
            Ok(nccl) => nccl,
            Err(error) => {
                println!("skipping benches: {error}");
                return;
            }
        };
        println!("NCCL {} from {}", nccl.version(), nccl.path());
        let comm = Communicator::init_rank(
            1,
            0,
            &UniqueId::new().expect("id"),
            gpu.device,
            &CommConfig::default(),
        )
        .expect("1-rank communicator");
        let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("stream");
        let mut table = Vec::new();
        for bytes in SIZES {
            let count = bytes / 4;
            let send = DeviceBuffer::<f32>::zeroed(&gpu.context, count).expect("send");
            let mut recv_view = DeviceBuffer::<f32>::zeroed(&gpu.context, count).expect("recv");
            let (send_ptr, recv_ptr) = (send.device_ptr(), recv_view.device_ptr());
            let raw = |stream: &Stream| raw_all_reduce(&comm, send_ptr, recv_ptr, count, stream);
            let mut group = c.benchmark_group("all_reduce");
            group.throughput(Throughput::Bytes(bytes as u64));
            if bytes >= 64 << 20 {
                cuweave_benches::slow_group(&mut group, Duration::from_secs(2));
            }
            group.bench_function(BenchmarkId::new("raw", bytes), |b| {
                b.iter(|| {
                    raw(&stream);
                    stream.synchronize().expect("sync");
                })
            });
            group.bench_function(BenchmarkId::new("cuweave", bytes), |b| {
                b.iter(|| {
                    comm.all_reduce(black_box(&send), &mut recv_view, ReduceOp::Sum, &stream)
                        .expect("all_reduce");
                    stream.synchronize().expect("sync");
                })
            });
            group.finish();
            // The summary: both cases alternated, so drift hits them alike.
            let reps = if bytes >= 64 << 20 { 20 } else { 2000 };
            let (mut t_raw, mut t_ours) = (Duration::ZERO, Duration::ZERO);
            for _ in 0..reps {
                let start = Instant::now();
                raw(&stream);
                stream.synchronize().expect("sync");
                t_raw += start.elapsed();
                let start = Instant::now();
                comm.all_reduce(&send, &mut recv_view, ReduceOp::Sum, &stream)
                    .expect("all_reduce");
                stream.synchronize().expect("sync");
                t_ours += start.elapsed();
            }
            table.push((bytes, t_raw / reps, t_ours / reps));
        }
        let n = comm.size() as f64;
        println!(
            "\nall_reduce f32 sum, {} rank(s), device {}:",
            comm.size(),
            gpu.device.name().unwrap_or_default()
        );
        println!(
            "{:>12} {:>12} {:>12} {:>8} {:>9} {:>12} {:>12}",
            "bytes", "raw µs", "cuweave µs", "raw/cw", "Δ µs", "algbw GB/s", "busbw GB/s"
        );
        for (bytes, raw, ours) in table {
            let algbw = bytes as f64 / ours.as_secs_f64() / 1e9;
            println!(
                "{bytes:>12} {:>12.2} {:>12.2} {:>8.3} {:>9.2} {:>12.1} {:>12.1}",
                raw.as_secs_f64() * 1e6,
                ours.as_secs_f64() * 1e6,
                raw.as_secs_f64() / ours.as_secs_f64(),
                (ours.as_secs_f64() - raw.as_secs_f64()) * 1e6,
                algbw,
                algbw * 2.0 * (n - 1.0) / n,
            );
        }
        all_devices_summary();
    });
}

/// With two or more devices: one communicator per device (`init_all`), all-reduce of f32 on
/// every rank as one group, raw grouped `ncclAllReduce` beside cuweave's `Group`, alternated.
fn all_devices_summary() {
    let count = Device::count().unwrap_or(0);
    if count < 2 {
        println!("\nall_reduce over several devices: skipped, {count} device(s)");
        return;
    }
    let devices: Vec<Device> = (0..count)
        .map(|ordinal| Device::get(ordinal).expect("device"))
        .collect();
    let comms = Communicator::init_all(&devices, &CommConfig::default()).expect("init_all");
    let n = comms.len() as f64;
    let streams: Vec<Stream> = comms
        .iter()
        .map(|comm| Stream::new(comm.context(), StreamFlags::NON_BLOCKING).expect("stream"))
        .collect();
    println!(
        "\nall_reduce f32 sum, {} ranks in one process (init_all), device {}:",
        comms.len(),
        devices[0].name().unwrap_or_default()
    );
    println!(
        "{:>12} {:>12} {:>12} {:>8} {:>9} {:>12} {:>12}",
        "bytes", "raw µs", "cuweave µs", "raw/cw", "Δ µs", "raw busbw", "cw busbw"
    );
    let api = cuweave_collective::loader::api().expect("nccl");
    let (group_start, group_end) = (
        api.group_start.get().expect("ncclGroupStart"),
        api.group_end.get().expect("ncclGroupEnd"),
    );
    for bytes in SIZES {
        let count = bytes / 4;
        let sends: Vec<DeviceBuffer<f32>> = comms
            .iter()
            .map(|comm| DeviceBuffer::zeroed(comm.context(), count).expect("send"))
            .collect();
        let mut recvs: Vec<DeviceBuffer<f32>> = comms
            .iter()
            .map(|comm| DeviceBuffer::zeroed(comm.context(), count).expect("recv"))
            .collect();
        let raw = |recvs: &[DeviceBuffer<f32>]| {
            // SAFETY: ncclGroupStart takes no arguments.
            assert_eq!(unsafe { group_start() }, sys::ncclResult_t::ncclSuccess);
            for ((comm, send), (recv, stream)) in
                comms.iter().zip(&sends).zip(recvs.iter().zip(&streams))
            {
                raw_all_reduce(comm, send.device_ptr(), recv.device_ptr(), count, stream);
            }
            // SAFETY: closes the group opened above.
            assert_eq!(unsafe { group_end() }, sys::ncclResult_t::ncclSuccess);
            for stream in &streams {
                stream.synchronize().expect("sync");
            }
        };
        let ours = |recvs: &mut [DeviceBuffer<f32>]| {
            let mut group = Group::new();
            for ((comm, send), (recv, stream)) in
                comms.iter().zip(&sends).zip(recvs.iter_mut().zip(&streams))
            {
                group
                    .all_reduce(comm, send, recv, ReduceOp::Sum, stream)
                    .expect("group all_reduce");
            }
            group.launch().expect("group launch");
            for stream in &streams {
                stream.synchronize().expect("sync");
            }
        };
        // Warm up both paths, then alternate so drift hits them alike.
        raw(&recvs);
        ours(&mut recvs);
        let reps = if bytes >= 64 << 20 { 20 } else { 500 };
        let (mut t_raw, mut t_ours) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..reps {
            let start = Instant::now();
            raw(&recvs);
            t_raw += start.elapsed();
            let start = Instant::now();
            ours(&mut recvs);
            t_ours += start.elapsed();
        }
        let (raw_t, ours_t) = (t_raw / reps, t_ours / reps);
        let busbw = |t: Duration| bytes as f64 / t.as_secs_f64() / 1e9 * 2.0 * (n - 1.0) / n;
        println!(
            "{bytes:>12} {:>12.2} {:>12.2} {:>8.3} {:>9.2} {:>12.1} {:>12.1}",
            raw_t.as_secs_f64() * 1e6,
            ours_t.as_secs_f64() * 1e6,
            raw_t.as_secs_f64() / ours_t.as_secs_f64(),
            (ours_t.as_secs_f64() - raw_t.as_secs_f64()) * 1e6,
            busbw(raw_t),
            busbw(ours_t),
        );
    }
}

/// `ncclAllReduce` on the communicator's own handle, through the same loaded library.
fn raw_all_reduce(
    comm: &Communicator,
    send: DevicePtr,
    recv: DevicePtr,
    count: usize,
    stream: &Stream,
) {
    let api = cuweave_collective::loader::api().expect("nccl");
    let all_reduce = api.all_reduce.get().expect("ncclAllReduce");
    let handle = comm.as_raw().expect("live communicator");
    // SAFETY: both addresses are buffers that hold at least `count` f32 on the communicator's device and outlive
    // the call and the synchronize that follows it; the stream is on that device.
    let code = unsafe {
        all_reduce(
            send as usize as *const std::ffi::c_void,
            recv as usize as *mut std::ffi::c_void,
            count,
            sys::ncclDataType_t::ncclFloat32,
            sys::ncclRedOp_t::ncclSum,
            handle,
            stream.as_raw().cast(),
        )
    };
    assert_eq!(code, sys::ncclResult_t::ncclSuccess, "ncclAllReduce");
}
