//! `GraphExec::update` keeps what the new graph keeps alive, each value once, and drops an old
//! generation once the launches made before the update have finished: update loops hold a
//! bounded number of values, and never drop one a queued launch still uses.

use std::any::Any;
use std::sync::{Arc, Weak};

use cuweave_driver::graph::KeepAlive;
use cuweave_driver::memory::{self, DeviceAllocation};
use cuweave_driver::{CaptureMode, Graph, GraphExec, InstantiateOptions, Stream, StreamFlags};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const BYTES: usize = 4096;
const MS: u64 = 1_000_000;

/// A graph that fills `out` with `value`, keeping each of `keep` alive.
fn fill_graph(stream: &Stream, out: &DeviceAllocation, value: u8, keep: &[KeepAlive]) -> Graph {
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: `out` holds BYTES and outlives every launch of the graph (the test synchronises
    // the stream before dropping it).
    unsafe { memory::memset_d8_async(out.ptr(), value, BYTES, stream) }.unwrap();
    let mut graph = stream.end_capture().unwrap();
    for value in keep {
        graph.keep_alive(Arc::clone(value));
    }
    graph
}

fn read(out: &DeviceAllocation, context: &cuweave_driver::Context) -> Vec<u8> {
    let mut host = vec![0u8; BYTES];
    // SAFETY: `host` and `out` hold BYTES each.
    unsafe { memory::copy_dtoh(context, host.as_mut_ptr(), out.ptr(), BYTES) }.unwrap();
    host
}

fn buffer(round: u64) -> (KeepAlive, Weak<dyn Any + Send + Sync>) {
    let value: KeepAlive = Arc::new(round);
    let weak = Arc::downgrade(&value);
    (value, weak)
}

#[test]
fn update_loops_hold_a_bounded_number_of_keep_alives() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let out = DeviceAllocation::new(&gpu.context, BYTES).unwrap();
    let pool: KeepAlive = Arc::new("pool");
    let (first, _) = buffer(0);
    let graph = fill_graph(
        &stream,
        &out,
        0,
        &[Arc::clone(&pool), first, Arc::clone(&pool)],
    );
    let mut exec: GraphExec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    // The graph holds its own clones (the pool twice, as given); only the executable's count.
    drop(graph);
    assert_eq!(exec.kept_alive_count(), 2, "the pool is kept once");

    let mut dropped = Vec::new();
    for round in 1..=2000u64 {
        exec.launch(&stream).unwrap();
        let (value, weak) = buffer(round);
        let next = fill_graph(
            &stream,
            &out,
            (round % 251) as u8,
            &[Arc::clone(&pool), value, Arc::clone(&pool)],
        );
        exec.update(&next).unwrap();
        dropped.push(weak);
        if round % 16 == 0 {
            stream.synchronize().unwrap();
        }
        // The current pool and buffer, and at most the 17 generations launched since the
        // last synchronisation.
        assert!(
            exec.kept_alive_count() <= 2 + 17,
            "round {round}: {} kept alive",
            exec.kept_alive_count()
        );
    }
    stream.synchronize().unwrap();
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    let (last, _) = buffer(u64::MAX);
    exec.update(&fill_graph(&stream, &out, 1, &[Arc::clone(&pool), last]))
        .unwrap();
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    // One more update after a finished launch drops everything but the current generation
    // and the one just retired (launched, fence pending until the next update).
    let (final_value, _) = buffer(u64::MAX - 1);
    exec.update(&fill_graph(
        &stream,
        &out,
        2,
        &[Arc::clone(&pool), final_value],
    ))
    .unwrap();
    assert!(exec.kept_alive_count() <= 3);
    let alive = dropped
        .iter()
        .filter(|weak| weak.upgrade().is_some())
        .count();
    assert_eq!(alive, 0, "every old generation was dropped");
    // The pool stayed current through every update, so it was never retired: held once.
    assert_eq!(
        Arc::strong_count(&pool),
        2,
        "ours and the current generation's"
    );
}

#[test]
fn an_old_generation_lives_until_the_launches_before_the_update_have_finished() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let out = DeviceAllocation::new(&gpu.context, BYTES).unwrap();
    let (first, first_weak) = buffer(0);
    let mut exec = fill_graph(&stream, &out, 10, &[first])
        .instantiate(&InstantiateOptions::default())
        .unwrap();

    // The first launch waits behind a 100 ms spin; everything below is queued meanwhile.
    kernels.spin_ns(&stream, 100 * MS).unwrap();
    exec.launch(&stream).unwrap();
    let (second, second_weak) = buffer(1);
    exec.update(&fill_graph(&stream, &out, 20, &[second]))
        .unwrap();
    exec.launch(&stream).unwrap(); // the fence goes behind this one
    let (third, third_weak) = buffer(2);
    exec.update(&fill_graph(&stream, &out, 30, &[third]))
        .unwrap();
    assert!(
        first_weak.upgrade().is_some(),
        "the first generation must stay alive while the launch that uses it is queued, but it was dropped"
    );
    assert!(second_weak.upgrade().is_some());

    stream.synchronize().unwrap();
    assert_eq!(
        read(&out, &gpu.context),
        vec![20u8; BYTES],
        "launches ran in order"
    );
    let (fourth, _) = buffer(3);
    exec.update(&fill_graph(&stream, &out, 40, &[fourth]))
        .unwrap();
    assert!(
        first_weak.upgrade().is_none(),
        "dropped once its launch finished"
    );
    // The second generation was retired behind a launch with no fence yet.
    assert!(second_weak.upgrade().is_some());
    // The third was never launched: dropped at the update that replaced it.
    assert!(third_weak.upgrade().is_none());
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    let (fifth, _) = buffer(4);
    exec.update(&fill_graph(&stream, &out, 50, &[fifth]))
        .unwrap();
    assert!(second_weak.upgrade().is_none());
    assert_eq!(read(&out, &gpu.context), vec![40u8; BYTES]);
}

/// A serving loop that instantiates, launches and drops an executable per request, each
/// keeping a value alive (the buffers its nodes use): every value outlives its launch, none
/// outlives it by more than the next instantiate that finds the launch finished, and what the
/// dropped executables hold stays bounded by the launches in flight, over many requests.
#[test]
fn executables_dropped_mid_launch_hold_their_values_only_while_their_launches_run() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let out = DeviceAllocation::new(&gpu.context, BYTES).unwrap();
    // What earlier tests of this binary left waiting goes at the first instantiate below.
    let mut most = 0;
    let mut weaks = Vec::new();
    for round in 0..3000u64 {
        let (value, weak) = buffer(round);
        let exec = fill_graph(&stream, &out, (round % 251) as u8, &[value])
            .instantiate(&InstantiateOptions::default())
            .unwrap();
        if round == 0 {
            // The first launch waits behind a 50 ms spin: its value must outlive the drop.
            kernels.spin_ns(&stream, 50 * MS).unwrap();
        }
        exec.launch(&stream).unwrap();
        drop(exec);
        if round == 0 {
            assert!(
                weak.upgrade().is_some(),
                "the value was dropped with its executable while the launch was queued"
            );
            assert!(cuweave_driver::graph::held_for_dropped_executables() >= 1);
        }
        weaks.push(weak);
        most = most.max(cuweave_driver::graph::held_for_dropped_executables());
        if round % 100 == 99 {
            stream.synchronize().unwrap();
        }
    }
    stream.synchronize().unwrap();
    // One more instantiate finds every launch finished.
    drop(
        fill_graph(&stream, &out, 0, &[])
            .instantiate(&InstantiateOptions::default())
            .unwrap(),
    );
    assert_eq!(cuweave_driver::graph::held_for_dropped_executables(), 0);
    assert!(
        weaks.iter().all(|weak| weak.upgrade().is_none()),
        "a dropped executable's value outlived its finished launch for good"
    );
    // At most the requests queued since the last synchronisation (plus the spun first one).
    assert!(
        most <= 101,
        "{most} values held for dropped executables at once"
    );
    assert_eq!(read(&out, &gpu.context), vec![(2999 % 251) as u8; BYTES]);
}

#[test]
fn an_update_from_another_devices_graph_is_refused_and_leaves_the_executable_as_it_was() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let devices = cuweave_driver::Device::count().unwrap();
    if devices < 2 {
        cuweave_test_support::skip(
            "an_update_from_another_devices_graph_is_refused_and_leaves_the_executable_as_it_was",
            &format!("needs two GPUs, this machine has {devices}"),
        );
        return;
    }
    let other_device = cuweave_driver::Device::get(1).unwrap();
    let other = cuweave_driver::Context::primary(other_device).unwrap();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let other_stream = Stream::new(&other, StreamFlags::NON_BLOCKING).unwrap();
    let out = DeviceAllocation::new(&gpu.context, BYTES).unwrap();
    let other_out = DeviceAllocation::new(&other, BYTES).unwrap();
    let mut exec = fill_graph(&stream, &out, 7, &[])
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    let foreign = fill_graph(&other_stream, &other_out, 9, &[]);
    let error = exec.update(&foreign).unwrap_err();
    assert!(
        matches!(error, cuweave_driver::DriverError::InvalidArgument { .. }),
        "{error}"
    );
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(read(&out, &gpu.context), vec![7; BYTES]);
}
