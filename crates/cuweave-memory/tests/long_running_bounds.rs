//! Long-running bounds of the memory layer's registries, under the loops a server that runs for
//! days makes: a new stream per request, a long-lived buffer read on each request's new stream,
//! `record_stream` of a long-lived block on each request's new stream.
//!
//! Each test runs its loop thousands of times and asserts the public figure that shows the
//! structure's size (`MemoryStats::reserved_bytes`, `Buffer::tracked_uses`,
//! `Buffer::concurrent_readers`, `CachedAllocation::recorded_streams`, and whether dropped streams
//! are still alive). Each takes a few seconds at most on an H200.
//!
//! Expected on the GPU (from reading the source, not yet run): the first and the third assert a
//! bound the source does not have (see each test's comment); they are there to show it.

use std::sync::{Arc, Weak};

use cuweave_driver::{Stream, StreamFlags};
use cuweave_memory::{Buffer, CachingAllocator};
use cuweave_test_support::{require_gpu, serial};

const REQUESTS: usize = 2000;
const MIB: usize = 1 << 20;

fn new_stream(gpu: &cuweave_test_support::Gpu) -> Stream {
    Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("stream")
}

/// Structure: the caching allocator's per-stream free lists (`caching/free_list.rs`,
/// `FreeLists::slots` and the segments behind them), keyed by `Stream::id`, which is never
/// reused. Loop: a request makes its own stream, allocates a small buffer on it, uses it, frees
/// it and drops the stream, 2000 times.
///
/// A block freed on a stream is handed out again only on that stream, so the 2 MiB small
/// segment each new stream made stays cached on a stream that no longer exists; only an
/// out-of-memory retry or `empty_cache` releases it. Expected bound: the reserve a single
/// request needs, not one segment per request ever served.
#[test]
fn a_stream_per_request_does_not_grow_the_caching_reserve() {
    let gpu = require_gpu!();
    let _serial = serial();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let mut most_reserved = 0;
    for request in 0..REQUESTS {
        let stream = new_stream(&gpu);
        let mut buffer = allocator
            .buffer::<u32>(1024, &stream)
            .expect("request buffer");
        buffer
            .fill_async(request as u32, &stream)
            .expect("fill on the request's stream");
        if request % 250 == 0 {
            assert_eq!(
                buffer.to_vec().expect("read"),
                vec![request as u32; 1024],
                "request {request}"
            );
        }
        stream.synchronize().expect("sync");
        drop(buffer);
        drop(stream);
        most_reserved = most_reserved.max(allocator.stats().reserved_bytes.current);
    }
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, 0, "every buffer was freed");
    assert!(
        most_reserved <= 64 * MIB,
        "after {REQUESTS} requests each on its own (dropped) stream the cache reserves \
         {most_reserved} bytes at most, {} now, in {} segments: free segments of dead streams \
         are never reused",
        stats.reserved_bytes.current,
        stats.segments.current
    );
}

/// Structure: a typed buffer's use tracker (`buffer/uses.rs`: reads per stream, pruned past
/// `PRUNE_READS_AT`, all uses merged past `MAX_USES`). Loop: a long-lived "weights" buffer is read
/// by every request on the request's own new stream, eight requests in flight at a time, 3000
/// requests; the streams are dropped after each batch.
#[test]
fn a_long_lived_buffer_read_on_a_new_stream_per_request_keeps_its_tracker_bounded() {
    let gpu = require_gpu!();
    let _serial = serial();
    const LEN: usize = 4096;
    const IN_FLIGHT: usize = 8;
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let main = new_stream(&gpu);
    let mut weights = allocator.buffer::<u32>(LEN, &main).expect("weights");
    weights.fill_async(0x5EED, &main).expect("fill weights");
    let mut most_tracked = 0;
    let mut most_readers = 0;
    let mut streams_alive: Vec<Weak<Stream>> = Vec::new();
    for batch in 0..3000 / IN_FLIGHT {
        let streams: Vec<Arc<Stream>> =
            (0..IN_FLIGHT).map(|_| Arc::new(new_stream(&gpu))).collect();
        let pending: Vec<_> = streams
            .iter()
            .map(|stream| {
                weights
                    .copy_to_host_async(vec![0u32; LEN], stream)
                    .expect("read on the request's stream")
            })
            .collect();
        most_tracked = most_tracked.max(weights.tracked_uses());
        most_readers = most_readers.max(weights.concurrent_readers());
        for host in pending {
            let host = host.wait().expect("downloaded");
            assert!(
                host.iter().all(|&x| x == 0x5EED),
                "batch {batch}: a read saw other bytes"
            );
        }
        if batch % 50 == 0 {
            streams_alive.extend(streams.iter().map(Arc::downgrade));
        }
    }
    assert!(
        most_tracked <= 32,
        "{most_tracked} uses tracked at once for one buffer"
    );
    assert!(
        most_readers <= 2 * IN_FLIGHT,
        "{most_readers} concurrent readers remembered with {IN_FLIGHT} reads in flight"
    );
    assert!(
        streams_alive.iter().all(|weak| weak.upgrade().is_none()),
        "the buffer keeps dropped streams alive"
    );
    // A write still orders after every read, and the buffer reads back whole.
    weights.fill_async(1, &main).expect("write after the reads");
    assert_eq!(weights.to_vec().expect("read"), vec![1u32; LEN]);
}

/// Structure: `CachedAllocation::record_stream`'s list of streams (`caching/allocation.rs`,
/// `uses: Vec<Arc<Stream>>`), kept until the allocation is freed. Loop: a long-lived block (a
/// model's weights, a KV cache) is read by each request on the request's own new stream and
/// recorded there, as PyTorch's `record_stream` is used, 2000 times.
///
/// Every recorded stream is held (its CUDA stream not destroyed) until the block is freed, and
/// the list only grows. Expected bound: streams whose work has finished, and which nobody else
/// holds, are let go.
#[test]
fn record_stream_on_a_new_stream_per_request_does_not_keep_every_stream() {
    let gpu = require_gpu!();
    let _serial = serial();
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let main = new_stream(&gpu);
    let mut block = allocator.allocate(MIB, &main).expect("long-lived block");
    main.synchronize().expect("sync");
    let mut dropped: Vec<Weak<Stream>> = Vec::with_capacity(REQUESTS);
    for _ in 0..REQUESTS {
        let reader = Arc::new(new_stream(&gpu));
        reader
            .wait_stream(&main)
            .expect("reader after the block's writer");
        block.record_stream(&reader).expect("record the reader");
        reader.synchronize().expect("the request's work finished");
        dropped.push(Arc::downgrade(&reader));
    }
    let recorded = block.recorded_streams().len();
    let alive = dropped
        .iter()
        .filter(|weak| weak.upgrade().is_some())
        .count();
    drop(block);
    assert!(
        recorded <= 64 && alive <= 64,
        "after {REQUESTS} requests the long-lived block records {recorded} streams and keeps \
         {alive} dropped streams alive"
    );
    // Freeing it lets them all go.
    assert!(dropped.iter().all(|weak| weak.upgrade().is_none()));
}
