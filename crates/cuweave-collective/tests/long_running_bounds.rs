//! Long-running bounds of the collective layer under a communicator made and dropped per job,
//! what an elastic job or a server that re-forms its group makes over days.
//!
//! The layer keeps no registry keyed by communicator (`comm.rs`: each `Communicator` owns its
//! `CommInner`; the buffers' use trackers and the event pool are the memory and driver layers',
//! bounded and tested there, and `one_rank.rs` runs 10^5 collectives on one communicator). What a
//! communicator holds lives in NCCL: its proxy threads and device memory, released by
//! `ncclCommFinalize` / `ncclCommDestroy` when the last handle drops. This file asserts that,
//! through the process's thread count (`/proc/self/task`, Linux only) and the device's free
//! memory (`Context::memory_info`). NCCL's init costs tens to hundreds of milliseconds, so the
//! loop runs as many rounds as fit in a few seconds (at least 12), not thousands.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use cuweave_collective::{CommConfig, ReduceOp};
use cuweave_memory::{Buffer, DeviceBuffer};

/// Structure: a communicator's NCCL resources (proxy threads, device buffers) behind
/// `CommInner`, released by its `Drop`. Loop: a job makes a 1-rank communicator, all-reduces a
/// buffer in place on a new stream, checks it, and drops the communicator; at least 12 rounds,
/// up to 8 seconds. Expected bound: threads and device memory come back to where they were
/// after the first rounds.
#[test]
#[cfg(target_os = "linux")]
fn a_communicator_per_job_releases_its_threads_and_device_memory() {
    let (gpu, _serial) = gate!();
    const WARMUP: usize = 2;
    const MIN_ROUNDS: usize = 12;
    let budget = Duration::from_secs(8);
    let started = Instant::now();
    let mut baseline = None;
    let mut rounds = 0;
    while rounds < MIN_ROUNDS || (started.elapsed() < budget && rounds < 200) {
        let comm = common::own_comm(&CommConfig::default());
        let stream = common::stream(comm.context());
        let values: Vec<i32> = (0..4096).map(|i| i * 3 + rounds as i32).collect();
        let mut buffer = DeviceBuffer::from_slice(comm.context(), &values).expect("upload");
        comm.all_reduce_in_place(&mut buffer, ReduceOp::Sum, &stream)
            .expect("all_reduce_in_place");
        comm.synchronize(&stream).expect("synchronize");
        assert_eq!(
            buffer.to_vec().expect("download"),
            values,
            "round {rounds}: a 1-rank sum changed the values"
        );
        drop(buffer);
        drop(stream);
        drop(comm);
        rounds += 1;
        if rounds == WARMUP {
            baseline = Some((
                cuweave_test_support::process_threads(),
                gpu.context.memory_info().expect("memory info").free,
            ));
        }
    }
    let (threads_before, free_before) = baseline.expect("warmed up");
    // NCCL's proxy threads may take a moment to go after the destroy.
    cuweave_test_support::poll_until(Duration::from_secs(5), || {
        cuweave_test_support::process_threads() <= threads_before + 2
    });
    let threads_after = cuweave_test_support::process_threads();
    let free_after = gpu.context.memory_info().expect("memory info").free;
    assert!(
        threads_after <= threads_before + 2,
        "{threads_before} threads after {WARMUP} communicators, {threads_after} after {rounds}"
    );
    assert!(
        free_after + (64 << 20) >= free_before,
        "device free memory fell from {free_before} to {free_after} bytes over {rounds} \
         communicators"
    );
}
