//! GPU tests: a pinned-pool buffer that a stream capture used is not handed out again after it
//! drops while the graph made from the capture may replay with the block's address: never, for a
//! capture no graph pool was bound to; until the graph pool dies, for one bound to a pool.

use std::sync::{Mutex, MutexGuard, PoisonError};

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::{InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::buffer::{Buffer, DeviceBuffer};
use cuweave_memory::caching::{GraphPool, MissPolicy, begin_allocate_to_pool};
use cuweave_memory::pinned_pool::PinnedPool;
use cuweave_test_support::require_gpu;

const LEN: usize = 1 << 16;

/// Serializes this file's tests: a capture active in one holds back the other's returns (held
/// memory is returned only while no capture is active anywhere).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}
const SENTINEL: u8 = 0xab;

#[test]
fn pinned_pool_buffer_used_in_a_capture_is_not_reused_while_its_graph_lives() {
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let pool = PinnedPool::new(ctx);
    let stream = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
    let mut device = DeviceBuffer::<f32>::new(ctx, LEN).unwrap();
    device.fill(1.5).unwrap();

    let mut staging = pool.buffer::<f32>(LEN).unwrap();
    let address = staging.as_host_ptr() as usize;
    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    staging.copy_from_async(&device, &stream).unwrap();
    let graph = stream.end_capture().unwrap();
    assert!(graph.node_count().unwrap() >= 1, "the copy was captured");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    drop(staging);
    assert_eq!(pool.stats().pending_blocks, 1, "{:?}", pool.stats());

    // The same size class again, typed and untyped: never the captured block.
    let mut other = pool.get(LEN * 4).unwrap();
    assert_ne!(
        other.as_slice().as_ptr() as usize,
        address,
        "the pool handed out the block a live graph still writes"
    );
    let typed = pool.buffer::<f32>(LEN).unwrap();
    assert_ne!(typed.as_host_ptr() as usize, address);
    drop(typed);
    other.as_mut_slice().fill(SENTINEL);

    // Replays write the captured block, and nothing the pool handed out since.
    for _ in 0..3 {
        exec.launch(&stream).unwrap();
    }
    stream.synchronize().unwrap();
    assert!(
        other.as_slice().iter().all(|&byte| byte == SENTINEL),
        "a replay wrote memory the pool handed to someone else"
    );
    drop(other);
    pool.trim();
    assert_eq!(
        pool.stats().pending_blocks,
        1,
        "trim leaves the captured block alone: {:?}",
        pool.stats()
    );
    drop(exec);
    drop(graph);
}

#[test]
fn pinned_pool_buffers_of_recaptured_graphs_come_back_when_their_graph_pools_die() {
    // A serving loop that recaptures its graph with a pinned staging buffer each round: the
    // block the capture used is held while the graph (its pool) lives, and returns to the pinned
    // pool when the graph goes, so pinned memory stays at one block however many rounds run.
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let pinned = PinnedPool::new(ctx);
    let stream = Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap();
    let mut device = DeviceBuffer::<f32>::new(ctx, LEN).unwrap();
    let mut address = None;
    for round in 0..20u16 {
        device.fill(f32::from(round)).unwrap();
        let graphs = GraphPool::new();
        let mut staging = pinned.buffer::<f32>(LEN).unwrap();
        let here = staging.as_host_ptr() as usize;
        assert_eq!(
            *address.get_or_insert(here),
            here,
            "round {round} pinned a new block"
        );
        stream
            .begin_capture_synchronized(CaptureMode::ThreadLocal)
            .unwrap();
        let routed = begin_allocate_to_pool(&stream, &graphs, MissPolicy::default()).unwrap();
        staging.copy_from_async(&device, &stream).unwrap();
        let mut graph = stream.end_capture().unwrap();
        drop(routed);
        graph.keep_alive(graphs.keep_alive());
        drop(graphs);
        let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
        exec.launch(&stream).unwrap();
        stream.synchronize().unwrap();
        assert!(
            staging
                .as_slice()
                .unwrap()
                .iter()
                .all(|&x| x == f32::from(round)),
            "the replay wrote the staging block"
        );
        drop(staging);
        assert_eq!(
            pinned.stats().pending_blocks,
            1,
            "held while the graph lives: {:?}",
            pinned.stats()
        );
        let other = pinned.get(LEN * 4).unwrap();
        assert_ne!(
            other.as_slice().as_ptr() as usize,
            here,
            "a live graph's block was reused"
        );
        drop(other);
        drop(exec);
        drop(graph);
        assert_eq!(
            pinned.stats().pending_blocks,
            0,
            "returned when the graph's pool died: {:?}",
            pinned.stats()
        );
    }
    let stats = pinned.stats();
    assert_eq!(
        stats.pinned_bytes,
        2 * LEN * 4,
        "the staging block and the one other block, every round: {stats:?}"
    );
}
