//! GPU test: a pinned-pool buffer that a stream capture used is never handed out again after it
//! drops, since the graph made from the capture replays with the block's address (docs/graphs.md:
//! "never reused ... until the pool goes away").

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::{InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::buffer::{Buffer, DeviceBuffer};
use cuweave_memory::pinned_pool::PinnedPool;
use cuweave_test_support::require_gpu;

const LEN: usize = 1 << 16;
const SENTINEL: u8 = 0xab;

#[test]
fn pinned_pool_buffer_used_in_a_capture_is_not_reused_while_its_graph_lives() {
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
