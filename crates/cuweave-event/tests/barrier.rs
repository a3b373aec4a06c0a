//! GPU tests of the cross-stream barrier, with spin kernels of different lengths and flags.

mod common;

use std::time::Duration;

use common::{Flags, MS};
use cuweave_event::{CrossStreamBarrier, EventError, EventPool};
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

const STREAMS: usize = 3;

/// Stream `i` spins `(i + 1) * 10` ms then sets flag `i`; then, with or without a barrier,
/// each stream counts the flags set. Returns the counts.
fn run(barrier_on: bool) -> ([u32; STREAMS], Duration, Duration) {
    let gpu = cuweave_test_support::gpu("barrier").unwrap();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let streams: Vec<_> = (0..STREAMS).map(|_| common::stream(&gpu.context)).collect();
    let barrier =
        CrossStreamBarrier::new(streams.clone(), EventPool::new(&gpu.context, 8, 0).unwrap())
            .unwrap();
    let flags = Flags::new(&gpu.context, STREAMS);
    let counts = Flags::new(&gpu.context, STREAMS);
    for (i, stream) in streams.iter().enumerate() {
        // SAFETY: mapped memory of this context, alive until the streams are synchronized.
        unsafe {
            kernels
                .spin_then_store_u32(stream, (i as u64 + 1) * 10 * MS, flags.device(i), 1)
                .unwrap()
        };
    }
    let queued = if barrier_on {
        barrier.wait_on_device().unwrap()
    } else {
        Duration::ZERO
    };
    for (i, stream) in streams.iter().enumerate() {
        // SAFETY: as above.
        unsafe {
            event_kernels
                .count_flags_u32(stream, flags.device(0), STREAMS, 1, counts.device(i))
                .unwrap()
        };
    }
    let waited = barrier.synchronize().unwrap();
    (
        [counts.read(0), counts.read(1), counts.read(2)],
        queued,
        waited,
    )
}

#[test]
fn after_the_device_barrier_every_stream_sees_every_flag() {
    let _gpu = require_gpu!();
    let _serial = serial();
    let (counts, queued, waited) = run(true);
    assert_eq!(counts, [STREAMS as u32; STREAMS]);
    assert!(
        queued < Duration::from_millis(5),
        "the barrier blocked the host for {queued:?}"
    );
    assert!(
        waited >= Duration::from_millis(20),
        "synchronize returned after {waited:?}"
    );
}

#[test]
fn without_the_barrier_the_short_stream_runs_ahead() {
    let _gpu = require_gpu!();
    let _serial = serial();
    let (counts, _, _) = run(false);
    assert!(
        counts[0] < STREAMS as u32,
        "the control run saw every flag: {counts:?}"
    );
}

#[test]
fn a_barrier_needs_streams_of_the_pool_context() {
    let gpu = require_gpu!();
    let pool = EventPool::new(&gpu.context, 0, 0).unwrap();
    assert!(matches!(
        CrossStreamBarrier::new(Vec::new(), pool),
        Err(EventError::InvalidArgument { .. })
    ));
}
