//! A fifth look at programs written the way RMM users stack memory resources and PyTorch users
//! read `torch.cuda.memory_snapshot()` / `memory_stats()`, aimed at the newest code:
//!
//! - a `LoggingAdaptor`'s CSV replayed in file order, when the thread that frees a block is
//!   preempted between the upstream's free and its log line and another thread is handed the
//!   same address meanwhile (RMM logs a free before it reaches the upstream);
//! - `tracking(logging(caching(driver)))` used from four threads, raw allocations freed on
//!   another stream than the allocating one, typed buffers beside them: bytes round-trip, and
//!   the books, the log and the cache all balance to nothing;
//! - a cross-stream free refused during a capture through that stack: typed, logged as a
//!   failure, the same booking kept, and the free after the capture goes through;
//! - a tracked stream-ordered pool whose buffer is split in two views written on two other
//!   streams (one held behind a gate) and dropped: the next allocation on its stream waits;
//! - `chunks_mut` views of a cached buffer written on three streams, dropped while one is held:
//!   the snapshot shows the block pending, and a new buffer never lands on it;
//! - the snapshot against `stats()` after mixed traffic on three streams with `record_stream`
//!   frees pending, and again after `empty_cache`;
//! - `empty_cache` with live blocks in split segments: only those segments remain;
//! - the out-of-memory retry under a budget, with a tracking adaptor under the cache: the books
//!   and the snapshot name the same segments at each step, a refused request changes neither;
//! - a snapshot taken while a capture is open, showing the capture's private pool;
//! - PyTorch's `del tmp` inside `torch.cuda.graph` with the `cudaMallocAsync` backend, through a
//!   tracking adaptor, the scratch split between the capturing stream and a forked one.
//!
//! Every GPU test takes the serial guard: some hold a stream behind a gate, others open
//! captures or synchronise the device (`cuMemFree`), which must not meet.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::memory::{self, DevicePtr};
use cuweave_driver::{Context, Event, EventFlags, InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::caching::{
    BlockStatus, CachingAllocator, CachingResource, GraphPool, MemorySnapshot, MissPolicy,
    begin_allocate_to_pool,
};
use cuweave_memory::resource::{
    AsyncPoolResource, DriverResource, LOG_HEADER, LimitAdaptor, LoggingAdaptor, MemoryResource,
    TrackingAdaptor,
};
use cuweave_memory::{Buffer, DeviceBuffer, MemoryError};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

#[path = "common/tracked.rs"]
mod tracked;
use tracked::{fill_kernel, tracked_fill};

const MIB: usize = 1 << 20;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

#[path = "common/shared_log.rs"]
mod shared_log;
use shared_log::SharedLog;

/// One parsed line of a `LoggingAdaptor`'s CSV.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Row {
    thread: u64,
    micros: u128,
    action: String,
    ptr: u64,
    bytes: usize,
    stream: u64,
}

/// Parses a log the way a replay tool does: the header, then one row of six columns a line.
fn parse_log(text: &str) -> Vec<Row> {
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(LOG_HEADER), "{text}");
    lines
        .map(|line| {
            let columns: Vec<&str> = line.split(',').collect();
            assert_eq!(columns.len(), 6, "six columns: {line}");
            Row {
                thread: columns[0].parse().expect("thread"),
                micros: columns[1].parse().expect("time"),
                action: columns[2].to_owned(),
                ptr: u64::from_str_radix(columns[3].trim_start_matches("0x"), 16).expect("ptr"),
                bytes: columns[4].parse().expect("size"),
                stream: columns[5].parse().expect("stream"),
            }
        })
        .collect()
}

/// Replays `rows` in file order as RMM's replay tool does: every `allocate` must name an address
/// not live at that point of the log, every `free` one that is live with that size, unless the
/// same thread's next line of that address is `free failure`, which undoes the `free` (the
/// adaptor logs a free before the upstream runs it). The first line that breaks this, if any.
fn replay(rows: &[Row]) -> Result<usize, String> {
    let mut live: HashMap<u64, usize> = HashMap::new();
    // Frees not yet confirmed: what each undid (None: it matched nothing live), by thread and
    // address, with the line it was on.
    let mut open: HashMap<(u64, u64), (Option<usize>, usize)> = HashMap::new();
    for (index, row) in rows.iter().enumerate() {
        let line = index + 2;
        let key = (row.thread, row.ptr);
        match row.action.as_str() {
            "allocate" => {
                if let Some(bytes) = live.insert(row.ptr, row.bytes) {
                    return Err(format!(
                        "line {line}: {:#x} allocated again while the log has it live ({bytes} bytes): {row:?}",
                        row.ptr
                    ));
                }
            }
            "free" => {
                let undone = match live.get(&row.ptr) {
                    Some(&bytes) if bytes == row.bytes => live.remove(&row.ptr),
                    _ => None,
                };
                open.insert(key, (undone, line));
            }
            "free failure" => match open.remove(&key) {
                Some((Some(bytes), _)) => {
                    live.insert(row.ptr, bytes);
                }
                Some((None, _)) => {}
                None => {
                    return Err(format!(
                        "line {line}: a free failure with no free of {:#x} before it: {row:?}",
                        row.ptr
                    ));
                }
            },
            _ => {}
        }
        // A free stays open only until the same thread logs something else.
        let settled: Vec<(u64, u64)> = open
            .iter()
            .filter(|&(&(thread, _), &(_, at))| thread == row.thread && at != line)
            .map(|(&key, _)| key)
            .collect();
        for key in settled {
            if let Some((None, at)) = open.remove(&key) {
                return Err(format!(
                    "line {at}: free of {:#x} that the log does not have live with that size",
                    key.1
                ));
            }
        }
    }
    if let Some((&(_, ptr), &(None, at))) = open.iter().find(|(_, (undone, _))| undone.is_none()) {
        return Err(format!(
            "line {at}: free of {ptr:#x} that the log does not have live with that size"
        ));
    }
    Ok(live.len())
}

/// An upstream that, once armed, holds the thread that freed a block right after the free
/// returned, until the test lets it go: the window in which the OS may deschedule a thread
/// between its upstream's free and the next line of its caller.
struct PauseAfterFree<R> {
    inner: R,
    name: String,
    armed: AtomicBool,
    barrier: Barrier,
}

impl<R: MemoryResource> PauseAfterFree<R> {
    fn new(inner: R) -> Self {
        let name = format!("pause({})", inner.name());
        Self {
            inner,
            name,
            armed: AtomicBool::new(false),
            barrier: Barrier::new(2),
        }
    }
}

// SAFETY: every call forwards to `inner`, which upholds the contract; the pause only delays the
// return of a free that has already happened.
#[allow(unsafe_code)]
unsafe impl<R: MemoryResource> MemoryResource for PauseAfterFree<R> {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cuweave_memory::Result<DevicePtr> {
        self.inner.allocate(bytes, stream)
    }

    fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> cuweave_memory::Result<()> {
        let freed = self.inner.deallocate(ptr, bytes, stream);
        if self.armed.swap(false, Ordering::SeqCst) {
            self.barrier.wait(); // the free has happened
            self.barrier.wait(); // the test let this thread go on
        }
        freed
    }

    fn allocate_owned(&self, bytes: usize, stream: &Stream) -> cuweave_memory::Result<DevicePtr> {
        self.inner.allocate_owned(bytes, stream)
    }

    fn deallocate_owned(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> cuweave_memory::Result<()> {
        self.inner.deallocate_owned(ptr, bytes, stream)
    }

    fn context(&self) -> &Arc<Context> {
        self.inner.context()
    }

    fn name(&self) -> &str {
        &self.name
    }
}

/// Checks everything a snapshot must agree on with itself and with `stats()` taken beside it
/// (nothing else runs on the allocator meanwhile), and returns it: segments in address order and
/// disjoint, blocks contiguous and summing to their segment, reserved bytes and segments,
/// allocated, requested and active bytes equal to the statistics.
fn consistent_snapshot(allocator: &CachingAllocator) -> MemorySnapshot {
    let snapshot = allocator.snapshot();
    let stats = allocator.stats();
    for pair in snapshot.segments.windows(2) {
        assert!(
            pair[0].address + pair[0].total_size as u64 <= pair[1].address,
            "segments in address order and disjoint: {snapshot}"
        );
    }
    let mut requested = 0;
    for segment in &snapshot.segments {
        assert_eq!(
            segment.blocks.first().map(|block| block.address),
            Some(segment.address),
            "{snapshot}"
        );
        let mut next = segment.address;
        for block in &segment.blocks {
            assert_eq!(block.address, next, "blocks are contiguous: {snapshot}");
            assert_eq!(block.size % 512, 0, "{snapshot}");
            next += block.size as u64;
            if block.status == BlockStatus::Allocated {
                assert!(
                    block.requested_size > 0 && block.requested_size <= block.size,
                    "{block:?}"
                );
            } else {
                assert_eq!(block.requested_size, 0, "{block:?}");
            }
            requested += block.requested_size;
        }
        assert_eq!(
            next,
            segment.address + segment.total_size as u64,
            "blocks sum to their segment: {snapshot}"
        );
    }
    assert_eq!(
        (snapshot.reserved_bytes(), snapshot.segments.len()),
        (stats.reserved_bytes.current, stats.segments.current),
        "reserved bytes and segments: {snapshot}{stats:?}"
    );
    assert_eq!(
        snapshot.bytes(BlockStatus::Allocated),
        stats.allocated_bytes.current,
        "allocated bytes: {snapshot}{stats:?}"
    );
    assert_eq!(
        requested, stats.requested_bytes.current,
        "requested bytes: {snapshot}{stats:?}"
    );
    assert_eq!(
        snapshot.bytes(BlockStatus::Allocated) + snapshot.bytes(BlockStatus::PendingFree),
        stats.active_bytes.current,
        "active bytes are allocated plus pending free: {snapshot}{stats:?}"
    );
    assert!(
        snapshot
            .to_string()
            .starts_with(&format!("{} segments, ", snapshot.segments.len())),
        "{snapshot}"
    );
    snapshot
}

/// The status and size of the block at `ptr`, with its segment's index, if a block starts there.
fn block_at(snapshot: &MemorySnapshot, ptr: u64) -> Option<(usize, BlockStatus, usize, usize)> {
    snapshot
        .segments
        .iter()
        .enumerate()
        .find_map(|(index, segment)| {
            segment
                .blocks
                .iter()
                .find(|block| block.address == ptr)
                .map(|block| (index, block.status, block.size, block.requested_size))
        })
}

/// RMM's allocation log replayed offline (RMM's `replay` benchmark reads it in file order): two
/// threads share one stream over a caching resource; the first frees a block and is descheduled
/// right after its upstream's free returned (modelled by an upstream that holds it there), the
/// second is handed the same address meanwhile and logs its allocation. The log must still
/// replay: the free line comes before the allocation that reuses the address, as RMM's adaptor
/// guarantees by logging a free before it reaches the upstream.
#[test]
fn a_logged_free_precedes_the_reuse_of_its_address_in_the_log() {
    let _serial = serial();
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    let log = SharedLog::default();
    let cache = CachingResource::new(CachingAllocator::with_driver(&gpu.context));
    let logged = LoggingAdaptor::new(PauseAfterFree::new(cache), log.clone()).unwrap();
    assert_eq!(logged.name(), "logging(pause(caching(driver)))");

    let first = logged.allocate(4096, &s).unwrap();
    logged.upstream().armed.store(true, Ordering::SeqCst);
    let second = std::thread::scope(|scope| {
        let freeing = scope.spawn(|| logged.deallocate(first, 4096, &s));
        // The block is back in the cache; its thread has not written its line yet.
        logged.upstream().barrier.wait();
        s.synchronize().unwrap();
        let second = logged.allocate(4096, &s).unwrap();
        logged.upstream().barrier.wait();
        freeing.join().unwrap().unwrap();
        second
    });
    assert_eq!(
        second, first,
        "the cache hands the freed block (its segment's only one) to the next request"
    );
    logged.deallocate(second, 4096, &s).unwrap();
    logged.flush().unwrap();

    let rows = parse_log(&log.text());
    let actions: Vec<&str> = rows.iter().map(|row| row.action.as_str()).collect();
    assert_eq!(actions.len(), 4, "{rows:?}");
    assert!(
        rows.iter().all(|row| row.ptr == first && row.bytes == 4096),
        "{rows:?}"
    );
    assert_eq!(
        replay(&rows),
        Ok(0),
        "the log replays in file order and ends with nothing live"
    );
    assert_eq!(
        actions,
        ["allocate", "free", "allocate", "free"],
        "{rows:?}"
    );
}

/// RMM's usual production stack, `tracking(logging(caching(driver)))`, shared by four worker
/// threads, each with its own stream: raw allocations of small and large sizes uploaded and
/// read back byte for byte, half of them freed on a shared cleanup stream ordered after the
/// allocating one by an event (RMM's free on another stream), with typed buffers made over the
/// same stack in between. At the end the tracking books, the caching resource's live map and the
/// cache's allocated bytes are empty, and the log, replayed in file order, balances exactly.
#[test]
fn a_stacked_tracking_logging_cache_balances_across_threads_and_free_streams() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 120;
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let allocator = CachingAllocator::with_driver(context);
    let log = SharedLog::default();
    let stack = Arc::new(TrackingAdaptor::new(
        LoggingAdaptor::new(CachingResource::new(allocator.clone()), log.clone()).unwrap(),
    ));
    assert_eq!(stack.name(), "tracking(logging(caching(driver)))");
    let resource: Arc<dyn MemoryResource> = Arc::clone(&stack) as _;
    let cleanup = stream(context);

    let worker_streams: Vec<u64> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (resource, cleanup) = (Arc::clone(&resource), &cleanup);
                scope.spawn(move || {
                    let s = stream(context);
                    let done = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
                    for round in 0..ROUNDS {
                        let bytes = [4096, 100_000 + 4 * t, 3 * MIB / 2 + 512][round % 3];
                        let words = bytes / 4;
                        let pattern: Vec<u32> = (0..words as u32)
                            .map(|i| i ^ ((t as u32) << 28) ^ ((round as u32) << 16))
                            .collect();
                        let mut back = vec![0u32; words];
                        let ptr = resource.allocate(bytes, &s).unwrap();
                        // SAFETY: `ptr` is `bytes` of live device memory until its free below,
                        // queued after these copies in stream order (the same stream, or a
                        // cleanup stream that waits for it); the host vectors outlive the
                        // synchronisation that ends the copies.
                        unsafe {
                            memory::copy_htod_async(ptr, pattern.as_ptr().cast(), bytes, &s)
                                .unwrap();
                            memory::copy_dtoh_async(back.as_mut_ptr().cast(), ptr, bytes, &s)
                                .unwrap();
                        }
                        s.synchronize().unwrap();
                        assert!(
                            back == pattern,
                            "thread {t} round {round}: bytes round-trip"
                        );
                        if round % 2 == 0 {
                            done.record(&s).unwrap();
                            cleanup.wait_event(&done).unwrap();
                            resource.deallocate(ptr, bytes, cleanup).unwrap();
                        } else {
                            resource.deallocate(ptr, bytes, &s).unwrap();
                        }
                        if round % 10 == 0 {
                            let mut typed =
                                DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), 1000, &s)
                                    .unwrap();
                            typed.fill(t as u32 + 1).unwrap();
                            assert_eq!(typed.to_vec().unwrap(), vec![t as u32 + 1; 1000]);
                        }
                    }
                    s.synchronize().unwrap();
                    s.id()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    cleanup.synchronize().unwrap();

    assert_eq!(stack.outstanding_count(), 0, "{}", stack.report());
    assert_eq!(stack.outstanding_bytes(), 0);
    assert!(
        stack
            .report()
            .starts_with("tracking(logging(caching(driver))): 0 allocations outstanding, 0 bytes"),
        "{}",
        stack.report()
    );
    assert_eq!(stack.upstream().upstream().live_allocations(), 0);
    let stats = allocator.stats();
    assert_eq!(
        (stats.allocated_bytes.current, stats.requested_bytes.current),
        (0, 0),
        "{stats:?}"
    );
    assert_eq!(
        consistent_snapshot(&allocator).bytes(BlockStatus::Allocated),
        0
    );

    stack.upstream().flush().unwrap();
    assert_eq!(stack.upstream().write_errors(), 0);
    let rows = parse_log(&log.text());
    let per_thread = ROUNDS + ROUNDS / 10;
    let count = |action: &str| rows.iter().filter(|row| row.action == action).count();
    assert_eq!(
        (count("allocate"), count("free")),
        (THREADS * per_thread, THREADS * per_thread),
        "one line per allocation and free, no failures"
    );
    assert_eq!(replay(&rows), Ok(0), "the log balances to nothing live");
    let freed_on_cleanup = rows
        .iter()
        .filter(|row| row.action == "free" && row.stream == cleanup.id())
        .count();
    assert_eq!(
        freed_on_cleanup,
        THREADS * ROUNDS / 2,
        "frees name their stream"
    );
    assert!(
        rows.iter()
            .filter(|row| row.action == "allocate")
            .all(|row| worker_streams.contains(&row.stream)),
        "allocations name the worker's stream"
    );
    let threads: std::collections::HashSet<u64> = rows.iter().map(|row| row.thread).collect();
    assert_eq!(threads.len(), THREADS, "one thread number per worker");
    for thread in threads {
        let times: Vec<u128> = rows
            .iter()
            .filter(|row| row.thread == thread)
            .map(|row| row.micros)
            .collect();
        assert!(
            times.windows(2).all(|pair| pair[0] <= pair[1]),
            "each thread's lines are in its own time order"
        );
    }
}

/// RMM's stream-ordered pool under a tracking adaptor, with a buffer split in two views written
/// by kernels on two other streams (the head held behind a gate), then dropped on the host while
/// the head's write waits: the buffer is freed on its allocating stream after both writes, so a
/// new buffer the pool gives out on that stream is written only after the held write, and keeps
/// its bytes. The books hold the new buffer alone; once everything is dropped, the pool has
/// nothing in use.
#[test]
fn a_tracked_pool_buffer_split_across_streams_is_not_reused_under_its_held_half() {
    const LEN: usize = 1 << 18; // 1 MiB of u32
    const HALF: usize = LEN / 2;
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let pool = match AsyncPoolResource::new(context) {
        Ok(pool) => Arc::new(pool),
        Err(error) => {
            cuweave_test_support::skip("split views over a pool", &format!("{error}"));
            return;
        }
    };
    let tracked = Arc::new(TrackingAdaptor::new(Arc::clone(&pool)));
    let resource: Arc<dyn MemoryResource> = Arc::clone(&tracked) as _;
    let kernels = TestKernels::load(context).unwrap();
    let fill = fill_kernel(&kernels);
    let (home, held, free) = (stream(context), stream(context), stream(context));

    let mut buffer = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), LEN, &home).unwrap();
    buffer.fill_async(0, &home).unwrap();
    let old = buffer.device_ptr();
    let gate = Gate::new(context);
    gate.hold(&kernels, &held);
    {
        let (mut head, mut tail) = buffer.split_at_mut(HALF).unwrap();
        tracked_fill(&fill, &held, &mut head, 0xdead_0001);
        tracked_fill(&fill, &free, &mut tail, 0xdead_0002);
    }
    drop(buffer);
    assert_eq!(
        tracked.outstanding_count(),
        0,
        "the free was queued at the drop"
    );

    let mut fresh = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), LEN, &home).unwrap();
    fresh.fill_async(7, &home).unwrap();
    let outstanding = tracked.outstanding();
    assert_eq!(
        outstanding
            .iter()
            .map(|a| (a.ptr, a.bytes, a.owned, a.stream))
            .collect::<Vec<_>>(),
        [(fresh.device_ptr(), LEN * 4, true, home.id())]
    );
    free.synchronize().unwrap();
    assert!(
        !home.query().unwrap(),
        "the free (and the new buffer's fill after it) waits for the held half's write"
    );
    gate.open();
    held.synchronize().unwrap();
    home.synchronize().unwrap();
    let back = fresh.to_vec().unwrap();
    let clobbered = back.iter().filter(|&&x| x != 7).count();
    assert_eq!(
        clobbered,
        0,
        "the new buffer (at {:#x}, old at {old:#x}) kept its fill",
        fresh.device_ptr()
    );
    drop(fresh);
    home.synchronize().unwrap();
    assert_eq!(tracked.outstanding_count(), 0, "{}", tracked.report());
    assert_eq!(pool.outstanding(), 0);
    assert_eq!(
        pool.pool().used_bytes().unwrap(),
        0,
        "nothing in use in the pool"
    );
}

/// PyTorch's per-stream workers writing the chunks of one cached buffer (`chunks_mut`, each
/// chunk on its own stream, the first held behind a gate), then dropping it: the snapshot shows
/// its block pending free (active, not allocated) while the held write waits, a new buffer of
/// the same size on the allocating stream gets another block and keeps its bytes after the
/// held write lands, and once the gate is open the block comes back as free.
#[test]
fn chunked_views_on_three_streams_keep_their_block_pending_in_the_snapshot() {
    const LEN: usize = 3 * 100_000;
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let fill = fill_kernel(&kernels);
    let allocator = CachingAllocator::with_driver(context);
    let home = stream(context);
    let streams: Vec<Stream> = (0..3).map(|_| stream(context)).collect();

    let mut buffer = allocator.buffer::<u32>(LEN, &home).unwrap();
    buffer.fill(0).unwrap();
    let old = buffer.device_ptr();
    let gate = Gate::new(context);
    gate.hold(&kernels, &streams[0]);
    {
        let mut chunks = buffer.chunks_mut(LEN / 3).unwrap();
        assert_eq!(chunks.len(), 3);
        for (i, chunk) in chunks.iter_mut().enumerate() {
            tracked_fill(&fill, &streams[i], chunk, 0xbad0_0000 + i as u32);
        }
    }
    drop(buffer);
    streams[1].synchronize().unwrap();
    streams[2].synchronize().unwrap();

    let snapshot = consistent_snapshot(&allocator);
    let (_, status, size, _) = block_at(&snapshot, old).expect("the old block is in the snapshot");
    assert_eq!(
        status,
        BlockStatus::PendingFree,
        "its first chunk's write still waits at the gate: {snapshot}"
    );
    assert!(size >= LEN * 4);
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
    assert_eq!(allocator.stats().active_bytes.current, size);

    let mut fresh = allocator.buffer::<u32>(LEN, &home).unwrap();
    assert_ne!(
        fresh.device_ptr(),
        old,
        "not handed out under the held write"
    );
    fresh.fill_async(9, &home).unwrap();
    home.synchronize().unwrap();
    let snapshot = consistent_snapshot(&allocator);
    assert_eq!(
        block_at(&snapshot, old).map(|b| b.1),
        Some(BlockStatus::PendingFree)
    );
    let (_, fresh_status, fresh_size, fresh_requested) =
        block_at(&snapshot, fresh.device_ptr()).expect("the new block is in the snapshot");
    assert_eq!(
        (fresh_status, fresh_requested),
        (BlockStatus::Allocated, LEN * 4)
    );
    gate.open();
    streams[0].synchronize().unwrap();
    assert_eq!(
        fresh.to_vec().unwrap(),
        vec![9; LEN],
        "the held write missed it"
    );

    // The next miss on the home stream polls the pending block back to the free lists.
    drop(allocator.allocate(512, &home).unwrap());
    let snapshot = consistent_snapshot(&allocator);
    assert_eq!(snapshot.bytes(BlockStatus::PendingFree), 0, "{snapshot}");
    assert_eq!(allocator.pending_frees(), 0);
    assert_eq!(snapshot.bytes(BlockStatus::Allocated), fresh_size);
    assert_eq!(
        block_at(&snapshot, old).map(|b| b.1),
        Some(BlockStatus::Free),
        "the old block is free again: {snapshot}"
    );
}

/// `torch.cuda.memory_snapshot()` beside `torch.cuda.memory_stats()` after mixed traffic: three
/// streams allocate sixty blocks of six sizes across both pools; some are kept, some freed at
/// once, and every fifth is `record_stream`ed on a stream held behind a gate and freed, so it
/// stays pending. The snapshot agrees with the statistics byte for byte, each kept block is
/// allocated in a segment of its stream with its requested size, the pending ones are exactly
/// those freed under the gate; after the gate opens and the cache is emptied, nothing is left.
#[test]
fn the_snapshot_agrees_with_stats_after_mixed_traffic_and_after_empty_cache() {
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let allocator = CachingAllocator::with_driver(context);
    let streams: Vec<Arc<Stream>> = (0..3).map(|_| Arc::new(stream(context))).collect();
    let watcher = Arc::new(stream(context));
    let sizes = [
        700,
        4096,
        512 * 1024 + 3,
        MIB + 1,
        3 * MIB + 7,
        12 * MIB + 5,
    ];

    let gate = Gate::new(context);
    gate.hold(&kernels, &watcher);
    let mut kept = Vec::new();
    let mut pending = 0;
    for i in 0..60 {
        let s = &streams[i % 3];
        let bytes = sizes[i % sizes.len()];
        let mut allocation = allocator.allocate(bytes, s).unwrap();
        if i % 5 == 0 {
            allocation.record_stream(&watcher).unwrap();
            drop(allocation);
            pending += 1;
        } else if i % 3 == 0 {
            drop(allocation);
        } else {
            kept.push((allocation, bytes));
        }
    }
    let snapshot = consistent_snapshot(&allocator);
    assert_eq!(allocator.pending_frees(), pending);
    let pending_blocks = snapshot
        .segments
        .iter()
        .flat_map(|segment| &segment.blocks)
        .filter(|block| block.status == BlockStatus::PendingFree)
        .count();
    assert_eq!(pending_blocks, pending, "{snapshot}");
    for (allocation, bytes) in &kept {
        let (segment, status, size, requested) =
            block_at(&snapshot, allocation.ptr()).expect("every kept block is in the snapshot");
        assert_eq!(
            (status, size, requested),
            (BlockStatus::Allocated, allocation.block_size(), *bytes)
        );
        assert_eq!(snapshot.segments[segment].stream, allocation.stream());
        assert_eq!(snapshot.segments[segment].graph_pool, None);
    }
    assert_eq!(
        snapshot.bytes(BlockStatus::Allocated),
        kept.iter().map(|(a, _)| a.block_size()).sum::<usize>()
    );
    assert!(snapshot.largest_free_block() <= snapshot.bytes(BlockStatus::Free));

    gate.open();
    watcher.synchronize().unwrap();
    drop(kept);
    for s in &streams {
        s.synchronize().unwrap();
    }
    let reserved = allocator.stats().reserved_bytes.current;
    let released = allocator.empty_cache().unwrap();
    assert_eq!(
        released, reserved,
        "every segment was free after the gate opened"
    );
    let snapshot = consistent_snapshot(&allocator);
    assert!(snapshot.segments.is_empty(), "{snapshot}");
    assert_eq!(allocator.pending_frees(), 0);
    assert_eq!(
        (snapshot.largest_free_block(), snapshot.split_segments()),
        (0, 0)
    );
}

/// `torch.cuda.empty_cache()` with tensors still alive: only the segments holding a live block
/// stay (split: the live block and its free remainder), every wholly free one goes back, the
/// bytes `empty_cache` reports are the difference in reserved bytes, and `segments_released`
/// counts exactly the segments that left the snapshot.
#[test]
fn empty_cache_with_live_blocks_leaves_exactly_their_split_segments() {
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let allocator = CachingAllocator::with_driver(context);
    let (a, b) = (stream(context), stream(context));
    let small = allocator.allocate(300 * 1024, &a).unwrap();
    let large = allocator.allocate(3 * MIB, &b).unwrap();
    for (bytes, s) in [
        (5 * MIB, &a),
        (64 * 1024, &b),
        (30 * MIB, &a),
        (700, &b),
        (MIB + 1, &b),
    ] {
        drop(allocator.allocate(bytes, s).unwrap());
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    let before_stats = allocator.stats();
    let before = consistent_snapshot(&allocator);
    assert!(before.segments.len() >= 4, "{before}");

    let released = allocator.empty_cache().unwrap();
    let after = consistent_snapshot(&allocator);
    let after_stats = allocator.stats();
    assert_eq!(
        after.segments.len(),
        2,
        "the two live blocks' segments: {after}"
    );
    assert_eq!(released, before.reserved_bytes() - after.reserved_bytes());
    assert_eq!(
        after_stats.segments_released - before_stats.segments_released,
        (before.segments.len() - 2) as u64
    );
    assert_eq!(after.split_segments(), 2, "{after}");
    for live in [&small, &large] {
        let (segment, status, size, requested) =
            block_at(&after, live.ptr()).expect("live block kept");
        assert_eq!(
            (status, size, requested),
            (BlockStatus::Allocated, live.block_size(), live.size())
        );
        let segment = &after.segments[segment];
        assert_eq!(segment.stream, live.stream());
        assert_eq!(
            segment.bytes(BlockStatus::Free),
            segment.total_size - live.block_size(),
            "the rest of its segment is one free remainder: {after}"
        );
    }
    let large_segment = &after.segments[block_at(&after, large.ptr()).unwrap().0];
    assert_eq!(
        after.largest_free_block(),
        large_segment.total_size - large.block_size()
    );
    drop((small, large));
    allocator.empty_cache().unwrap();
    assert!(consistent_snapshot(&allocator).segments.is_empty());
}

/// `PYTORCH_CUDA_ALLOC_CONF`-style budget with RMM's tracking adaptor under the cache: a 40 MiB
/// tensor on a second stream only fits once the first stream's cached 40 MiB is given back (the
/// out-of-memory retry); a third is refused with the typed error naming the budget and changes
/// neither the snapshot nor the books; after the holder frees, the refused request goes through.
/// At each step the tracked segments are exactly the snapshot's segments.
#[test]
fn the_oom_retry_under_a_budget_keeps_the_books_and_the_snapshot_in_step() {
    const CAP: usize = 64 * MIB;
    const BIG: usize = 40 * MIB;
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let tracked = Arc::new(TrackingAdaptor::new(LimitAdaptor::new(
        DriverResource::new(context),
        CAP,
    )));
    let allocator = CachingAllocator::new(Arc::clone(&tracked) as Arc<dyn MemoryResource>);
    let (a, b) = (stream(context), stream(context));
    let books_match = |snapshot: &MemorySnapshot| {
        let mut booked: Vec<(u64, usize, bool)> = tracked
            .outstanding()
            .iter()
            .map(|o| (o.ptr, o.bytes, o.owned))
            .collect();
        booked.sort_unstable();
        let segments: Vec<(u64, usize, bool)> = snapshot
            .segments
            .iter()
            .map(|segment| (segment.address, segment.total_size, true))
            .collect();
        assert_eq!(booked, segments, "{}{snapshot}", tracked.report());
    };

    drop(allocator.allocate(BIG, &a).unwrap());
    a.synchronize().unwrap();
    books_match(&consistent_snapshot(&allocator));
    assert_eq!(allocator.stats().reserved_bytes.current, BIG);

    let held = allocator.allocate(BIG, &b).unwrap();
    let stats = allocator.stats();
    assert_eq!(
        (stats.oom_retries, stats.segments_released, stats.ooms),
        (1, 1, 0),
        "{stats:?}"
    );
    let snapshot = consistent_snapshot(&allocator);
    books_match(&snapshot);
    assert_eq!(snapshot.segments.len(), 1, "{snapshot}");
    assert_eq!(snapshot.segments[0].stream, held.stream());

    let refused = allocator.allocate(BIG, &a).unwrap_err();
    assert_eq!(
        refused,
        MemoryError::OutOfMemory {
            requested: BIG,
            allocated: BIG,
            reserved: BIG,
            limit: Some(CAP),
        }
    );
    assert!(refused.is_out_of_memory());
    assert_eq!(allocator.stats().ooms, 1);
    let after_refusal = consistent_snapshot(&allocator);
    assert_eq!(
        after_refusal, snapshot,
        "a refused request changes no block"
    );
    books_match(&after_refusal);
    assert_eq!(tracked.upstream().used(), BIG);

    drop(held);
    b.synchronize().unwrap();
    let again = allocator.allocate(BIG, &a).unwrap();
    let snapshot = consistent_snapshot(&allocator);
    books_match(&snapshot);
    assert_eq!(
        (snapshot.segments.len(), snapshot.segments[0].stream),
        (1, again.stream())
    );
    assert_eq!(allocator.stats().segments_released, 2);
    drop(again);
    a.synchronize().unwrap();
    allocator.empty_cache().unwrap();
    assert_eq!(tracked.outstanding_count(), 0, "{}", tracked.report());
    assert_eq!(tracked.upstream().used(), 0);
}

/// `torch.cuda.memory_snapshot()` taken in the middle of `torch.cuda.graph(...)`: the capture's
/// scratch sits in segments of its private pool (named by the pool's id), the eager tensor made
/// before in a general segment, and the snapshot agrees with the statistics with the capture
/// open, after its scratch is freed inside it, and after a replay. Once the graph is gone,
/// `empty_cache` returns the pool's segments and only the eager tensor's segment is left.
#[test]
fn a_snapshot_taken_during_a_capture_shows_its_private_pool() {
    const LARGE: usize = 1 << 20; // u32s: 4 MiB, the large pool
    const SMALL: usize = 1 << 14; // u32s: 64 KiB, the small pool
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let allocator = CachingAllocator::with_driver(context);
    let s = stream(context);
    let mut eager = allocator.buffer::<u32>(SMALL, &s).unwrap();
    eager.fill(0).unwrap();

    let pool = GraphPool::new();
    s.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let routed = begin_allocate_to_pool(&s, &pool, MissPolicy::default()).unwrap();
    let mut large = allocator.buffer::<u32>(LARGE, &s).unwrap();
    let mut small = allocator.buffer::<u32>(SMALL, &s).unwrap();
    large.fill_async(3, &s).unwrap();
    small.fill_async(4, &s).unwrap();
    eager.copy_from_async(&small, &s).unwrap();

    let during = consistent_snapshot(&allocator);
    for (ptr, len) in [(large.device_ptr(), LARGE), (small.device_ptr(), SMALL)] {
        let (segment, status, _, requested) =
            block_at(&during, ptr).expect("the capture's scratch is in the snapshot");
        assert_eq!((status, requested), (BlockStatus::Allocated, len * 4));
        assert_eq!(
            during.segments[segment].graph_pool,
            Some(pool.id()),
            "scratch comes from the capture's pool: {during}"
        );
    }
    let (segment, status, _, _) = block_at(&during, eager.device_ptr()).unwrap();
    assert_eq!(status, BlockStatus::Allocated);
    assert_eq!(during.segments[segment].graph_pool, None, "{during}");
    drop((large, small));
    let freed_inside = consistent_snapshot(&allocator);
    assert_eq!(
        freed_inside.reserved_bytes(),
        during.reserved_bytes(),
        "the pool keeps its segments for the graph"
    );
    let mut graph = s.end_capture().unwrap();
    drop(routed);
    graph.keep_alive(pool.keep_alive());
    drop(pool);
    consistent_snapshot(&allocator);

    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    eager.fill(0).unwrap();
    exec.launch(&s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(eager.to_vec().unwrap(), vec![4; SMALL], "the replay ran");
    consistent_snapshot(&allocator);

    drop(exec);
    drop(graph);
    s.synchronize().unwrap();
    allocator.empty_cache().unwrap();
    let after = consistent_snapshot(&allocator);
    assert!(
        after
            .segments
            .iter()
            .all(|segment| segment.graph_pool.is_none()),
        "a dead graph's pool segments go back at empty_cache: {after}"
    );
    assert_eq!(
        after.segments.len(),
        1,
        "the eager tensor's segment: {after}"
    );
}

/// PyTorch's `tmp = torch.empty(...); ...; del tmp` inside `torch.cuda.graph` with the
/// `cudaMallocAsync` backend, through RMM's tracking adaptor over the stream-ordered pool: the
/// scratch is a graph allocation, split in two views written on the capturing stream and on a
/// forked stream, read into an eager output, and dropped before the capture ends, so the graph
/// frees it itself (after the home stream joins the fork). The books are empty once the capture
/// ends, the graph replays 50 times with exact output, and the pool has nothing in use after.
#[test]
fn scratch_dropped_inside_its_capture_through_a_tracking_adaptor_replays_and_frees() {
    const LEN: usize = 1 << 16;
    const HALF: usize = LEN / 2;
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let pool = match AsyncPoolResource::new(context) {
        Ok(pool) => Arc::new(pool),
        Err(error) => {
            cuweave_test_support::skip("scratch in a capture", &format!("{error}"));
            return;
        }
    };
    let tracked = Arc::new(TrackingAdaptor::new(Arc::clone(&pool)));
    let resource: Arc<dyn MemoryResource> = Arc::clone(&tracked) as _;
    assert!(
        resource.allocates_in_graphs(),
        "the adaptor forwards the pool's graph allocation"
    );
    let kernels = TestKernels::load(context).unwrap();
    let fill = fill_kernel(&kernels);
    let (home, fork) = (stream(context), stream(context));
    let mut out = DeviceBuffer::<u32>::new_on(&home, LEN).unwrap();
    out.fill(0).unwrap();
    let forked = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();

    home.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let mut scratch =
        DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), LEN, &home).unwrap();
    assert_eq!(tracked.outstanding_count(), 1);
    forked.record(&home).unwrap();
    fork.wait_event(&forked).unwrap();
    {
        let (mut head, mut tail) = scratch.split_at_mut(HALF).unwrap();
        tracked_fill(&fill, &home, &mut head, 0x1111);
        tracked_fill(&fill, &fork, &mut tail, 0x2222);
    }
    out.copy_from_async(&scratch, &home).unwrap();
    drop(scratch);
    let graph = home.end_capture().unwrap();
    assert_eq!(
        tracked.outstanding_count(),
        0,
        "the scratch was freed by a free node of its own graph: {}",
        tracked.report()
    );

    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    let expected: Vec<u32> = (0..LEN)
        .map(|i| if i < HALF { 0x1111 } else { 0x2222 })
        .collect();
    for replay in 0..50 {
        out.fill_async(0, &home).unwrap();
        exec.launch(&home).unwrap();
        // A launch is stream work the output's tracker does not see: wait for it.
        home.synchronize().unwrap();
        assert!(
            out.to_vec().unwrap() == expected,
            "replay {replay}: both halves of the scratch reached the output"
        );
    }
    // Fifty launches succeeded: a graph whose allocation was not freed inside it cannot be
    // launched again while that allocation is outstanding.
    assert_eq!(exec.launch_count(), 50);
    assert_eq!(pool.pool().used_bytes().unwrap(), 0);
    drop(exec);
    drop(graph);
    assert_eq!(pool.outstanding(), 0);
    assert_eq!(tracked.outstanding_count(), 0);
}

/// An RMM user freeing on a cleanup stream while another part of the program captures a graph
/// (PyTorch's warm-up-then-capture beside an RMM pool): the caching resource refuses a free on
/// another stream than the allocating one during a capture, and through the stack that refusal
/// is typed, logged as a `free failure`, and leaves the very same booking outstanding (same
/// sequence, size and stream), so the free after the capture goes through and every book ends
/// empty; the log still replays.
#[test]
fn a_cross_stream_free_refused_during_a_capture_keeps_the_booking_and_succeeds_after() {
    let _serial = serial();
    let gpu = require_gpu!();
    let context = &gpu.context;
    let allocator = CachingAllocator::with_driver(context);
    let log = SharedLog::default();
    let stack = TrackingAdaptor::new(
        LoggingAdaptor::new(CachingResource::new(allocator.clone()), log.clone()).unwrap(),
    );
    let (s, cleanup, capturing) = (stream(context), stream(context), stream(context));
    let ptr = stack.allocate(MIB, &s).unwrap();
    // SAFETY: `ptr` is MIB bytes of live device memory until its free, queued on `cleanup`
    // after `cleanup` waits for `s`.
    unsafe { memory::memset_d32_async(ptr, 0x5a5a_5a5a, MIB / 4, &s) }.unwrap();
    let done = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    done.record(&s).unwrap();
    cleanup.wait_event(&done).unwrap();
    let booked = stack.outstanding();
    assert_eq!(booked.len(), 1);

    capturing
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let refused = stack.deallocate(ptr, MIB, &cleanup);
    let graph = capturing.end_capture();
    let refused = refused.expect_err("a cross-stream free during a capture is refused");
    assert!(refused.is_capture_refusal(), "{refused}");
    graph.expect("the refusal left the capture intact");
    let still = stack.outstanding();
    assert_eq!(
        still
            .iter()
            .map(|a| (a.ptr, a.bytes, a.sequence, a.stream))
            .collect::<Vec<_>>(),
        [(ptr, MIB, booked[0].sequence, s.id())],
        "the same booking stays"
    );
    assert_eq!(stack.outstanding_bytes(), MIB);
    assert_eq!(stack.upstream().upstream().live_allocations(), 1);

    stack.deallocate(ptr, MIB, &cleanup).unwrap();
    cleanup.synchronize().unwrap();
    assert_eq!(stack.outstanding_count(), 0, "{}", stack.report());
    assert_eq!(stack.upstream().upstream().live_allocations(), 0);
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
    stack.upstream().flush().unwrap();
    let rows = parse_log(&log.text());
    assert_eq!(
        rows.iter()
            .map(|row| (row.action.as_str(), row.stream))
            .collect::<Vec<_>>(),
        [
            ("allocate", s.id()),
            ("free", cleanup.id()),
            ("free failure", cleanup.id()),
            ("free", cleanup.id())
        ]
    );
    assert_eq!(replay(&rows), Ok(0));
}
