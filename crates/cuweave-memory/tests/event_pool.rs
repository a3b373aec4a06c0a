//! GPU tests of where the memory layer's events come from: the context's one event pool
//! (`EventPool::for_context`). Buffers made, used on streams and dropped in a loop make no more
//! events than are held at once (the pool's counters say how many it created), a buffer nothing
//! was queued on takes none, and the bytes the loop wrote arrive.
//!
//! The tests take the serial guard, so the pool's counters move only by what each one does
//! (this file is its own test binary: no other crate's tests share its process).

use std::sync::Arc;

use cuweave_driver::{Context, EventPool, Stream, StreamFlags};
use cuweave_memory::buffer::{Buffer, PinnedBuffer};
use cuweave_memory::caching::CachingAllocator;
use cuweave_memory::pinned_pool::PinnedPool;
use cuweave_test_support::{require_gpu, serial};

/// Buffers made, used and dropped per test.
const CYCLES: u32 = 100_000;
/// The streams are synchronized every this many cycles, so at most this many cycles' uses are
/// in flight (and so hold events) at once.
const IN_FLIGHT: u32 = 64;
const WORDS: usize = 1024;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream")
}

fn created(pool: &EventPool) -> u64 {
    let counters = pool.counters();
    counters.created_regular + counters.created_timing + counters.created_blocking
}

#[test]
fn typed_buffers_made_used_and_dropped_create_only_the_events_held_at_once() {
    let gpu = require_gpu!(else return);
    let _serial = serial();
    let context = &gpu.context;
    let events = EventPool::for_context(context).expect("the context's event pool");
    let allocator = CachingAllocator::with_driver(context);
    let (writer, reader) = (stream(context), stream(context));
    let before = created(&events);
    let mut last = Vec::new();
    for cycle in 0..CYCLES {
        let mut buffer = allocator.buffer::<u32>(WORDS, &writer).expect("buffer");
        buffer.fill_async(cycle, &writer).expect("fill_async");
        // A use on a second stream: it waits for the fill, and records an event of its own.
        buffer.record_read(&reader).expect("record_read");
        if cycle == CYCLES - 1 {
            last = buffer.to_vec().expect("read back");
        }
        // Back to the cache behind both uses' events, without waiting.
        drop(buffer);
        if cycle % IN_FLIGHT == IN_FLIGHT - 1 {
            writer.synchronize().expect("synchronize");
            reader.synchronize().expect("synchronize");
        }
    }
    assert_eq!(last, vec![CYCLES - 1; WORDS], "the last fill arrived");
    let made = created(&events) - before;
    // Two events per cycle (the write and the read) for the cycles in flight, plus the one the
    // pool may make while the completed ones wait for the next allocation to poll them.
    let bound = 2 * (u64::from(IN_FLIGHT) + 2);
    assert!(
        made <= bound,
        "{made} events created for {CYCLES} buffers (bound {bound})"
    );
    let stats = allocator.stats();
    assert!(
        stats.segments.peak <= 2,
        "the pending blocks fit the cache: {stats:?}"
    );
    writer.synchronize().expect("synchronize");
    reader.synchronize().expect("synchronize");
    // The next allocation polls the pending blocks: their events go back to the pool.
    drop(allocator.buffer::<u32>(WORDS, &writer).expect("buffer"));
    assert_eq!(allocator.pending_frees(), 0);
    assert_eq!(
        events.utilization().in_use,
        0,
        "every event went back: {:?}",
        events.utilization()
    );
    println!("{CYCLES} typed buffers made, used on two streams and dropped: {made} events created");
}

#[test]
fn an_untouched_buffer_takes_no_event() {
    let gpu = require_gpu!(else return);
    let _serial = serial();
    let context = &gpu.context;
    let events = EventPool::for_context(context).expect("the context's event pool");
    let allocator = CachingAllocator::with_driver(context);
    let on = stream(context);
    let before = created(&events);
    for _ in 0..CYCLES {
        drop(allocator.buffer::<u32>(WORDS, &on).expect("buffer"));
    }
    assert_eq!(created(&events), before, "no event for a buffer never used");
    assert_eq!(events.utilization().in_use, 0);
    let stats = allocator.stats();
    assert_eq!(
        stats.cache_misses, 1,
        "one segment, every other buffer a hit"
    );
    assert_eq!(allocator.pending_frees(), 0);
}

#[test]
fn pinned_pool_buffers_staging_uploads_create_only_the_events_held_at_once() {
    const UPLOADS: u32 = 20_000;
    let gpu = require_gpu!(else return);
    let _serial = serial();
    let context = &gpu.context;
    let events = EventPool::for_context(context).expect("the context's event pool");
    let pool = PinnedPool::new(context);
    let on = stream(context);
    let mut device = CachingAllocator::with_driver(context)
        .buffer::<u32>(WORDS, &on)
        .expect("device buffer");
    let before = created(&events);
    for upload in 0..UPLOADS {
        let mut staging = PinnedBuffer::<u32>::from_pool(&pool, WORDS).expect("from_pool");
        staging
            .as_mut_slice()
            .expect("a fresh block is idle")
            .fill(upload);
        // The upload reads the pinned buffer: its event travels with the block to the pool.
        device.copy_from_async(&staging, &on).expect("upload");
        drop(staging);
        if upload % IN_FLIGHT == IN_FLIGHT - 1 {
            on.synchronize().expect("synchronize");
        }
    }
    assert_eq!(
        device.to_vec().expect("read back"),
        vec![UPLOADS - 1; WORDS]
    );
    let made = created(&events) - before;
    // The pinned side's read per upload in flight, the device buffer's one write event
    // (re-recorded each time), and one the pool may make before a poll returns the others.
    let bound = u64::from(IN_FLIGHT) + 3;
    assert!(
        made <= bound,
        "{made} events created for {UPLOADS} uploads (bound {bound})"
    );
    let stats = pool.stats();
    assert!(
        stats.peak_pinned_bytes <= (IN_FLIGHT as usize + 2) * WORDS * 4,
        "pinned blocks stay bounded: {stats:?}"
    );
    on.synchronize().expect("synchronize");
    pool.trim();
    drop(device);
    println!("{UPLOADS} pooled pinned uploads: {made} events created, {stats:?}");
}
