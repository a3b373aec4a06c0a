//! The sharded caching allocator under load on a real GPU: sixteen threads, each on its own
//! stream, free blocks that another thread's stream is still reading (recorded with
//! `record_stream`) and keep allocating and filling the same size meanwhile; a watch kernel on
//! the reading stream counts every element that changed under it, and must count none.

use std::sync::{Arc, Barrier};

use cuweave_driver::memory::DeviceAllocation;
use cuweave_driver::{Context, Event, EventFlags, Stream, StreamFlags};
use cuweave_memory::caching::CachingAllocator;
mod common;

use common::{counter, read_u32};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

const MIB: usize = 1 << 20;
const THREADS: usize = 16;
const ROUNDS: u32 = 3;
/// How long each watch kernel reads a freed block.
const WATCH_NS: u64 = 20_000_000;

fn stream(context: &Arc<Context>) -> Arc<Stream> {
    Arc::new(Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream"))
}

#[test]
fn sixteen_threads_never_get_a_block_back_while_another_threads_stream_reads_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = gpu.context.clone();
    let allocator = CachingAllocator::with_driver(&context);
    let kernels = Arc::new(TestKernels::load(&context).expect("load test kernels"));
    let streams: Vec<Arc<Stream>> = (0..THREADS).map(|_| stream(&context)).collect();
    let counters: Vec<DeviceAllocation> = (0..THREADS).map(|_| counter(&context)).collect();
    let counter_ptrs: Vec<u64> = counters.iter().map(DeviceAllocation::ptr).collect();
    let start = Arc::new(Barrier::new(THREADS));
    let n = MIB / 4;

    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (allocator, kernels, start) = (allocator.clone(), kernels.clone(), start.clone());
            let own = streams[thread].clone();
            let reader = streams[(thread + 1) % THREADS].clone();
            let mismatches = counter_ptrs[thread];
            let context = context.clone();
            std::thread::spawn(move || {
                start.wait();
                let mut early_reuses = 0u32;
                let mut reallocations = 0u32;
                for round in 0..ROUNDS {
                    let tag = 0x1000_0000 | ((thread as u32) << 8) | round;
                    let mut block = allocator.allocate(MIB, &own).unwrap();
                    let filled = Event::new(&context, EventFlags::DISABLE_TIMING).unwrap();
                    let watched = Event::new(&context, EventFlags::DISABLE_TIMING).unwrap();
                    // SAFETY: `block` holds n u32s; it stays out of reuse until the watch on
                    // `reader` has finished (recorded below), and `mismatches` outlives the
                    // test's final synchronisation.
                    unsafe {
                        kernels.fill_u32(&own, block.ptr(), tag, n).unwrap();
                        filled.record(&own).unwrap();
                        reader.wait_event(&filled).unwrap();
                        kernels
                            .watch_u32(&reader, block.ptr(), n, tag, WATCH_NS, mismatches)
                            .unwrap();
                    }
                    watched.record(&reader).unwrap();
                    block.record_stream(&reader).unwrap();
                    let old = block.ptr();
                    drop(block);
                    // Keep allocating the same size on our own stream, writing something else,
                    // for as long as the watch runs.
                    loop {
                        let again = allocator.allocate(MIB, &own).unwrap();
                        if again.ptr() == old {
                            reallocations += 1;
                            // Handed out again: allowed only once the watch has finished, which
                            // its event (recorded before the free) must show.
                            if !watched.query().unwrap() {
                                early_reuses += 1;
                            }
                        }
                        // SAFETY: `again` holds n u32s until its free below, which is in `own`'s
                        // order after this fill.
                        unsafe { kernels.fill_u32(&own, again.ptr(), !tag, n).unwrap() };
                        drop(again);
                        own.synchronize().unwrap();
                        if watched.query().unwrap() {
                            break;
                        }
                    }
                }
                (early_reuses, reallocations)
            })
        })
        .collect();
    let mut reallocations = 0;
    for thread in threads {
        let (early, again) = thread.join().expect("thread");
        assert_eq!(
            early, 0,
            "a block came back while its watch was still running"
        );
        reallocations += again;
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    let total: u32 = counter_ptrs
        .iter()
        .map(|&ptr| read_u32(&context, ptr))
        .sum();
    assert_eq!(total, 0, "no watch kernel saw its block change under it");
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(stats.allocations, stats.frees);
    eprintln!(
        "{THREADS} threads: {} allocations, {reallocations} blocks handed out again after their \
         watch, {} cache misses",
        stats.allocations, stats.cache_misses
    );
}
